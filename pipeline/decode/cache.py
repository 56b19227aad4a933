"""A causal LM plus its static KV cache, rolled back by moving the write position.

    from pipeline.decode.cache import CachedModel
    cm = CachedModel(model, batch=1, max_len=T + new + 1)
    logits = cm.forward(ids, all_logits=False)   # [B, 1, V]; cm.length += T
    cm.rollback(T - 2)                           # keep the first T-2 positions, copy nothing

The cache is transformers' StaticCache: tensors [B, kv_heads, max_len, head_dim] allocated once and
written in place at the cache's write offset (each layer's `cumulative_length`). Rolling back is
`StaticCache.crop(-n)`, transformers' own call for "the next update overwrites the last n
positions": it moves the offset and touches no tensor. The slots past the offset still hold the
rejected tokens' keys and values; they are never attended, because every forward passes explicit
position_ids and the causal mask (query at position t sees key slots 0..t) excludes them.

What attention reads: a StaticLayer hands the attention its whole [B, H, max_len, D] tensors and
`get_mask_sizes` says kv_length = max_len, so every step's attention reads (and masks) all
max_len slots, not just the filled ones. The roofline (pipeline/roofline.py) counts those bytes.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from pipeline.decode.errors import EngineError


def hf_model(model):
    """The transformers model inside a wrapper (GPTQModel returns one around the HF module)."""
    from transformers import PreTrainedModel

    seen = 0
    while not isinstance(model, PreTrainedModel) and hasattr(model, "model") and seen < 3:
        model, seen = model.model, seen + 1
    return model


def cache_kwarg(model) -> str:
    # transformers >= 5.2x names it `cache`; earlier 4.x/5.x `past_key_values`.
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "cache" not in params and "past_key_values" in params else "cache"


@dataclass
class _Pooled:
    cache: object  # transformers.StaticCache
    offset: int  # the write offset its layers hold (tracked here: reading it back is a device sync)


class CachedModel:
    """A causal LM plus its static KV cache and the number of positions the cache holds."""

    # One cache per (model, slot, batch, device, dtype); reused across generate() calls while large
    # enough, so repeated timing runs do not allocate (the stale contents are masked like any
    # rollback). A reused cache keeps its larger size: attention then reads that many slots.
    _pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, model, batch: int, max_len: int, slot: str = "target"):
        from transformers import StaticCache

        self.model = hf_model(model)
        self.kwarg = cache_kwarg(self.model)
        self.batch = batch
        self.device = next(self.model.parameters()).device
        # `slot` keeps a model drafting for itself (self-draft) from sharing the target's cache.
        key = (slot, batch, self.device, next(self.model.parameters()).dtype)
        pooled = self._pool.get(self.model, {}).get(key)
        if pooled is None or pooled.cache.max_cache_len < max_len:
            size = max(max_len, 64)
            cache = StaticCache(config=self.model.config, max_cache_len=size)
            cache.max_cache_len = size
            if not cache.is_croppable or any(type(layer).__name__ != "StaticLayer" for layer in cache.layers):
                kinds = sorted({type(layer).__name__ for layer in cache.layers})
                raise EngineError(f"{type(self.model).__name__}: cache layers {', '.join(kinds)} cannot be rolled "
                                  "back by position (sliding-window or linear attention)")
            pooled = _Pooled(cache, 0)
            self._pool.setdefault(self.model, {})[key] = pooled
        self._pooled = pooled
        self.cache = pooled.cache
        self.max_len = self.cache.max_cache_len
        self.length = 0
        emb = self.model.get_output_embeddings()
        self.vocab = emb.weight.shape[0] if emb is not None and hasattr(emb, "weight") else self.model.config.vocab_size

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions. Only the engine's count moves here; the cache's own
        offset follows at the next forward (one crop however many rollbacks came between)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def forward(self, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """tokens: [B, T] at positions length..length+T-1 -> logits [B, T or 1, V] (float32)."""
        b, t = tokens.shape
        start = self.length
        if start + t > self.max_len:
            raise EngineError(f"static cache of {self.max_len} positions is full ({start} + {t})")
        pooled = self._pooled
        if pooled.offset < start:  # another CachedModel wrote this pooled cache since: ours is gone
            raise EngineError("a pooled KV cache was used by two CachedModels at once; run them in turn")
        if pooled.offset != start:  # after a rollback (or a reused cache): move the write offset back
            self.cache.crop(start - pooled.offset)  # negative: StaticLayer.crop removes that many
            pooled.offset = start
        positions = torch.arange(start, start + t, device=tokens.device).unsqueeze(0).expand(b, t)  # [B, T]
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self.kwarg: self.cache})
        self.length = pooled.offset = start + t
        return out.logits.float()

"""A causal LM plus its static KV cache, rolled back by moving the write position.

    from pipeline.decode.cache import CachedModel
    cm = CachedModel(model, batch=1, max_len=T + new + 1)
    logits = cm.forward(ids, all_logits=False)   # [B, 1, V]; cm.length += T
    cm.rollback(T - 2)                           # keep the first T-2 positions, copy nothing

The cache is transformers' StaticCache, written in place. A rollback moves every layer's write
offset; the stale slots past it are never attended, but attention reads all max_len slots, so a
timed cell asks for a cache of exactly its length (`exact=True`).

Also here: release_caches / collect, which hand a dropped model's memory back (the caller
deletes its own references first; gc frees hook cycles, empty_cache the CUDA blocks). The
engine's error, EngineError, is in pipeline/decode/errors.py.
"""
from __future__ import annotations

import gc
import inspect
import weakref
from dataclasses import dataclass

import torch

from pipeline.decode.attention import use_gqa_attention
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
    max_len: int  # positions it holds (StaticCache.max_cache_len is a read-only property in 5.17)


class CachedModel:
    """A causal LM plus its static KV cache and the number of positions the cache holds."""

    # One cache per (model, slot, batch, device, dtype), reused while large enough (with `exact`,
    # only at exactly max_len), so repeated timing runs do not allocate.
    _pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, model, batch: int, max_len: int, slot: str = "target", exact: bool = False):
        from transformers import StaticCache

        self.model = hf_model(model)
        self.kwarg = cache_kwarg(self.model)
        self.batch = batch
        self.device = next(self.model.parameters()).device
        # `slot` keeps a model drafting for itself (self-draft) from sharing the target's cache.
        key = (slot, batch, self.device, next(self.model.parameters()).dtype)
        pooled = self._pool.get(self.model, {}).get(key)
        size = max(max_len, 64)
        if pooled is not None and (pooled.max_len < size or exact and pooled.max_len != size):
            self._pool[self.model].pop(key)  # dropped before the new one is allocated: one alive at a time
            pooled = None
            _empty_device_cache(self.device)
        if pooled is None:
            cache = StaticCache(config=self.model.config, max_cache_len=size)
            if any(type(layer).__name__ != "StaticLayer" for layer in cache.layers):
                kinds = sorted({type(layer).__name__ for layer in cache.layers})
                raise EngineError(f"{type(self.model).__name__}: cache layers {', '.join(kinds)} cannot be rolled "
                                  "back by position (sliding-window or linear attention)")
            pooled = _Pooled(cache, 0, size)
            self._pool.setdefault(self.model, {})[key] = pooled
        self._pooled = pooled
        self.cache = pooled.cache
        self.max_len = pooled.max_len
        self.length = 0
        emb = self.model.get_output_embeddings()
        self.vocab = emb.weight.shape[0] if emb is not None and hasattr(emb, "weight") else self.model.config.vocab_size
        # Grouped-query attention that reads each KV head once (pipeline/decode/attention.py); what ran.
        self.attention = use_gqa_attention(self.model)

    @classmethod
    def release(cls, model, slot: str | None = None) -> int:
        """Drop `model`'s pooled caches (one slot's, or all); returns the bytes they held. The
        memory is freed once no CachedModel refers to them (on CUDA, handed back to the driver)."""
        pools = cls._pool.get(hf_model(model), {})
        freed, device = 0, None
        for key in [k for k in pools if slot is None or k[0] == slot]:
            pooled = pools.pop(key)
            device = key[2]
            for layer in pooled.cache.layers:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        freed += t.numel() * t.element_size()
        if device is not None:
            _empty_device_cache(device)
        return freed

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions (the cache's own offset follows at the next forward)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def forward(self, tokens: torch.Tensor, all_logits: bool, prefill: bool = False) -> torch.Tensor:
        """tokens: [B, T] at positions length..length+T-1 -> logits [B, T or 1, V] (float32);
        prefill=True marks a prompt forward (only tests read it)."""
        b, t = tokens.shape
        start = self.length
        if start + t > self.max_len:
            raise EngineError(f"static cache of {self.max_len} positions is full ({start} + {t})")
        pooled = self._pooled
        if pooled.offset < start:  # another CachedModel wrote this pooled cache since: ours is gone
            raise EngineError("a pooled KV cache was used by two CachedModels at once; run them in turn")
        if pooled.offset != start:  # after a rollback (or a reused cache): move the write offset back
            _move_offset(self.cache, start - pooled.offset)
            pooled.offset = start
        positions = torch.arange(start, start + t, device=tokens.device).unsqueeze(0).expand(b, t)  # [B, T]
        logits = self.eager_forward(tokens, positions, all_logits)
        self.length = pooled.offset = start + t
        return logits

    def eager_forward(self, tokens: torch.Tensor, positions: torch.Tensor, all_logits: bool) -> torch.Tensor:
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self.kwarg: self.cache})
        return out.logits.float()

    def prefill(self, tokens: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """tokens: [B, T] from position `length` on, in forwards of at most `chunk` tokens (None:
        one) -> logits of the last position [B, 1, V] (those of one forward up to rounding)."""
        t = tokens.shape[1]
        step = t if not chunk or chunk >= t else chunk
        logits = None
        for i in range(0, t, step):
            logits = self.forward(tokens[:, i:i + step], all_logits=False, prefill=True)
        return logits


def _move_offset(cache, delta: int) -> None:
    """Move every layer's write offset by delta (< 0: the next update overwrites the last -delta
    positions) in one foreach update (StaticLayer.crop's work in one kernel; 5.17 has no crop)."""
    offsets = [layer.cumulative_length for layer in cache.layers]
    torch._foreach_add_(offsets, delta)


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # freed cache blocks back to the driver: the next cell may be larger


def release_caches(*models) -> int:
    """Drop every pooled static cache of these models (None and model-free drafts skipped);
    returns the bytes they held."""
    return sum(CachedModel.release(m) for m in models if m is not None)


def collect(device: torch.device | str | None = None) -> None:
    """gc.collect(), then on CUDA hand the allocator's free blocks back to the driver."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

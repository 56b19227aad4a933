"""The decode engine: plain and speculative decoding on a static KV cache.

    from pipeline.engine import generate, SamplingParams
    res = generate(model, input_ids, max_new_tokens=32)                    # plain (k = 0)
    res = generate(model, input_ids, 32, draft=d, k=4, sampling=SamplingParams(0.7))
    res.tokens, res.rounds, res.prefill_s, res.decode_s

One set of small functions serves both modes, so acceptance (pipeline/acceptance.py) and latency
(pipeline/latency.py) describe the same computation: `prefill`, `decode_one_token`, `draft_k`,
`verify`, `speculative_step`.

The KV cache is transformers' StaticCache: tensors [B, kv_heads, max_len, head_dim] allocated once
and written in place at the cache's current length. Rolling back after a rejection is moving that
length back (`CachedModel.rollback`): nothing is copied and nothing is re-run. The slots beyond the
length still hold the rejected tokens' keys and values; they are never attended, because every
forward passes explicit position_ids and the causal mask (query at position t sees key slots
0..t only, built from the cache's length) excludes them, and the next write overwrites them.

Positions: `CachedModel.length` is one number for the whole batch, because transformers'
StaticLayer writes every row at the same offset. Plain decode runs B equal-length prompts in
lock step; speculative decoding is B = 1. Ragged acceptance for B > 1 would need a cache layer
that writes row b at its own offset and a per-row 4-D mask; the engine's round bookkeeping is
per sequence already (one RoundRecord list per generate call, one position per draft).
"""
from __future__ import annotations

import inspect
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.device import synchronize
from pipeline.sampling import SamplingParams, logits_to_probs, pick, verify_draft
from pipeline.timing import Timer

__all__ = ["SamplingParams", "generate", "GenerationResult", "RoundRecord", "CachedModel", "ModelDraft",
           "Draft", "EngineError", "prefill", "decode_one_token", "draft_k", "verify", "speculative_step"]


class EngineError(Exception):
    """A model or draft the engine cannot run; one line for the user."""


# ---------------------------------------------------------------- records


@dataclass
class RoundRecord:
    drafted: int  # draft tokens proposed this round (< k when the draft had fewer to offer)
    accepted: int  # of those, how many the target kept (leading accepts)
    emitted: int  # tokens appended to the output this round (accepted + 1, less after EOS)
    betas: list[float]  # beta_i = sum_x min(p_i, q_i) for each drafted position i = 1..drafted
    draft_s: float  # seconds drafting (device-synchronized via pipeline.timing.Timer)
    verify_s: float  # seconds in the target's verify forward + the accept/reject rule
    round_s: float  # the whole round, including bookkeeping
    k: int = 0  # draft length requested this round (k, or fewer near max_new_tokens)


@dataclass
class GenerationResult:
    # New token ids: a flat list for one prompt; a list of per-sequence lists when B > 1.
    tokens: list
    rounds: list[RoundRecord] = field(default_factory=list)  # speculative only (empty for k = 0)
    prefill_s: float = 0.0  # prompt forward(s) + first token (target and draft prefill)
    decode_s: float = 0.0  # every token after the first
    batch_tokens: list[list[int]] = field(default_factory=list)  # always per sequence
    stop: str = "length"  # "eos" or "length" (sequence 0)


# ---------------------------------------------------------------- a model with its static cache


def _hf_model(model):
    """The transformers model inside a wrapper (GPTQModel returns one around the HF module)."""
    from transformers import PreTrainedModel

    seen = 0
    while not isinstance(model, PreTrainedModel) and hasattr(model, "model") and seen < 3:
        model, seen = model.model, seen + 1
    return model


def _cache_kwarg(model) -> str:
    # transformers >= 5.2x names it `cache`; earlier 4.x/5.x `past_key_values`.
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "cache" not in params and "past_key_values" in params else "cache"


class CachedModel:
    """A causal LM plus its static KV cache and the number of positions the cache holds."""

    # One cache per (model, batch, dtype); reused across generate() calls while large enough, so
    # repeated timing runs do not allocate (the stale contents are masked like any rollback).
    _pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, model, batch: int, max_len: int, slot: str = "target"):
        from transformers import StaticCache

        self.model = _hf_model(model)
        self.kwarg = _cache_kwarg(self.model)
        self.batch = batch
        self.device = next(self.model.parameters()).device
        # `slot` keeps a model drafting for itself (self-draft) from sharing the target's cache.
        key = (slot, batch, self.device, next(self.model.parameters()).dtype)
        pooled = self._pool.get(self.model, {}).get(key)
        if pooled is not None and pooled.max_cache_len >= max_len:
            self.cache = pooled
        else:
            size = max(max_len, 64)
            self.cache = StaticCache(config=self.model.config, max_cache_len=size)
            self.cache.max_cache_len = size
            for layer in self.cache.layers:
                if type(layer).__name__ != "StaticLayer":
                    raise EngineError(f"{type(self.model).__name__}: cache layer {type(layer).__name__} cannot "
                                      "be rolled back by position (sliding-window or linear attention)")
            self._pool.setdefault(self.model, {})[key] = self.cache
        self.max_len = self.cache.max_cache_len
        self.length = 0
        self._cache_offset: int | None = None  # the offset the cache layers hold (None = unknown)
        emb = self.model.get_output_embeddings()
        self.vocab = emb.weight.shape[0] if emb is not None and hasattr(emb, "weight") else self.model.config.vocab_size

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions: move the write offset, copy nothing."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def forward(self, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """tokens: [B, T] at positions length..length+T-1 -> logits [B, T or 1, V] (float32)."""
        b, t = tokens.shape
        start = self.length
        if start + t > self.max_len:
            raise EngineError(f"static cache of {self.max_len} positions is full ({start} + {t})")
        if self._cache_offset != start:  # after a rollback: move the cache's write offset to ours
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(start)
        positions = torch.arange(start, start + t, device=tokens.device).unsqueeze(0).expand(b, t)  # [B, T]
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self.kwarg: self.cache})
        self.length = self._cache_offset = start + t
        return out.logits.float()


# ---------------------------------------------------------------- drafts


class Draft(Protocol):
    """What the engine needs from a draft (draft_models/ builds these)."""

    spec: str

    def prefill(self, input_ids: torch.Tensor, max_len: int) -> None:
        """input_ids: [1, T], the prompt; max_len bounds every position the round will reach."""

    def propose(self, seq: torch.Tensor, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """seq: [L] the committed tokens -> (draft tokens [k'], q [k', V] or None for one-hot q),
        k' <= k (0 = nothing to offer: the round is a plain step)."""

    def accept(self, n: int) -> None:
        """The target kept n of the proposed tokens: roll any state back to match."""


class ModelDraft:
    """A causal LM drafting through its own static cache (layerskip, self, hf drafts).

    Cache bookkeeping per round, with L committed tokens: the cache holds a prefix seq[:c] (c <= L).
    propose() feeds the catch-up tokens seq[c:L] in one forward (1 token, or 2 after a round whose
    k drafts were all accepted: d_k and the bonus were never fed), then d_1..d_{k-1} one at a
    time, sampling d_i from q_i. After the target keeps n drafts, the valid prefix is
    L + min(n, k-1) positions; the rest is rolled back.
    """

    def __init__(self, spec: str, model, vocab_size: int):
        self.spec = spec
        self.model = model
        self.vocab_size = vocab_size  # the target's logits width; q is padded/cut to it
        self.cached: CachedModel | None = None
        self._round = (0, 0)  # (L, k) of the last proposal

    def prefill(self, input_ids: torch.Tensor, max_len: int) -> None:
        self.cached = CachedModel(self.model, batch=1, max_len=max_len, slot="draft")
        self.cached.forward(input_ids, all_logits=False)
        self._round = (0, 0)

    def _q(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        v = logits.shape[-1]
        if v > self.vocab_size:  # padded embedding rows beyond the shared vocabulary: never proposed
            logits = logits[..., : self.vocab_size]
        elif v < self.vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size - v), float("-inf"))
            logits = torch.cat([logits, pad], -1)
        return logits_to_probs(logits, sampling)

    def propose(self, seq, k, sampling, generator):
        assert self.cached is not None, "prefill first"
        length = seq.shape[0]
        self._round = (length, k)
        if k == 0:
            return seq.new_empty(0), None
        tokens, qs = [], []
        feed = seq[self.cached.length:length].unsqueeze(0)  # [1, catch-up]
        for i in range(k):
            logits = self.cached.forward(feed, all_logits=False)[0, -1]  # [V]
            q = self._q(logits, sampling)
            tok = pick(q, sampling, generator)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                feed = tok.view(1, 1)
        return torch.stack(tokens), torch.stack(qs)  # [k], [k, V]

    def accept(self, n: int) -> None:
        length, k = self._round
        if k > 0 and self.cached is not None:
            self.cached.rollback(min(self.cached.length, length + min(n, k - 1)))


# ---------------------------------------------------------------- the decode steps


def prefill(target: CachedModel, input_ids: torch.Tensor, sampling: SamplingParams,
            generator: torch.Generator | None) -> torch.Tensor:
    """input_ids: [B, T] -> first new token per sequence [B]. The cache then holds T positions."""
    logits = target.forward(input_ids, all_logits=False)[:, -1]  # [B, V]
    return _next_token(logits, sampling, generator)


def decode_one_token(target: CachedModel, token: torch.Tensor, sampling: SamplingParams,
                     generator: torch.Generator | None) -> torch.Tensor:
    """token: [B] the last emitted token (not yet in the cache) -> the next token [B]."""
    logits = target.forward(token.unsqueeze(1), all_logits=False)[:, -1]  # [B, V]
    return _next_token(logits, sampling, generator)


def _next_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits: [B, V] -> [B]. Greedy skips building the one-hot: argmax of the logits is the same."""
    if sampling.greedy:
        return logits.argmax(-1)
    return pick(logits_to_probs(logits, sampling), sampling, generator)


def draft_k(draft: Draft, seq: torch.Tensor, k: int, sampling: SamplingParams,
            generator: torch.Generator | None, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq: [L] committed tokens -> draft tokens [k'] and q [k', V] (one-hot rows for a
    model-free draft, which makes beta_i = p_i(d_i) and the accept test u < p_i(d_i))."""
    tokens, q = draft.propose(seq, k, sampling, generator)
    tokens = tokens.to(seq.device, torch.long)
    if q is None:
        q = torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)  # [k', V]
    return tokens, q


def verify(target: CachedModel, last: torch.Tensor, draft_tokens: torch.Tensor,
           sampling: SamplingParams) -> torch.Tensor:
    """last: [1] the newest committed token, draft_tokens: [k] -> p: [k+1, V].

    One target forward over [last, d_1..d_k] at positions L-1..L+k-1 scores every draft token
    (row i gives p for d_{i+1}) and the bonus position (row k) at once.
    """
    tokens = torch.cat([last, draft_tokens]).unsqueeze(0)  # [1, k+1]
    logits = target.forward(tokens, all_logits=True)[0]  # [k+1, V]
    return logits_to_probs(logits, sampling)


def speculative_step(target: CachedModel, draft: Draft, seq: torch.Tensor, k: int,
                     sampling: SamplingParams, generator: torch.Generator | None,
                     timer: Timer) -> tuple[list[int], int, int, list[float]]:
    """One round on seq: [L] (B = 1; the target cache holds L-1 positions, seq[-1] is not in it).

    Returns (new tokens: accepted drafts + the residual/bonus token, drafted, accepted, betas).
    """
    start = target.length  # = L - 1
    with timer.measure("draft"):
        d, q = draft_k(draft, seq, k, sampling, generator, vocab=target.vocab)
    with timer.measure("verify"):
        p = verify(target, seq[-1:], d, sampling)
        verdict = verify_draft(p, q, d, sampling, generator)
    n = verdict.accepted
    # Keep [last, d_1..d_n] in the target cache; the rest of this round's k+1 writes are stale.
    target.rollback(start + 1 + n)
    draft.accept(n)
    new = d[:n].tolist() + [verdict.next_token]
    return new, int(d.shape[0]), n, verdict.betas


# ---------------------------------------------------------------- the loop


def _cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


@torch.inference_mode()
def generate(target, input_ids: torch.Tensor, max_new_tokens: int, draft: Draft | None = None, k: int = 0,
             sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
             timer: Timer | None = None, eos_token_id: int | list[int] | None = None) -> GenerationResult:
    """Decode up to max_new_tokens new tokens after input_ids [B, T] (equal-length prompts).

    k = 0 or draft = None: plain decode (any B). Otherwise speculative with draft length k (B = 1):
    near the end k shrinks so a round never runs past max_new_tokens. Generation stops at an EOS
    (the EOS is emitted; tokens after it, accepted or not, are not). Timer sections: "prefill" once,
    then "decode" per plain step, or "round" (containing "draft" and "verify") per speculative round.
    """
    if max_new_tokens < 1:
        raise EngineError("max_new_tokens must be >= 1")
    speculative = draft is not None and k > 0
    if k < 0:
        raise EngineError(f"draft length k must be >= 0 (got {k})")
    b, t = input_ids.shape
    if speculative and b != 1:
        raise EngineError(f"speculative decoding runs one sequence at a time (got a batch of {b})")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    cached = CachedModel(target, batch=b, max_len=t + max_new_tokens + 1)
    device = cached.device
    input_ids = input_ids.to(device)
    own = Timer(device)  # per-round figures; merged into the caller's timer at the end

    synchronize(device)
    t0 = time.perf_counter()
    with own.measure("prefill"):
        first = prefill(cached, input_ids, sampling, generator)  # [B]
        if speculative:
            draft.prefill(input_ids, t + max_new_tokens + 1)
    synchronize(device)
    t1 = time.perf_counter()

    out: list[list[int]] = [[x] for x in first.tolist()]
    done = [bool(eos) and x[0] in eos for x in out]
    rounds: list[RoundRecord] = []
    if speculative:
        seq = torch.cat([input_ids[0], first])  # [L]
        while not done[0] and len(out[0]) < max_new_tokens:
            k_round = min(k, max_new_tokens - len(out[0]) - 1)
            with own.measure("round"):
                if k_round > 0:
                    new, drafted, n, beta = speculative_step(cached, draft, seq, k_round, sampling, generator, own)
                else:  # one token left: a plain step, the draft's state stays consistent via accept(0)
                    draft.propose(seq, 0, sampling, generator)
                    with own.measure("draft"):
                        pass
                    with own.measure("verify"):
                        new = [int(decode_one_token(cached, seq[-1:], sampling, generator)[0])]
                    draft.accept(0)
                    drafted, n, beta = 0, 0, []
            kept, hit = _cut_at_eos(new, eos)
            out[0].extend(kept)
            done[0] = hit
            seq = torch.cat([seq, torch.tensor(kept, device=device, dtype=seq.dtype)])
            rounds.append(RoundRecord(drafted, n, len(kept), beta, 0.0, 0.0, 0.0, k_round))
    else:
        last = first
        while not all(done) and len(out[0]) < max_new_tokens:
            with own.measure("decode"):
                last = decode_one_token(cached, last, sampling, generator)  # [B]
            for row, x in zip(out, last.tolist()):
                row.append(x)
            done = [d or (x[-1] in eos) for d, x in zip(done, out)]
    synchronize(device)
    t2 = time.perf_counter()

    samples = own.collect()
    for i, r in enumerate(rounds):
        r.draft_s, r.verify_s, r.round_s = samples["draft"][i], samples["verify"][i], samples["round"][i]
    if timer is not None:
        for name, vals in samples.items():
            timer.samples[name].extend(vals)
    per_seq = [_cut_at_eos(row, eos)[0] for row in out]
    stop = "eos" if per_seq[0] and per_seq[0][-1] in eos else "length"
    return GenerationResult(tokens=per_seq[0] if b == 1 else per_seq, rounds=rounds, prefill_s=t1 - t0,
                            decode_s=t2 - t1, batch_tokens=per_seq, stop=stop)

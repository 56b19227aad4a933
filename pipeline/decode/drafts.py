"""What the engine needs from a draft (the Draft protocol) and the runtime draft classes.

    from pipeline.decode.drafts import ModelDraft, NgramDraft
    d = NgramDraft("ngram", max_n=3)                 # prompt lookup, model-free
    d = ModelDraft("layerskip:8", small_model, vocab_size=49152)

draft_models/ turns a spec string ("ngram", "layerskip:8", "self:<variant>", "hf:<path>") into one
of these; the engine only calls prefill, propose and accept. A draft that works on the host
(prompt lookup) declares `reads_host_tokens = True` and is handed the engine's host copy.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.decode.cache import CachedModel
from pipeline.decode.sampling import SamplingParams, logits_to_probs, pick


class Draft(Protocol):
    """What the engine needs from a draft."""

    spec: str
    # Optional: True when propose() takes `host`, the committed tokens as a host int64 array.
    # reads_host_tokens: bool

    def prefill(self, input_ids: torch.Tensor, max_len: int, exact: bool = False) -> None:
        """input_ids: [1, T], the prompt; max_len bounds every position a round reaches (exact: see CachedModel)."""

    def propose(self, seq: torch.Tensor, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """seq: [L] the committed tokens -> (draft tokens [k'], q [k', V] or None for one-hot q),
        k' <= k (0 = nothing to offer: the round is a plain step)."""

    def accept(self, n: int) -> None:
        """The target kept n of the proposed tokens: roll any state back to match."""


class ModelDraft:
    """A causal LM drafting through its own static cache: propose() feeds the catch-up tokens in one
    forward, then d_1..d_{k-1} one at a time; after n kept drafts, L + min(n, k-1) positions stay."""

    def __init__(self, spec: str, model, vocab_size: int):
        self.spec = spec
        self.model = model
        self.vocab_size = vocab_size  # the target's logits width; q is padded/cut to it
        self.cached: CachedModel | None = None
        self._round = (0, 0)  # (L, k) of the last proposal

    def prefill(self, input_ids: torch.Tensor, max_len: int, exact: bool = False) -> None:
        self.cached = CachedModel(self.model, batch=1, max_len=max_len, slot="draft", exact=exact)
        self.cached.prefill(input_ids)
        self._round = (0, 0)

    def probs(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Draft logits [..., V_draft] -> q [..., V_target], shaped by `sampling` like p is."""
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
            q = self.probs(logits, sampling)
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


class NgramDraft:
    """Prompt lookup, a model-free draft: the (up to k) tokens that followed the earliest (as
    vLLM's; `latest`: the most recent) earlier occurrence of the longest suffix of n = max_n..1
    tokens. q is one-hot; with no match it proposes nothing and the round is a plain step."""

    reads_host_tokens = True  # the engine hands propose() its host copy of the sequence

    def __init__(self, spec: str, max_n: int = 3, latest: bool = False):
        self.spec = spec
        self.max_n = max_n
        self.latest = latest

    def prefill(self, input_ids: torch.Tensor, max_len: int, exact: bool = False) -> None:
        pass  # stateless: everything it needs is the committed sequence

    def match(self, seq: np.ndarray, k: int) -> tuple[int, int]:
        """seq: [L] -> (start, count): seq[start:start+count] (count <= k) followed the earliest
        (latest: the most recent) earlier match of the longest suffix; count = 0 when none."""
        length = seq.shape[0]
        for n in range(min(self.max_n, length - 1), 0, -1):
            tail = seq[length - n:]
            windows = sliding_window_view(seq[: length - 1], n)  # starts 0..L-1-n: never the tail itself
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1] if self.latest else hits[0]) + n
                return start, min(k, length - start)
        return 0, 0

    def lookup(self, seq: np.ndarray, k: int) -> np.ndarray:
        start, count = self.match(seq, k)
        return seq[start: start + count]

    def propose(self, seq, k, sampling, generator, host: np.ndarray | None = None):
        if k == 0:
            return seq[:0], None
        tokens = host if host is not None else seq.cpu().numpy()
        start, count = self.match(tokens, k)
        return seq[start: start + count], None  # a slice of the device sequence: nothing copied

    def accept(self, n: int) -> None:
        pass

"""`ngram` / `ngram:<max_n>`: prompt lookup, a model-free draft (max_n defaults to 3).

Match the last n tokens of the committed sequence (n = max_n down to 1) against earlier text,
take the most recent earlier occurrence, and propose the (up to k) tokens that followed it. q is
one-hot on the proposal, so beta_i = p_i(d_i) and the accept test is u < p_i(d_i). When no suffix
occurs earlier the draft proposes nothing and the round is a plain decode step (drafted = 0): the
cheapest fallback, and honest in the acceptance figures (such rounds emit exactly one token).
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.stage import StageError


class NgramDraft:
    def __init__(self, spec: str, max_n: int = 3):
        self.spec = spec
        self.max_n = max_n

    def prefill(self, input_ids: torch.Tensor, max_len: int) -> None:
        pass  # stateless: everything it needs is the committed sequence

    def lookup(self, seq: np.ndarray, k: int) -> np.ndarray:
        """seq: [L] -> up to k tokens that followed the latest earlier match of the longest suffix."""
        length = seq.shape[0]
        for n in range(min(self.max_n, length - 1), 0, -1):
            tail = seq[length - n:]
            windows = sliding_window_view(seq[: length - 1], n)  # starts 0..L-1-n: never the tail itself
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start: start + k]
        return seq[:0]

    def propose(self, seq, k, sampling, generator):
        # .cpu() is a CPU-GPU sync point on CUDA: the lookup is host work.
        found = self.lookup(seq.cpu().numpy(), k) if k > 0 else np.zeros(0, dtype=np.int64)
        return torch.as_tensor(found, dtype=torch.long).to(seq.device), None

    def accept(self, n: int) -> None:
        pass


def build(spec, target, tokenizer, run_dir, device):
    _, _, arg = spec.partition(":")
    try:
        max_n = int(arg) if arg else 3
    except ValueError:
        max_n = 0
    if max_n < 1:
        raise StageError(f"draft {spec}: expected ngram or ngram:<max_n> with max_n >= 1")
    return NgramDraft(spec, max_n)

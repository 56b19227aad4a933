"""The decode steps plain and speculative decoding share: prefill, one token, the EOS cut, the result.

    from pipeline.decode.steps import prefill, decode_one_token, GenerationResult
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.decode.cache import CachedModel
from pipeline.decode.sampling import SamplingParams, logits_to_probs, pick

__all__ = ["GenerationResult", "prefill", "decode_one_token", "next_token", "cut_at_eos"]


@dataclass
class GenerationResult:
    # New token ids: a flat list for one prompt; a list of per-sequence lists when B > 1.
    tokens: list
    # Speculative only (empty for k = 0): one engine.RoundRecord per round.
    rounds: list = field(default_factory=list)
    prefill_s: float = 0.0  # prompt forward(s) + first token (target and draft prefill)
    decode_s: float = 0.0  # every token after the first
    batch_tokens: list[list[int]] = field(default_factory=list)  # always per sequence
    stop: str = "length"  # "eos" or "length" (sequence 0)
    step_s: list[float] = field(default_factory=list)  # plain decode: seconds of each step after the first
    # Slots of the target's static cache: every step's attention reads all of them (cache.py).
    cache_positions: int = 0


def prefill(target: CachedModel, input_ids: torch.Tensor, sampling: SamplingParams,
            generator: torch.Generator | None, chunk: int | None = None) -> torch.Tensor:
    """input_ids: [B, T] -> first new token per sequence [B]; chunk: forwards of at most that many tokens."""
    logits = target.prefill(input_ids, chunk)[:, -1]  # [B, V]
    return next_token(logits, sampling, generator)


def decode_one_token(target: CachedModel, token: torch.Tensor, sampling: SamplingParams,
                     generator: torch.Generator | None) -> torch.Tensor:
    """token: [B] the last emitted token (not yet in the cache) -> the next token [B]."""
    logits = target.forward(token.unsqueeze(1), all_logits=False)[:, -1]  # [B, V]
    return next_token(logits, sampling, generator)


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits: [B, V] -> [B]. Greedy skips building the one-hot: argmax of the logits is the same."""
    if sampling.greedy:
        return logits.argmax(-1)
    return pick(logits_to_probs(logits, sampling), sampling, generator)


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """tokens up to and including the first EOS, and whether there was one."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False

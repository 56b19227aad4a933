"""Expected speculative rounds at every draft length k, given one generated text.

    from pipeline.speculation.expected_rounds import TextAcceptance, round_chain
    text = TextAcceptance(accept=A, beta=B, available=avail, tokens=n, max_new_tokens=N)
    chain = round_chain(text, k)       # chain.rounds: E[rounds | text] at draft length k

Given the target's own text the accept/reject outcomes are independent Bernoulli draws, and the
rounds a Markov chain over round starts: one pass gives E[rounds | text] at every k exactly. A
slice's E(k) is sum(tokens) / sum(E[rounds]) (docs/methods/acceptance.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TextAcceptance:
    """What the round chain needs from one generated text (starts s = 1..n-1 are rows s-1)."""

    accept: np.ndarray  # [n-1, k_max]: P(the draft at offset i of a round starting at s is accepted | text)
    beta: np.ndarray  # [n-1, k_max]: sum_x min(p, q) at that position (1 - TV), for expected_beta
    available: np.ndarray  # [n-1]: drafts the draft can offer at start s (k_max for a model draft)
    tokens: int  # n: tokens emitted in all, the prefill's first included
    max_new_tokens: int  # N: the engine's budget, which shortens k near the end


@dataclass
class RoundChain:
    """Expectations over the acceptance outcomes, given the text, at one draft length k."""

    k: int
    rounds: float  # E[number of rounds]
    drafted_rounds: np.ndarray  # [k+1]: E[rounds that drafted d tokens], d = 0..k
    # Rounds run at the full k (not shortened near max_new_tokens), for per-position rates:
    full_rounds: float
    reached: np.ndarray  # [k]: E[full rounds whose positions 1..i-1 were accepted] (position i tested)
    accepted: np.ndarray  # [k]: E[full rounds whose positions 1..i were accepted]
    beta_sum: np.ndarray  # [k]: E[sum of beta_i over the rounds reaching i] (0 where nothing drafted)
    histogram: np.ndarray  # [k+1]: E[full rounds with j accepted], j = 0..k
    starts: np.ndarray  # [n-1]: P(a round starts at s), s = 1..n-1 (sums to `rounds`)


def round_chain(text: TextAcceptance, k: int) -> RoundChain:
    """Walk the chain forward: visit[s] = P(a round starts at s); every expectation is a sum of
    visit-weighted per-start terms (positions past the text's end are not counted)."""
    n, big_n = int(text.tokens), int(text.max_new_tokens)
    k_max = text.accept.shape[1] if text.accept.ndim == 2 else 0
    if not 1 <= k <= max(k_max, 1):
        raise ValueError(f"k = {k} outside 1..{k_max}")
    visit = np.zeros(n + k + 2)
    if n >= 2:
        visit[1] = 1.0
    drafted_rounds = np.zeros(k + 1)
    reached, accepted, beta_sum = np.zeros(k), np.zeros(k), np.zeros(k)
    histogram = np.zeros(k + 1)
    full_rounds = 0.0
    for s in range(1, n):
        w = visit[s]
        if w == 0.0:
            continue
        k_s = min(k, big_n - s - 1)
        d = max(0, min(k_s, int(text.available[s - 1])))
        drafted_rounds[d] += w
        m = min(d, n - s)  # drafted positions that lie inside the text (s + i <= n - 1)
        a = text.accept[s - 1, :m]
        survive = np.concatenate([[1.0], np.cumprod(a)])  # survive[j] = P(offsets 0..j-1 accepted)
        for j in range(m):  # first rejection at offset j: the next round starts after its token
            visit[s + j + 1] += w * survive[j] * (1.0 - a[j])
        if m == d:  # every draft accepted: the bonus token follows (or the text ended at an EOS)
            visit[s + d + 1] += w * survive[d]
        if k_s < k:
            continue
        full_rounds += w
        histogram[:m] += w * survive[:m] * (1.0 - a)
        histogram[m] += w * survive[m]
        for i in range(1, k + 1):  # position i <-> offset i - 1
            if i <= m:
                reached[i - 1] += w * survive[i - 1]
                accepted[i - 1] += w * survive[i]
                beta_sum[i - 1] += w * survive[i - 1] * text.beta[s - 1, i - 1]
            elif i == d + 1 and m == d and s + d <= n - 1:  # the draft offered fewer than i tokens
                reached[i - 1] += w * survive[d]
    return RoundChain(k=k, rounds=float(visit[1:n].sum()), drafted_rounds=drafted_rounds, full_rounds=full_rounds,
                      reached=reached, accepted=accepted, beta_sum=beta_sum, histogram=histogram,
                      starts=visit[1:max(n, 1)].copy())


def model_draft_rows(per_token: np.ndarray, k_max: int) -> np.ndarray:
    """A model draft's acceptance (or beta) by token t = 1..n-1, per_token: [n-1] -> the
    [start, offset] matrix: row s-1, column i holds token s + i (0 past the end of the text)."""
    m = per_token.shape[0]
    padded = np.concatenate([per_token, np.zeros(k_max)])
    idx = np.arange(m)[:, None] + np.arange(k_max)[None, :]  # token (s + i) - 1
    return padded[idx]

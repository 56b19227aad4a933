"""E[tokens per row per round] at batch size B under the engine's synchronised scheme, from the
acceptance stage's texts: exact given B texts, then averaged over groups of B distinct prompts.

    from pipeline.speculation.batch_rounds import batch_chain, batch_block
    chain = batch_chain([text_a, text_b], k)     # E[rounds], E[row-rounds] given the two texts
    block = batch_block(texts, tokens, batch=4, k_max=6, confidence=0.95, seed=0)   # one slice

Every row keeps n_min + 1 tokens a round, so given the texts the batch is one round chain over
shared starts whose acceptance is the product over the active rows (`round_chain` on the combined
TextAcceptance); at B = 1 it is the acceptance stage's E(k). Per slice: seeded groups of distinct
prompts, a delete-one-prompt jackknife CI. Why exact, and when not: docs/methods/batching.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.speculation.expected_rounds import TextAcceptance, round_chain
from pipeline.stats.intervals import jackknife_se, normal_interval

PARTITIONS = 8  # random partitions per (slice, B): more groups per prompt, a steadier average


@dataclass
class BatchChain:
    k: int
    rounds: float  # E[rounds of the batch | texts]
    row_rounds: float  # E[sum over rounds of the rows active in it | texts]
    tokens: int  # tokens emitted by rounds, all rows
    histogram: np.ndarray | None = None  # [k+1]: E[full-length rounds with n_min = j | texts]
    widths: np.ndarray | None = None  # [k+1]: E[rounds whose verify width is w | texts] (all rounds)


def batch_text(texts: list[TextAcceptance]) -> tuple[TextAcceptance, np.ndarray, np.ndarray]:
    """B rows' texts -> the batch's TextAcceptance over shared starts, the number of active rows
    and the most any active row offers at each start s = 1..n-1 (n = the longest text)."""
    big_ns = {int(t.max_new_tokens) for t in texts}
    if len(big_ns) != 1:
        raise ValueError(f"rows of one batch share max_new_tokens (got {sorted(big_ns)})")
    k_max = max(t.accept.shape[1] for t in texts)
    n = max(int(t.tokens) for t in texts)
    accept = np.ones((max(n - 1, 0), k_max))
    available = np.full(max(n - 1, 0), k_max, dtype=int)
    active = np.zeros(max(n - 1, 0), dtype=int)
    widest = np.zeros(max(n - 1, 0), dtype=int)
    for t in texts:
        rows = int(t.tokens) - 1  # starts s = 1..n_b - 1: the row has not ended
        if rows <= 0:
            continue
        accept[:rows, : t.accept.shape[1]] *= t.accept[:rows]
        accept[:rows, t.accept.shape[1]:] = 0.0
        available[:rows] = np.minimum(available[:rows], t.available[:rows])
        widest[:rows] = np.maximum(widest[:rows], t.available[:rows])
        active[:rows] += 1
    combined = TextAcceptance(accept=accept, beta=np.zeros_like(accept), available=available, tokens=n,
                              max_new_tokens=big_ns.pop())
    return combined, active, widest


def verify_widths(widest: np.ndarray, k: int, max_new_tokens: int) -> np.ndarray:
    """The engine's verify width at each start s = 1..n-1: min(k_s, what the widest active row
    offers), k_s = min(k, N - s - 1) (0: a plain step)."""
    s = np.arange(1, widest.size + 1)
    return np.clip(np.minimum(np.minimum(k, max_new_tokens - s - 1), widest), 0, None).astype(int)


def batch_chain(texts: list[TextAcceptance], k: int) -> BatchChain:
    """E[rounds] and E[row-rounds] of the synchronised scheme at draft length k, given the rows' texts."""
    combined, active, widest = batch_text(texts)
    tokens = sum(max(int(t.tokens) - 1, 0) for t in texts)
    if combined.tokens < 2:
        return BatchChain(k, 0.0, 0.0, tokens, np.zeros(k + 1), np.zeros(k + 1))
    chain = round_chain(combined, k)
    widths = np.bincount(verify_widths(widest, k, int(combined.max_new_tokens)), weights=chain.starts,
                         minlength=k + 1)[: k + 1]
    # Summed the way round_chain sums `rounds`, so B = 1 gives the same float to the last bit.
    return BatchChain(k, chain.rounds, float(np.sum(chain.starts * active)), tokens, chain.histogram, widths)


def partition_groups(n_prompts: int, batch: int, seed: int, partitions: int = PARTITIONS) -> list[tuple[int, ...]]:
    """Groups of `batch` distinct prompt indices from seeded random partitions (B = 1: each prompt once)."""
    if batch == 1:
        return [(i,) for i in range(n_prompts)]
    rng = np.random.default_rng([seed, batch])
    groups = []
    for _ in range(partitions):
        perm = rng.permutation(n_prompts)
        groups += [tuple(sorted(int(x) for x in perm[j * batch:(j + 1) * batch])) for j in range(n_prompts // batch)]
    return groups


def batch_block(texts: list[TextAcceptance], batch: int, k_max: int, confidence: float = 0.95,
                seed: int = 0) -> dict:
    """E_B(k) for k = 1..k_max over one slice's prompts (module docstring), with intervals."""
    n_prompts = len(texts)
    design = {"batch": batch, "prompts": n_prompts, "partitions": 1 if batch == 1 else PARTITIONS,
              "ci_unit": "prompt (delete-one-prompt jackknife over groups of B distinct prompts, normal)"}
    if n_prompts < batch or n_prompts == 0:
        return {**design, "groups": 0, "expected_tokens_per_round": None, "ci": None, "accepted_distribution": None,
                "note": f"fewer prompts ({n_prompts}) than the batch size: no group of {batch} distinct prompts"}
    groups = partition_groups(n_prompts, batch, seed)
    member = np.zeros((len(groups), n_prompts), dtype=bool)
    for g, idx in enumerate(groups):
        member[g, list(idx)] = True
    tokens = np.array([sum(max(int(texts[i].tokens) - 1, 0) for i in idx) for idx in groups], float)
    expected, ci, se_by_k, rounds_by_k, pmf, width_share, jackknife = {}, {}, {}, {}, {}, {}, {}
    for k in range(1, k_max + 1):
        chains = [batch_chain([texts[i] for i in idx], k) for idx in groups]
        row_rounds = np.array([c.row_rounds for c in chains])
        widths = np.array([c.widths for c in chains])  # [groups, k+1]
        rounds_by_k[str(k)] = float(sum(c.rounds for c in chains))
        hist = np.sum([c.histogram for c in chains], axis=0)
        if hist.sum() > 0:
            pmf[str(k)] = (hist / hist.sum()).tolist()
        if widths.sum() > 0:
            width_share[str(k)] = (widths.sum(0) / widths.sum()).tolist()
        point = float(tokens.sum() / row_rounds.sum()) if row_rounds.sum() > 0 else 1.0
        expected[str(k)] = point
        if n_prompts < 2 or batch == n_prompts:  # dropping any prompt leaves no group
            ci[str(k)], se_by_k[str(k)] = [1.0, k + 1.0], None
            continue
        jack, jack_share = [], []
        for p in range(n_prompts):
            keep = ~member[:, p]
            jack.append(tokens[keep].sum() / row_rounds[keep].sum() if row_rounds[keep].sum() > 0 else 1.0)
            w = widths[keep].sum(0)
            jack_share.append((w / w.sum()).tolist() if w.sum() > 0 else width_share.get(str(k)))
        # Delete-one-prompt jackknife SE, normal interval clipped to E_B's range [1, k + 1].
        se_by_k[str(k)] = jackknife_se(jack)
        ci[str(k)] = normal_interval(point, se_by_k[str(k)], confidence, bounds=(1.0, k + 1.0))
        # The delete-one-prompt replicates of E_B and of the width shares, for a jackknife of any
        # smooth function of both (pipeline/serving/batch_k.py: ms/token = sum_w share_w T_w / E_B).
        jackknife[str(k)] = {"tokens_per_round": jack, "width_share": jack_share}
    return {**design, "groups": len(groups), "expected_tokens_per_round": expected, "ci": ci, "se": se_by_k,
            "expected_batch_rounds": rounds_by_k, "accepted_distribution": pmf, "width_distribution": width_share,
            "jackknife": jackknife}


def by_batch_blocks(texts: list[TextAcceptance], batch_sizes: list[int], k_max: int, confidence: float,
                    seed: int) -> dict:
    """The acceptance JSON's per-slice keys: B -> k -> E_B(k), its CI, and how the groups were drawn."""
    blocks = {b: batch_block(texts, b, k_max, confidence, seed) for b in sorted({1, *batch_sizes})}
    return {
        "expected_tokens_per_round_by_batch": {str(b): v["expected_tokens_per_round"] for b, v in blocks.items()},
        "expected_tokens_per_round_by_batch_ci": {str(b): v["ci"] for b, v in blocks.items()},
        "accepted_distribution_by_batch": {str(b): v["accepted_distribution"] for b, v in blocks.items()},
        "width_distribution_by_batch": {str(b): v.get("width_distribution") for b, v in blocks.items()},
        "by_batch_jackknife": {str(b): v.get("jackknife") for b, v in blocks.items()},
        "by_batch_design": {str(b): {x: y for x, y in v.items()
                                     if x not in ("expected_tokens_per_round", "ci", "accepted_distribution",
                                                  "width_distribution", "jackknife")}
                            for b, v in blocks.items()},
    }

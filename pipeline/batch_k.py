"""Draft length k per batch size, and the table vLLM's dynamic speculation takes.

Called by the marginal stage (python -m pipeline marginal --run ... --config ...) for every pair
with a `latency/batched/<pair>.json`. Under the engine's synchronised scheme
(pipeline/decode/batched.py) a round at batch B keeps n_min + 1 tokens in every row, n_min the
fewest accepted in the batch. With the rows' accepted counts A_b independent and distributed as
the acceptance stage measured them (P(A >= i) = `prefix` of position i):

    P(min_b min(A_b, k) >= i) = P(A >= i)^B        for i <= k
    E_B(k) = 1 + sum_{i=1..k} P(A >= i)^B            tokens per row per round; E_1 = E(k)

and the accepted tokens thrown away against per-row offsets are a share 1 - E_B(k) / E_1(k) of
what the rows would keep alone. At each B:

    ms/token(B, k) = T_round(B, k) / E_B(k)          speedup(B, k) = T_plain(B) / ms/token(B, k)

with T_round and T_plain (one plain step of B rows) timed in the same repeats on the same B
prompts (pipeline/batch_latency.py). recommended_k_by_batch applies marginal.RULE at each B.
The latency run's own tokens per round at B (real rows, not independent draws) is kept beside
E_B as `measured_tokens_per_round`: where they differ, the independence assumption is off.
"""
from __future__ import annotations

import numpy as np

from pipeline.stats import percentile_bootstrap

# vLLM's dynamic speculative decoding (DSD): speculative_config.num_speculative_tokens_per_batch_size,
# a list of [start_bs, end_bs, K] rows, ranges inclusive; num_speculative_tokens is the startup
# maximum (buffers) and the scheduled K is clamped to it; batch sizes in a gap inherit the previous
# row's K. Docs: docs.vllm.ai/en/latest/features/speculative_decoding/dynamic_speculative_decoding/
# (merged in vllm-project/vllm#32374).
VLLM_KEY = "num_speculative_tokens_per_batch_size"
VLLM_SOURCES = [
    "https://docs.vllm.ai/en/latest/features/speculative_decoding/dynamic_speculative_decoding/",
    "https://github.com/vllm-project/vllm/pull/32374",
]


def prefix_rates(per_position: list[dict], k_max: int) -> np.ndarray:
    """P(A >= i) for i = 1..k_max from the acceptance JSON's per-position `prefix`."""
    by_pos = {int(p["position"]): p.get("prefix") for p in per_position}
    return np.array([float(by_pos.get(i) or 0.0) for i in range(1, k_max + 1)])


def expected_tokens_batched(prefix: np.ndarray, k: int, batch: int) -> float:
    """E_B(k) = 1 + sum_{i<=k} P(A >= i)^B (module docstring)."""
    return 1.0 + float(np.sum(np.asarray(prefix[:k], dtype=float) ** batch))


def _e_from_rounds(accepted: np.ndarray, k: int, batch: int, axis: int = -1) -> np.ndarray:
    """E_B(k) from accepted counts per round (resampled along `axis`)."""
    tail = np.stack([(accepted >= i).mean(axis=axis) for i in range(1, k + 1)], -1)
    return 1.0 + (tail ** batch).sum(-1)


def batch_rows(prefix: np.ndarray, histogram: list[int] | None, cells: list[dict], confidence: float,
               seed: int = 0) -> list[dict]:
    """One row per measured (B, k): E_B(k), ms/token, speedup with CIs, the thrown-away share.

    CIs resample timing repeats (ratio plain/round per repeat: paired) and, when the acceptance
    histogram is there, acceptance rounds, independently; the resampled E_B is shifted onto the
    point estimate from `prefix` so the two cannot disagree by construction (as marginal does)."""
    accepted = None
    if histogram and sum(histogram):
        accepted = np.repeat(np.arange(len(histogram)), np.asarray(histogram, dtype=int)).astype(float)
    plain = {c["batch"]: c for c in cells if c["k"] == 0}
    rows = []
    for c in sorted((c for c in cells if c["k"] > 0), key=lambda c: (c["batch"], c["k"])):
        b, k = int(c["batch"]), int(c["k"])
        if b not in plain or k > len(prefix):
            continue
        e_b, e_1 = expected_tokens_batched(prefix, k, b), expected_tokens_batched(prefix, k, 1)
        round_ms = np.asarray(c["round_ms"]["samples"], dtype=float)
        plain_ms = np.asarray(plain[b]["ms_per_token"]["samples"], dtype=float)
        n = min(len(round_ms), len(plain_ms))
        ratio = plain_ms[:n] / round_ms[:n]  # same repeat: paired
        t_plain, t_round = float(np.median(plain_ms)), float(np.median(round_ms))
        ms = t_round / e_b
        row = {"batch": b, "k": k, "tokens_per_round": e_b, "tokens_per_round_alone": e_1,
               "thrown_away_share": 1.0 - e_b / e_1,
               "measured_tokens_per_round": c.get("tokens_per_round"),
               "measured_thrown_away_fraction": c.get("thrown_away_fraction"),
               "round_ms": t_round, "round_ms_ci": c["round_ms"]["ci"],
               "plain_ms_per_token": t_plain, "plain_ms_per_token_ci": plain[b]["ms_per_token"]["ci"],
               "ms_per_token": ms, "speedup": float(np.median(ratio)) * e_b,
               "measured_ms_per_token": c["ms_per_token"]["median"], "measured_speedup": c["speedup"]["median"],
               "measured_speedup_ci": c["speedup"]["ci"]}
        row["ms_per_token_ci"], row["speedup_ci"], row["tokens_per_round_ci"] = _cis(
            round_ms, ratio, accepted, prefix, k, b, confidence, seed + 31 * b + k)
        rows.append(row)
    return rows


def _cis(round_ms, ratio, accepted, prefix, k, b, confidence, seed):
    e_point = expected_tokens_batched(prefix, k, b)

    def ci(fn, data):
        data = tuple(d if d.size > 1 else np.repeat(d, 2) for d in data)
        if all(np.ptp(d) == 0 for d in data):
            v = float(fn(*[d[None, :] for d in data], axis=-1)[0])
            return [v, v]
        return list(percentile_bootstrap(data, fn, confidence, seed))

    if accepted is None:
        e = lambda a, axis: e_point  # noqa: E731 (no rounds to resample: E_B is taken as known)
        ms = ci(lambda r, axis: np.median(r, axis=axis) / e_point, (round_ms,))
        sp = ci(lambda q, axis: np.median(q, axis=axis) * e_point, (ratio,))
        return ms, sp, [e_point, e_point]
    shift = e_point - float(_e_from_rounds(accepted, k, b))

    def e(a, axis):
        return _e_from_rounds(a, k, b, axis) + shift

    ms = ci(lambda r, a, axis: np.median(r, axis=axis) / e(a, axis), (round_ms, accepted))
    sp = ci(lambda q, a, axis: np.median(q, axis=axis) * e(a, axis), (ratio, accepted))
    return ms, sp, ci(lambda a, axis: e(a, axis), (accepted,))


def recommended_by_batch(rows: list[dict]) -> dict[int, int]:
    """B -> k by marginal.RULE applied to each batch size's rows (0 = do not speculate at B)."""
    from pipeline.marginal import recommend_k

    out = {}
    for b in sorted({r["batch"] for r in rows}):
        out[b] = recommend_k([r for r in rows if r["batch"] == b])
    return out


def vllm_rows(by_batch: dict[int, int]) -> list[list[int]]:
    """{B: k} -> [[start_bs, end_bs, k], ...]: each measured B covers up to the next measured B
    minus one (vLLM's own rule for gaps: the previous row's K), the last covers only itself (larger
    batches were not measured); neighbouring rows with the same k are merged."""
    bs = sorted(by_batch)
    rows: list[list[int]] = []
    for i, b in enumerate(bs):
        end = bs[i + 1] - 1 if i + 1 < len(bs) else b
        if rows and rows[-1][2] == by_batch[b]:
            rows[-1][1] = end
        else:
            rows.append([b, end, int(by_batch[b])])
    return rows


def speculative_config(by_batch: dict[int, int]) -> dict:
    """The `speculative_config_by_batch` block of the marginal JSON."""
    rows = vllm_rows(by_batch)
    top = max(by_batch.values(), default=0)
    largest = max(by_batch, default=0)
    return {
        "rows": rows,
        "config_key": f"speculative_config.{VLLM_KEY}",
        "vllm_speculative_config": ({"num_speculative_tokens": top, VLLM_KEY: rows} if top > 0 else None),
        "note": ("vLLM dynamic speculative decoding: rows [start_bs, end_bs, k], inclusive, by the number of "
                 "running requests; k = 0 turns speculation off in that range; num_speculative_tokens is the "
                 "startup maximum (the scheduled k is clamped to it). Batch sizes between two measured ones take "
                 f"the smaller one's k; above {largest} nothing was measured. Merge these keys into the draft's "
                 "own speculative_config (method, model)." if top > 0 else
                 "No measured batch size pays: leave speculative decoding off (no speculative_config)."),
        "sources": VLLM_SOURCES,
    }


def by_batch_section(acceptance_slice: dict, batched: dict, confidence: float, seed: int = 0) -> dict:
    """Everything the marginal JSON gets from one pair's batched latency and its primary acceptance slice."""
    k_max = max(int(c["k"]) for c in batched["cells"])
    prefix = prefix_rates(acceptance_slice.get("per_position") or [], k_max)
    rows = batch_rows(prefix, acceptance_slice.get("histogram"), batched["cells"], confidence, seed)
    rec = recommended_by_batch(rows)
    plain = [{"batch": c["batch"], "ms_per_token": c["ms_per_token"]["median"], "ci": c["ms_per_token"]["ci"],
              "prefill_ms": c["prefill_ms"]["median"]} for c in batched["cells"] if c["k"] == 0]
    return {
        "by_batch": {"rows": rows, "plain": plain, "batch_sizes": batched.get("batch_sizes"),
                     "prompt_tokens": batched.get("prompt_tokens"), "new_tokens": batched.get("new_tokens"),
                     "repeats": batched.get("repeats")},
        "recommended_k_by_batch": {str(b): k for b, k in rec.items()},
        "speculative_config_by_batch": speculative_config(rec),
    }

"""Draft length k per batch size, and the table vLLM's dynamic speculation takes.

Called by the marginal stage (python -m pipeline marginal --run ... --config ...) for every pair
with a `latency/batched/<pair>.json`. At each batch size B:

    ms/token(B, k) = T_round(B, k) / E_B(k)          speedup(B, k) = T_plain(B) / ms/token(B, k)

E_B(k) is the acceptance stage's exact batch figure (pipeline/speculation/batch_rounds.py) and
T_round(B, k) the latency stage's round time by verify width, weighted by the acceptance texts'
widths at (B, k), so both come from the same texts. The CI, B1_RULE, the fallbacks and the
comparison formulas: docs/methods/batching.md.
"""
from __future__ import annotations

import numpy as np

from pipeline.latency.modes import compare
from pipeline.serving.marginal import by_drafted_matrix, recommend_k
from pipeline.serving.timing_noise import noise_line, timing_factors
from pipeline.stats.intervals import jackknife_se, median_ci, normal_se, percentile_interval

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
    """The comparison formula 1 + sum_{i<=k} P(A >= i)^B (module docstring): not E_B."""
    return 1.0 + float(np.sum(np.asarray(prefix[:k], dtype=float) ** batch))


def exact_tokens_per_round(acceptance_slice: dict, batch: int, k: int) -> tuple[float, list[float]] | None:
    """(E_B(k), its CI) from the acceptance JSON (B = 1: expected_tokens_per_round), or None."""
    if batch == 1:
        e = (acceptance_slice.get("expected_tokens_per_round") or {}).get(str(k))
        ci = (acceptance_slice.get("expected_tokens_per_round_ci") or {}).get(str(k))
    else:
        e = ((acceptance_slice.get("expected_tokens_per_round_by_batch") or {}).get(str(batch)) or {}).get(str(k))
        ci = ((acceptance_slice.get("expected_tokens_per_round_by_batch_ci") or {}).get(str(batch)) or {}).get(str(k))
    if e is None:
        return None
    return float(e), [float(x) for x in ci] if ci else [float(e), float(e)]


def _width_block(acceptance_slice: dict, batched: dict, b: int, k: int):
    """(share over widths 0..k at (B, k), the width-time matrix [repeats, widths] at B, its jackknife
    replicates) or None when either JSON lacks the width keys."""
    share = ((acceptance_slice.get("width_distribution_by_batch") or {}).get(str(b)) or {}).get(str(k))
    block = (batched.get("round_ms_by_width") or {}).get(str(b))
    if share is None or not block:
        return None
    top = max(len(share) - 1, max(int(w) for w in block))
    m, filled = by_drafted_matrix(block, top)  # [R, top + 1] ms
    jack = ((acceptance_slice.get("by_batch_jackknife") or {}).get(str(b)) or {}).get(str(k))
    return np.asarray(share, float), m[:, : len(share)], jack, [w for w in filled if w < len(share)]


def batch_rows(acceptance_slice: dict, cells: list[dict], confidence: float, seed: int = 0,
               batched: dict | None = None, noise: dict | None = None) -> list[dict]:
    """One row per measured (B, k): E_B(k), ms/token, speedup with CIs, the thrown-away share.
    `batched` (the latency JSON) supplies round_ms_by_width; without it the cells' round time.
    `noise`: the run's pooled timing noise (pipeline/serving/timing_noise.py; None: the rows' own repeats)."""
    k_max = max((int(c["k"]) for c in cells), default=0)
    prefix = prefix_rates(acceptance_slice.get("per_position") or [], k_max)
    plain = {c["batch"]: c for c in cells if c["k"] == 0}
    rows = []
    for c in sorted((c for c in cells if c["k"] > 0), key=lambda c: (c["batch"], c["k"])):
        b, k = int(c["batch"]), int(c["k"])
        if b not in plain:
            continue
        formula = expected_tokens_batched(prefix, k, b)
        exact, alone = exact_tokens_per_round(acceptance_slice, b, k), exact_tokens_per_round(acceptance_slice, 1, k)
        if exact is not None:
            (e_b, e_ci), source = exact, "exact (acceptance expected_tokens_per_round_by_batch)"
        else:
            e_b, e_ci, source = formula, [formula, formula], "independent-rows formula (no exact E_B in the acceptance JSON)"
        e_1 = alone[0] if alone is not None else expected_tokens_batched(prefix, k, 1)
        plain_ms = np.asarray(plain[b]["ms_per_token"]["samples"], dtype=float)
        cell_round = np.asarray(c["round_ms"]["samples"], dtype=float)
        width = _width_block(acceptance_slice, batched or {}, b, k) if exact is not None else None
        jack_factor = None
        if width is not None:
            share, t_w, jack, filled = width
            round_ms = t_w @ share  # per repeat: sum_w share_w T(B, w)
            t_point = np.median(t_w, axis=0)
            if jack and jack.get("width_share") and all(x is not None for x in jack["width_share"]):
                jack_factor = (np.asarray(jack["width_share"], float) @ t_point) / np.asarray(jack["tokens_per_round"], float)
            round_source = "by verify width, weighted by the acceptance chain's width shares at (B, k)"
        else:
            round_ms, share, filled = cell_round, None, []
            round_source = "the cells' own round time at k (no width keys in the latency or acceptance JSON)"
        n = min(len(round_ms), len(plain_ms))
        ratio = plain_ms[:n] / round_ms[:n]  # same repeat: paired
        t_plain, t_round = float(np.median(plain_ms)), float(np.median(round_ms))
        row = {"batch": b, "k": k, "tokens_per_round": e_b, "tokens_per_round_ci": e_ci,
               "tokens_per_round_source": source, "tokens_per_round_alone": e_1,
               "thrown_away_share": 1.0 - e_b / e_1,
               "tokens_per_round_independent_rows": formula,
               "measured_tokens_per_round": c.get("tokens_per_round"),
               "measured_thrown_away_fraction": c.get("thrown_away_fraction"),
               "round_ms": t_round, "round_ms_source": round_source, "timing_repeats": int(n),
               "round_ms_ci": median_ci(round_ms, confidence, seed + 7 * b + k)["ci"],
               "cell_round_ms": c["round_ms"]["median"], "cell_round_ms_ci": c["round_ms"]["ci"],
               "mean_width": float(share @ np.arange(share.size)) if share is not None else None,
               "cell_mean_width": c.get("mean_width"), "round_ms_interpolated_widths": filled,
               "plain_ms_per_token": t_plain, "plain_ms_per_token_ci": plain[b]["ms_per_token"]["ci"],
               "ms_per_token": t_round / e_b, "speedup": float(np.median(ratio)) * e_b,
               "measured_ms_per_token": c["ms_per_token"]["median"], "measured_speedup": c["speedup"]["median"],
               "measured_speedup_ci": c["speedup"]["ci"],
               **compare(c.get("run_mode"), plain[b].get("run_mode"), ("speculative", "plain"))}
        row["ms_per_token_ci"], row["speedup_ci"], row["ci_unit"] = _cis(
            round_ms, ratio, e_b, e_ci, k, confidence, seed + 31 * b + k, jack_factor, timing=noise)
        row["timing_ci"] = noise_line(noise)
        rows.append(row)
    return rows


def _cis(round_ms: np.ndarray, ratio: np.ndarray, e_point: float, e_ci: list[float], k: int, confidence: float,
         seed: int, jack_factor: np.ndarray | None = None, resamples: int = 2000,
         timing: dict | None = None) -> tuple[list[float], list[float], str]:
    """CIs of ms/token and speedup from two independent sources: the timing repeats (median of a
    bootstrap resample; with `timing`, the run's pooled noise, pipeline/serving/timing_noise.py: a t
    draw of the median of these n repeats) and acceptance. With `jack_factor` (the delete-one-prompt replicates of
    sum_w share_w T_w / E_B) acceptance moves the whole factor: a normal draw with its jackknife
    relative SE; without it only E_B moves (a normal draw with the SE its CI implies). Written out
    because scipy.stats.bootstrap resamples data only, and acceptance's uncertainty is given as a
    jackknife."""
    rng = np.random.default_rng(seed)
    med_round = np.median(rng.choice(round_ms, (resamples, round_ms.size)), axis=1)
    med_ratio = np.median(rng.choice(ratio, (resamples, ratio.size)), axis=1)
    noise = rng.standard_normal(resamples)
    if timing is not None:
        n = min(round_ms.size, ratio.size)
        med_round = float(np.median(round_ms)) * timing_factors(rng, timing["round_sd"], n, timing["df"], resamples)
        med_ratio = float(np.median(ratio)) * timing_factors(rng, timing["ratio_sd"], n, timing["df"], resamples)
    if jack_factor is not None and jack_factor.size >= 2 and np.all(np.isfinite(jack_factor)):
        rel_se = jackknife_se(jack_factor) / jack_factor.mean()
        scale = np.clip(1.0 + rel_se * noise, 0.05, None)  # multiplies ms/token, divides speedup
        ms_draws, sp_draws = med_round / e_point * scale, med_ratio * e_point / scale
        unit = ("timing repeats (bootstrap) and acceptance prompts (delete-one-prompt jackknife of "
                "sum_w share_w T_w / E_B), independent")
    else:
        se = normal_se(e_ci, confidence)
        e = np.clip(e_point + se * noise, 1.0, k + 1.0)
        ms_draws, sp_draws = med_round / e, med_ratio * e
        unit = "timing repeats (bootstrap) and E_B's prompt interval (normal), independent"
    return (percentile_interval(ms_draws, confidence, float(np.median(round_ms)) / e_point),
            percentile_interval(sp_draws, confidence, float(np.median(ratio)) * e_point), unit)


def recommended_by_batch(rows: list[dict]) -> dict[int, int]:
    """B -> k by marginal.RULE applied to each batch size's rows (0 = do not speculate at B;
    recommend_k leaves out rows flagged not like with like)."""
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


B1_RULE = (
    "At B = 1 the recommended k is the B = 1 phase's (recommended_k): the latency stage times one "
    "row there in detail (every temperature, round time by drafted count, its own repeats and screen), and "
    "the batched phase's B = 1 cell runs the same single-row engine on one prompt, as the bridge to "
    "B > 1. One quantity gets one answer in a run: the batched rows' own rule at B = 1 is kept as "
    "`recommended_k_by_batch_own` and reported beside it when the two differ."
)


def with_b1(own: dict[int, int], at_one: int | None) -> tuple[dict[int, int], dict[int, str]]:
    """(B -> k, B -> where its k comes from): the batched rows' own rule at every B, except B = 1,
    which takes the B = 1 phase's recommended k (B1_RULE) when given (None: the batched rule)."""
    rec, source = dict(own), {b: "batched rows" for b in own}
    if 1 in rec and at_one is not None:
        rec[1], source[1] = int(at_one), "B = 1 phase (recommended_k)"
    return rec, source


def by_batch_section(acceptance_slice: dict, batched: dict, confidence: float, seed: int = 0,
                     at_one: int | None = None, noise: dict | None = None) -> dict:
    """Everything the marginal JSON gets from one pair's batched latency and its primary acceptance
    slice. at_one: the pair's recommended k from the B = 1 phase (B1_RULE; None: the batched rows decide
    B = 1 too); noise: the run's pooled timing noise (batch_rows)."""
    rows = batch_rows(acceptance_slice, batched["cells"], confidence, seed, batched, noise)
    own = recommended_by_batch(rows)
    rec, source = with_b1(own, at_one)
    plain = [{"batch": c["batch"], "ms_per_token": c["ms_per_token"]["median"], "ci": c["ms_per_token"]["ci"],
              "prefill_ms": c["prefill_ms"]["median"]} for c in batched["cells"] if c["k"] == 0]
    return {
        "by_batch": {"rows": rows, "plain": plain, "batch_sizes": batched.get("batch_sizes"),
                     "prompt_tokens": batched.get("prompt_tokens"), "new_tokens": batched.get("new_tokens"),
                     "repeats": batched.get("repeats"),
                     # The k not timed under batching: their bound is below 1 at every B (screen.ks_to_time).
                     "ks_not_timed": batched.get("ks_not_timed") or {}},
        "recommended_k_by_batch": {str(b): k for b, k in rec.items()},
        "recommended_k_by_batch_own": {str(b): k for b, k in own.items()},
        "recommended_k_by_batch_source": {str(b): v for b, v in source.items()},
        "b1_rule": B1_RULE,
        "speculative_config_by_batch": speculative_config(rec),
    }

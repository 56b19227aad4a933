"""The marginal-cost stage: which draft length k pays, from measured acceptance and measured time.

    python -m pipeline marginal --run runs/smollm2-135m --config configs/default.yaml

For every (target variant, draft) pair it joins `acceptance/<pair>.json` (E[tokens/round] for every
k, per slice and temperature) with `latency/<pair>.json` (round time per k, plain decode time per
token of the same target) and writes `marginal/<pair>.json`, `.md` and `.png`.

SEEDS.md, "Choosing k by marginal cost":
    ms_per_token(k) = T_round(k) / E(k)                    speedup(k) = T_plain / ms_per_token(k)
    marginal(k-1 -> k) = (T_round(k) - T_round(k-1)) / (E(k) - E(k-1))
with k = 0 meaning plain decoding (T_round(0) = T_plain, E(0) = 1). Going to k pays while the
marginal time per marginal token is below T_plain. Beside it, the Leviathan et al. (2023) model:
a round costs one target step plus k draft steps of relative cost c = T_draft_step / T_plain, so
predicted ms_per_token(k) = T_plain * (1 + k c) / E(k); where it misses the measured curve, verify
cost growing with k or per-round overhead is what the model leaves out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.stage import StageError, progress, read_json
from pipeline.stats import median_ci, percentile_bootstrap

RULE = (
    "k beats plain decoding when the lower end of its speedup CI is above 1. Among those, take the k "
    "with the lowest median ms/token; then, while the next smaller k also beats plain decoding and "
    "its ms/token CI overlaps this k's, step down to it (the data cannot tell them apart, and a "
    "smaller k drafts and verifies less work, which matters once the device is busy). "
    "recommended_k = 0 (do not speculate) when no k beats plain decoding."
)


# ---------------------------------------------------------------- helpers


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


# ---------------------------------------------------------------- the computation


def accepted_per_round(histogram: list[int] | None) -> np.ndarray | None:
    """Expand the histogram (rounds with 0, 1, ..., k_max accepted tokens) into one value per round."""
    if not histogram or sum(histogram) == 0:
        return None
    return np.repeat(np.arange(len(histogram)), np.asarray(histogram, dtype=int)).astype(float)


def marginal_table(expected_tokens: dict[int, float], round_ms: dict[int, list[float]],
                   plain_ms: list[float], per_position: list[dict] | None = None,
                   draft_ms: dict[int, list[float]] | None = None,
                   histogram: list[int] | None = None, confidence: float = 0.95,
                   seed: int = 0) -> dict:
    """The marginal-cost table for one (pair, slice, temperature).

    expected_tokens: k -> E[tokens/round] from acceptance; round_ms: k -> per-repeat round times;
    plain_ms: per-repeat plain decode ms/token of the same target. `histogram` (accepted tokens
    per round at k_max) makes the CIs carry acceptance noise too: a round at k emits
    1 + min(accepted, k) tokens, and timing repeats and rounds are resampled independently.
    """
    ks = sorted(k for k in expected_tokens if k in round_ms and k >= 1)
    if not ks:
        raise ValueError("no k with both acceptance and latency")
    plain = median_ci(plain_ms, confidence, seed)
    t_plain = plain["median"]
    accepted = accepted_per_round(histogram)
    alphas = _position_rates(per_position or [])
    c = _cost_ratio(draft_ms or {}, t_plain)
    rows = []
    prev_round, prev_tokens = t_plain, 1.0  # k = 0 is plain decoding
    for k in ks:
        rms = np.asarray(round_ms[k], dtype=float)
        tokens = float(expected_tokens[k])
        r_med = float(np.median(rms))
        ms_tok = r_med / tokens
        ms_ci, sp_ci, tok_ci = _ratio_cis(rms, np.asarray(plain_ms, float), accepted, k, tokens,
                                          confidence, seed + k)
        gained = tokens - prev_tokens
        marginal = (r_med - prev_round) / gained if gained > 1e-12 else None
        row = {
            "k": k,
            "tokens_per_round": tokens,
            "tokens_per_round_ci": tok_ci,
            "round_ms": r_med,
            "round_ms_ci": median_ci(rms, confidence, seed)["ci"],
            "ms_per_token": ms_tok,
            "ms_per_token_ci": ms_ci,
            "speedup": t_plain / ms_tok,
            "speedup_ci": sp_ci,
            "marginal_ms_per_token": marginal,
            # k-1 -> k lowers ms/token iff a marginal token costs less than the average one at
            # k-1. SEEDS' looser test (below plain ms/token) says the extra tokens are at least
            # cheaper than plain decoding would make them.
            "marginal_pays": marginal is not None and marginal < prev_round / prev_tokens,
            "marginal_beats_plain": marginal is not None and marginal < t_plain,
        }
        if alphas and c is not None and k <= len(alphas):
            e_pred = 1.0 + float(np.sum(np.cumprod(alphas[:k])))
            row["predicted_tokens_per_round"] = e_pred
            row["predicted_ms_per_token"] = t_plain * (1.0 + k * c) / e_pred
            row["predicted_speedup"] = e_pred / (1.0 + k * c)
        rows.append(row)
        prev_round, prev_tokens = r_med, tokens
    return {
        "baseline_ms_per_token": t_plain,
        "baseline_ci": plain["ci"],
        "cost_ratio_c": c,
        "position_rates": alphas,
        "rows": rows,
        "recommended_k": recommend_k(rows),
    }


def _ratio_cis(rms, plain, accepted, k, tokens, confidence, seed):
    """Bootstrap CIs of ms/token, speedup and E(k), resampling timing repeats and (when known)
    acceptance rounds independently."""
    if accepted is not None:
        emitted = 1.0 + np.minimum(accepted, k)
        # The acceptance JSON's own E(k) is the point estimate; resampled means are shifted onto
        # it so a k_max-pass histogram and the reported E(k) cannot disagree by construction.
        shift = tokens - float(emitted.mean())

        def e_of(a, axis):
            return np.mean(a, axis=axis) + shift
    else:
        emitted = None

    def ms(r, *rest, axis):
        e = e_of(rest[0], axis) if emitted is not None else tokens
        return np.median(r, axis=axis) / e

    def speed(r, *rest, axis):
        p = rest[-1]
        e = e_of(rest[0], axis) if emitted is not None else tokens
        return np.median(p, axis=axis) / (np.median(r, axis=axis) / e)

    def ci(fn, data):
        # A single repeat resamples to itself; scipy wants two observations per sample.
        data = tuple(d if d.size > 1 else np.repeat(d, 2) for d in data)
        if all(np.ptp(d) == 0 for d in data):
            v = float(fn(*[d[None, :] for d in data], axis=-1)[0])
            return [v, v]
        return list(percentile_bootstrap(data, lambda *a, axis: fn(*a, axis=axis), confidence, seed))

    base = (rms,) if emitted is None else (rms, emitted)
    ms_ci = ci(ms, base)
    sp_ci = ci(speed, (*base, plain))
    if emitted is None:
        tok_ci = [tokens, tokens]
    else:
        tok_ci = ci(lambda a, axis: e_of(a, axis), (emitted,))
    return ms_ci, sp_ci, tok_ci


def _position_rates(per_position: list[dict]) -> list[float]:
    """Measured conditional acceptance per position (P(A_i | A_1..A_i-1)); where no round reached
    position i, the mean beta_i (1 - TV(p, q)) stands in."""
    rates = []
    for pos in sorted(per_position, key=lambda p: p["position"]):
        r = pos.get("conditional")
        if r is None:
            r = pos.get("expected_beta")
        if r is None:
            break
        rates.append(float(r))
    return rates


def _cost_ratio(draft_ms: dict[int, list[float]], t_plain: float) -> float | None:
    """c = one draft step / one plain target step, the median over k of draft_ms(k) / (k T_plain)."""
    per_k = [float(np.median(v)) / (k * t_plain) for k, v in draft_ms.items() if v and k >= 1]
    return float(np.median(per_k)) if per_k and t_plain > 0 else None


def recommend_k(rows: list[dict]) -> int:
    """See RULE (written into every report)."""
    by_k = {r["k"]: r for r in rows}
    beats = {k for k, r in by_k.items() if r["speedup_ci"][0] > 1.0}
    if not beats:
        return 0
    best = min(beats, key=lambda k: (by_k[k]["ms_per_token"], k))
    while best - 1 in beats and _overlap(by_k[best - 1]["ms_per_token_ci"], by_k[best]["ms_per_token_ci"]):
        best -= 1
    return best


# ---------------------------------------------------------------- joining the artifacts


def pair_report(acceptance: dict, latency: dict, confidence: float = 0.95) -> dict:
    """The whole marginal artifact for one pair: the primary table (slice "all", greedy when
    measured) at the top level, and one table per slice and temperature under "slices"."""
    try:
        lat_rows = {int(r["k"]): r for r in latency["rows"]}
        round_ms = {k: r["round_ms"]["samples"] for k, r in lat_rows.items()}
        draft_ms = {k: r["draft_ms"]["samples"] for k, r in lat_rows.items()}
        plain = latency["plain_ms_per_token"]["samples"]
        slices = acceptance["slices"]
    except (KeyError, TypeError, ValueError) as e:
        raise StageError(f"marginal: acceptance or latency artifact lacks expected key {e}") from None
    if not slices:
        raise StageError("marginal: acceptance artifact has no slices")
    tables: dict[str, dict[str, dict]] = {}
    for slice_name, temps in slices.items():
        for temp_key, acc in temps.items():
            try:
                expected = {int(k): float(v) for k, v in acc["expected_tokens_per_round"].items()}
            except (KeyError, TypeError, ValueError) as e:
                raise StageError(f"marginal: acceptance slice {slice_name}/{temp_key} lacks {e}") from None
            tables.setdefault(slice_name, {})[temp_key] = marginal_table(
                expected, round_ms, plain, acc.get("per_position"), draft_ms, acc.get("histogram"),
                confidence)
    primary_slice = "all" if "all" in tables else sorted(tables)[0]
    temps = tables[primary_slice]
    primary_temp = min(temps, key=lambda t: float(t))  # greedy (0.0) when it was measured
    primary = temps[primary_temp]
    for row in primary["rows"]:
        measured = lat_rows.get(row["k"], {})
        if "tokens_per_round" in measured:
            row["measured_tokens_per_round"] = measured["tokens_per_round"]
        if isinstance(measured.get("ms_per_token"), dict):
            row["measured_ms_per_token"] = measured["ms_per_token"]["median"]
    return {
        "variant": latency.get("variant", acceptance.get("variant")),
        "draft": latency.get("draft", acceptance.get("draft")),
        "device": latency.get("device"),
        "confidence": confidence,
        "primary": {"slice": primary_slice, "temperature": primary_temp},
        **primary,
        "rule": RULE,
        "slices": {s: {t: {k: v for k, v in tab.items()} for t, tab in ts.items()}
                   for s, ts in tables.items()},
        "acceptance_per_position": slices[primary_slice][primary_temp].get("per_position", []),
        "latency_rows": [{k: r[k] for k in ("k", "draft_ms", "verify_ms", "overhead_ms", "round_ms")
                          if k in r} for r in latency["rows"]],
    }


def _pair_files(d: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(d.glob("*__*.json"))}


def run(ctx) -> None:
    from pipeline.marginal_report import write_markdown, write_plot

    acc_files = _pair_files(ctx.run_dir / "acceptance")
    lat_files = _pair_files(ctx.run_dir / "latency")
    if not acc_files:
        raise StageError(f"marginal: no acceptance/<variant>__<draft>.json in {ctx.run_dir}")
    missing = sorted(set(acc_files) - set(lat_files))
    if missing:
        raise StageError(f"marginal: no latency/{missing[0]}.json for acceptance pair {missing[0]} "
                         "(re-run make latency)")
    confidence = ctx.config.marginal.confidence
    recommended, by_batch = {}, {}
    for pair, acc_path in acc_files.items():
        from pipeline.batch_report import batching_inputs, write_batching

        from pipeline.stage import sha256_file

        item = ctx.item(f"{pair}.json", {"acceptance": sha256_file(acc_path),
                                          "latency": sha256_file(lat_files[pair]),
                                          "confidence": confidence,
                                          **batching_inputs(ctx.run_dir, pair, ctx.config)}, is_dir=False)
        if item.fresh:
            recommended[pair] = item.meta.get("recommended_k")
            by_batch[pair] = item.meta.get("recommended_k_by_batch")
            continue
        acc = read_json(acc_path, "acceptance artifact")
        report = pair_report(acc, read_json(lat_files[pair], "latency artifact"), confidence)
        # Speculation under batching (pipeline/serving.py): k per B, the vLLM table, the simulation.
        extra = write_batching(ctx.run_dir, ctx.out_dir, pair, report, acc, ctx.config, ctx.config.seed)
        # The .md and .png first, the JSON last: the JSON is what marks the pair finished.
        write_plot(report, ctx.out_dir / f"{pair}.png")
        write_markdown(report, ctx.out_dir / f"{pair}.md", f"{pair}.png", extra)
        item.write_json(report)
        recommended[pair] = report["recommended_k"]
        by_batch[pair] = report.get("recommended_k_by_batch")
        progress(f"marginal: {pair}: recommended k = {report['recommended_k']}, by batch size "
                 f"{report.get('recommended_k_by_batch')}")
    ctx.meta["recommended_k"] = recommended
    ctx.meta["recommended_k_by_batch"] = by_batch

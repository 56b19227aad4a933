"""Which draft length k pays, from measured acceptance and measured time: the marginal-cost table.

    from pipeline.serving.marginal import pair_report, recommend_k
    report = pair_report(acceptance_json, latency_json, confidence=0.95)   # marginal/<pair>.json

Joins a pair's acceptance JSON (E(k), drafted-count shares) with its latency JSON (round time by
drafted count, plain ms/token) per slice and temperature: T_round(k) weights the round times by
that slice's own drafted counts at k, ms_per_token(k) = T_round(k) / E(k), speedup(k) =
T_plain / ms_per_token(k). RULE picks k (per category: `recommended_k_by_category`); a row whose
two sides ran differently is never recommended. Method: docs/methods/marginal.md.
"""
from __future__ import annotations

import numpy as np

from pipeline.core.stage import StageError
from pipeline.latency.modes import comparable, compare
from pipeline.latency.screen import cut_line, screened_note
from pipeline.latency.speculative import MIN_TIMING_REPEATS
from pipeline.speculation.acceptance_stats import ratio_t_draws, ratio_t_interval
from pipeline.serving.timing_noise import noise_line, timing_factors
from pipeline.stats.intervals import median_ci, percentile_interval

RULE = (
    "k beats plain decoding when the lower end of its speedup CI is above 1. Among those, take the k "
    "with the lowest median ms/token; then, while the next smaller k also beats plain decoding and "
    "its ms/token CI overlaps this k's, step down to it (the data cannot tell them apart, and a "
    "smaller k drafts and verifies less work, which matters once the device is busy). "
    "recommended_k = 0 (do not speculate) when no k beats plain decoding. A k whose speculative and "
    "plain timings did not run the same way (like_with_like false) is never recommended, nor one timed "
    "in a single repeat (timing_repeats 1, as a budget can leave it): "
    "its CI then resamples the prompts alone and says nothing of the machine's load between the plain "
    "and the speculative runs."
)


def timed_enough(row: dict) -> bool:
    """Whether a row's timing has the repeats a recommendation needs (an unrecorded count: yes)."""
    return row.get("timing_repeats", MIN_TIMING_REPEATS) >= MIN_TIMING_REPEATS


CATEGORY_RULE = (
    "Per category and temperature, recommended k is RULE on that category's own prompts (the same round "
    "times). It is settled when the data decide: k > 0 (its speedup CI lies above 1 by RULE), or k = 0 "
    "with every k's speedup CI below 1 (speculating is measurably slower). Otherwise (k = 0 because the "
    "best k's speedup CI contains 1) the recommendation stays k = 0, since nothing shows that speculating "
    "pays, but it is marked settled: false, verdict 'inconclusive': more prompts in that category could go "
    "either way. Timed in a single repeat (as a budget can leave it), a category is inconclusive whatever its "
    "CIs say. A category "
    "the acceptance stage flags as having too few prompts (few_prompts) is never "
    "settled, whatever its CI says, since an interval over so few prompts covers less than it claims; "
    "nor is one with a single prompt (its CI resamples the timing repeats only). The figures "
    "are given at `at_k`: the recommended k, or the best (lowest ms/token) k when that is 0."
)


def by_drafted_matrix(block: dict, d_max: int) -> tuple[np.ndarray, list[int]]:
    """{d: {"samples": per repeat ms or None, "rounds"}} -> [R, d_max+1] ms, and the d that no
    round drafted. A repeat's missing d is read off a least-squares line through its measured
    ones, weighted by their round counts (a round's time is close to linear in d)."""
    cols = [block.get(str(d)) or {"samples": [], "rounds": 0} for d in range(d_max + 1)]
    repeats = max(len(c["samples"]) for c in cols)
    m = np.full((repeats, d_max + 1), np.nan)
    for d, c in enumerate(cols):
        for r, v in enumerate(c["samples"]):
            m[r, d] = np.nan if v is None else float(v)
    counts = np.array([max(c["rounds"], 0) for c in cols], float)
    ds = np.arange(d_max + 1, dtype=float)
    for r in range(repeats):
        seen = ~np.isnan(m[r])
        if seen.sum() >= 2:
            slope, icpt = np.polyfit(ds[seen], m[r, seen], 1, w=np.sqrt(np.maximum(counts[seen], 1.0)))
            m[r, ~seen] = icpt + slope * ds[~seen]
        elif seen.sum() == 1:
            m[r, ~seen] = m[r, seen][0]
    if np.isnan(m).any():  # a repeat with no rounds at all: the other repeats' medians
        m = np.where(np.isnan(m), np.nanmedian(m, axis=0, keepdims=True), m)
    return m, [d for d in range(d_max + 1) if counts[d] == 0]


def _prompt_arrays(acc: dict, ks: list[int], d_max: int):
    """Per-prompt tokens [P], expected rounds [P, K] and rounds by drafted count [P, K, D]."""
    recs = acc["per_prompt"]
    tokens = np.array([r["tokens"] for r in recs], float)
    rounds = np.array([[r["expected_rounds"][str(k)] for k in ks] for r in recs], float).reshape(len(recs), len(ks))
    drafted = np.zeros((len(recs), len(ks), d_max + 1))
    for i, r in enumerate(recs):
        for j, k in enumerate(ks):
            row = r["drafted_rounds"][str(k)]
            drafted[i, j, : len(row)] = row
    return tokens, rounds, drafted


def marginal_table(acc: dict, timing: dict, confidence: float = 0.95, seed: int = 0, resamples: int = 2000,
                   noise: dict | None = None) -> dict:
    """The marginal-cost table for one (pair, slice, temperature) from the acceptance JSON's block
    `acc` and the latency pair JSON's block `timing` at that temperature; `noise`: the run's
    pooled timing noise (timing_noise.py; None: the table's own repeats are resampled)."""
    # Only the k whose drafted counts were all timed (latency.k_max may stop below acceptance's).
    timed = max((int(d) for d in timing["round_ms_by_drafted"]), default=0)
    ks = sorted(int(k) for k in acc["expected_tokens_per_round"] if 1 <= int(k) <= timed)
    if not ks:
        raise ValueError("no k with both acceptance and latency")
    d_max = max(ks)
    tokens, rounds, drafted = _prompt_arrays(acc, ks, d_max)
    t_round, filled = by_drafted_matrix(timing["round_ms_by_drafted"], d_max)  # [R, D]
    plain_ms = np.asarray(timing["plain_ms_per_token"]["samples"], float)  # [R]
    plain = median_ci(plain_ms, confidence, seed)
    t_plain = plain["median"]
    expected = rounds.sum(0)  # [K]
    e_point = tokens.sum() / expected  # [K]: = the acceptance JSON's E(k)
    share = drafted.sum(0) / expected[:, None]  # [K, D]: share of rounds drafting d at k
    round_point = np.median(t_round @ share.T, axis=0)  # [K]
    # Bootstrap: prompt weights (acceptance) and repeat indices (timing), drawn independently.
    rng = np.random.default_rng(seed)
    n_prompts = tokens.size
    w = rng.multinomial(n_prompts, np.full(n_prompts, 1 / n_prompts), size=resamples).astype(float) \
        if n_prompts >= 2 else np.ones((resamples, n_prompts))
    idx = rng.integers(0, plain_ms.size, (resamples, plain_ms.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        share_b = np.einsum("bp,pkd->bkd", w, drafted) / (w @ rounds)[..., None]
        # E(k)'s part of each replicate is a draw from the acceptance stage's own t interval (one
        # t draw per replicate, shared by every k): a bootstrap of E over few prompts is too narrow.
        if n_prompts >= 2:
            t_b = rng.standard_t(n_prompts - 1, size=resamples)
            e_c = np.stack([ratio_t_draws(tokens, rounds[:, j], e_point[j], t_b, log_above=1.0,
                                          bounds=(1.0, k + 1.0))
                            for j, k in enumerate(ks)], axis=1)  # [B, K]: feasible, in [1, k + 1]
        else:
            e_c = np.broadcast_to(e_point, (resamples, len(ks)))
        if noise is None:  # the timing part: this table's own repeats, resampled
            round_b = np.median(np.einsum("bkd,brd->bkr", share_b, t_round[idx]), axis=2)  # [B, K]
            ms_c = round_b / e_c
            sp_c = np.median(plain_ms[idx], axis=1)[:, None] / ms_c
        else:
            # Pooled noise: a replicate's round time moves with its resampled drafted shares and a
            # t draw of the median over n repeats; the ratio plain / round by its own draw.
            n_rep = int(min(plain_ms.size, t_round.shape[0]))
            t_med = np.median(t_round, axis=0)  # [D]
            moved = (share_b @ t_med) / (share @ t_med)[None, :]  # [B, K]
            round_b = round_point[None, :] * moved * timing_factors(rng, noise["round_sd"], n_rep, noise["df"],
                                                                     resamples)[:, None]
            ratio = (t_plain / round_point)[None, :] / moved * timing_factors(rng, noise["ratio_sd"], n_rep,
                                                                               noise["df"], resamples)[:, None]
            ms_c, sp_c = round_b / e_c, ratio * e_c
    alphas = _position_rates(acc.get("per_position") or [])
    lat_modes = {int(r["k"]): r.get("run_mode") for r in timing.get("rows", [])}
    c = _cost_ratio(by_drafted_matrix(timing.get("draft_ms_by_drafted") or {}, d_max)[0]
                    if timing.get("draft_ms_by_drafted") else None, t_plain)

    def ci(boot: np.ndarray, point: float) -> list[float]:  # undefined ratios dropped
        return percentile_interval(boot, confidence, point, drop_nonfinite=True, too_few=(point, point))

    rows = []
    prev_round, prev_tokens = t_plain, 1.0  # k = 0 is plain decoding
    for j, k in enumerate(ks):
        tokens_k, r_med = float(e_point[j]), float(round_point[j])
        ms_tok = r_med / tokens_k
        gained = tokens_k - prev_tokens
        marginal = (r_med - prev_round) / gained if gained > 1e-12 else None
        row = {
            "k": k,
            "tokens_per_round": tokens_k,
            "tokens_per_round_ci": ratio_t_interval(tokens, rounds[:, j], tokens_k, confidence, (1.0, k + 1.0),
                                                    log_above=1.0),
            "round_ms": r_med,
            "round_ms_ci": ci(round_b[:, j], r_med),
            "mean_drafted": float(share[j] @ np.arange(d_max + 1)),
            "ms_per_token": ms_tok,
            "ms_per_token_ci": ci(ms_c[:, j], ms_tok),
            "speedup": t_plain / ms_tok,
            "speedup_ci": ci(sp_c[:, j], t_plain / ms_tok),
            "timing_repeats": int(min(plain_ms.size, t_round.shape[0])),
            "marginal_ms_per_token": marginal,
            # k-1 -> k lowers ms/token iff a marginal token costs less than the average one at k-1.
            "marginal_pays": marginal is not None and marginal < prev_round / prev_tokens,
            "marginal_beats_plain": marginal is not None and marginal < t_plain,
            **compare(lat_modes.get(k), timing.get("plain_run_mode"), ("speculative", "plain")),
        }
        if alphas and c is not None and k <= len(alphas):
            e_pred = 1.0 + float(np.sum(np.cumprod(alphas[:k])))
            row["predicted_tokens_per_round"] = e_pred
            row["predicted_ms_per_token"] = t_plain * (1.0 + k * c) / e_pred
            row["predicted_speedup"] = e_pred / (1.0 + k * c)
        rows.append(row)
        prev_round, prev_tokens = r_med, tokens_k
    return {
        "baseline_ms_per_token": t_plain,
        "baseline_ci": plain["ci"],
        "cost_ratio_c": c,
        "position_rates": alphas,
        "round_ms_by_drafted": np.median(t_round, axis=0).tolist(),
        "round_ms_interpolated_d": filled,
        "prompts": n_prompts,
        "ci_unit": ("acceptance prompts and timing repeats, resampled independently" if n_prompts >= 2 else
                    "timing repeats only (one prompt: acceptance not resampled)"),
        "timing_ci": noise_line(noise),
        "ci_method": ("percentile over resampled timing repeats and prompts' drafted shares, E(k) drawn from "
                      "its t interval (n - 1 df, log(E - 1) scale)" if n_prompts >= 2 else
                      "percentile over resampled timing repeats"),
        "rows": rows,
        "recommended_k": recommend_k(rows),
    }


def _position_rates(per_position: list[dict]) -> list[float]:
    """Measured conditional acceptance per position; the mean beta_i where no round reached i."""
    rates = []
    for pos in sorted(per_position, key=lambda p: p["position"]):
        r = pos["conditional"] if pos.get("conditional") is not None else pos.get("expected_beta")
        if r is None:
            break
        rates.append(float(r))
    return rates


def _cost_ratio(draft_ms: np.ndarray | None, t_plain: float) -> float | None:
    """c = one draft step / one plain target step: median over d >= 1 of draft time(d) / (d T_plain)."""
    if draft_ms is None or draft_ms.shape[1] < 2 or t_plain <= 0:
        return None
    per_d = np.median(draft_ms[:, 1:], axis=0) / (np.arange(1, draft_ms.shape[1]) * t_plain)
    return float(np.median(per_d))


def recommend_k(rows: list[dict]) -> int:
    """See RULE (written into every report)."""
    by_k = {r["k"]: r for r in rows if comparable(r)}  # mixed-mode ratios are out
    beats = {k for k, r in by_k.items() if r["speedup_ci"][0] > 1.0 and timed_enough(r)}
    if not beats:
        return 0
    best = min(beats, key=lambda k: (by_k[k]["ms_per_token"], k))
    while best - 1 in beats and (by_k[best - 1]["ms_per_token_ci"][0] <= by_k[best]["ms_per_token_ci"][1]
                                 and by_k[best]["ms_per_token_ci"][0] <= by_k[best - 1]["ms_per_token_ci"][1]):
        best -= 1
    return best


def category_entry(table: dict, acc: dict) -> dict:
    """One category's recommendation at one temperature (CATEGORY_RULE) from its marginal_table and
    acceptance slice block."""
    rows = table["rows"]
    rec = table["recommended_k"]
    usable = [r for r in rows if comparable(r)]
    best = min(usable or rows, key=lambda r: (r["ms_per_token"], r["k"]))
    at = next(r for r in rows if r["k"] == (rec or best["k"]))
    few = acc.get("few_prompts")
    if rec:
        verdict, settled, reason = "speculate", True, f"k = {rec}: speedup CI above 1"
    elif usable and not timed_enough(best):
        verdict, settled = "inconclusive", False
        reason = (f"best k = {best['k']}: one timing repeat (speedup {best['speedup']:.3g}, its CI over prompts "
                  f"alone); a k is recommended, or ruled out, from {MIN_TIMING_REPEATS} repeats on")
    elif usable and all(r["speedup_ci"][1] < 1.0 for r in usable):
        verdict, settled, reason = "do not speculate", True, "every k's speedup CI lies below 1"
    elif not usable:
        verdict, settled, reason = "inconclusive", False, "no k ran like with like with plain decoding"
    else:
        verdict, settled = "inconclusive", False
        reason = (f"best k = {best['k']}: speedup CI [{best['speedup_ci'][0]:.3g}, {best['speedup_ci'][1]:.3g}] "
                  "contains 1")
    if table["prompts"] < 2:
        settled = False
        reason += "; one prompt: the CI covers the timing repeats only, not which prompts were drawn"
    elif few:
        settled = False
        reason += "; too few prompts in this category for its interval to be trusted (few_prompts)"
    out = {"k": rec, "settled": settled, "verdict": verdict, "reason": reason, "at_k": at["k"],
           "best_k": best["k"], "tokens_per_round": at["tokens_per_round"],
           "tokens_per_round_ci": at["tokens_per_round_ci"], "speedup": at["speedup"],
           "speedup_ci": at["speedup_ci"], "ms_per_token": at["ms_per_token"],
           "ms_per_token_ci": at["ms_per_token_ci"], "n_prompts": table["prompts"]}
    out.update({key: acc[key] for key in ("few_prompts", "min_prompts") if key in acc})  # a thin slice's flag
    return out


def by_category(tables: dict[str, dict[str, dict]], slices: dict, categories: list[str] | None) -> dict:
    """{category: {temperature: category_entry}} for every slice but "all", in the workload's order."""
    names = [c for c in (categories or []) if c in tables and c != "all"]
    names += sorted(s for s in tables if s != "all" and s not in names)
    return {c: {t: category_entry(tables[c][t], slices[c][t]) for t in sorted(tables[c], key=float)}
            for c in names}


def _head(acceptance: dict, latency: dict, confidence: float, primary: tuple[str, str], acc_primary: dict) -> dict:
    """The keys every marginal artifact of specq's engine opens with."""
    w = acceptance.get("workload")
    return {"variant": latency.get("variant", acceptance.get("variant")),
            "draft": latency.get("draft", acceptance.get("draft")), "confidence": confidence,
            "primary": {"slice": primary[0], "temperature": primary[1]}, "rule": RULE,
            "workload": {k: v for k, v in w.items() if k != "prompts"} if isinstance(w, dict) else None,
            "acceptance_per_position": acc_primary.get("per_position", [])}


def untimed_report(acceptance: dict, latency: dict, confidence: float = 0.95) -> dict:
    """The marginal artifact of a pair with no timed table, with the acceptance figures that were
    measured: one the latency stage screened out (pipeline/latency/screen.py: recommended_k 0, the
    screen's record under `screened`, its sentence under `screened_note`, k per category not given)
    or one its budget left no time for (`not_timed`: recommended_k None)."""
    slices = acceptance.get("slices") or {}
    primary_slice = "all" if "all" in slices else (sorted(slices)[0] if slices else "all")
    temps = slices.get(primary_slice) or {}
    primary_temp = (min(temps, key=float) if temps else latency.get("primary_temperature")) or "0.0"
    acc_primary = temps.get(primary_temp) or {}
    out = {**_head(acceptance, latency, confidence, (primary_slice, primary_temp), acc_primary), "rows": [],
           "baseline_ms_per_token": None, "baseline_ci": None, "slices": {}, "recommended_k_by_category": None}
    if latency.get("not_timed"):
        return {**out, "recommended_k": None, "not_timed": latency["not_timed"], "recommended_k_by_batch": None}
    rec = latency["screened"]
    plain = [float(x) for x in (rec.get("probe") or {}).get("plain_ms") or []]
    cats = rec.get("categories_not_ruled_out") or []
    return {
        **out, "device": latency.get("device"),
        "baseline_ms_per_token": float(np.median(plain)) if plain else None,
        "baseline_ci": [min(plain), max(plain)] if plain else None,
        "baseline_source": "the screen's probe (plain decode steps on one prompt; the range of its repeats), "
                           "not a timed grid",
        "recommended_k": 0, "screened": rec, "screened_note": screened_note(rec),
        "recommended_k_by_category_note": (
            "k per category: not given, the pair was screened on the pooled slice 'all'" +
            (f" (the bound does not rule out {', '.join(cats)} on their own acceptance CI)" if cats else "")),
        "category_rule": CATEGORY_RULE, "direct_check": acc_primary.get("direct_check", {}),
        "latency_new_tokens": latency.get("new_tokens"), "latency_rows": [],
    }


def pair_report(acceptance: dict, latency: dict, confidence: float = 0.95, noise: dict | None = None) -> dict:
    """The marginal artifact of one pair: the primary table (slice "all", greedy when measured) at
    the top level, one per slice and temperature under "slices"; an untimed pair's: untimed_report."""
    if isinstance(latency, dict) and (latency.get("screened") or latency.get("not_timed")):
        return untimed_report(acceptance if isinstance(acceptance, dict) else {}, latency, confidence)
    try:
        by_temp = latency["by_temperature"]
        slices = acceptance["slices"]
    except (KeyError, TypeError) as e:
        raise StageError(f"marginal: acceptance or latency artifact lacks expected key {e} "
                         "(re-run make acceptance latency)") from None
    if not slices:
        raise StageError("marginal: acceptance artifact has no slices")
    tables: dict[str, dict[str, dict]] = {}
    for slice_name, temps in slices.items():
        for temp_key, acc in temps.items():
            if temp_key not in by_temp:
                raise StageError(f"marginal: latency has no round times at temperature {temp_key} "
                                 f"(it has {', '.join(by_temp)}): re-run make latency")
            try:
                table = tables.setdefault(slice_name, {})[temp_key] = marginal_table(acc, by_temp[temp_key], confidence, noise=noise)
                table.update({key: acc[key] for key in ("few_prompts", "min_prompts") if key in acc})
            except (KeyError, TypeError, ValueError) as e:
                raise StageError(f"marginal: acceptance slice {slice_name}/{temp_key} or latency at T={temp_key} "
                                 f"lacks {e} (re-run make acceptance latency)") from None
    primary_slice = "all" if "all" in tables else sorted(tables)[0]
    temps = tables[primary_slice]
    primary_temp = min(temps, key=lambda t: float(t))  # greedy (0.0) when it was measured
    primary = temps[primary_temp]
    lat_rows = {int(r["k"]): r for r in by_temp[primary_temp].get("rows", [])}
    for row in primary["rows"]:
        measured = lat_rows.get(row["k"], {})
        if "tokens_per_round" in measured:
            row["measured_tokens_per_round"] = measured["tokens_per_round"]
        if isinstance(measured.get("ms_per_token"), dict):
            row["measured_ms_per_token"] = measured["ms_per_token"]["median"]
    acc_primary = slices[primary_slice][primary_temp]
    return {
        **_head(acceptance, latency, confidence, (primary_slice, primary_temp), acc_primary),
        "device": latency.get("device"), **primary, "timing_noise": noise, "slices": tables,
        "recommended_k_by_category": by_category(tables, slices, (acceptance.get("workload") or {}).get("categories")),
        "category_rule": CATEGORY_RULE, "direct_check": acc_primary.get("direct_check", {}),
        "ks_not_timed": latency.get("ks_not_timed") or {},
        "ks_not_timed_note": cut_line(latency.get("ks_timed") or [], latency.get("ks_not_timed") or {}) or None,
        "latency_new_tokens": latency.get("new_tokens"),
        "latency_rows": [{k: r[k] for k in ("k", "draft_ms", "verify_ms", "overhead_ms", "round_ms") if k in r}
                         for r in by_temp[primary_temp].get("rows", [])],
    }

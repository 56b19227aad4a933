"""The marginal stage's batching part: k per batch size, the vLLM table, what pays at a request
rate, and the simulation's check against the measured closed loop.

    python -m pipeline marginal --run runs/smollm2-135m --config configs/default.yaml

For a pair with `latency/batched/<pair>.json`, `batching_report` returns the keys the marginal
JSON gets: `recommended_k_by_batch`, `speculative_config_by_batch`, `by_batch`
(pipeline/serving/batch_k.py) and `serving`: request lengths from the workload
(pipeline/serving/lengths.py), an open-loop `sweep` and `crossover` per policy, and `validation`,
the simulation replayed wave by wave against the closed loop and judged family-wise over the
pair's rows. Method: docs/methods/batching.md.
"""
from __future__ import annotations

import numpy as np

from pipeline.latency.modes import comparable
from pipeline.latency.screen import screened_note
from pipeline.serving.batch_k import by_batch_section, prefix_rates, speculative_config
from pipeline.serving.simulation import (LENGTHS_FIXED, CostModel, Request, assumptions, crossover, open_loop,
                                         plain_capacity_rps, simulate, summarize, table_policy)
from pipeline.stats.intervals import percentile_bootstrap, percentile_interval


def _policies(fixed_k: int, by_batch: dict[int, int]) -> dict[str, tuple]:
    table_on = any(by_batch.values())
    return {"plain": (lambda b: 0, False),
            f"k={fixed_k}": (lambda b: fixed_k, True),
            "per-batch k": (table_policy(by_batch), table_on)}


def sweep(costs: CostModel, policies: dict, serving, seed: int, pairs: list | None = None) -> dict:
    """pairs: the workload's (prompt, output) lengths each request draws from (None: fixed lengths)."""
    if pairs:
        mean_prompt, mean_output = np.asarray(pairs, dtype=float).mean(axis=0)
    else:
        mean_prompt, mean_output = serving.prompt_tokens, serving.output_tokens
    cap = plain_capacity_rps(costs, mean_prompt, mean_output)
    rates = list(serving.rates) or [float(cap * f) for f in np.linspace(0.05, serving.max_load, serving.rate_points)]
    rows = []
    for ri, rate in enumerate(rates):
        row = {"rate_rps": rate}
        for name, (policy, spec) in policies.items():
            pooled, goodput = [], []
            for s in range(serving.seeds):
                reqs = open_loop(rate, serving.requests, serving.prompt_tokens, serving.output_tokens,
                                 np.random.default_rng([seed, ri, s]), lengths=pairs or None)
                done = simulate(costs, policy, reqs, np.random.default_rng([seed, ri, s, 1]), spec)
                pooled += done
                goodput.append(summarize(done, serving.slo_ttft_ms, serving.slo_tpot_ms)["goodput_rps"])
            summary = summarize(pooled, serving.slo_ttft_ms, serving.slo_tpot_ms)
            summary["goodput_rps"] = float(np.mean(goodput))
            row[name] = summary
        rows.append(row)
    cross = {}
    for name in policies:
        if name == "plain":
            continue
        cross[name] = {
            "tpot_p50": crossover(rates, [r["plain"]["tpot_p50_ms"] for r in rows], [r[name]["tpot_p50_ms"] for r in rows]),
            # Higher goodput is better: compare its negatives.
            "goodput": crossover(rates, [-r["plain"]["goodput_rps"] for r in rows], [-r[name]["goodput_rps"] for r in rows]),
        }
    return {"plain_capacity_rps": cap, "rates_rps": rates, "rows": rows, "crossover": cross}


def _wave(costs: CostModel, loop: dict, mode: str, wave: dict, rng: np.random.Generator,
          replay: bool) -> tuple[float, float]:
    """Simulated TPOT and TTFT of one closed-loop wave: B requests of the wave's prompt length that
    arrive together (at concurrency B with equal output lengths a closed loop runs its waves one
    after another, so each wave is a batch of its own). replay: every speculative round keeps the
    tokens the measured wave's round kept; else they are drawn from the acceptance model."""
    b, k = loop["batch"], loop["k"]
    spec = mode == "speculative"
    reqs = [Request(0.0, wave["prompt_tokens"], loop["new_tokens"]) for _ in range(b)]
    gains = None
    if spec and replay and wave.get("kept_per_round") is not None:
        widths = wave.get("width_per_round")
        gains = iter(zip(wave["kept_per_round"], widths) if widths is not None else wave["kept_per_round"])
    done = simulate(costs, (lambda n: k) if spec else (lambda n: 0), reqs, rng, spec, max_batch=b, gains=gains)
    return float(np.median([r.tpot for r in done])), float(np.median([r.ttft for r in done]))


def _rel_median(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.median(pred) / np.median(meas) - 1.0)


def validate(grid: dict, batched: dict, prefix: np.ndarray, resamples: int, confidence: float, seed: int,
             accept_by_k: dict | None = None, accept_by_batch: dict | None = None,
             width_by_batch: dict | None = None) -> list[dict]:
    """The simulation against the latency stage's closed loop, wave by wave (module docstring).

    Per (B, mode) and metric (TPOT, TTFT): `predicted` is the median over waves of the simulated
    wave (point costs), `relative_error` = predicted / measured median - 1, and `relative_error_ci`
    its percentile-bootstrap CI whose resampling unit is the wave (waves drawn with replacement,
    predicted and measured of the same waves) together with the timing repeats behind every cost
    (each resample re-draws the costs from their repeats). `agrees`: that CI contains 0. For the
    speculative rows the simulated waves replay the rounds each measured wave had (verify width and
    tokens kept per row), so the check is on the cost model and the scheduler; the acceptance model is checked
    in `acceptance_check` (the simulation's own draws against the waves' tokens per round) and
    in `unconditional` (TPOT with the rounds drawn, in the same resamples), both reported, not gated."""
    point_costs = CostModel.from_artifacts(grid, batched, prefix, accept_by_k=accept_by_k,
                                           accept_by_batch=accept_by_batch, width_by_batch=width_by_batch)
    loops = batched.get("closed_loop") or []
    # Family-wise: every TPOT row's CI at 1 - alpha / m (Bonferroni over the m rows, plain and
    # speculative per loop), so that when the model is right all m agree together with probability
    # >= `confidence` if each row's interval is exact (m rows at `confidence` each would all agree
    # only about confidence^m of the time: 0.81 for four). Percentile tails from few resamples make
    # it a little less (module doc).
    family_level = 1.0 - (1.0 - confidence) / max(1, 2 * len(loops))
    out = []
    for li, loop in enumerate(loops):
        for mi, mode in enumerate(("plain", "speculative")):
            spec = mode == "speculative"
            waves = sorted(loop[mode]["waves"], key=lambda w: w["wave"])
            replay = spec and all(w.get("kept_per_round") is not None for w in waves)
            meas = np.array([[w["tpot_ms"], w["ttft_ms"]] for w in waves])
            pred = np.array([_wave(point_costs, loop, mode, w, np.random.default_rng([seed, li, mi, j]), replay)
                             for j, w in enumerate(waves)])
            boot, spread, drawn_boot = [], [], []
            for i in range(resamples):
                rng = np.random.default_rng([seed, li, mi, i, 7])
                costs = CostModel.from_artifacts(grid, batched, prefix, rng, accept_by_k, accept_by_batch,
                                                 width_by_batch)
                sim = np.array([_wave(costs, loop, mode, w, rng, replay) for w in waves])
                spread.append(np.median(sim, axis=0))
                idx = rng.integers(0, len(waves), len(waves))
                boot.append([_rel_median(sim[idx, j], meas[idx, j]) for j in range(2)])
                if spec:  # the same resample with the rounds drawn (already so when nothing is replayed)
                    drawn = np.array([_wave(costs, loop, mode, w, rng, False)[0] for w in waves]) if replay else sim[:, 0]
                    drawn_boot.append(_rel_median(drawn[idx], meas[idx, 0]))
            boot, spread = np.array(boot), np.array(spread)
            row = {"batch": loop["batch"], "k": loop["k"] if spec else 0, "mode": mode,
                   "waves": loop["waves"], "requests": loop["requests"],
                   "rounds": "replayed from each measured wave" if replay else (
                       "drawn from the acceptance model" if spec else "plain steps")}
            for j, metric in enumerate(("tpot_ms", "ttft_ms")):
                m = loop[mode][metric]
                p = float(np.median(pred[:, j]))
                rel_ci = percentile_interval(boot[:, j], confidence)
                interval = percentile_interval(spread[:, j], confidence)
                row[metric] = {"predicted": p, "prediction_interval": interval, "measured": m["median"],
                               "measured_ci": m["ci"], "relative_error": p / m["median"] - 1.0,
                               "relative_error_ci": rel_ci, "agrees": rel_ci[0] <= 0.0 <= rel_ci[1],
                               "within_measured_ci": m["ci"][0] <= p <= m["ci"][1],
                               "intervals_overlap": interval[0] <= m["ci"][1] and m["ci"][0] <= interval[1],
                               "per_wave": {"predicted": pred[:, j].tolist(), "measured": meas[:, j].tolist()}}
            family_ci = percentile_interval(boot[:, 0], family_level)
            row["tpot_ms"].update({"relative_error_ci_familywise": family_ci, "familywise_confidence": family_level,
                                   "agrees_familywise": family_ci[0] <= 0.0 <= family_ci[1]})
            if spec:
                # Point prediction with drawn rounds: point costs, the median over up to 20 draws.
                drawn_point = np.array([[_wave(point_costs, loop, mode, w, np.random.default_rng([seed, li, mi, j, r]),
                                               False)[0] for j, w in enumerate(waves)]
                                        for r in range(max(1, min(resamples, 20)))])
                p = float(np.median(np.median(drawn_point, axis=1)))
                ci = percentile_interval(np.asarray(drawn_boot), confidence)
                row["unconditional"] = {"tpot_predicted": p, "relative_error": p / float(np.median(meas[:, 0])) - 1.0,
                                        "relative_error_ci": ci, "agrees": ci[0] <= 0.0 <= ci[1]}
                row["acceptance_check"] = _acceptance_check(point_costs, loop, waves, confidence, seed)
                cell = next((c for c in batched["cells"] if c["batch"] == loop["batch"] and c["k"] == loop["k"]), None)
                loop_rounds = [w["round_ms"] for w in waves if w.get("round_ms") is not None]
                row["round_ms"] = {"cells": cell["round_ms"]["median"] if cell else None,
                                   "model": float(point_costs._at(point_costs.round_ms[loop["k"]], loop["batch"]))
                                   if loop["k"] in point_costs.round_ms else None,
                                   "closed_loop": float(np.median(loop_rounds)) if loop_rounds else None}
            out.append(row)
    return out


def _acceptance_check(costs: CostModel, loop: dict, waves: list[dict], confidence: float, seed: int) -> dict:
    """Tokens kept per row per full-k round: the measured waves' mean (percentile-bootstrap CI over
    waves) against the acceptance model's mean at (B, k) (the exact batch chain where the
    acceptance JSON has it)."""
    b, k = loop["batch"], loop["k"]
    per_wave = []
    for w in waves:
        kept = [g for g, kk in zip(w.get("kept_per_round") or [], w.get("k_per_round") or []) if kk == k]
        if kept:
            per_wave.append(float(np.mean(kept)))
    if b > 1 and costs.has_batch_chain(b, k):
        source = "exact batch chain"
    else:
        source = "B = 1 round chain" if b == 1 else "independent B = 1 draws per row"
    out = {"model_tokens_per_round": costs.mean_kept_per_row(k, b), "model_source": source,
           "measured_tokens_per_round": None, "measured_ci": None,
           "note": "the closed loop's prompts are not the acceptance stage's: a check of how far acceptance moves "
                   "between prompt sets, not of the chain"}
    if per_wave:
        x = np.asarray(per_wave)
        mean = float(x.mean())
        ci = (percentile_bootstrap((x,), np.mean, confidence, seed) if x.size > 1 and np.ptp(x) > 0
              else (mean, mean))
        out.update(measured_tokens_per_round=mean, measured_ci=[float(ci[0]), float(ci[1])])
    return out


def _cost_sources(grid: dict, batched: dict) -> dict:
    """Whether the simulation's costs (plain steps from the grid, rounds from the batched cells)
    were timed the same way: compiled, eager or mixed per source (pipeline/latency/modes.py)."""
    modes = {"plain grid": sorted({c["run_mode"]["steps"] for c in grid.get("grid", []) if c.get("run_mode")}),
             "batched cells": sorted({c["run_mode"]["steps"] for c in batched.get("cells", []) if c.get("run_mode")})}
    if not all(modes.values()):
        return {"like_with_like": None, "modes": modes}
    both = set(modes["plain grid"]) | set(modes["batched cells"])
    return {"like_with_like": len(both) == 1 and "mixed" not in both, "modes": modes}


def batching_report(report: dict, acceptance_slice: dict, batched: dict, grid: dict, serving, confidence: float,
                    seed: int = 0, lengths: dict | None = None, noise: dict | None = None) -> dict:
    """The keys the marginal JSON gets for one pair (module docstring). lengths: what
    pipeline/serving/lengths.py request_lengths returns for the pair (None: fixed lengths)."""
    lengths = lengths or {"lengths": "fixed", "pairs": None, "source": None}
    pairs = lengths.get("pairs") if lengths.get("lengths") == "workload" else None
    section = by_batch_section(acceptance_slice, batched, confidence, seed, at_one=report.get("recommended_k"),
                               noise=noise)
    rows = section["by_batch"]["rows"]
    by_batch = {int(b): k for b, k in section["recommended_k_by_batch"].items()}
    fixed_k = report.get("recommended_k") or 0
    fixed_note = "recommended k at B = 1"
    if fixed_k == 0 or fixed_k not in {r["k"] for r in rows}:
        b1 = [r for r in rows if r["batch"] == min(by_batch)]
        # Mixed-mode rows (like_with_like false) are out; if every row is, plain decoding (k = 0).
        usable = [r for r in b1 if comparable(r)]
        fixed_k = min(usable, key=lambda r: (r["ms_per_token"], r["k"]))["k"] if usable else 0
        fixed_note = (f"fastest k at B = {min(by_batch)} (no k is recommended there)" if usable else
                      f"plain decoding: no k at B = {min(by_batch)} ran like with like")
    prefix = prefix_rates(acceptance_slice.get("per_position") or [], max(r["k"] for r in rows))
    accept_by_k = acceptance_slice.get("accepted_distribution") or None
    accept_by_batch = acceptance_slice.get("accepted_distribution_by_batch") or None
    width_by_batch = acceptance_slice.get("width_distribution_by_batch") or None
    costs = CostModel.from_artifacts(grid, batched, prefix, accept_by_k=accept_by_k, accept_by_batch=accept_by_batch,
                                     width_by_batch=width_by_batch)
    policies = _policies(fixed_k, by_batch)
    result = sweep(costs, policies, serving, seed, pairs)
    val = validate(grid, batched, prefix, serving.validation_resamples, confidence, seed, accept_by_k, accept_by_batch,
                   width_by_batch)
    section["serving"] = {
        **result,
        "cost_sources": _cost_sources(grid, batched),
        "policies": {"plain": "no speculation", f"k={fixed_k}": fixed_note,
                     "per-batch k": f"recommended_k_by_batch {section['recommended_k_by_batch']}"},
        "fixed_k": fixed_k,
        "slo": {"ttft_ms": serving.slo_ttft_ms, "tpot_ms": serving.slo_tpot_ms},
        "lengths": "workload" if pairs else "fixed",
        "lengths_source": lengths.get("source") or LENGTHS_FIXED,
        "workload": {**({"name": lengths.get("workload"), "n_prompts": len(pairs),
                         "prompt_tokens_mean": lengths["mean_prompt_tokens"],
                         "output_tokens_mean": lengths["mean_output_tokens"],
                         "prompt_tokens_range": [min(p for p, _ in pairs), max(p for p, _ in pairs)],
                         "output_tokens_range": [min(o for _, o in pairs), max(o for _, o in pairs)],
                         "without_lengths": lengths.get("without_lengths", 0),
                         "outputs_raised_to_two": lengths.get("outputs_raised_to_two", 0)} if pairs else
                        {"prompt_tokens": serving.prompt_tokens, "output_tokens": serving.output_tokens}),
                     "requests_per_run": serving.requests, "runs_per_rate": serving.seeds,
                     "max_batch": costs.max_batch},
        "validation_lengths": "the closed loop's own: each wave's prompt length and the latency stage's new_tokens, "
                              "as measured (not the workload's)",
        "acceptance": {"accept_pmf": costs.accept_pmf.tolist(),
                       "accept_pmf_by_k": {str(k): list(map(float, v)) for k, v in (accept_by_k or {}).items()},
                       "accept_pmf_by_batch": {str(b): {str(k): list(map(float, v)) for k, v in (by_k or {}).items()}
                                               for b, by_k in (accept_by_batch or {}).items() if by_k},
                       "draws": ("a round of b > 1 rows at k: n_min from the acceptance stage's exact batch round "
                                 "chain at (b, k) (accepted_distribution_by_batch)" if accept_by_batch else
                                 "a round of b > 1 rows: b independent B = 1 draws, n_min their minimum (acceptance "
                                 "JSON without accepted_distribution_by_batch)") + "; one row at k: " +
                                ("the acceptance round chain's per-round distribution at that k" if accept_by_k
                                 else "the k_max rounds' distribution clipped at k (acceptance JSON without "
                                      "accepted_distribution)")},
        "assumptions": assumptions(lengths.get("source") if pairs else None),
        "validation": val,
        # The gated check: TPOT with each wave's rounds replayed (cost model + scheduler), family-wise
        # over the pair's rows; `validation_agrees_each_row` is the per-row rule at `confidence`.
        "validation_agrees": bool(val) and all(v["tpot_ms"]["agrees_familywise"] for v in val),
        "validation_agrees_each_row": bool(val) and all(v["tpot_ms"]["agrees"] for v in val),
        "validation_rule": ("per closed-loop (B, mode): the percentile-bootstrap CI of predicted / measured median "
                            "TPOT - 1 (resampling waves and the cost repeats) contains 0, every row's CI at "
                            f"1 - {1 - confidence:.2g}/m for the pair's m = {len(val)} rows (Bonferroni: aims at all agreeing "
                            f"with probability {confidence:g} when the model is right)"),
        "validation_agrees_unconditional": bool(val) and all(v["unconditional"]["agrees"] for v in val
                                                             if "unconditional" in v),
    }
    return section


SERVING_SCREENED = ("not simulated: the pair was screened under batching (no (B, k) can pay), so every batch size "
                    "decodes plainly (k = 0) and each policy of the simulated server would be plain decoding")


def screened_batching(batched: dict) -> dict:
    """The marginal JSON's batching keys for a pair whose batched cells the latency stage screened
    out (pipeline/latency/screen.py): k = 0 at every batch size, the vLLM table that says to leave
    speculation off, the screen record (`by_batch_screened`) and no simulation (`serving` None,
    `serving_note` says why)."""
    rec = batched["screened"]
    sizes = sorted(int(b) for b in (rec.get("batch_sizes") or batched.get("batch_sizes") or []))
    table = speculative_config({b: 0 for b in sizes})
    table["note"] = (f"Screened: {screened_note(rec)}; leave speculative decoding off for this draft "
                     "(no speculative_config).")
    return {"recommended_k_by_batch": {str(b): 0 for b in sizes}, "speculative_config_by_batch": table,
            "by_batch": None, "by_batch_screened": rec, "by_batch_note": screened_note(rec),
            "serving": None, "serving_note": SERVING_SCREENED}

"""The marginal stage's batching part: k per batch size, the vLLM table, what pays at a request
rate, and the simulation's check against the measured closed loop.

    python -m pipeline marginal --run runs/smollm2-135m --config configs/default.yaml

For a pair with `latency/batched/<pair>.json`, `batching_report` returns the keys the marginal
JSON gets beside `recommended_k`: `recommended_k_by_batch`, `speculative_config_by_batch`,
`by_batch` (pipeline/batch_k.py) and `serving`:

- `sweep`: open-loop Poisson rates (serving.rates, or serving.rate_points rates up to
  serving.max_load x the plain server's full-batch capacity), serving.seeds runs of
  serving.requests requests per rate and policy, the same arrival times and acceptance draws for
  every policy (common random numbers): TTFT and TPOT p50/p99 over the pooled requests, goodput
  (requests meeting serving.slo_ttft_ms and serving.slo_tpot_ms, per second) averaged over runs.
  Policies: plain, speculative at one k (the recommended k at B = 1, or the fastest k there
  when none is recommended), and the per-batch k table.
- `crossover`: per speculative policy, the rate above which it stops paying on TPOT p50 and on
  goodput (pipeline/serving_sim.py crossover).
- Acceptance draws: per k, the acceptance stage's `accepted_distribution` at that k (the round
  chain at k, so B = 1 agrees with the exact E(k)); rows are drawn independently, so at B > 1
  the simulation's tokens per row per round is the independent-draws figure, not by_batch's
  exact E_B (ASSUMPTIONS in pipeline/serving_sim.py).
- `validation`: the simulation in closed-loop mode on the latency stage's closed-loop requests
  (same B, k, prompt lengths per wave, output length) against the measured TPOT and TTFT per wave:
  the predicted median (point costs, acceptance draws over serving.validation_resamples runs)
  and a prediction interval (costs resampled from their timing repeats as well), the measured
  median with its CI over waves, and whether the prediction lies inside that CI.
"""
from __future__ import annotations

import numpy as np

from pipeline.batch_k import by_batch_section, prefix_rates
from pipeline.serving_sim import (ASSUMPTIONS, CostModel, Request, crossover, open_loop, plain_capacity_rps,
                                  simulate, summarize, table_policy)


def _policies(fixed_k: int, by_batch: dict[int, int]) -> dict[str, tuple]:
    table_on = any(by_batch.values())
    return {"plain": (lambda b: 0, False),
            f"k={fixed_k}": (lambda b: fixed_k, True),
            "per-batch k": (table_policy(by_batch), table_on)}


def sweep(costs: CostModel, policies: dict, serving, seed: int) -> dict:
    cap = plain_capacity_rps(costs, serving.prompt_tokens, serving.output_tokens)
    rates = list(serving.rates) or [float(cap * f) for f in np.linspace(0.05, serving.max_load, serving.rate_points)]
    rows = []
    for ri, rate in enumerate(rates):
        row = {"rate_rps": rate}
        for name, (policy, spec) in policies.items():
            pooled, goodput = [], []
            for s in range(serving.seeds):
                reqs = open_loop(rate, serving.requests, serving.prompt_tokens, serving.output_tokens,
                                 np.random.default_rng([seed, ri, s]))
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


def _closed_run(costs: CostModel, loop: dict, mode: str, rng: np.random.Generator) -> tuple[float, float]:
    """Median TPOT and TTFT over waves of the simulated closed loop (as the measurement is summarised)."""
    b, k, waves = loop["batch"], loop["k"], loop[mode]["waves"]
    reqs = [Request(0.0, w["prompt_tokens"], loop["new_tokens"]) for w in waves for _ in range(b)]
    policy = (lambda n: k) if mode == "speculative" else (lambda n: 0)
    done = simulate(costs, policy, reqs[:b], rng, mode == "speculative", concurrency=b, follow_ups=reqs[b:],
                    max_batch=b)
    order = {id(r): i for i, r in enumerate(reqs)}
    done.sort(key=lambda r: order[id(r)])
    tpot = [np.median([r.tpot for r in done[i:i + b]]) for i in range(0, len(done), b)]
    ttft = [np.median([r.ttft for r in done[i:i + b]]) for i in range(0, len(done), b)]
    return float(np.median(tpot)), float(np.median(ttft))


def validate(grid: dict, batched: dict, prefix: np.ndarray, resamples: int, confidence: float, seed: int,
             accept_by_k: dict | None = None) -> list[dict]:
    point_costs = CostModel.from_artifacts(grid, batched, prefix, accept_by_k=accept_by_k)
    out = []
    for li, loop in enumerate(batched.get("closed_loop") or []):
        for mi, mode in enumerate(("plain", "speculative")):
            point = [_closed_run(point_costs, loop, mode, np.random.default_rng([seed, li, mi, i]))
                     for i in range(resamples)]
            spread = []
            for i in range(resamples):
                rng = np.random.default_rng([seed, li, mi, i, 7])
                spread.append(_closed_run(CostModel.from_artifacts(grid, batched, prefix, rng, accept_by_k), loop, mode,
                                          rng))
            lo_q, hi_q = (1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100
            row = {"batch": loop["batch"], "k": loop["k"] if mode == "speculative" else 0, "mode": mode,
                   "waves": loop["waves"], "requests": loop["requests"]}
            for j, metric in enumerate(("tpot_ms", "ttft_ms")):
                pred = float(np.median([p[j] for p in point]))
                interval = [float(np.percentile([s[j] for s in spread], lo_q)),
                            float(np.percentile([s[j] for s in spread], hi_q))]
                meas = loop[mode][metric]
                row[metric] = {"predicted": pred, "prediction_interval": interval, "measured": meas["median"],
                               "measured_ci": meas["ci"], "relative_error": pred / meas["median"] - 1.0,
                               "within_measured_ci": meas["ci"][0] <= pred <= meas["ci"][1],
                               "intervals_overlap": interval[0] <= meas["ci"][1] and meas["ci"][0] <= interval[1]}
            out.append(row)
    return out


def batching_report(report: dict, acceptance_slice: dict, batched: dict, grid: dict, serving, confidence: float,
                    seed: int = 0) -> dict:
    """The keys the marginal JSON gets for one pair (module docstring)."""
    section = by_batch_section(acceptance_slice, batched, confidence, seed)
    rows = section["by_batch"]["rows"]
    by_batch = {int(b): k for b, k in section["recommended_k_by_batch"].items()}
    fixed_k = report.get("recommended_k") or 0
    fixed_note = "recommended k at B = 1"
    if fixed_k == 0 or fixed_k not in {r["k"] for r in rows}:
        b1 = [r for r in rows if r["batch"] == min(by_batch)]
        fixed_k = min(b1, key=lambda r: (r["ms_per_token"], r["k"]))["k"]
        fixed_note = f"fastest k at B = {min(by_batch)} (no k is recommended there)"
    prefix = prefix_rates(acceptance_slice.get("per_position") or [], max(r["k"] for r in rows))
    accept_by_k = acceptance_slice.get("accepted_distribution") or None
    costs = CostModel.from_artifacts(grid, batched, prefix, accept_by_k=accept_by_k)
    policies = _policies(fixed_k, by_batch)
    result = sweep(costs, policies, serving, seed)
    val = validate(grid, batched, prefix, serving.validation_resamples, confidence, seed, accept_by_k)
    section["serving"] = {
        **result,
        "policies": {"plain": "no speculation", f"k={fixed_k}": fixed_note,
                     "per-batch k": f"recommended_k_by_batch {section['recommended_k_by_batch']}"},
        "fixed_k": fixed_k,
        "slo": {"ttft_ms": serving.slo_ttft_ms, "tpot_ms": serving.slo_tpot_ms},
        "workload": {"prompt_tokens": serving.prompt_tokens, "output_tokens": serving.output_tokens,
                     "requests_per_run": serving.requests, "runs_per_rate": serving.seeds,
                     "max_batch": costs.max_batch},
        "acceptance": {"accept_pmf": costs.accept_pmf.tolist(),
                       "accept_pmf_by_k": {str(k): list(map(float, v)) for k, v in (accept_by_k or {}).items()},
                       "draws": ("per k: the acceptance round chain's per-round distribution at that k"
                                 if accept_by_k else "the k_max rounds' distribution clipped at k (older acceptance "
                                 "JSON without accepted_distribution)") +
                                "; rows drawn independently (tokens per row per round at B > 1 is not the exact "
                                "E_B of by_batch)"},
        "assumptions": ASSUMPTIONS,
        "validation": val,
        "validation_agrees": bool(val) and all(v["tpot_ms"]["within_measured_ci"] for v in val),
    }
    return section

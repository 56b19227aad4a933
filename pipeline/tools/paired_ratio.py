"""Paired speed ratios for the benches (pipeline/tools/bench.py, pipeline/tools/bench_quality.py).

    from pipeline.tools.paired_ratio import ratio_summary, run_order, token_check
    s = ratio_summary(baseline_s=[2.0, 2.1, 1.9], candidate_s=[1.0, 1.1, 0.9], goal=1.5)
    s["ratio"], s["ci"], s["bootstrap_ci"], s["goal_status"]

A repeat, one candidate and one baseline run back to back (order alternating: `run_order`), is the
unit of every interval: `ratio` is the geometric mean of baseline / candidate seconds, `ci` a t
interval on the mean log ratio (the primary one: with a handful of repeats the percentile
bootstrap, `bootstrap_ci`, is too narrow). `goal_status` is "met" when the CI's lower end reaches
the goal, "not met" when its upper end is below it, else "inconclusive".
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

UNIT = "one paired repeat (a candidate run and a baseline run back to back, order alternating)"


def paired_ratios(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> list[float]:
    """Per-repeat baseline / candidate time ratios (> 1: the candidate is faster)."""
    if len(baseline_s) != len(candidate_s):
        raise ValueError(f"paired ratios need as many baseline as candidate times "
                         f"({len(baseline_s)} vs {len(candidate_s)})")
    if not baseline_s:
        raise ValueError("paired ratios need at least one repeat")
    if any(not (t > 0 and math.isfinite(t)) for t in (*baseline_s, *candidate_s)):
        raise ValueError("paired ratios need positive, finite times")
    return [b / c for b, c in zip(baseline_s, candidate_s)]


def goal_status(point: float, ci: Sequence[float] | None, goal: float) -> str:
    """met / not met / inconclusive against `goal`, read from the interval (see module doc)."""
    if ci is None or ci[0] is None:
        return "met (one repeat: no interval)" if point >= goal else "not met (one repeat: no interval)"
    if ci[0] >= goal:
        return "met"
    if ci[1] < goal:
        return "not met"
    return "inconclusive"


def ratio_summary(baseline_s: Sequence[float], candidate_s: Sequence[float], goal: float,
                  confidence: float = 0.95, seed: int = 0) -> dict:
    """The paired ratio of a bench row: point, intervals, goal (module doc)."""
    from pipeline.stats.intervals import mean_t_interval, percentile_bootstrap

    ratios = paired_ratios(baseline_s, candidate_s)
    logs = np.log(np.asarray(ratios, dtype=float))
    mean_log, t_ci = mean_t_interval(logs, confidence)
    point = math.exp(mean_log)
    ci = None if t_ci[0] is None else [math.exp(t_ci[0]), math.exp(t_ci[1])]
    if len(ratios) < 2:
        boot = None
    elif float(np.ptp(logs)) == 0.0:
        boot = [point, point]
    else:
        lo, hi = percentile_bootstrap((logs,), lambda a, axis: np.mean(a, axis=axis), confidence, seed)
        boot = [math.exp(min(lo, mean_log)), math.exp(max(hi, mean_log))]
    return {
        "ratio": point, "ci": ci, "bootstrap_ci": boot, "confidence": confidence,
        "median": statistics.median(ratios), "range": [min(ratios), max(ratios)], "ratios": ratios,
        "repeats": len(ratios), "unit": UNIT,
        "ci_method": "t interval on the mean log ratio over repeats (n - 1 df), exponentiated; "
                     "bootstrap_ci: percentile bootstrap of the geometric mean, resampling repeats",
        "goal": goal, "goal_status": goal_status(point, ci, goal),
    }


def run_order(repeat: int, names: tuple[str, str]) -> tuple[str, str]:
    """The two sides in the order repeat `repeat` runs them: as given on even repeats, swapped on
    odd ones, so neither side always runs first (warm caches, a neighbour's burst)."""
    return names if repeat % 2 == 0 else (names[1], names[0])


def token_check(engine: Sequence[int], baseline: Sequence[int]) -> dict:
    """Whether two greedy outputs are the same tokens, and where they first part."""
    engine, baseline = list(engine), list(baseline)
    first = next((i for i, (a, b) in enumerate(zip(engine, baseline)) if a != b), None)
    if first is None and len(engine) != len(baseline):
        first = min(len(engine), len(baseline))
    return {"identical": first is None, "first_mismatch": first, "lengths": [len(engine), len(baseline)]}


def format_ci(ci: Sequence[float] | None) -> str:
    return "[  n/a  ]" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def with_threads(threads: int | None, fn):
    """fn() with torch's intra-op threads set to `threads` (None or 0: as they are), restored after
    (a bench's --threads: on a shared machine one thread per process times more steadily)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)

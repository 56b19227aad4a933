"""What the two side-by-side benches share (pipeline/tools/bench.py, pipeline/tools/bench_quality.py):
paired speed ratios with their intervals, the common arguments, the run's model, torch's threads.

    s = ratio_summary(baseline_s=[2.0, 2.1, 1.9], candidate_s=[1.0, 1.1, 0.9], goal=1.5)
    s["ratio"], s["ci"], s["bootstrap_ci"], s["goal_status"]

A repeat, one candidate and one baseline run back to back (order alternating: `run_order`), is the
unit of every interval: `ratio` is the geometric mean of baseline / candidate seconds, `ci` a t
interval on the mean log ratio (the primary one: with a handful of repeats the percentile
bootstrap, `bootstrap_ci`, is too narrow). `goal_status` is "met" when the CI's lower end reaches
the goal, "not met" when its upper end is below it, else "inconclusive".
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

UNIT = "one paired repeat (a candidate run and a baseline run back to back, order alternating)"


def paired_ratios(baseline_s: Sequence[float], candidate_s: Sequence[float]) -> list[float]:
    """Per-repeat baseline / candidate time ratios (> 1: the candidate is faster)."""
    if len(baseline_s) != len(candidate_s) or not baseline_s:
        raise ValueError(f"paired ratios need as many baseline as candidate times, at least one "
                         f"({len(baseline_s)} vs {len(candidate_s)})")
    if any(not (t > 0 and math.isfinite(t)) for t in (*baseline_s, *candidate_s)):
        raise ValueError("paired ratios need positive, finite times")
    return [b / c for b, c in zip(baseline_s, candidate_s)]


def goal_status(point: float, ci: Sequence[float] | None, goal: float) -> str:
    """met / not met / inconclusive against `goal`, read from the interval (see module doc)."""
    if ci is None:
        return "met (one repeat: no interval)" if point >= goal else "not met (one repeat: no interval)"
    return "met" if ci[0] >= goal else "not met" if ci[1] < goal else "inconclusive"


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
    """The two sides as given on even repeats, swapped on odd ones: neither always runs first (warm caches)."""
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


def at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        if not text.strip().lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return int(text)
    return parse


def _confidence(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError("must be in (0, 1)")
    return value


def bench_parser(prog: str, doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments both benches take (`make bench` passes the same ones to both)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--run", default="runs/smollm2-135m")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafts", default="", help="bench: the first layerskip:<n> is its draft (default "
                                                "layerskip:8); bench_quality ignores it")
    p.add_argument("--repeats", type=at_least(1), default=repeats, help="paired timed repeats")
    p.add_argument("--warmup", type=at_least(0), default=0, help="untimed runs of both sides first")
    p.add_argument("--confidence", type=_confidence, default=0.95)
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch CPU threads (default: torch's, one per core). On a CPU shared with other jobs, 1: "
                        "a multi-row matmul waits for every thread, and a descheduled one stalls it")
    return p


def run_bench(args: argparse.Namespace, body) -> int:
    """body(args) with torch's intra-op threads set to --threads (restored after); a StageError
    (a driver too old for torch, missing data) is one line and exit 2, like the stages."""
    import torch

    from pipeline.core.process import set_up_process
    from pipeline.core.stage import StageError

    set_up_process()
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return body(args)
    except StageError as e:
        print(f"specq: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)


def load_run_model(args: argparse.Namespace, dtype: str | None = None):
    """(config, device, run directory, model, tokenizer): the run's prepared model (the prepare
    stage runs first where the run has none)."""
    from pipeline.core.config import load_config
    from pipeline.core.device import resolve_device
    from pipeline.core.stage import run_stage
    from pipeline.stages.table import STAGES
    from pipeline.variants.schemes import load_variant

    cfg = load_config(args.config)
    device = resolve_device(cfg.device)
    run = Path(args.run)
    if not (run / "model" / "meta.json").is_file():
        run_stage(STAGES["prepare"], run, cfg, {"model": args.model}, STAGES)
    model, tok = load_variant(run / "model", device=device, dtype=dtype)
    return cfg, device, run, model, tok

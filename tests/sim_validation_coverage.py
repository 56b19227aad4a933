"""Coverage of the serving validation's interval (pipeline/serving/batching.py validate), by simulation.
Not a test (pytest collects test_*.py only); run it for a closing note:

    .venv/bin/python tests/sim_validation_coverage.py [--sims 200] [--waves 6] [--repeats 5]

A world where the simulation's cost model is true: a plain step costs 90 ms, a speculative round
at k = 1 / 2 costs 120 / 150 ms, prefill 400 ms, whatever the context. What the latency stage
would write is drawn from it: every timing repeat of a cell is the true cost times lognormal
noise (sd `--noise`) and a shared per-repeat machine-load factor; every closed-loop wave draws
its rounds (tokens kept per round at k = 2 from a fixed distribution), its true TPOT is the sum
of its rounds' costs over its tokens, and its measured TPOT is that times its own noise and load
factor. Each world goes through `validate` as the marginal stage calls it. Because the model is
right, a row `agrees` exactly when its CI covers the truth (relative error 0): the share of
agreeing rows is the interval's coverage. Printed per row (B, plain / speculative) with its
Monte-Carlo standard error, and the share of worlds where every row agrees: at 0.95 per row
(about 0.95^m), and family-wise (validation_agrees, each row at 1 - 0.05/m), which should be
>= 0.95.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.serving.batching import validate  # noqa: E402

STEP, ROUND, PREFILL, NEW = 90.0, {1: 120.0, 2: 150.0}, 400.0, 24
KEPT_PMF = np.array([0.45, 0.25, 0.30])  # n_min = 0, 1, 2 at k = 2


def _summ(x) -> dict:
    x = [float(v) for v in x]
    return {"median": float(np.median(x)), "ci": [float(np.min(x)), float(np.max(x))], "samples": x}


def _true_tpot(kept: list[int]) -> float:
    """The engine's rounds: k = min(2, tokens left - 1); a plain step when nothing is left to draft."""
    produced, total, i = 1, 0.0, 0
    while produced < NEW:
        k = min(2, NEW - produced - 1)
        if k == 0:
            total, produced = total + STEP, produced + 1
            continue
        g = min(kept[i], k + 1)
        i += 1
        total, produced = total + ROUND[k], produced + g
    return total / (NEW - 1)


def world(rng: np.random.Generator, waves: int, repeats: int, noise: float,
          batches: tuple[int, ...] = (1,)) -> tuple[dict, dict]:
    """One latency stage's output drawn from the true costs; batch b costs (1 + 0.1 (b - 1)) times
    batch 1's, and its waves keep n_min + 1 tokens a round from the same distribution."""
    load = lambda: float(np.exp(rng.normal(0, noise / 2)))  # noqa: E731
    jitter = lambda: float(np.exp(rng.normal(0, noise)))  # noqa: E731
    rep_load = [load() for _ in range(repeats)]
    grid = {"new_tokens": 16, "grid": [
        {"batch": b, "context": c, "tpot_ms": _summ([STEP * _scale(b) * f * jitter() for f in rep_load]),
         "ttft_ms": _summ([PREFILL * _scale(b) * f * jitter() for f in rep_load])}
        for b in batches for c in (128, 1024)]}
    cells, loops = [], []
    for b in batches:
        x = _scale(b)
        cells.append({"batch": b, "k": 0, "ms_per_token": _summ([STEP * x * f * jitter() for f in rep_load]),
                      "prefill_ms": _summ([PREFILL * x * f * jitter() for f in rep_load])})
        for k, cost in ROUND.items():
            cells.append({"batch": b, "k": k, "round_ms": _summ([cost * x * f * jitter() for f in rep_load]),
                          "prefill_ms": _summ([PREFILL * x * f * jitter() for f in rep_load]),
                          "ms_per_token": _summ([cost * x / 1.5 * f for f in rep_load])})
        rows = {"plain": [], "speculative": []}
        for w in range(waves):
            f = load()
            used = [int(v) + 1 for v in rng.choice(3, size=NEW, p=KEPT_PMF)]
            rows["plain"].append({"wave": w, "prompt_tokens": 100, "ttft_ms": PREFILL * x * f * jitter(),
                                  "tpot_ms": STEP * x * f * jitter(), "output_tokens": NEW})
            rows["speculative"].append({"wave": w, "prompt_tokens": 100, "ttft_ms": PREFILL * x * f * jitter(),
                                        "tpot_ms": _true_tpot(used) * x * f * jitter(), "output_tokens": NEW,
                                        "kept_per_round": used, "k_per_round": [2] * len(used)})
        loops.append({"batch": b, "k": 2, "waves": waves, "new_tokens": NEW, "requests": waves * b,
                      **{m: {"tpot_ms": _summ([r["tpot_ms"] for r in rs]),
                             "ttft_ms": _summ([r["ttft_ms"] for r in rs]), "waves": rs} for m, rs in rows.items()}})
    batched = {"batch_sizes": list(batches), "ks": [1, 2], "new_tokens": 16, "repeats": repeats,
               "prompt_tokens": {str(b): 100 for b in batches}, "cells": cells, "closed_loop": loops}
    return grid, batched


def _scale(b: int) -> float:
    return 1.0 + 0.1 * (b - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sims", type=int, default=200)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.08)
    ap.add_argument("--resamples", type=int, default=100)
    ap.add_argument("--batches", default="1,4", help="closed-loop batch sizes (2 TPOT rows each; default 1,4 "
                                                    "as the default config: 4 rows, the family of one pair)")
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batches.split(","))
    prefix = np.array([KEPT_PMF[1:].sum(), KEPT_PMF[2]])
    accept = {"1": [KEPT_PMF[0], KEPT_PMF[1:].sum()], "2": KEPT_PMF.tolist()}
    hits: dict[str, list[bool]] = {}
    every_row, familywise = [], []
    for s in range(a.sims):
        grid, batched = world(np.random.default_rng([7, s]), a.waves, a.repeats, a.noise, batches)
        rows = validate(grid, batched, prefix, a.resamples, 0.95, s, accept_by_k=accept)
        for row in rows:
            hits.setdefault(f"B={row['batch']} {row['mode']}", []).append(row["tpot_ms"]["agrees"])
        every_row.append(all(r["tpot_ms"]["agrees"] for r in rows))
        familywise.append(all(r["tpot_ms"]["agrees_familywise"] for r in rows))
    print(f"{a.sims} worlds, {a.waves} waves, {a.repeats} repeats, noise sd {a.noise}, {a.resamples} resamples, "
          f"batches {batches}; nominal 0.95")

    def line(label: str, h: list[bool]) -> None:
        p = float(np.mean(h))
        print(f"  {label}: {p:.3f} (MC se {np.sqrt(p * (1 - p) / len(h)):.3f})")

    for label, h in hits.items():
        line(f"{label}: coverage", h)
    line(f"all {len(rows)} rows agree, each at 0.95 (validation_agrees_each_row)", every_row)
    line(f"all {len(rows)} rows agree, family-wise (validation_agrees)", familywise)


if __name__ == "__main__":
    main()

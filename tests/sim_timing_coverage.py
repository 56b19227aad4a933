"""How often the speedup interval covers the true speedup when a budget leaves a pair 2-5 timing
repeats. Not a test (pytest collects test_*.py only); run it for a closing note or
docs/validation/timing-coverage.md:

    .venv/bin/python tests/sim_timing_coverage.py              # about a minute
    .venv/bin/python tests/sim_timing_coverage.py --reps 2000

The interval the marginal stage recommends k from goes through the project's own function
(pipeline/serving/marginal.py marginal_table). It resamples the timing repeats (percentile bootstrap
of the median) and, independently, the acceptance prompts. The world:

- timing: every repeat scales plain ms/token and the round time by their own lognormal factors
  (sd `--noise` each, so the per-repeat log ratio plain / round has sd noise * sqrt(2); the medians are
  the nominal 10 ms and 12 + k ms). On the default config the per-repeat ratio's sd was 0.4-1.8%
  (2026-12-03 runs), about noise = 0.01.
- acceptance: "exact" (every prompt realises E(k): the interval is the timing part alone), or
  24 prompts, each prompt's E(k) the population's times a lognormal factor of sd `--spread`,
  drawn afresh per table, so the acceptance part of the interval is a real sampling interval too
  (spread 0.05 gives E(1) an interval of about +-2.1%, against the self-draft's +-3.7% on the
  default config; 0.15 about +-6%, against prompt lookup's +-8%).

The truth is 10 E(k) / (12 + k) with the population's E(k). For n continuous i.i.d. repeats the
bootstrap interval of the median is at most the repeats' range, which holds the true median with
probability 1 - 2^(1 - n): 0.50, 0.75, 0.875, 0.94 at n = 2, 3, 4, 5.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.serving.marginal import marginal_table  # noqa: E402
from pipeline.serving.timing_noise import noise_for, pooled_noise  # noqa: E402

ALPHA, K_MAX, TOKENS = 0.6, 3, 1200.0
E_POP = {k: sum(ALPHA ** i for i in range(k + 1)) for k in range(1, K_MAX + 1)}


def acceptance(rng, mode: str, prompts: int = 24, spread: float = 0.15) -> tuple[dict, dict[int, float]]:
    """(an acceptance block for marginal_table, the population's E(k)). A model draft: every round drafts k."""
    if mode == "exact":
        factors, truth = np.ones(prompts), dict(E_POP)
    else:
        factors = np.exp(rng.normal(0.0, spread, prompts))
        # Each prompt's rounds = tokens / (E f): E[rounds] = tokens exp(spread^2 / 2) / E.
        truth = {k: e * math.exp(-spread ** 2 / 2) for k, e in E_POP.items()}
    recs = []
    for i, f in enumerate(factors):
        rounds = {str(k): TOKENS / (e * f) for k, e in E_POP.items()}
        recs.append({"prompt": f"p{i}", "tokens": TOKENS, "expected_rounds": rounds,
                     "drafted_rounds": {str(k): [0.0] * k + [rounds[str(k)]] for k in E_POP}})
    tot = {k: TOKENS * prompts / sum(r["expected_rounds"][str(k)] for r in recs) for k in E_POP}
    return {"expected_tokens_per_round": {str(k): v for k, v in tot.items()}, "per_position": [],
            "per_prompt": recs}, truth


def timing(rng, repeats: int, noise: float) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Per-repeat plain ms/token and round ms by drafted count d (nominal 10 and 12 + d)."""
    plain = 10.0 * np.exp(rng.normal(0.0, noise, repeats))
    f_round = np.exp(rng.normal(0.0, noise, repeats))
    return plain, {d: (12.0 + d) * f_round for d in range(K_MAX + 1)}


def _block(plain, rounds: dict[int, np.ndarray]) -> dict:
    return {"plain_ms_per_token": {"samples": plain.tolist()},
            "round_ms_by_drafted": {str(d): {"samples": v.tolist(), "rounds": 100 * v.size} for d, v in rounds.items()}}


def _other_block(rng, repeats: int, noise: float, figures: int, hetero: float) -> dict:
    """Another plain sequence and `figures` round times of the same repeats (nominal 10 and 12 + d
    ms), plain's factor of sd `noise`, each round time's of sd noise (hetero > 0: times a
    lognormal factor of sd hetero, per figure)."""
    plain = 10.0 * np.exp(rng.normal(0.0, noise, repeats))
    rounds = {}
    for d in range(figures):
        sd = noise * math.exp(rng.normal(0.0, hetero)) if hetero else noise
        rounds[d] = (12.0 + d) * np.exp(rng.normal(0.0, sd, repeats))
    return _block(plain, rounds)


def loop_noise(rng, table: dict, repeats: int, noise: float, loops: int, hetero: float, figures: int = 7) -> dict | None:
    """The pooled noise (timing_noise.py) the table's intervals get in a run like the default
    config's: the table's loop holds its own temperature and a second one (`figures` round times),
    and the run `loops` more loops of two plain sequences each (a pair's temperatures); noise_for takes the loop's own pool, or the run's where the loop's is short."""
    pairs = {"table": {"by_temperature": {"0.0": table, "0.7": _other_block(rng, repeats, noise, figures, hetero)}}}
    for i in range(loops):
        pairs[f"other{i}"] = {"by_temperature": {t: _other_block(rng, repeats, noise, figures, hetero)
                                                 for t in ("0.0", "0.7")}}
    return noise_for(pooled_noise(pairs), "table")


def b1_cis(acc: dict, plain, rounds, seed: int, noise: dict | None = None) -> dict[int, list[float]]:
    return {r["k"]: r["speedup_ci"] for r in marginal_table(acc, _block(plain, rounds), 0.95, seed=seed,
                                                            noise=noise)["rows"]}


METHODS = ("own", "pooled")


def coverage(repeats: int, noise: float, mode: str, reps: int, seed: int, spread: float = 0.15,
             loops: int = 3, hetero: float = 0.0) -> dict[str, float]:
    """Coverage and median width / truth of each method's CI at k = 1. hetero > 0: the table's
    own noise is `noise` times a lognormal factor of sd hetero, and so is each other figure's."""
    rng = np.random.default_rng(seed)
    hit = {m: 0 for m in METHODS}
    width = {m: [] for m in METHODS}
    k = 1
    for r in range(reps):
        acc, e_true = acceptance(rng, mode, spread=spread)
        own_sd = noise * math.exp(rng.normal(0.0, hetero)) if hetero else noise
        plain, rounds = timing(rng, repeats, own_sd)
        pool = loop_noise(rng, _block(plain, rounds), repeats, noise, loops, hetero)
        truth = 10.0 * e_true[k] / (12.0 + k)
        cis = {"own": b1_cis(acc, plain, rounds, r), "pooled": b1_cis(acc, plain, rounds, r, pool)}
        for m in METHODS:
            lo, hi = cis[m][k]
            hit[m] += lo <= truth <= hi
            width[m].append((hi - lo) / truth)
    return {m: (hit[m] / reps, float(np.median(width[m]))) for m in METHODS}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=400, help="simulated tables per cell")
    ap.add_argument("--repeats", default="2,3,5", help="timing repeats per table")
    ap.add_argument("--noise", default="0.005,0.01,0.02", help="lognormal sd of each repeat's plain and round factor")
    ap.add_argument("--spread", default="0.05,0.15", help="prompts' lognormal E(k) spread (the 'prompts' rows)")
    ap.add_argument("--hetero", default="0,0.5", help="figures' noise spread (0: every figure the same noise)")
    ap.add_argument("--loops", type=int, default=3, help="the run's other timing loops (2 plain sequences x 7 figures)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    se = math.sqrt(0.95 * 0.05 / args.reps)
    print(f"95% speedup CI at k = 1 covering the truth, share of {args.reps} simulated tables (Monte-Carlo se "
          f"{se:.3f} at 0.95); median width / truth in brackets. own: the table's own repeats resampled (as "
          f"before); pooled: the pooled noise of its loop (its 4 figures and 7 more on a second plain sequence), or of "
          f"the run ({args.loops} more such loops) where the loop's is short. Range "
          f"bound 1 - 2^(1 - n): the timing part alone, own repeats.\n")
    print("| acceptance | noise | figures' noise | repeats | range bound | " + " | ".join(METHODS) + " |")
    print("|---|---:|---|---:|---:|" + "---|" * len(METHODS))
    worlds = [("exact", 0.0)] + [(f"24 prompts, spread {s}", float(s)) for s in args.spread.split(",")]
    for label, spread in worlds:
        for hetero in (float(x) for x in args.hetero.split(",")):
            for noise in (float(x) for x in args.noise.split(",")):
                for n in (int(x) for x in args.repeats.split(",")):
                    c = coverage(n, noise, "exact" if spread == 0 else "prompts", args.reps,
                                 args.seed + n + int(noise * 1e4) + int(spread * 1e3) + int(hetero * 1e5),
                                 spread or 0.15, args.loops, hetero)
                    print(f"| {label} | {noise:g} | {'equal' if not hetero else f'x lognormal({hetero:g})'} | {n} | "
                          f"{1 - 2.0 ** (1 - n):.3f} | "
                          + " | ".join(f"{c[m][0]:.3f} ({c[m][1]:.3f})" for m in METHODS) + " |", flush=True)


if __name__ == "__main__":
    main()

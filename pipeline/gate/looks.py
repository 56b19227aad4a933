"""Group-sequential looks of one gated row: which look settles it, at which nominal levels.

    from pipeline.gate.looks import plan, settle
    looks = plan(240, 40)                                  # [40, 80, 120, 160, 200, 240]
    k, record = settle({0: est40, 1: est80}, looks, 240, margin=0.05, alpha_pass=0.025, alpha_fail=0.005)

At each look a row's two sides are tested at the nominal levels the slice's spending function
plans; a row stops at the first look that passes or fails it. The quality stage's stopping and
the gate's replay both use this function (docs/methods/gate.md, "Stopping before the last look").
"""
from __future__ import annotations

import functools
from typing import Sequence

from pipeline.stats import sequential
from pipeline.stats.paired import Estimate, noninferiority_status


def plan(n_max: int, wave: int | None, ends: Sequence[int] | None = None) -> list[int]:
    """Look sizes (cumulative items) for `n_max` items scored `wave` at a time (None: one look).
    `ends`: item counts at which a cluster ends; each look is the first end at or after k * wave."""
    if n_max < 1:
        raise ValueError("a slice needs at least one item")
    if not wave or wave >= n_max:
        return [n_max]
    ends = sorted(set(ends or range(1, n_max + 1)) | {n_max})
    looks: list[int] = []
    target = wave
    for e in ends:
        if e >= target or e == n_max:
            if not looks or e > looks[-1]:
                looks.append(e)
            while target <= e:
                target += wave
    return looks


@functools.lru_cache(maxsize=512)
def levels(looks: tuple[int, ...], n_max: int, alpha: float, spending: str = "obf") -> tuple[float, ...]:
    """One-sided nominal level of each planned look for a side spending `alpha` (a look's level
    depends only on the looks up to it, so the plan serves any prefix that happened)."""
    if len(looks) == 1 and looks[0] >= n_max:
        return (float(alpha),)
    return tuple(sequential.nominal_levels(list(looks), n_max, alpha, spending))


def settle(estimates: dict[int, Estimate], looks: Sequence[int], n_max: int, margin: float,
           alpha_pass: float, alpha_fail: float, spending: str = "obf") -> tuple[int, list[dict]]:
    """(index of the deciding look: the first that passes or fails, else the last; one record per
    look up to it). `estimates`: look index -> the row's estimate on the first looks[k] items."""
    lp, lf = (levels(tuple(looks), n_max, a, spending) for a in (alpha_pass, alpha_fail))
    record: list[dict] = []
    ks = sorted(estimates)
    for k in ks:
        est = estimates[k]
        lo, hi = est.lower(lp[k]), est.upper(lf[k])
        status = noninferiority_status(lo, hi, margin)
        record.append({"n": est.n, "ci": [lo, hi], "alpha_lower": lp[k], "alpha_upper": lf[k],
                       "status": status})
        if status != "inconclusive":
            return k, record
    return ks[-1], record

"""Group-sequential looks of one gated row: which look settles it, at which nominal levels.

    from pipeline.gate.looks import plan, settle
    looks = plan(240, 40)                                  # [40, 80, 120, 160, 200, 240]
    k, record = settle({0: est40, 1: est80}, looks, 240, margin=0.05, alpha_pass=0.025, alpha_fail=0.005)

The quality stage scores each slice in waves (a fixed seeded order, the reference and the variants
on the same items) and, after every wave, asks the gate (pipeline/gate/decision.py: open_rows)
which (variant, slice) rows are still open; the gate stage later replays the same looks from the
same files with the same function, so the stage's stopping and gate.json's decision cannot differ.

At look k of a row (n_k items of the slice's n_max) each side is tested at its own nominal level
from Lan-DeMets O'Brien-Fleming-type spending (or Pocock-type: config gate.spending;
pipeline/stats/sequential.py; or either fitted to the quality stage's time budget, named per slice
in quality/meta.json's `sequential`: pipeline/quality/sequential.py: fit_design) of that side's alpha: the pass side at the variant's pass alpha
(intersection-union: alpha, or alpha / r when the user picks among r release variants), the fail side at alpha / m over the variant's m gated rows
(Bonferroni: for "does any row fail", which is all a variant's decision uses, the same as Holm's
first step). A row stops at the first look whose bound clears -margin on either side; a row that
never does is inconclusive at its last look. Each side's error over all looks stays at its alpha
(tests/test_sequential.py, tests/sim_gate_rates.py --sequential). A slice with one look at n_max
is the fixed-n gate: its level is the side's alpha itself.

Stopping before the last look (the quality stage's time budget, issue 27: a look that does not
fit the variant's allowance is not taken). A row that stops at look j < K is replayed at looks
1..j, each at the level planned for it, and stays inconclusive: the levels come from the planned
looks (`levels` depends only on the looks up to k), so the alpha the skipped looks would have
spent is never moved to look j. Each side then rejects only if its statistic crossed a planned
boundary at one of looks 1..j, an event inside "crossed at one of looks 1..K", whose probability
under the null is at most that side's alpha. So stopping early keeps each one-sided error at or
below nominal (fewer chances to reject: the final look is never reached); this holds whatever
the reason for stopping, and the budget's reason (wall-clock time, not the scores) does not even
look at the data. What it costs is power: the row may stay inconclusive where the later looks
would have settled it. Treating look j as final (testing it at alpha minus what was spent)
would need the decision to stop there made before look j's data were seen; the budget stops a
row after look j showed it open, so it is not done.
"""
from __future__ import annotations

import functools
from typing import Sequence

from pipeline.stats import sequential
from pipeline.stats.paired import Estimate, noninferiority_status


def plan(n_max: int, wave: int | None, ends: Sequence[int] | None = None) -> list[int]:
    """Look sizes (cumulative items) for a slice of `n_max` items scored `wave` at a time (None:
    one look at n_max). `ends`: the item counts at which a cluster ends (a look never splits a
    cluster: its items enter together); each look is the first end at or after k * wave."""
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
    """One-sided nominal level of each planned look for a side spending `alpha` under `spending`
    (config gate.spending; a look's level depends only on the looks up to it, so the planned list
    serves any prefix that happened)."""
    if len(looks) == 1 and looks[0] >= n_max:
        return (float(alpha),)
    return tuple(sequential.nominal_levels(list(looks), n_max, alpha, spending))


def settle(estimates: dict[int, Estimate], looks: Sequence[int], n_max: int, margin: float,
           alpha_pass: float, alpha_fail: float, spending: str = "obf") -> tuple[int, list[dict]]:
    """(index of the deciding look, one record per look up to it). `estimates`: look index ->
    the row's estimate on the slice's first looks[k] items (a row may lack early looks: a group
    with fewer than 2 items). The deciding look is the first that passes or fails, else the last."""
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

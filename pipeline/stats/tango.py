"""Tango's score interval for a difference of paired proportions, with a design effect for
clustered items: the gate's bound for every slice whose scores are 0/1 for both models.

With `better` / `worse` the items only the variant / only the reference gets right out of n,
diff = (better - worse) / n, and Tango (1998, Stat Med 17:891) tests H0: diff = d0 with
Z(d0) = (better - worse - n d0) / sqrt(n (2 q + d0 (1 - d0))), q the maximum-likelihood p_worse
under H0; a bound is the d0 at which Z = +-z. Clustered items divide Z by sqrt(design_effect).
Hand-written (statsmodels and scipy have none); everything broadcasts over arrays.
"""
from __future__ import annotations

import numpy as np
from scipy import stats as sps
from scipy.optimize import elementwise

# The fail side (the upper bound) adds one effective item (design_effect items) to the numerator:
# without it exact false-fail rates reached 0.051 at nominal 0.025 (tests/test_gate_sims.py).
FAIL_CORRECTION = 1.0

_EDGE = 1e-12  # bounds are searched inside (-1, 1): Z is undefined at the ends themselves


def constrained_worse_rate(better, worse, n, d0):
    """Tango's maximum-likelihood p_worse given p_better - p_worse = d0 (see the module doc)."""
    better, worse, n, d0 = (np.asarray(x, dtype=float) for x in (better, worse, n, d0))
    a = 2.0 * n
    b = -better - worse + (2.0 * n - better + worse) * d0
    c = -worse * d0 * (1.0 - d0)
    return (np.sqrt(np.maximum(b * b - 4.0 * a * c, 0.0)) - b) / (2.0 * a)


def null_variance(better, worse, n, d0):
    """Variance of one item's difference under H0: diff = d0 (Tango's constrained estimate)."""
    d0 = np.asarray(d0, dtype=float)
    return np.maximum(2.0 * constrained_worse_rate(better, worse, n, d0) + d0 * (1.0 - d0), 0.0)


def score_z(better, worse, n, d0, design_effect=1.0, shift=0.0):
    """Tango's Z(d0), divided by sqrt(design_effect). Z = 0 where the numerator is 0 (d0 equal
    to the observed difference, including no discordant item at d0 = 0). `shift` is added to the
    numerator (better - worse - n d0): a continuity correction, in items (see FAIL_CORRECTION)."""
    better, worse, n = (np.asarray(x, dtype=float) for x in (better, worse, n))
    num = better - worse - n * np.asarray(d0, dtype=float) + np.asarray(shift, dtype=float)
    var = n * null_variance(better, worse, n, d0) * np.asarray(design_effect, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 0.0, num / np.sqrt(np.where(var > 0.0, var, 1.0)), np.sign(num) * np.inf)
    return np.where(num == 0.0, 0.0, z)


def bound(better, worse, n, alpha, design_effect=1.0, side: str = "lower", shift=0.0):
    """The lower (or upper) confidence bound at one-sided `alpha`: the root of Z(d0) = +-z.
    `shift` >= 0 on the upper side (the fail side's continuity correction) moves it up."""
    better, worse, n, alpha, deff, shift = np.broadcast_arrays(
        *(np.asarray(x, dtype=float) for x in (better, worse, n, alpha, design_effect, shift)))
    diff = (better - worse) / n
    q = sps.norm.isf(alpha)
    if side == "lower":
        end, sign, lo, hi = -1.0, 1.0, np.full(diff.shape, -1.0 + _EDGE), diff
    elif side == "upper":
        end, sign, lo, hi = 1.0, -1.0, diff, np.full(diff.shape, 1.0 - _EDGE)
    else:
        raise ValueError(f"side must be 'lower' or 'upper', not {side!r}")
    at_end = diff == end
    # Z(diff) = 0 and Z runs to +-inf towards the far end, so [lo, hi] brackets the root.
    res = elementwise.find_root(
        lambda x, b, w, m, target, d, c: score_z(b, w, m, x, d, c) - target,
        (np.where(at_end, end / 2, lo), np.where(at_end, end / 2 + 1e-3, hi)),
        args=(better, worse, n, sign * q, deff, shift),
        tolerances={"xatol": 1e-10, "xrtol": 0.0})
    return np.where(at_end, end, res.x)


def p_value(better, worse, n, d0, design_effect=1.0, side: str = "above", shift=0.0):
    """One-sided p of H0: diff <= d0 (side "above": small = diff is above d0) or H0: diff >= d0
    (side "below"); p < alpha exactly when the matching bound (with the same shift) excludes d0."""
    z = score_z(better, worse, n, d0, design_effect, shift)
    return sps.norm.sf(z) if side == "above" else sps.norm.cdf(z)


def items_needed(better, worse, n, d0, alpha, power, design_effect=1.0):
    """Items for the score test of H0: diff = d0 to reject with probability `power` at the
    observed discordance rates: n = design_effect ((z_{1-alpha} sd_0 + z_power sd_1) / |diff - d0|)^2
    (Connor 1987: the null and observed spreads apart). None when diff == d0."""
    diff = (better - worse) / n
    gap = abs(diff - d0)
    if gap == 0.0:
        return None
    sd0 = float(np.sqrt(null_variance(better, worse, n, d0)))
    sd1 = float(np.sqrt(max((better + worse) / n - diff**2, 0.0)))
    z = sps.norm.isf(alpha) * sd0 + sps.norm.ppf(power) * sd1
    return int(np.ceil(design_effect * (z / gap) ** 2))

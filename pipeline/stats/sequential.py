"""Group-sequential looks: Lan-DeMets alpha spending with the O'Brien-Fleming-type function (or the
Pocock-type one), one sided, and the nominal level each look's bound is drawn at.

    from pipeline.stats.sequential import boundaries, nominal_levels
    z = boundaries([0.5, 1.0], alpha=0.025)        # [2.963, 1.969]: cross at look k if Z_k >= z[k]
    a = nominal_levels([200, 400, 600], 600, 0.025)  # one-sided alpha of each look's bound

Look k's boundary c_k makes P(no earlier crossing, Z_k >= c_k) = alpha(t_k) - alpha(t_{k-1})
under H0 (t = n_look / n_max), by recursive numerical integration (Jennison & Turnbull 2000, ch. 19)
and a root finder; its bound is drawn at nominal level 1 - Phi(c_k) (docs/methods/gate.md).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

_GRID = 4001  # points of the integration grid on the continuation region
_LOW = -10.0  # the grid's lower end (the density below it is < 1e-22)


def obf_spending(t, alpha: float):
    """Lan-DeMets O'Brien-Fleming-type spending: alpha used by information fraction t in [0, 1]."""
    t = np.asarray(t, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(t > 0, 2.0 * sps.norm.sf(sps.norm.isf(alpha / 2.0) / np.sqrt(np.maximum(t, 1e-300))), 0.0)


def pocock_spending(t, alpha: float):
    """Lan-DeMets Pocock-type spending: alpha used by information fraction t in [0, 1]."""
    t = np.asarray(t, dtype=float)
    return alpha * np.log1p((np.e - 1.0) * np.clip(t, 0.0, None))


SPENDING = {"obf": obf_spending, "pocock": pocock_spending}


def spending_function(name: str):
    """`alpha(t)` of a spending name: "obf" or "pocock"."""
    if name not in SPENDING:
        raise ValueError(f"unknown spending function {name!r} (known: {', '.join(SPENDING)})")
    return SPENDING[name]


def boundaries(fractions: Sequence[float], alpha: float, spending: str = "obf") -> list[float]:
    """The z boundary of each look at information fractions t_1 < ... < t_K (t_K <= 1; the last
    look at t_K = 1 spends all of alpha), under the `spending` function ("obf" or "pocock")."""
    t = np.asarray(fractions, dtype=float)
    if t.ndim != 1 or t.size == 0 or np.any(np.diff(t) <= 0) or t[0] <= 0 or t[-1] > 1 + 1e-12:
        raise ValueError(f"information fractions must increase in (0, 1], got {list(fractions)}")
    spent = spending_function(spending)(np.minimum(t, 1.0), alpha)
    out: list[float] = []
    grid = density = None
    prev_t = 0.0
    for k, tk in enumerate(t):
        target = float(spent[k] - (spent[k - 1] if k else 0.0))
        if k == 0:
            c = float(sps.norm.isf(target)) if target > 0 else np.inf
            out.append(c)
            grid = np.linspace(_LOW, min(c, 12.0), _GRID)
            density = sps.norm.pdf(grid)
        else:
            root_t, root_prev, root_dt = np.sqrt(tk), np.sqrt(prev_t), np.sqrt(tk - prev_t)

            def crossing(c):  # P(continue so far, then Z_k >= c)
                tail = sps.norm.sf((c * root_t - grid * root_prev) / root_dt)
                return np.trapezoid(density * tail, grid)

            if target <= 0:
                c = np.inf
            else:
                c = float(optimize.brentq(lambda x: crossing(x) - target, -10.0, 40.0, xtol=1e-10))
            out.append(c)
            new_grid = np.linspace(_LOW, min(c, 12.0), _GRID)
            kernel = sps.norm.pdf((new_grid[:, None] * root_t - grid[None, :] * root_prev) / root_dt) * root_t / root_dt
            density = np.trapezoid(kernel * density[None, :], grid, axis=1)
            grid = new_grid
        prev_t = float(tk)
    return out


def nominal_levels(looks: Sequence[int], n_max: int, alpha: float, spending: str = "obf") -> list[float]:
    """One-sided alpha of each look's bound, for looks at `looks` items of at most `n_max`
    (information fraction n / n_max); a last look at n_max spends what is left."""
    fractions = [min(n / n_max, 1.0) for n in looks]
    return [float(sps.norm.sf(c)) for c in boundaries(fractions, alpha, spending)]

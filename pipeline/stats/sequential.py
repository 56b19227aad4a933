"""Group-sequential looks: Lan-DeMets alpha spending with the O'Brien-Fleming-type function (or the
Pocock-type one), one sided, and the nominal level each look's bound is drawn at.

    from pipeline.stats.sequential import boundaries, nominal_levels
    z = boundaries([0.5, 1.0], alpha=0.025)        # [2.963, 1.969]: cross at look k if Z_k >= z[k]
    a = nominal_levels([200, 400, 600], 600, 0.025)  # one-sided alpha of each look's bound

alpha(t), t = n_look / n_max, is the alpha spent by each look: 2 (1 - Phi(z_{1-alpha/2} / sqrt(t)))
(O'Brien-Fleming type) or alpha ln(1 + (e - 1) t) (Pocock type). Look k's boundary c_k makes
P(no earlier crossing, Z_k >= c_k) = alpha(t_k) - alpha(t_{k-1}) under H0, found by recursive
numerical integration (Jennison & Turnbull 2000, ch. 19) and a root finder; its bound is drawn at
nominal level 1 - Phi(c_k), each side apart (docs/methods/gate.md#sequential-looks).
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


def fitted(base: str, t_fit: float, share: float) -> str:
    """The name of a budget-fitted spending function (fitted_spending): `share` of alpha spent, in
    `base`'s shape, by information fraction `t_fit` (the last look a time budget is predicted to
    afford); the rest, in the same shape, over (t_fit, 1]. Rounded so the name is stable in JSON."""
    if base not in SPENDING:
        raise ValueError(f"unknown spending function {base!r} (known: {', '.join(SPENDING)})")
    if not 0.0 < t_fit < 1.0 or not 0.0 < share <= 1.0:
        raise ValueError(f"fitted spending needs 0 < t_fit < 1 and 0 < share <= 1, got {t_fit}, {share}")
    return f"fit({base},{t_fit:.10g},{share:.6g})"


def fitted_spending(t, alpha: float, base: str, t_fit: float, share: float):
    """alpha(t) = share * base(t / t_fit) on [0, t_fit]; share * alpha + (1 - share) *
    base((t - t_fit) / (1 - t_fit)) after it: a spending function like any other (0 at 0,
    nondecreasing, alpha at 1), so each side's error over all looks stays at alpha whichever looks
    happen, as long as the function is fixed before the looks' data are seen. A run whose time
    budget affords only the looks up to t_fit spends `share` of alpha on them, where the base
    function alone (O'Brien-Fleming) would spend almost none; a later run with more time
    continues the same function on the rest."""
    t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
    fn = SPENDING[base]
    early = share * fn(np.minimum(t / t_fit, 1.0), alpha)
    late = (1.0 - share) * fn(np.clip((t - t_fit) / (1.0 - t_fit), 0.0, 1.0), alpha)
    return np.where(t <= t_fit, early, share * alpha + late)


def fitted_parts(name: str) -> tuple[str, float, float] | None:
    """(base, t_fit, share) of a fitted spending's name (fitted), None for any other name; a
    malformed fitted name raises ValueError."""
    if not (name.startswith("fit(") and name.endswith(")")):
        return None
    try:
        base, t_fit, share = name[4:-1].split(",")
        fitted(base, float(t_fit), float(share))  # validates
    except ValueError as e:
        raise ValueError(f"bad fitted spending {name!r}: {e}") from None
    return base, float(t_fit), float(share)


def spending_function(name: str):
    """`alpha(t)` of a spending name: "obf", "pocock" or a fitted one ("fit(obf,0.1666666667,0.5)")."""
    if name in SPENDING:
        return SPENDING[name]
    parts = fitted_parts(name)
    if parts is None:
        raise ValueError(f"unknown spending function {name!r} (known: {', '.join(SPENDING)}, fit(base,t,share))")
    return lambda t, alpha: fitted_spending(t, alpha, *parts)


def boundaries(fractions: Sequence[float], alpha: float, spending: str = "obf") -> list[float]:
    """The z boundary of each look at information fractions t_1 < ... < t_K (t_K <= 1; the last
    look at t_K = 1 spends all of alpha), under the `spending` function ("obf", "pocock" or a
    fitted one: spending_function)."""
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
    """One-sided alpha of each look's bound, for looks at `looks` items of at most `n_max`: the
    information fraction of a look is n / n_max (the items' share; with clusters the gate's
    design effect is the same at every look, so the share of information equals the share of
    items). A last look at n_max spends what is left."""
    fractions = [min(n / n_max, 1.0) for n in looks]
    return [float(sps.norm.sf(c)) for c in boundaries(fractions, alpha, spending)]

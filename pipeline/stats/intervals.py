"""Confidence intervals from resampling replicates and from quantiles: the one implementation.

`percentile_interval` (replicates drawn by the caller, in the caller's unit), `percentile_bootstrap`
(scipy.stats.bootstrap over single observations), `t_interval` and `mean_t_interval` around a
point, `median_ci`; `clip_contain` clips to the quantity's range and then widens to contain the
point. Differences between callers are parameters here, not copies elsewhere.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import numpy as np
from scipy import stats as sps


def t_quantile(confidence: float, df: float) -> float:
    """t with P(|T_df| <= t) = confidence: Student's t upper quantile at (1 - confidence)/2."""
    return float(sps.t.isf((1.0 - confidence) / 2.0, df))


def clip_contain(lo: float, hi: float, point: float | None = None,
                 bounds: tuple[float, float] | None = None) -> list[float]:
    """[lo, hi] clipped to `bounds` (the range the quantity can take; None: no clip), then widened
    to contain `point` (None: not widened). As floats."""
    lo, hi = float(lo), float(hi)
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    if point is not None:
        lo, hi = min(lo, point), max(hi, point)
    return [lo, hi]


def percentile_interval(replicates, confidence: float, point: float | None = None,
                        bounds: tuple[float, float] | None = None, *, drop_nonfinite: bool = False,
                        min_replicates: int = 1, too_few: Sequence[float] | None = None) -> list[float]:
    """Percentile interval of the caller's replicates, then `clip_contain(point, bounds)`.
    drop_nonfinite: drop nan/inf replicates first. With fewer than `min_replicates` left the
    interval is `too_few` as given (None: ValueError)."""
    r = np.asarray(replicates, dtype=float).ravel()
    if drop_nonfinite:
        r = r[np.isfinite(r)]
    if r.size < max(min_replicates, 1):
        if too_few is None:
            raise ValueError(f"percentile interval of {r.size} replicates (needs {max(min_replicates, 1)})")
        return [float(too_few[0]), float(too_few[1])]
    lo, hi = np.quantile(r, [(1 - confidence) / 2, (1 + confidence) / 2])
    return clip_contain(lo, hi, point, bounds)


def percentile_bootstrap(data: tuple, statistic: Callable, confidence: float = 0.95,
                         seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap CI (2000 resamples) of `statistic(*samples, axis)` (vectorised) through
    scipy.stats, resampling each sample's single observations on its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate resamples of tiny samples are expected
        res = sps.bootstrap(data, statistic, vectorized=True, n_resamples=2000,
                            confidence_level=confidence, method="percentile",
                            random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def t_interval(point: float, se: float, df: float, confidence: float,
               bounds: tuple[float, float] | None = None) -> list[float]:
    """point -/+ t_df se, clipped to `bounds` and widened to contain the point."""
    q = t_quantile(confidence, df)
    return clip_contain(point - q * se, point + q * se, point, bounds)


def mean_t_interval(values, confidence: float = 0.95,
                    bounds: tuple[float, float] | None = None) -> tuple[float, list[float | None]]:
    """Mean of independent units and its t interval (s/sqrt(n), n - 1 df) clipped to `bounds`;
    [None, None] with fewer than two units, [mean, mean] when every unit is equal."""
    v = np.asarray(values, dtype=np.float64).ravel()
    mean = float(v.mean())
    if v.size < 2:
        return mean, [None, None]
    se = float(np.std(v, ddof=1) / math.sqrt(v.size))
    if se == 0.0:
        return mean, [mean, mean]
    return mean, t_interval(mean, se, v.size - 1, confidence, bounds)


def median_ci(samples, confidence: float = 0.95, seed: int = 0) -> dict:
    """{"median", "ci": [lo, hi], "samples"}: percentile bootstrap of the median over samples."""
    x = np.asarray([float(s) for s in samples], dtype=float)
    if x.size == 0:
        raise ValueError("median_ci needs at least one sample")
    med = float(np.median(x))
    if x.size < 2 or np.ptp(x) == 0:
        lo = hi = med
    else:
        lo, hi = percentile_bootstrap((x,), lambda a, axis: np.median(a, axis=axis), confidence, seed)
    return {"median": med, "ci": clip_contain(lo, hi, med), "samples": x.tolist()}

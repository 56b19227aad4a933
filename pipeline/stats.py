"""The statistics behind the gate: paired differences, clustered standard errors, the bootstrap,
non-inferiority status, the items needed to settle a test, and multiplicity.

Conventions (every function here):
- `diff` is oriented so that NEGATIVE MEANS THE VARIANT IS WORSE: variant - reference for a metric
  where higher is better, reference - variant where lower is better (ECE, Brier). The margin is
  then always a non-negative number and the test is H0: diff <= -margin vs H1: diff > -margin.
- A two-sided CI at level 1 - 2*alpha is read as two one-sided tests at alpha each: its lower bound
  above -margin is "pass" (non-inferior), its upper bound below -margin is "fail" (inferior).
  A 95% CI therefore means one-sided alpha = 0.025, the usual non-inferiority convention. Under
  multiplicity the two bounds may carry different alphas (each family is adjusted on its own);
  the interval then covers with probability >= 1 - alpha_lower - alpha_upper.
- The unit of resampling / of the standard error is the cluster (items sharing a source); an item
  without a cluster is its own cluster, which reduces every formula to the textbook one.

Everything is array code over a trailing item axis, so the simulations in tests/test_stats.py run
thousands of synthetic gates in a fraction of a second through the same functions the gate uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from scipy import stats as sps

# ---------------------------------------------------------------- clusters


def cluster_codes(clusters: Sequence | None, n: int) -> np.ndarray:
    """Integer codes 0..G-1 for cluster labels; None (or a None label) = the item is its own."""
    if clusters is None:
        return np.arange(n)
    labels = [f"\0item{i}" if c is None else str(c) for i, c in enumerate(clusters)]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} cluster labels for {n} items")
    _, codes = np.unique(np.array(labels, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64)


# ---------------------------------------------------------------- paired mean difference


def paired_mean_se(d: np.ndarray, codes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean and standard error of per-item differences d[..., n], clustered by `codes`.

    The clustered variance is the CR1 sandwich estimator of an intercept-only regression (what
    statsmodels' OLS(cov_type="cluster") gives):  Var(mean) = G/(G-1) * sum_g (S_g - n_g*mean)^2 / n^2,
    with S_g the sum of d over cluster g. With one item per cluster it is exactly s^2/n. Returns
    (mean, se, degrees of freedom = G - 1).
    """
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    mean = d.mean(axis=-1)
    if codes is None:  # one item per cluster: the same formula, without the n x n one-hot
        if n < 2:
            raise ValueError("need at least two items for a standard error")
        return mean, np.sqrt(d.var(axis=-1, ddof=1) / n), n - 1
    g = int(codes.max()) + 1
    if g < 2:
        raise ValueError("need at least two clusters (or items) for a standard error")
    resid = d - mean[..., None]
    # Cluster sums of residuals via a one-hot matrix: [..., n] @ [n, G] -> [..., G].
    onehot = np.zeros((n, g))
    onehot[np.arange(n), codes] = 1.0
    sums = resid @ onehot
    var = g / (g - 1) * (sums**2).sum(axis=-1) / n**2
    return mean, np.sqrt(var), g - 1


def t_interval(mean, se, df, alpha_one_sided) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided CI at level 1 - 2*alpha from Student's t with `df` degrees of freedom."""
    q = sps.t.ppf(1.0 - np.asarray(alpha_one_sided), df)
    return mean - q * se, mean + q * se


# ---------------------------------------------------------------- estimates


@dataclass
class Estimate:
    """One gated comparison: the oriented difference and how to get its CI at any level."""

    metric: str
    reference: float  # the metric's value for the reference (in its own orientation)
    variant: float
    diff: float  # oriented: negative = variant worse
    se: float
    n: int  # items
    n_clusters: int
    method: str  # "paired-t", "cluster-t" or "cluster-bootstrap"
    higher_is_better: bool = True
    df: int | None = None
    boot: np.ndarray | None = field(default=None, repr=False)  # bootstrap distribution of diff
    # The range one item's (oriented) difference can take, e.g. (-1, 1) for scores in [0, 1];
    # None = unbounded. CIs are clipped to it, and it bounds the CI when no item differs.
    diff_range: tuple[float, float] | None = None
    # Scores were all 0 or 1, so each item's difference is -w, 0 or +w (w = the range's end).
    binary: bool = False
    # (clustered SE / item-level SE)^2 as observed, >= 1: how much clustering inflates variance.
    design_effect: float = 1.0

    def se_for_pass(self, margin: float | None) -> float:
        """The SE behind the lower bound (the `pass` side). For binary scores a difference at
        the margin cannot have less spread than items that are either w worse or unchanged, so
        the SE is at least w * sqrt(r (1 - r) * deff / n), r = margin / w: the null variance of a
        score test, inflated by the observed design effect where items are clustered. The observed SE alone is too small when only a few items differ, all one way (the
        usual case for a good quantized variant): at n = 100..400 with the true difference on
        the margin, the plain t bound passed 6-12% of the time instead of 2.5%; with the floor
        0.5-2% (tests/test_stats.py simulates it)."""
        if not (self.binary and margin and self.diff_range and self.se > 0.0):
            return self.se
        w = self.diff_range[1]
        r = min(margin / w, 1.0)
        return max(self.se, w * math.sqrt(r * (1.0 - r) * max(self.design_effect, 1.0) / self.n))

    def ci(self, alpha_one_sided: float, margin: float | None = None) -> tuple[float, float]:
        """Two-sided CI at level 1 - 2*alpha; given the margin, the lower bound is the one the
        `pass` test uses (see se_for_pass)."""
        if self.se == 0.0:
            lo, hi = self._no_spread_ci(alpha_one_sided)
        elif self.boot is not None:
            lo, hi = np.quantile(self.boot, [alpha_one_sided, 1.0 - alpha_one_sided])
        else:
            lo, hi = t_interval(self.diff, self.se, self.df, alpha_one_sided)
            lo = min(lo, t_interval(self.diff, self.se_for_pass(margin), self.df, alpha_one_sided)[0])
        if self.diff_range is not None:
            lo, hi = max(lo, self.diff_range[0]), min(hi, self.diff_range[1])
        return float(lo), float(hi)

    def _no_spread_ci(self, alpha: float) -> tuple[float, float]:
        """Every item (cluster) has the same difference, so the SE estimate is 0, but a sample of
        G clusters with no exception only bounds the share of exceptions: by the exact binomial
        (Clopper-Pearson) bound for 0 of G, it is below u = 1 - alpha^(1/G) at confidence 1 - alpha
        (the "rule of three" when alpha = 0.05). Exceptions could move the mean at most u times
        the distance to the end of `diff_range`. Unbounded metrics keep the point."""
        if self.diff_range is None:
            return self.diff, self.diff
        u = 1.0 - alpha ** (1.0 / max(self.n_clusters, 1))
        return (self.diff - u * (self.diff - self.diff_range[0]),
                self.diff + u * (self.diff_range[1] - self.diff))

    def _no_spread_p(self, bound: float, end: float) -> float:
        """The p matching _no_spread_ci: the alpha at which its bound reaches -margin, i.e. the
        largest alpha with u(alpha) >= the share r of the way from diff to the range's end."""
        if self.diff_range is None or end == self.diff:
            return 0.0
        r = (self.diff - bound) / (self.diff - end)
        return float((1.0 - min(max(r, 0.0), 1.0)) ** max(self.n_clusters, 1))

    def p_value(self, margin: float) -> float:
        """One-sided p for H0: diff <= -margin (small = clearly non-inferior, a `pass`). Used to
        order the Holm steps; the status itself is always read off the CI that is printed."""
        if self.se == 0.0:
            if self.diff <= -margin:
                return 1.0
            return self._no_spread_p(-margin, self.diff_range[0]) if self.diff_range else 0.0
        if self.boot is not None:
            # Percentile-bootstrap p, consistent with the percentile CI above; +1 keeps it > 0.
            return float((np.sum(self.boot <= -margin) + 1) / (self.boot.size + 1))
        return float(sps.t.sf((self.diff + margin) / self.se_for_pass(margin), self.df))

    def p_value_inferior(self, margin: float) -> float:
        """One-sided p for H0: diff >= -margin (small = clearly inferior, a `fail`)."""
        if self.se == 0.0:
            if self.diff >= -margin:
                return 1.0
            return self._no_spread_p(-margin, self.diff_range[1]) if self.diff_range else 0.0
        if self.boot is not None:
            return float((np.sum(self.boot >= -margin) + 1) / (self.boot.size + 1))
        return float(sps.t.cdf((self.diff + margin) / self.se, self.df))


def usable_clusters(clusters, n: int, min_clusters: int) -> tuple[np.ndarray, str]:
    """Cluster codes to use, and the method's name.

    A clustered SE estimates the between-cluster spread from the clusters themselves; with a
    handful of clusters (4 prompt templates, say) that estimate is nearly worthless and t with
    G - 1 df makes the CI several times wider. Below `min_clusters` the clusters are treated as
    fixed strata instead: the pairing already cancels each template's difficulty (both models see
    the same items), and item-level SEs are valid for the fixed mix of templates.
    """
    codes = cluster_codes(clusters, n)
    g = int(codes.max()) + 1
    if g == n:
        return np.arange(n), "paired-t"
    if g < min_clusters:
        return np.arange(n), f"paired-t ({g} clusters < {min_clusters}: treated as strata)"
    return codes, "cluster-t"


def paired_difference(reference: Sequence[float], variant: Sequence[float], clusters=None,
                      metric: str = "score", higher_is_better: bool = True,
                      min_clusters: int = 2, score_range: tuple[float, float] | None = None) -> Estimate:
    """Paired difference of per-item scores (same items, same order) with a (clustered) t CI."""
    ref = np.asarray(reference, dtype=float)
    var = np.asarray(variant, dtype=float)
    if ref.shape != var.shape or ref.ndim != 1:
        raise ValueError(f"paired scores must be 1-D and equal length, got {ref.shape} vs {var.shape}")
    codes, method = usable_clusters(clusters, ref.size, min_clusters)
    sign = 1.0 if higher_is_better else -1.0
    d = sign * (var - ref)
    mean, se, df = paired_mean_se(d, None if method != "cluster-t" else codes)
    deff = 1.0
    if method == "cluster-t" and se > 0:
        deff = float((se / paired_mean_se(d, None)[1]) ** 2)
    rng = diff_range_of(score_range, ref, var)
    binary = bool(rng) and all(np.all((s == 0.0) | (s == 1.0)) for s in (ref, var)) and rng[1] == 1.0
    return Estimate(metric=metric, reference=float(ref.mean()), variant=float(var.mean()),
                    diff=float(mean) + 0.0, se=float(se), n=int(ref.size), n_clusters=df + 1,
                    method=method, higher_is_better=higher_is_better, df=df, diff_range=rng,
                    binary=binary, design_effect=deff)


def diff_range_of(score_range: tuple[float, float] | None, *scores: np.ndarray) -> tuple[float, float] | None:
    """The range of a per-item difference: +-(hi - lo) for scores known to lie in [lo, hi]; when
    no range is given, (-1, 1) if every score lies in [0, 1] (accuracies, exact match), else None."""
    if score_range is None:
        if all(np.all((s >= 0.0) & (s <= 1.0)) for s in scores):
            score_range = (0.0, 1.0)
        else:
            return None
    width = float(score_range[1] - score_range[0])
    return (-width, width)


# A weighted statistic maps item weights w[B, n] (a bootstrap resample expressed as how many times
# each item was drawn) to one value per row, shape [B].
WeightedStat = Callable[[np.ndarray], np.ndarray]


def cluster_bootstrap(ref_stat: WeightedStat, var_stat: WeightedStat, n: int, clusters=None,
                      metric: str = "statistic", higher_is_better: bool = True,
                      n_resamples: int = 2000, seed: int = 0, min_clusters: int = 2,
                      score_range: tuple[float, float] | None = None) -> Estimate:
    """Paired cluster bootstrap (scipy.stats.bootstrap) of var_stat - ref_stat.

    Clusters are resampled with replacement and both models are scored on the same resample,
    which is what makes it paired. The statistics take item weights rather than index lists so
    that a whole batch of resamples is one array operation.
    """
    codes, method = usable_clusters(clusters, n, min_clusters)
    g = int(codes.max()) + 1
    sign = 1.0 if higher_is_better else -1.0

    def diff_of(ids: np.ndarray, axis: int = -1) -> np.ndarray:
        ids = np.moveaxis(np.asarray(ids), axis, -1)
        batch_shape = ids.shape[:-1]
        ids = ids.reshape(-1, g).astype(np.int64)
        counts = np.zeros((ids.shape[0], g))
        np.add.at(counts, (np.repeat(np.arange(ids.shape[0]), g), ids.ravel()), 1.0)
        w = counts[:, codes]  # [B, n]: each item weighted by its cluster's draw count
        return (sign * (var_stat(w) - ref_stat(w))).reshape(batch_shape)

    ones = np.ones((1, n))
    ref_value, var_value = float(ref_stat(ones)[0]), float(var_stat(ones)[0])
    point = sign * (var_value - ref_value) + 0.0  # + 0.0 turns -0.0 into 0.0 for the table
    res = sps.bootstrap((np.arange(g),), diff_of, vectorized=True, n_resamples=n_resamples,
                        method="percentile", rng=np.random.default_rng(seed), batch=500)
    boot = np.asarray(res.bootstrap_distribution, dtype=float)
    return Estimate(metric=metric, reference=ref_value, variant=var_value, diff=point,
                    se=float(boot.std(ddof=1)), n=n, n_clusters=g,
                    method=method.replace("paired-t", "paired bootstrap").replace("cluster-t", "cluster bootstrap"),
                    higher_is_better=higher_is_better, boot=boot,
                    diff_range=diff_range_of(score_range) if score_range else None)


# ---------------------------------------------------------------- calibration metrics


def weighted_mean(values: np.ndarray) -> WeightedStat:
    values = np.asarray(values, dtype=float)
    return lambda w: (w @ values) / w.sum(axis=-1)


def brier_per_item(option_probs: Sequence[Sequence[float]], labels: Sequence[int]) -> np.ndarray:
    """Multi-class Brier score per item: sum_j (p_j - [j == label])^2 over the options,
    after normalising each item's option probabilities to sum to 1 (lower is better)."""
    out = np.empty(len(labels))
    for i, (probs, label) in enumerate(zip(option_probs, labels)):
        p = _normalised(probs)
        onehot = np.zeros_like(p)
        onehot[int(label)] = 1.0
        out[i] = float(((p - onehot) ** 2).sum())
    return out


def confidence_and_correct(option_probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """Top-choice probability and whether the top choice is the label, per item."""
    conf, correct = np.empty(len(labels)), np.empty(len(labels))
    for i, (probs, label) in enumerate(zip(option_probs, labels)):
        p = _normalised(probs)
        conf[i], correct[i] = p.max(), float(int(p.argmax()) == int(label))
    return conf, correct


def ece_statistic(confidence: np.ndarray, correct: np.ndarray, bins: int = 10) -> WeightedStat:
    """Expected calibration error with equal-width confidence bins, as a weighted statistic:
    ECE = sum_b |sum_{i in b} w_i (conf_i - correct_i)| / sum_i w_i  (lower is better)."""
    confidence = np.asarray(confidence, dtype=float)
    gap = confidence - np.asarray(correct, dtype=float)
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    onehot = np.zeros((confidence.size, bins))
    onehot[np.arange(confidence.size), which] = 1.0
    return lambda w: np.abs((w * gap) @ onehot).sum(axis=-1) / w.sum(axis=-1)


def _normalised(probs) -> np.ndarray:
    p = np.asarray(probs, dtype=float)
    if p.ndim != 1 or p.size < 2 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"option_probs must be >= 2 finite non-negative numbers, got {list(p)}")
    return p / p.sum()


# ---------------------------------------------------------------- decisions


def noninferiority_status(lo: float, hi: float, margin: float) -> str:
    """pass: the whole CI lies above -margin; fail: the whole CI lies below; else inconclusive."""
    if lo > -margin:
        return "pass"
    if hi < -margin:
        return "fail"
    return "inconclusive"


def items_needed(est: Estimate, margin: float, alpha_one_sided: float, power: float = 0.8) -> int | None:
    """Items that would settle the test (pass or fail) with probability `power`, if the true
    difference and the per-item spread are what was observed.

    Normal approximation: n = ((z_{1-alpha} + z_{power}) * sd / |diff + margin|)^2, where
    sd = se * sqrt(n) is the per-item spread *including* the clustering (design effect), so a
    slice with clustered items asks for proportionally more items. None when the observed
    difference sits exactly on -margin (no finite n settles it).
    """
    gap = abs(est.diff + margin)
    if est.se == 0.0:
        # No spread observed: the n at which _no_spread_ci's bound clears -margin, if the
        # items keep agreeing (scaled from clusters to items).
        if est.diff_range is None or gap == 0.0:
            return est.n
        end = est.diff_range[0] if est.diff > -margin else est.diff_range[1]
        r = min(gap / abs(est.diff - end), 1.0) if est.diff != end else 1.0
        if r >= 1.0:
            return est.n
        g = math.floor(math.log(alpha_one_sided) / math.log(1.0 - r)) + 1
        return int(math.ceil(g * est.n / max(est.n_clusters, 1)))
    if gap == 0.0:
        return None
    se = est.se_for_pass(margin) if est.diff > -margin else est.se
    sd = se * math.sqrt(est.n)
    z = sps.norm.ppf(1.0 - alpha_one_sided) + sps.norm.ppf(power)
    return int(math.ceil((z * sd / gap) ** 2))


def step_levels(p_values: Sequence[float], passes_at: Callable[[int, float], bool], alpha: float,
                method: str) -> list[float]:
    """The one-sided alpha at which each test's confidence bound is drawn, under a multiplicity
    method. The gate calls it twice: for the lower bounds (the `pass` family, H0: diff <= -margin)
    and for the upper bounds (the `fail` family, H0: diff >= -margin), so a false go and a false
    no-go are each controlled family-wise.

    - "none": alpha for every test. "bonferroni": alpha / m for every test.
    - "holm": tests in order of increasing p; the r-th (from 0) is drawn at alpha / (m - r). Holm
      stops at the first test that is not rejected at its level: that test and every later one are
      drawn at the stopping level, so no later test is rejected (Holm's step-down rule) and a
      printed bound always agrees with its printed status. `passes_at(i, level)` says whether
      test i's bound at that level rejects.
    """
    m = len(p_values)
    if method == "none" or m == 0:
        return [alpha] * m
    if method == "bonferroni":
        return [alpha / m] * m
    if method != "holm":
        raise ValueError(f"unknown multiplicity method {method!r} (holm, bonferroni, none)")
    levels = [alpha] * m
    stopped_at: float | None = None
    for rank, i in enumerate(np.argsort(p_values, kind="stable")):
        level = stopped_at if stopped_at is not None else alpha / (m - rank)
        levels[i] = level
        if stopped_at is None and not passes_at(int(i), level):
            stopped_at = level
    return levels


def adjusted_p_values(p_values: Sequence[float], alpha: float, method: str) -> tuple[list[bool], list[float]]:
    """(reject, adjusted p) from statsmodels' multipletests; step_levels agrees with its rejections
    (tests/test_stats.py), and gate.json reports the adjusted p beside each CI."""
    if method == "none" or not p_values:
        return [p < alpha for p in p_values], [float(p) for p in p_values]
    from statsmodels.stats.multitest import multipletests

    reject, adjusted, _, _ = multipletests(list(p_values), alpha=alpha, method=method)
    return [bool(r) for r in reject], [float(p) for p in adjusted]



# ---------------------------------------------------------------- medians over timing repeats
# (latency and marginal; kept in its own section at the end so it merges apart from the gate's)


def percentile_bootstrap(data: tuple, statistic: Callable, confidence: float = 0.95, seed: int = 0,
                         paired: bool = False, n_resamples: int = 2000) -> tuple[float, float]:
    """Percentile-bootstrap CI of `statistic(*samples, axis)` (vectorised), through scipy.stats.
    Each sample is resampled on its own unless `paired`."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate resamples of tiny samples are expected
        res = sps.bootstrap(data, statistic, paired=paired, vectorized=True, n_resamples=n_resamples,
                            confidence_level=confidence, method="percentile",
                            random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def median_ci(samples, confidence: float = 0.95, seed: int = 0) -> dict:
    """{"median", "ci": [lo, hi], "samples"}: percentile bootstrap of the median; the unit of
    resampling is one sample (a timing repeat)."""
    x = np.asarray([float(s) for s in samples], dtype=float)
    if x.size == 0:
        raise ValueError("median_ci needs at least one sample")
    med = float(np.median(x))
    if x.size < 2 or np.ptp(x) == 0:
        lo = hi = med
    else:
        lo, hi = percentile_bootstrap((x,), lambda a, axis: np.median(a, axis=axis), confidence, seed)
    return {"median": med, "ci": [min(lo, med), max(hi, med)], "samples": x.tolist()}

"""The statistics behind the gate and the quality summaries: clusters, paired differences and
their one-sided bounds, non-inferiority status, items needed to settle a test, multiplicity, and
the descriptive CIs of quality/<variant>.json.

`diff` is oriented so that NEGATIVE MEANS THE VARIANT IS WORSE, so the test is H0: diff <= -margin:
the lower bound above -margin is "pass", the upper bound below it "fail". The unit is the cluster
(items sharing a prompt, haystack or document). 0/1 scores get Tango's score bounds (PairedBinary),
anything else a CR1 cluster-robust t interval (PairedMean). Method: docs/methods/gate.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats as sps

from pipeline.stats import tango
from pipeline.stats.intervals import clip_contain, t_interval

def cluster_codes(clusters: Sequence | None, n: int) -> np.ndarray:
    """Integer codes 0..G-1 for cluster labels; None (or a None label) = the item is its own."""
    if clusters is None:
        return np.arange(n)
    if isinstance(clusters, np.ndarray) and clusters.dtype.kind in "iu":
        labels = clusters.astype(str).tolist()
    else:
        labels = [f"\0item{i}" if c is None else str(c) for i, c in enumerate(clusters)]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} cluster labels for {n} items")
    _, codes = np.unique(np.array(labels, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64)


def merge_clusters(n: int, *keys: Sequence | None) -> np.ndarray:
    """Cluster codes where two items share a cluster if they share ANY key (a `cluster` label, a
    prompt hash, ...), transitively; None = no key of that kind. Union-find over the items."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for key_list in keys:
        if key_list is None:
            continue
        if len(key_list) != n:
            raise ValueError(f"{len(key_list)} cluster keys for {n} items")
        first: dict = {}
        for i, k in enumerate(key_list):
            if k is None:
                continue
            j = first.setdefault(k, i)
            parent[root(i)] = root(j)
    return cluster_codes([root(i) for i in range(n)], n)


def design_effect_bound(codes: np.ndarray) -> float:
    """sum_g n_g^2 / n: the factor by which clustering multiplies the variance of a sum of n item
    scores when each cluster's items always agree (the most it can), 1 with no clusters."""
    sizes = np.bincount(np.asarray(codes))
    return float((sizes.astype(float) ** 2).sum() / sizes.sum())


@dataclass(frozen=True)
class ClusterSplit:
    """How a 0/1 cell's clusters enter its bound (pipeline/stats/paired.py, `cluster_split`)."""

    bound: float          # the design effect drawn on the bulk: its largest cluster size
    bulk: np.ndarray      # per cluster code: True = in the bulk (size <= bound)
    bulk_items: int
    large_share: float    # share of the items in clusters above `bound`, taken at their worst case
    large_clusters: int


def cluster_split(codes: np.ndarray, alpha: float = 0.025) -> ClusterSplit:
    """Which clusters the Tango bound covers, and at what design effect; the rest are bounded at
    their worst case (every item of theirs worse for the pass side, better for the fail side).
    Clusters of size <= s have at most s times the independent variance (Cauchy-Schwarz), so the
    bulk is drawn at design effect s; s is chosen from the sizes alone, never the scores: the one
    that gives an identical copy the highest lower bound (why: docs/methods/gate.md)."""
    codes = np.asarray(codes)
    sizes = np.bincount(codes)
    n = int(sizes.sum())
    best = None
    # Largest first: a tie keeps every cluster in the bulk. Codes with gaps (a group's items)
    # leave empty clusters in the count; they are no candidate size.
    for s in np.unique(sizes[sizes > 0])[::-1]:
        bulk = sizes <= s
        n_bulk = int(sizes[bulk].sum())
        share = 1.0 - n_bulk / n
        lo = (1.0 - share) * float(tango.bound(0, 0, n_bulk, alpha, float(s))) - share
        if best is None or lo > best[0] + 1e-12:
            best = (lo, ClusterSplit(float(s), bulk, n_bulk, share, int((~bulk).sum())))
    return best[1]


def binary_p(better, worse, split: ClusterSplit, margin: float, side: str = "pass"):
    """One-sided p of a 0/1 cell's pass (H0: diff <= -margin) or fail (H0: diff >= -margin) from
    the bulk's counts (arrays broadcast). With w the large clusters' share, the bulk is tested
    against (-margin + w) / (1 - w) for pass and (-margin - w) / (1 - w) for fail."""
    w, nb, deff = split.large_share, split.bulk_items, split.bound
    better, worse = np.asarray(better, dtype=float), np.asarray(worse, dtype=float)
    if side == "pass":
        d0 = (-margin + w) / (1.0 - w)
        if d0 >= 1.0:
            return np.ones(np.broadcast(better, worse).shape)
        return tango.p_value(better, worse, nb, d0, deff, "above")
    d0 = (-margin - w) / (1.0 - w)
    if d0 <= -1.0:
        return np.ones(np.broadcast(better, worse).shape)
    return tango.p_value(better, worse, nb, d0, deff, "below", shift=tango.FAIL_CORRECTION * deff)


def mean_se(d: np.ndarray, codes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean and CR1 cluster-robust standard error of d[..., n], clustered by `codes`: (mean, se,
    G - 1 df); statsmodels' OLS(cov_type="cluster") for an intercept, over a leading batch axis."""
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    mean = d.mean(axis=-1)
    if codes is None or int(np.max(codes)) + 1 == n:
        if n < 2:
            raise ValueError("need at least two items for a standard error")
        return mean, np.sqrt(d.var(axis=-1, ddof=1) / n), n - 1
    g = int(np.max(codes)) + 1
    if g < 2:
        raise ValueError("need at least two clusters for a standard error")
    onehot = np.zeros((n, g))
    onehot[np.arange(n), codes] = 1.0
    sums = (d - mean[..., None]) @ onehot  # [..., G] cluster sums of residuals
    return mean, np.sqrt(g / (g - 1) * (sums**2).sum(axis=-1) / n**2), g - 1


def t_bound(diff, se, df, alpha, side: int):
    """diff + side * t_{df}(1 - alpha) * se: the one-sided t bound (side -1 lower, +1 upper)."""
    return np.asarray(diff) + side * sps.t.isf(alpha, df) * np.asarray(se)


@dataclass
class Estimate:
    """One gated comparison. Subclasses give lower(alpha) / upper(alpha) (one-sided bounds),
    p_pass(margin) (H0: diff <= -margin; < alpha exactly when lower(alpha) > -margin), p_fail(margin)
    (H0: diff >= -margin) and items_needed(margin, alpha, power): the items that would settle the
    test with probability `power` if the observed difference and spread were the truth (None when
    no n settles it)."""

    metric: str
    reference: float  # the metric's value for the reference (in its own orientation)
    variant: float
    diff: float  # oriented: negative = variant worse
    se: float  # standard error of diff (clustered), for the table
    n: int  # items
    n_clusters: int
    method: str
    higher_is_better: bool = True
    design_effect: float = 1.0  # PairedBinary: the one its bound uses; PairedMean: the observed one

    def ci(self, alpha_lower: float, alpha_upper: float | None = None) -> tuple[float, float]:
        """(lower bound at alpha_lower, upper bound at alpha_upper), each one-sided."""
        return self.lower(alpha_lower), self.upper(alpha_lower if alpha_upper is None else alpha_upper)


@dataclass
class PairedBinary(Estimate):
    """0/1 scores: Tango's score bounds (pipeline/stats/tango.py) on the counts of items the variant
    gets right and the reference wrong (`better`) and the other way round (`worse`)."""

    better: int = 0
    worse: int = 0
    # cluster_split: the bulk's counts, and the share of items in larger clusters (worst case).
    bulk_better: int | None = None
    bulk_worse: int | None = None
    bulk_n: int | None = None
    large_share: float = 0.0
    large_clusters: int = 0

    def __post_init__(self):
        if self.bulk_n is None:
            self.bulk_better, self.bulk_worse, self.bulk_n = self.better, self.worse, self.n

    def _split(self) -> ClusterSplit:
        return ClusterSplit(self.design_effect, np.ones(0, bool), self.bulk_n, self.large_share,
                            self.large_clusters)

    def lower(self, alpha: float) -> float:
        w = self.large_share
        lo = tango.bound(self.bulk_better, self.bulk_worse, self.bulk_n, alpha, self.design_effect, "lower")
        return float(max((1.0 - w) * lo - w, -1.0))

    def upper(self, alpha: float) -> float:
        w, deff = self.large_share, self.design_effect
        hi = tango.bound(self.bulk_better, self.bulk_worse, self.bulk_n, alpha, deff, "upper",
                         shift=tango.FAIL_CORRECTION * deff)
        return float(min((1.0 - w) * hi + w, 1.0))

    def p_pass(self, margin: float) -> float:
        return float(binary_p(self.bulk_better, self.bulk_worse, self._split(), margin, "pass"))

    def p_fail(self, margin: float) -> float:
        return float(binary_p(self.bulk_better, self.bulk_worse, self._split(), margin, "fail"))

    def items_needed(self, margin: float, alpha: float, power: float) -> int | None:
        """The bulk's items (Tango's formula, shifted threshold) scaled to the cell's; None when
        the large clusters' worst case alone keeps the cell from settling at any n."""
        w = self.large_share
        passing = self.diff > -margin
        d0 = (-margin + w) / (1.0 - w) if passing else (-margin - w) / (1.0 - w)
        bulk_diff = (self.bulk_better - self.bulk_worse) / self.bulk_n
        if not -1.0 < d0 < 1.0 or (bulk_diff <= d0 if passing else bulk_diff >= d0):
            return None
        need = tango.items_needed(self.bulk_better, self.bulk_worse, self.bulk_n, d0, alpha, power,
                                  self.design_effect)
        return None if need is None else int(math.ceil(need * self.n / self.bulk_n))


@dataclass
class PairedMean(Estimate):
    """Any other score: t bounds from the CR1 standard error with G - 1 df, clipped to the range
    a difference can take. With no spread (se == 0, e.g. an identical copy) the bound moves the
    mean u of the way to the range's end, u = Clopper-Pearson's upper bound for 0 of G clusters."""

    df: int = 1
    diff_range: tuple[float, float] | None = None

    def _exceptions(self, alpha: float) -> float:
        from statsmodels.stats.proportion import proportion_confint

        return float(proportion_confint(0, self.n_clusters, alpha=2 * alpha, method="beta")[1])

    def _bound(self, alpha: float, side: int) -> float:
        if self.se == 0.0:
            if self.diff_range is None:
                return self.diff
            end = self.diff_range[0] if side < 0 else self.diff_range[1]
            value = self.diff + self._exceptions(alpha) * (end - self.diff)
        else:
            value = float(t_bound(self.diff, self.se, self.df, alpha, side))
        if self.diff_range is not None:
            value = min(max(value, self.diff_range[0]), self.diff_range[1])
        return float(value)

    def lower(self, alpha: float) -> float:
        return self._bound(alpha, -1)

    def upper(self, alpha: float) -> float:
        return self._bound(alpha, +1)

    def _no_spread_p(self, threshold: float, end: float) -> float:
        """The alpha at which the no-spread bound reaches `threshold`: (1 - r)^G, r the share of
        the way from diff to the range's end."""
        if self.diff_range is None or end == self.diff:
            return 0.0
        r = min(max((self.diff - threshold) / (self.diff - end), 0.0), 1.0)
        return float((1.0 - r) ** self.n_clusters)

    def p_pass(self, margin: float) -> float:
        if self.se == 0.0:
            if self.diff <= -margin:
                return 1.0
            return self._no_spread_p(-margin, self.diff_range[0]) if self.diff_range else 0.0
        return float(sps.t.sf((self.diff + margin) / self.se, self.df))

    def p_fail(self, margin: float) -> float:
        if self.se == 0.0:
            if self.diff >= -margin:
                return 1.0
            return self._no_spread_p(-margin, self.diff_range[1]) if self.diff_range else 0.0
        return float(sps.t.cdf((self.diff + margin) / self.se, self.df))

    def items_needed(self, margin: float, alpha: float, power: float) -> int | None:
        gap = abs(self.diff + margin)
        if self.se == 0.0:
            # If the clusters keep agreeing: the G at which the no-spread bound clears -margin
            # (alpha = (1 - r)^G), scaled from clusters to items.
            if self.diff_range is None or gap == 0.0:
                return self.n
            end = self.diff_range[0] if self.diff > -margin else self.diff_range[1]
            r = min(gap / abs(self.diff - end), 1.0) if self.diff != end else 1.0
            if r >= 1.0:
                return self.n
            g = math.floor(math.log(alpha) / math.log(1.0 - r)) + 1
            return int(math.ceil(g * self.n / max(self.n_clusters, 1)))
        if gap == 0.0:
            return None
        from statsmodels.stats.power import TTestPower

        sd = self.se * math.sqrt(self.n)  # per item, including the design effect
        n = TTestPower().solve_power(effect_size=gap / sd, alpha=alpha, power=power,
                                     alternative="larger")
        return int(math.ceil(float(np.squeeze(n))))


def diff_range_of(score_range: tuple[float, float] | None, *scores: np.ndarray) -> tuple[float, float] | None:
    """The range of a per-item difference: +-(hi - lo) for scores in [lo, hi]; without a range,
    (-1, 1) if every score lies in [0, 1], else None."""
    if score_range is None:
        if all(np.all((s >= 0.0) & (s <= 1.0)) for s in scores):
            score_range = (0.0, 1.0)
        else:
            return None
    width = float(score_range[1] - score_range[0])
    return (-width, width)


def paired_difference(reference: Sequence[float], variant: Sequence[float], clusters=None,
                      metric: str = "score", higher_is_better: bool = True,
                      score_range: tuple[float, float] | None = None) -> Estimate:
    """Paired difference of per-item scores (same items, same order). `clusters`: labels (None =
    own cluster) or integer codes, e.g. from merge_clusters. 0/1 scores give a PairedBinary,
    anything else a PairedMean."""
    ref = np.asarray(reference, dtype=float)
    var = np.asarray(variant, dtype=float)
    if ref.shape != var.shape or ref.ndim != 1:
        raise ValueError(f"paired scores must be 1-D and equal length, got {ref.shape} vs {var.shape}")
    n = ref.size
    codes = cluster_codes(clusters, n)
    g = int(codes.max()) + 1
    sign = 1.0 if higher_is_better else -1.0
    d = sign * (var - ref)
    common = dict(metric=metric, reference=float(ref.mean()), variant=float(var.mean()),
                  diff=float(d.mean()) + 0.0, n=int(n), n_clusters=g, higher_is_better=higher_is_better)
    binary = all(np.all((s == 0.0) | (s == 1.0)) for s in (ref, var)) and score_range in (None, (0.0, 1.0))
    if binary:
        split = cluster_split(codes)
        deff = split.bound
        better, worse = int((d > 0).sum()), int((d < 0).sum())
        in_bulk = split.bulk[codes]
        bb, bw = int((d[in_bulk] > 0).sum()), int((d[in_bulk] < 0).sum())
        se = math.sqrt(deff * max((better + worse) / n - common["diff"] ** 2, 0.0) / n)
        method = "tango score" if g == n else f"tango score, {g} clusters (design effect {deff:g}, the largest cluster)"
        if split.large_clusters:
            method = (f"tango score on {g - split.large_clusters} clusters (design effect {deff:g}, the largest); "
                      f"{split.large_clusters} larger clusters ({split.large_share:.1%} of items) at their worst case")
        return PairedBinary(**common, se=se, method=method, design_effect=deff, better=better, worse=worse,
                            bulk_better=bb, bulk_worse=bw, bulk_n=split.bulk_items,
                            large_share=split.large_share, large_clusters=split.large_clusters)
    if n < 2 or g < 2:
        raise ValueError("need at least two items (clusters) for a standard error")
    _, se, df = mean_se(d, None if g == n else codes)
    deff = float(se**2 / (d.var(ddof=1) / n)) if se > 0 and d.var() > 0 else 1.0
    return PairedMean(**common, se=float(se), method="paired-t" if g == n else "cluster-t",
                      design_effect=deff, df=df, diff_range=diff_range_of(score_range, ref, var))


def noninferiority_status(lo: float, hi: float, margin: float) -> str:
    """pass: the whole CI lies above -margin; fail: the whole CI lies below; else inconclusive."""
    if lo > -margin:
        return "pass"
    if hi < -margin:
        return "fail"
    return "inconclusive"


def adjusted_p_values(p_values: Sequence[float], alpha: float, method: str) -> tuple[list[bool], list[float]]:
    """(reject, adjusted p) from statsmodels' multipletests (gate.json reports the adjusted p)."""
    if method == "none" or not p_values:
        return [p < alpha for p in p_values], [float(p) for p in p_values]
    from statsmodels.stats.multitest import multipletests

    reject, adjusted, _, _ = multipletests(list(p_values), alpha=alpha, method=method)
    return [bool(r) for r in reject], [float(p) for p in adjusted]


def mean_ci(scores: Sequence[float], codes: np.ndarray | None, confidence: float) -> tuple[float, list, str]:
    """(mean, [lo, hi], a one-line method) of one model's scores (the quality summaries). Scores
    in [0, 1]: Wilson's interval at the clustered mean's effective sample size p(1-p)/se^2 (Korn &
    Graubard 1998; n / design_effect_bound when se is 0); other scores: the CR1 t interval."""
    y = np.asarray(scores, dtype=float)
    n = y.size
    mean = float(y.mean()) if n else math.nan
    if n < 2:
        return mean, [None, None], "fewer than 2 items"
    codes = np.arange(n) if codes is None else np.asarray(codes)
    g = int(codes.max()) + 1
    unit = "items" if g == n else f"{g} clusters"
    se = float(mean_se(y, codes)[1]) if g >= 2 else math.inf
    if np.all((y >= 0.0) & (y <= 1.0)):
        from statsmodels.stats.proportion import proportion_confint

        spread = mean * (1.0 - mean)
        usable = 0.0 < se < math.inf and spread > 0.0
        n_eff = spread / se**2 if usable else n / design_effect_bound(codes)
        lo, hi = proportion_confint(mean * n_eff, n_eff, alpha=1.0 - confidence, method="wilson")
        # Containing the mean: float rounding can put Wilson's end a hair inside a mean of 0 or 1.
        return mean, clip_contain(lo, hi, mean), f"Wilson at effective n {n_eff:.1f} ({unit})"
    if g < 2:
        return mean, [None, None], "one cluster"
    return mean, t_interval(mean, se, g - 1, confidence), f"t, CR1 ({unit})"

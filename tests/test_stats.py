"""The gate's statistics against references: Tango's interval against a published example and a
numerical maximum likelihood, the CR1 standard error against statsmodels, the exact bound against
statsmodels' Clopper-Pearson, the calibration metrics by hand, and the
descriptive CIs of the quality summaries. The error-rate simulations are in test_gate_sims.py."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps

from pipeline.stats import scoring_rules as R
from pipeline.stats import paired as S
from pipeline.stats import tango
from pipeline.core.config import Config, GateConfig

MARGIN = GateConfig().margin
ALPHA = (1 - Config().confidence) / 2  # one-sided, 0.025 for a 95% CI


def test_tango_matches_the_published_example():
    # Fagerland, Lydersen & Laake (2017), Cavo et al. 2012's table [[59, 6], [16, 80]]: Tango's
    # asymptotic score CI for the difference is -0.0621 (-0.1240 to -0.0054), as printed (4 dp).
    est = S.paired_difference([0] * 6 + [1] * 16 + [1] * 59 + [0] * 80,
                              [1] * 6 + [0] * 16 + [1] * 59 + [0] * 80)
    assert isinstance(est, S.PairedBinary) and (est.better, est.worse, est.n) == (6, 16, 161)
    assert round(est.diff, 4) == -0.0621
    lo, hi = est.ci(ALPHA)
    assert abs(lo - -0.1240) < 5e-5, lo
    assert abs(tango.bound(6, 16, 161, ALPHA, side="upper") - -0.0054) < 5e-5
    # The gate's upper bound (the fail side) adds one item to Tango's numerator (issue 26): it
    # is Tango's bound for the table with one item fewer worse, better by about 1/161.
    assert hi == pytest.approx(float(tango.bound(6, 16, 161, ALPHA, side="upper", shift=1.0)))
    assert 0.005 < hi - -0.0054 < 0.0075


def test_tango_constrained_mle_and_bounds_against_brute_force():
    """The closed-form constrained MLE equals a numerical maximisation of the multinomial
    likelihood, and the vectorised bound equals a scalar root of the same Z (1e-8)."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(5, 300))
        better, worse = (int(x) for x in rng.multinomial(n, [0.1, 0.15, 0.75])[:2])
        d0 = float(rng.uniform(-0.3, 0.3))

        def nll(q):  # p_worse = q, p_better = q + d0
            p = np.array([q + d0, q, 1 - 2 * q - d0])
            return -np.dot([better, worse, n - better - worse], np.log(np.maximum(p, 1e-300)))

        lo_q, hi_q = max(0.0, -d0), (1 - d0) / 2
        q_num = optimize.minimize_scalar(nll, bounds=(lo_q, hi_q), method="bounded",
                                         options={"xatol": 1e-12}).x
        assert abs(tango.constrained_worse_rate(better, worse, n, d0) - q_num) < 1e-5
        for side, sign in (("lower", 1), ("upper", -1)):
            z = sps.norm.isf(ALPHA)
            diff = (better - worse) / n
            if diff in (-1.0, 1.0):
                continue
            ends = (-1 + 1e-12, diff) if side == "lower" else (diff, 1 - 1e-12)
            scalar = optimize.brentq(lambda x: float(tango.score_z(better, worse, n, x)) - sign * z,
                                     *ends, xtol=1e-14)
            assert abs(tango.bound(better, worse, n, ALPHA, side=side) - scalar) < 1e-8


def test_bounds_agree_with_p_values_so_a_printed_ci_is_the_decision():
    rng = np.random.default_rng(1)
    for _ in range(80):
        n = int(rng.integers(10, 400))
        ref = (rng.random(n) < 0.7).astype(float)
        var = np.where(rng.random(n) < rng.uniform(0, 0.3), 1 - ref, ref)
        codes = rng.integers(0, max(2, n // int(rng.integers(1, 5))), n)
        for est in (S.paired_difference(ref, var, codes), S.paired_difference(ref, var + 0.25 * var)):
            lo, hi = est.ci(ALPHA)
            for margin in (0.02, 0.05, 0.1):
                p, q = est.p_pass(margin), est.p_fail(margin)
                if abs(p - ALPHA) > 1e-6:
                    assert (p < ALPHA) == (lo > -margin), (est, margin)
                if abs(q - ALPHA) > 1e-6:
                    assert (q < ALPHA) == (hi < -margin), (est, margin)


def test_cr1_standard_error_matches_statsmodels():
    import statsmodels.api as sm

    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(25), 4)
    d = rng.normal(size=100) + np.repeat(rng.normal(size=25), 4)
    mean, se, df = S.mean_se(d, clusters)
    fit = sm.OLS(d, np.ones_like(d)).fit(cov_type="cluster", cov_kwds={"groups": clusters})
    assert abs(mean - fit.params[0]) < 1e-12 and abs(se - fit.bse[0]) < 1e-12 and df == 24
    _, se1, df1 = S.mean_se(d)
    assert abs(se1 - d.std(ddof=1) / 10) < 1e-12 and df1 == 99


def test_merge_clusters_joins_items_sharing_any_key():
    labels = ["a", "a", None, None, "b", None]
    prompts = [None, "p", "p", "q", "q", None]
    codes = S.merge_clusters(6, labels, prompts)
    # 0-1 share "a", 1-2 share "p", 3-4 share "q", 4 is "b"; 5 is alone.
    assert len(set(codes[[0, 1, 2]])) == 1 and codes[3] == codes[4] and len(set(codes)) == 3
    assert S.design_effect_bound(codes) == pytest.approx((9 + 4 + 1) / 6)
    assert S.design_effect_bound(np.arange(5)) == 1.0


def test_no_spread_bound_is_statsmodels_clopper_pearson():
    from statsmodels.stats.proportion import proportion_confint

    # Every cluster has the same mean difference (here: none differs), non-binary scores.
    scores = [1, 0, 1, 1, 0.5]
    est = S.paired_difference(scores, scores)
    assert isinstance(est, S.PairedMean) and est.se == 0.0 and est.diff_range == (-1.0, 1.0)
    u = proportion_confint(0, 5, alpha=2 * ALPHA, method="beta")[1]
    assert np.allclose(est.ci(ALPHA), (-u, u), atol=1e-12) and np.isclose(u, 1 - ALPHA ** (1 / 5))
    p = est.p_pass(MARGIN)  # the alpha at which the bound touches -margin
    assert np.isclose(est.lower(p), -MARGIN) and est.p_fail(MARGIN) == 1.0
    n = est.items_needed(MARGIN, ALPHA, 0.8)
    big = S.paired_difference([1.0, 0.0, 0.5] * (n // 3 + 1), [1.0, 0.0, 0.5] * (n // 3 + 1))
    assert big.lower(ALPHA) > -MARGIN
    flat = S.paired_difference([3.0, 5.0], [3.0, 5.0])  # unbounded scores keep the point
    assert flat.diff_range is None and flat.ci(ALPHA) == (0.0, 0.0)


def test_t_bounds_are_clipped_to_the_possible_range():
    est = S.paired_difference([1.0] * 4, [0.0, 1.0, 1.0, 0.9])
    assert isinstance(est, S.PairedMean)
    raw = S.t_bound(est.diff, est.se, est.df, ALPHA, -1)
    assert raw < -1.0 and est.lower(ALPHA) == -1.0


def test_identical_binary_copy_needs_the_items_tango_says():
    n = S.paired_difference([1.0, 0.0], [1.0, 0.0]).items_needed(MARGIN, ALPHA, 0.8)
    assert n == 73  # 0 of n items differ: Tango's bound clears -5 points from n = 73
    for m, status in ((n, "pass"), (n - 1, "inconclusive")):
        est = S.paired_difference(np.arange(m) % 2, np.arange(m) % 2)
        assert S.noninferiority_status(*est.ci(ALPHA), MARGIN) == status
    # Duplicated prompts: 73 items in clusters of 3 (design effect 3) count as ~24 items.
    est = S.paired_difference(np.ones(73), np.ones(73), np.arange(73) // 3)
    assert est.lower(ALPHA) < -MARGIN and est.items_needed(MARGIN, ALPHA, 0.8) >= 3 * 72


def test_calibration_metrics_by_hand():
    probs = [[0.9, 0.1], [0.2, 0.6, 0.2], [0.5, 0.5], [0.3, 0.7]]
    labels = [0, 2, 1, 1]
    np.testing.assert_allclose(R.brier_per_item(probs, labels),
                               [0.02, 0.36 + 0.04 + 0.64, 0.5, 0.18], atol=1e-12)
    conf, correct = R.confidence_and_correct(probs, labels)
    np.testing.assert_allclose(conf, [0.9, 0.6, 0.5, 0.7])
    np.testing.assert_allclose(correct, [1, 0, 0, 1])  # ties go to the first option
    # Equal-width bins [k/10, (k+1)/10): 0.9 -> 9, 0.6 -> 6, 0.5 -> 5, 0.7 -> 7; one item each.
    assert R.calibration_error(conf, correct) == pytest.approx((0.1 + 0.6 + 0.5 + 0.3) / 4, abs=1e-12)
    # Equal-mass, 2 bins: {0.5, 0.6} (acc 0, conf 0.55) and {0.7, 0.9} (acc 1, conf 0.8); each
    # bin's squared gap minus acc(1 - acc)/(n_b - 1) = 0 here.
    want = 0.5 * 0.55**2 + 0.5 * 0.2**2
    assert R.calibration_error(conf, correct, bins=2, scheme="mass", power=2) == pytest.approx(want**0.5)
    assert R.calibration_error(conf, correct, bins=2, scheme="mass", power=2, debias=True) == \
        pytest.approx(want**0.5)
    mixed = R.calibration_error([0.6, 0.6, 0.8, 0.8], [1, 0, 1, 1], bins=2, scheme="mass", power=2, debias=True)
    assert mixed == pytest.approx(max(0.5 * (0.1**2 - 0.25 / 1) + 0.5 * 0.2**2, 0) ** 0.5)
    # The case two implementations disagreed on (0.475 vs 0.025): now one answer.
    summary = R.calibration_summary([[0.8, 0.2], [0.8, 0.2]], [0, 1])
    assert summary["ece"] == pytest.approx(0.3) and summary["brier"] == pytest.approx(0.68)
    with pytest.raises(ValueError):
        R.brier_per_item([[0.5, -0.1]], [0])


def test_descriptive_cis_stay_inside_0_1_and_cover_on_clustered_data():
    """quality/<variant>.json: Wilson at the clustered effective n. Simulated on 30 clusters of 4
    items sharing a difficulty (correlated), with a mean near the edge (0.92): coverage of the
    true mean within 0.93-0.97 (MC SE 0.5 points), and no bound outside [0, 1]. The t interval it
    replaces leaves [0, 1] on some of these slices."""
    rng = np.random.default_rng(3)
    sims, g, m = 2000, 30, 4
    a = sps.norm.ppf(0.92) * np.sqrt(1.3)  # P(z < a) = 0.92 for z ~ N(0, 1.3)
    z = np.repeat(rng.normal(0, np.sqrt(0.3), (sims, g)), m, axis=1) + rng.standard_normal((sims, g * m))
    y = (z < a).astype(float)
    codes = np.repeat(np.arange(g), m)
    cover = outside = t_outside = 0
    for row in y:
        mean, (lo, hi), _ = S.mean_ci(row, codes, 0.95)
        cover += lo <= 0.92 <= hi
        outside += lo < 0 or hi > 1
        _, se, df = S.mean_se(row, codes)
        t_outside += mean + sps.t.isf(0.025, df) * se > 1
    print(f"\ndescriptive CI, 30 clusters x 4, p = 0.92: coverage {cover / sims:.3f}; outside [0, 1]: "
          f"Wilson {outside / sims:.3f}, t {t_outside / sims:.3f}")
    assert outside == 0 and 0.93 <= cover / sims <= 0.97
    for scores in ([1.0] * 10, [0.0] * 3 + [1.0], [0.0, 1.0]):  # small groups, all-equal groups
        mean, (lo, hi), _ = S.mean_ci(scores, None, 0.95)
        assert 0.0 <= lo <= mean <= hi <= 1.0 and hi > lo

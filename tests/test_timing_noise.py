"""The run's pooled timing noise (pipeline/serving/timing_noise.py): the estimate against a known
noise, what it leaves out, the median's small-sample factor against its known values, and the
speedup interval's coverage at two repeats by simulation (tests/sim_timing_coverage.py has the
full table)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.serving.timing_noise import MIN_DF, MIN_ROUNDS, median_factor, noise_for, pooled_noise, timing_factors


def _doc(rng, figures: int, repeats: int, sd: float, temps=("0.0", "0.7")) -> dict:
    """A B = 1 latency pair document: per temperature, plain ms/token and `figures` drafted counts,
    each repeat's plain and each round time scaled by their own lognormal factor of sd `sd`."""
    out = {}
    for t in temps:
        plain = 10.0 * np.exp(rng.normal(0.0, sd, repeats))
        out[t] = {"plain_ms_per_token": {"samples": plain.tolist()},
                  "round_ms_by_drafted": {str(d): {"samples": ((12.0 + d) * np.exp(rng.normal(0.0, sd, repeats))).tolist(),
                                                   "rounds": 40 * repeats} for d in range(figures)}}
    return {"by_temperature": out}


def test_pooled_noise_recovers_a_known_noise_per_loop_and_for_the_run():
    """Plain and round time with independent lognormal factors of sd s: the per-repeat log ratio
    has sd s sqrt(2), the log round time s. 20 temperatures x 8 figures x 3 repeats per pair: 320
    figure df, 40 plain df, so about 140 effective df and a relative se near 0.06; tolerance 20%."""
    rng = np.random.default_rng(3)
    temps = [f"{t / 10:.1f}" for t in range(20)]
    pairs = {"a__ngram": _doc(rng, 8, 3, 0.01, temps), "a__self": _doc(rng, 8, 3, 0.03, temps)}
    noise = pooled_noise(pairs)
    for pair, s in (("a__ngram", 0.01), ("a__self", 0.03)):
        own = noise_for(noise, pair)
        assert own["figure_df"] == 20 * 8 * 2 and own["plain_df"] == 40 and own["figures"] == 160
        assert own["pooled_over"].startswith(pair) and 40 < own["df"] < 360  # between plain_df and the sum
        assert own["ratio_sd"] == pytest.approx(s * math.sqrt(2), rel=0.2)
        assert own["round_sd"] == pytest.approx(s, rel=0.2)
    # The run's pool lies between the loops'.
    assert 0.01 * math.sqrt(2) < noise["ratio_sd"] < 0.03 * math.sqrt(2) and noise["figure_df"] == 640
    assert noise["pooled_over"] == "the run"


def test_the_shared_plain_time_limits_the_degrees_of_freedom():
    """Many figures, one plain sequence per temperature: the ratio's variance is only as sure as
    the plain part's (2 temperatures x 2 df here), so the effective df stays near the plain df
    however many figures there are (Satterthwaite's df moves with the plain variance's own 4-df
    estimate, so the bound is loose), not the 320 figure df."""
    rng = np.random.default_rng(5)
    own = noise_for(pooled_noise({"p": _doc(rng, 80, 3, 0.01)}), "p")
    assert own["figure_df"] == 320 and own["plain_df"] == 4
    assert 4 <= own["df"] < 80


def test_pooled_noise_leaves_out_what_says_nothing_and_falls_back_to_the_run():
    rng = np.random.default_rng(4)
    small = _doc(rng, 1, 2, 0.01, temps=("0.0",))  # 1 df: below MIN_DF, takes the run's pool
    holes = _doc(rng, 3, 3, 0.01, temps=("0.0",))
    cols = holes["by_temperature"]["0.0"]["round_ms_by_drafted"]
    cols["0"]["samples"][1] = None  # a repeat with no round drafting 0: left out
    cols["1"]["rounds"] = MIN_ROUNDS * 3 - 1  # too few rounds behind the means: left out
    big = _doc(rng, 10, 3, 0.01)
    noise = pooled_noise({"p__small": small, "p__holes": holes, "p__big": big,
                          "p__screened": {"screened": True}})
    assert noise["phases"]["p__small"] is None and "p__screened" not in noise["phases"]
    holes_pool = _Pool_of(holes)
    assert holes_pool.figures == 1 and holes_pool.df == 2 and holes_pool.plain_df == 2
    assert noise["figure_df"] == 1 + 2 + 2 * 10 * 2 and noise["plain_df"] == 1 + 2 + 4
    assert noise_for(noise, "p__small")["pooled_over"] == "the run" and "phases" not in noise_for(noise, "p__small")
    assert noise_for(noise, "p__big")["figure_df"] == 40
    assert noise_for(None, "p__big") is None
    # Every figure timed once: no pool at all (the tables resample their own repeats).
    assert pooled_noise({"p": _doc(rng, 10, 1, 0.01)}) is None and MIN_DF > 1


def _Pool_of(doc: dict):
    from pipeline.serving.timing_noise import _Pool

    pool = _Pool()
    for block in doc["by_temperature"].values():
        pool.add(block["plain_ms_per_token"], list(block["round_ms_by_drafted"].values()))
    return pool


def test_median_factor_matches_the_known_variance_of_a_normal_median():
    """Var(median of n standard normals): n = 3: 0.4487, n = 5: 0.2868 (order-statistic tables),
    n = 2 and 4 by the mean of the middle two; large n: pi / (2n). Tolerance 1%."""
    assert median_factor(1) == median_factor(2) == 1.0
    assert median_factor(3) == pytest.approx(math.sqrt(3 * 0.4487), rel=0.01)
    assert median_factor(5) == pytest.approx(math.sqrt(5 * 0.2868), rel=0.01)
    assert median_factor(4) == pytest.approx(math.sqrt(4 * 0.2982), rel=0.01)
    assert median_factor(201) == pytest.approx(math.sqrt(math.pi / 2), rel=0.02)
    draws = timing_factors(np.random.default_rng(0), 0.02, 4, 1000, 100_000)
    assert np.log(draws).std() == pytest.approx(0.02 * median_factor(4) / 2, rel=0.02)


def test_two_repeat_speedup_interval_covers_with_the_pool_and_not_without():
    """The simulation of tests/sim_timing_coverage.py, timing part alone (every prompt realises
    E(k)), 2 repeats, 1% noise per factor, 300 tables through marginal_table: the table's own
    repeats give at most their range, which holds the true median half of the time; the pooled
    noise (its loop's, or the run's of 3 more loops where the loop's is short) gives near 95%. Monte Carlo se 0.013 at 0.95
    and 0.029 at 0.5; bounds 4 se away."""
    from tests.sim_timing_coverage import _block, acceptance, b1_cis, loop_noise, timing

    rng = np.random.default_rng(11)
    hits = {"own": 0, "pooled": 0}
    reps = 300
    for r in range(reps):
        acc, e_true = acceptance(rng, "exact")
        plain, rounds = timing(rng, 2, 0.01)
        pool = loop_noise(rng, _block(plain, rounds), 2, 0.01, 3, 0.0)
        truth = 10.0 * e_true[1] / 13.0
        for name, noise in (("own", None), ("pooled", pool)):
            lo, hi = b1_cis(acc, plain, rounds, r, noise)[1]
            hits[name] += lo <= truth <= hi
    assert hits["own"] / reps < 0.62
    assert hits["pooled"] / reps > 0.90

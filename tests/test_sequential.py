"""Group-sequential looks (pipeline/stats/sequential.py): the Lan-DeMets O'Brien-Fleming-type
boundaries against published values, their crossing probabilities by simulation, and the
sequential gate (Tango at each look's nominal level, pass and fail sides apart) on items drawn
at the margin: false pass and false fail <= nominal + 3 MC SE, and the items it spends.

    .venv/bin/python -m pytest -q -s tests/test_sequential.py     # -s prints the items-spent table
"""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.config import Config, GateConfig
from pipeline.stats import paired as S
from pipeline.stats import sequential as Q

MARGIN = GateConfig().margin
ALPHA = (1 - Config().confidence) / 2

# Lan-DeMets O'Brien-Fleming-type spending, one-sided alpha 0.025, K equally spaced looks
# (Jennison & Turnbull 2000 table 7.x; gsDesign's sfLDOF gives the same to 3 decimals).
PUBLISHED = {2: [2.963, 1.969], 3: [3.710, 2.511, 1.993], 4: [4.333, 2.963, 2.359, 2.014],
             5: [4.877, 3.357, 2.680, 2.290, 2.031]}


@pytest.mark.parametrize("k", sorted(PUBLISHED))
def test_boundaries_match_published_values(k):
    got = Q.boundaries(np.arange(1, k + 1) / k, ALPHA)
    assert np.allclose(got, PUBLISHED[k], atol=1.5e-3), (k, got)


@pytest.mark.parametrize("spending", sorted(Q.SPENDING))
def test_boundaries_spend_what_the_function_says_by_simulation(spending):
    """Brownian motion at the looks (independent increments): the share crossing at or before
    look k equals the spending function at t_k (3 MC SE), for equal and unequal spacing."""
    rng = np.random.default_rng(0)
    sims = 200_000
    for t in ([0.25, 0.5, 0.75, 1.0], [0.2, 0.45, 1.0]):
        c = np.array(Q.boundaries(t, ALPHA, spending))
        inc = rng.standard_normal((sims, len(t))) * np.sqrt(np.diff([0.0] + t))
        z = np.cumsum(inc, axis=1) / np.sqrt(t)
        crossed = np.cumsum(z >= c, axis=1) > 0
        for k in range(len(t)):
            want = float(Q.spending_function(spending)(t[k], ALPHA))
            got = crossed[:, k].mean()
            assert abs(got - want) < 3 * np.sqrt(want * (1 - want) / sims) + 1e-5, (t, k, got, want)
    levels = Q.nominal_levels([100, 200, 300, 400], 400, ALPHA, spending)
    if spending == "obf":
        assert levels[0] < 1e-4 and levels[-1] < ALPHA and levels[-1] > 0.02
    else:  # about even: every look between alpha / K and alpha / 2
        assert all(ALPHA / 4 < a < ALPHA / 2 for a in levels), levels


def test_pocock_type_spending_by_hand():
    """alpha ln(1 + (e - 1) t): 0 at 0, alpha at 1; a first look at t spends exactly that, so its
    boundary is Phi^-1(1 - alpha ln(1 + (e - 1) t)) (2.157 at t = 1/2, alpha 0.025: Lan-DeMets'
    Pocock-type K = 2 value); a bad name is refused."""
    assert Q.pocock_spending(0.0, ALPHA) == 0.0
    assert Q.pocock_spending(1.0, ALPHA) == pytest.approx(ALPHA, rel=1e-12)
    first = Q.boundaries([0.5, 1.0], ALPHA, "pocock")[0]
    assert first == pytest.approx(2.157, abs=1e-3)
    assert Q.nominal_levels([40, 240], 240, ALPHA, "pocock")[0] == pytest.approx(
        ALPHA * np.log1p((np.e - 1) / 6), rel=1e-9)
    with pytest.raises(ValueError, match="unknown spending"):
        Q.boundaries([0.5, 1.0], ALPHA, "haybittle")


def sequential_gate(rng, sims: int, worse: float, better: float, looks: list[int], codes=None,
                    spending: str = "obf"):
    """Vectorised sequential gate on independent items (or clusters `codes` over looks[-1] items):
    per simulation, the look it stopped at, and its status. Every look tests both sides with
    S.binary_p at the look's nominal levels; a cell that passes or fails stops."""
    n_max = looks[-1]
    levels = Q.nominal_levels(looks, n_max, ALPHA, spending)
    u = rng.random((sims, n_max))
    d = np.where(u < worse, -1, np.where(u < worse + better, 1, 0))
    status = np.full(sims, "open", dtype=object)
    spent = np.full(sims, n_max)
    for n, level in zip(looks, levels):
        split = S.cluster_split(np.arange(n) if codes is None else S.cluster_codes(codes[:n], n))
        bulk = split.bulk[np.arange(n) if codes is None else S.cluster_codes(codes[:n], n)]
        b, w = (d[:, :n][:, bulk] > 0).sum(1), (d[:, :n][:, bulk] < 0).sum(1)
        open_ = status == "open"
        passed = open_ & (S.binary_p(b, w, split, MARGIN, "pass") < level)
        failed = open_ & ~passed & (S.binary_p(b, w, split, MARGIN, "fail") < level)
        status[passed], status[failed] = "pass", "fail"
        spent[passed | failed] = n
    return status, spent


@pytest.mark.parametrize("looks,spending", [([200, 400], "obf"), ([100, 200, 300, 400], "obf"),
                                            ([80, 160, 240, 320, 400, 480, 560, 640], "obf"),
                                            ([40, 80, 120, 160, 200, 240], "pocock")])
def test_sequential_gate_holds_both_errors_at_the_margin(looks, spending):
    rng = np.random.default_rng(len(looks))
    sims = 8000
    limit = ALPHA + 3 * np.sqrt(ALPHA * (1 - ALPHA) / sims)
    for worse, better in ((0.05, 0.0), (0.06, 0.01), (0.10, 0.05), (0.20, 0.15)):
        status, _ = sequential_gate(rng, sims, worse, better, looks, spending=spending)
        fp, ff = np.mean(status == "pass"), np.mean(status == "fail")
        print(f"\nlooks {looks} ({spending}), mix {worse:.0%}/{better:.0%}: false pass {fp:.4f}, false fail {ff:.4f}")
        assert fp <= limit and ff <= limit, (looks, spending, worse, better, fp, ff)


def test_items_spent_table():
    """Items spent (mean, of at most 1000 in 10 waves of 100) on a clear fail (10%/0%), a clear
    pass (2%/2%), an identical model (0/0) and a cell on the margin (6%/1%)."""
    rng = np.random.default_rng(7)
    looks = list(range(100, 1001, 100))
    print("\n| variant | discordance worse/better | P(pass) | P(fail) | mean items spent |")
    for label, mix in (("clear fail", (0.10, 0.0)), ("clear pass", (0.02, 0.02)),
                       ("identical", (0.0, 0.0)), ("on the margin", (0.06, 0.01))):
        status, spent = sequential_gate(rng, 4000, *mix, looks)
        print(f"| {label} | {mix[0]:.0%}/{mix[1]:.0%} | {np.mean(status == 'pass'):.3f} | "
              f"{np.mean(status == 'fail'):.3f} | {spent.mean():.0f} |")
        if label == "identical":
            assert np.all(status == "pass") and spent.max() <= 300  # OBF spends little early
        if label == "clear fail":
            assert np.mean(status == "fail") > 0.95 and spent.mean() < 500  # 408 measured

"""What looks fitted to the budget buy (docs/methods/gate.md: "Looks fitted to the budget"). Not a test
(pytest collects test_*.py only); prints the table in docs/validation/fitted-looks.md:

    .venv/bin/python tests/sim_fitted_looks.py

One gated 0/1 cell of independent items on the default looks (40, 80, ..., 240), the fail side at
alpha / 7 (the default config's seven gated rows), stopped by the budget after look j (j = 1, 2,
3): P(pass) and P(fail) under O'Brien-Fleming spending alone and under the spending fitted to look
j (half of each side's alpha by then: pipeline/stats/sequential.py: fitted), each look through the
gate's own Tango bound (pipeline/stats/paired.py: binary_p) at the look's nominal level. Items
differ "worse" or "better" with the given probabilities.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.config import Config, GateConfig  # noqa: E402
from pipeline.stats import paired as S  # noqa: E402
from pipeline.stats import sequential as Q  # noqa: E402

MARGIN = GateConfig().margin
ALPHA = (1 - Config().confidence) / 2
LOOKS = [40, 80, 120, 160, 200, 240]
ROWS = 7
CASES = [("identical", 0.0, 0.0), ("clear pass 2/2", 0.02, 0.02), ("on the margin 6/1", 0.06, 0.01),
         ("clear fail 10/0", 0.10, 0.0), ("damage 20/0", 0.20, 0.0), ("damage 30/2", 0.30, 0.02)]


def rates(rng, sims: int, worse: float, better: float, taken: int, spending: str) -> tuple[float, float]:
    """(P(pass), P(fail)) of a cell stopped after look `taken` of LOOKS under `spending`."""
    lp = Q.nominal_levels(LOOKS, LOOKS[-1], ALPHA, spending)
    lf = Q.nominal_levels(LOOKS, LOOKS[-1], ALPHA / ROWS, spending)
    n_max = LOOKS[taken - 1]
    u = rng.random((sims, n_max))
    d = np.where(u < worse, -1, np.where(u < worse + better, 1, 0))
    status = np.full(sims, "open", dtype=object)
    for n, a_pass, a_fail in list(zip(LOOKS, lp, lf))[:taken]:
        split = S.cluster_split(np.arange(n))
        b, w = (d[:, :n] > 0).sum(1), (d[:, :n] < 0).sum(1)
        still = status == "open"
        passed = still & (S.binary_p(b, w, split, MARGIN, "pass") < a_pass)
        failed = still & ~passed & (S.binary_p(b, w, split, MARGIN, "fail") < a_fail)
        status[passed], status[failed] = "pass", "fail"
    return float(np.mean(status == "pass")), float(np.mean(status == "fail"))


def main(sims: int = 4000) -> None:
    rng = np.random.default_rng(7)
    print("| the budget affords | cell (worse / better) | O'Brien-Fleming: P(pass) / P(fail) | "
          "fitted: P(pass) / P(fail) |")
    print("|---|---|---|---|")
    for taken in (1, 2, 3):
        fit = Q.fitted("obf", LOOKS[taken - 1] / LOOKS[-1], 0.5)
        where = f"look 1 ({LOOKS[0]} items)" if taken == 1 else f"looks 1-{taken} ({LOOKS[taken - 1]} items)"
        for label, w, b in CASES:
            po, fo = rates(rng, sims, w, b, taken, "obf")
            pf, ff = rates(rng, sims, w, b, taken, fit)
            print(f"| {where} | {label} | {po:.3f} / {fo:.3f} | {pf:.3f} / {ff:.3f} |")


if __name__ == "__main__":
    main()

"""The run's time budget (issue 27): the config section and a stage's clock (pipeline/core/budget.py)."""
import math

import pytest

from pipeline.core.budget import StageBudget, fmt_s
from pipeline.core.config import BUDGET_SHARES, ConfigError, load_config


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_no_budget_is_the_exhaustive_run():
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": None}})
    b = StageBudget(cfg, "latency")
    assert not b.active and b.seconds is None and math.isinf(b.left())
    assert b.affords(1e12)
    assert b.to_json()["seconds"] is None


def test_a_stage_gets_its_share_and_counts_from_its_start():
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 30, "shares": {"latency": 0.4}}})
    assert cfg.budget.shares == {**BUDGET_SHARES, "latency": 0.4}
    clock = Clock()
    b = StageBudget(cfg, "latency", clock=clock)
    assert b.seconds == pytest.approx(720.0)
    clock.t += 600
    assert b.left() == pytest.approx(120.0)
    assert b.affords(119) and not b.affords(121)
    b.skip("pair x", "does not pay")
    b.announce("grids", 12.0)
    doc = b.to_json()
    assert doc["spent_s"] == 600.0 and doc["skipped"][0]["why"] == "does not pay"
    assert doc["estimates"][0]["estimate_s"] == 12.0
    assert "left" in b.eta(1, 2)


@pytest.mark.parametrize("budget, says", [
    ({"minutes": -1}, "budget.minutes"),
    ({"minutes": 30, "shares": {"report": 0.1}}, "unknown stage 'report'"),
    ({"minutes": 30, "shares": {"quality": 0.9}}, "> 1"),
    ({"minutes": 30, "shares": {"quality": 0}}, "> 0"),
])
def test_bad_budgets_are_one_line_errors(budget, says):
    with pytest.raises(ConfigError) as e:
        load_config("configs/smoke.yaml", {"budget": budget})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_fmt_s():
    assert [fmt_s(x) for x in (None, math.inf, 43, 450, 6000, 9000)] == ["-", "-", "43 s", "7.5 min", "100.0 min",
                                                                          "2.5 h"]


def test_the_plan_line_splits_the_budget():
    from pipeline.core.budget import plan_line

    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 30}})
    line = plan_line(cfg)
    assert line.startswith("time budget 30.0 min: acceptance 6.0 min, latency 9.0 min, quality 10.5 min")
    assert line.endswith("report) 4.5 min")
    assert "no time budget" in plan_line(load_config("configs/smoke.yaml", {"budget": {"minutes": None}}))


def test_a_part_of_the_budget_splits_what_is_left_and_never_exceeds_the_stage():
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 10, "shares": {"latency": 0.2}}})
    clock = Clock()
    b = StageBudget(cfg, "latency", clock=clock)  # 120 s
    clock.t += 20
    first = b.part("grids", 0.5, of_items=2)  # half of 100 s over 2 pieces
    assert first.seconds == pytest.approx(25.0) and first.affords(25) and not first.affords(26)
    clock.t += 10
    assert first.left() == pytest.approx(15.0)
    assert first.piece("one of three", 3).seconds == pytest.approx(5.0)  # a phase's time left, split
    whole = b.part("pairs")
    assert whole.seconds == pytest.approx(90.0)
    clock.t += 85
    assert whole.left() == pytest.approx(5.0) and first.left() < 0  # whole: capped by the stage
    first.skip("x", "y")
    assert b.to_json()["skipped"][0]["what"] == "x"
    none = StageBudget(load_config("configs/smoke.yaml", {"budget": {"minutes": None}}), "latency").part("p", 0.5, 3)
    assert not none.active and math.isinf(none.left()) and none.affords(1e9)

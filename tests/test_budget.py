"""The run's time budget (issue 27): the config section, a stage's clock and the run's ledger
(pipeline/core/budget.py)."""
import json
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
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 30, "shares": {"latency": 0.1}}})
    assert cfg.budget.shares == {**BUDGET_SHARES, "latency": 0.1}
    clock = Clock()
    b = StageBudget(cfg, "latency", clock=clock)
    assert b.seconds == pytest.approx(180.0)
    clock.t += 150
    assert b.left() == pytest.approx(30.0)
    assert b.affords(29) and not b.affords(31)
    b.skip("pair x", "does not pay")
    b.announce("grids", 12.0)
    doc = b.to_json()
    assert doc["spent_s"] == 150.0 and doc["skipped"][0]["why"] == "does not pay"
    assert doc["estimates"][0]["estimate_s"] == 12.0
    assert "left" in b.eta(1, 2)


def _ran(run, stage_dir, wall_s):
    (run / stage_dir).mkdir(parents=True, exist_ok=True)
    (run / stage_dir / "meta.json").write_text(json.dumps({"wall_s": wall_s}))


def test_the_ledger_shares_what_the_stages_before_left(tmp_path):
    """Each planning stage gets the budget less what ran (meta.json's wall_s) and the tail, in
    proportion to its share among the planning stages still to run; time one leaves goes on."""
    from pipeline.core.budget import TAIL_FRACTION
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 40}})
    sh, total = cfg.budget.shares, 40 * 60 * (1 - TAIL_FRACTION)
    _ran(tmp_path, "model", 20.0)
    _ran(tmp_path, "variants", 100.0)
    q = StageBudget(cfg, "quality", run_dir=tmp_path)
    assert q.seconds == pytest.approx((total - 120) * sh["quality"] / sum(sh.values()), abs=0.1)
    assert q.to_json()["seconds_from"] == "ledger" and q.to_json()["ledger"]["pending"] == [
        "acceptance", "vllm", "latency"]
    # quality ran short: acceptance shares what it left with vllm and latency
    _ran(tmp_path, "quality", 300.0)
    _ran(tmp_path, "drafts", 5.0)
    a = StageBudget(cfg, "acceptance", run_dir=tmp_path)
    rest = sh["acceptance"] + sh["vllm"] + sh["latency"]
    assert a.seconds == pytest.approx((total - 425) * sh["acceptance"] / rest, abs=0.1)
    # the last planning stage gets all that is left; a run already over its budget gives 0
    _ran(tmp_path, "acceptance", 400.0)
    _ran(tmp_path, "vllm", 900.0)
    assert StageBudget(cfg, "latency", run_dir=tmp_path).seconds == pytest.approx(total - 1725, abs=0.1)
    _ran(tmp_path, "vllm", 3000.0)
    assert StageBudget(cfg, "latency", run_dir=tmp_path).seconds == 0.0
    # a stage re-run alone counts only the stages before it: what it got in the cold run
    _ran(tmp_path, "latency", 500.0)
    assert StageBudget(cfg, "acceptance", run_dir=tmp_path).seconds == pytest.approx(a.seconds, abs=0.1)


@pytest.mark.parametrize("budget, says", [
    ({"minutes": -1}, "budget.minutes"),
    ({"minutes": 30, "shares": {"report": 0.1}}, "unknown stage 'report'"),
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
    assert line.startswith("time budget 30.0 min: each planning stage gets what the stages before it left")
    assert line.endswith("(quality 45%, acceptance 15%, vllm 25%, latency 15%)")
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


def test_where_a_stages_seconds_come_from(tmp_path):
    """The ledger with a run directory; without one, or with rebalance off, the share; no budget, none."""
    cfg = load_config("configs/smoke.yaml", {"budget": {"minutes": 30}})
    assert StageBudget(cfg, "latency", run_dir=tmp_path).to_json()["seconds_from"] == "ledger"
    alone = StageBudget(cfg, "latency")
    assert alone.seconds == pytest.approx(270.0) and alone.to_json()["seconds_from"] == "share"
    off = load_config("configs/smoke.yaml", {"budget": {"minutes": 30, "rebalance": False}})
    assert StageBudget(off, "latency", run_dir=tmp_path).to_json()["seconds_from"] == "share"
    none = load_config("configs/smoke.yaml", {"budget": {"minutes": None}})
    assert StageBudget(none, "latency", run_dir=tmp_path).seconds is None

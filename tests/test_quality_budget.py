"""The quality stage on a time budget (issue 27): the wave loop (pipeline/quality/waves.py:
score_variants, Waves) with injected per-item scorers and a fake clock that each scored item
advances, each variant's allowance (share, Pace), and the gate's
replay of what was scored (pipeline/gate/decision.py: build_gate). Shows: without a budget the
looks are exactly those of the loop without one; a budget that affords two looks stops there and
the gate says inconclusive, stopped on the budget; a cell that fails within the budget is still
no-go; the allowance split leaves the second variant looks of its own; a larger budget continues
from the items scored and re-scores none of them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline.core.budget import StageBudget
from pipeline.core.stage import StageContext
from pipeline.gate.decision import build_gate
from pipeline.gate.looks import levels, plan
from pipeline.quality.waves import (Pace, Waves, budget_stopped, item_inputs, pace_priors,
                                    score_in_waves, score_variants, share)
from pipeline.report.gate_table import render_table

from tests.test_sequential_gate import (_config, damaged, flips, identical, independent_slice, reference_score,
                                        run_waves, scorer)


class Clock:
    """Wall-clock stand-in: scoring an item advances it by the item's seconds."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def timed(score, clock: Clock, per_item: float | dict):
    def run(configs: dict, with_named: bool):
        records, counters = score(configs, with_named)
        for s, recs in records.items():
            clock.t += len(recs) * (per_item[s] if isinstance(per_item, dict) else per_item)
        return records, counters
    return run


def budget_config(tmp_path: Path, variants: list[str], minutes: float | None, quality_share: float = 0.5):
    budget = ("budget: {minutes: null}\n" if minutes is None else
              f"budget: {{minutes: {minutes}, shares: {{quality: {quality_share}}}}}\n")
    return _config(tmp_path, variants, budget)


def run_budget(tmp_path: Path, cfg, data: dict[str, bytes], plans: dict, fns: dict, per_item=1.0,
               calls: dict | None = None, clock: Clock | None = None, one_pass: bool = False,
               forward: dict[str, float] | None = None) -> dict:
    """What the quality stage does (pipeline/stages/quality.py: run), with fake scorers: items
    opened with the stage's own inputs (item_inputs), the reference's first look, the variants'
    looks (score_variants), the variants' meta, quality/meta.json's `sequential` and `budget`;
    then the gate stage's decision. `one_pass`: each variant whole in turn with 1/n of the time
    left (score_in_waves per variant: the stage's loop before the two passes), for comparison.
    `forward`: model -> the seconds of its timed forward (the quantize stage's `forward_seconds`),
    the priors (None: none, every variant priced at the reference's pace)."""
    run = tmp_path / "run"
    out = run / "quality"
    clock = clock or Clock()
    ctx = StageContext(name="quality", run_dir=run, out_dir=out, config=cfg, args={},
                       input_hash="test", upstream={}, code="test")
    for s, b in data.items():
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "data" / f"{s}.jsonl").write_bytes(b)
    for name in fns:  # what quantize leaves: variants/<name>/meta.json
        (run / "variants" / name).mkdir(parents=True, exist_ok=True)
        prior = {"forward_seconds": {"tokens": 512, "seconds": forward[name]}} if forward else {}
        (run / "variants" / name / "meta.json").write_text(json.dumps({"scheme": "none", "name": name, **prior}))
    lines = {s: b.splitlines(keepends=True) for s, b in data.items()}
    hashes = {s: hashlib.sha256(b).hexdigest() for s, b in data.items()}
    budget = StageBudget(cfg, "quality", clock=clock)
    # A dict `per_item` is also the stage's prior cost weights (its first look's split by slice).
    waves = Waves(out, lines, plans, [], lambda files: files,
                  weights=per_item if isinstance(per_item, dict) else None, clock=clock)
    waves.prior = pace_priors({n: json.loads((run / "variants" / n / "meta.json").read_text()) for n in fns}, "bf16")
    calls = {} if calls is None else calls
    items, inputs_of = {}, {}
    for name in fns:
        scored_with, inputs_of[name] = item_inputs(ctx, run / "variants" / name, run / "variants" / "bf16",
                                                   hashes, [])
        items[name] = waves.open(ctx.item(name, inputs_of[name](budget_stopped(out / name))),
                                 scored_with)
    pending = [n for n in fns if n != "bf16" and not items[n].fresh]
    ref_score = timed(scorer(fns["bf16"], calls.setdefault("bf16", [])), clock, per_item)
    waves.first_look("bf16", ref_score)

    def finish(name: str) -> None:
        items[name].input_hash = ctx.item(name, inputs_of[name](waves.stopped(name))).input_hash
        waves.finish(name, "fake")
    def score_of(name: str):
        return timed(scorer(fns[name], calls.setdefault(name, [])), clock, per_item)
    if one_pass:
        for i, name in enumerate(pending):
            score_in_waves(waves, "bf16", name, ref_score, score_of(name), cfg, share(budget, len(pending) - i))
            finish(name)
    else:
        score_variants(waves, "bf16", pending, ref_score, score_of, cfg, budget, finish=finish)
    if not items["bf16"].fresh or waves.grew("bf16"):
        waves.finish("bf16", "fake")
    records = {n: json.loads((out / n / "meta.json").read_text()).get("budget") for n in fns if n != "bf16"}
    (out / "meta.json").write_text(json.dumps({"slices": list(data), "tasks": [], "sequential": plans,
                                               "budget": {**budget.to_json(), "variants": records}}))
    return build_gate(run, cfg)


def one_slice(n: int = 400, wave: int = 100, name: str = "s"):
    return {name: independent_slice(name, n)}, {name: {"looks": plan(n, wave), "n_max": n}}


def scored_ids(calls: list) -> list[str]:
    return [i for _, ids in calls for i in ids]


def test_no_budget_scores_exactly_the_looks_of_the_loop_without_one(tmp_path):
    n, wave = 1000, 100
    data, plans = one_slice(n, wave)
    fns = {"bf16": reference_score, "copy": identical, "broken": damaged(0.3), "close": flips(0.01),
           "margin": damaged(0.085)}
    names = [k for k in fns if k != "bf16"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before, after = {}, {}
    today = run_waves(tmp_path / "a", _config(tmp_path / "a", names), data, plans, fns, before)
    budgeted = run_budget(tmp_path / "b", budget_config(tmp_path / "b", names, None), data, plans, fns,
                          per_item=5.0, calls=after)
    assert after == before  # the same calls, items and order
    assert budgeted["variants"] == today["variants"]
    assert budgeted["quality_budget"] is None
    for name in fns:
        assert (tmp_path / "a/run/quality" / name / "s.jsonl").read_bytes() == \
               (tmp_path / "b/run/quality" / name / "s.jsonl").read_bytes()
    rec = json.loads((tmp_path / "b/run/quality/margin/meta.json").read_text())["budget"]
    assert rec["stopped"] is False and rec["allowance_s"] is None
    assert rec["slices"]["s"]["stopped_on"] == "last look" and rec["slices"]["s"]["looks_skipped"] == 0
    assert {c["stopped_on"] for v in budgeted["variants"].values() for c in v["slices"].values()} <= {
        "data", "last look"}
    assert all(v["stopped_on_budget"] == [] for v in budgeted["variants"].values())


def test_a_budget_for_two_looks_stops_there_and_the_gate_says_inconclusive_on_the_budget(tmp_path):
    data, plans = one_slice(400, 100)
    fns = {"bf16": reference_score, "v": flips(0.03)}
    # The quality share: 0.5 x 10 minutes = 300 s; 0.6 s an item. Reference's first look 60 s,
    # v's 60 s; v's later looks get the 180 s left: the second look (100 items each) 120 s, 60 s
    # left, the third needs 120 s.
    cfg = budget_config(tmp_path, ["v"], 10, 0.5)
    calls: dict = {}
    g = run_budget(tmp_path, cfg, data, plans, fns, per_item=0.6, calls=calls)
    q = tmp_path / "run/quality"
    assert len((q / "v/s.jsonl").read_text().splitlines()) == 200
    assert len((q / "bf16/s.jsonl").read_text().splitlines()) == 200  # the reference: only what v needed
    assert len(scored_ids(calls["v"])) == 200
    v = g["variants"]["v"]
    cell = v["slices"]["s"]
    assert cell["status"] == "inconclusive" and v["decision"] == "inconclusive" and g["decision"] == "inconclusive"
    assert [lk["n"] for lk in cell["looks"]] == [100, 200] and cell["planned_looks"] == [100, 200, 300, 400]
    assert cell["stopped_on"] == "budget" and cell["items_left"] == 200 and cell["slice_items"] == 200
    assert cell["looks_skipped"] == 2 and cell["items_to_settle"]
    assert cell["stop_reason"] == "budget: 60 s left, the next look needs ~2.0 min"
    assert v["stopped_on_budget"] == ["s"] and v["missing"] == []
    # The replay: the second look at its planned level (not treated as the last one).
    assert cell["looks"][-1]["alpha_lower"] == pytest.approx(levels((100, 200, 300, 400), 400, 0.025)[1])
    assert cell["looks"][-1]["alpha_lower"] < 0.025 / 2
    # What the stage recorded: per slice, items, looks done and skipped, and why.
    rec = json.loads((q / "v/meta.json").read_text())["budget"]
    assert rec["stopped"] is True and rec["allowance_s"] == pytest.approx(180.0)
    assert rec["slices"]["s"] == {"items": 200, "n_max": 400, "looks_done": 2, "looks_planned": 4,
                                  "stopped_on": "budget", "looks_skipped": 2, "why": cell["stop_reason"]}
    meta = json.loads((q / "meta.json").read_text())["budget"]
    assert meta["seconds"] == 300.0 and meta["skipped"][0]["why"] == cell["stop_reason"]
    assert meta["spent_s"] <= 300.0
    assert g["quality_budget"]["seconds"] == 300.0
    table = render_table(g)
    assert "inconclusive: open (budget) at 200 of 400 items" in table
    assert "Scoring stopped on the time budget" in table


def test_a_fail_within_the_budget_is_no_go_and_stops_the_variant(tmp_path):
    data = {"a": independent_slice("a", 400), "b": independent_slice("b", 400)}
    plans = {s: {"looks": plan(400, 100), "n_max": 400} for s in data}

    def mixed(s, i):  # slice a: most of the reference's correct items wrong; slice b: 6% flips
        return damaged(0.8)(s, i) if s == "a" else flips(0.06)(s, i)
    fns = {"bf16": reference_score, "v": mixed}
    # 0.5 x 2 minutes = 60 s at 0.1 s an item: the first looks (2 x 200 items) take 40 s, and a
    # fails there. The 20 s left would hold b's second look, but the variant is no-go whatever b
    # does: a budgeted stage scores no more of it.
    cfg = budget_config(tmp_path, ["v"], 2, 0.5)
    calls: dict = {}
    g = run_budget(tmp_path, cfg, data, plans, fns, per_item=0.1, calls=calls)
    v = g["variants"]["v"]
    assert v["slices"]["a"]["status"] == "fail" and v["slices"]["a"]["stopped_on"] == "data"
    b = v["slices"]["b"]
    assert b["status"] == "inconclusive" and b["stopped_on"] == "verdict"
    assert b["stop_reason"].startswith("no-go already (a failed)") and b["items_left"] == 300
    assert v["stopped_on_budget"] == []
    assert v["decision"] == "no-go" and g["decision"] == "no-go"
    assert len(scored_ids(calls["v"])) == 200 and len(scored_ids(calls["bf16"])) == 200
    rec = json.loads((tmp_path / "run/quality/v/meta.json").read_text())["budget"]
    assert rec["stopped"] is True
    assert rec["slices"]["a"]["stopped_on"] == "settled" and rec["slices"]["a"]["items"] == 100
    assert rec["slices"]["b"]["items"] == 100
    assert rec["slices"]["b"]["stopped_on"] == "verdict" and rec["slices"]["b"]["looks_skipped"] == 3
    assert "open (variant already no-go) at 100 of 400 items" in render_table(g)
    # Without a budget the open cell goes on (the exhaustive run scores every open cell).
    (tmp_path / "nobudget").mkdir()
    free = run_budget(tmp_path / "nobudget", budget_config(tmp_path / "nobudget", ["v"], None), data, plans,
                      fns, per_item=0.1)
    assert free["variants"]["v"]["slices"]["b"]["stopped_on"] != "verdict"
    assert free["variants"]["v"]["slices"]["b"]["items_spent"] > 100


def test_variants_a_first_look_settles_leave_their_time_to_the_open_ones(tmp_path):
    """Two passes under a budget: every first look, then the later looks of the variants still
    open. Two variants that fail at once, listed after an identical copy, leave it their time;
    scored whole in turn, the copy would have had a third of it and stopped open."""
    data, plans = one_slice(1000, 100)
    fns = {"bf16": reference_score, "copy": identical, "broken": damaged(1.0), "bad": damaged(1.0)}
    # 0.5 x 2.8 minutes = 84 s at 0.1 s an item: four first looks of 10 s (the reference holding
    # its items), then copy alone gets the 44 s left: two later looks of 20 s, and it passes at 300.
    names = ["copy", "broken", "bad"]
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    g = run_budget(tmp_path / "two", budget_config(tmp_path / "two", names, 2.8, 0.5), data, plans, fns,
                   per_item=0.1)
    rec = json.loads((tmp_path / "two/run/quality/copy/meta.json").read_text())["budget"]
    for n in ("broken", "bad"):
        assert g["variants"][n]["decision"] == "no-go"
        assert g["variants"][n]["slices"]["s"]["items_spent"] == 100
    assert rec["allowance_s"] == pytest.approx(44.0) and rec["spent_s"] == pytest.approx(40.0)
    assert rec["slices"]["s"]["items"] == 300 and rec["stopped"] is False
    assert g["variants"]["copy"]["decision"] == "go" and g["decision"] == "no-go"
    # The loop before: copy's allowance (84 - 10) / 3 = 24.7 s holds its first look (10 s) and no
    # later one (20 s): open on the budget at 100 items.
    old = run_budget(tmp_path / "one", budget_config(tmp_path / "one", names, 2.8, 0.5), data, plans, fns,
                     per_item=0.1, one_pass=True)
    cell = old["variants"]["copy"]["slices"]["s"]
    assert cell["status"] == "inconclusive" and cell["stopped_on"] == "budget" and cell["items_spent"] == 100


def test_the_allowance_split_leaves_the_second_variant_looks_of_its_own(tmp_path):
    data, plans = one_slice(1000, 100)
    fns = {"bf16": reference_score, "v1": flips(0.06), "v2": flips(0.06)}
    # 0.5 x 4 minutes = 120 s at 0.1 s an item. The first looks: 10 s each (the reference's, v1's,
    # v2's). v1's later looks get (120 - 30) / 2 = 45 s: looks of 20 s (its 100 items and the
    # reference's) while they fit: 300 items. v2 gets the rest, 50 s: the reference holds v1's
    # items, so its looks to 300 cost 10 s each, then one of 20 s: 400.
    cfg = budget_config(tmp_path, ["v1", "v2"], 4, 0.5)
    calls: dict = {}
    g = run_budget(tmp_path, cfg, data, plans, fns, per_item=0.1, calls=calls)
    q = tmp_path / "run/quality"
    rec = {n: json.loads((q / n / "meta.json").read_text())["budget"] for n in ("v1", "v2")}
    assert rec["v1"]["allowance_s"] == pytest.approx(45.0)
    assert rec["v1"]["stopped"] and rec["v1"]["slices"]["s"]["items"] == 300
    # What v1 left of its allowance carries forward to v2.
    assert rec["v2"]["allowance_s"] == pytest.approx(120 - 30 - rec["v1"]["spent_s"])
    assert rec["v2"]["slices"]["s"]["items"] == 400 > 100
    assert len(scored_ids(calls["v2"])) == 400
    assert json.loads((q / "meta.json").read_text())["budget"]["spent_s"] <= 120.0
    for n in ("v1", "v2"):
        assert g["variants"][n]["slices"]["s"]["stopped_on"] == "budget"
    # Without the split the first variant would have taken it all: 110 s, 20 s a look.
    greedy = share(StageBudget(cfg, "quality", clock=Clock()), 1)
    assert greedy.seconds == pytest.approx(120.0) and greedy.seconds > 2 * rec["v1"]["allowance_s"]


def test_a_larger_budget_continues_from_the_items_scored(tmp_path):
    data, plans = one_slice(400, 100)
    fns = {"bf16": reference_score, "v": flips(0.03)}
    first = run_budget(tmp_path, budget_config(tmp_path, ["v"], 10, 0.5), data, plans, fns, per_item=0.6)
    assert first["variants"]["v"]["slices"]["s"]["stopped_on"] == "budget"
    q = tmp_path / "run/quality"
    kept = {n: (q / n / "s.jsonl").read_text() for n in fns}
    assert len(kept["v"].splitlines()) == 200
    # The same budget again: nothing re-opened, nothing scored.
    calls: dict = {}
    again = run_budget(tmp_path, budget_config(tmp_path, ["v"], 10, 0.5), data, plans, fns, per_item=0.6,
                       calls=calls)
    assert calls.get("v") is None and scored_ids(calls["bf16"]) == []
    assert again["variants"]["v"] == first["variants"]["v"]
    # A larger budget: the variant re-opens (the budget is in its inputs) and scores from item 200
    # on; its lines and the reference's stand (the budget is not in what they were scored with).
    calls = {}
    more = run_budget(tmp_path, budget_config(tmp_path, ["v"], 60, 0.5), data, plans, fns, per_item=0.6,
                      calls=calls)
    order = [json.loads(x)["id"] for x in data["s"].decode().splitlines()]
    for n in fns:
        now = (q / n / "s.jsonl").read_text()
        assert now.startswith(kept[n]) and len(now.splitlines()) > 200
        assert scored_ids(calls[n]) == order[200:len(now.splitlines())]
    cell = more["variants"]["v"]["slices"]["s"]
    assert cell["stopped_on"] in ("data", "last look") and more["variants"]["v"]["stopped_on_budget"] == []
    assert json.loads((q / "v/meta.json").read_text())["budget"]["stopped"] is False
    # The same as a run that never had a budget.
    fresh = run_budget(tmp_path / "nobudget", budget_config(tmp_path, ["v"], None), data, plans, fns)
    assert (tmp_path / "nobudget/run/quality/v/s.jsonl").read_text() == (q / "v/s.jsonl").read_text()
    assert fresh["variants"]["v"] == more["variants"]["v"]
    # A variant that ran to the end of its looks does not depend on the budget: another one
    # leaves it fresh.
    calls = {}
    run_budget(tmp_path, budget_config(tmp_path, ["v"], 1, 0.5), data, plans, fns, per_item=0.6, calls=calls)
    assert calls.get("v") is None


def test_pace_splits_a_call_by_weights_until_a_slice_is_measured_alone():
    pace = Pace({"gen": 3.0, "mc": 1.0})
    assert pace.cost({"gen": 10}) is None and pace.cost({"gen": 0}) == 0.0
    pace.record({"gen": 10, "mc": 10}, 40.0)  # 40 weight units: 1 s a unit
    assert pace.per_item("gen") == pytest.approx(3.0) and pace.per_item("mc") == pytest.approx(1.0)
    pace.record({"gen": 10}, 20.0)  # measured alone: 2 s an item
    assert pace.per_item("gen") == pytest.approx(2.0)
    assert pace.cost({"gen": 5, "mc": 5}) == pytest.approx(10.0 + 60.0 / 70.0 * 5)
    again = Pace({"gen": 3.0, "mc": 1.0}, json.loads(json.dumps(pace.to_json())))
    assert again.per_item("gen") == pace.per_item("gen") and again.per_item("mc") == pytest.approx(pace.per_item("mc"))


def test_the_stage_on_a_tiny_budget_stops_after_the_first_look_and_a_rerun_without_continues(
        tmp_path, tiny_model_dir, capsys):
    """The stage itself (pipeline/stages/quality.py: run) on the tiny model: a budget too small
    for anything past the first look (the reference's first look alone spends it), then the same
    run with no budget."""
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage
    from tests.test_quality import _make_run

    run, cfg = _make_run(tmp_path, tiny_model_dir)
    cfg.budget.minutes = 0.001  # 0.35 x 0.06 s
    meta = json.loads(run_stage(STAGES["quality"], run, cfg, {}, STAGES).read_text())
    err = capsys.readouterr().err
    assert "quality: up to 16 items" in err and "after the reference's first look" in err, err
    assert "quality: skipped noisy: looks at" in err
    q = run / "quality"
    for s in ("reasoning", "calibration"):
        assert len((q / "noisy" / f"{s}.jsonl").read_text().splitlines()) == 2
    rec = meta["budget"]["variants"]["noisy"]
    assert rec["stopped"] and rec["slices"]["reasoning"]["stopped_on"] == "budget"
    assert rec["slices"]["reasoning"]["why"].startswith("budget: ")
    assert meta["budget"]["skipped"] and meta["budget"]["estimates"]
    assert "load_seconds" in meta["timing"]["noisy"]["counters"]
    assert set(meta["budget"]["pace_s_per_item"]["bf16"]) == {"reasoning", "calibration"}
    scoring = json.loads((q / "noisy" / "scoring.json").read_text())
    assert scoring["pace"]["weighted"][1] > 0

    cfg.budget.minutes = None
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    err = capsys.readouterr().err
    assert "bf16 up to date" in err and "noisy up to date" not in err
    assert "noisy: loading" in err and "noisy: 4 items" in err and "reasoning 2->4" in err, err
    for s in ("reasoning", "calibration"):
        assert len((q / "noisy" / f"{s}.jsonl").read_text().splitlines()) == 4
    assert json.loads((q / "noisy" / "meta.json").read_text())["budget"]["stopped"] is False


def test_a_slices_own_wave_items_keeps_its_scored_items(tmp_path):
    """quality.per_slice.<name>.wave_items changes when a slice's looks fall, never what an item
    scores: like quality.wave_items it is out of what the lines were scored with (item_inputs), so a
    run that changes it re-uses them; a slice's `items` stays in."""
    run = tmp_path / "run"
    for name in ("bf16", "int8"):
        (run / "variants" / name).mkdir(parents=True)
        (run / "variants" / name / "meta.json").write_text(json.dumps({"scheme": "none", "name": name}))

    def scored_with(per_slice: str) -> dict:
        cfg = _config(tmp_path, ["int8"], f"quality: {{per_slice: {per_slice}}}\n")
        ctx = StageContext(name="quality", run_dir=run, out_dir=run / "quality", config=cfg, args={},
                           input_hash="test", upstream={}, code="test")
        return item_inputs(ctx, run / "variants" / "int8", run / "variants" / "bf16", {"s": "h"}, [])[0]

    base = scored_with("{}")
    assert scored_with("{reasoning: {wave_items: 80}}") == base
    assert scored_with("{reasoning: {max_new_tokens: 8}}") != base


def test_a_budgeted_look_takes_every_open_slice_and_stops_open_when_they_do_not_fit(tmp_path):
    """Slice a is cheap and damaged (its difference heads to fail from the first look); b is
    dear and equivalent. After the first looks the budget holds a's next look but not b's: a
    budgeted look takes every open slice's next look together, so it does not fit and the variant
    stops open on the budget at its first looks, a's and b's alike."""
    data = {"a": independent_slice("a", 400), "b": independent_slice("b", 400)}
    plans = {s: {"looks": plan(400, 100), "n_max": 400} for s in data}

    def mixed(s, i):
        return damaged(0.25)(s, i) if s == "a" else flips(0.02)(s, i)
    fns = {"bf16": reference_score, "v": mixed}
    per_item = {"a": 0.1, "b": 1.0}
    # The first looks take 2 x (10 + 100) = 220 s of the 0.5 x 10 min = 300 s; the next look
    # (a's 20 s and b's 200 s, the reference's items and the variant's) needs 220 s.
    calls: dict = {}
    g = run_budget(tmp_path, budget_config(tmp_path, ["v"], 10, 0.5), data, plans, fns, per_item=per_item,
                   calls=calls)
    v = g["variants"]["v"]
    assert v["decision"] == "inconclusive" and v["stopped_on_budget"] == ["a", "b"]
    for s in ("a", "b"):
        assert v["slices"][s]["items_spent"] == 100 and v["slices"][s]["stopped_on"] == "budget"
    assert v["slices"]["a"]["stop_reason"] == "budget: 80 s left, the next look needs ~3.7 min"
    assert len(scored_ids(calls["v"])) == 200
    rec = json.loads((tmp_path / "run/quality/v/meta.json").read_text())["budget"]
    assert rec["stopped"] is True and set(rec["slices"]) == {"a", "b"}
    assert "aimed_looks" not in rec and "aimed" not in g["quality_budget"]


def test_the_second_pass_splits_the_time_left_evenly(tmp_path):
    """The second pass's allowance: the time left over the open variants still to score; the
    last variant takes everything left."""
    budget = StageBudget(budget_config(tmp_path, ["v"], 10, 0.5), "quality", clock=Clock())  # 300 s
    assert share(budget, 4).seconds == pytest.approx(75.0)
    assert share(budget, 1).seconds == pytest.approx(300.0)


def test_a_variants_prior_pace_is_its_timed_forward_over_the_references(tmp_path):
    """pace_priors reads the quantize stage's timed forwards; a variant without one has no prior;
    model_cost prices a variant that has not scored at the reference's pace times its prior (at
    the reference's pace without one), and at its own pace once it has."""
    metas = {"bf16": {"forward_seconds": {"tokens": 512, "seconds": 0.25}},
             "w4": {"forward_seconds": {"tokens": 512, "seconds": 0.31}},
             "nf4": {"forward_seconds": {"tokens": 512, "seconds": 0.86}}, "old": {}}
    prior = pace_priors(metas, "bf16")
    assert prior == pytest.approx({"w4": 1.24, "nf4": 3.44})
    assert pace_priors({"bf16": {}, "w4": metas["w4"]}, "bf16") == {}
    waves = Waves(tmp_path, {}, {"a": {"looks": [10], "n_max": 10}}, [], lambda f: f)
    waves.pace["bf16"] = Pace()
    waves.pace["bf16"].record({"a": 10}, 20.0)  # 2 s an item
    waves.prior = prior
    assert waves.model_cost("nf4", {"a": 5}, "bf16") == pytest.approx(10.0 * 3.44)
    assert waves.model_cost("old", {"a": 5}, "bf16") == pytest.approx(10.0)
    waves.pace["nf4"] = Pace()
    waves.pace["nf4"].record({"a": 10}, 50.0)
    assert waves.model_cost("nf4", {"a": 5}, "bf16") == pytest.approx(25.0)

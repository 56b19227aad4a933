"""The marginal-cost computation on synthetic inputs with known answers, and the stage's artifacts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.serving.marginal import by_drafted_matrix, marginal_table, pair_report, recommend_k
from pipeline.stats.intervals import median_ci

TOL = 1e-9


def _expected(alpha: float, k_max: int) -> dict[int, float]:
    # Constant per-position rate a: E[tokens/round] = 1 + a + ... + a^k (SEEDS.md).
    return {k: sum(alpha ** i for i in range(k + 1)) for k in range(1, k_max + 1)}


def _positions(alpha: float, k_max: int) -> list[dict]:
    return [{"position": i, "conditional": alpha, "prefix": alpha ** i, "expected_beta": alpha,
             "n": 100, "ci": [alpha - 0.05, alpha + 0.05]} for i in range(1, k_max + 1)]


def _acc(expected: dict[int, float], alpha: float | None = None, prompts: int = 3, tokens: float = 1200.0,
         share: dict[int, list[float]] | None = None, spread: float = 0.0) -> dict:
    """An acceptance block whose prompts realise E(k) exactly (spread > 0: prompts differ, the
    pooled E(k) unchanged). A model draft by default: every round drafts k."""
    k_max = max(expected)
    recs = []
    for i in range(prompts):
        scale = 1.0 + spread * (i - (prompts - 1) / 2)  # symmetric around 1: the sums stay put
        rounds = {str(k): tokens / e * scale for k, e in expected.items()}
        drafted = {str(k): [rounds[str(k)] * x for x in (share or {}).get(k, [0.0] * k + [1.0])] for k in expected}
        recs.append({"prompt": f"p{i}", "tokens": tokens, "expected_rounds": rounds, "drafted_rounds": drafted})
    return {"expected_tokens_per_round": {str(k): v for k, v in expected.items()},
            "per_position": _positions(alpha, k_max) if alpha is not None else [], "per_prompt": recs}


def _summ(x):
    return {"median": float(np.median(x)), "ci": [min(x), max(x)], "samples": list(x)}


def _timing(k_max: int, round_of_d, plain, draft_of_d=None, repeats: int = 3) -> dict:
    """A latency block: round time by drafted count d (a function, or per-repeat lists)."""
    def col(fn, d):
        v = fn(d)
        return {"samples": list(v) if isinstance(v, (list, np.ndarray)) else [float(v)] * repeats, "rounds": 50}
    out = {"plain_ms_per_token": _summ(plain if isinstance(plain, list) else [plain] * repeats),
           "round_ms_by_drafted": {str(d): col(round_of_d, d) for d in range(k_max + 1)}}
    if draft_of_d is not None:
        out["draft_ms_by_drafted"] = {str(d): col(draft_of_d, d) for d in range(k_max + 1)}
    return out


def test_noise_free_curve_has_the_closed_form_answer():
    # Plain 10 ms/token; a round = one 10 ms verify + 4 ms per drafted token; a = 0.8.
    # ms/token: k=1 14/1.8=7.778, k=2 18/2.44=7.377, k=3 22/2.952=7.453 -> best k = 2.
    E = _expected(0.8, 4)
    tab = marginal_table(_acc(E, 0.8), _timing(4, lambda d: 10.0 + 4 * d, 10.0, lambda d: 4.0 * d))
    rows = {r["k"]: r for r in tab["rows"]}
    assert tab["baseline_ms_per_token"] == 10.0
    for k in E:
        assert abs(rows[k]["ms_per_token"] - (10 + 4 * k) / E[k]) < TOL
        assert abs(rows[k]["speedup"] - 10 * E[k] / (10 + 4 * k)) < TOL
        assert rows[k]["ms_per_token_ci"][0] == pytest.approx(rows[k]["ms_per_token"])
        assert rows[k]["mean_drafted"] == pytest.approx(k)
    # Marginal k-1 -> k = 4 ms / a^k; k = 0 is plain (10 ms, 1 token).
    assert rows[1]["marginal_ms_per_token"] == pytest.approx(4 / 0.8)
    assert rows[3]["marginal_ms_per_token"] == pytest.approx(4 / 0.8 ** 3)
    # 7.81 ms for a marginal token beats plain (10) but not the 7.38 average at k = 2.
    assert rows[3]["marginal_beats_plain"] and not rows[3]["marginal_pays"]
    assert rows[2]["marginal_pays"]
    assert tab["recommended_k"] == 2
    # c = 4 / 10 and a round costs exactly (1 + k c) plain steps: Leviathan matches the measurement.
    assert tab["cost_ratio_c"] == pytest.approx(0.4)
    for k in E:
        assert rows[k]["predicted_ms_per_token"] == pytest.approx(rows[k]["ms_per_token"])
        assert rows[k]["predicted_speedup"] == pytest.approx(rows[k]["speedup"])


def test_one_timing_repeat_recommends_nothing():
    """A speedup whose CI lies above 1 is recommended from 2 timing repeats, never from 1: one
    repeat's CI resamples the prompts alone (no timing spread), which a budget can leave."""
    E = _expected(0.8, 4)
    rows = marginal_table(_acc(E, 0.8, spread=0.1), _timing(4, lambda d: 10.0 + 4 * d, 10.0, repeats=1))["rows"]
    assert all(r["timing_repeats"] == 1 for r in rows)
    assert any(r["speedup_ci"][0] > 1.0 for r in rows)  # it would beat plain by its CI
    assert recommend_k(rows) == 0
    two = marginal_table(_acc(E, 0.8, spread=0.1), _timing(4, lambda d: 10.0 + 4 * d, 10.0, repeats=2))
    assert {r["timing_repeats"] for r in two["rows"]} == {2} and two["recommended_k"] >= 1


def test_round_time_is_weighted_by_the_slice_s_drafted_counts():
    # Prompt lookup: at k = 2 half the rounds draft nothing (a 10 ms plain step) and half draft 2
    # (18 ms): T_round(2) = 14 ms, not the 18 ms a model draft's round would cost.
    E = {1: 1.4, 2: 1.6}
    share = {1: [0.5, 0.5], 2: [0.5, 0.0, 0.5]}
    tab = marginal_table(_acc(E, share=share), _timing(2, lambda d: 10.0 + 4 * d, 10.0))
    rows = {r["k"]: r for r in tab["rows"]}
    assert rows[1]["round_ms"] == pytest.approx(12.0) and rows[2]["round_ms"] == pytest.approx(14.0)
    assert rows[2]["mean_drafted"] == pytest.approx(1.0)
    assert rows[2]["ms_per_token"] == pytest.approx(14.0 / 1.6)


def test_a_drafted_count_no_timed_round_had_is_read_off_the_line():
    block = {"0": {"samples": [10.0, 11.0], "rounds": 40}, "1": {"samples": [14.0, None], "rounds": 20},
             "2": {"samples": [None, None], "rounds": 0}, "3": {"samples": [22.0, 23.0], "rounds": 5}}
    m, filled = by_drafted_matrix(block, 3)
    assert filled == [2]
    assert m[0] == pytest.approx([10.0, 14.0, 18.0, 22.0])  # exactly linear: the line is exact
    assert m[1, 1] == pytest.approx(15.0) and m[1, 2] == pytest.approx(19.0)  # 11 + 4 d


def test_only_k_whose_drafted_counts_were_timed():
    # latency.k_max = 2 below acceptance's 3: k = 3 would need T(3) extrapolated, so it is left out.
    tab = marginal_table(_acc(_expected(0.8, 3)), _timing(2, lambda d: 10.0 + 4 * d, 10.0))
    assert [r["k"] for r in tab["rows"]] == [1, 2]


def test_never_speculate_when_no_k_beats_plain():
    # a = 0.1 and a draft step as dear as half a target step: every k is slower than plain.
    E = _expected(0.1, 5)
    rng = np.random.default_rng(0)
    noise = {d: list(10.0 + 5 * d + rng.normal(0, 0.2, 5)) for d in range(6)}
    tab = marginal_table(_acc(E, 0.1), _timing(5, lambda d: noise[d], list(10 + rng.normal(0, 0.2, 5)), repeats=5))
    assert all(r["speedup"] < 1 for r in tab["rows"])
    assert tab["recommended_k"] == 0


def test_a_speedup_inside_the_noise_is_not_a_speedup():
    # Medians say k = 1 is 2% faster, but the repeats scatter by +-20% and plain and speculative
    # do not move together (repeats are resampled as pairs): CI straddles 1 -> 0.
    E = {1: 1.5}
    rounds = [14.7, 11.0, 17.0, 12.0, 16.5]
    plain = [12.0, 9.0, 8.0, 11.0, 10.0]
    tab = marginal_table(_acc(E), _timing(1, lambda d: rounds, plain, repeats=5))
    assert tab["rows"][0]["speedup"] > 1
    assert tab["rows"][0]["speedup_ci"][0] < 1 < tab["rows"][0]["speedup_ci"][1]
    assert tab["recommended_k"] == 0


def test_overlapping_neighbour_steps_down_to_the_smaller_k():
    rows = [
        {"k": 1, "ms_per_token": 8.0, "ms_per_token_ci": [7.8, 8.2], "speedup_ci": [1.2, 1.3]},
        {"k": 2, "ms_per_token": 6.1, "ms_per_token_ci": [5.9, 6.4], "speedup_ci": [1.5, 1.7]},
        {"k": 3, "ms_per_token": 6.0, "ms_per_token_ci": [5.8, 6.3], "speedup_ci": [1.6, 1.7]},
        {"k": 4, "ms_per_token": 6.5, "ms_per_token_ci": [6.3, 6.8], "speedup_ci": [1.4, 1.6]},
    ]
    # k=3 has the best median; k=2's CI overlaps it, k=1's does not overlap k=2's -> 2.
    assert recommend_k(rows) == 2
    rows[1]["ms_per_token"], rows[1]["ms_per_token_ci"] = 6.4, [6.35, 6.5]  # now distinguishable
    assert recommend_k(rows) == 3
    # k=2 no longer beats plain: the step down cannot pass through it.
    rows[1]["ms_per_token"], rows[1]["ms_per_token_ci"] = 6.1, [5.9, 6.4]
    rows[1]["speedup_ci"] = [0.9, 1.7]
    assert recommend_k(rows) == 3


def test_prompt_resampling_widens_the_ci_and_keeps_the_point_estimate():
    E = {1: 1.5, 2: 1.75}
    timing = _timing(2, lambda d: 10.0 + 2 * d, 10.0, repeats=4)
    spread = marginal_table(_acc(E, prompts=6, spread=0.2), timing)
    same = marginal_table(_acc(E, prompts=6), timing)
    for a, b in zip(spread["rows"], same["rows"]):
        assert a["ms_per_token"] == pytest.approx(b["ms_per_token"])
        assert b["ms_per_token_ci"][0] == pytest.approx(b["ms_per_token_ci"][1])
        assert a["ms_per_token_ci"][0] < a["ms_per_token"] < a["ms_per_token_ci"][1]
        assert a["tokens_per_round_ci"][0] < a["tokens_per_round"] < a["tokens_per_round_ci"][1]
    one = marginal_table(_acc(E, prompts=1), timing)
    assert one["ci_unit"].startswith("timing repeats only")


def test_median_ci_brackets_the_median_and_keeps_samples():
    s = median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert s["median"] == 3.0 and s["samples"] == [3.0, 1.0, 2.0, 5.0, 4.0]
    assert 1.0 <= s["ci"][0] <= 3.0 <= s["ci"][1] <= 5.0
    assert median_ci([7.0])["ci"] == [7.0, 7.0]


def _acceptance(alpha: float, k_max: int, slices=("all", "code", "chat")) -> dict:
    good = _acc(_expected(alpha, k_max), alpha)
    slow = _acc({k: 1.0 + 0.05 * k for k in range(1, k_max + 1)}, alpha)
    return {"variant": "bf16", "draft": "layerskip:4", "k_max": k_max,
            "slices": {s: {"0.0": good if s != "chat" else slow, "0.7": slow} for s in slices}}


def _latency(k_max: int) -> dict:
    block = _timing(k_max, lambda d: 12.5 + 2 * d, 10.0, lambda d: 2.0 * d)
    block["rows"] = [{"k": k, "draft_ms": _summ([2.0 * k] * 3), "verify_ms": _summ([10.0] * 3),
                      "overhead_ms": _summ([0.5] * 3), "round_ms": _summ([12.5 + 2 * k] * 3),
                      "tokens_per_round": 1.5, "ms_per_token": _summ([9.0] * 3), "tokens_per_s": 111.0,
                      "speedup": _summ([1.1] * 3)} for k in range(1, k_max + 1)]
    return {"variant": "bf16", "draft": "layerskip:4", "device": "cpu", "new_tokens": 16,
            "plain_ms_per_token": block["plain_ms_per_token"], "rows": block["rows"],
            "by_temperature": {"0.0": block, "0.7": block}}


def test_pair_report_keys_and_per_slice_recommendation():
    rep = pair_report(_acceptance(0.9, 4), _latency(4))
    for key in ("baseline_ms_per_token", "rows", "recommended_k", "rule", "slices", "cost_ratio_c"):
        assert key in rep
    for row in rep["rows"]:
        assert {"k", "tokens_per_round", "round_ms", "ms_per_token", "speedup",
                "marginal_ms_per_token"} <= set(row)
    assert rep["primary"] == {"slice": "all", "temperature": "0.0"}
    assert rep["recommended_k"] >= 1
    # Chat accepts almost nothing: the same round times give k = 0 there.
    assert rep["slices"]["chat"]["0.0"]["recommended_k"] == 0
    assert rep["slices"]["code"]["0.0"]["recommended_k"] == rep["recommended_k"]


def test_a_single_timing_repeat_reads_as_such_in_categories_and_the_report():
    """The pair report of a pair timed once: k = 0 everywhere, every category inconclusive with the
    single repeat as its reason (not a CI 'containing 1'), and the Markdown says why."""
    from pipeline.report.marginal import render_markdown

    lat = _latency(4)
    once = _timing(4, lambda d: 12.5 + 2 * d, 10.0, lambda d: 2.0 * d, repeats=1)
    lat["by_temperature"] = {"0.0": once, "0.7": once}
    lat["plain_ms_per_token"] = once["plain_ms_per_token"]
    rep = pair_report(_acceptance(0.9, 4), lat)
    assert rep["recommended_k"] == 0 and any(r["speedup_ci"][0] > 1.0 for r in rep["rows"])
    entries = [e for temps in rep["recommended_k_by_category"].values() for e in temps.values()]
    assert entries
    for e in entries:
        assert e["k"] == 0 and not e["settled"] and e["verdict"] == "inconclusive"
        assert e["reason"].startswith(f"best k = {e['best_k']}: one timing repeat")
    assert "Timed in a single repeat" in render_markdown(rep)


def _fake_stage(run, name):
    (run / name).mkdir(parents=True, exist_ok=True)
    (run / name / "meta.json").write_text(json.dumps({"stage": name, "input_hash": name}))


def _one_pair_run(tmp_path):
    """A run directory with one pair's acceptance and latency JSONs, for the marginal stage."""
    run = tmp_path / "run"
    for name in ("acceptance", "latency"):
        _fake_stage(run, name)
    (run / "acceptance" / "bf16__layerskip-4.json").write_text(json.dumps(_acceptance(0.9, 3)))
    (run / "latency" / "bf16__layerskip-4.json").write_text(json.dumps(_latency(3)))
    return run


def test_stage_writes_json_md_png_and_refuses_corrupt_input(tmp_path):
    from pipeline.__main__ import STAGES
    from pipeline.core.config import Config
    from pipeline.core.stage import StageError, run_stage

    run = _one_pair_run(tmp_path)
    run_stage(STAGES["marginal"], run, Config(), {}, STAGES)
    out = run / "marginal"
    rep = json.loads((out / "bf16__layerskip-4.json").read_text())
    assert rep["recommended_k"] == json.loads((out / "meta.json").read_text())["recommended_k"][
        "bf16__layerskip-4"]
    md = (out / "bf16__layerskip-4.md").read_text()
    assert f"Recommended k = {rep['recommended_k']}" in md and "| k | E[tokens/round]" in md
    assert (out / "bf16__layerskip-4.png").read_bytes()[:4] == b"\x89PNG"

    (run / "latency" / "bf16__layerskip-4.json").write_text("{not json")
    with pytest.raises(StageError, match="corrupt latency artifact"):
        run_stage(STAGES["marginal"], run, Config(), {}, STAGES, force=True)
    assert not (out / "meta.json").exists()


def test_the_top_level_confidence_reaches_the_marginal_stage(tmp_path):
    """The stage hashes the top-level confidence: changing it re-runs the stage at that level."""
    from pipeline.__main__ import STAGES
    from pipeline.core.config import Config
    from pipeline.core.stage import run_stage

    run = _one_pair_run(tmp_path)
    for level in (0.95, 0.8):
        run_stage(STAGES["marginal"], run, Config(confidence=level), {}, STAGES)
        rep = json.loads((run / "marginal" / "bf16__layerskip-4.json").read_text())
        assert rep["confidence"] == level


def test_reads_what_the_acceptance_stage_writes():
    """The acceptance stage's own summary (pipeline.speculation.acceptance_stats.summarize_slice) joins
    without glue, and the marginal E(k) is the acceptance E(k) with a CI around it."""
    from pipeline.speculation.acceptance_stats import prompt_record, summarize_slice
    from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows, round_chain

    rng = np.random.default_rng(1)
    recs = []
    for i in range(6):
        a = rng.random(40) ** 0.5
        text = TextAcceptance(model_draft_rows(a, 3), model_draft_rows(a, 3), np.full(40, 3), 41, 41)
        recs.append(prompt_record(f"p{i}", "code", text, {k: round_chain(text, k) for k in (1, 2, 3)}))
    per = summarize_slice(recs, 3)
    acc = {"variant": "bf16", "draft": "ngram", "k_max": 3, "slices": {"all": {"0.0": per, "0.7": per}}}
    rep = pair_report(acc, _latency(3))
    for row in rep["rows"]:
        e = per["expected_tokens_per_round"][str(row["k"])]
        assert row["tokens_per_round"] == pytest.approx(e)
        assert row["tokens_per_round_ci"][0] < e < row["tokens_per_round_ci"][1]
        assert row["round_ms"] == pytest.approx(12.5 + 2 * row["mean_drafted"])
    assert rep["acceptance_per_position"] == per["per_position"]


def test_a_pair_timed_below_k_max_reports_the_k_it_cut():
    """A pair the latency stage timed at k = 1..2 of 1..4 (the screen's bound is below 1 past 2:
    pipeline/latency/screen.py ks_to_time): the tables stop at 2, the report names the k cut with
    their bound, and the Markdown says they were not timed."""
    from pipeline.report.marginal import render_markdown

    lat = _latency(2)
    lat.update(ks_asked=[1, 2, 3, 4], ks_timed=[1, 2], ks_not_timed={"3": 0.97, "4": 0.9})
    rep = pair_report(_acceptance(0.9, 4), lat)
    assert [r["k"] for r in rep["rows"]] == [1, 2]
    assert all([r["k"] for r in t["rows"]] == [1, 2] for temps in rep["slices"].values() for t in temps.values())
    assert rep["ks_not_timed"] == {"3": 0.97, "4": 0.9}
    assert rep["ks_not_timed_note"] == "k = 3..4 not timed: speedup at most 0.97 there (at k = 3; timed at k = 1..2)"
    assert rep["ks_not_timed_note"] + ": they cannot be recommended" in render_markdown(rep)
    full = pair_report(_acceptance(0.9, 4), _latency(4))
    assert full["ks_not_timed"] == {} and full["ks_not_timed_note"] is None
    assert "not timed" not in render_markdown(full)

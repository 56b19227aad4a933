"""The real embedded model through every stage with configs/smoke.yaml (CI-sized), then a warm
re-run that must do no work, then the gate's exit status."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.__main__ import STAGES, main

REPO = Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "configs/smoke.yaml")


def test_evaluate_smoke_end_to_end(embedded_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    # Reuse the session's prepared model: same config and MODEL, so prepare's hash matches.
    shutil.copytree(embedded_model_dir, run / "model")
    argv = ["--run", str(run), "--config", SMOKE, "--model", "smollm2-135m"]
    assert main(["evaluate", *argv]) == 0
    err = capsys.readouterr().err
    assert "prepare: up to date" in err

    for spec in STAGES.values():
        assert (run / spec.out / "meta.json").is_file(), spec.name
    variants = json.loads((run / "variants" / "meta.json").read_text())["variants"]
    assert {"bf16", "w4a16-gptq", "nf4"} <= set(variants)

    for draft in ("ngram", "layerskip-4", "self-w4a16-gptq"):
        acc = json.loads((run / "acceptance" / f"bf16__{draft}.json").read_text())
        greedy = acc["slices"]["all"]["0.0"]
        assert len(greedy["per_position"]) == 3
        e = greedy["expected_tokens_per_round"]
        assert 1.0 <= e["1"] <= e["2"] <= e["3"] <= 4.0
        assert acc["lossless"]["greedy_lossless"] is True, acc["lossless"]  # bf16 on a CPU with native bf16: near-ties allowed
        marginal = json.loads((run / "marginal" / f"bf16__{draft}.json").read_text())
        assert marginal["recommended_k"] in range(0, 4)
        # The speedup CIs' timing part: the run's pooled repeat noise, or the pair's own repeats when
        # the run has too few (timing_noise.py); each table says which.
        noise = marginal.get("timing_noise")
        assert "timing_noise" in marginal and (noise is None or noise["df"] >= 4)
        assert marginal.get("timing_ci", "").startswith("timing part") or marginal.get("screened")
        assert marginal["baseline_ms_per_token"] > 0
        # Specq's engine times B = 1 only; k per batch size is vLLM's (the vllm stage).
        assert marginal["recommended_k_by_batch"] is None and "vLLM" in marginal["by_batch_note"]

    gate = json.loads((run / "gate.json").read_text())
    assert gate["decision"] in ("go", "no-go", "inconclusive")
    for name in ("w4a16-gptq", "nf4"):
        v = gate["variants"][name]
        assert v["decision"] in ("go", "no-go", "inconclusive")
        for s in v["slices"].values():
            assert s["status"] in ("pass", "fail", "inconclusive") and len(s["ci"]) == 2
    assert (run / "report" / "index.html").stat().st_size > 10_000

    # Warm: nothing runs again.
    assert main(["evaluate", *argv]) == 0
    err = capsys.readouterr().err
    assert "running" not in err, err
    assert err.count("up to date") == len(STAGES)

    # The gate's exit status follows gate.json's decision: 0 go, 1 no-go, 3 inconclusive.
    assert main(["gate-check", *argv]) == {"go": 0, "no-go": 1, "inconclusive": 3}[gate["decision"]]

"""The report's runtime section (pipeline/report/variants.py: runtime_blocks) from latency JSON
shaped like the stage's: kernel per variant, the memory plan."""
from __future__ import annotations

import json

from pipeline.core.stage import SCHEMA_VERSION
from pipeline.report.document import to_markdown
from pipeline.report.variants import runtime_blocks

PLAN = {"budget_bytes": 60e9, "steps": [
    {"action": "run", "batch": 1, "context": 128, "cache_len": 193, "prefill_chunk": None},
    {"action": "free", "batch": 1, "cache_len": 193},
    {"action": "run", "batch": 32, "context": 8192, "cache_len": 8257, "prefill_chunk": 1024},
    {"action": "free", "batch": 32, "cache_len": 8257}],
    "dropped": [{"batch": 64, "context": 8192, "reason": "needs 90.0 GB (cache 69.2 GB + activations 20.8 GB) "
                                                         "of 60.0 GB"}]}
GPTQ = {"library": "gptqmodel", "kernels": {"MarlinQuantLinear": 224},
        "details": {"MarlinQuantLinear": {"backend": "marlin", "bits": "4"}}, "compute_dtype": "bfloat16"}


def test_runtime_section(tmp_path):
    lat = tmp_path / "latency"
    lat.mkdir()
    (lat / "meta.json").write_text(json.dumps({"stage": "latency", "schema": SCHEMA_VERSION}))
    (lat / "w4.json").write_text(json.dumps({"device_name": "NVIDIA H200", "kernels": GPTQ,
                                             "memory_plan": PLAN, "grid": []}))
    (lat / "bf16.json").write_text(json.dumps({"device": "cpu", "grid": []}))  # without these keys (a pair not timed)
    md = to_markdown("t", runtime_blocks(tmp_path))
    assert "| w4 | NVIDIA H200 | gptqmodel: MarlinQuantLinear x224 (backend marlin) | timed |" in md
    assert "| bf16 | cpu | not recorded | timed |" in md
    assert "| w4 | 60.00 GB | B=1x128, B=32x8192 (chunks of 1024) | B=64x8192: needs 90.0 GB" in md
    assert runtime_blocks(tmp_path / "nowhere") == []

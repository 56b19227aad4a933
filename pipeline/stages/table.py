"""The STAGES table: every stage's config sections, upstream stages, output directory, code and entry.

    from pipeline.stages.table import STAGES
    run_stage(STAGES["latency"], run_dir, config, {}, STAGES)      # pipeline.core.stage.run_stage

The order is the one `evaluate` and make run them in (the budget ledger gives each what the stages
before it left). `after`: stages read and hashed when they have run, not required (vllm). Code:
"import:<module>" = the stage's module and every project module it imports, plus the data files
it reads; the runner adds its own modules and the config schema (pipeline.core.stage.RUNNER_CODE).
"""
from __future__ import annotations

from pipeline.core.stage import StageSpec

PROMPTS_DATA = "evals/data/speculation_prompts.json"  # the builtin workload (pipeline.speculation.prompts)

# name -> StageSpec(name, config sections read, upstream stages, output dir, code, entry point)
STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("prepare", ["prepare"], [], "model", ["import:pipeline.stages.prepare"], "pipeline.stages.prepare:run",
                  precheck="pipeline.models.source:check_model"),
        StageSpec("quantize", ["quantize", "device", "seed"], ["prepare"], "variants",
                  ["import:pipeline.stages.quantize", "evals/data/calibration.txt"], "pipeline.stages.quantize:run"),
        StageSpec("quality", ["quality", "gate", "confidence", "quantize", "device", "seed", "budget"], ["quantize"],
                  "quality", ["import:pipeline.stages.quality", "evals/tasks/*", "evals/data/*.jsonl"],
                  "pipeline.stages.quality:run", precheck="pipeline.stages.quality:precheck"),
        StageSpec("drafts", ["drafts", "device"], ["quantize"], "drafts", ["import:pipeline.stages.drafts"],
                  "pipeline.stages.drafts:run"),
        StageSpec("acceptance", ["acceptance", "latency", "confidence", "device", "seed", "budget"], ["quantize", "drafts"],
                  "acceptance", ["import:pipeline.stages.acceptance", PROMPTS_DATA], "pipeline.stages.acceptance:run",
                  precheck="pipeline.speculation.workload:precheck"),
        StageSpec("vllm", ["vllm", "speculation_engine", "acceptance", "serving", "confidence", "quantize", "drafts", "seed",
                            "budget"],
                  ["quantize", "drafts"], "vllm", ["import:pipeline.stages.vllm_engine", PROMPTS_DATA],
                  "pipeline.stages.vllm_engine:run",
                  precheck="pipeline.stages.vllm_engine:precheck"),
        StageSpec("latency", ["latency", "acceptance", "vllm", "confidence", "device", "seed", "budget"],
                  ["quantize", "drafts", "acceptance"], "latency", ["import:pipeline.stages.latency", PROMPTS_DATA],
                  "pipeline.stages.latency:run",
                  precheck="pipeline.speculation.workload:precheck", after=["vllm"]),
        StageSpec("marginal", ["confidence", "serving", "report"], ["acceptance", "latency"], "marginal",
                  ["import:pipeline.stages.marginal"], "pipeline.stages.marginal:run", after=["vllm"]),
        StageSpec("gate", ["gate", "confidence", "quantize"], ["quality", "acceptance"], "gate",
                  ["import:pipeline.stages.gate"], "pipeline.stages.gate:run"),
        StageSpec("report", ["report"], ["gate", "marginal", "latency", "acceptance", "quality"],
                  "report", ["import:pipeline.stages.report"], "pipeline.stages.report:run", after=["vllm"]),
    ]
}

"""Which targets and drafts each engine measures, and which engine chooses k.

    from pipeline.stages.targets import vllm_targets, speculation_targets, engine_drafts, engine_args
    vllm_targets(config)                      # the vllm stage's targets
    speculation_targets(config, run_dir)      # the targets specq's engine derives acceptance for

Shared by the acceptance, vllm and latency stages, so that each vLLM-measured pair has the
teacher-forced derivation beside it, and a change of engine (vLLM installed or removed) re-runs
the stages it changes (engine_args goes into their hash).
"""
from __future__ import annotations

from pipeline.latency.served import serve_reason
from pipeline.vllm.env import engine_info, speculation_engine


def engine_args(config) -> dict:
    """What the stage's hash takes from the machine: which engine runs it, and vLLM's version."""
    engine, _ = speculation_engine(config)
    return {"engine": engine, "vllm": engine_info().get("vllm") if engine == "vllm" else None}


def vllm_targets(config) -> list[str]:
    """vllm.targets as written, or the reference and every release variant."""
    q = config.quantize
    if config.vllm.targets:
        return list(dict.fromkeys(config.vllm.targets))
    return [q.reference] + [v for v, spec in q.variants.items() if spec.release and v != q.reference]


def speculation_targets(config, run_dir) -> list[str]:
    """The targets specq's own engine derives acceptance for (the acceptance and latency stages):
    acceptance.targets as written, or by default the reference and, where vLLM measures
    speculation, every release variant it serves here, so each vLLM-measured pair has the
    teacher-forced derivation beside it."""
    if config.acceptance.targets:
        return list(config.acceptance.targets)
    ref = config.quantize.reference
    if speculation_engine(config)[0] != "vllm":
        return [ref]
    platform = engine_info().get("platform", "cpu")
    served = [v for v in vllm_targets(config)
              if v != ref and (run_dir / "variants" / v / "meta.json").is_file()
              and serve_reason(run_dir / "variants" / v, platform) is None]
    return [ref, *served]


def engine_drafts(specs: list[str], target: str, stage: str, say=None, reference: str | None = None) -> list[str]:
    """The drafts specq's engine pairs with `target`: not the target itself (self:<target>), except
    on the reference, where it is the sanity pair a config may ask for (every draft accepted)."""
    out = []
    for spec in specs:
        if spec == f"self:{target}" and target != reference:
            if say:
                say(f"{stage}: {target} + {spec}: the draft is the target itself; not measured")
            continue
        out.append(spec)
    return out

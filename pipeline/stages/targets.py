"""Which targets and drafts each engine measures, and which engine chooses k.

    from pipeline.stages.targets import vllm_targets, speculation_targets, engine_drafts, engine_args
    vllm_targets(config)                      # the vllm stage's targets
    speculation_targets(config, run_dir)      # the targets specq's engine derives acceptance for
    vllm_measured(run_dir)                    # the pairs the vllm stage measured: pair -> its JSON

By default every release variant is a target in both engines, so each vLLM-measured pair has the
teacher-forced derivation beside it; engine_args goes into the stages' hash.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import read_json
from pipeline.vllm.env import engine_info, speculation_engine


def engine_args(config) -> dict:
    """What the stage's hash takes from the machine: which engine runs it, and vLLM's version."""
    engine, _ = speculation_engine(config)
    return {"engine": engine, "vllm": engine_info().get("vllm") if engine == "vllm" else None}


def release_variants(config) -> list[str]:
    """The variants that ship: every release variant other than the reference."""
    q = config.quantize
    return [v for v, spec in q.variants.items() if spec.release and v != q.reference]


def vllm_targets(config) -> list[str]:
    """vllm.targets as written, or every release variant (the reference is a target when listed)."""
    if config.vllm.targets:
        return list(dict.fromkeys(config.vllm.targets))
    return release_variants(config) or [config.quantize.reference]


def speculation_targets(config, run_dir) -> list[str]:
    """The targets specq's own engine derives acceptance for: acceptance.targets as written, or
    every release variant (the reference where there is none)."""
    if config.acceptance.targets:
        return list(config.acceptance.targets)
    return release_variants(config) or [config.quantize.reference]


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


def vllm_measured(run_dir: Path) -> dict[str, Path]:
    """The pairs the vllm stage measured (its meta.json names them): their speed is vLLM's, so the
    latency stage does not time them and the marginal stage reports them from vLLM's figures."""
    meta = run_dir / "vllm" / "meta.json"
    measured = (read_json(meta, "vllm meta.json").get("measured") or {}) if meta.is_file() else {}
    return {pair: run_dir / "vllm" / f"{pair}.json" for pair in measured}

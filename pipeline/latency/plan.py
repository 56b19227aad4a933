"""The latency stage's memory plan: built before any cell runs, recorded after.

    from pipeline.latency.plan import plain_phase, speculative_phase
    plan, budget = plain_phase(model, lat, device)                 # after the variant is loaded
    plan, budget = speculative_phase(model, drafts, lat, k_max, prompt_len, device)

Two phases per model: the plain grid of each variant, then each target's speculative pairs,
each planned against the memory free when it starts. Why: docs/methods/gpu-box.md.
"""
from __future__ import annotations

from pipeline.decode.attention import GQA, attention_path, use_gqa_attention
from pipeline.decode.cache import hf_model
from pipeline.latency.memory import CellPlan, MemoryPlan, ModelShape, cache_len, device_budget, plan_grid
from pipeline.latency.roofline import model_bytes

# ---------------------------------------------------------------- the two phases, measured


def _shape(model, weight_bytes: int) -> ModelShape:
    return ModelShape.from_model(model, weight_bytes)


def why_not_screened(lat) -> str | None:
    """Why the pairs are not screened (pipeline/latency/screen.py), or None when they are."""
    return "off (latency.screen: false)" if not lat.screen else None


def _attention(model) -> str:
    """Switch a grouped-query model to the attention path that reads each KV head once (what its
    CachedModel will do anyway: idempotent) and say which path its steps will run."""
    use_gqa_attention(hf_model(model))
    return attention_path(hf_model(model))


def plain_phase(model, lat, device, contexts: list[int] | None = None) -> tuple[MemoryPlan, dict]:
    """The plain grid of a loaded variant against the memory free now."""
    weights = model_bytes(model)["all_weight_bytes"]
    budget = device_budget(device, weights_loaded=True, weight_bytes=weights)
    plan = plan_grid(_shape(model, weights), lat.batch_sizes, contexts if contexts is not None else lat.context_lengths,
                     lat.new_tokens, budget["budget_bytes"], device.type, attention_path=_attention(model))
    return plan, budget


def draft_kv_bytes_per_token(draft) -> int:
    """KV bytes per position of a runtime draft's own cache (0 for a model-free draft)."""
    model = getattr(draft, "model", None)
    if model is None:
        return 0
    return ModelShape.from_model(hf_model(model), 0).kv_bytes_per_token


def speculative_phase(model, drafts: dict, lat, k_max: int, prompt_len: int, device) -> tuple[MemoryPlan, dict]:
    """The speculative cell of a loaded target with its drafts loaded beside it."""
    weights = model_bytes(model)["all_weight_bytes"]
    budget = device_budget(device, weights_loaded=True, weight_bytes=weights)
    kv = {spec: draft_kv_bytes_per_token(d) for spec, d in drafts.items()}
    plan = speculative_plan(_shape(model, weights), kv, prompt_len, lat.new_tokens, k_max,
                            budget["budget_bytes"], device.type, attention_path=_attention(model))
    return plan, budget


def speculative_plan(shape: ModelShape, draft_kv: dict[str, int], context: int, new_tokens: int, k_max: int,
                     budget_bytes: float, device_type: str, attention_path: str = GQA) -> MemoryPlan:
    """B = 1 at `context` with verify width k_max + 1; the largest draft cache (one alive at a
    time) is set aside first. A draft's own step activations are a fraction of the target's
    verify and sit inside plan_grid's slack."""
    length = cache_len(context, new_tokens)
    largest = max(draft_kv.values(), default=0) * length
    plan = plan_grid(shape, [1], [context], new_tokens, budget_bytes - largest, device_type,
                     verify_width=k_max + 1, attention_path=attention_path)
    plan.budget_bytes = int(budget_bytes)
    for step in plan.steps:
        if step["action"] == "run":
            step["draft_cache_bytes"] = int(largest)
    return plan

"""The latency stage's memory plan and compile session: built before any cell runs, recorded after.

    from pipeline.latency.plan import plain_phase, speculative_phase, plan_latency_stage
    plan, budget = plain_phase(model, lat, device)                 # after the variant is loaded
    plan, budget = speculative_phase(model, drafts, lat, k_max, prompt_len, device)
    session, record = compile_session(lat, device)                 # None + a record when off
    plan_latency_stage(cfg, shape, card_bytes=80e9, spec_context=64)   # the whole stage, no device

The stage runs in two phases per model: the plain grid of each variant (batch x context cells, one
at a time, pipeline.latency.memory.plan_grid), then the speculative pairs of each target (B = 1 on
the longest timing prompt, verify width k_max + 1, every draft built at once: their weights are
loaded beside the target's, and one draft's cache is alive beside the target's at a time). The
budget is measured (pipeline.latency.memory.device_budget) after the weights are loaded, so it
already excludes them; `plan_latency_stage` plans the same phases from estimated weight bytes, for
checking a config against a card without one.

Graphs a compiled run needs (one per shape, pipeline/decode/compiled.py): one decode-step graph per
plain cell; for the speculative phase the target's decode step and its verify widths 2..k_max+1,
and each model draft's widths 1 and 2 (a step, and the catch-up after a round accepted in full).
They are compiled before the timed runs (CompileSession.warm), never inside them.
"""
from __future__ import annotations

from pipeline.latency.memory import CellPlan, MemoryPlan, ModelShape, cache_len, device_budget, plan_grid


# ---------------------------------------------------------------- the compiled shapes and the session


def plain_shapes(cells: list[CellPlan]) -> list[tuple]:
    """One decode-step graph per plain cell (its batch, its cache length)."""
    from pipeline.decode.compiled import step_shapes

    return [s for c in cells for s in step_shapes("target", c.batch, c.cache_len, [1])]


def speculative_shapes(cache_len: int, k_max: int, draft_labels: list[str]) -> list[tuple]:
    """The target's decode step and verify widths 2..k_max+1 (the shortened last rounds of a
    generation use the narrower ones), and each model draft's widths 1 and 2."""
    from pipeline.decode.compiled import step_shapes

    shapes = step_shapes("target", 1, cache_len, [1]) + step_shapes("target", 1, cache_len, range(2, k_max + 2),
                                                                     all_logits=True)
    for label in draft_labels:
        shapes += step_shapes(label, 1, cache_len, [1, 2])
    return shapes


def draft_label(spec: str) -> str:
    return f"draft {spec}"


def compile_session(lat, device):
    """(CompileSession or None, record). Runs torch.compile where it is asked for and can run:
    on CUDA with inductor and CUDA graphs (compile_backend auto), on any device with an explicit
    eager / aot_eager backend (a check of the machinery; no speed-up is expected from those).
    The caller says which shapes to compile (session.expect) once its plan is known."""
    from pipeline.decode.compiled import CompileSession, not_compiled

    why = why_not_compiled(lat, device)
    if why is not None:
        return None, not_compiled(why)
    backend = "inductor" if lat.compile_backend == "auto" else lat.compile_backend
    return CompileSession(backend=backend, mode="reduce-overhead" if backend == "inductor" else None), None


def why_not_compiled(lat, device) -> str | None:
    """Why the config's steps run eagerly on this device, or None when they are to be compiled."""
    if not lat.compile:
        return "off"
    if lat.compile_backend == "auto" and device.type != "cuda":
        return ("requested, not run on CPU: the compiled path is the GPU's (inductor + CUDA graphs); "
                "latency.compile_backend: eager checks it here")
    return None


# ---------------------------------------------------------------- the two phases, measured


def _shape(model, weight_bytes: int) -> ModelShape:
    return ModelShape.from_model(model, weight_bytes)


def plain_phase(model, lat, device, contexts: list[int] | None = None) -> tuple[MemoryPlan, dict]:
    """The plain grid of a loaded variant against the memory free now."""
    from pipeline.latency.roofline import model_bytes

    weights = model_bytes(model)["all_weight_bytes"]
    budget = device_budget(device, weights_loaded=True, weight_bytes=weights)
    plan = plan_grid(_shape(model, weights), lat.batch_sizes, contexts if contexts is not None else lat.context_lengths,
                     lat.new_tokens, budget["budget_bytes"], device.type)
    return plan, budget


def draft_kv_bytes_per_token(draft) -> int:
    """KV bytes per position of a runtime draft's own cache (0 for a model-free draft)."""
    from pipeline.decode.cache import hf_model

    model = getattr(draft, "model", None)
    if model is None:
        return 0
    return ModelShape.from_model(hf_model(model), 0).kv_bytes_per_token


def speculative_phase(model, drafts: dict, lat, k_max: int, prompt_len: int, device) -> tuple[MemoryPlan, dict]:
    """The speculative cell of a loaded target with its drafts loaded beside it."""
    from pipeline.latency.roofline import model_bytes

    weights = model_bytes(model)["all_weight_bytes"]
    budget = device_budget(device, weights_loaded=True, weight_bytes=weights)
    kv = {spec: draft_kv_bytes_per_token(d) for spec, d in drafts.items()}
    plan = speculative_plan(_shape(model, weights), kv, prompt_len, lat.new_tokens, k_max,
                            budget["budget_bytes"], device.type)
    return plan, budget


def speculative_plan(shape: ModelShape, draft_kv: dict[str, int], context: int, new_tokens: int, k_max: int,
                     budget_bytes: float, device_type: str) -> MemoryPlan:
    """B = 1 at `context` with verify width k_max + 1; the largest draft cache (one alive at a
    time) is set aside first. A draft's own step activations are a fraction of the target's
    verify and sit inside plan_grid's slack."""
    length = cache_len(context, new_tokens)
    largest = max(draft_kv.values(), default=0) * length
    plan = plan_grid(shape, [1], [context], new_tokens, budget_bytes - largest, device_type,
                     verify_width=k_max + 1)
    plan.budget_bytes = int(budget_bytes)
    for step in plan.steps:
        if step["action"] == "run":
            step["draft_cache_bytes"] = int(largest)
    return plan


# ---------------------------------------------------------------- the whole stage, from a config


def linear_parameters(shape: ModelShape) -> int:
    """Parameters in the decoder layers' linear maps (what GPTQ, bnb and torchao quantize; the
    embeddings and the LM head stay 16-bit)."""
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    per_layer = shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * shape.intermediate
    return shape.layers * per_layer


def estimated_weight_bytes(shape: ModelShape, variant) -> int:
    """Bytes a variant's weights take once loaded, from its scheme (an estimate for planning
    without loading it; the stage itself measures). Quantized linears: bits/8 bytes per weight,
    plus a 16-bit scale (and packed zero) per group; the rest stays in the compute dtype."""
    linear = linear_parameters(shape)
    rest = shape.weight_bytes - linear * shape.element_bytes
    scheme, bits = variant.scheme, variant.bits
    if scheme == "none":
        return shape.weight_bytes
    if scheme in ("gptq", "checkpoint"):
        group = variant.group_size or 128
        per_weight = (bits or 4) / 8 + (2 + (bits or 4) / 8) / group
    elif scheme == "bnb-nf4":
        per_weight = 0.5 + 4 / 64  # one float32 absmax per block of 64 (before double quantization)
    elif scheme in ("bnb-int8", "torchao-int8wo"):
        per_weight = 1.0  # + one scale per output row, negligible
    else:
        raise ValueError(f"no weight estimate for scheme {scheme!r}")
    return int(rest + linear * per_weight)


def draft_cost(spec: str, shape: ModelShape, variants: dict) -> dict:
    """Weights a draft adds beside the target, and its KV bytes per position (for planning)."""
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        return {"weight_bytes": 0, "kv_bytes_per_token": 0}
    if kind == "layerskip":  # shares the target's first n layers; its own n-layer cache
        return {"weight_bytes": 0, "kv_bytes_per_token": shape.kv_bytes_per_token * int(arg) // shape.layers}
    if kind == "self":  # the target architecture, quantized: a second copy of the weights
        return {"weight_bytes": estimated_weight_bytes(shape, variants[arg]),
                "kv_bytes_per_token": shape.kv_bytes_per_token}
    raise ValueError(f"no planning estimate for draft {spec!r} (an hf: draft's size is known once loaded)")


def plan_latency_stage(cfg, shape: ModelShape, card_bytes: float, spec_context: int, device_type: str = "cuda",
                       reserve_fraction: float = 0.05, reserve_min: int = 1 << 30) -> dict:
    """The stage's plan for a config on a card of `card_bytes`, from estimated weights: every
    variant's plain grid, every target's speculative cell, and the graphs each would compile."""
    lat = cfg.latency
    k_max = lat.k_max or cfg.acceptance.k_max
    free = card_bytes - max(reserve_min, reserve_fraction * card_bytes)
    variants = cfg.quantize.variants
    out: dict = {"card_bytes": int(card_bytes), "variants": {}, "speculative": {}}
    for name, variant in variants.items():
        weights = estimated_weight_bytes(shape, variant)
        plan = plan_grid(shape, lat.batch_sizes, lat.context_lengths, lat.new_tokens, free - weights, device_type)
        out["variants"][name] = {"weight_bytes": weights, "plan": plan, "graphs": len(plain_shapes(plan.cells))}
    costs = {spec: draft_cost(spec, shape, variants) for spec in cfg.drafts}
    for target in cfg.acceptance.targets or [cfg.quantize.reference]:
        weights = estimated_weight_bytes(shape, variants[target]) + sum(c["weight_bytes"] for c in costs.values())
        plan = speculative_plan(shape, {s: c["kv_bytes_per_token"] for s, c in costs.items()}, spec_context,
                                lat.new_tokens, k_max, free - weights, device_type)
        labels = [draft_label(s) for s, c in costs.items() if c["kv_bytes_per_token"]]
        length = plan.cells[0].cache_len if plan.cells else cache_len(spec_context, lat.new_tokens)
        out["speculative"][target] = {"weight_bytes": weights, "plan": plan,
                                      "graphs": len(speculative_shapes(length, k_max, labels))}
    return out

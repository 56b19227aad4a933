"""The latency stage's memory plan and compile session: built before any cell runs, recorded after.

    from pipeline.latency.plan import plain_phase, speculative_phase
    plan, budget = plain_phase(model, lat, device)                 # after the variant is loaded
    plan, budget = speculative_phase(model, drafts, lat, k_max, prompt_len, device)
    session, record = compile_session(lat, device)                 # None + a record when off

Two phases per model: the plain grid of each variant, then each target's speculative pairs. Every
shape a compiled run needs is known and compiled before any timing, never inside it. The phases,
the shapes and why: docs/methods/gpu-box.md, "Compiled steps and the memory plan".
"""
from __future__ import annotations

from pipeline.decode.attention import GQA, attention_path, use_gqa_attention
from pipeline.decode.cache import hf_model
from pipeline.decode.compiled import CompileSession, not_compiled, step_shapes
from pipeline.latency.memory import CellPlan, MemoryPlan, ModelShape, cache_len, device_budget, plan_grid
from pipeline.latency.roofline import model_bytes

# ---------------------------------------------------------------- the compiled shapes and the session


def plain_shapes(cells: list[CellPlan]) -> list[tuple]:
    """One decode-step graph per plain cell (its batch, its cache length)."""
    return [s for c in cells for s in step_shapes("target", c.batch, c.cache_len, [1])]


def speculative_shapes(cache_len: int, k_max: int, draft_labels: list[str]) -> list[tuple]:
    """The target's decode step (plain decoding, and a round whose draft offered nothing: the
    engine runs that as a decode step, pipeline/decode/engine.py) and verify widths 2..k_max+1
    (the shortened last rounds of a generation use the narrower ones), and each model draft's
    widths 1 and 2."""
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
    why = why_not_compiled(lat, device)
    if why is not None:
        return None, not_compiled(why)
    backend = _backend(lat)
    return CompileSession(backend=backend, mode="reduce-overhead" if backend == "inductor" else None,
                          dynamic_width=lat.compile_dynamic_width), None


def _backend(lat) -> str:
    """The torch.compile backend the config asks for (auto: inductor, with CUDA graphs)."""
    return "inductor" if lat.compile_backend == "auto" else lat.compile_backend


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


def why_not_screened(lat, device) -> str | None:
    """Why the pairs are not screened (pipeline/latency/screen.py), or None when they are. The
    screen's probe runs eagerly; where the timed steps run compiled with inductor, an eager probe
    bounds nothing about them. On a GPU an eager step of a large model is host-bound (kernel
    launches, about 0.6-0.9 ms a layer), so a draft's step looks as dear as the target's and every
    model draft would be screened out where, compiled, it may pay. Those pairs are timed."""
    if not lat.screen:
        return "off (latency.screen: false)"
    if why_not_compiled(lat, device) is None and _backend(lat) == "inductor":
        return ("not run: the timed steps are compiled (inductor) and the probe is eager; an eager step is "
                "host-bound on a GPU, so its bound would screen out model drafts that pay compiled")
    return None


def uses_cuda_graphs(lat, device) -> bool:
    """Whether the steps will be captured as CUDA graphs (compile_session's inductor +
    "reduce-overhead" on CUDA), whose memory pool the plan must count."""
    return why_not_compiled(lat, device) is None and device.type == "cuda" and _backend(lat) == "inductor"


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
                     lat.new_tokens, budget["budget_bytes"], device.type, attention_path=_attention(model),
                     cuda_graphs=uses_cuda_graphs(lat, device))
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
                            budget["budget_bytes"], device.type, attention_path=_attention(model),
                            cuda_graphs=uses_cuda_graphs(lat, device))
    return plan, budget


def speculative_plan(shape: ModelShape, draft_kv: dict[str, int], context: int, new_tokens: int, k_max: int,
                     budget_bytes: float, device_type: str, attention_path: str = GQA,
                     cuda_graphs: bool = False) -> MemoryPlan:
    """B = 1 at `context` with verify width k_max + 1; the largest draft cache (one alive at a
    time) is set aside first. A draft's own step activations are a fraction of the target's
    verify and sit inside plan_grid's slack."""
    length = cache_len(context, new_tokens)
    largest = max(draft_kv.values(), default=0) * length
    plan = plan_grid(shape, [1], [context], new_tokens, budget_bytes - largest, device_type,
                     verify_width=k_max + 1, attention_path=attention_path, cuda_graphs=cuda_graphs)
    plan.budget_bytes = int(budget_bytes)
    for step in plan.steps:
        if step["action"] == "run":
            step["draft_cache_bytes"] = int(largest)
    return plan

"""The bench's baseline side (pipeline/tools/bench.py): transformers' generate as a speed-minded user
runs it, a static cache, compiled per the bench's plan, and assisted generation with the layer-skip
draft as a truncated copy of the target; its first run records what actually ran (compiled or eager,
which caches).
"""
from __future__ import annotations

import copy
import time

import torch

from pipeline.tools.bench_clock import compiled_graphs, forward_clock


def hf_compile_config(plan: dict, device_type: str):
    """The CompileConfig transformers' generate gets (None: its own default, or no compile)."""
    if not plan["compile"]:
        return None
    from transformers import CompileConfig

    if device_type == "cuda" and plan["backend"] == "inductor":
        return None  # transformers' default CompileConfig: what a user gets from cache_implementation="static"
    cc = CompileConfig(backend=plan["backend"], mode="default" if plan["backend"] == "inductor" else None)
    if device_type != "cuda":
        cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
    return cc


def hf_generation_config(model, n: int, plan: dict, device_type: str, static: bool = True):
    """Greedy, exactly n tokens (EOS off), on a static cache, compiled per `plan`."""
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, n, None
    gc.temperature = gc.top_p = gc.top_k = None
    gc.eos_token_id = None  # exactly n tokens, like the engine with eos_token_id=None
    if gc.pad_token_id is None:
        gc.pad_token_id = model.config.get_text_config().pad_token_id or 0
    gc.cache_implementation = "static" if static else None
    gc.compile_config = hf_compile_config(plan, device_type)
    gc.disable_compile = not plan["compile"]
    return gc


def set_assistant(assistant, k: int) -> None:
    agc = assistant.generation_config
    agc.num_assistant_tokens = k
    agc.num_assistant_tokens_schedule = "constant"
    agc.assistant_confidence_threshold = 0.0


def truncated_copy(model, n_layers: int):
    """A separate model holding copies of the target's first n decoder layers, its final norm and
    its LM head: transformers' view of the layerskip draft (it cannot share the target's modules)."""
    from pipeline.models.architecture import decoder_layers

    draft = copy.deepcopy(model)
    path, layers = decoder_layers(draft)
    if n_layers > len(layers):
        raise SystemExit(f"bench: cannot truncate {type(model).__name__} to {n_layers} layers")
    parent_path, _, attr = path.rpartition(".")
    setattr(draft.get_submodule(parent_path), attr, layers[:n_layers])
    text = draft.config.get_text_config()
    text.num_hidden_layers = n_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:n_layers]
    return draft.eval()


def hf_generate(model, ids: torch.Tensor, gc, assistant=None, record: dict | None = None) -> list[int]:
    """transformers' generate with `gc`; `record` (optional) receives the cache class it returned."""
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    if record is not None:
        gc = copy.copy(gc)
        gc.return_dict_in_generate = True
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **kwargs)
    if record is not None:
        cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        record["cache"] = type(cache).__name__ if cache is not None else None
        out = out.sequences
    return out[0, ids.shape[1]:].tolist()


def hf_first_run(model, ids, gc, assistant, plan: dict, device_type: str, device) -> tuple[dict, object]:
    """transformers' first run (untimed): compiles where planned and records what ran. A compile
    that fails falls back to eager, recorded. Returns (record, the generation config to time)."""
    from pipeline.decode.timing import synchronize

    rec: dict = {}
    modules = {"assistant": assistant} if assistant is not None else {}
    if not plan["compile"]:
        modules["target"] = model  # under compile a clocked target forward would change the graph
    before = compiled_graphs()
    synchronize(device)
    t0 = time.perf_counter()
    try:
        with forward_clock(modules) as stats:
            hf_generate(model, ids, gc, assistant, record=rec)
    except Exception as e:  # noqa: BLE001 - a compile failure becomes a recorded eager fallback
        if not plan["compile"]:
            raise
        rec["compile_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        gc = copy.copy(gc)
        gc.compile_config, gc.disable_compile = None, True
        return {**rec, "ran": "eager", "reason": "compile failed; ran eagerly: " + rec["compile_error"]}, gc
    synchronize(device)
    made = compiled_graphs() - before
    rec["first_run_s"] = time.perf_counter() - t0
    rec["graphs_compiled"] = made
    if "assistant" in stats:
        rec["assistant_cache"] = ", ".join(stats["assistant"]["caches"]) or None
    if not plan["compile"]:
        rec.update(ran="eager", reason=plan["reason"])
    elif made > 0:
        rec.update(ran="compiled", reason=plan["reason"],
                   compile_config=("transformers' default CompileConfig" if gc.compile_config is None
                                   else gc.compile_config.to_dict()))
    else:
        rec.update(ran="eager", reason="compile requested but transformers compiled no graph "
                                       "(its auto-compile criteria were not met)")
    return rec, gc


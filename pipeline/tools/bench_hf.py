"""The bench's baseline side (pipeline/tools/bench.py): transformers' generate on a static cache,
eager like the engine, and assisted generation with the layer-skip draft as a truncated copy of the
target; its first run records which caches each side's forwards received.
"""
from __future__ import annotations

import copy
import time

import torch

from pipeline.tools.bench_clock import forward_clock


def hf_generation_config(model, n: int, static: bool = True):
    """Greedy, exactly n tokens (EOS off), on a static cache, never compiled (transformers would
    compile a static-cache generate on CUDA by itself)."""
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, n, None
    gc.temperature = gc.top_p = gc.top_k = None
    gc.eos_token_id = None  # exactly n tokens, like the engine with eos_token_id=None
    if gc.pad_token_id is None:
        gc.pad_token_id = model.config.get_text_config().pad_token_id or 0
    gc.cache_implementation = "static" if static else None
    gc.disable_compile = True
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


def hf_first_run(model, ids, gc, assistant, device) -> dict:
    """transformers' first run (untimed): how long it took and the cache classes its forwards got."""
    from pipeline.decode.timing import synchronize

    rec: dict = {}
    modules = {"target": model, **({"assistant": assistant} if assistant is not None else {})}
    synchronize(device)
    t0 = time.perf_counter()
    with forward_clock(modules) as stats:
        hf_generate(model, ids, gc, assistant, record=rec)
    synchronize(device)
    rec["first_run_s"] = time.perf_counter() - t0
    if "assistant" in stats:
        rec["assistant_cache"] = ", ".join(stats["assistant"]["caches"]) or None
    return rec

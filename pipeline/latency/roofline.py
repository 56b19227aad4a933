"""The memory-bandwidth roofline for decode: bytes moved per step, and what the device can move.

    from pipeline.latency.roofline import measure_bandwidth, model_bytes
    bw = measure_bandwidth(torch.device("cpu"))        # {"gbps": ..., "bytes": ..., ...}
    mb = model_bytes(model)                             # weight bytes read per step, KV bytes per token
    step = bytes_per_step(mb["weight_bytes"], batch=4, context=1024,
                          kv_bytes_per_token=mb["kv_bytes_per_token"],
                          kv_passes=step_kv_passes(model, width=1))  # after a CachedModel

A decode step moves W + B x K x kv_passes bytes (kv_passes > 1 where attention repeats K and V:
docs/methods/gpu-box.md); the share of measured bandwidth it reaches is its distance to the bound.
"""
from __future__ import annotations

import statistics
import time

import torch

from pipeline.decode.attention import EAGER_REPEAT, SDPA_REPEAT, attention_path
from pipeline.decode.timing import synchronize
from pipeline.latency.memory import ModelShape
from pipeline.models.bytes import bytes_in_memory, shares_data, unique_bytes


def measure_bandwidth(device: torch.device, size_bytes: int | None = None, repeats: int = 5) -> dict:
    """Device memory bandwidth from a large tensor copy (one copy reads and writes `size` bytes):
    the best of `repeats` after a warm-up copy, since on a shared CPU slower copies measure the
    neighbours."""
    if size_bytes is None:
        size_bytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: touches every page of dst
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    moved = 2 * n * 4
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "gbps": moved / min(seconds) / 1e9,
        "gbps_median": moved / statistics.median(seconds) / 1e9,
        "bytes_per_copy": moved,
        "copies": repeats,
        "method": "tensor copy_ (read + write counted), best of repeats after one warm-up copy",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
    }


def model_bytes(model) -> dict:
    """Bytes a decode step reads from the model (every parameter and buffer as the bytes it holds,
    shared ones once; an untied input embedding is read one row per token, so it is left out and
    reported separately), and KV bytes per cached token per sequence."""
    total = bytes_in_memory(model)
    embedding_bytes = _untied_input_embedding_bytes(model)
    shape = ModelShape.from_model(model, total)
    out = {
        "weight_bytes": total - embedding_bytes,
        "all_weight_bytes": total,
        "untied_input_embedding_bytes": embedding_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "kv_formula": f"2 * {shape.layers} layers * {shape.kv_heads} kv_heads * {shape.head_dim} head_dim * "
                      f"{shape.element_bytes} B",
    }
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)  # Qwen-MoE, Mixtral
    if experts:
        out["moe"] = {"experts": experts, "experts_per_token": getattr(text, "num_experts_per_tok", None),
                      "note": "weight_bytes counts every expert: an upper bound, since a decode step "
                              "reads only the experts its tokens are routed to"}
    return out


def _untied_input_embedding_bytes(model) -> int:
    """Bytes of the input embedding when it is not tied to the LM head (judged by the data held), else 0."""
    weight = getattr(model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None, "weight", None)
    head = getattr(model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None, "weight", None)
    if weight is None or (head is not None and shares_data(weight, head)):
        return 0
    return unique_bytes([weight])  # like the total, a meta (offloaded) embedding holds nothing


def bytes_per_step(weight_bytes: int, batch: int, context: float, kv_bytes_per_token: int,
                   kv_passes: int = 1) -> int:
    """W + B * K * kv_passes: weights once per step, plus each sequence's cache at the length
    attention reads, as many times as the attention path moves it."""
    return int(weight_bytes + batch * context * kv_bytes_per_token * kv_passes)


def kv_passes(path: str, heads: int, kv_heads: int, width: int = 1) -> int:
    """How many times one step of `width` new tokens moves the KV bytes it attends over on attention
    path `path`: 1 where each KV head is read once (or there are no groups), 1 + 2 * n_rep where
    repeat_kv runs (one read to copy, n_rep writes, n_rep reads); sdpa skips the copy at width 1."""
    n_rep = heads // kv_heads if kv_heads else 1
    copies = path == EAGER_REPEAT or (path == SDPA_REPEAT and width > 1)
    return 1 + 2 * n_rep if copies and n_rep > 1 else 1


def step_kv_passes(model, width: int = 1) -> int:
    """kv_passes for `model` as its cached steps run now (once a CachedModel has been made)."""
    shape = ModelShape.from_model(model, 0)
    return kv_passes(attention_path(model), shape.heads, shape.kv_heads, width)


def roofline(bytes_step: int, seconds_per_step: float, device_gbps: float) -> dict:
    achieved = bytes_step / seconds_per_step / 1e9 if seconds_per_step > 0 else float("nan")
    return {"achieved_gbps": achieved, "roofline_fraction": achieved / device_gbps if device_gbps else None,
            "roofline_ms_per_step": bytes_step / (device_gbps * 1e9) * 1e3 if device_gbps else None}

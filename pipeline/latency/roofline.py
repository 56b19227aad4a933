"""The memory-bandwidth roofline for decode: bytes moved per step, and what the device can move.

    from pipeline.latency.roofline import measure_bandwidth, model_bytes
    bw = measure_bandwidth(torch.device("cpu"))        # {"gbps": ..., "bytes": ..., ...}
    mb = model_bytes(model)                             # weight bytes read per step, KV bytes per token
    step = bytes_per_step(mb["weight_bytes"], batch=4, context=1024,
                          kv_bytes_per_token=mb["kv_bytes_per_token"])

SEEDS.md: a decode step reads all weights plus every sequence's KV cache, so
bytes per step ~= W + B * K, with K = context * 2 * layers * kv_heads * head_dim * bytes_per_element.
Achieved bandwidth = bytes per step / time per step; its fraction of the measured device bandwidth
says how far a variant is from the memory-bound limit (a W4 variant that moves 1/3 of the bytes but
reaches a small fraction of the bandwidth spends its time dequantizing, not reading).
"""
from __future__ import annotations

import statistics
import time

import torch

from pipeline.decode.timing import synchronize
from pipeline.models.bytes import bytes_in_memory, shares_data, unique_bytes


def measure_bandwidth(device: torch.device, size_bytes: int | None = None, repeats: int = 5) -> dict:
    """Device memory bandwidth from a large tensor copy (dst.copy_(src) reads and writes `size`
    bytes each, so one copy moves 2 * size). Run once per stage and recorded, not assumed.

    The buffer is far larger than any cache (256 MiB on CPU, 1 GiB on CUDA), the first copy is a
    warm-up (page faults, allocator), and the best of `repeats` is the figure: the question is
    what the memory system can do, and on a shared CPU slower copies measure the neighbours.
    """
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
    """Bytes a decode step reads from the model, and KV bytes per cached token per sequence.

    Weight bytes are every parameter and buffer (quantized layers keep their packed
    weights, scales and zeros in buffers), counted as the bytes they hold (pipeline.models.bytes:
    a torchao weight is its int8 data and scales, not its logical float32), once when shared
    (tied embeddings). An input embedding that is NOT tied to the LM head is read one row per
    token, not whole, so it is left out of the per-step figure (and reported separately).
    """
    total = bytes_in_memory(model)
    embedding_bytes = _untied_input_embedding_bytes(model)
    cfg = model.config
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_element = _kv_element_bytes(model)
    out = {
        "weight_bytes": total - embedding_bytes,
        "all_weight_bytes": total,
        "untied_input_embedding_bytes": embedding_bytes,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * kv_element,
        "kv_formula": f"2 * {layers} layers * {kv_heads} kv_heads * {head_dim} head_dim * {kv_element} B",
    }
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if experts:  # Qwen-MoE / Mixtral naming
        out["moe"] = {"experts": experts, "experts_per_token": getattr(text, "num_experts_per_tok", None),
                      "note": "weight_bytes counts every expert: an upper bound, since a decode step "
                              "reads only the experts its tokens are routed to"}
    return out


def _untied_input_embedding_bytes(model) -> int:
    """Bytes of the input embedding when it is not tied to the LM head, else 0. Tied is judged by
    the data held, not data_ptr(): a torchao wrapper's data_ptr() is 0 for every wrapper."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(emb, "weight", None) if emb is not None else None
    if weight is None:
        return 0
    head_weight = getattr(head, "weight", None) if head is not None else None
    if head_weight is not None and shares_data(weight, head_weight):
        return 0
    return unique_bytes([weight])  # like the total, a meta (offloaded) embedding holds nothing


def _kv_element_bytes(model) -> int:
    """The KV cache holds activations, so its element size is the compute dtype's, not the
    (possibly 4-bit) weight storage's."""
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.float32
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_step(weight_bytes: int, batch: int, context: float, kv_bytes_per_token: int) -> int:
    """W + B * K: weights once per step, plus each sequence's cache at its current length."""
    return int(weight_bytes + batch * context * kv_bytes_per_token)


def roofline(bytes_step: int, seconds_per_step: float, device_gbps: float) -> dict:
    achieved = bytes_step / seconds_per_step / 1e9 if seconds_per_step > 0 else float("nan")
    return {"achieved_gbps": achieved, "roofline_fraction": achieved / device_gbps if device_gbps else None,
            "roofline_ms_per_step": bytes_step / (device_gbps * 1e9) * 1e3 if device_gbps else None}

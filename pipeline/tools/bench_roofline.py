"""The bench's roofline (pipeline/tools/bench.py): the bytes a decode step or a speculative round reads
and the bandwidth bound they give at the copy bandwidth measured in the same run.
"""
from __future__ import annotations


def step_bytes(weight_bytes: int, kv_bytes_per_token: int, cache_len: int, kv_passes: int) -> int:
    """Bytes one step reads: the weights once, every slot of the static cache (attention reads the
    whole StaticCache: pipeline/decode/cache.py), as many passes as the attention path makes."""
    from pipeline.latency.roofline import bytes_per_step

    return bytes_per_step(weight_bytes, 1, cache_len, kv_bytes_per_token, kv_passes)


def bound(bytes_per_token: float, gbps: float, measured_ms: float | None) -> dict:
    """The bandwidth bound for `bytes_per_token` at `gbps`, and a measured ms/token against it."""
    ms = bytes_per_token / (gbps * 1e9) * 1e3
    out = {"bytes_per_token": int(bytes_per_token), "bound_ms_per_token": ms}
    if measured_ms:
        out.update(measured_ms_per_token=measured_ms, times_bound=measured_ms / ms,
                   achieved_gbps=bytes_per_token / (measured_ms * 1e-3) / 1e9,
                   bandwidth_fraction=ms / measured_ms)
    return out


def speculative_bytes(rounds: list[tuple[int, int]], target_verify: int, target_step: int,
                      draft_step: int) -> tuple[int, int]:
    """rounds: (drafted, emitted) per round. A round reads the target once (a verify, or a plain
    step when nothing was drafted) and the draft once per drafted token. Returns (bytes, tokens)."""
    total = sum((target_verify if d else target_step) + d * draft_step for d, _ in rounds)
    return total, sum(e for _, e in rounds)


def model_step_bytes(model, cache_len: int, width: int) -> dict:
    from pipeline.latency.roofline import model_bytes, step_kv_passes

    mb = model_bytes(model)
    passes = step_kv_passes(model, width)
    return {"weight_bytes": mb["weight_bytes"], "kv_bytes_per_token": mb["kv_bytes_per_token"],
            "cache_len": cache_len, "kv_passes": passes,
            "step_bytes": step_bytes(mb["weight_bytes"], mb["kv_bytes_per_token"], cache_len, passes)}


def roofline_section(model, draft, plain: dict, spec_row: dict, k: int, bandwidth: dict) -> dict:
    gbps = bandwidth["gbps"]
    target = model_step_bytes(model, plain["engine"]["cache_len"], 1)
    out = {"bandwidth": bandwidth, "plain": {**target, **bound(target["step_bytes"], gbps,
                                                               plain["engine"]["decode_ms_per_token"])}}
    cache_len = spec_row["engine"]["cache_len"]
    verify = model_step_bytes(model, cache_len, k + 1)
    step = model_step_bytes(model, cache_len, 1)
    dstep = model_step_bytes(draft.model, draft.cached.max_len if draft.cached is not None else cache_len, 1)
    total, tokens = speculative_bytes(spec_row["engine"]["round_shape"], verify["step_bytes"], step["step_bytes"],
                                      dstep["step_bytes"])
    if tokens:
        out["speculative"] = {"target_verify": verify, "target_step": step, "draft_step": dstep,
                              "round_bytes": total, "tokens": tokens,
                              **bound(total / tokens, gbps, spec_row["engine"]["decode_ms_per_token"])}
    return out


"""How the prefix evaluator (pipeline/quality/prefix_lm.py) sizes its batches: which requests share
a forward (`plan_batches`, a cost model where a call is worth `call_tokens` row-tokens), the
measurement of that ratio (`measure_call_tokens`, `bucket_call_tokens`), and how many cached
positions a decode batch may hold (`decode_kv_budget`). Imports no lm-eval.

    m = measure_call_tokens(forward, sync); call_tokens = bucket_call_tokens(m["ratio"])
    batches = plan_batches(token_ids, need, max_rows=40, call_tokens=call_tokens)
"""
from __future__ import annotations

import math
import time

import torch

from pipeline.core.device import host_memory

# A forward costs ~ a call cost + a token cost x rows x width; only their ratio steers
# plan_batches. A CPU's (measured on SmolLM2-135M float32).
CPU_CALL_TOKENS = 48
# The largest ratio reported (4^8): beyond it every join is worth it anyway.
MAX_CALL_TOKENS = 4 ** 8
# Measuring forwards run rows of at most this many tokens, so attention stays a small part of it.
MEASURE_WIDTH = 256
# Cached positions (rows x padded length) of a decode batch: on the CPU a speed limit (every step
# reads the whole cache); on CUDA DECODE_KV_SHARE of the free memory.
DECODE_KV_TOKENS = 16384
DECODE_KV_SHARE = 1 / 8
MIN_DECODE_KV_TOKENS = 1024
# The keys of the evaluator's `stats` that are constants, not counts (never summed over evaluators).
SIZING_CONSTANTS = ("call_tokens", "call_tokens_measured", "call_tokens_source", "call_ms", "token_ns",
                    "kv_bytes_per_token", "decode_kv_tokens")
# Whether a CPU uses its measured ratio: not by default, as on a shared CPU it moves with other
# processes' load, and so would batch compositions, hence rounding. CUDA always uses its own.
MEASURE_ON_CPU = False


def bucket_call_tokens(ratio: float) -> int:
    """The power of 4 nearest `ratio` on a log scale, within [1, MAX_CALL_TOKENS]: the ratio
    decides batch compositions, hence float rounding, so it must not move with timing noise."""
    if math.isnan(ratio) or math.isinf(ratio):  # no measurable per-token cost
        return MAX_CALL_TOKENS
    if ratio <= 1:
        return 1
    return int(min(MAX_CALL_TOKENS, 4 ** round(math.log(ratio, 4))))


def _floor_pow2(x: float) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def decode_kv_budget(device_type: str, kv_bytes_per_token: int, free_bytes: int | None) -> int:
    """Cached positions one decode batch may hold: on CUDA DECODE_KV_SHARE of the free memory over
    the KV bytes of a position (a batch's cache lives in up to three copies); elsewhere
    DECODE_KV_TOKENS, lowered where the RAM would not hold it. A power of 2, as it decides batches."""
    fit = _floor_pow2(free_bytes * DECODE_KV_SHARE / max(kv_bytes_per_token, 1)) if free_bytes else None
    if device_type == "cuda" and fit:
        return max(MIN_DECODE_KV_TOKENS, fit)
    return max(MIN_DECODE_KV_TOKENS, min(DECODE_KV_TOKENS, fit)) if fit else DECODE_KV_TOKENS


def free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return host_memory()[0]


def measure_call_tokens(forward, sync=lambda: None, reps: int = 5, max_tokens: int = MAX_CALL_TOKENS,
                        time_limit: float = 10.0) -> dict:
    """How many row-tokens one forward call is worth: {"ratio", "call_s", "token_s", "tokens"}.
    `forward(rows, width)` runs one prefill of rows x width new tokens; `sync()` waits for the
    device. A 1-token call is timed against calls of 16, 64, 256, ... tokens until one takes twice
    as long (or `max_tokens`, or `time_limit` s); then `reps` interleaved pairs at that size."""
    def timed(rows: int, width: int) -> float:
        sync()
        t0 = time.perf_counter()
        forward(rows, width)
        sync()
        return time.perf_counter() - t0

    def shape(n: int) -> tuple[int, int]:
        width = min(n, MEASURE_WIDTH)
        return max(1, n // width), width

    start = time.perf_counter()
    timed(1, 1)  # warm-up
    t1 = min(timed(1, 1), timed(1, 1))
    n, good = 16, None
    while True:
        try:
            timed(*shape(n))  # warm-up at this shape
            tn = timed(*shape(n))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        good = n
        if tn >= 2 * t1 or 4 * n > max_tokens or time.perf_counter() - start > time_limit:
            break
        n *= 4
    if good is None:
        raise RuntimeError("row sizing: no forward of 16 tokens fits")
    rows, width = shape(good)
    ones, many = [], []
    for k in range(reps):
        ones.append(timed(1, 1))
        many.append(timed(rows, width))
        if k >= 1 and time.perf_counter() - start > time_limit:
            break
    t1, tn = min(ones), min(many)
    tokens = rows * width
    token = (tn - t1) / (tokens - 1)
    call = t1 - token
    ratio = call / token if token > 0 else math.inf
    return {"ratio": ratio, "call_s": call, "token_s": token, "tokens": tokens}


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _batch_cost(head: int, lengths: list[int], call_tokens: int) -> int:
    """A batch's cost in tokens: the head's call (if any) and the tails' call of rows x width."""
    width = max(n - head for n in lengths)
    return (call_tokens + head if head else 0) + call_tokens + len(lengths) * width


def plan_batches(seqs: list[list[int]], need: list[int], max_rows: int,
                 call_tokens: int = CPU_CALL_TOKENS) -> list[tuple[int, list[int]]]:
    """Cut requests into (head length, member indices) batches, in lexicographic order of `seqs`.
    Every member starts with the same `head` tokens and keeps at least `need[i]` tokens in its
    tail (the positions whose logits are read). Greedy: the next request joins the current batch
    when that costs less (_batch_cost) than a batch of its own."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    batches: list[tuple[int, list[int]]] = []
    members: list[int] = []
    head = 0
    for i in order:
        own = len(seqs[i]) - need[i]
        if members:
            joined = min(head, own, common_prefix(seqs[members[-1]], seqs[i]))
            lengths = [len(seqs[j]) for j in members]
            if len(members) < max_rows and _batch_cost(joined, lengths + [len(seqs[i])], call_tokens) <= \
                    _batch_cost(head, lengths, call_tokens) + _batch_cost(own, [len(seqs[i])], call_tokens):
                members.append(i)
                head = joined
                continue
            batches.append((head, members))
        members, head = [i], own
    if members:
        batches.append((head, members))
    return batches

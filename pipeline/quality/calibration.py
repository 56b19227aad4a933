"""How many rows the prefix evaluator (pipeline/quality/prefix_lm.py) joins into one forward, and
how many cached positions a decode batch may hold: its cost constants, the measurement it makes
once per loaded model, and the decode KV budget from free memory.

    from pipeline.quality.calibration import measure_call_tokens, bucket_call_tokens
    m = measure_call_tokens(forward, sync); call_tokens = bucket_call_tokens(m["ratio"])

Kept apart from the evaluator so that what only needs its constants (the quality stage's
counters) does not import lm-eval's HFLM.
"""
from __future__ import annotations

import math
import time

import torch

# Cost of a forward pass ~ a call cost + a token cost x rows x width, as measured on the 2-core CPU
# (SmolLM2-135M in float32: one call of 1 token took 119 ms, each further token about 2.3 ms).
# Only the ratio steers the plan: plan_batches works in tokens, a call being worth `call_tokens`
# of them. CPU_CALL_TOKENS is its default (0.11 s / 0.0023 s); PrefixCachedLM measures its own
# (calibrate).
CPU_CALL_TOKENS = 48
# The largest ratio calibration reports (4^8): a batch of quality.batch_size rows of a few hundred
# tokens is far below it, so beyond it every join is worth it anyway.
MAX_CALL_TOKENS = 4 ** 8
# Calibration forwards run rows of at most this many tokens, so attention (quadratic in the row's
# length) stays a small part of what is timed, as in the plan's tails.
CALIBRATION_WIDTH = 256
# A decode batch holds at most this many cached positions (rows x padded length). On the CPU it
# is a speed limit, not a memory one: every step reads the whole cache, so 40 rows of a 1k-token
# haystack decoded slower together than in batches of ~16. On CUDA the limit is memory:
# decode_kv_budget gives the decode caches DECODE_KV_SHARE of the free memory.
DECODE_KV_TOKENS = 16384
DECODE_KV_SHARE = 1 / 8
MIN_DECODE_KV_TOKENS = 1024


def bucket_call_tokens(ratio: float) -> int:
    """The power of 4 nearest `ratio` on a log scale, within [1, MAX_CALL_TOKENS].

    Why a bucket: the ratio decides which requests share a batch, and a batch's composition
    changes the float rounding of its rows (a kernel's result depends on the number of rows and
    the padding), so a ratio that moved with timing noise would let two runs of the same model
    score an item differently. Why powers of 4: a bucket spans a factor of 2 either side of its
    value, so a ratio measured in the middle of one needs a 40-100% timing error to leave it (the
    2-core CPU's 46-48 sits in 64's, whose edges are 32 and 128), while the plan barely cares:
    a ratio off by 2x moves few joins, and those only where either choice costs about the same.
    A ratio near an edge can still flip between runs; pin it (`call_tokens=`) where that matters."""
    if math.isnan(ratio) or math.isinf(ratio):  # no measurable per-token cost
        return MAX_CALL_TOKENS
    if ratio <= 1:  # the call's own cost is lost in the tokens'
        return 1
    return int(min(MAX_CALL_TOKENS, 4 ** round(math.log(ratio, 4))))


def _floor_pow2(x: float) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def decode_kv_budget(device_type: str, kv_bytes_per_token: int, free_bytes: int | None) -> int:
    """Cached positions (rows x padded length) one decode batch may hold.

    CUDA: DECODE_KV_SHARE of the free memory (the driver's free memory plus what torch's allocator
    holds unused) over the model's KV bytes per position. Up to three copies of a batch's cache
    live at once (the prefilled parts, the merged batch, the decode buffers with room for
    max_gen_toks), so 1/8 leaves most of the free memory to activations and the other model.
    CPU (and other devices): DECODE_KV_TOKENS, the measured speed optimum of the 2-core CPU (per
    step the attention reads every cached position, compute-bound, so batches beyond it decoded
    slower), lowered only where the available RAM would not hold it at the same share (a large
    model on a small machine: SmolLM2-135M's float32 cache takes 45 KiB a position, 16k positions
    720 MiB). Rounded down to a power of 2, since free memory differs from run to run and the
    budget decides batches (see bucket_call_tokens)."""
    fit = _floor_pow2(free_bytes * DECODE_KV_SHARE / max(kv_bytes_per_token, 1)) if free_bytes else None
    if device_type == "cuda" and fit:
        return max(MIN_DECODE_KV_TOKENS, fit)
    return max(MIN_DECODE_KV_TOKENS, min(DECODE_KV_TOKENS, fit)) if fit else DECODE_KV_TOKENS


def free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil  # accelerate's dependency
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def measure_call_tokens(forward, sync=lambda: None, reps: int = 5, max_tokens: int = MAX_CALL_TOKENS,
                        time_limit: float = 10.0) -> dict:
    """How many row-tokens one forward call is worth on this model and device.

    `forward(rows, width)` runs one prefill call of rows x width new tokens (as the plan's tail
    batches do); `sync()` waits for the device. A call of 1 token (t1) is timed against calls of
    n = 16, 64, 256, ... tokens, in rows of at most CALIBRATION_WIDTH, until n tokens take at
    least twice t1 (the tokens' own cost is then as large as the call's, so it is measured above
    the noise; on a GPU small calls cost the same whatever their size, and the ratio that matters
    is where that stops), n reaches `max_tokens`, or `time_limit` seconds have gone by. Then
    `reps` interleaved pairs (t1, tn) at that n, each the fastest of its kind (other work on the
    machine only ever adds time): token = (tn - t1) / (n - 1), call = t1 - token. Returns the raw
    ratio call / token, call and token in seconds, and n.

    On a CPU shared with other processes no estimator saves it: with the cores busy elsewhere a
    multi-threaded GEMM waits for its descheduled threads, so tokens slow down far more than the
    call overhead. On the 2-core CPU (idle: call 119 ms, token 2.3 ms, ratio 48) under loads of 3
    to 5, with torch's 2 threads: tokens of 80-220 ms, calls of 45-330 ms, ratios 0.2 to 5; with
    1 thread, ratio 10. Pin call_tokens where runs on a shared machine must agree."""
    def timed(rows: int, width: int) -> float:
        sync()
        t0 = time.perf_counter()
        forward(rows, width)
        sync()
        return time.perf_counter() - t0

    def shape(n: int) -> tuple[int, int]:
        width = min(n, CALIBRATION_WIDTH)
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
        raise RuntimeError("calibration: no forward of 16 tokens fits")
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


# The keys of `stats` that are constants, not counts (summing them over evaluators means nothing;
# calibration_seconds, a count, is not among them).
CALIBRATION_CONSTANTS = ("call_tokens", "call_tokens_measured", "call_tokens_source", "call_ms", "token_ns",
                         "kv_bytes_per_token", "decode_kv_tokens")
# Whether the plan uses the ratio measured on a CPU. It does not by default: on a shared CPU the
# measurement moved 10-200x with other processes' load (0.2 to 4.8 under load against ~48 idle:
# docs/methods/quality-slices.md), past what the power-of-4 bucket absorbs, and a plan that
# changes between the reference's evaluator and a variant's changes batch compositions, hence
# bf16 rounding, on items the two should score alike. A CPU plan uses CPU_CALL_TOKENS (measured idle on the 2-core CPU);
# the measured ratio is still recorded beside it. CUDA always uses its measurement.
MEASURE_ON_CPU = False

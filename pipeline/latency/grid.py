"""The plain decode grid of one variant: TTFT, TPOT and their percentiles per (batch, context) cell.

    from pipeline.latency.grid import plain_grid, add_reference_ratios
    doc = plain_grid("w4a16-gptq", model, cfg.latency, device, bandwidth, seed=0, confidence=0.95)

Each cell decodes `new_tokens` after a random prompt of exactly `context` ids through the engine
the acceptance stage measured, with peak memory, the roofline's share of bandwidth and its
`run_mode` beside it; once the reference's grid exists, its TPOT over the reference's with a CI.
Repeats stop once the TPOT CI settles (SETTLE_RULE of pipeline/latency/speculative.py) or the
budget runs out. How it is timed: docs/methods/stages.md; the repeats: docs/methods/budget.md.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import psutil  # accelerate's dependency
import torch

from pipeline.core.stage import StageError, progress
from pipeline.decode.attention import attention_path
from pipeline.decode.cache import CachedModel
from pipeline.decode.engine import generate
from pipeline.latency.modes import compare, run_mode
from pipeline.latency.memory import plan_loaded
from pipeline.latency.roofline import bytes_per_step, model_bytes, roofline, step_kv_passes
from pipeline.latency.speculative import Repeats, rel_half_width
from pipeline.models.architecture import context_length
from pipeline.models.kernels import device_name, quantized_kernels
from pipeline.stats.intervals import clip_contain, median_ci, percentile_bootstrap, percentile_interval

PERCENTILES = (50, 90, 99)


class PeakMemory:
    """Peak memory during a block: CUDA's max_memory_allocated, or on CPU the process's resident set
    size sampled every 2 ms by a thread (interpreter and libraries included: compare cells)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_rss_peak_sampled_2ms"
        self.peak = 0
        self.before = 0

    @staticmethod
    def _rss() -> int:
        return int(psutil.Process().memory_info().rss)

    @contextlib.contextmanager
    def track(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        self.before = self.peak = self._rss()
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                self.peak = max(self.peak, self._rss())
                stop.wait(0.002)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            yield self
        finally:
            stop.set()
            th.join()
            self.peak = max(self.peak, self._rss())


def plain_cell(model, batch: int, context: int, new_tokens: int, warmup: int, loop: Repeats,
               device: torch.device, vocab: int, seed: int = 0, cache_len: int | None = None,
               prefill_chunk: int | None = None) -> dict:
    """TTFT and TPOT samples (ms) of plain decode at one (batch, context), one per repeat of `loop`,
    and every step's time. TTFT = the prompt forward and the first token; TPOT = the rest's time /
    (new_tokens - 1). cache_len / prefill_chunk: the memory plan's."""
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))  # [B, T]
    run = dict(cache_len=cache_len, prefill_chunk=prefill_chunk)
    for _ in range(warmup):
        generate(model, ids, new_tokens, **run)
    ttft, tpot, steps, cache = [], [], [], 0
    mem = PeakMemory(device)
    with mem.track():
        while loop.next():
            res = generate(model, ids, new_tokens, **run)
            n = len(res.batch_tokens[0])
            if n != new_tokens:
                raise StageError(f"latency: the engine produced {n} tokens, asked {new_tokens}")
            ttft.append(res.prefill_s * 1e3)
            tpot.append(res.decode_s / (n - 1) * 1e3)
            steps.append([x * 1e3 for x in res.step_s])
            cache = res.cache_positions
            loop.finished(lambda: {"tpot": rel_half_width(tpot, loop.confidence, loop.seed)})
    rec = loop.to_json()
    return {"ttft_ms": ttft, "tpot_ms": tpot, "step_ms": steps, "cache_positions": cache,
            "peak_memory_bytes": mem.peak, "peak_memory_kind": mem.kind, "memory_before_bytes": mem.before,
            **{key: rec[key] for key in ("repeats_done", "stopped", "settle_widths")}}


def percentiles_ci(per_repeat: list[list[float]], confidence: float, seed: int) -> dict:
    """p50/p90/p99 of the pooled samples, each with a CI that resamples whole repeats (a repeat's
    steps share its machine state)."""
    x = np.asarray(per_repeat, dtype=float)  # [R, S]: every repeat has the same number of steps
    point = np.percentile(x.ravel(), PERCENTILES)
    if x.shape[0] < 2:
        cis = [[float(p), float(p)] for p in point]
    else:
        idx = np.random.default_rng(seed).integers(0, x.shape[0], (2000, x.shape[0]))
        boot = np.percentile(x[idx].reshape(2000, -1), PERCENTILES, axis=1)  # [3, B]
        cis = [percentile_interval(b, confidence, float(p)) for b, p in zip(boot, point)]
    return {**{f"p{q}": {"value": float(p), "ci": ci} for q, p, ci in zip(PERCENTILES, point, cis)},
            "ci_unit": "repeat"}


def ratio_of_medians(a: list[float], b: list[float], confidence: float, seed: int) -> dict:
    """median(a) / median(b) with a percentile-bootstrap CI, a and b resampled independently."""
    point = float(np.median(a) / np.median(b))
    if len(a) < 2 or len(b) < 2:
        return {"value": point, "ci": [point, point], "ci_unit": "repeat (too few to resample)"}
    lo, hi = percentile_bootstrap((np.asarray(a, float), np.asarray(b, float)),
                                  lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis),
                                  confidence, seed)
    return {"value": point, "ci": clip_contain(lo, hi, point), "ci_unit": "repeat, each variant resampled"}


def plain_grid(name: str, model, lat, device: torch.device, bandwidth: dict, seed: int,
               confidence: float, *, budget=None) -> dict:
    """The latency/<variant>.json document; each cell's repeats as Repeats runs them (settled on
    TPOT; `budget`: a StageBudget or None)."""
    rule = Repeats(lat, name)  # the grid's settings, for the record
    mb = model_bytes(model)
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") \
        else model.config.vocab_size
    max_pos = context_length(model)
    grid = []
    fits = [c for c in lat.context_lengths if not (max_pos and c + lat.new_tokens > max_pos)]
    for batch in lat.batch_sizes:
        for context in sorted(set(lat.context_lengths) - set(fits)):
            grid.append({"batch": batch, "context": context,
                         "skipped": f"context + new tokens exceeds the model's {max_pos} positions"})
    plan, memory_budget = plan_loaded(model, lat, device, fits)
    for cell in plan.dropped:
        progress(f"latency: {name}: B={cell['batch']} context={cell['context']} dropped by the memory plan: "
                 f"{cell['reason']}")
        grid.append({"batch": cell["batch"], "context": cell["context"], "skipped": f"memory plan: {cell['reason']}"})
    kernels = quantized_kernels(model)
    for planned in plan.cells:
        batch, context = planned.batch, planned.context
        cell = {"batch": batch, "context": context, "cache_len": planned.cache_len,
                "prefill_chunk": planned.prefill_chunk}
        progress(f"latency: {name}: B={batch} context={context}"
                 + (f" (prefill in chunks of {planned.prefill_chunk})" if planned.prefill_chunk else ""))
        try:
            loop = Repeats(lat, f"{name} B={batch} context={context}", budget, confidence=confidence,
                           seed=seed, verbose=None)
            raw = plain_cell(model, batch, context, lat.new_tokens, lat.warmup, loop, device, vocab, seed,
                             cache_len=planned.cache_len, prefill_chunk=planned.prefill_chunk)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            grid.append({**cell, "skipped": "out of device memory (the memory plan expected it to fit)"})
            continue
        finally:
            CachedModel.release(model)  # no later cell uses this cache: each gets one of its own length
        tpot = median_ci(raw["tpot_ms"], confidence, seed)
        # Attention reads every slot of the static cache each step: the allocated length's KV bytes.
        passes = step_kv_passes(model, width=1)
        step_bytes = bytes_per_step(mb["weight_bytes"], batch, raw["cache_positions"], mb["kv_bytes_per_token"],
                                    kv_passes=passes)
        grid.append({**cell,
                     "ttft_ms": median_ci(raw["ttft_ms"], confidence, seed), "tpot_ms": tpot,
                     "ttft_percentiles": percentiles_ci([[x] for x in raw["ttft_ms"]], confidence, seed),
                     "inter_token_ms": {**percentiles_ci(raw["step_ms"], confidence, seed),
                                        "samples": raw["step_ms"]},
                     "tokens_per_s": batch * 1e3 / tpot["median"],
                     **{key: raw[key] for key in ("repeats_done", "stopped", "settle_widths", "cache_positions",
                                                  "peak_memory_bytes", "peak_memory_kind", "memory_before_bytes")},
                     "bytes_per_step": step_bytes,
                     "attention_path": attention_path(model), "kv_passes": passes,
                     **roofline(step_bytes, tpot["median"] / 1e3, bandwidth["gbps"]),
                     "run_mode": run_mode(kernels)})
    return {"variant": name, "device": str(device), "device_name": device_name(device),
            "bandwidth_gbps": bandwidth["gbps"], "bandwidth": bandwidth, "weight_bytes": mb["weight_bytes"],
            "model_bytes": mb, "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats,
            **{key: v for key, v in rule.to_json().items()
               if key in ("settle", "min_repeats", "settle_rel", "settle_rule")},
            "grid": grid, "memory_plan": {**plan.to_json(), "budget": memory_budget},
            "kernels": kernels, "attention_path": attention_path(model)}


def add_reference_ratios(grid: dict, reference: dict, confidence: float, seed: int) -> bool:
    """Give every measured cell of a non-reference grid its TPOT over the reference's (with a CI
    and `like_with_like`) and the roofline's ratio of bytes per step; whether anything was added."""
    if grid is reference or grid.get("variant") == reference.get("variant"):
        return False
    ref = {(c["batch"], c["context"]): c for c in reference["grid"] if "tpot_ms" in c}
    added = False
    for cell in grid["grid"]:
        other = ref.get((cell["batch"], cell["context"]))
        if other is None or "tpot_ms" not in cell:
            continue
        cell["tpot_ratio_vs_reference"] = {
            **ratio_of_medians(cell["tpot_ms"]["samples"], other["tpot_ms"]["samples"], confidence, seed),
            "reference": reference.get("variant"), "meaning": "this variant's TPOT / the reference's (< 1: faster)",
            **compare(cell.get("run_mode"), other.get("run_mode"), ("variant", "reference"))}
        cell["roofline_tpot_ratio_vs_reference"] = cell["bytes_per_step"] / other["bytes_per_step"]
        added = True
    return added

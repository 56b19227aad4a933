"""The latency stage: real decode time of every variant, and of every (target, draft) pair across k.

    python -m pipeline latency --run runs/smollm2-135m --config configs/default.yaml

Writes `latency/<variant>.json`: plain decode over batch sizes x context lengths, per cell TTFT and
TPOT (medians with CIs), TTFT and inter-token p50/p90/p99 from the per-step samples (kept raw),
peak memory, bytes per step and the share of the measured device bandwidth it reaches, and
`tpot_ratio_vs_reference` (this variant's TPOT / the reference's, with a CI) beside the roofline's
prediction; `latency/tpot_ratio.png` plots that against B x context. And
`latency/<variant>__<draft_slug>.json`: speculative round times on the acceptance prompts and
temperatures at k = 1..k_max, as a function of the drafted count (pipeline/latency/speculative.py).

Every figure goes through pipeline.decode.generate (the computation the acceptance stage measured)
and pipeline.decode.timing (CUDA events on GPU, a synchronized perf_counter on CPU). Warm-up runs
are not recorded; every CI is a bootstrap over `latency.repeats` repeats (the unit of
resampling), and the raw per-repeat (and per-step) samples are kept in the JSON.

Before any cell runs, a memory plan (pipeline/latency/plan.py) drops the cells that cannot fit
(one line each), picks chunked prefill where a one-shot prefill would not fit, and orders the
cells so each runs on a cache of exactly its length, freed before the next. With latency.compile
the steps run compiled (pipeline/decode/compiled.py). Each JSON records the plan, what compiled
(per shape), the quantized kernels the variant really runs and the device's name.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.core.device import resolve_device
from pipeline.models.kernels import device_name, quantized_kernels
from pipeline.latency.plan import compile_session, draft_label, plain_phase, plain_shapes
from pipeline.latency.speculative import speculative_pair
from pipeline.speculation.prompts import acceptance_prompts
from pipeline.latency.roofline import bytes_per_step, measure_bandwidth, model_bytes, roofline
from pipeline.core.stage import StageError, atomic_write_bytes, atomic_write_json, progress, read_json
from pipeline.stats.paired import median_ci, percentile_bootstrap

# The plain grid uses random ids of the exact context length: plain decode time does not depend
# on which tokens they are. Speculative timings run on the acceptance prompts (latency_spec.py).
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- measuring


class PeakMemory:
    """Peak memory during a block. CUDA: torch.cuda.max_memory_allocated (tensors only). CPU: the
    process's resident set size sampled every 2 ms by a thread (torch's CPU allocator is not
    visible to tracemalloc, and ru_maxrss cannot be reset between cells); it includes the
    interpreter and libraries, so compare cells, and read `rss_before_bytes` for the baseline."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_rss_peak_sampled_2ms"
        self.peak = 0
        self.before = 0

    @staticmethod
    def _rss() -> int:
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:  # Linux fallback: resident pages from /proc
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

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


def _random_prompt(vocab: int, batch: int, context: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, context), generator=g)  # [B, T]


def plain_cell(model, batch: int, context: int, new_tokens: int, warmup: int, repeats: int,
               device: torch.device, vocab: int, seed: int = 0, cache_len: int | None = None,
               prefill_chunk: int | None = None) -> dict:
    """TTFT and TPOT samples (ms) of plain decode at one (batch, context), one sample per repeat,
    and every step's time.

    TTFT = the prompt forward + picking the first token (engine's prefill_s; no queue here);
    TPOT = the time for the remaining tokens / (new_tokens - 1), as SEEDS.md defines it; the
    inter-token samples are those steps one by one. cache_len / prefill_chunk: the memory plan's."""
    from pipeline.decode.engine import generate

    ids = _random_prompt(vocab, batch, context, seed)
    run = dict(cache_len=cache_len, prefill_chunk=prefill_chunk)
    for _ in range(warmup):
        generate(model, ids, new_tokens, **run)
    ttft, tpot, steps, cache = [], [], [], 0
    mem = PeakMemory(device)
    with mem.track():
        for _ in range(repeats):
            res = generate(model, ids, new_tokens, **run)
            n = len(res.batch_tokens[0])
            if n != new_tokens:
                raise StageError(f"latency: the engine produced {n} tokens, asked {new_tokens}")
            ttft.append(res.prefill_s * 1e3)
            tpot.append(res.decode_s / (n - 1) * 1e3)
            steps.append([x * 1e3 for x in res.step_s])
            cache = res.cache_positions
    return {"ttft_ms": ttft, "tpot_ms": tpot, "step_ms": steps, "cache_positions": cache,
            "peak_memory_bytes": mem.peak, "peak_memory_kind": mem.kind, "memory_before_bytes": mem.before}


def percentiles_ci(per_repeat: list[list[float]], confidence: float, seed: int) -> dict:
    """p50/p90/p99 of the pooled samples, each with a CI that resamples whole repeats (a repeat's
    steps share its machine state, so the repeat is the unit). Written out because
    scipy.stats.bootstrap resamples single observations, not groups."""
    x = np.asarray(per_repeat, dtype=float)  # [R, S]: every repeat has the same number of steps
    point = np.percentile(x.ravel(), PERCENTILES)
    if x.shape[0] < 2:
        cis = [[float(p), float(p)] for p in point]
    else:
        idx = np.random.default_rng(seed).integers(0, x.shape[0], (2000, x.shape[0]))
        boot = np.percentile(x[idx].reshape(2000, -1), PERCENTILES, axis=1)  # [3, B]
        lo, hi = np.quantile(boot, [(1 - confidence) / 2, (1 + confidence) / 2], axis=1)
        cis = [[float(min(a, p)), float(max(b, p))] for a, b, p in zip(lo, hi, point)]
    return {**{f"p{q}": {"value": float(p), "ci": ci} for q, p, ci in zip(PERCENTILES, point, cis)},
            "ci_unit": "repeat"}


def ratio_of_medians(a: list[float], b: list[float], confidence: float, seed: int) -> dict:
    """median(a) / median(b) with a percentile-bootstrap CI, a and b resampled independently
    (they are different runs; their repeats are not paired)."""
    point = float(np.median(a) / np.median(b))
    if len(a) < 2 or len(b) < 2:
        return {"value": point, "ci": [point, point], "ci_unit": "repeat (too few to resample)"}
    lo, hi = percentile_bootstrap((np.asarray(a, float), np.asarray(b, float)),
                                  lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis),
                                  confidence, seed)
    return {"value": point, "ci": [min(lo, point), max(hi, point)], "ci_unit": "repeat, each variant resampled"}


# ---------------------------------------------------------------- the two artifacts


def plain_grid(name: str, model, lat, device: torch.device, bandwidth: dict, seed: int,
               confidence: float) -> dict:
    from pipeline.decode.cache import CachedModel

    mb = model_bytes(model)
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") \
        else model.config.vocab_size
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    grid = []
    fits = [c for c in lat.context_lengths if not (max_pos and c + lat.new_tokens > max_pos)]
    for batch in lat.batch_sizes:
        for context in sorted(set(lat.context_lengths) - set(fits)):
            grid.append({"batch": batch, "context": context,
                         "skipped": f"context + new tokens exceeds the model's {max_pos} positions"})
    plan, budget = plain_phase(model, lat, device, fits)
    for cell in plan.dropped:
        progress(f"latency: {name}: B={cell['batch']} context={cell['context']} dropped by the memory plan: "
                 f"{cell['reason']}")
        grid.append({"batch": cell["batch"], "context": cell["context"], "skipped": f"memory plan: {cell['reason']}"})
    session, compiled = compile_session(lat, device)
    try:
        if session is not None:
            session.attach(model, "target")
            session.expect(plain_shapes(plan.cells))
        for planned in plan.cells:
            batch, context = planned.batch, planned.context
            cell = {"batch": batch, "context": context, "cache_len": planned.cache_len,
                    "prefill_chunk": planned.prefill_chunk}
            progress(f"latency: {name}: B={batch} context={context}"
                     + (f" (prefill in chunks of {planned.prefill_chunk})" if planned.prefill_chunk else ""))
            if session is not None:  # this cell's graph compiles now, on its own cache, before any timed run
                session.warm(model, shapes=plain_shapes([planned]))
            try:
                raw = plain_cell(model, batch, context, lat.new_tokens, lat.warmup, lat.repeats, device,
                                 vocab, seed, cache_len=planned.cache_len, prefill_chunk=planned.prefill_chunk)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                grid.append({**cell, "skipped": "out of device memory (the memory plan expected it to fit)"})
                continue
            finally:
                CachedModel.release(model)  # no later cell uses this cache: each gets one of its own length
            tpot = median_ci(raw["tpot_ms"], confidence, seed)
            # Attention reads every slot of the static cache each step (pipeline/decode/cache.py),
            # so the KV bytes are the allocated length's, not the filled length's.
            step_bytes = bytes_per_step(mb["weight_bytes"], batch, raw["cache_positions"], mb["kv_bytes_per_token"])
            grid.append({**cell,
                         "ttft_ms": median_ci(raw["ttft_ms"], confidence, seed), "tpot_ms": tpot,
                         "ttft_percentiles": percentiles_ci([[x] for x in raw["ttft_ms"]], confidence, seed),
                         "inter_token_ms": {**percentiles_ci(raw["step_ms"], confidence, seed),
                                            "samples": raw["step_ms"]},
                         "tokens_per_s": batch * 1e3 / tpot["median"],
                         "cache_positions": raw["cache_positions"],
                         "peak_memory_bytes": raw["peak_memory_bytes"],
                         "peak_memory_kind": raw["peak_memory_kind"],
                         "memory_before_bytes": raw["memory_before_bytes"],
                         "bytes_per_step": step_bytes,
                         **roofline(step_bytes, tpot["median"] / 1e3, bandwidth["gbps"])})
        if session is not None:
            compiled = session.record()
    finally:
        if session is not None:
            session.close()
    return {"variant": name, "device": str(device), "device_name": device_name(device),
            "bandwidth_gbps": bandwidth["gbps"], "bandwidth": bandwidth, "weight_bytes": mb["weight_bytes"],
            "model_bytes": mb, "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats,
            "grid": grid, "memory_plan": {**plan.to_json(), "budget": budget}, "compile": compiled,
            "kernels": quantized_kernels(model)}


def add_reference_ratios(grid: dict, reference: dict, confidence: float, seed: int) -> bool:
    """Give every measured cell of a non-reference grid its TPOT over the reference's (with a
    CI) and the roofline's ratio of bytes per step, (W_q + B K_q) / (W + B K). Returns whether
    anything was added."""
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
            "reference": reference.get("variant"), "meaning": "this variant's TPOT / the reference's (< 1: faster)"}
        cell["roofline_tpot_ratio_vs_reference"] = cell["bytes_per_step"] / other["bytes_per_step"]
        added = True
    return added


def tpot_ratio_plot(grids: dict[str, dict], reference: str) -> bytes | None:
    """Speedup over the reference (reference TPOT / variant TPOT, with CIs) against B x context,
    beside the roofline's (W + B K) / (W_q + B K): the W4 speedup should fall towards 1 as B K grows."""
    series = {name: [c for c in g["grid"] if "tpot_ratio_vs_reference" in c] for name, g in grids.items()
              if name != reference}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, cells) in enumerate(sorted(series.items())):
        cells = sorted(cells, key=lambda c: (c["batch"] * c["context"], c["batch"]))
        x = [c["batch"] * c["context"] for c in cells]
        r = [c["tpot_ratio_vs_reference"] for c in cells]
        y = [1 / v["value"] for v in r]
        err = [[yi - 1 / v["ci"][1] for yi, v in zip(y, r)], [1 / v["ci"][0] - yi for yi, v in zip(y, r)]]
        line = ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=f"{name} measured")
        ax.plot(x, [1 / c["roofline_tpot_ratio_vs_reference"] for c in cells], "s--", color=line[0].get_color(),
                alpha=0.6, label=f"{name} roofline (W + BK) / (W_q + BK)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("batch x context (tokens in the KV cache)")
    ax.set_ylabel(f"speedup over {reference} (TPOT ratio)")
    ax.set_title("Decode speedup of each variant over the reference", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------- the stage


def draft_input_hash(run_dir: Path, slug: str) -> str | None:
    """The drafts stage's input hash for one draft (None before it ran): a pair's items key on it."""
    meta = run_dir / "drafts" / slug / "meta.json"
    return read_json(meta).get("input_hash") if meta.is_file() else None


def _resolve_dir(ctx, name: str, d: str | None) -> Path:
    for cand in ([ctx.run_dir / d, Path(d)] if d else []) + [ctx.run_dir / "variants" / name]:
        if (cand / "meta.json").is_file():
            return cand
    raise StageError(f"latency: variant '{name}' has no directory with a meta.json under {ctx.run_dir}")


def run(ctx) -> None:
    from pipeline.models.loading import load_variant

    cfg = ctx.config
    lat = cfg.latency
    if lat.new_tokens < 2:
        raise StageError("latency.new_tokens must be >= 2 (TPOT is undefined for one output token)")
    if lat.repeats < 1 or lat.warmup < 0:
        raise StageError("latency.repeats must be >= 1 and latency.warmup >= 0")
    device = resolve_device(cfg.device)
    confidence = lat.confidence
    k_max = lat.k_max or cfg.acceptance.k_max
    if k_max < 1:
        raise StageError(f"latency.k_max must be >= 1 (got {k_max})")
    ks = list(range(1, k_max + 1))
    listed = ctx.upstream.get("quantize", {}).get("variants") or {}
    names = list(listed) or [p.parent.name for p in sorted((ctx.run_dir / "variants").glob("*/meta.json"))]
    if not names:
        raise StageError(f"latency: no variants in {ctx.run_dir / 'variants'} (run make quantize first)")
    dirs = {n: _resolve_dir(ctx, n, (listed.get(n) or {}).get("dir")) for n in names}
    bandwidth: dict | None = None
    common = {"latency": cfg.section("latency"), "device": str(device), "seed": cfg.seed}
    ctx.meta.update(device=str(device), device_name=device_name(device),
                    compile="off" if not lat.compile else "requested; no cell ran",
                    compile_record={"plain": {}, "speculative": {}}, memory_plan={"plain": {}, "speculative": {}},
                    kernels={}, threads=torch.get_num_threads(),
                    load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)

    def bw() -> dict:
        nonlocal bandwidth
        if bandwidth is None:
            progress("latency: measuring device bandwidth (large tensor copy)")
            bandwidth = measure_bandwidth(device)
            ctx.meta["bandwidth"] = bandwidth
        return bandwidth

    for name, d in dirs.items():
        item = ctx.item(f"{name}.json", {**common, "variant": read_json(d / "meta.json").get("input_hash")
                                         or str(d)}, is_dir=False)
        if item.fresh:
            # A resumed run keeps the bandwidth its grids were measured against in meta.json.
            ctx.meta.setdefault("bandwidth", read_json(item.path).get("bandwidth"))
            continue
        model, _ = load_variant(d, device=device)
        doc = plain_grid(name, model, lat, device, bw(), cfg.seed, confidence)
        _record(ctx.meta, "plain", name, doc)
        item.write_json(doc)
        del model
    reference = cfg.quantize.reference
    if reference in dirs:
        grids = {name: read_json(ctx.out_dir / f"{name}.json", "latency grid") for name in dirs}
        for name, grid in grids.items():  # a cheap join, redone on every run: never stale
            if add_reference_ratios(grid, grids[reference], confidence, cfg.seed):
                atomic_write_json(ctx.out_dir / f"{name}.json", grid)
        png = tpot_ratio_plot(grids, reference)
        if png:
            atomic_write_bytes(ctx.out_dir / "tpot_ratio.png", png)

    from draft_models import build_draft, draft_slug

    targets = cfg.acceptance.targets or [cfg.quantize.reference]
    # Round times are measured on the acceptance stage's prompts and temperatures.
    acc_inputs = {key: cfg.section("acceptance")[key] for key in ("temperatures", "sampling", "prompts_per_kind")}
    for target in targets:
        if target not in dirs:
            raise StageError(f"latency: target '{target}' is not a variant ({', '.join(dirs)})")
        target_hash = read_json(dirs[target] / "meta.json").get("input_hash") or target
        pending = {}
        for spec in cfg.drafts:
            slug = draft_slug(spec)
            inputs = {**common, "target": target_hash, "draft": spec, "ks": ks, "acceptance": acc_inputs,
                      "draft_meta": draft_input_hash(ctx.run_dir, slug)}
            item = ctx.item(f"{target}__{slug}.json", inputs, is_dir=False)
            if not item.fresh:
                pending[spec] = item
        if not pending:
            continue
        model, tok = load_variant(dirs[target], device=device)
        prompts = acceptance_prompts(lat.speculative_prompts_per_kind or cfg.acceptance.prompts_per_kind, tok,
                                     "latency")
        drafts = {spec: build_draft(spec, model, tok, ctx.run_dir, device) for spec in pending}
        session, _ = compile_session(lat, device)
        if session is not None:
            session.attach(model, "target")
            for spec, d in drafts.items():
                if getattr(d, "model", None) is not None:
                    session.attach(d.model, draft_label(spec))
        try:
            for spec, item in pending.items():
                t0 = time.time()
                doc = speculative_pair(target, spec, model, drafts[spec], prompts, lat, cfg.acceptance,
                                       device, confidence, cfg.seed, ks, session=session)
                _record(ctx.meta, "speculative", f"{target}__{draft_slug(spec)}", doc)
                item.write_json(doc)
                progress(f"latency: {target}__{draft_slug(spec)} done in {time.time() - t0:.0f} s")
        finally:
            if session is not None:
                session.close()
        del model, drafts

    # Speculation under batching: (B, k) cells and the closed loop (pipeline/latency/batched.py).
    from pipeline.latency.batched import run_batched

    run_batched(ctx, dirs, ks, device, confidence)

def _record(meta: dict, phase: str, name: str, doc: dict) -> None:
    """What ran, into the stage's meta.json: the plan, the compile record, the kernels. `compile`
    stays a one-word summary (its old meaning); the per-shape detail is in `compile_record`."""
    meta["memory_plan"][phase][name] = doc["memory_plan"]
    meta["compile_record"][phase][name] = doc["compile"]
    runs = {r["ran"] for p in meta["compile_record"].values() for r in p.values() if r.get("requested")}
    if runs:
        meta["compile"] = runs.pop() if len(runs) == 1 else "mixed: " + ", ".join(sorted(runs))
    if phase == "plain":
        meta["kernels"][name] = doc["kernels"]

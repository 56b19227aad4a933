"""The latency stage: real decode time of every variant, and of every (target, draft) pair across k.

    python -m pipeline latency --run runs/smollm2-135m --config configs/default.yaml

Writes `latency/<variant>.json` (plain decode over batch sizes x context lengths: TTFT, TPOT, peak
memory, bytes per step and the share of the device's measured bandwidth it reaches) and
`latency/<variant>__<draft_slug>.json` (speculative decode at k = 1..k_max, B = 1: draft, verify,
overhead and round time, tokens/s, and the speedup over plain decode of the same target, timed in
the same repeats so the ratio is paired).

Every figure goes through pipeline.decode.generate (the computation the acceptance stage measured)
and pipeline.decode.timing (CUDA events on GPU, a synchronized perf_counter on CPU). Warm-up runs are not
recorded; every figure is the median over `latency.repeats` repeats with a bootstrap CI over those
repeats, and the raw per-repeat samples are kept in the JSON.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import torch

from pipeline.device import resolve_device
from pipeline.roofline import bytes_per_step, measure_bandwidth, model_bytes, roofline
from pipeline.stage import StageError, progress, read_json
from pipeline.stats import median_ci

# Speculative timings need text a draft can predict some of (acceptance depends on content, and
# tokens/round feeds the measured ms/token), so they run on these; the plain grid uses random ids
# of the exact context length, since plain decode time does not depend on which tokens they are.
PROMPTS = [
    "Explain in a few sentences why the sky is blue, for a ten-year-old.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
]


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
               device: torch.device, vocab: int, seed: int = 0) -> dict:
    """TTFT and TPOT samples (ms) of plain decode at one (batch, context), one sample per repeat.

    TTFT = the prompt forward + picking the first token (engine's prefill_s; no queue here);
    TPOT = the time for the remaining tokens / (new_tokens - 1), as SEEDS.md defines it."""
    from pipeline.decode import generate

    ids = _random_prompt(vocab, batch, context, seed)
    for _ in range(warmup):
        generate(model, ids, new_tokens)
    ttft, tpot = [], []
    mem = PeakMemory(device)
    with mem.track():
        for _ in range(repeats):
            res = generate(model, ids, new_tokens)
            n = len(res.batch_tokens[0])
            if n != new_tokens:
                raise StageError(f"latency: the engine produced {n} tokens, asked {new_tokens}")
            ttft.append(res.prefill_s * 1e3)
            tpot.append(res.decode_s / (n - 1) * 1e3)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "peak_memory_bytes": mem.peak,
            "peak_memory_kind": mem.kind, "memory_before_bytes": mem.before}


def speculative_repeat(model, draft, prompts: list[torch.Tensor], ks: list[int], new_tokens: int) -> dict:
    """One repeat: plain decode and speculative decode at every k on the same prompts, so each
    repeat yields one paired sample of every figure. Returns k -> figures (k = 0 is plain).

    ms/token is end to end over the decode (every token after the first, which prefill made).
    The per-round figures use the rounds that really drafted k tokens: near max_new_tokens the
    engine shortens the last round, and averaging it in would make T_round(k) look cheaper."""
    from pipeline.decode import generate

    out = {}
    for k in [0, *ks]:
        tokens, decode_s, rounds = 0, 0.0, []
        for ids in prompts:
            res = generate(model, ids, new_tokens, draft=draft if k else None, k=k)
            tokens += len(res.tokens) - 1
            decode_s += res.decode_s
            rounds += res.rounds
        fig = {"ms_per_token": decode_s / max(tokens, 1) * 1e3}
        if k:
            full = [r for r in rounds if r.k == k] or rounds  # all shortened: new_tokens <= k + 1
            n = len(full)
            draft_s, verify_s = sum(r.draft_s for r in full), sum(r.verify_s for r in full)
            round_s = sum(r.round_s for r in full)
            fig.update(draft_ms=draft_s / n * 1e3, verify_ms=verify_s / n * 1e3, round_ms=round_s / n * 1e3,
                       overhead_ms=(round_s - draft_s - verify_s) / n * 1e3,
                       tokens_per_round=sum(r.emitted for r in full) / n, rounds_at_k=n,
                       rounds=len(rounds))
        out[k] = fig
    return out


# ---------------------------------------------------------------- the two artifacts


def plain_grid(name: str, model, lat, device: torch.device, bandwidth: dict, seed: int,
               confidence: float) -> dict:
    mb = model_bytes(model)
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") \
        else model.config.vocab_size
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    grid = []
    for batch in lat.batch_sizes:
        for context in lat.context_lengths:
            cell = {"batch": batch, "context": context}
            if max_pos and context + lat.new_tokens > max_pos:
                grid.append({**cell, "skipped": f"context + new tokens exceeds the model's {max_pos} positions"})
                continue
            progress(f"latency: {name}: B={batch} context={context}")
            try:
                raw = plain_cell(model, batch, context, lat.new_tokens, lat.warmup, lat.repeats, device,
                                 vocab, seed)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                grid.append({**cell, "skipped": "out of device memory"})
                continue
            tpot = median_ci(raw["tpot_ms"], confidence, seed)
            # Mean cache length over the decode steps: context + (new_tokens) / 2.
            step_bytes = bytes_per_step(mb["weight_bytes"], batch, context + lat.new_tokens / 2,
                                        mb["kv_bytes_per_token"])
            grid.append({**cell,
                         "ttft_ms": median_ci(raw["ttft_ms"], confidence, seed), "tpot_ms": tpot,
                         "tokens_per_s": batch * 1e3 / tpot["median"],
                         "peak_memory_bytes": raw["peak_memory_bytes"],
                         "peak_memory_kind": raw["peak_memory_kind"],
                         "memory_before_bytes": raw["memory_before_bytes"],
                         "bytes_per_step": step_bytes,
                         **roofline(step_bytes, tpot["median"] / 1e3, bandwidth["gbps"])})
    return {"variant": name, "device": str(device), "bandwidth_gbps": bandwidth["gbps"],
            "bandwidth": bandwidth, "weight_bytes": mb["weight_bytes"], "model_bytes": mb,
            "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats, "grid": grid}


def speculative_pair(target: str, draft_spec: str, model, draft, tokenizer, ks: list[int], lat,
                     device: torch.device, confidence: float, seed: int,
                     texts: list[str] = PROMPTS) -> dict:
    prompts = [encode_prompt(tokenizer, p) for p in texts]
    for _ in range(lat.warmup):
        speculative_repeat(model, draft, prompts, ks, lat.new_tokens)
    reps = []
    for r in range(lat.repeats):
        progress(f"latency: {target} + {draft_spec}: repeat {r + 1}/{lat.repeats}")
        reps.append(speculative_repeat(model, draft, prompts, ks, lat.new_tokens))
    plain = [rep[0]["ms_per_token"] for rep in reps]
    rows = []
    for k in ks:
        col = {key: [rep[k][key] for rep in reps] for key in reps[0][k]}
        ms = median_ci(col["ms_per_token"], confidence, seed)
        rows.append({
            "k": k,
            **{key: median_ci(col[key], confidence, seed)
               for key in ("draft_ms", "verify_ms", "overhead_ms", "round_ms")},
            "tokens_per_round": float(sum(col["tokens_per_round"]) / len(col["tokens_per_round"])),
            "rounds_at_k": int(sum(col["rounds_at_k"])), "rounds": int(sum(col["rounds"])),
            "ms_per_token": ms,
            "tokens_per_s": 1e3 / ms["median"],
            # Paired: plain and speculative of the same repeat, so drift between repeats cancels.
            "speedup": median_ci([p / s for p, s in zip(plain, col["ms_per_token"])], confidence, seed),
        })
    return {"variant": target, "draft": draft_spec, "device": str(device),
            "plain_ms_per_token": median_ci(plain, confidence, seed),
            "prompts": list(texts), "new_tokens": lat.new_tokens, "warmup": lat.warmup,
            "repeats": lat.repeats, "rows": rows}


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    """A chat prompt as the model would see it: [1, T]."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


# ---------------------------------------------------------------- the stage


def _resolve_dir(ctx, name: str, d: str | None) -> Path:
    for cand in ([ctx.run_dir / d, Path(d)] if d else []) + [ctx.run_dir / "variants" / name]:
        if (cand / "meta.json").is_file():
            return cand
    raise StageError(f"latency: variant '{name}' has no directory with a meta.json under {ctx.run_dir}")


def _maybe_compile(models: list, lat, device: torch.device) -> str:
    """The GPU fast path: the same engine and static cache, each model's forward compiled with
    CUDA graphs ("reduce-overhead"); each new shape (prefill length, verify width k+1) compiles
    once during the warm-up runs, which are not recorded. CPU ignores the switch.

    Call it after the drafts are built: a layerskip draft is a shallow copy of the target, and a
    copy made after compiling would inherit the target's compiled forward."""
    if not lat.compile:
        return "off"
    if device.type != "cuda":
        return "requested, ignored on CPU (eager)"
    from pipeline.decode import hf_model

    for m in models:
        hf = hf_model(m)  # the module the engine calls (inside any quantization wrapper)
        if "forward" not in hf.__dict__:
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", dynamic=False)
    return "torch.compile(mode=reduce-overhead): static cache + CUDA graphs"


def run(ctx) -> None:
    from pipeline.models import load_variant

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
    ctx.meta.update(device=str(device), compile=_maybe_compile([], lat, device), threads=torch.get_num_threads(),
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
        ctx.meta["compile"] = _maybe_compile([model], lat, device)
        item.write_json(plain_grid(name, model, lat, device, bw(), cfg.seed, confidence))
        del model

    from draft_models import build_draft, draft_slug

    targets = cfg.acceptance.targets or [cfg.quantize.reference]
    for target in targets:
        if target not in dirs:
            raise StageError(f"latency: target '{target}' is not a variant ({', '.join(dirs)})")
        target_hash = read_json(dirs[target] / "meta.json").get("input_hash") or target
        pending = {}
        for spec in cfg.drafts:
            slug = draft_slug(spec)
            draft_meta = ctx.run_dir / "drafts" / slug / "meta.json"
            inputs = {**common, "target": target_hash, "draft": spec, "ks": ks,
                      "draft_meta": read_json(draft_meta).get("input_hash") if draft_meta.is_file() else None}
            item = ctx.item(f"{target}__{slug}.json", inputs, is_dir=False)
            if not item.fresh:
                pending[spec] = item
        if not pending:
            continue
        model, tok = load_variant(dirs[target], device=device)
        drafts = {spec: build_draft(spec, model, tok, ctx.run_dir, device) for spec in pending}
        ctx.meta["compile"] = _maybe_compile(
            [model, *(d.model for d in drafts.values() if getattr(d, "model", None) is not None)], lat, device)
        for spec, item in pending.items():
            t0 = time.time()
            item.write_json(speculative_pair(target, spec, model, drafts[spec], tok, ks, lat, device,
                                             confidence, cfg.seed, texts=PROMPTS))
            progress(f"latency: {target}__{draft_slug(spec)} done in {time.time() - t0:.0f} s")
        del model, drafts

    # Speculation under batching: (B, k) cells and the closed loop (pipeline/batch_latency.py).
    from pipeline.batch_latency import run_batched

    run_batched(ctx, dirs, ks, device, confidence)

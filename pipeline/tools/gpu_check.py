"""One prepared check of the GPU path, for a machine with one GPU, no network and a few minutes.

    make gpu-check OUT=runs/gpu-check                  # PYTHONPATH=. <python> -m pipeline.tools.gpu_check OUT
    PYTHONPATH=. python3 -m pipeline.tools.gpu_check OUTDIR [--shape 8b|tiny] [--budget-s 420] [--ks 1,2,3,4,5,6]

On a random-weight model of Llama-3-8B's shape it measures, every step eager (the engine's own
timing, one warm-up run per cell, medians of `repeats`), copy bandwidth, plain decode against its
bandwidth roofline, speculative rounds with a layer-skip draft (and whether greedy output stays the
target's) and the greedy check in float32, skipping any part the time budget would not cover. It
imports only torch, transformers and the decode core, so it runs on a bare image's python; a driver
too old for torch's CUDA ends it in one line, exit 2. OUTDIR/gpu_check.json and .md are rewritten
after every part (docs/methods/gpu-box.md#make-gpu-check).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from draft_models.layerskip import truncate
# core.stage is standard library only, so the bare image (torch and transformers) imports it.
from pipeline.core.device import driver_version, resolve_device
from pipeline.core.stage import StageError, atomic_write_text, progress
from pipeline.decode.attention import attention_path
from pipeline.decode.cache import CachedModel
from pipeline.decode.drafts import ModelDraft
from pipeline.decode.engine import generate
from pipeline.latency.memory import ModelShape, cache_len, device_budget, plan_grid
from pipeline.latency.roofline import bytes_per_step, measure_bandwidth, model_bytes, roofline, step_kv_passes
from pipeline.models.kernels import device_name
from pipeline.report.document import to_markdown

# Model shapes (transformers LlamaConfig fields) and each shape's default run settings.
SHAPES = {
    # Llama-3-8B / 3.1-8B (from its published config.json; rope settings do not change latency).
    "8b": {"config": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          tie_word_embeddings=False),
           "run": dict(batches=[1, 8], context=512, new_tokens=64, ks=[1, 2, 3, 4, 5, 6],
                       draft_layers=8, repeats=3)},
    # The same parts at CPU-test size (tests/test_gpu_check.py).
    "tiny": {"config": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            tie_word_embeddings=False),
             "run": dict(batches=[1, 2], context=24, new_tokens=12, ks=[1, 2, 3],
                         draft_layers=1, repeats=2)},
}

# bf16 keeps 8 significant bits; after a deep forward two logits within ~2% of the top logit's
# magnitude can swap order between two forward shapes (a 1-token step vs a k+1-token verify).
NEAR_TIE_RELATIVE = 0.02


class Check:
    """The document being built, the clock, and the rule that skips a part rather than overrun."""

    def __init__(self, out_dir: Path, budget_s: float, argv: list[str]):
        self.out_dir, self.budget_s, self.t0 = out_dir, budget_s, time.perf_counter()
        self.slowest_step_s = 0.0  # for estimating what the next part costs
        self.doc: dict = {"argv": argv, "budget_s": budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                          "parts": {}, "skipped": [], "notes": [], "errors": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step_s(self, device: torch.device) -> float:
        """A pessimistic per-step time for the budget: the slowest step measured so far, else a guess."""
        return self.slowest_step_s or (0.08 if device.type == "cuda" else 0.02)

    def fits(self, part: str, estimate_s: float) -> bool:
        left = self.budget_s - self.elapsed()
        if estimate_s <= left:
            return True
        why = f"needs about {estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left"
        self.doc["skipped"].append({"part": part, "why": why})
        progress(f"gpu-check: skipped {part}: {why}")
        self.save()
        return False

    @contextlib.contextmanager
    def guard(self, part: str):
        """A part that fails is recorded (error and the last traceback lines) and the next part
        runs: one run on a borrowed machine should bring back everything that worked."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded, reported, and the exit status says so
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            self.doc["errors"].append({"part": part, "error": f"{type(e).__name__}: {str(e)[:500]}",
                                       "traceback": traceback.format_exc().splitlines()[-12:]})
            progress(f"gpu-check: {part} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            self.save()

    def save(self, line: str | None = None) -> None:
        if line:
            progress(f"gpu-check: {line}")
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        atomic_write_text(self.out_dir / "gpu_check.json", json.dumps(self.doc, indent=1, default=str) + "\n")
        atomic_write_text(self.out_dir / "gpu_check.md", render_markdown(self.doc))


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A random Llama of `shape` built on `device` in `dtype`: N(0, 1/fan_in) linears, an LM head 4x
    that scale so next-token distributions are peaked like a trained model's (flat logits tie)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]["config"]), dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            else:
                scale = 4.0 if name.endswith("lm_head.weight") else 1.0
                p.normal_(0.0, scale / p.shape[1] ** 0.5, generator=gen)
    return model.eval()


def prompt(vocab: int, batch: int, context: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))  # [B, T]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


@torch.inference_mode()
def compare_greedy(model, ids: torch.Tensor, reference: list[int], tokens: list[int]) -> dict:
    """Equal, or where the outputs first differ and the target's logit gap between the two tokens
    there (one uncached forward over the prompt and the reference up to that point)."""
    if tokens == reference:
        return {"equal": True}
    n = min(len(tokens), len(reference))
    i = next((j for j in range(n) if tokens[j] != reference[j]), n)
    out = {"equal": False, "first_divergence": i}
    if i == n:
        return {**out, "note": f"lengths differ ({len(tokens)} vs {len(reference)})"}
    device = next(model.parameters()).device
    seq = torch.cat([ids[0].to(device), torch.tensor(reference[:i], dtype=torch.long, device=device)])
    logits = model(input_ids=seq.unsqueeze(0), logits_to_keep=1).logits[0, -1].float()
    gap, top = float(logits[reference[i]] - logits[tokens[i]]), float(logits.max())
    return {**out, "reference_token": reference[i], "token": tokens[i], "logit_gap": gap, "top_logit": top,
            "near_tie": abs(gap) <= NEAR_TIE_RELATIVE * max(1.0, abs(top))}


def release(*models) -> None:
    for m in models:
        CachedModel.release(m)


def plain_part(check: Check, model, cells, args, gbps) -> None:
    """TTFT and TPOT of plain decode per planned cell, bytes per step and % of the roofline."""
    device = next(model.parameters()).device
    mb = model_bytes(model)
    part = check.doc["parts"].setdefault("plain", {"cells": []})
    for cell in cells:
        steps = (1 + args.repeats) * args.new_tokens * max(1.0, cell.batch / 8)
        if not check.fits(f"plain B={cell.batch}", steps * check.step_s(device)):
            continue
        ids = prompt(model.config.vocab_size, cell.batch, cell.context, args.seed)
        run = dict(cache_len=cell.cache_len, prefill_chunk=cell.prefill_chunk)
        t0 = time.perf_counter()
        generate(model, ids, args.new_tokens, **run)
        warm_s = time.perf_counter() - t0
        ttft, tpot = [], []
        for _ in range(args.repeats):
            res = generate(model, ids, args.new_tokens, **run)
            ttft.append(res.prefill_s * 1e3)
            tpot.append(res.decode_s / (len(res.batch_tokens[0]) - 1) * 1e3)
        release(model)
        check.slowest_step_s = max(check.slowest_step_s, max(tpot) / 1e3)
        passes = step_kv_passes(model, width=1)
        step = bytes_per_step(mb["weight_bytes"], cell.batch, cell.context + args.new_tokens / 2,
                              mb["kv_bytes_per_token"], kv_passes=passes)
        row = {"batch": cell.batch, "context": cell.context, "cache_len": cell.cache_len,
               "prefill_chunk": cell.prefill_chunk, "ttft_ms": summary(ttft), "tpot_ms": summary(tpot),
               "tokens_per_s": cell.batch * 1e3 / statistics.median(tpot), "bytes_per_step": step,
               "attention_path": attention_path(model), "kv_passes": passes, "warmup_s": round(warm_s, 3),
               "tokens": res.batch_tokens[0], **(roofline(step, statistics.median(tpot) / 1e3, gbps) if gbps else {})}
        part["cells"].append(row)
        check.save(f"plain B={cell.batch}: TPOT {statistics.median(tpot):.2f} ms"
                   + (f", {100 * row['roofline_fraction']:.3g}% of the bandwidth roofline" if gbps else ""))


def speculative_part(check: Check, model, draft, args, reference) -> None:
    """Round time (draft + verify + overhead), tokens per round and ms/token at each k, B = 1 on
    the plain B = 1 cell's prompt, and whether the greedy output equals plain greedy."""
    device = next(model.parameters()).device
    ids = prompt(model.config.vocab_size, 1, args.context, args.seed)
    length = cache_len(args.context, args.new_tokens)
    part = check.doc["parts"].setdefault("speculative", {"draft": draft.spec, "cache_len": length, "rows": []})
    for k in args.ks:
        steps = (1 + args.repeats) * args.new_tokens * (1 + k * args.draft_layers / model.config.num_hidden_layers)
        if not check.fits(f"speculative k={k}", steps * check.step_s(device)):
            continue
        if reference is None:  # the plain B = 1 cell did not run: plain greedy output made here
            reference = generate(model, ids, args.new_tokens, cache_len=length).tokens
        t0 = time.perf_counter()
        generate(model, ids, min(args.new_tokens, 2 * k + 4), draft=draft, k=k, cache_len=length)
        warm_s = time.perf_counter() - t0
        fig: dict[str, list[float]] = {n: [] for n in ("round_ms", "draft_ms", "verify_ms", "ms_per_token",
                                                       "tokens_per_round")}
        for _ in range(args.repeats):
            res = generate(model, ids, args.new_tokens, draft=draft, k=k, cache_len=length)
            full = [r for r in res.rounds if r.k == k] or res.rounds  # the last rounds may be cut short
            for name in ("round", "draft", "verify"):
                fig[f"{name}_ms"].append(sum(getattr(r, f"{name}_s") for r in full) / len(full) * 1e3)
            fig["tokens_per_round"].append(sum(r.emitted for r in full) / len(full))
            fig["ms_per_token"].append(res.decode_s / (len(res.tokens) - 1) * 1e3)
        check.slowest_step_s = max(check.slowest_step_s, max(fig["round_ms"]) / 1e3)
        row = {"k": k, **{name: summary(v) for name, v in fig.items()}, "warmup_s": round(warm_s, 3),
               "greedy": compare_greedy(model, ids, reference, res.tokens)}
        part["rows"].append(row)
        check.save(f"speculative k={k}: round {row['round_ms']['median']:.2f} ms, "
                   f"{row['tokens_per_round']['median']:.2f} tokens/round, greedy "
                   + ("== plain" if row["greedy"]["equal"] else f"differs at {row['greedy']['first_divergence']}"))
    release(model, draft.model)


def fp32_part(check: Check, model, draft, args) -> None:
    """Greedy speculative == plain greedy again with the model in float32, where it must be exact."""
    new = min(args.new_tokens, 32)
    ks = sorted({args.ks[0], args.ks[-1]})
    if not check.fits("greedy float32", 20 + (1 + len(ks)) * new * check.step_s(model.device) * 2):
        return
    release(model, draft.model)
    model.float()  # the draft shares the target's modules, so it converts too
    ids = prompt(model.config.vocab_size, 1, args.context, args.seed)
    length = cache_len(args.context, new)
    reference = generate(model, ids, new, cache_len=length).tokens
    rows = [{"k": k, **compare_greedy(model, ids, reference, generate(model, ids, new, draft=draft, k=k,
                                                                      cache_len=length).tokens)} for k in ks]
    release(model, draft.model)
    ok = all(r["equal"] for r in rows)
    check.doc["parts"]["greedy_float32"] = {"new_tokens": new, "rows": rows, "all_equal": ok}
    check.save(f"float32 greedy: speculative == plain for k in {ks}: {ok}")


def _ms(d: dict | None) -> str:
    return "-" if not d else f"{d['median']:.2f}"


def _greedy(g: dict) -> str:
    if g["equal"]:
        return "greedy == plain"
    if "logit_gap" not in g:
        return f"greedy differs ({g.get('note', '')})"
    return (f"greedy differs at token {g['first_divergence']} (logit gap {g['logit_gap']:.3g}, top "
            f"{g['top_logit']:.3g}: {'near-tie' if g['near_tie'] else 'NOT a near-tie'})")


def render_markdown(doc: dict) -> str:
    env, parts, settings = doc.get("environment", {}), doc["parts"], doc.get("settings", {})
    rows = []
    bw = parts.get("bandwidth")
    if bw:
        rows.append(["bandwidth", f"copy {bw['bytes_per_copy'] / 2 ** 21:.0f} MiB", f"{bw['gbps']:.1f} GB/s",
                     "tensor copy, read + write"])
    cells = parts.get("plain", {}).get("cells", [])
    for c in cells:
        roof = f", {100 * c['roofline_fraction']:.3g}% of roofline" if c.get("roofline_fraction") else ""
        rows.append(["plain decode", f"B={c['batch']}, context {c['context']}", f"TPOT {_ms(c['tpot_ms'])}{roof}",
                     f"TTFT {_ms(c['ttft_ms'])}"])
    spec = parts.get("speculative", {})
    base = next((c for c in cells if c["batch"] == 1), None)
    for r in spec.get("rows", []):
        cost = f"; verify / plain step {r['verify_ms']['median'] / base['tpot_ms']['median']:.2f}" if base else ""
        rows.append([f"speculative ({spec.get('draft')})", f"k={r['k']}",
                     f"round {_ms(r['round_ms'])} (draft {_ms(r['draft_ms'])}, verify {_ms(r['verify_ms'])}), "
                     f"{r['tokens_per_round']['median']:.2f} tokens/round, {_ms(r['ms_per_token'])} ms/token",
                     _greedy(r["greedy"]) + cost])
    g32 = parts.get("greedy_float32")
    if g32:
        rows.append(["greedy float32", f"k={', '.join(str(r['k']) for r in g32['rows'])}",
                     "all equal" if g32["all_equal"] else "DIFFER",
                     "; ".join(_greedy(r) for r in g32["rows"] if not r["equal"])])
    notes = []
    plan = doc.get("memory_plan")
    if plan:
        run = [st for st in plan["steps"] if st["action"] == "run"]
        notes.append(f"- memory plan: {len(run)} cells against {plan['budget_bytes'] / 1e9:.1f} GB free after the "
                     f"weights ({len(plan['dropped'])} dropped); prefill chunks: "
                     f"{', '.join(str(c['prefill_chunk']) for c in run if c['prefill_chunk']) or 'none'}")
    notes += [f"- FAILED {e['part']}: {e['error']}" for e in doc["errors"]]
    notes += [f"- skipped {s['part']}: {s['why']}" for s in doc["skipped"]] + [f"- {n}" for n in doc["notes"]]
    intro = (f"python {env.get('python')} ({env.get('python_executable')}), torch {env.get('torch')} (CUDA "
             f"{env.get('torch_cuda')}), transformers {env.get('transformers')}, {settings.get('dtype')}, "
             f"context {settings.get('context')}, {settings.get('new_tokens')} new tokens, "
             f"{settings.get('repeats')} repeats; {doc.get('elapsed_s', 0):.0f} s of a {doc['budget_s']:.0f} s "
             f"budget{'' if doc.get('finished') else ' (not finished)'}. Times are medians (ms).")
    return to_markdown(f"gpu-check: {settings.get('shape', '?')} shape on {env.get('device_name', '?')}",
                       [("p", intro), ("table", ["part", "cell", "measured", "note"], rows, None)]
                       + ([("p", "\n".join(notes))] if notes else []))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments; the run settings (batches, context, new tokens, draft layers, repeats) are the shape's."""
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip parts rather than run past this")
    p.add_argument("--ks", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=None,
                   help="draft lengths timed (8b: 1..6)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="copy size (default 1024 CUDA, 256 CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vars(args).update({**SHAPES[args.shape]["run"], **({"ks": args.ks} if args.ks else {})})
    if min(args.ks) < 1:
        p.error("--ks: every k must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    check = Check(args.out_dir, args.budget_s, argv)
    import transformers

    # What it runs with, first: `make gpu-check` takes .venv's python only when its install finished.
    env = check.doc["environment"] = {
        "python": platform.python_version(), "python_executable": sys.executable, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "transformers": transformers.__version__, "nvidia_driver": driver_version()}
    progress(f"gpu-check: python {env['python']} ({env['python_executable']}), torch {env['torch']} "
             f"(CUDA {env['torch_cuda'] or 'none: a CPU build'}), transformers {env['transformers']}"
             f"{', NVIDIA driver ' + env['nvidia_driver'] if env['nvidia_driver'] else ''}")
    try:  # a driver too old for this torch's CUDA stops here, rather than run the 8B shape on the CPU
        device = resolve_device(args.device)
    except StageError as e:
        check.doc["errors"].append({"part": "device", "error": str(e)})
        check.save(str(e))
        return 2
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    env.update(device=str(device), device_name=device_name(device), cpus=os.cpu_count(),
               threads=torch.get_num_threads())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                   memory_bytes=int(props.total_memory))
    check.doc["settings"] = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                             "dtype": str(dtype).removeprefix("torch.")}
    progress(f"gpu-check: {args.shape} shape on {env['device_name']} ({dtype}), "
             f"budget {args.budget_s:.0f} s, writing {args.out_dir}")

    t = time.perf_counter()
    model = build_model(args.shape, device, dtype, args.seed)
    mb = model_bytes(model)
    check.doc["model"] = {"shape": args.shape, "config": SHAPES[args.shape]["config"],
                          "build_s": time.perf_counter() - t,
                          "parameters": sum(p.numel() for p in model.parameters()), **mb}
    check.save(f"model built in {check.doc['model']['build_s']:.1f} s "
               f"({mb['all_weight_bytes'] / 1e9:.2f} GB of weights)")

    if check.fits("bandwidth", 15):
        with check.guard("bandwidth"):
            size = (args.bandwidth_mib << 20) if args.bandwidth_mib else None
            bw = check.doc["parts"]["bandwidth"] = measure_bandwidth(device, size_bytes=size)
            check.save(f"copy bandwidth {bw['gbps']:.1f} GB/s")
    gbps = (check.doc["parts"].get("bandwidth") or {}).get("gbps")

    # Memory plan of the check's own cells, before any runs (pipeline.latency.memory).
    shape = ModelShape.from_model(model, mb["all_weight_bytes"])
    budget = device_budget(device, weights_loaded=True, weight_bytes=mb["all_weight_bytes"])
    plan = plan_grid(shape, args.batches, [args.context], args.new_tokens, budget["budget_bytes"], device.type,
                     verify_width=max(args.ks) + 1)
    check.doc["memory_plan"] = {**plan.to_json(), "budget": budget}
    check.doc["notes"] += [f"B={d['batch']} dropped by the memory plan: {d['reason']}" for d in plan.dropped]

    draft = ModelDraft(f"layerskip:{args.draft_layers}", truncate(model, args.draft_layers),
                       vocab_size=model.config.vocab_size)  # the target's first layers, norm and head, shared
    with check.guard("plain"):
        plain_part(check, model, plan.cells, args, gbps)
    cells = check.doc["parts"].get("plain", {}).get("cells", [])
    # Plain greedy output of the B = 1 cell: what every speculative run must reproduce.
    reference = next((c["tokens"] for c in cells if c["batch"] == 1), None)
    with check.guard("speculative"):
        speculative_part(check, model, draft, args, reference)
    if dtype != torch.float32:
        with check.guard("greedy float32"):
            fp32_part(check, model, draft, args)
    else:
        check.doc["notes"].append("the run is float32 already: its greedy checks are the exact ones")
    check.doc["finished"] = True
    check.save()
    times = [round(c["tpot_ms"]["median"], 2) for c in cells]
    progress(f"gpu-check: done in {check.elapsed():.0f} s; plain TPOT ms {times}; {args.out_dir / 'gpu_check.md'}"
             + (f"; {len(check.doc['errors'])} parts FAILED" if check.doc["errors"] else ""))
    return 1 if check.doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""One prepared check of the GPU path, for a machine with one GPU, no network and a few minutes.

    make gpu-check OUT=runs/gpu-check                  # PYTHONPATH=. <python> -m pipeline.tools.gpu_check OUT
    PYTHONPATH=. python3 -m pipeline.tools.gpu_check OUTDIR [--shape 8b|tiny] [--budget-s 420] [--ks 1,2,3,4,5,6]

On a random-weight model of Llama-3-8B's shape it measures, every step eager, copy bandwidth, plain
decode against its bandwidth roofline, speculative rounds with a layer-skip draft (and whether greedy
output stays the target's) and the greedy check in float32, skipping any part the time budget would
not cover (speculation as served, with CUDA graphs, is vLLM's: the vllm stage). It imports only
torch, transformers and the decode core, so it runs on a bare image's python; a driver too old for
torch's CUDA ends it in one line, exit 2. OUTDIR/gpu_check.json and .md are rewritten after every
part (docs/methods/gpu-box.md#make-gpu-check).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

# core.stage is standard library only, so the bare image (torch and transformers) imports it.
from pipeline.core.device import driver_version, resolve_device
from pipeline.core.stage import StageError, atomic_write_text, progress
from pipeline.latency.memory import ModelShape, device_budget, plan_grid
from pipeline.latency.roofline import measure_bandwidth, model_bytes
from pipeline.models.kernels import device_name
from pipeline.tools.gpu_check_parts import (SHAPES, build_model, fp32_part, make_draft, plain_part, render_markdown,
                                            speculative_part)


class Check:
    """The document being built, the clock, and the rule that skips a part rather than overrun."""

    def __init__(self, out_dir: Path, budget_s: float, argv: list[str]):
        self.out_dir = out_dir
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.slowest_step_s = 0.0  # for estimating what the next part costs
        self.doc: dict = {"argv": argv, "budget_s": budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                          "parts": {}, "skipped": [], "notes": [], "errors": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, part: str, estimate_s: float) -> bool:
        left = self.budget_s - self.elapsed()
        if estimate_s <= left:
            return True
        self.skip(part, f"needs about {estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left")
        return False

    def skip(self, part: str, why: str) -> None:
        self.doc["skipped"].append({"part": part, "why": why})
        progress(f"gpu-check: skipped {part}: {why}")
        self.save()

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

    def progress(self, text: str) -> None:
        progress(f"gpu-check: {text}")

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        atomic_write_text(self.out_dir / "gpu_check.json", json.dumps(self.doc, indent=1, default=str) + "\n")
        atomic_write_text(self.out_dir / "gpu_check.md", render_markdown(self.doc))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip parts rather than run past this")
    p.add_argument("--batches", type=_ints, default=None, help="plain decode batch sizes (8b: 1,8)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (8b: 512)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per generation (8b: 64)")
    p.add_argument("--ks", type=_ints, default=None, help="draft lengths timed (8b: 1..6)")
    p.add_argument("--draft-layers", type=int, default=None, help="layers of the layer-skip draft (8b: 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (8b: 3)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="copy size (default 1024 CUDA, 256 CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = SHAPES[args.shape]["run"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    layers = SHAPES[args.shape]["config"]["num_hidden_layers"]
    if args.repeats < 1 or args.new_tokens < 2 or args.context < 1:
        p.error("--repeats must be >= 1, --new-tokens >= 2 and --context >= 1")
    if not 1 <= args.draft_layers < layers:
        p.error(f"--draft-layers must be between 1 and {layers - 1} for the {args.shape} shape")
    if not args.ks or min(args.ks) < 1 or not args.batches:
        p.error("--ks and --batches must be non-empty, every k >= 1")
    return args


def versions() -> dict:
    """What the check runs with, recorded and printed before anything else: `make gpu-check` takes
    .venv's python when the install finished and the machine's otherwise, so the torch measured here
    is not necessarily the one `make evaluate` uses."""
    import transformers

    return {"python": platform.python_version(), "python_executable": sys.executable, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
            "nvidia_driver": driver_version()}


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "device_name": device_name(device), "cpus": os.cpu_count(),
           "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                   memory_bytes=int(props.total_memory))
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    check = Check(args.out_dir, args.budget_s, argv)
    env = check.doc["environment"] = versions()
    progress(f"gpu-check: python {env['python']} ({env['python_executable']}), torch {env['torch']} "
             f"(CUDA {env['torch_cuda'] or 'none: a CPU build'}), transformers {env['transformers']}"
             f"{', NVIDIA driver ' + env['nvidia_driver'] if env['nvidia_driver'] else ''}")
    try:
        # An NVIDIA driver too old for this torch's CUDA stops here, with its one line, rather
        # than running the 8B shape on the CPU (pipeline.core.device).
        device = resolve_device(args.device)
    except StageError as e:
        check.doc["errors"].append({"part": "device", "error": str(e)})
        check.save()
        progress(f"gpu-check: {e}")
        return 2
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    env.update(environment(device))
    check.doc["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    check.doc["settings"]["dtype"] = str(dtype).removeprefix("torch.")
    progress(f"gpu-check: {args.shape} shape on {check.doc['environment']['device_name']} ({dtype}), "
             f"budget {args.budget_s:.0f} s, writing {args.out_dir}")

    t = time.perf_counter()
    model = build_model(args.shape, device, dtype, args.seed)
    mb = model_bytes(model)
    check.doc["model"] = {"shape": args.shape, "config": SHAPES[args.shape]["config"],
                          "build_s": time.perf_counter() - t,
                          "parameters": sum(p.numel() for p in model.parameters()), **mb}
    progress(f"gpu-check: model built in {check.doc['model']['build_s']:.1f} s "
             f"({mb['all_weight_bytes'] / 1e9:.2f} GB of weights)")
    check.save()

    if check.fits("bandwidth", 15):
        with check.guard("bandwidth"):
            size = (args.bandwidth_mib << 20) if args.bandwidth_mib else None
            check.doc["parts"]["bandwidth"] = measure_bandwidth(device, size_bytes=size)
            progress(f"gpu-check: copy bandwidth {check.doc['parts']['bandwidth']['gbps']:.1f} GB/s")
            check.save()
    gbps = (check.doc["parts"].get("bandwidth") or {}).get("gbps")

    # Memory plan of the check's own cells, before any runs (pipeline.latency.memory).
    shape = ModelShape.from_model(model, mb["all_weight_bytes"])
    budget = device_budget(device, weights_loaded=True, weight_bytes=mb["all_weight_bytes"])
    plan = plan_grid(shape, args.batches, [args.context], args.new_tokens, budget["budget_bytes"], device.type,
                     verify_width=max(args.ks) + 1)
    check.doc["memory_plan"] = {**plan.to_json(), "budget": budget}
    for dropped in plan.dropped:
        check.note(f"B={dropped['batch']} dropped by the memory plan: {dropped['reason']}")

    draft = make_draft(model, args.draft_layers)
    with check.guard("plain"):
        plain_part(check, model, plan.cells, args, gbps)
    # Plain greedy output of the B = 1 cell: what every speculative run must reproduce.
    reference = next((c["tokens"] for c in check.doc["parts"].get("plain", {}).get("cells", [])
                      if c["batch"] == 1), None)
    with check.guard("speculative"):
        speculative_part(check, model, draft, args, reference)
    if dtype != torch.float32:
        with check.guard("greedy float32"):
            fp32_part(check, model, draft, args)
    else:
        check.note("the run is float32 already: its greedy checks are the exact ones")
    check.doc["finished"] = True
    check.save()
    times = [c.get("tpot_ms", {}).get("median") for c in check.doc["parts"].get("plain", {}).get("cells", [])]
    progress(f"gpu-check: done in {check.elapsed():.0f} s; plain TPOT ms {[round(x, 2) for x in times if x]}; "
             f"{args.out_dir / 'gpu_check.md'}" + (f"; {len(check.doc['errors'])} parts FAILED" if check.doc["errors"]
                                                      else ""))
    return 1 if check.doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

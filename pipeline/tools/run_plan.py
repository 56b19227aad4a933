"""The run's budget plan (pipeline/core/budget.py: allot, PLAN_FILE), made when `make evaluate` starts.

    from pipeline.tools.run_plan import write_plan
    line = write_plan(run_dir, cfg)    # runs/<run>/budget.json, or no file; a line to print either way

    python -m pipeline.tools.run_plan --run runs/smollm2-135m --config configs/default.yaml

A planning stage cannot go below its floor, so where a floor is over the stage's share the plan
shares the planning stages' time again from the cost model's floors for the model's own shape:
each stage gets max(its floor, lambda x its share). It is made only on a GPU the cost model has a
profile for, with `budget.minutes` set and `budget.rebalance` on; elsewhere each stage takes its
share (docs/methods/budget.md#the-runs-ledger).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.core.budget import PLAN_FILE, fmt_s
from pipeline.core.stage import atomic_write_json

# Substrings of torch.cuda.get_device_name() -> the cost model's device (pipeline/tools/cost_devices.py).
# An A100 with 40 GB has other bandwidth: only the 80 GB one matches.
DEVICE_PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"))
# LlamaConfig fields the cost model reads from a model's config.json (its text config for a multimodal one).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "head_dim")


def profile_for(device_name: str | None) -> str | None:
    """The cost model's device for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
    if not device_name:
        return None
    upper = device_name.upper()
    return next((prof for key, prof in DEVICE_PROFILES if key.upper() in upper), None)


def model_shape(model_dir: Path) -> dict | None:
    """The cost model's shape (LlamaConfig fields) from a saved model's config.json, or None when the
    fields the cost model needs are not there."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    shape = {k: config[k] for k in SHAPE_FIELDS if config.get(k) is not None}
    if not all(k in shape for k in SHAPE_FIELDS[:5]):
        return None
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    shape.setdefault("max_position_embeddings", 4096)
    return shape


def make_plan(cfg, shape, profile: str) -> dict:
    """The plan for `cfg` on the cost model's device `profile`: per planning stage its share's
    seconds, the floor and the exhaustive estimate, and the seconds it gets (budget.allot)."""
    from pipeline.tools.cost_devices import DEVICES
    from pipeline.tools.estimate import estimate

    b = cfg.budget
    # On a GPU profile the estimate makes the run's plan itself (estimate.plans_run): its cap is
    # the plan's seconds (budget.allot over the floors), so they are read, not computed again.
    doc = estimate(cfg, shape, DEVICES[profile])
    rows = {r["stage"]: r for r in doc["stages"] if r["stage"] in b.shares}
    total = b.minutes * 60 * sum(b.shares[n] for n in rows)  # the stages the cost model plans (not vllm)
    seconds = {n: r["cap_s"] for n, r in rows.items()}
    return {"minutes": b.minutes, "shares": dict(b.shares), "device_profile": profile,
            "shape": shape, "time_s": round(total, 1),
            "floors_over_time": sum(r["floor_s"] for r in rows.values()) > total,
            "stages": {n: {"seconds": round(seconds[n], 1), "share_s": round(b.minutes * 60 * b.shares[n], 1),
                           "floor_s": r["floor_s"], "exhaustive_s": r["exhaustive_s"]} for n, r in rows.items()},
            "made_from": "pipeline/tools/estimate.py floors on the device profile (a prediction)"}


def plan_text(plan: dict) -> str:
    """One line: each planning stage's seconds against its share."""
    parts = [f"{n} {fmt_s(e['seconds'])} (share {fmt_s(e['share_s'])}, floor {fmt_s(e['floor_s'])})"
             for n, e in plan["stages"].items()]
    over = "; the floors alone are over the time, each stage gets its floor" if plan["floors_over_time"] else ""
    return f"the run's plan on the {plan['device_profile']} profile: {', '.join(parts)}{over}"


def write_plan(run_dir: Path, cfg, device_name: str | None = None) -> str:
    """Write (or remove) runs/<run>/budget.json for this run; returns the line to print.
    device_name: the CUDA device's name (default: torch's, where CUDA is what the run uses)."""
    path = Path(run_dir) / PLAN_FILE
    b = cfg.budget
    why = None
    if not b.minutes:
        why = "no budget"
    elif not b.rebalance:
        why = "budget.rebalance is off"
    else:
        if device_name is None:
            device_name = _cuda_name(cfg)
        profile = profile_for(device_name)
        shape = model_shape(Path(run_dir) / "model")
        if profile is None:
            why = (f"the cost model has no profile for {device_name}" if device_name
                   else "a CPU run: its floors are not predicted well enough to move time by")
        elif shape is None:
            why = "the model's config.json lacks the fields the cost model reads"
    if why is not None:
        path.unlink(missing_ok=True)
        if not b.minutes:
            return "no time budget: no plan"
        return (f"no cost-model plan ({why}): the run's ledger shares the time as the stages measure it"
                if b.rebalance else "each planning stage takes its share (budget.rebalance is off)")
    plan = make_plan(cfg, shape, profile)
    atomic_write_json(path, plan)
    return plan_text(plan)


def _cuda_name(cfg) -> str | None:
    """The name of the CUDA device the run resolves to, or None (a CPU run)."""
    import torch

    from pipeline.core.device import resolve_device

    device = resolve_device(cfg.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    from pipeline.core.config import ConfigError, load_config
    from pipeline.core.stage import progress

    ap = argparse.ArgumentParser(description="Write (or remove) the run's budget plan, runs/<run>/budget.json.")
    ap.add_argument("--run", required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"run_plan: {e}", file=sys.stderr)
        return 2
    progress(f"specq: {write_plan(Path(args.run), cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

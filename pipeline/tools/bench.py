"""Benchmark, side by side (not a test): specq's engine against transformers on the same work.

    make bench                       # = python -m pipeline.tools.bench --run R --config C --model M --drafts D
    python -m pipeline.tools.bench --run runs/smollm2-135m --config configs/default.yaml \
        --model smollm2-135m --drafts "layerskip:8" --k 3 --new-tokens 32 --repeats 3

1. Plain greedy decode: `pipeline.decode.engine.generate(model, ids, N)` vs `model.generate(ids,
   max_new_tokens=N, do_sample=False)` (transformers' default dynamic cache).
2. Speculative greedy decode at the same draft and k: the engine with the config's first
   `layerskip:<n>` draft (draft_models) vs transformers assisted generation with `assistant_model`
   = a separate copy of the target truncated to its first n layers (+ final norm and LM head),
   `num_assistant_tokens=k`, schedule "constant", `assistant_confidence_threshold=0`.

Both sides run in float32 with EOS disabled, so each produces exactly N tokens, and the tokens
must be identical (greedy speculative decoding reproduces the target's greedy output). Engine
and transformers alternate within each repeat and the ratio is taken per repeat (paired), which
keeps a shared machine's drift out of it. Time is end to end (prefill + N tokens), device
synchronized, warm-up excluded. The goal (issue 5) is engine >= 1.5x transformers on both.
Prints a table; writes <run>/bench.json.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

GOAL = 1.5
PROMPT = "Explain in a few sentences why the sky is blue, for a ten-year-old."


def truncated_copy(model, n_layers: int):
    """A separate model holding copies of the target's first n decoder layers, its final norm and
    its LM head: transformers' view of the layerskip draft (it cannot share the target's modules)."""
    from pipeline.models.architecture import decoder_layers

    draft = copy.deepcopy(model)
    path, layers = decoder_layers(draft)
    if n_layers > len(layers):
        raise SystemExit(f"bench: cannot truncate {type(model).__name__} to {n_layers} layers")
    parent_path, _, attr = path.rpartition(".")
    setattr(draft.get_submodule(parent_path), attr, layers[:n_layers])
    text = draft.config.get_text_config()
    text.num_hidden_layers = n_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:n_layers]
    return draft.eval()


def _timed(device: torch.device, fn):
    from pipeline.decode.timing import synchronize

    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def _hf_generate(model, ids: torch.Tensor, n: int, assistant=None, k: int = 0) -> list[int]:
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, n, None
    gc.temperature = gc.top_p = gc.top_k = None
    gc.eos_token_id = None  # exactly n tokens, like the engine with eos_token_id=None
    if gc.pad_token_id is None:
        gc.pad_token_id = model.config.get_text_config().pad_token_id or 0
    kwargs = {}
    if assistant is not None:
        agc = assistant.generation_config
        agc.num_assistant_tokens = k
        agc.num_assistant_tokens_schedule = "constant"
        agc.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def compare(name: str, engine_fn, hf_fn, device, warmup: int, repeats: int, n: int) -> dict:
    for _ in range(warmup):
        engine_fn()
        hf_fn()
    eng_s, hf_s, ratios = [], [], []
    eng_tokens = hf_tokens = None
    for _ in range(repeats):
        eng_tokens, te = _timed(device, engine_fn)
        hf_tokens, th = _timed(device, hf_fn)
        eng_s.append(te)
        hf_s.append(th)
        ratios.append(th / te)
        print(f"bench: {name}: engine {te:.2f} s, transformers {th:.2f} s ({th / te:.2f}x)", file=sys.stderr,
              flush=True)
    ratio = statistics.median(ratios)
    return {
        "mode": name,
        "engine_ms_per_token": statistics.median(eng_s) / n * 1e3,
        "transformers_ms_per_token": statistics.median(hf_s) / n * 1e3,
        "engine_s": eng_s, "transformers_s": hf_s, "ratios": ratios,
        "ratio": ratio, "ratio_range": [min(ratios), max(ratios)],
        "identical_tokens": eng_tokens == hf_tokens,
        "first_mismatch": next((i for i, (a, b) in enumerate(zip(eng_tokens, hf_tokens)) if a != b), None),
        "engine_tokens": eng_tokens, "transformers_tokens": hf_tokens,
        "goal_met": ratio >= GOAL,
    }


def _model_dir(run: Path, config_path: str, model: str) -> Path:
    if (run / "model" / "meta.json").is_file():
        return run / "model"
    from pipeline.core.config import load_config
    from pipeline.core.stage import run_stage
    from pipeline.stages.table import STAGES

    run_stage(STAGES["prepare"], run, load_config(config_path), {"model": model}, STAGES)
    return run / "model"


def main(argv: list[str] | None = None) -> int:
    from pipeline.core.process import set_up_process

    set_up_process()
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--run", default="runs/smollm2-135m")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafts", default="", help="drafts; the first layerskip:<n> is used (default layerskip:8)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from draft_models.registry import build_draft
    from pipeline.core.config import load_config
    from pipeline.core.device import resolve_device
    from pipeline.core.stage import StageError, atomic_write_json, library_versions
    from pipeline.decode.engine import generate
    from pipeline.speculation.prompts import prompt_ids
    from pipeline.variants.schemes import load_variant

    cfg = load_config(args.config)
    drafts = args.drafts.split() or cfg.drafts
    spec = next((d for d in drafts if d.startswith("layerskip:")), "layerskip:8")
    n_layers = int(spec.split(":", 1)[1])
    try:
        device = resolve_device(cfg.device)
    except StageError as e:  # e.g. a driver too old for this torch: one line, exit 2, like the stages
        print(f"specq: {e}", file=sys.stderr)
        return 2
    run = Path(args.run)
    model, tok = load_variant(_model_dir(run, args.config, args.model), device=device, dtype="float32")
    ids = torch.tensor([prompt_ids(tok, PROMPT)], device=device)
    n, k = args.new_tokens, args.k
    print(f"bench: {args.model} on {device} ({torch.get_num_threads()} threads), float32, greedy, "
          f"prompt {ids.shape[1]} tokens, {n} new tokens, draft {spec}, k={k}, "
          f"{args.repeats} repeats after {args.warmup} warm-up", file=sys.stderr)

    plain = compare("plain", lambda: generate(model, ids, n).tokens,
                    lambda: _hf_generate(model, ids, n), device, args.warmup, args.repeats, n)
    draft = build_draft(spec, model, tok, run, device)
    assistant = truncated_copy(model, n_layers)
    spec_row = compare(f"speculative {spec} k={k}", lambda: generate(model, ids, n, draft=draft, k=k).tokens,
                       lambda: _hf_generate(model, ids, n, assistant, k), device, args.warmup,
                       args.repeats, n)
    spec_row["identical_to_plain"] = spec_row["engine_tokens"] == plain["engine_tokens"]
    rows = [plain, spec_row]
    print(f"\n{'mode':<28} {'engine ms/tok':>14} {'transformers ms/tok':>20} {'ratio':>7} "
          f"{'range':>13} {'tokens':>10}  goal {GOAL}x")
    for r in rows:
        same = "identical" if r["identical_tokens"] else f"DIFFER@{r['first_mismatch']}"
        print(f"{r['mode']:<28} {r['engine_ms_per_token']:>14.2f} {r['transformers_ms_per_token']:>20.2f} "
              f"{r['ratio']:>6.2f}x [{r['ratio_range'][0]:.2f}, {r['ratio_range'][1]:.2f}] {same:>10}  "
              f"{'met' if r['goal_met'] else 'NOT met'}")
    ok = all(r["identical_tokens"] for r in rows) and spec_row["identical_to_plain"]
    atomic_write_json(run / "bench.json", {
        "model": args.model, "device": str(device), "threads": torch.get_num_threads(), "dtype": "float32",
        "prompt_tokens": ids.shape[1], "new_tokens": n, "draft": spec, "k": k, "warmup": args.warmup,
        "repeats": args.repeats, "goal": GOAL, "rows": rows, "tokens_identical": ok,
        "libraries": library_versions(),
    })
    print(f"\nbench: tokens {'identical' if ok else 'NOT identical'} across engine and transformers; "
          f"written to {run / 'bench.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

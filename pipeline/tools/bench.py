"""Benchmark, side by side (not a test): specq's engine against transformers' fast paths on the same work.

    make bench                       # = bench (this) then bench_quality, on the run's model
    python -m pipeline.tools.bench --run runs/smollm2-135m --config configs/default.yaml \
        --model smollm2-135m --drafts "layerskip:8" --k 3 --new-tokens 32 --repeats 5

Plain greedy decode (`generate` against `model.generate` on a static cache) and speculative greedy
decode at the same draft and k (the config's first `layerskip:<n>` draft against assisted
generation with a copy of the target's first n layers), both eager, in float32 with EOS off, so
both sides' tokens must be identical (exit 1 otherwise). Paired repeats give each ratio's CI
(pipeline/tools/paired_ratio.py), and one last run per side with its model forwards clocked
gives its host share. On a CPU shared with other jobs pass `--threads 1`. Writes <run>/bench.json
(docs/methods/stages.md#the-benches).
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from pipeline.decode.timing import synchronize
from pipeline.tools.paired_ratio import (at_least, bench_parser, format_ci, load_run_model, ratio_summary,
                                         run_bench, run_order, token_check)

GOALS = {"plain": 1.2, "speculative": 1.5}
PROMPT = "Explain in a few sentences why the sky is blue, for a ten-year-old."


def parse_args(argv: list[str] | None = None):
    p = bench_parser("python -m pipeline.tools.bench", __doc__, repeats=5)
    p.add_argument("--k", type=at_least(1), default=3)
    p.add_argument("--new-tokens", type=at_least(2), default=32, help="at least 2 (the first comes from the prefill)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the last untimed run that times each side's model forwards")
    return p.parse_args(argv)


def pick_draft(drafts: list[str]) -> tuple[str, int]:
    """The first layerskip:<n> of the configured drafts (layerskip:8 when there is none)."""
    spec = next((d for d in drafts if d.startswith("layerskip:")), "layerskip:8")
    try:
        return spec, int(spec.split(":", 1)[1])
    except ValueError:
        raise SystemExit(f"bench: draft {spec}: expected layerskip:<n> with an integer n") from None


def hf_generation_config(model, n: int):
    """Greedy, exactly n tokens (EOS off), on a static cache, never compiled (transformers would
    compile a static-cache generate on CUDA by itself)."""
    gc = copy.deepcopy(model.generation_config)
    gc.update(do_sample=False, max_new_tokens=n, min_new_tokens=None, temperature=None, top_p=None, top_k=None,
              eos_token_id=None, cache_implementation="static", disable_compile=True)
    if gc.pad_token_id is None:
        gc.pad_token_id = model.config.get_text_config().pad_token_id or 0
    return gc


def truncated_copy(model, n_layers: int, k: int):
    """An assistant drafting k tokens a round (constant schedule): a separate model holding copies
    of the target's first n decoder layers, final norm and LM head (transformers' view of the
    layerskip draft: it cannot share the target's modules)."""
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
    draft.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    return draft.eval()


def hf_generate(model, ids: torch.Tensor, gc, assistant=None, record: dict | None = None) -> list[int]:
    """transformers' generate with `gc`; `record` (optional) receives the cache class it returned."""
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    if record is not None:
        gc = copy.copy(gc)
        gc.return_dict_in_generate = True
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **kwargs)
    if record is not None:
        cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        record["cache"] = type(cache).__name__ if cache is not None else None
        out = out.sequences
    return out[0, ids.shape[1]:].tolist()


@contextmanager
def forward_clock(modules: dict):
    """Time every forward of each module (label -> module) and note the cache class it was handed:
    {label: {"calls", "seconds", "caches"}}."""
    stats = {label: {"calls": 0, "seconds": 0.0, "caches": set()} for label in modules}

    def wrap(s, fn):
        def timed(*args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None:
                s["caches"].add(type(cache).__name__)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                s["calls"] += 1
                s["seconds"] += time.perf_counter() - t0
        return timed

    for label, m in modules.items():
        m.forward = wrap(stats[label], m.forward)  # instance attribute: shadows the class's forward
    try:
        yield stats
    finally:
        for m in modules.values():
            m.__dict__.pop("forward", None)
        for s in stats.values():
            s["caches"] = sorted(s["caches"])


def clocked(fn, modules: dict, device) -> dict:
    """One untimed run of fn with its model forwards clocked: total, forward and host seconds."""
    with forward_clock(modules) as stats:
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        total = time.perf_counter() - t0
    fwd = sum(s["seconds"] for s in stats.values())
    return {"total_s": total, "forward_s": fwd, "host_s": total - fwd,
            "host_share": (total - fwd) / total if total > 0 else None, "forwards": stats}


def paired_runs(sides: dict, device, warmup: int, repeats: int, label: str) -> tuple[dict, dict]:
    """sides: {"engine": fn, "transformers": fn}, each returning its tokens: `warmup` untimed runs
    of each, then `repeats` timed ones back to back, order alternating. Seconds and last tokens."""
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    seconds, tokens = {name: [] for name in sides}, {}
    for r in range(repeats):
        for name in run_order(r, tuple(sides)):
            synchronize(device)
            t0 = time.perf_counter()
            tokens[name] = sides[name]()
            synchronize(device)
            seconds[name].append(time.perf_counter() - t0)
        e, h = seconds["engine"][-1], seconds["transformers"][-1]
        print(f"bench: {label}: repeat {r + 1}/{repeats}: engine {e:.2f} s, transformers {h:.2f} s "
              f"({h / e:.2f}x)", file=sys.stderr, flush=True)
    return seconds, tokens


def bench_mode(model, ids, n: int, device, args, draft=None, assistant=None, k: int = 0) -> dict:
    """Plain (no draft) or speculative decode on both sides: a first untimed run each (transformers'
    records its caches), the paired repeats, the row with its ratio, and the profile runs."""
    from pipeline.decode.engine import generate

    mode = "plain" if draft is None else f"speculative {draft.spec} k={k}"
    results: list = []

    def engine():
        results.append(generate(model, ids, n, draft=draft, k=k, cache_len=ids.shape[1] + n + 1))
        return results[-1].tokens

    gc = hf_generation_config(model, n)

    def hf(record=None):
        return hf_generate(model, ids, gc, assistant, record)

    hf_modules = {"target": model, **({"assistant": assistant} if assistant is not None else {})}
    engine()  # the engine's first run: untimed, like transformers'
    hf_rec: dict = {}
    first = clocked(lambda: hf(hf_rec), hf_modules, device)
    hf_rec["first_run_s"] = first["total_s"]
    seconds, tokens = paired_runs({"engine": engine, "transformers": hf}, device, args.warmup, args.repeats, mode)
    timed = results[-args.repeats:]
    rec = {"cache_len": timed[-1].cache_positions,
           "decode_ms_per_token": statistics.median(r.decode_s / (n - 1) for r in timed) * 1e3,
           "prefill_ms": statistics.median(r.prefill_s for r in timed) * 1e3}
    if draft is not None:
        rounds = timed[-1].rounds
        hf_rec["assistant_cache"] = ", ".join(first["forwards"]["assistant"]["caches"]) or None
        hf_rec["assistant"] = {"num_assistant_tokens": k, "schedule": "constant", "confidence_threshold": 0.0}
        rec.update(rounds=len(rounds), tokens_per_round=sum(r.emitted for r in rounds) / max(len(rounds), 1),
                   acceptance=sum(r.accepted for r in rounds) / max(sum(r.drafted for r in rounds), 1))
        rec.update({f"{p}_ms": statistics.mean(getattr(r, f"{p}_s") for r in rounds) * 1e3 if rounds else None
                    for p in ("round", "draft", "verify")})
    check = token_check(tokens["engine"], tokens["transformers"])
    row = {
        "mode": mode,
        "engine_ms_per_token": statistics.median(seconds["engine"]) / n * 1e3,
        "transformers_ms_per_token": statistics.median(seconds["transformers"]) / n * 1e3,
        "engine_s": seconds["engine"], "transformers_s": seconds["transformers"],
        **ratio_summary(seconds["transformers"], seconds["engine"], GOALS[mode.split()[0]], args.confidence),
        "identical_tokens": check["identical"], "first_mismatch": check["first_mismatch"],
        "engine_tokens": tokens["engine"], "transformers_tokens": tokens["transformers"],
        "engine": rec, "transformers": hf_rec,
    }
    if args.profile:
        engine_modules = {"target": model, **({"draft": draft.model} if draft is not None else {})}
        row["profile"] = {"engine": clocked(engine, engine_modules, device),
                          "transformers": clocked(hf, hf_modules, device)}
    return row


def print_table(rows: list[dict]) -> None:
    conf = int(round(rows[0]["confidence"] * 100))
    print(f"\n{'mode':<28} {'engine ms/tok':>13} {'transformers ms/tok':>19} {'ratio':>6} {f'{conf}% CI':>14} "
          f"{'goal':>5}  {'status':<13} tokens")
    for r in rows:
        same = "identical" if r["identical_tokens"] else f"DIFFER@{r['first_mismatch']}"
        print(f"{r['mode']:<28} {r['engine_ms_per_token']:>13.2f} {r['transformers_ms_per_token']:>19.2f} "
              f"{r['ratio']:>5.2f}x {format_ci(r['ci']):>14} {r['goal']:>4.1f}x  {r['goal_status']:<13} {same}")


def main(argv: list[str] | None = None) -> int:
    return run_bench(parse_args(argv), _main)


def _main(args) -> int:
    from draft_models.registry import build_draft
    from pipeline.core.stage import atomic_write_json, library_versions
    from pipeline.speculation.prompts import prompt_ids

    cfg, device, run, model, tok = load_run_model(args, dtype="float32")
    spec, n_layers = pick_draft(args.drafts.split() or cfg.drafts)
    ids = torch.tensor([prompt_ids(tok, PROMPT)], device=device)
    n, k = args.new_tokens, args.k
    print(f"bench: {args.model} on {device} ({torch.get_num_threads()} threads), float32, greedy, eager, "
          f"prompt {ids.shape[1]} tokens, {n} new tokens, draft {spec}, k={k}, {args.repeats} paired repeats "
          f"after {args.warmup} warm-up", file=sys.stderr)

    plain = bench_mode(model, ids, n, device, args)
    draft = build_draft(spec, model, tok, run, device)
    spec_row = bench_mode(model, ids, n, device, args, draft, truncated_copy(model, n_layers, k), k)
    spec_row["identical_to_plain"] = spec_row["engine_tokens"] == plain["engine_tokens"]
    rows = [plain, spec_row]
    print_table(rows)
    ok = all(r["identical_tokens"] for r in rows) and spec_row["identical_to_plain"]
    atomic_write_json(run / "bench.json", {
        "model": args.model, "device": str(device), "threads": torch.get_num_threads(), "dtype": "float32",
        "prompt_tokens": ids.shape[1], "new_tokens": n, "draft": spec, "k": k, "warmup": args.warmup,
        "repeats": args.repeats, "goals": GOALS,
        "baseline": {"plain": "model.generate(cache_implementation='static', disable_compile=True)",
                     "speculative": "model.generate(assistant_model=<first n layers, copied>, num_assistant_tokens=k, "
                                    "schedule constant, cache_implementation='static', disable_compile=True)"},
        "rows": rows, "tokens_identical": ok, "libraries": library_versions(),
    })
    print(f"\nbench: tokens {'identical' if ok else 'NOT identical'} across engine and transformers; "
          f"written to {run / 'bench.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

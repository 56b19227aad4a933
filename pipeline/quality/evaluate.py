"""Scoring a loaded model on the quality slices through lm-eval, item by item, and per-slice summaries.

    from pipeline.quality.evaluate import evaluate, summarize_slice
    records, counters = evaluate(model, tokenizer, task_configs, named_slices, cfg.quality, seed=0)
    summary = summarize_slice(records["long_context"], confidence=0.95)

All tasks of a look go through one lm-eval `simple_evaluate` call with per-item samples, on the
`quality.evaluator` (prefix_lm or lm-eval's HFLM) or an lm-eval model the caller built (vLLM).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from evals import metrics
from evals.bfcl_checker import score_item as score_bfcl
from pipeline.core.stage import StageError, atomic_write_json, read_json, read_jsonl
from pipeline.quality import lm_tasks
from pipeline.quality.items import PRIMARY
from pipeline.stats.paired import mean_ci, merge_clusters
from pipeline.stats.scoring_rules import calibration_summary


def evaluate(model, tokenizer, task_configs: dict[str, dict], named: list, qcfg,
             seed: int, cache: str | None = None, prompts: dict | None = None) -> tuple[dict, dict]:
    """({task: per-item records}, the evaluator's counters) for every task, on the loaded model.
    `cache`: a path prefix for lm-eval's request cache. `prompts`, a dict, gets each built-in
    item's prompt as the model saw it: (slice, id) -> text."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.models.huggingface import HFLM

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if qcfg.evaluator == "prefix":
        from pipeline.quality.prefix_lm import PrefixCachedLM as lm_class
    else:
        lm_class = HFLM
    named_tasks = [s.tasks[leaf.name] for s in named for leaf in s.leaves if leaf.doc_ids]
    tasks = list(task_configs.values()) + named_tasks
    use_template = bool(qcfg.chat_template and getattr(tokenizer, "chat_template", None))
    include = tuple(sorted({p for s in named for p in s.index[1]}))
    manager = lm_tasks.task_manager(any(s.index[0] for s in named), include)
    with lm_tasks.quiet():  # HFLM warns at construction that it was handed a loaded model: expected here
        lm = model if isinstance(model, LM) else lm_class(pretrained=model, tokenizer=tokenizer,
                                                          batch_size=qcfg.batch_size)
        res = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, log_samples=True, apply_chat_template=use_template,
            samples=lm_tasks.samples_request(named) or None,
            bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, verbosity="ERROR", task_manager=manager,
            use_cache=str(cache) if cache is not None else None)
    samples = res["samples"]
    out = {}
    for name, cfg in task_configs.items():
        out[name] = [_builtin_record(name, s) for s in sorted(samples[cfg["task"]], key=lambda s: s["doc_id"])]
        if prompts is not None:
            prompts.update({(name, s["doc"]["id"]): s["arguments"][0][0] for s in samples[cfg["task"]]})
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
    prediction, before, after = sample["filtered_resps"][0], {}, {}
    if slice_name == "calibration":
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        pick = int(np.argmax(lls))
        scores, prediction = {"acc": float(pick == doc["label"])}, doc["choices"][pick]
        after = {"option_probs": metrics.option_probs(lls), "label": doc["label"]}
    elif slice_name == "code":  # the sandbox filter's outcome; the completion is in it
        after = {"status": prediction["status"], "detail": prediction["detail"]}
        scores, prediction = {"pass@1": float(prediction["pass@1"])}, prediction["completion"]
    elif slice_name == "bfcl":
        s = score_bfcl(doc, prediction)
        scores, before = {"accuracy": s["accuracy"], "decoded": s["decoded"]}, {"error": s["error"]}
    elif slice_name == "tool_args":
        scores = metrics.score_tool_call(doc, prediction)
    else:
        scores = {"exact_match": metrics.score_answer(doc, prediction)["exact_match"]}
    metric = PRIMARY.get(slice_name, "exact_match")
    return {**rec, **before, "metric": metric, "score": scores[metric], "scores": scores, "prediction": prediction,
            "target": doc["target"], **after}


# ------------------------------------------------------------------ summaries


def summarize_slice(records: list[dict], confidence: float) -> dict:
    """Per-slice (and per-group) mean with a CI clustered as the gate clusters (stats.paired.mean_ci)."""
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


def write_summaries(out_dir: Path, order: list[str], tasks: list[str], confidence: float) -> None:
    """quality/<model>.json for every model (the reference first in `order`), each checked to have
    scored the first of the reference's item ids (the gate pairs items by id)."""
    ref_ids: dict[str, list] = {}
    for name in order:
        summary = {"variant": name, "reference": order[0], "slices": {}}
        for task in tasks:
            recs = read_jsonl(out_dir / name / f"{task}.jsonl")
            if not recs:
                raise StageError(f"quality: slice '{task}' produced no items for {name}")
            ids = [r["id"] for r in recs]
            ref = ref_ids.setdefault(task, ids)
            if ids != ref[:len(ids)]:
                raise StageError(f"quality: {name} scored other '{task}' items than {order[0]} "
                                 f"({len(ids)} vs {len(ref)}); delete {out_dir / name} and re-run")
            summary["slices"][task] = summarize_slice(recs, confidence)
        dist = out_dir / name / "distribution.json"
        if dist.is_file():
            summary["distribution"] = {k: v for k, v in read_json(dist, "distribution metrics").items()
                                       if k != "per_document"}
        atomic_write_json(out_dir / f"{name}.json", summary)

"""quality: score the reference and every variant on the same task items, item by item.

    python -m pipeline quality --run runs/smollm2-135m --config configs/default.yaml
    make quality MODEL=smollm2-135m

Each slice's items (generated, BFCL, HumanEval, lm-eval tasks) are put once in a seeded cluster
order and scored in looks of `quality.wave_items`; after each look the gate's own replay
(pipeline/gate/decision.py: open_slices) says which variants still have open cells, and only those
score on, as far as the stage's time budget allows. Lines are appended look by look, so a re-run
resumes. Method: docs/methods/gate.md (looks), budget.md (time), quality-slices.md (slices and
outputs), quality-vllm.md (`quality.backend: vllm`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from evals import sandbox
from pipeline.core.budget import StageBudget, fmt_s
from pipeline.core.device import resolve_device
from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_json,
                                 hash_obj, progress, read_json, read_jsonl, sha256_file)
from pipeline.decode.release import collect
from pipeline.models.loading import load_tokenizer
from pipeline.quality import distribution, lm_tasks, vllm_backend
from pipeline.quality.evaluate import evaluate, summarize_slice
from pipeline.quality.items import KNOWN_SLICES, builtin_task_config
from pipeline.quality.plans import cost_weights, prompt_tokens_of, slice_data, task_plan
from pipeline.quality.gpu_groups import device_groups, side_by_side, visible_gpus
from pipeline.quality.sequential import Waves, score_in_waves, score_variants
from pipeline.quality.waves import Allowance, pace_priors
from pipeline.variants.schemes import load_variant


def precheck(config, args: dict | None = None) -> None:
    """Before any work starts (the quality stage's precheck; `python -m pipeline prepare` and
    `evaluate` run it too, so a typo costs one line, not the hours before quality): every slice is
    a built-in one and every `quality.tasks` entry is a task, group or tag lm-eval's index knows
    (reading the index only, about 12 s when a name needs lm-eval's own tasks; no data is read).
    `backend: vllm` needs the vLLM environment (.venv-vllm); without quality.vllm.distribution it measures no
    drift, so gate thresholds on drift are refused; with fallback: stop, a variant the config
    already shows vLLM cannot load (torchao, a checkpoint's method) is refused."""
    qcfg = config.quality
    for name in qcfg.slices:
        if name not in KNOWN_SLICES:
            raise StageError(f"unknown quality slice '{name}' (known: {', '.join(KNOWN_SLICES)})")
    if qcfg.backend == "vllm":
        why = vllm_backend.unavailable()
        if why:
            raise StageError(why)
        gate = config.gate
        drift = [k for k in ("max_kl", "min_top1_agreement") if getattr(gate, k) is not None]
        if drift and not qcfg.vllm.distribution:
            raise StageError(f"gate.{drift[0]} needs the distribution drift, which quality.backend vllm does not "
                             "measure unless quality.vllm.distribution is true")
        if qcfg.vllm.fallback == "stop":
            where = vllm_backend.platform()
            for vname, spec in config.quantize.variants.items():
                why = vllm_backend.config_reason(spec, where)
                if why:
                    raise StageError(f"quality: vLLM cannot load variant '{vname}': {why} "
                                     "(quality.vllm.fallback: stop; fallback: hf scores it with transformers)")
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

    # What scores each model (quality.backend; pipeline/quality/vllm_backend.py), decided before any
    # work: a variant vLLM cannot load is scored with hf (said here) or, with fallback: stop, ends
    # the stage in one line.
    served = qcfg.backend == "vllm"
    host = vllm_backend.Host.of(cfg, ctx.out_dir / "logs") if served else None
    version = vllm_backend.vllm_version() if served else None
    backends = {name: vllm_backend.choose(qcfg, variant_dir(name), cfg.seed, None, name,
                                          platform=host.platform if host else "cuda", version=version)
                for name in order}
    for name, chosen in backends.items():
        if chosen.why:
            progress(f"quality: {name}: {chosen.why}; scored with the hf backend")
    engines = vllm_backend.Engines(keep=reference if qcfg.vllm.keep_reference else None, host=host)
    drift = qcfg.backend == "hf" or qcfg.vllm.distribution

    ref_dir = variant_dir(reference)
    ref_tokenizer = load_tokenizer(ref_dir)
    # The items every variant scores, in wave order, written once so their hashes go into each
    # variant's inputs; the looks each slice allows.
    data_dir = ctx.out_dir / "data"
    data_files, plans = {}, {}
    for name in qcfg.slices:
        blob, plans[name] = slice_data(name, qcfg, cfg.seed, ref_tokenizer)
        path = data_dir / f"{name}.jsonl"
        if not path.is_file() or path.read_bytes() != blob:
            atomic_write_bytes(path, blob)
        data_files[name] = path
    named, skipped = lm_tasks.resolve(qcfg.tasks, qcfg, cfg.seed)
    # lm-eval tasks in waves like the built-in slices: their documents' seeded cluster order
    # (pipeline/quality/lm_tasks.py), written beside the slices' items, and the looks it allows.
    task_files = {}
    for s in named:
        if s.name in plans:
            raise StageError(f"quality.tasks: '{s.name}' has the name of a quality slice; "
                             "list it under one of quality.slices or quality.tasks")
        plans[s.name] = task_plan(s, qcfg)
        path = data_dir / f"{s.name}.jsonl"
        if not path.is_file() or path.read_bytes() != s.rows:
            atomic_write_bytes(path, s.rows)
        task_files[s.name] = path
    lines = {s: p.read_bytes().splitlines(keepends=True) for s, p in {**data_files, **task_files}.items()}
    data_hashes = {n: sha256_file(p) for n, p in {**data_files, **task_files}.items()}
    prompt_tokens = prompt_tokens_of(ref_tokenizer, data_files)
    models: dict = {}  # name -> (model, tokenizer); the reference stays loaded for every variant
    timings: dict = {}
    budget = StageBudget(cfg, "quality", run_dir=ctx.run_dir)

    def scorer(name: str, engines=engines):
        def score(configs: dict, tasks: list):
            loaded = 0.0
            if backends[name].backend == "vllm":
                if models:  # an hf-loaded model leaves the GPUs to the engine
                    models.clear()
                    collect(device)
                if name not in engines.loaded:
                    progress(f"quality: {name}: starting vLLM on {variant_dir(name)} "
                             f"(tensor_parallel_size {qcfg.vllm.tensor_parallel_size})")
                lm, loaded = engines.get(name, backends[name].kwargs)
                # Each answered request is kept until its look is written: a look the engine
                # dies in is resumed from them (lm-eval's request cache).
                cache = ctx.out_dir / name / f"requests-{hash_obj(backends[name].scored_with())[:12]}"
                try:
                    records, counters = evaluate(lm, lm.tokenizer, configs, tasks, qcfg, cfg.seed, cache=cache)
                except Exception as e:
                    why = engines.died(name)
                    if why is None:
                        raise
                    engines.release(name)
                    raise StageError(f"quality: {name}: {why}; the looks already written are kept and the "
                                     "requests it answered are cached: run again to resume") from e
                return records, {**(counters or {}), **({"load_seconds": loaded} if loaded else {})}
            else:
                if name not in models:
                    engines.release(keep=engines.keep)  # vLLM's engines hold the GPUs' memory
                    progress(f"quality: {name}: loading {variant_dir(name)}")
                    start = time.perf_counter()
                    models[name] = load_variant(variant_dir(name), device)
                    loaded = time.perf_counter() - start
                model, tok = models[name]
            records, counters = evaluate(model, tok, configs, tasks, qcfg, cfg.seed)
            # The load is not the items' cost (Waves' pace leaves it out of seconds per item).
            return records, {**(counters or {}), **({"load_seconds": loaded} if loaded else {})}
        return score

    def builtin_configs(files: dict[str, Path]) -> dict:
        return {s: builtin_task_config(s, f, qcfg.max_new_tokens_for(s), qcfg.sandbox) for s, f in files.items()}

    weights = {**cost_weights(qcfg, data_files, prompt_tokens),
               **{s.name: lm_tasks.cost_weight(s, ref_tokenizer) for s in named}}
    waves = Waves(ctx.out_dir, lines, plans, named, builtin_configs, timings, weights=weights)
    waves.prior = pace_priors({n: _read_meta(variant_dir(n)) for n in order}, reference)
    items, inputs_of = {}, {}
    for name in order:
        scored_with, inputs_of[name] = item_inputs(ctx, variant_dir(name), ref_dir, data_hashes, named,
                                                   backends[name].scored_with())
        stopped = _budget_stopped(ctx.out_dir / name / "meta.json")
        items[name] = waves.open(ctx.item(name, inputs_of[name](stopped)), scored_with)
        if items[name].fresh:
            progress(f"quality: {name} up to date")

    pending = [n for n in order[1:] if not items[n].fresh]
    _announce_plan(budget, waves, reference, pending, first=True)
    ref_score = scorer(reference)
    waves.first_look(reference, ref_score)
    if pending:
        _announce_plan(budget, waves, reference, pending, first=False)
    ref_logp: dict = {}
    heldout = heldout_info = None
    for name in order[1:]:
        if items[name].fresh:
            waves.cover(reference, ref_score, waves.scored(name))  # the reference holds its items

    def measure_drift(name: str) -> None:
        """The variant's distribution drift against the reference, while it is loaded."""
        nonlocal heldout, heldout_info
        engines.release(name)
        if not drift:  # not measured: an earlier run's figures would not be this run's
            (ctx.out_dir / name / "distribution.json").unlink(missing_ok=True)
            return
        engines.release()  # through transformers (backend vllm: only with quality.vllm.distribution)
        if reference not in models:
            models[reference] = load_variant(ref_dir, device)
        ref_model = models[reference][0]
        if heldout is None:
            heldout, heldout_info = distribution.heldout_documents(
                models[reference][1], qcfg.distribution_docs, qcfg.distribution_tokens)
        if name not in models:  # its first look was scored before (a resumed run): load it for drift
            progress(f"quality: {name}: loading {variant_dir(name)}")
            models[name] = load_variant(variant_dir(name), device)
        start = time.perf_counter()
        per_doc = distribution.per_document(ref_model, models[name][0], heldout, device, cache=ref_logp)
        atomic_write_json(ctx.out_dir / name / "distribution.json",
                          {**distribution.summarize(per_doc), **heldout_info,
                           "seconds": time.perf_counter() - start})

    def drop_request_cache(name: str) -> None:
        """The answers kept for a look the engine might die in: not needed once its lines are written."""
        for f in (ctx.out_dir / name).glob("requests-*.db"):
            f.unlink()

    def unload(name: str) -> None:
        engines.release(name)
        models.pop(name, None)
        collect(device)  # the variant's memory back before the next one loads

    def finish(name: str) -> None:
        # Its item's inputs hold the budget only when a look was skipped on it (a variant that
        # ran to the end of its looks is the same under any budget).
        items[name].input_hash = ctx.item(name, inputs_of[name](waves.stopped(name))).input_hash
        waves.finish(name, qcfg.evaluator, backends[name].record(qcfg.evaluator))
        drop_request_cache(name)
        unload(name)

    groups = _side_by_side_groups(qcfg, host, budget, backends, pending)
    if groups:
        # One engine per GPU group, each group taking the next variant: the reference is scored
        # first to every slice's last look, so no variant waits on the reference's engine.
        waves.cover(reference, ref_score, {s: p["n_max"] for s, p in plans.items()})
        engines.release()
        progress(f"quality: {len(pending)} variants side by side on {len(groups)} GPU groups "
                 f"({'; '.join(','.join(g) for g in groups)})")

        def one(name: str, group: tuple[str, ...]) -> None:
            own = vllm_backend.Engines(host=host.on(group))
            try:
                score_in_waves(waves, reference, name, ref_score, scorer(name, own), cfg,
                               Allowance(budget, 1))
            finally:
                own.release()

        side_by_side(pending, groups, one)
        for name in pending:  # drift through transformers, one model pair at a time
            measure_drift(name)
            finish(name)
    else:
        score_variants(waves, reference, pending, ref_score, scorer, cfg, budget,
                       after_first=measure_drift, finish=finish, park=unload)
    engines.release()
    if not items[reference].fresh or waves.grew(reference):
        waves.finish(reference, qcfg.evaluator, backends[reference].record(qcfg.evaluator))
    drop_request_cache(reference)
    tasks = list(qcfg.slices) + [s.name for s in named]
    budgets, ran = {}, {}
    for name in order:
        vmeta = read_json(items[name].path / "meta.json")
        timings[name] = {k: vmeta.get(k)
                         for k in ("items", "eval_seconds", "items_per_second", "counters", "items_scored")}
        # What scored it, from its own meta.json (a variant finished in an earlier run keeps its record).
        ran[name] = {k: vmeta.get(k) for k in ("backend", "evaluator", "backend_reason", "vllm_version")
                     if vmeta.get(k) is not None}
        ran[name].setdefault("backend", "hf")
        if name != reference:
            budgets[name] = vmeta.get("budget")
        _write_summary(ctx, name, reference, tasks)
    _check_same_ids(ctx.out_dir, order, tasks, set(plans))
    ctx.meta.update({
        "variants": order, "reference": reference, "slices": list(qcfg.slices),
        "tasks": [s.name for s in named], "task_details": {s.name: s.info() for s in named},
        "skipped_tasks": skipped, "items_per_slice": qcfg.items_per_slice,
        "max_items": qcfg.max_items, "wave_items": qcfg.wave_items,
        "sequential": {s: {"looks": p["looks"], "n_max": p["n_max"], "order": p["order"],
                           "spending": cfg.gate.spending} for s, p in plans.items()},
        "generation": {"greedy": True, "max_new_tokens": qcfg.max_new_tokens,
                       "chat_template": qcfg.chat_template, "batch_size": qcfg.batch_size,
                       "evaluator": _one_or_mixed([r.get("evaluator", qcfg.evaluator) for r in ran.values()])},
        # Per model, what scored it (quality.backend: vllm, or hf and why), never what was asked.
        "backends": ran,
        **({"distribution_drift": "not measured: quality.backend vllm without quality.vllm.distribution"}
           if not drift else {}),
        "data_sha256": data_hashes, "prompt_tokens": prompt_tokens, "timing": timings,
        "items": {s: len(v) for s, v in lines.items()},
        # What the stage planned, spent and skipped; per variant and slice the items scored, the
        # looks done and skipped and why (the gate reads it: pipeline/gate/decision.py).
        "budget": {**budget.to_json(), "variants": budgets,
                   "pace_s_per_item": {n: waves.pace[n].to_json()["per_item_s"] for n in order if n in waves.pace}},
        **({"sandbox": {**qcfg.sandbox.model_dump(), **sandbox.isolation()}} if "code" in qcfg.slices else {}),
    })


def _side_by_side_groups(qcfg, host, budget, backends: dict, pending: list[str]) -> list[tuple[str, ...]]:
    """The GPU groups the pending variants are scored on side by side (pipeline/quality/gpu_groups.py),
    or [] to score them one after another: vLLM on GPUs, no time budget (a budget's looks are
    planned one variant at a time), more than one group and more than one variant vLLM scores."""
    if host is None or host.platform == "cpu" or budget.active:
        return []
    if sum(backends[n].backend == "vllm" for n in pending) < 2 or any(backends[n].backend != "vllm" for n in pending):
        return []
    groups = device_groups(visible_gpus(qcfg.vllm.devices), qcfg.vllm.tensor_parallel_size)
    return groups if len(groups) > 1 else []


def _one_or_mixed(values: list[str]) -> str:
    """The one value they all have, or "mixed" (meta.json's `backends` then says which is which)."""
    return values[0] if len(set(values)) == 1 else "mixed (see backends)"


def item_inputs(ctx, vdir: Path, ref_dir: Path, data_hashes: dict, named: list,
                backend: dict | None = None) -> tuple[dict, object]:
    """(what a model's lines were scored with: scoring.json's hash, so lines scored with the same
    are kept; a function of `stopped` giving its item's inputs, so what re-opens the item). The
    budget is never in the first (a larger budget continues from the items scored); it is in the
    second when the variant stopped on it (a re-run with another budget re-opens the variant).
    `backend` is what scores the model (vllm_backend.Choice.scored_with: the backend, its
    arguments, the vLLM version, why hf): lines scored otherwise are not kept. With
    quality.backend hf the `quality.vllm` settings are in neither (they change nothing scored)."""
    cfg = ctx.config
    quality = cfg.section("quality")
    if quality.get("backend", "hf") == "hf":
        quality = {k: v for k, v in quality.items() if k != "vllm"}
    scoring = {k: v for k, v in quality.items() if k not in STOPPING_KEYS}
    if isinstance(scoring.get("per_slice"), dict):  # a slice's own wave_items is a stopping key too
        kept = {n: {k: v for k, v in e.items() if k not in STOPPING_KEYS and v is not None}
                for n, e in scoring["per_slice"].items() if isinstance(e, dict)}
        scoring["per_slice"] = {n: e for n, e in kept.items() if e}  # an entry left empty says nothing
    if "vllm" in scoring:
        scoring["vllm"] = {k: v for k, v in scoring["vllm"].items() if k not in VLLM_STOPPING_KEYS}
    scored_with = {"variant_meta": sha256_file(vdir / "meta.json"), "data": data_hashes,
                   "tasks": {s.name: s.info() for s in named}, "quality": scoring,
                   "device": cfg.device, "seed": cfg.seed,
                   # The stage's code: a fix in a scorer re-scores (the lines are not kept).
                   "code": ctx.code, **({"backend": backend} if backend is not None else {})}
    inputs = {**scored_with, "reference_meta": sha256_file(ref_dir / "meta.json"),
              "quality": quality, "gate": cfg.section("gate"), "confidence": cfg.confidence,
              "release": sorted(n for n, v in cfg.quantize.variants.items() if v.release)}
    stage_budget = {"minutes": cfg.budget.minutes, "share": cfg.budget.shares.get("quality")}

    def inputs_for(stopped: bool) -> dict:
        return {**inputs, "budget": stage_budget} if stopped else inputs
    return scored_with, inputs_for


def _read_meta(vdir: Path) -> dict:
    """A directory's meta.json, {} where it is missing or unreadable."""
    try:
        meta = json.loads((vdir / "meta.json").read_text())
    except (json.JSONDecodeError, OSError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _budget_stopped(meta_path: Path) -> bool:
    """Whether a variant's last finished scoring skipped a look on the budget (its meta.json)."""
    return bool((_read_meta(meta_path.parent).get("budget") or {}).get("stopped"))


def _announce_plan(budget: StageBudget, waves: "Waves", reference: str, pending: list[str], first: bool) -> None:
    """The stage's estimate: every slice of the reference and the variants to be scored to its
    maximum (the most the plan may score), at the seconds per item measured so far (before any
    look: an earlier run's, kept in scoring.json, or unknown)."""
    if not pending:  # nothing to score but what the reference lacks for variants already done
        return
    ref_left = waves.items_left(reference)
    per_variant = {n: waves.items_left(n) for n in pending}
    total = sum(ref_left.values()) + sum(sum(v.values()) for v in per_variant.values())
    costs = [waves.model_cost(reference, ref_left, reference)] + [
        waves.model_cost(n, v, reference) for n, v in per_variant.items()]
    est = None if any(c is None for c in costs) else sum(costs)
    firsts = [waves.model_cost(n, waves.first_items(n), reference) for n in pending]
    first_s = None if any(c is None for c in firsts) else sum(firsts)
    rates = waves.pace[reference].to_json()["per_item_s"] if reference in waves.pace else {}
    if first:
        what = (f"up to {total} items: the reference and {len(pending)} variant(s) to every slice's maximum "
                f"({', '.join(str(s) + ' ' + str(p['n_max']) for s, p in waves.plans.items())})"
                + ("" if est is not None else "; s/item not measured yet"))
    else:
        what = (f"after the reference's first look (s/item: "
                f"{', '.join(f'{s} {r:.2f}' for s, r in rates.items()) or '-'}): up to {total} more items; "
                f"the variants' first looks ~{fmt_s(first_s)}")
    budget.announce(what, est)


# Config keys that change when scoring stops, never what an item scores: a run that changes only
# these re-uses every item already scored.
STOPPING_KEYS = ("wave_items", "max_items", "items_per_slice", "distribution_docs",
                 "distribution_tokens")
# quality.vllm keys that change where engines live or what happens after scoring, never a line:
# what falling back does is in the variant's backend (item_inputs' `backend`).
VLLM_STOPPING_KEYS = ("keep_reference", "distribution", "fallback", "devices")


def _write_summary(ctx, name: str, reference: str, tasks: list[str]) -> None:
    vdir = ctx.out_dir / name
    conf = ctx.config.confidence
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


def _check_same_ids(out_dir: Path, order: list[str], tasks: list[str], waved: set[str] = frozenset()) -> None:
    """The gate pairs items by id: every variant must have scored the reference's ids (on a slice
    scored in waves, the first ones of them: the reference scored what any variant needed)."""
    for task in tasks:
        ref_ids = [r["id"] for r in read_jsonl(out_dir / order[0] / f"{task}.jsonl")]
        for name in order[1:]:
            ids = [r["id"] for r in read_jsonl(out_dir / name / f"{task}.jsonl")]
            want = ref_ids[:len(ids)] if task in waved else ref_ids
            if ids != want:
                raise StageError(f"quality: {name} scored other '{task}' items than {order[0]} "
                                 f"({len(ids)} vs {len(ref_ids)}); delete {out_dir / name} and re-run")

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

import time

from evals import sandbox
from pipeline.core.budget import StageBudget
from pipeline.core.device import resolve_device
from pipeline.core.stage import StageContext, StageError, atomic_write_bytes, hash_obj, progress, sha256_file
from pipeline.decode.cache import collect
from pipeline.models.loading import load_tokenizer
from pipeline.quality import distribution, lm_tasks, vllm_backend
from pipeline.quality.evaluate import evaluate, write_summaries
from pipeline.quality.items import (KNOWN_SLICES, builtin_task_config, cost_weights, prompt_tokens_of, slice_data,
                                    task_looks)
from pipeline.quality.waves import (Waves, budget_stopped, item_inputs, pace_priors, read_meta,
                                    score_in_waves, score_variants, share)
from pipeline.variants.schemes import load_variant


def precheck(config, args: dict | None = None) -> None:
    """Before any work starts (also run by `prepare` and `evaluate`): known slices and
    `quality.tasks` names (no data is read); with `backend: vllm`, .venv-vllm, the drift the gate's
    thresholds need, and (fallback: stop) no variant the config already shows vLLM cannot load."""
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
    vdirs = {name: ctx.run_dir / variants[name]["dir"] for name in order}

    # What scores each model, decided before any work (fallback: stop ends the stage here).
    host = vllm_backend.Host.of(cfg, ctx.out_dir / "logs") if qcfg.backend == "vllm" else None
    version = vllm_backend.vllm_version() if host else None
    backends = {name: vllm_backend.choose(qcfg, vdirs[name], cfg.seed, name,
                                          platform=host.platform if host else "cuda", version=version)
                for name in order}
    for name, chosen in backends.items():
        if chosen.why:
            progress(f"quality: {name}: {chosen.why}; scored with the hf backend")
    engines = vllm_backend.Engines(keep=reference if qcfg.vllm.keep_reference else None, host=host)
    drift = qcfg.backend == "hf" or qcfg.vllm.distribution

    # The items every model scores, in wave order, written once (their hashes are in every input).
    ref_dir = vdirs[reference]
    ref_tokenizer = load_tokenizer(ref_dir)
    blobs, plans = {}, {}
    for name in qcfg.slices:
        blobs[name], plans[name] = slice_data(name, qcfg, cfg.seed, ref_tokenizer)
    named, skipped = lm_tasks.resolve(qcfg.tasks, qcfg, cfg.seed)
    for s in named:
        if s.name in plans:
            raise StageError(f"quality.tasks: '{s.name}' has the name of a quality slice; "
                             "list it under one of quality.slices or quality.tasks")
        blobs[s.name], plans[s.name] = s.rows, task_looks(s, qcfg)
    files = {name: ctx.out_dir / "data" / f"{name}.jsonl" for name in blobs}
    for name, path in files.items():
        if not path.is_file() or path.read_bytes() != blobs[name]:
            atomic_write_bytes(path, blobs[name])
    data_files = {name: files[name] for name in qcfg.slices}
    lines = {name: blob.splitlines(keepends=True) for name, blob in blobs.items()}
    data_hashes = {name: sha256_file(path) for name, path in files.items()}
    prompt_tokens = prompt_tokens_of(ref_tokenizer, data_files)
    models: dict = {}  # name -> (model, tokenizer); the reference stays loaded for every variant
    budget = StageBudget(cfg, "quality", run_dir=ctx.run_dir)

    def load(name: str) -> tuple[tuple, float]:  # ((model, tokenizer), seconds loading took now)
        if name in models:
            return models[name], 0.0
        progress(f"quality: {name}: loading {vdirs[name]}")
        start = time.perf_counter()
        models[name] = load_variant(vdirs[name], device)
        return models[name], time.perf_counter() - start

    def scorer(name: str, engines=engines):
        choice = backends[name]

        def score(configs: dict, tasks: list):
            cache = None
            if choice.backend == "vllm":
                if models:  # an hf-loaded model leaves the GPUs to the engine
                    models.clear()
                    collect(device)
                if name not in engines.loaded:
                    progress(f"quality: {name}: starting vLLM on {vdirs[name]} "
                             f"(tensor_parallel_size {qcfg.vllm.tensor_parallel_size})")
                lm, loaded = engines.get(name, choice.kwargs)
                model, tok = lm, lm.tokenizer
                # Answers are kept until the look is written: a look the engine dies in resumes from them.
                cache = ctx.out_dir / name / f"requests-{hash_obj(choice.scored_with())[:12]}"
            else:
                if name not in models:
                    engines.release(keep=engines.keep)  # vLLM's engines hold the GPUs' memory
                (model, tok), loaded = load(name)
            try:
                records, counters = evaluate(model, tok, configs, tasks, qcfg, cfg.seed, cache=cache)
            except Exception as e:
                why = engines.died(name)
                if why is None:
                    raise
                engines.release(name)
                raise StageError(f"quality: {name}: {why}; the looks already written are kept and the "
                                 "requests it answered are cached: run again to resume") from e
            # The load is not the items' cost (Waves' pace leaves it out of seconds per item).
            return records, {**counters, **({"load_seconds": loaded} if loaded else {})}
        return score

    weights = {**cost_weights(qcfg, data_files, prompt_tokens),
               **{s.name: lm_tasks.cost_weight(s, ref_tokenizer) for s in named}}
    waves = Waves(ctx.out_dir, lines, plans, named,
                  lambda files: {s: builtin_task_config(s, f, qcfg.max_new_tokens_for(s), qcfg.sandbox)
                                 for s, f in files.items()}, weights=weights)
    waves.prior = pace_priors({n: read_meta(vdirs[n]) for n in order}, reference)
    items, inputs_of = {}, {}
    for name in order:
        scored_with, inputs_of[name] = item_inputs(ctx, vdirs[name], ref_dir, data_hashes, named,
                                                   backends[name].scored_with())
        items[name] = waves.open(ctx.item(name, inputs_of[name](budget_stopped(ctx.out_dir / name))),
                                 scored_with)
        if items[name].fresh:
            progress(f"quality: {name} up to date")

    pending = [n for n in order[1:] if not items[n].fresh]
    waves.announce(budget, reference, pending, first=True)
    ref_score = scorer(reference)
    waves.first_look(reference, ref_score)
    waves.announce(budget, reference, pending, first=False)
    for name in order[1:]:
        if items[name].fresh:
            waves.cover(reference, ref_score, waves.scored(name))  # the reference holds its items
    drift_cache: dict = {}

    def measure_drift(name: str) -> None:  # through transformers
        engines.release(name)
        path = ctx.out_dir / name / "distribution.json"
        if not drift:  # not measured: an earlier run's figures would not be this run's
            path.unlink(missing_ok=True)
            return
        engines.release()
        (ref_model, ref_tok), _ = load(reference)
        (var_model, _), _ = load(name)
        distribution.write_drift(path, ref_model, var_model, ref_tok, qcfg, device, drift_cache)

    def drop_request_cache(name: str) -> None:
        for f in (ctx.out_dir / name).glob("requests-*.db"):
            f.unlink()

    def unload(name: str) -> None:
        engines.release(name)
        models.pop(name, None)
        collect(device)  # the variant's memory back before the next one loads

    def finish(name: str) -> None:
        # Its item's inputs hold the budget only when a look was skipped on it.
        items[name].input_hash = ctx.item(name, inputs_of[name](waves.stopped(name))).input_hash
        waves.finish(name, qcfg.evaluator, backends[name].record(qcfg.evaluator))
        drop_request_cache(name)
        unload(name)

    groups = vllm_backend.groups_for(qcfg, host, budget, backends, pending)
    if groups:
        # The reference first to every slice's last look, so no variant waits on its engine.
        waves.cover(reference, ref_score, {s: p["n_max"] for s, p in plans.items()})
        engines.release()
        progress(f"quality: {len(pending)} variants side by side on {len(groups)} GPU groups "
                 f"({'; '.join(','.join(g) for g in groups)})")

        def one(name: str, group: tuple[str, ...]) -> None:
            own = vllm_backend.Engines(host=host.on(group))
            try:
                score_in_waves(waves, reference, name, ref_score, scorer(name, own), cfg, share(budget, 1))
            finally:
                own.release()

        vllm_backend.side_by_side(pending, groups, one)
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
    metas = {name: read_meta(items[name].path) for name in order}
    # What scored each model, from its own meta.json (a variant finished earlier keeps its record).
    ran = {name: {"backend": "hf", **{k: m[k] for k in ("backend", "evaluator", "backend_reason", "vllm_version")
                                      if m.get(k) is not None}} for name, m in metas.items()}
    write_summaries(ctx.out_dir, order, list(plans), cfg.confidence)
    evaluators = {r.get("evaluator", qcfg.evaluator) for r in ran.values()}
    ctx.meta.update({
        "variants": order, "reference": reference, "slices": list(qcfg.slices),
        "tasks": [s.name for s in named], "task_details": {s.name: s.info() for s in named},
        "skipped_tasks": skipped, "items_per_slice": qcfg.items_per_slice,
        "max_items": qcfg.max_items, "wave_items": qcfg.wave_items,
        "sequential": {s: {"looks": p["looks"], "n_max": p["n_max"], "order": p["order"],
                           "spending": cfg.gate.spending} for s, p in plans.items()},
        "generation": {"greedy": True, "max_new_tokens": qcfg.max_new_tokens,
                       "chat_template": qcfg.chat_template, "batch_size": qcfg.batch_size,
                       "evaluator": evaluators.pop() if len(evaluators) == 1 else "mixed (see backends)"},
        "backends": ran,  # per model, what scored it, never what was asked
        **({"distribution_drift": "not measured: quality.backend vllm without quality.vllm.distribution"}
           if not drift else {}),
        "data_sha256": data_hashes, "prompt_tokens": prompt_tokens,
        "timing": {name: {k: m.get(k) for k in ("items", "eval_seconds", "items_per_second", "counters",
                                                 "items_scored")} for name, m in metas.items()},
        "items": {s: len(v) for s, v in lines.items()},
        # What the stage planned, spent and skipped; per variant and slice the looks done and
        # skipped and why (the gate reads it: pipeline/gate/decision.py).
        "budget": {**budget.to_json(), "variants": {n: metas[n].get("budget") for n in order[1:]},
                   "pace_s_per_item": {n: waves.pace[n].to_json()["per_item_s"] for n in order if n in waves.pace}},
        **({"sandbox": {**qcfg.sandbox.model_dump(), **sandbox.isolation()}} if "code" in qcfg.slices else {}),
    })

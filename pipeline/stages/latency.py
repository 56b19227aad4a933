"""The latency stage: real decode time of every variant, and of every (target, draft) pair across k.

    python -m pipeline latency --run runs/smollm2-135m --config configs/default.yaml

Writes `latency/<variant>.json` (the plain grid: pipeline/latency/grid.py) and
`latency/<variant>__<draft_slug>.json` (B = 1 round time by drafted count on the acceptance
workload: pipeline/latency/speculative.py) for the pairs the vllm stage did not measure. Each model's
memory plan (pipeline/latency/memory.py) runs first, a screen (pipeline/latency/screen.py) skips
pairs that cannot pay. Method: docs/methods/stages.md, marginal.md, budget.md, gpu-box.md.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from draft_models.registry import build_draft, draft_slug, engine_specs
from pipeline.core.budget import StageBudget, fmt_s
from pipeline.core.device import resolve_device
from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_json, progress, read_json,
                                 sha256_file)
from pipeline.decode.cache import collect, release_caches
from pipeline.latency.grid import add_reference_ratios, plain_grid
from pipeline.latency.memory import cache_len
from pipeline.latency.roofline import measure_bandwidth
from pipeline.latency.screen import DOES_NOT_PAY, cut_line, ks_to_time, reason, screen_pair, summary
from pipeline.latency.speculative import speculative_pair
from pipeline.models.architecture import context_length
from pipeline.models.kernels import device_name, quantized_kernels
from pipeline.report.figures import tpot_ratio_plot
from pipeline.speculation.measure import temp_key
from pipeline.speculation.workload import prompt_limit_inputs, workload_prompts, workload_summary
from pipeline.stages.targets import engine_drafts, speculation_targets, vllm_measured
from pipeline.variants.schemes import load_variant

# With a time budget (pipeline/core/budget.py) the plain grids get this share of the stage's time,
# the pairs the rest; within a phase each piece gets an even split of what the phase has left.
PHASE_SHARES = {"grids": 0.3, "pairs": 1.0}


def workload_inputs(cfg) -> dict:
    """The config keys that choose the workload's prompts, hashed as the acceptance stage hashes
    them (prompt_limit_inputs), so the two stages draw the same prompts and re-run together."""
    acc = cfg.section("acceptance")
    out = {key: acc[key] for key in ("workload", "workload_prompts", "categories", "workload_sha256")}
    out["prompt_limit"] = prompt_limit_inputs(cfg)
    return out


def _variant_dirs(ctx: StageContext) -> dict[str, Path]:
    """variant -> its directory (the quantize stage's listing, else every variants/*/meta.json)."""
    listed = ctx.upstream.get("quantize", {}).get("variants") or {}
    names = list(listed) or [p.parent.name for p in sorted((ctx.run_dir / "variants").glob("*/meta.json"))]
    if not names:
        raise StageError(f"latency: no variants in {ctx.run_dir / 'variants'} (run make quantize first)")
    dirs = {name: ctx.run_dir / ((listed.get(name) or {}).get("dir") or f"variants/{name}") for name in names}
    for name, d in dirs.items():
        if not (d / "meta.json").is_file():
            raise StageError(f"latency: variant '{name}' has no meta.json at {d}")
    return dirs


def run(ctx: StageContext) -> None:
    cfg, lat = ctx.config, ctx.config.latency
    if lat.new_tokens < 2:
        raise StageError("latency.new_tokens must be >= 2 (TPOT is undefined for one output token)")
    if lat.repeats < 1 or lat.warmup < 0:
        raise StageError("latency.repeats must be >= 1 and latency.warmup >= 0")
    device = resolve_device(cfg.device)
    k_max = lat.k_max or cfg.vllm.k_max or cfg.acceptance.k_max
    dirs = _variant_dirs(ctx)
    targets = speculation_targets(cfg, ctx.run_dir)
    for target in targets:
        if target not in dirs:
            raise StageError(f"latency: target '{target}' is not a variant ({', '.join(dirs)})")
    ctx.meta.update(device=str(device), device_name=device_name(device),
                    memory_plan={"plain": {}, "speculative": {}},
                    kernels={}, threads=torch.get_num_threads(),
                    load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)
    budget = StageBudget(cfg, "latency", run_dir=ctx.run_dir)
    budget.announce(f"plain grids of {len(dirs)} variants ({PHASE_SHARES['grids']:.0%} of the budget), then "
                    f"{len(targets) * len(cfg.drafts)} pairs at B = 1 (the rest); each piece's estimate follows its "
                    "first repeat", None)
    # The latency section as the items key on it, without `screen`: it decides whether a pair is timed, not how.
    timing = {**{k: v for k, v in cfg.section("latency").items() if k != "screen"}, "confidence": cfg.confidence}
    _plain_grids(ctx, dirs, device, budget, timing)
    _speculative_pairs(ctx, dirs, targets, list(range(1, k_max + 1)), device, budget, timing)
    ctx.meta["budget"] = {**budget.to_json(), "phase_shares": PHASE_SHARES}


def _plain_grids(ctx: StageContext, dirs: dict[str, Path], device, budget: StageBudget, timing: dict) -> None:
    """Every variant's plain decode grid, then each one's TPOT against the reference's."""
    cfg = ctx.config
    common = {"latency": timing, "device": str(device), "seed": cfg.seed}
    bandwidth: dict | None = None
    items = {name: ctx.item(f"{name}.json", {**common, "variant": read_json(d / "meta.json").get("input_hash")
                                              or str(d)}, is_dir=False) for name, d in dirs.items()}
    phase = budget.part("plain grids", PHASE_SHARES["grids"])
    pending = [name for name, item in items.items() if not item.fresh]
    for name, d in dirs.items():
        item = items[name]
        if item.fresh:
            # A resumed run keeps the bandwidth its grids were measured against in meta.json.
            ctx.meta.setdefault("bandwidth", read_json(item.path).get("bandwidth"))
            continue
        if bandwidth is None:  # measured once, and only when a grid is timed
            progress("latency: measuring device bandwidth (large tensor copy)")
            bandwidth = ctx.meta["bandwidth"] = measure_bandwidth(device)
        model, _ = load_variant(d, device=device)
        doc = plain_grid(name, model, cfg.latency, device, bandwidth, cfg.seed, cfg.confidence,
                         budget=phase.piece(f"{name} grid", len(pending) - pending.index(name)))
        _record(ctx.meta, "plain", name, doc)
        item.write_json(doc)
        release_caches(model)
        del model
        collect(device)  # before the next variant loads and its plan measures the free memory
    reference = cfg.quantize.reference
    if reference in dirs:
        grids = {name: read_json(ctx.out_dir / f"{name}.json", "latency grid") for name in dirs}
        for name, grid in grids.items():  # a cheap join, redone on every run: never stale
            if add_reference_ratios(grid, grids[reference], cfg.confidence, cfg.seed):
                atomic_write_json(ctx.out_dir / f"{name}.json", grid)
        png = tpot_ratio_plot(grids, reference)
        if png:
            atomic_write_bytes(ctx.out_dir / "tpot_ratio.png", png)


def _pending_pairs(ctx: StageContext, dirs: dict[str, Path], target: str, inputs: dict) -> dict:
    """draft spec -> the item of (target, draft) that is not yet current. A screened item, or one
    the screen cut to fewer k, is current only while latency.screen is on and its acceptance JSON
    is the one it was screened against; a current item's screen goes into meta.json."""
    target_hash = read_json(dirs[target] / "meta.json").get("input_hash") or target
    pending = {}
    served = vllm_measured(ctx.run_dir)
    for spec in engine_drafts(engine_specs(ctx.config.drafts, "latency"), target, "latency",
                              reference=ctx.config.quantize.reference):
        slug = draft_slug(spec)
        if f"{target}__{slug}" in served:  # measured where it is served (the vllm stage): not timed here
            ctx.meta.setdefault("measured_in_vllm", []).append(f"{target}__{slug}")
            continue
        dmeta = ctx.run_dir / "drafts" / slug / "meta.json"
        item = ctx.item(f"{target}__{slug}.json", {**inputs, "target": target_hash, "draft": spec, "draft_meta":
                                                   read_json(dmeta).get("input_hash") if dmeta.is_file() else None},
                        is_dir=False)
        screened = item.meta.get("screened") if item.fresh else None
        rec = screened or (item.meta.get("screen") if item.fresh and item.meta.get("ks_not_timed") else None)
        if item.fresh and item.meta.get("not_timed"):  # the budget ran out before it: time it now
            item.fresh = False
        if rec and (not ctx.config.latency.screen
                    or (rec.get("acceptance") or {}).get("sha256") != _acceptance_source(ctx, target, spec)["sha256"]):
            item.fresh = False
        if not item.fresh:
            pending[spec] = item
        elif screened or item.meta.get("screen"):
            _note_screen(ctx, target, spec, screened or item.meta["screen"])
    return pending


def _not_timed(ctx: StageContext, target: str, pending: dict, budget: StageBudget) -> bool:
    """Where the stage's time is spent, the target's pending pairs each get a `not_timed`
    document (no k is recommended from it; a re-run with time left times it)."""
    if not budget.active or budget.left() > 0:
        return False
    why = f"budget: the latency stage's {fmt_s(budget.seconds)} were spent before this pair"
    for spec, item in pending.items():
        name = f"{target}__{draft_slug(spec)}"
        budget.skip(f"{name}: not timed", why)
        item.write_json({"variant": target, "draft": spec, "not_timed": why})
        ctx.meta.setdefault("not_timed", []).append(name)
    pending.clear()
    return True


def _acceptance_source(ctx: StageContext, target: str, spec: str) -> dict:
    """The screen record's note of the pair's acceptance JSON (without one the bound takes k + 1
    tokens per round)."""
    path = ctx.run_dir / "acceptance" / f"{target}__{draft_slug(spec)}.json"
    if not path.is_file():
        return {"file": None, "sha256": None, "note": "no acceptance JSON: E_hi(k) = k + 1"}
    return {"file": str(path.relative_to(ctx.run_dir)), "sha256": sha256_file(path), "slice": "all"}


def _note_screen(ctx: StageContext, target: str, spec: str, rec: dict) -> None:
    """meta.json's `screened`: pair -> {"speculative": the screen's verdict and bound}."""
    ctx.meta.setdefault("screened", {}).setdefault(f"{target}__{draft_slug(spec)}", {})["speculative"] = summary(rec)


def _screen_b1(ctx: StageContext, target: str, spec: str, model, draft, prompts: dict, ks: list[int], device,
               item) -> dict:
    """The B = 1 screen of one pair; writes the pair's JSON, not timed, when it does not pay."""
    cfg, lat = ctx.config, ctx.config.latency
    source = _acceptance_source(ctx, target, spec)
    acceptance = read_json(ctx.run_dir / source["file"], "acceptance artifact") if source["file"] else None
    rows = [(pid, ids) for kind_rows in prompts.values() for pid, ids in kind_rows]
    pid, ids = min(rows, key=lambda r: (len(r[1]), r[0]))  # the shortest prompt: the cheapest prefill
    length = cache_len(max(len(r[1]) for r in rows), lat.new_tokens)
    rec = screen_pair(model, draft, ids, ks, acceptance, cfg.acceptance, device, length, seed=cfg.seed, prompt_id=pid)
    rec["acceptance"] = source
    pays = rec["verdict"] != DOES_NOT_PAY  # always, for a model-free draft
    said = f"{rec['verdict']} ({reason(rec)}), " + ("timing" if pays else "not timed")
    if rec["model_free"]:
        said = "not screened (drafts without a model forward), timing"
    progress(f"latency: {target} + {spec}: {said}")
    _note_screen(ctx, target, spec, rec)
    if not pays:
        rec["skipped"] = (f"B = 1 round times at k = {ks[0]}..{ks[-1]} and plain decoding on {len(rows)} prompts x "
                          f"{len(cfg.acceptance.temperatures)} temperatures, every latency repeat")
        item.write_json({
            "variant": target, "draft": spec, "device": str(device), "device_name": device_name(device),
            "prompts": {kind: [p for p, _ in kind_rows] for kind, kind_rows in prompts.items()},
            "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats, "repeats_done": 0,
            "stopped": "screened", "timing_unit": None,
            "primary_temperature": temp_key(min(cfg.acceptance.temperatures)),
            "plain_ms_per_token": None, "rows": [], "by_temperature": {}, "cache_len": length, "memory_plan": None,
            "kernels": quantized_kernels(model), "draft_kernels": quantized_kernels(draft.model),
            "screened": rec, "workload": workload_summary(prompts)})
    return rec


def _speculative_pairs(ctx: StageContext, dirs: dict[str, Path], targets: list[str], ks: list[int], device,
                       budget: StageBudget, timing: dict) -> None:
    """B = 1 round times of every (target, draft) pair on the acceptance prompts and temperatures."""
    cfg, lat = ctx.config, ctx.config.latency
    acc_inputs = {key: cfg.section("acceptance")[key] for key in ("temperatures", "sampling", "prompts_per_kind")}
    acc_inputs.update(workload_inputs(cfg))
    inputs = {"latency": timing, "device": str(device), "seed": cfg.seed, "ks": ks, "acceptance": acc_inputs}
    phase = budget.part("B = 1 pairs", PHASE_SHARES["pairs"])
    pending_by_target = {target: _pending_pairs(ctx, dirs, target, inputs) for target in targets}
    ctx.meta["screen"] = "on" if lat.screen else "off (latency.screen: false)"
    if not lat.screen:
        progress(f"latency: screen {ctx.meta['screen']}")
    for target in targets:
        pending = pending_by_target[target]
        if not pending or _not_timed(ctx, target, pending, budget):
            continue
        model, tok = load_variant(dirs[target], device=device)
        prompts = workload_prompts(cfg, tok, "latency", lat.speculative_prompts_per_kind or None,
                                   context=context_length(model))
        drafts = {spec: build_draft(spec, model, tok, ctx.run_dir, device) for spec in pending}
        screens = {}
        if lat.screen:
            for spec in list(pending):
                screens[spec] = _screen_b1(ctx, target, spec, model, drafts[spec], prompts, ks, device, pending[spec])
                if screens[spec]["verdict"] == DOES_NOT_PAY:
                    del pending[spec]
        for spec, item in pending.items():
            t0 = time.time()
            left = sum(len(p) for p in pending_by_target.values())  # pairs still to time, this one included
            pending_by_target[target] = {s: i for s, i in pending_by_target[target].items() if s != spec}
            pair_ks, cut = ks_to_time(screens[spec], ks) if spec in screens else (list(ks), {})
            if cut:  # the k past the last whose bound reaches 1 are not timed
                screens[spec]["ks_not_timed"] = cut
                progress(f"latency: {target} + {spec}: {cut_line(pair_ks, cut)}")
                _note_screen(ctx, target, spec, screens[spec])
            doc = speculative_pair(target, spec, model, drafts[spec], prompts, lat, cfg.acceptance,
                                   device, cfg.confidence, cfg.seed, pair_ks,
                                   budget=phase.piece(f"{target} + {spec}", left))
            doc.update(ks_asked=ks, ks_timed=pair_ks, ks_not_timed=cut)
            doc["workload"] = workload_summary(prompts)
            if spec in screens:
                doc["screen"] = screens[spec]
            _record(ctx.meta, "speculative", f"{target}__{draft_slug(spec)}", doc)
            item.write_json(doc)
            progress(f"latency: {target}__{draft_slug(spec)} done in {time.time() - t0:.0f} s")
        release_caches(model, *(getattr(d, "model", None) for d in drafts.values()))
        del model, drafts
        collect(device)  # before the next target's plan


def _record(meta: dict, phase: str, name: str, doc: dict) -> None:
    """What ran, into the stage's meta.json: the memory plan, the kernels, the attention path."""
    meta["memory_plan"][phase][name] = doc["memory_plan"]
    if phase == "plain":
        meta["kernels"][name] = doc["kernels"]
        meta.setdefault("attention", {})[name] = doc.get("attention_path")

"""The gate's decision: go / no-go / inconclusive per variant and slice, from paired per-item scores.

    from pipeline.gate.decision import build_gate
    gate = build_gate(run_dir, config)          # what gate.json holds (the gate stage writes it)

Each cell bounds the variant - reference difference over the same items: pass if the lower bound
is above -margin, fail if the upper bound is below it. A variant is go when every cell passes,
no-go when any fails. The quality stage stops with the same `open_slices`. Method:
docs/methods/gate.md.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from pipeline.core.stage import StageError, progress, read_json
from pipeline.gate import looks as looks_mod
from pipeline.gate.items import by_item, item_clusters, pair_items, read_items, unscored_slices
from pipeline.gate.speculation import speculation
from pipeline.gate.stops import budget_stops, quality_budget, schedules, stop_fields
from pipeline.stats import paired as stats, scoring_rules

# gate-check's exit status per decision (2 is bad input): a contract release jobs rely on.
EXIT_CODES = {"go": 0, "no-go": 1, "inconclusive": 3}
# Power of an open cell's items_to_settle (if the observed difference were the truth): a guide only.
SETTLE_POWER = 0.8


def slice_estimates(ref: dict, var: dict, ids: list[str], codes: np.ndarray,
                    gcfg) -> tuple[dict[str, stats.Estimate], dict | None]:
    """Row key -> estimate (the slice's primary metric, plus per-item Brier on calibration items),
    and the calibration errors reported beside them (None without option probabilities)."""
    metric = ref[ids[0]]["metric"] or "score"
    out = {"": stats.paired_difference([ref[i]["score"] for i in ids], [var[i]["score"] for i in ids],
                                       codes, metric=metric)}
    calibrated = all(m[i]["option_probs"] is not None and m[i]["label"] is not None
                     for m in (ref, var) for i in ids)
    if not (gcfg.calibration_metrics and calibrated):
        return out, None
    try:
        probs = {k: ([m[i]["option_probs"] for i in ids], [m[i]["label"] for i in ids])
                 for k, m in (("reference", ref), ("variant", var))}
        brier = {k: scoring_rules.brier_per_item(*v) for k, v in probs.items()}
        summary = {k: scoring_rules.calibration_summary(*v) for k, v in probs.items()}
    except (ValueError, IndexError, TypeError) as e:
        raise StageError(f"corrupt calibration item: {e}") from None
    out["brier"] = stats.paired_difference(brier["reference"], brier["variant"], codes, metric="brier",
                                           higher_is_better=False, score_range=(0.0, 2.0))
    reported = {name: {"reference": summary["reference"][name], "variant": summary["variant"][name],
                       "diff": summary["reference"][name] - summary["variant"][name] + 0.0}
                for name in ("ece_debiased", "ece")}
    reported["gated"] = False
    reported["note"] = ("calibration errors, lower is better, diff = reference - variant (negative "
                        "= worse); ece_debiased: Kumar et al. 2019 l2 estimator, equal-mass bins")
    return out, reported


def group_estimates(ref: dict, var: dict, ids: list[str], codes: np.ndarray) -> dict[str, stats.Estimate]:
    groups: dict[str, list[int]] = defaultdict(list)
    for k, i in enumerate(ids):
        if ref[i]["group"] is not None:
            groups[str(ref[i]["group"])].append(k)
    return {g: stats.paired_difference([ref[ids[k]]["score"] for k in ks], [var[ids[k]]["score"] for k in ks],
                                       codes[ks], metric=ref[ids[ks[0]]]["metric"])
            for g, ks in sorted(groups.items()) if len(ks) >= 2}


def _margin(gcfg, key: str, slice_name: str) -> float:
    """A metric row (`calibration:brier`) has its own units and margin; a slice or group row: its
    key's margin, else its slice's, else the default."""
    if ":" in key:
        metric = key.split(":", 1)[1]
        default = gcfg.brier_margin if metric == "brier" else gcfg.margin
        return float(gcfg.margins.get(key, default))
    return float(gcfg.margins.get(key, gcfg.margins.get(slice_name, gcfg.margin)))


def _cell(est: stats.Estimate, margin: float, alpha_lo: float, alpha_hi: float,
          p_adj: tuple[float, float] | None) -> dict:
    lo, hi = est.ci(alpha_lo, alpha_hi)
    status = stats.noninferiority_status(lo, hi, margin)
    settle = None
    if status == "inconclusive":
        # Settling means reaching pass (diff above -margin) or fail (below): the side it is on.
        settle = est.items_needed(margin, alpha_lo if est.diff > -margin else alpha_hi, SETTLE_POWER)
    return {
        "metric": est.metric, "higher_is_better": est.higher_is_better,
        "reference": est.reference, "variant": est.variant, "diff": est.diff, "ci": [lo, hi],
        "ci_level": 1 - alpha_lo - alpha_hi, "alpha_lower": alpha_lo, "alpha_upper": alpha_hi,
        "margin": margin, "n": est.n, "n_clusters": est.n_clusters, "se": est.se,
        "design_effect": est.design_effect, "method": est.method,
        "p_noninferior": est.p_pass(margin), "p_inferior": est.p_fail(margin),
        "p_adjusted": list(p_adj) if p_adj else None, "status": status, "items_to_settle": settle,
        # 0/1 cells: clusters above the design effect, bounded at their worst case (paired.cluster_split).
        "worst_case_clusters": getattr(est, "large_clusters", 0),
        "worst_case_share": getattr(est, "large_share", 0.0),
    }


def distribution_checks(summary: dict, gcfg) -> dict:
    """Optional thresholds on KL and top-1 agreement, judged on the CI quality reported."""
    dist = summary.get("distribution") or {}
    out = {k: dist.get(k) for k in ("kl_mean", "kl_ci", "top1_agreement", "top1_ci", "ppl_ratio",
                                    "ppl_ratio_ci", "n_docs")}
    checks = {}
    if gcfg.max_kl is not None:
        checks["kl"] = _threshold_check(dist.get("kl_ci"), gcfg.max_kl, at_most=True)
    if gcfg.min_top1_agreement is not None:
        checks["top1_agreement"] = _threshold_check(dist.get("top1_ci"), gcfg.min_top1_agreement, at_most=False)
    out["checks"] = checks
    return out


def _threshold_check(ci, threshold: float, at_most: bool) -> dict:
    """pass when the whole CI is on the threshold's good side, fail when wholly on the bad side;
    a missing or non-finite CI (quality wrote no measurement) cannot pass: inconclusive."""
    try:
        lo, hi = (float(x) for x in ci)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return {"threshold": threshold, "ci": [None, None], "status": "inconclusive"}
    good, bad = (hi <= threshold, lo > threshold) if at_most else (lo >= threshold, hi < threshold)
    return {"threshold": threshold, "ci": [lo, hi], "status": "pass" if good else "fail" if bad else "inconclusive"}


def decide(statuses: list[str]) -> str:
    """Cells' statuses -> a decision: one fail is no-go, all pass is go, else inconclusive."""
    return overall_decision([{"pass": "go", "fail": "no-go"}.get(s, "inconclusive") for s in statuses])


def overall_decision(decisions: list[str]) -> str:
    """Over the release variants: one no-go blocks; all go ships; anything else waits."""
    if "no-go" in decisions:
        return "no-go"
    return "go" if decisions and all(d == "go" for d in decisions) else "inconclusive"


def release_alpha(cfg) -> tuple[list[str], float, list[str]]:
    """(release variants, one-sided alpha, the variants the pass side is adjusted across: none
    (intersection-union) unless `gate.select_among_variants`)."""
    reference = cfg.quantize.reference
    release = [n for n, v in cfg.quantize.variants.items() if v.release and n != reference]
    return release, (1.0 - cfg.confidence) / 2.0, release if cfg.gate.select_among_variants else []


def pass_alpha(cfg, name: str) -> float:
    """Variant `name`'s pass-side alpha: alpha / r when adjusted across r chosen variants."""
    _, alpha, chosen = release_alpha(cfg)
    return alpha / len(chosen) if name in chosen and cfg.gate.multiplicity != "none" else alpha


def slice_looks(ref: dict, var_rows: list[dict], s: str, sched: dict | None, gcfg,
                where: str) -> tuple[dict, dict, dict | None, dict]:
    """One variant's slice at every look it reached: ({row key: {look index: estimate}}, {row key:
    margin}, calibration errors and {group: estimate} at the last look, the schedule as it
    happened). Without a schedule one look over all items (ids equal to the reference's); with
    one, the variant's items in file order must end at a planned look."""
    var = by_item(var_rows)
    if sched is None:
        order = pair_items(ref, var, where)
        looks, n_max = [len(order)], len(order)
    else:
        order = list(dict.fromkeys(r["id"] for r in var_rows))
        missing = [i for i in order if i not in ref]
        if missing:
            raise StageError(f"{where}: the variant scored items the reference did not "
                             f"({len(missing)}, e.g. {missing[:3]}); re-run quality")
        looks, n_max = sched["looks"], sched["n_max"]
        if len(order) not in looks:
            raise StageError(f"{where}: {len(order)} items scored, not a planned look ({looks}); re-run quality")
    if len(order) < 2:
        raise StageError(f"slice {s} has {len(order)} item(s); the gate needs at least 2")
    done = [n for n in looks if n <= len(order)]
    rows: dict[str, dict[int, stats.Estimate]] = defaultdict(dict)
    reported, gests = None, {}
    for k, n in enumerate(done):
        if n < 2:
            continue
        ids = order[:n]
        codes = item_clusters(ref, ids)
        found, reported = slice_estimates(ref, var, ids, codes, gcfg)
        gests = group_estimates(ref, var, ids, codes)
        for row, est in found.items():
            key = f"{s}:{row}" if row else s
            rows[key][k] = est
        if gcfg.gate_groups:
            for g, est in gests.items():
                rows[f"{s}/{g}"][k] = est
    margins = {key: _margin(gcfg, key, s) for key in rows}
    return dict(rows), margins, reported, {"groups": gests, "looks": looks, "n_max": n_max, "done": done,
                                           "spending": (sched or {}).get("spending") or gcfg.spending}


def variant_rows(quality: Path, reference: str, name: str, cfg, scheds: dict,
                 ref_items: dict | None = None) -> tuple:
    """Every slice of variant `name` at every look its files reach, each row settled: (row key ->
    (deciding look, per-look record), rows, margins, row key -> its slice's schedule, (slice ->
    calibration errors, slice -> group estimates)). The fail side is at
    alpha / m over the variant's m rows (pipeline/gate/looks.py says why)."""
    gcfg = cfg.gate
    ref_dir = quality / reference
    slices = sorted(p.stem for p in ref_dir.glob("*.jsonl"))
    if ref_items is None:
        ref_items = {s: by_item(read_items(ref_dir / f"{s}.jsonl")) for s in slices}
    vdir = quality / name
    rows, margins, row_sched, reported, groups = {}, {}, {}, {}, {}
    for s in slices:
        if not (vdir / f"{s}.jsonl").is_file():
            raise StageError(f"missing artifact: {vdir / f'{s}.jsonl'} (the reference has it)")
        r, m, rep, info = slice_looks(ref_items[s], read_items(vdir / f"{s}.jsonl"), s, scheds.get(s), gcfg,
                                      f"{name}/{s}")
        rows.update(r)
        margins.update(m)
        row_sched.update({k: info for k in r})
        reported[s], groups[s] = rep, info
    alpha = (1.0 - cfg.confidence) / 2.0
    alpha_fail = alpha / len(rows) if gcfg.multiplicity != "none" and rows else alpha
    settled = {key: looks_mod.settle(ests, row_sched[key]["looks"], row_sched[key]["n_max"], margins[key],
                                     pass_alpha(cfg, name), alpha_fail, row_sched[key]["spending"])
               for key, ests in rows.items()}
    return settled, rows, margins, row_sched, (reported, groups)


def open_slices(quality: Path, reference: str, name: str, cfg, scheds: dict) -> tuple[set[str], list[str]]:
    """(slices of variant `name` with an unsettled row and a planned look left, row keys a look has
    failed): the gate's own replay on quality/meta.json's schedules, for the quality stage."""
    settled, _, _, row_sched, _ = variant_rows(quality, reference, name, cfg, scheds)
    out, failed = set(), []
    for key, (_, record) in settled.items():
        sched = row_sched[key]
        if record[-1]["status"] == "inconclusive" and len(sched["done"]) < len(sched["looks"]):
            out.add(key.split(":", 1)[0].split("/", 1)[0])
        elif record[-1]["status"] == "fail":
            failed.append(key)
    return out, failed


def build_gate(run_dir: Path, cfg) -> dict:
    gcfg, qcfg = cfg.gate, cfg.quantize
    reference = qcfg.reference
    release, alpha, chosen = release_alpha(cfg)
    if not release:
        raise StageError("no variant besides the reference is marked release: true, so the gate has "
                         "nothing to decide (mark the variants you would ship in quantize.variants)")
    quality = run_dir / "quality"
    ref_dir = quality / reference
    if not ref_dir.is_dir():
        raise StageError(f"missing artifact: {ref_dir} (the reference's quality results)")
    slices = sorted(p.stem for p in ref_dir.glob("*.jsonl"))
    if not slices:
        raise StageError(f"empty artifact: {ref_dir} has no <slice>.jsonl")
    ref_items = {s: by_item(read_items(ref_dir / f"{s}.jsonl")) for s in slices}
    unscored = unscored_slices(quality, slices)
    scheds = schedules(quality)
    stops = budget_stops(quality)

    variants: dict[str, dict] = {}
    tests: dict[str, dict] = {}  # variant -> row key -> (estimate at its deciding look, margin, ...)
    for name, vcfg in qcfg.variants.items():
        if name == reference:
            continue
        entry = {"decision": "inconclusive", "release": vcfg.release, "scheme": vcfg.scheme,
                 "slices": {}, "missing": [], "stopped_on_budget": []}
        variants[name] = entry
        tests[name] = {}
        if unscored:
            entry["missing_slices"] = dict(unscored)
            entry["missing"] += [f"slice '{k}': {why}" for k, why in unscored.items()]
        vdir = quality / name
        if not vdir.is_dir():
            entry["missing"].append("quality results")
            progress(f"gate: {name} has no quality results; it cannot be go")
            continue
        settled, rows, margins, row_sched, (reported, groups) = variant_rows(
            quality, reference, name, cfg, scheds, ref_items)
        for key, (k, record) in settled.items():
            tests[name][key] = (rows[key][k], margins[key], record, row_sched[key])
        entry["_groups"], entry["_reported"] = groups, reported
        summary_path = quality / f"{name}.json"
        entry["distribution"] = (distribution_checks(read_json(summary_path, "quality summary"), gcfg)
                                 if summary_path.is_file() else {"checks": {}})

    p_go_adjusted = {n: None for n in tests}
    if chosen:
        live = [n for n in chosen if tests.get(n)]
        p_go = [max(est.p_pass(m) for est, m, _, _ in tests[n].values()) for n in live]
        p_go_adjusted.update(zip(live, stats.adjusted_p_values(p_go, alpha, gcfg.multiplicity)[1]))
    for name, cells in tests.items():
        keys = list(cells)
        p_fail = [cells[k][0].p_fail(cells[k][1]) for k in keys]
        fail_adj = stats.adjusted_p_values(p_fail, alpha, gcfg.multiplicity)[1]
        for i, key in enumerate(keys):
            est, margin, record, sched = cells[key]
            p_go = p_go_adjusted[name] if p_go_adjusted[name] is not None else est.p_pass(margin)
            cell = _cell(est, margin, record[-1]["alpha_lower"], record[-1]["alpha_upper"],
                         (p_go, fail_adj[i]))
            cell.update(looks=record, items_spent=est.n, planned_looks=sched["looks"], n_max=sched["n_max"],
                        spending=sched["spending"])
            cell.update(stop_fields(cell["status"], sched,
                                    stops.get(name, {}).get(key.split(":", 1)[0].split("/", 1)[0])))
            variants[name]["slices"][key] = cell
        variants[name]["alpha_pass"] = pass_alpha(cfg, name)
        variants[name]["fail_family_size"] = len(cells)
    for name, entry in variants.items():
        groups, reported = entry.pop("_groups", {}), entry.pop("_reported", {})
        for s, info in groups.items():
            cell = entry["slices"][s]
            if reported.get(s):
                cell["calibration_error"] = reported[s]
            cell["groups"] = {}
            for g, est in info["groups"].items():
                gated = entry["slices"].pop(f"{s}/{g}", None)
                cell["groups"][g] = ({**gated, "gated": True} if gated else
                                     {**_cell(est, _margin(gcfg, f"{s}/{g}", s), alpha, alpha, None),
                                      "gated": False})

    for name, entry in variants.items():
        statuses = [c["status"] for c in entry["slices"].values()]
        statuses += [g["status"] for c in entry["slices"].values() for g in c.get("groups", {}).values()
                     if g["gated"]]
        statuses += [c["status"] for c in entry.get("distribution", {}).get("checks", {}).values()]
        # Cells left open because the quality stage's time budget ran out (not the data).
        entry["stopped_on_budget"] = [k for k, c in entry["slices"].items() if c.get("stopped_on") == "budget"] + [
            f"{k}/{g}" for k, c in entry["slices"].items() for g, gc in (c.get("groups") or {}).items()
            if gc.get("stopped_on") == "budget"]
        # A fail is a fail whatever else is missing; without one, a missing slice keeps it from go.
        entry["decision"] = ("no-go" if "fail" in statuses else
                             "inconclusive" if entry["missing"] else decide(statuses))
    return {
        "decision": overall_decision([variants[n]["decision"] for n in release]),
        "reference": reference,
        "release_variants": release,
        "confidence": cfg.confidence,
        "alpha_one_sided": alpha,
        "multiplicity": gcfg.multiplicity,
        "spending": gcfg.spending,
        "select_among_variants": gcfg.select_among_variants,
        # The largest family any bound is adjusted over (kept from the single-family gate).
        "family_size": max([len(c) for c in tests.values()] + [len(chosen)]),
        "families": {"pass": chosen, "fail": {n: len(c) for n, c in tests.items()}},
        "sequential": scheds,
        "quality_budget": quality_budget(quality),
        "method": _method_text(cfg, chosen),
        "variants": variants,
        "speculation": speculation(run_dir, gcfg.multiplicity),
    }


SPENDING_NAMES = {"obf": "O'Brien-Fleming", "pocock": "Pocock"}


def _method_text(cfg, chosen: list[str]) -> str:
    gcfg = cfg.gate
    pass_side = (f"alpha / {len(chosen)} across the release variants {', '.join(chosen)} (the user picks among them)"
                 if chosen and gcfg.multiplicity != "none" else "unadjusted: a variant is go only if all its cells pass "
                                "(intersection-union test)")
    fail_side = "unadjusted" if gcfg.multiplicity == "none" else "at alpha / m over each variant's m cells"
    return (f"paired differences variant - reference over the same items (negative = worse); "
            f"one-sided alpha {(1 - cfg.confidence) / 2:g} per bound before adjustment; lower "
            f"bounds (pass) {pass_side}; upper bounds (fail) {fail_side}; group-sequential looks "
            f"where a slice is scored in waves (Lan-DeMets {SPENDING_NAMES[gcfg.spending]}-type spending per side, "
            f"a cell decided at its first settling look); pass if "
            f"the lower bound > -margin, fail if the upper bound < -margin; 0/1 scores: Tango "
            f"score bounds, variance times the largest cluster's size (larger clusters, chosen "
            f"from the sizes alone, at their worst case), fail side with a one-item continuity "
            f"correction; other scores: t "
            f"with CR1 cluster-robust SE (exact binomial bound when no cluster differs); items "
            f"sharing a cluster label or a prompt are one cluster; ECE reported, not gated")

"""The gate: go / no-go per variant and slice, from paired per-item quality scores.

    python -m pipeline gate       --run runs/smollm2-135m --config configs/default.yaml
    python -m pipeline gate-check --run runs/smollm2-135m   # prints the table; exit 0 = go, 1 = not

Reads `quality/<variant>/<slice>.jsonl` (one line per item and sample), `quality/<variant>.json`
(distribution metrics) and `acceptance/<pair>.json` (`lossless`), and writes `runs/<run>/gate.json`
and `gate/table.md`. How a cell is decided (pipeline/stats.py has the formulas):

1. Per variant and slice, pair the variant's items with the reference's by id (the id sets must be
   equal); average repeated samples of one item first, so the item is the unit. The difference is
   variant - reference (oriented so negative = worse). Items sharing a `cluster` are clustered
   (CR1 standard error, t with clusters - 1 df); calibration slices also gate Brier (a per-item
   mean) and ECE (not a mean: paired cluster bootstrap through scipy.stats.bootstrap).
2. Non-inferiority: pass if the CI's lower bound is above -margin, fail if its upper bound is below
   -margin, otherwise inconclusive with the items that would settle it at 80% power.
3. Multiplicity: every gated cell of every variant is one family, adjusted twice: the lower CI
   bounds (the `pass` tests; a false pass is a false go) and the upper bounds (the `fail` tests; a
   false fail is a false no-go). Holm (default) orders the cells by one-sided p and draws the r-th
   bound at alpha/(m - r), stopping at the first that is not rejected; Bonferroni draws all at
   alpha/m. Each cell records `alpha_lower`, `alpha_upper` and `ci_level` = 1 - both, so what is
   printed is what was decided. Groups are reported unadjusted (gated only if gate.gate_groups).
4. Variant: go if every gated cell passes, no-go if any fails, inconclusive otherwise. Overall go
   only if every release variant is go. Speculation pairs are judged apart (lossless or not): a
   failing pair is no-go for speculation; it does not change a variant's quality decision.
"""
from __future__ import annotations

import math
import sys
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np

from pipeline import stats
from pipeline.stage import StageError, atomic_write_json, atomic_write_text, progress, read_json, read_jsonl

STATUS_ORDER = {"fail": 0, "inconclusive": 1, "pass": 2}


# ---------------------------------------------------------------- reading quality items


def read_items(path: Path) -> list[dict]:
    """One slice's JSONL; a bad line is a StageError naming file and line."""
    rows = read_jsonl(path, "quality items", validate=_quality_item)
    if not rows:
        raise StageError(f"empty slice: {path} has no items")
    return rows


def _quality_item(row) -> dict:
    try:
        if not isinstance(row, dict) or not math.isfinite(float(row["score"])):
            raise ValueError
        row["id"] = str(row["id"])
    except (ValueError, KeyError, TypeError):
        raise ValueError("is not a quality item with id and a finite score") from None
    return row


def by_item(rows: list[dict]) -> dict[str, dict]:
    """Collapse repeated samples of one item: mean score, first cluster/group/probabilities."""
    out: dict[str, dict] = {}
    for r in rows:
        it = out.setdefault(r["id"], {"scores": [], "cluster": r.get("cluster"),
                                      "group": r.get("group"), "metric": r.get("metric", "score"),
                                      "option_probs": r.get("option_probs"), "label": r.get("label")})
        it["scores"].append(float(r["score"]))
    for it in out.values():
        it["score"] = float(np.mean(it["scores"]))
    return out


def pair_items(ref: dict[str, dict], var: dict[str, dict], where: str) -> list[str]:
    if set(ref) != set(var):
        only_ref, only_var = sorted(set(ref) - set(var)), sorted(set(var) - set(ref))
        raise StageError(f"{where}: the variant and the reference scored different items "
                         f"({len(only_ref)} only in reference e.g. {only_ref[:3]}, {len(only_var)} "
                         f"only in variant e.g. {only_var[:3]}); re-run quality")
    return sorted(ref)


# ---------------------------------------------------------------- estimates per slice


def slice_estimates(ref: dict, var: dict, ids: list[str], gcfg, seed: int) -> dict[str, stats.Estimate]:
    """Row key -> estimate: the slice's primary metric, plus ECE/Brier on calibration items. The
    bootstrap seed comes from the variant/slice name, so a re-run reproduces the same CI."""
    clusters = [ref[i]["cluster"] for i in ids]
    metric = ref[ids[0]]["metric"] or "score"
    k = gcfg.min_clusters
    out = {"": stats.paired_difference([ref[i]["score"] for i in ids], [var[i]["score"] for i in ids],
                                       clusters, metric=metric, min_clusters=k)}
    calibrated = all(m[i]["option_probs"] is not None and m[i]["label"] is not None
                     for m in (ref, var) for i in ids)
    if gcfg.calibration_metrics and calibrated and len(ids) >= 2:
        try:
            probs = {k: ([m[i]["option_probs"] for i in ids], [m[i]["label"] for i in ids])
                     for k, m in (("ref", ref), ("var", var))}
            brier = {k: stats.brier_per_item(*v) for k, v in probs.items()}
            conf = {k: stats.confidence_and_correct(*v) for k, v in probs.items()}
        except (ValueError, IndexError) as e:
            raise StageError(f"corrupt calibration item: {e}") from None
        out["brier"] = stats.paired_difference(brier["ref"], brier["var"], clusters, metric="brier",
                                               higher_is_better=False, min_clusters=k,
                                               score_range=(0.0, 2.0))
        out["ece"] = stats.cluster_bootstrap(
            stats.ece_statistic(*conf["ref"]), stats.ece_statistic(*conf["var"]), len(ids), clusters,
            metric="ece", higher_is_better=False, n_resamples=gcfg.bootstrap_resamples, seed=seed,
            min_clusters=k, score_range=(0.0, 1.0))
    return out


def group_estimates(ref: dict, var: dict, ids: list[str], gcfg) -> dict[str, stats.Estimate]:
    groups: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        if ref[i]["group"] is not None:
            groups[str(ref[i]["group"])].append(i)
    return {g: stats.paired_difference([ref[i]["score"] for i in gids], [var[i]["score"] for i in gids],
                                       [ref[i]["cluster"] for i in gids], metric=ref[gids[0]]["metric"],
                                       min_clusters=gcfg.min_clusters)
            for g, gids in sorted(groups.items()) if len(gids) >= 2}


def _margin(gcfg, key: str, slice_name: str) -> float:
    return float(gcfg.margins.get(key, gcfg.margins.get(slice_name, gcfg.margin)))


def _cell(est: stats.Estimate, margin: float, alpha_lo: float, alpha_hi: float, gcfg,
          p_adj: tuple[float, float] | None) -> dict:
    lo, hi = est.ci(alpha_lo, margin)[0], est.ci(alpha_hi)[1]
    status = stats.noninferiority_status(lo, hi, margin)
    return {
        "metric": est.metric, "higher_is_better": est.higher_is_better,
        "reference": est.reference, "variant": est.variant, "diff": est.diff, "ci": [lo, hi],
        "ci_level": 1 - alpha_lo - alpha_hi, "alpha_lower": alpha_lo, "alpha_upper": alpha_hi,
        "margin": margin, "n": est.n, "n_clusters": est.n_clusters, "se": est.se,
        "method": est.method, "p_noninferior": est.p_value(margin),
        "p_inferior": est.p_value_inferior(margin),
        "p_adjusted": list(p_adj) if p_adj else None, "status": status,
        # Settling means reaching pass (diff above -margin) or fail (below): the side it is on.
        "items_to_settle": (stats.items_needed(est, margin, alpha_lo if est.diff > -margin
                                               else alpha_hi, gcfg.power)
                            if status == "inconclusive" else None),
    }


# ---------------------------------------------------------------- distribution and speculation


def distribution_checks(summary: dict, gcfg) -> dict:
    """Optional thresholds on KL and top-1 agreement, judged on the CI quality reported."""
    dist = summary.get("distribution") or {}
    out = {k: dist.get(k) for k in ("kl_mean", "kl_ci", "top1_agreement", "top1_ci", "ppl_ratio",
                                    "ppl_ratio_ci", "n_docs")}
    checks = {}
    # A threshold with no measurement (quality wrote no distribution CI) cannot pass: inconclusive.
    if gcfg.max_kl is not None:
        lo, hi = _bounds(dist.get("kl_ci"))
        checks["kl"] = {"threshold": gcfg.max_kl, "ci": [lo, hi],
                        "status": "inconclusive" if lo is None else "pass" if hi <= gcfg.max_kl
                        else "fail" if lo > gcfg.max_kl else "inconclusive"}
    if gcfg.min_top1_agreement is not None:
        lo, hi = _bounds(dist.get("top1_ci"))
        t = gcfg.min_top1_agreement
        checks["top1_agreement"] = {"threshold": t, "ci": [lo, hi],
                                    "status": "inconclusive" if lo is None else "pass" if lo >= t
                                    else "fail" if hi < t else "inconclusive"}
    out["checks"] = checks
    return out


def _bounds(ci) -> tuple[float | None, float | None]:
    try:
        lo, hi = (float(x) for x in ci)
    except (TypeError, ValueError):
        return None, None
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else (None, None)


def speculation(run_dir: Path, method: str) -> dict:
    """Per pair: greedy identical and the sampling test, with the sampling p-values adjusted for
    the number of pairs (same multiplicity method as the quality cells)."""
    pairs = {}
    for path in sorted((run_dir / "acceptance").glob("*__*.json")):
        doc = read_json(path, "acceptance result")
        if not isinstance(doc, dict):
            raise StageError(f"corrupt artifact: {path} is not a JSON object")
        pairs[path.stem] = {"variant": doc.get("variant"), "draft": doc.get("draft"),
                            "lossless": doc.get("lossless")}
    tested = [k for k, v in pairs.items()
              if isinstance((v["lossless"] or {}).get("sampling"), dict)
              and v["lossless"]["sampling"].get("p_value") is not None]
    alpha = min([pairs[k]["lossless"]["sampling"].get("alpha", 0.01) for k in tested] or [0.01])
    rejected, p_adj = stats.adjusted_p_values([float(pairs[k]["lossless"]["sampling"]["p_value"])
                                               for k in tested], alpha, method)
    adj = dict(zip(tested, zip(rejected, p_adj)))
    for key, pair in pairs.items():
        loss = pair.pop("lossless") or {}
        sampling = loss.get("sampling") or {}
        greedy = loss.get("greedy_identical")
        pair.update({"greedy_identical": greedy, "prompts": loss.get("prompts"), "dtype": loss.get("dtype"),
                     "mismatches": len(loss.get("mismatches") or []),
                     "sampling_test": sampling.get("test"), "sampling_p": sampling.get("p_value"),
                     "sampling_p_adjusted": adj[key][1] if key in adj else None, "alpha": alpha})
        if greedy is None and key not in adj:
            pair["decision"] = "unchecked"
        elif greedy is False or (key in adj and adj[key][0]):
            pair["decision"] = "no-go"
        else:
            pair["decision"] = "go"
    decisions = {p["decision"] for p in pairs.values()}
    overall = "no-go" if "no-go" in decisions else "unchecked" if "unchecked" in decisions or not pairs else "go"
    return {"decision": overall, "pairs": pairs}


# ---------------------------------------------------------------- the stage


def decide(statuses: list[str]) -> str:
    if "fail" in statuses:
        return "no-go"
    if statuses and all(s == "pass" for s in statuses):
        return "go"
    return "inconclusive"


def build_gate(run_dir: Path, cfg) -> dict:
    gcfg, qcfg = cfg.gate, cfg.quantize
    reference = qcfg.reference
    alpha = (1.0 - gcfg.confidence) / 2.0
    quality = run_dir / "quality"
    ref_dir = quality / reference
    if not ref_dir.is_dir():
        raise StageError(f"missing artifact: {ref_dir} (the reference's quality results)")
    slices = sorted(p.stem for p in ref_dir.glob("*.jsonl"))
    if not slices:
        raise StageError(f"empty artifact: {ref_dir} has no <slice>.jsonl")
    ref_items = {s: by_item(read_items(ref_dir / f"{s}.jsonl")) for s in slices}

    variants: dict[str, dict] = {}
    tests: list[tuple[str, str, str, stats.Estimate, float]] = []  # variant, row, slice, est, margin
    groups: dict[tuple[str, str], dict[str, stats.Estimate]] = {}
    for name, vcfg in qcfg.variants.items():
        if name == reference:
            continue
        entry = {"decision": "inconclusive", "release": vcfg.release, "scheme": vcfg.scheme,
                 "slices": {}, "missing": []}
        variants[name] = entry
        vdir = quality / name
        if not vdir.is_dir():
            entry["missing"].append("quality results")
            progress(f"gate: {name} has no quality results; it cannot be go")
            continue
        for s in slices:
            if not (vdir / f"{s}.jsonl").is_file():
                raise StageError(f"missing artifact: {vdir / f'{s}.jsonl'} (the reference has it)")
            var = by_item(read_items(vdir / f"{s}.jsonl"))
            ids = pair_items(ref_items[s], var, f"{name}/{s}")
            if len(ids) < 2:
                raise StageError(f"slice {s} has {len(ids)} item(s); the gate needs at least 2")
            seed = zlib.crc32(f"{name}/{s}".encode())
            for row, est in slice_estimates(ref_items[s], var, ids, gcfg, seed).items():
                key = f"{s}:{row}" if row else s
                tests.append((name, key, s, est, _margin(gcfg, key, s)))
            groups[(name, s)] = group_estimates(ref_items[s], var, ids, gcfg)
            if gcfg.gate_groups:
                for g, est in groups[(name, s)].items():
                    key = f"{s}/{g}"
                    tests.append((name, key, s, est, _margin(gcfg, key, s)))
        summary_path = quality / f"{name}.json"
        entry["distribution"] = (distribution_checks(read_json(summary_path, "quality summary"), gcfg)
                                 if summary_path.is_file() else {"checks": {}})

    # Multiplicity over the whole family of gated cells, once for the lower bounds (pass) and
    # once for the upper bounds (fail).
    p_pass = [est.p_value(margin) for _, _, _, est, margin in tests]
    p_fail = [est.p_value_inferior(margin) for _, _, _, est, margin in tests]
    lo_levels = stats.step_levels(
        p_pass, lambda i, a: tests[i][3].ci(a, tests[i][4])[0] > -tests[i][4], alpha, gcfg.multiplicity)
    hi_levels = stats.step_levels(
        p_fail, lambda i, a: tests[i][3].ci(a)[1] < -tests[i][4], alpha, gcfg.multiplicity)
    adj_pass = stats.adjusted_p_values(p_pass, alpha, gcfg.multiplicity)[1]
    adj_fail = stats.adjusted_p_values(p_fail, alpha, gcfg.multiplicity)[1]
    for i, (name, key, s, est, margin) in enumerate(tests):
        variants[name]["slices"][key] = _cell(est, margin, lo_levels[i], hi_levels[i], gcfg,
                                              (adj_pass[i], adj_fail[i]))
    for (name, s), gests in groups.items():
        cell = variants[name]["slices"][s]
        cell["groups"] = {}
        for g, est in gests.items():
            gated = variants[name]["slices"].pop(f"{s}/{g}", None)
            cell["groups"][g] = ({**gated, "gated": True} if gated else
                                 {**_cell(est, _margin(gcfg, f"{s}/{g}", s), alpha, alpha, gcfg, None),
                                  "gated": False})

    for name, entry in variants.items():
        statuses = [c["status"] for c in entry["slices"].values()]
        statuses += [g["status"] for c in entry["slices"].values() for g in c.get("groups", {}).values()
                     if g["gated"]]
        statuses += [c["status"] for c in entry.get("distribution", {}).get("checks", {}).values()]
        entry["decision"] = "inconclusive" if entry["missing"] else decide(statuses)
    release = [n for n, e in variants.items() if e["release"]]
    decision = "go" if all(variants[n]["decision"] == "go" for n in release) else "no-go"
    return {
        "decision": decision,
        "reference": reference,
        "release_variants": release,
        "confidence": gcfg.confidence,
        "alpha_one_sided": alpha,
        "multiplicity": gcfg.multiplicity,
        "family_size": len(tests),
        "method": _method_text(gcfg, len(tests)),
        "variants": variants,
        "speculation": speculation(run_dir, gcfg.multiplicity),
    }


def _method_text(gcfg, m: int) -> str:
    adj = {"holm": f"Holm step-down over {m} gated cells, separately for the lower bounds (pass) "
                   "and the upper bounds (fail): the r-th smallest p drawn at alpha/(m-r), later cells "
                   "at the level where Holm stopped",
           "bonferroni": f"Bonferroni over {m} gated cells (each CI at alpha/{m})",
           "none": "no multiplicity adjustment"}[gcfg.multiplicity]
    return (f"paired differences variant - reference over the same items (negative = worse); "
            f"{gcfg.confidence:.0%} two-sided CIs = one-sided alpha {(1 - gcfg.confidence) / 2:g} "
            f"before adjustment; {adj}; pass if the CI's lower end > -margin, fail if its upper end "
            f"< -margin; clustered SEs where items share a cluster (with >= {gcfg.min_clusters} "
            f"clusters; fewer are treated as strata); ECE by paired (cluster) bootstrap; when no "
            f"item differs, the exact binomial bound on the share that could (0 of n), not a "
            f"zero-width CI; on 0/1 scores the lower end uses at least the SE a difference at the "
            f"margin would have; CIs clipped to the possible range")


def run(ctx) -> None:
    gate = build_gate(ctx.run_dir, ctx.config)
    atomic_write_json(ctx.run_dir / "gate.json", gate)
    table = render_table(gate)
    atomic_write_text(ctx.out_dir / "table.md", table)
    ctx.meta["decision"] = gate["decision"]
    ctx.meta["gate_json"] = str(ctx.run_dir / "gate.json")
    print(table, file=sys.stderr)


# ---------------------------------------------------------------- the table and the exit code


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def cell_text(c: dict) -> str:
    lo, hi = c["ci"]
    settle = ""
    if c["status"] == "inconclusive":
        settle = (f" (~{c['items_to_settle']} items to settle)" if c.get("items_to_settle")
                  else " (diff sits on -margin: no n settles it)")
    return f"{_fmt(c['diff'], True)} [{_fmt(lo, True)}, {_fmt(hi, True)}] {c['status']}{settle}"


def render_table(gate: dict) -> str:
    """Markdown: one line per variant, then one row per gated cell (diff, CI, margin, status)."""
    lines = [f"# specq gate: {gate['decision'].upper()}", "",
             f"Reference `{gate['reference']}`. {gate['method']}.", "",
             "| variant | release | decision | slice | metric | reference | variant | diff [CI] status "
             "| CI level | margin | n |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in gate["variants"].items():
        rel = "yes" if v["release"] else "no"
        if not v["slices"]:
            lines.append(f"| {name} | {rel} | **{v['decision']}** | - | - | - | - | missing: "
                         f"{', '.join(v['missing']) or 'nothing gated'} | - | - | - |")
        for i, (key, c) in enumerate(v["slices"].items()):
            head = f"| {name} | {rel} | **{v['decision']}** " if i == 0 else "| | | "
            lines.append(f"{head}| {key} | {c['metric']} | {_fmt(c['reference'])} | {_fmt(c['variant'])} "
                         f"| {cell_text(c)} | {c['ci_level']:.4f} | {c['margin']:g} | {c['n']} |")
            for g, gc in (c.get("groups") or {}).items():
                tag = "" if gc.get("gated", True) else " (reported, not gated)"
                lines.append(f"| | | | {key}/{g} | {gc['metric']} | {_fmt(gc['reference'])} "
                             f"| {_fmt(gc['variant'])} | {cell_text(gc)}{tag} | {gc['ci_level']:.4f} "
                             f"| {gc['margin']:g} | {gc['n']} |")
        for what, chk in (v.get("distribution") or {}).get("checks", {}).items():
            lo, hi = chk["ci"]
            lines.append(f"| | | | distribution | {what} | - | - | [{_fmt(lo)}, {_fmt(hi)}] "
                         f"{chk['status']} (threshold {chk['threshold']:g}) | - | - | - |")
    spec = gate.get("speculation") or {"pairs": {}}
    if spec["pairs"]:
        lines += ["", f"Speculation (lossless check, judged apart from quality): "
                      f"**{spec['decision']}**", "",
                  "| pair | greedy identical (dtype) | sampling p (adjusted) | decision |", "|---|---|---|---|"]
        for key, p in spec["pairs"].items():
            lines.append(f"| {key} | {p['greedy_identical']} ({p.get('dtype') or '-'}) | {_fmt(p['sampling_p'])} "
                         f"({_fmt(p['sampling_p_adjusted'])}) | **{p['decision']}** |")
    if not gate["release_variants"]:
        lines += ["", "No variant is marked release: true; the decision is go by default."]
    return "\n".join(lines) + "\n"


def gate_check(run_dir: str | Path) -> int:
    """Print the go/no-go table of a finished gate; 0 if the decision is go, 1 otherwise."""
    gate = read_json(Path(run_dir) / "gate.json", "gate result")
    if not isinstance(gate, dict) or gate.get("decision") not in ("go", "no-go"):
        raise StageError(f"corrupt artifact: {Path(run_dir) / 'gate.json'} has no decision")
    print(render_table(gate), end="")
    return 0 if gate["decision"] == "go" else 1

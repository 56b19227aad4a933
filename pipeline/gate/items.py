"""Reading the quality stage's per-item files for the gate: items (repeated samples collapsed),
pairing by id, clusters (a shared `cluster` label or prompt), and the slices left unscored.

    from pipeline.gate.items import by_item, read_items
    ref = by_item(read_items(run / "quality" / "bf16" / "reasoning.jsonl"))
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipeline.core.stage import StageError, read_jsonl
from pipeline.gate.stops import quality_meta
from pipeline.stats import paired as stats


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
    """Collapse repeated samples of one item: mean score, first cluster/prompt/group/probabilities."""
    out: dict[str, dict] = {}
    for r in rows:
        it = out.setdefault(r["id"], {"scores": [], "cluster": r.get("cluster"),
                                      "prompt_hash": r.get("prompt_hash"),
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


def item_clusters(items: dict[str, dict], ids: list[str]) -> np.ndarray:
    """Cluster codes for `ids`: a shared `cluster` label or a shared prompt (the `prompt_hash`
    lm-eval records per item) puts items together."""
    labels = [items[i]["cluster"] for i in ids]
    keys = [items[i]["prompt_hash"] for i in ids]
    return stats.merge_clusters(len(ids), labels, keys)


def unscored_slices(quality: Path, scored: list[str]) -> dict[str, str]:
    """{slice: why} for what the quality stage was asked to score and did not (meta.json's
    `skipped_tasks`, or a requested slice without results): each makes every decision inconclusive."""
    meta = quality_meta(quality)
    out = {str(k): f"not scored: {why}" for k, why in (meta.get("skipped_tasks") or {}).items()}
    for name in list(meta.get("slices") or []) + list(meta.get("tasks") or []):
        if name not in scored and name not in out:
            out[str(name)] = "requested, but the reference has no results for it"
    return out

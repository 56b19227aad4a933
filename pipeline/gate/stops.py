"""Where each slice's scoring stopped, as the quality stage recorded it in quality/meta.json, and
what that makes of a gate cell.

    from pipeline.gate.stops import schedules, budget_stops, stop_fields
    cell.update(stop_fields(cell["status"], sched, budget_stops(quality)[variant].get(slice_name)))

The quality stage writes `sequential` (each slice's planned looks and maximum) and `budget` (per
variant and slice: the items scored, the looks done and skipped, and why scoring stopped: settled,
the last look, the time budget, or the variant's verdict) into quality/meta.json. The gate reads
both: the planned looks are the group-sequential schedule its replay tests at
(pipeline/gate/looks.py), and a cell left open says why (`stopped_on`, `stop_reason`,
`items_left`). Results without these keys (quality results made elsewhere than the quality
stage) read as one look at the items scored and no stop record.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import StageError, read_json
from pipeline.stats.sequential import spending_function


def schedules(quality: Path) -> dict[str, dict]:
    """slice -> {"looks": planned look sizes, "n_max": the slice's maximum, and "spending" where the
    stage recorded the one its looks stopped on} from quality/meta.json's `sequential` (written by
    the quality stage); {} for results without it (one look at the n scored: the fixed-n gate)."""
    meta_path = quality / "meta.json"
    if not meta_path.is_file():
        return {}
    meta = read_json(meta_path, "quality meta.json")
    out = {}
    for s, sched in ((meta.get("sequential") or {}) if isinstance(meta, dict) else {}).items():
        try:
            looks, n_max = [int(n) for n in sched["looks"]], int(sched["n_max"])
        except (KeyError, TypeError, ValueError):
            raise StageError(f"corrupt artifact: {meta_path}: sequential.{s} needs looks and n_max") from None
        out[str(s)] = {"looks": looks, "n_max": n_max}
        if sched.get("spending") is not None:
            try:
                spending_function(str(sched["spending"]))
            except ValueError as e:
                raise StageError(f"corrupt artifact: {meta_path}: sequential.{s}.spending: {e}") from None
            out[str(s)]["spending"] = str(sched["spending"])
    return out


def budget_stops(quality: Path) -> dict[str, dict[str, dict]]:
    """variant -> slice -> the quality stage's record of where scoring stopped ("stopped_on":
    "settled" / "last look" / "budget", "why", items, looks done and skipped), from quality/
    meta.json's `budget.variants`; {} for results without one."""
    meta_path = quality / "meta.json"
    if not meta_path.is_file():
        return {}
    meta = read_json(meta_path, "quality meta.json")
    records = ((meta.get("budget") or {}).get("variants") or {}) if isinstance(meta, dict) else {}
    return {str(v): dict((r or {}).get("slices") or {}) for v, r in records.items() if isinstance(r, dict)}


def quality_budget(quality: Path) -> dict | None:
    """The quality stage's time budget as it ran (minutes, its share, seconds, spent, skipped), or
    None when it had none."""
    meta_path = quality / "meta.json"
    meta = read_json(meta_path, "quality meta.json") if meta_path.is_file() else {}
    b = meta.get("budget") if isinstance(meta, dict) else None
    if not isinstance(b, dict) or b.get("seconds") is None:
        return None
    return {k: b.get(k) for k in ("minutes", "share", "seconds", "spent_s", "skipped")}


def stop_fields(status: str, sched: dict, record: dict | None) -> dict:
    """Where a cell's looks ended: "data" (a look passed or failed it), "last look" (open at the
    slice's final look), "budget" (open before it: the quality stage stopped on its time budget;
    with the reason and the items the slice has left to its maximum), "verdict" (open before it:
    a budgeted stage stopped scoring a variant another of whose cells had failed, so no item
    could change its no-go), or "early" (open before its final look with no budget record:
    results from elsewhere)."""
    done, looks = sched["done"], sched["looks"]
    if status != "inconclusive":
        return {"stopped_on": "data"}
    if len(done) >= len(looks):
        return {"stopped_on": "last look"}
    scored = done[-1] if done else 0
    kind = (record or {}).get("stopped_on")
    kind = kind if kind in ("budget", "verdict") else "early"
    why = (record or {}).get("why") if kind != "early" else "scoring stopped before the slice's last look"
    return {"stopped_on": kind, "stop_reason": why,
            "slice_items": scored, "items_left": sched["n_max"] - scored,
            "looks_skipped": len(looks) - len(done)}

"""Where each slice's scoring stopped, as the quality stage recorded it in quality/meta.json, and
what that makes of a gate cell.

    from pipeline.gate.stops import schedules, budget_stops, stop_fields
    cell.update(stop_fields(cell["status"], sched, budget_stops(quality)[variant].get(slice_name)))

meta.json's `sequential` holds each slice's planned looks (the schedule the gate's replay tests
at) and `budget` why each variant's slice stopped (so an open cell says why). Results made
elsewhere, without these keys, read as one look at the items scored and no stop record.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import read_json


def quality_meta(quality: Path) -> dict:
    """quality/meta.json; {} without one (quality results made elsewhere)."""
    path = quality / "meta.json"
    return read_json(path, "quality meta.json") if path.is_file() else {}


def schedules(quality: Path) -> dict[str, dict]:
    """slice -> {"looks", "n_max", and "spending" where the stage recorded one} from meta.json's
    `sequential`; {} for results without it (one look at the n scored: the fixed-n gate)."""
    out = {}
    for s, sched in (quality_meta(quality).get("sequential") or {}).items():
        out[str(s)] = {"looks": [int(n) for n in sched["looks"]], "n_max": int(sched["n_max"])}
        if sched.get("spending") is not None:
            out[str(s)]["spending"] = str(sched["spending"])
    return out


def budget_stops(quality: Path) -> dict[str, dict[str, dict]]:
    """variant -> slice -> the quality stage's record of where scoring stopped ("stopped_on",
    "why", items, looks done and skipped), from meta.json's `budget.variants`; {} without one."""
    records = (quality_meta(quality).get("budget") or {}).get("variants") or {}
    return {str(v): dict((r or {}).get("slices") or {}) for v, r in records.items() if isinstance(r, dict)}


def quality_budget(quality: Path) -> dict | None:
    """The quality stage's time budget as it ran (minutes, its share, seconds, spent, skipped), or
    None when it had none."""
    b = quality_meta(quality).get("budget")
    if not isinstance(b, dict) or b.get("seconds") is None:
        return None
    return {k: b.get(k) for k in ("minutes", "share", "seconds", "spent_s", "skipped")}


def stop_fields(status: str, sched: dict, record: dict | None) -> dict:
    """Where a cell's looks ended: "data" (a look passed or failed it), "last look" (open at the
    slice's final look), or open before it: "budget" (the stage's time budget ran out), "verdict"
    (another cell of the variant had failed) or "early" (no budget record: results from elsewhere)."""
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

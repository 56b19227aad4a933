"""Numbers as the report package writes them, the not-like-with-like mark, and reading a run's
artifacts for a page.

    from pipeline.report.format import number, interval, nbytes, median_ci
    number(0.1234, 3)                  -> "0.123"      number(-0.02, 3, signed=True) -> "-0.020"
    interval([0.1, 0.2], 2)            -> "[0.10, 0.20]"                interval(None, 2) -> ""
    nbytes(3 << 20)                    -> "3.0 MiB"
    median_ci({"median": 10, "ci": [9, 11]}, 2) -> "10.00 [9.00, 11.00]"

A missing value (None, NaN, infinity) is MISSING, "-"; an absent interval is "", so "value [lo, hi]"
reads as "value"; a string is written as it is. Digits are always the caller's.
"""
from __future__ import annotations

import math
from pathlib import Path

from pipeline.core.stage import read_json, require_schema

MISSING = "-"
# Marks a ratio whose two sides did not run the same way (a row's `like_with_like` false, with its
# `modes`: pipeline/latency/modes.py); such a ratio is kept out of every recommendation.
MARK = "†"


def number(x, digits: int, signed: bool = False) -> str:
    """x to `digits` decimals ("+" on positives when signed); MISSING when None or not finite."""
    if x is None:
        return MISSING
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if not math.isfinite(v):
        return MISSING
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def interval(ci, digits: int, signed: bool = False) -> str:
    """"[lo, hi]" with each bound as number() writes it; "" when there is no interval."""
    if not ci:
        return ""
    return f"[{number(ci[0], digits, signed)}, {number(ci[1], digits, signed)}]"


def median_ci(record, digits: int) -> str:
    """A {median, ci, samples} record as "median [lo, hi]"; a bare number as number() writes it."""
    if not isinstance(record, dict):
        return number(record, digits)
    return f"{number(record.get('median'), digits)} {interval(record.get('ci'), digits)}"


UNITS = {"MiB": 2**20, "GB": 1e9}


def nbytes(n, unit: str = "MiB", digits: int = 1) -> str:
    """A byte count in MiB (2^20) or GB (10^9): nbytes(3 << 20) -> "3.0 MiB"; MISSING when None."""
    return MISSING if n is None else f"{n / UNITS[unit]:.{digits}f} {unit}"


def mark(row: dict | None) -> str:
    return MARK if row and row.get("like_with_like") is False else ""


def footnote(rows: list[dict], what: str, name=lambda r: f"k={r.get('k')}") -> str:
    """One line naming each flagged row's two modes, or "" when no row is flagged."""
    flagged = [r for r in rows if r and r.get("like_with_like") is False]
    if not flagged:
        return ""
    parts = [f"{name(r)} (" + ", ".join(f"{side} {mode}" for side, mode in (r.get("modes") or {}).items()) + ")"
             for r in flagged]
    return (f"{MARK} {what} compares two runs that did not run the same way: "
            "not like with like, so left out of every recommendation: " + "; ".join(parts) + ".")


def json_files(folder: Path, pattern: str, what: str) -> dict[str, dict]:
    """{file stem: JSON object} for the files matching `pattern` in `folder`, meta.json left out,
    in name order (StageError where the folder's meta.json is of another specq version)."""
    require_schema(folder / "meta.json")
    return {p.stem: read_json(p, what) for p in sorted(folder.glob(pattern)) if p.name != "meta.json"}


def optional_json(path: Path, what: str) -> dict:
    """{} when the file is absent (a stage that wrote nothing); StageError when it is corrupt."""
    return read_json(path, what) if path.is_file() else {}

"""The report's mark for a ratio whose two sides did not run the same way (like with like).

    from pipeline.report.modes import MARK, mark, footnote
    f"{number(r['speedup'], 2)}x{mark(r)}"      # "1.31x†" when r["like_with_like"] is False
    footnote(rows, "speedup")                    # one line naming each flagged row's two modes, or ""

A row carries `like_with_like` and, when it is false, `modes` (pipeline/latency/modes.py): e.g. a
variant on a fallback quantized kernel over the reference (every step runs eagerly, so the kernel is
what can differ; an artifact from an older specq may also record compiled steps). Such a ratio is
shown with the mark and kept out of every recommendation.
"""
from __future__ import annotations

MARK = "†"


def mark(row: dict | None) -> str:
    return MARK if row and row.get("like_with_like") is False else ""


def footnote(rows: list[dict], what: str, name=lambda r: f"k={r.get('k')}") -> str:
    """"† <what> compares two runs that did not run the same way: ...: w4 B=1 context=128 (variant eager +
    fallback kernel, reference eager); ..." for the flagged rows, or "" when there are none."""
    flagged = [r for r in rows if r and r.get("like_with_like") is False]
    if not flagged:
        return ""
    parts = [f"{name(r)} (" + ", ".join(f"{side} {mode}" for side, mode in (r.get("modes") or {}).items()) + ")"
             for r in flagged]
    return (f"{MARK} {what} compares two runs that did not run the same way: "
            "not like with like, so left out of every recommendation: " + "; ".join(parts) + ".")

"""The report's mark for a ratio whose two sides did not run the same way (like with like).

    from pipeline.report.modes import MARK, mark, footnote
    f"{number(r['speedup'], 2)}x{mark(r)}"      # "1.31x†" when r["like_with_like"] is False
    footnote(rows, "speedup")                    # one line naming each flagged row's two modes, or ""

A row carries `like_with_like` and, when it is false, `modes` (pipeline/latency/modes.py): e.g. a
compiled speculative run over an eager plain one, or a variant on a fallback kernel over the
reference. Such a ratio is shown with the mark and kept out of every recommendation.
"""
from __future__ import annotations

MARK = "†"


def mark(row: dict | None) -> str:
    return MARK if row and row.get("like_with_like") is False else ""


def footnote(rows: list[dict], what: str, name=lambda r: f"k={r.get('k')}") -> str:
    """"† <what> not like with like (left out of every recommendation): k=2 (speculative compiled,
    plain eager); ..." for the flagged rows, or "" when there are none."""
    flagged = [r for r in rows if r and r.get("like_with_like") is False]
    if not flagged:
        return ""
    parts = [f"{name(r)} (" + ", ".join(f"{side} {mode}" for side, mode in (r.get("modes") or {}).items()) + ")"
             for r in flagged]
    return (f"{MARK} {what} compares two runs that did not run the same way (compiled, eager, fallback kernel): "
            "not like with like, so left out of every recommendation: " + "; ".join(parts) + ".")

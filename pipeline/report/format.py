"""Numbers as the report package writes them: one implementation for every table and page.

    from pipeline.report.format import number, interval, percent, nbytes, median_ci
    number(0.1234, 3)                  -> "0.123"      number(-0.02, 3, signed=True) -> "-0.020"
    interval([0.1, 0.2], 2)            -> "[0.10, 0.20]"                interval(None, 2) -> ""
    percent(0.0312, 1, signed=True)    -> "+3.1%"      nbytes(3 << 20) -> "3.0 MiB"
    median_ci({"median": 10, "ci": [9, 11]}, 2) -> "10.00 [9.00, 11.00]"

A missing value is written MISSING, "-": None, NaN and infinities alike (a number that is not
finite was not measured). An absent interval (None or empty) is "" so that "value [lo, hi]" reads
as "value"; an interval with a missing bound shows it as "-" ("[-, -]"). A value that is not a
number at all (a string) is written as it is. Digits are always the caller's: each table keeps
the precision it has always had.
"""
from __future__ import annotations

import math

MISSING = "-"


def _float(x) -> float | None:
    """x as a finite float; None when it is missing or not finite; raises when it is not a number."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def number(x, digits: int, signed: bool = False) -> str:
    """x to `digits` decimals ("+" on positives when signed); MISSING when None or not finite."""
    try:
        v = _float(x)
    except (TypeError, ValueError):
        return str(x)
    if v is None:
        return MISSING
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def percent(x, digits: int, signed: bool = False) -> str:
    """A fraction as a percentage: percent(0.25, 0) -> "25%"; MISSING when None or not finite."""
    try:
        v = _float(x)
    except (TypeError, ValueError):
        return str(x)
    return MISSING if v is None else number(100 * v, digits, signed) + "%"


def interval(ci, digits: int, signed: bool = False, as_percent: bool = False) -> str:
    """"[lo, hi]" with each bound as number() (or percent()) writes it; "" when there is no interval."""
    if not ci:
        return ""
    fmt = percent if as_percent else number
    return f"[{fmt(ci[0], digits, signed)}, {fmt(ci[1], digits, signed)}]"


def median_ci(record, digits: int) -> str:
    """A {median, ci, samples} record as "median [lo, hi]"; a bare number as number() writes it."""
    if not isinstance(record, dict):
        return number(record, digits)
    return f"{number(record.get('median'), digits)} {interval(record.get('ci'), digits)}"


UNITS = {"MiB": 2**20, "GB": 1e9}


def nbytes(n, unit: str = "MiB", digits: int = 1) -> str:
    """A byte count in MiB (2^20) or GB (10^9): nbytes(3 << 20) -> "3.0 MiB"; MISSING when None."""
    return MISSING if n is None else f"{n / UNITS[unit]:.{digits}f} {unit}"

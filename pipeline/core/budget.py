"""The run's time budget (config `budget`): a stage's clock, its estimates and what it skipped.

    budget = StageBudget(ctx.config, "latency", run_dir=ctx.run_dir)
    if not budget.affords(next_repeat_s):
        budget.skip("bf16__ngram repeats 4-5", "budget: 38 s left, a repeat takes 52 s")
    ctx.meta["budget"] = budget.to_json()

A planning stage's seconds come from the run's `ledger`: the budget less what the stages before it
took, shared by `budget.shares` with the planning stages after it; without a run directory, or with
`budget.rebalance` off, its share of the minutes. Without a budget `left()` is infinite.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pipeline.core.stage import progress


def fmt_s(seconds: float | None) -> str:
    """'43 s', '7.5 min', '1.6 h'; '-' for None or infinity."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class _Clock:
    """What a stage's budget and a piece of it share: `seconds` (None = no budget), `left()`, `spent()`."""
    label = "budget"

    @property
    def active(self) -> bool:
        return self.seconds is not None

    def affords(self, estimate_s: float | None) -> bool:
        """Whether work estimated at `estimate_s` seconds still fits (an unknown estimate: while time is left)."""
        return self.left() > 0 if estimate_s is None else estimate_s <= self.left()

    def eta(self, done: float, total: float) -> str:
        """' (3.2 min left; budget 5.0 min left)': the time left at the rate so far, for a progress line."""
        rate = self.spent() / done if done > 0 else None
        left = rate * (total - done) if rate is not None else None
        budget = f"; {self.label} {fmt_s(max(self.left(), 0.0))} left" if self.active else ""
        return f" ({fmt_s(left)} left{budget})"


# The run's stages in make's order, and where each writes its meta.json (the ledger reads wall_s).
STAGE_DIRS = {"prepare": "model", "quantize": "variants", "quality": "quality", "drafts": "drafts",
              "acceptance": "acceptance", "vllm": "vllm", "latency": "latency", "gate": "gate",
              "marginal": "marginal", "report": "report"}
# Kept back for the stages after the planning ones (gate, marginal, report: seconds each).
TAIL_FRACTION = 0.03


def ledger(run_dir, config, stage: str) -> dict:
    """The stage's seconds: the budget less what the stages before it took (meta.json's wall_s) and
    TAIL_FRACTION, shared with the planning stages after it in proportion to their shares."""
    total = config.budget.minutes * 60
    shares = config.budget.shares
    order = list(STAGE_DIRS)
    before = order[:order.index(stage)] if stage in order else []
    spent = {}
    for name in before:
        try:
            spent[name] = float(json.loads((Path(run_dir) / STAGE_DIRS[name] / "meta.json").read_text())["wall_s"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    pending = [n for n in order[len(before) + 1:] if n in shares]
    weight = shares[stage] / (shares[stage] + sum(shares[n] for n in pending))
    left = total * (1 - TAIL_FRACTION) - sum(spent.values())
    return {"seconds": round(max(left, 0.0) * weight, 1), "budget_s": round(total, 1),
            "spent_s": {n: round(v, 1) for n, v in spent.items()}, "left_s": round(left, 1),
            "pending": pending, "weight": round(weight, 4)}


class StageBudget(_Clock):
    def __init__(self, config, stage: str, clock=time.monotonic, run_dir=None):
        self.stage = stage
        self.clock = clock
        self.start = clock()
        minutes = config.budget.minutes
        self.share = config.budget.shares.get(stage) if minutes else None
        self.seconds = minutes * 60 * self.share if minutes and self.share else None
        self.minutes = minutes
        self.ledger = None
        if self.seconds is not None and run_dir is not None and config.budget.rebalance:
            self.ledger = ledger(run_dir, config, stage)
            self.seconds = self.ledger["seconds"]
        self.estimates: list[dict] = []
        self.skipped: list[dict] = []

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.spent()

    def announce(self, what: str, estimate_s: float | None) -> None:
        """Print (and record) the stage's estimate for `what` before it starts, beside its budget."""
        self.estimates.append({"what": what, "estimate_s": None if estimate_s is None else round(estimate_s, 1),
                               "at_s": round(self.spent(), 1)})
        budget = (f"; budget {fmt_s(max(self.left(), 0.0))} left of {fmt_s(self.seconds)}" if self.active
                  else "; no time budget")
        progress(f"{self.stage}: {what}: estimate {fmt_s(estimate_s)}{budget}")

    def skip(self, what: str, why: str) -> None:
        """Record (and print) work the stage chose not to do, and why."""
        self.skipped.append({"what": what, "why": why, "at_s": round(self.spent(), 1)})
        progress(f"{self.stage}: skipped {what}: {why}")

    def part(self, what: str, fraction: float = 1.0, of_items: int = 1) -> "Allowance":
        """`fraction` of the time left now, split evenly over `of_items` pieces (time a piece does not
        use carries to the next); its skips are recorded in this budget."""
        return Allowance(self, what, None if not self.active else max(self.left(), 0.0) * fraction / max(of_items, 1))

    def to_json(self) -> dict:
        return {"minutes": self.minutes, "share": self.share,
                "seconds": None if self.seconds is None else round(self.seconds, 1),
                "seconds_from": None if self.seconds is None else "ledger" if self.ledger is not None else "share",
                **({"ledger": self.ledger} if self.ledger is not None else {}),
                "spent_s": round(self.spent(), 1), "estimates": self.estimates, "skipped": self.skipped}


class Allowance(_Clock):
    """A piece of a stage's budget (StageBudget.part): the same interface, its own seconds, counted
    from when it was made; never more than the stage has left."""
    label = "allowance"

    def __init__(self, parent: StageBudget, what: str, seconds: float | None):
        self.parent, self.what, self.seconds = parent, what, seconds
        self.start = parent.clock()

    def piece(self, what: str, pieces_left: int) -> "Allowance":
        """An even split of what this part has left now over `pieces_left` pieces."""
        return Allowance(self.parent, what, None if not self.active else max(self.left(), 0.0) / max(pieces_left, 1))

    def spent(self) -> float:
        return self.parent.clock() - self.start

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return min(self.seconds - self.spent(), self.parent.left())

    def skip(self, what: str, why: str) -> None:
        self.parent.skip(what, why)


def plan_line(config) -> str:
    """The run's budget in one line, printed when a run starts (prepare / evaluate)."""
    b = config.budget
    if not b.minutes:
        return ("no time budget (budget.minutes unset): every stage does all its config asks; each stage "
                "prints its own estimate")
    total = sum(b.shares.values())
    parts = [f"{stage} {share / total:.0%}" for stage, share in b.shares.items()]
    return (f"time budget {fmt_s(b.minutes * 60)}: each planning stage gets what the stages before it left, "
            f"shared among those still to run ({', '.join(parts)})")

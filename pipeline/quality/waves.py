"""The order in which a slice's items are scored in waves, and the time the waves take.

    blob, ends = order_items(pool_blob, seed=0, slice_name="bfcl", n_max=240)
    pace = Pace({"bfcl": 420.0, "calibration": 180.0}); pace.record({"bfcl": 40}, 61.0)
    allowance = Allowance(StageBudget(config, "quality"), variants_left=3)

A slice's clusters are put once in a seeded random order and every model scores a prefix of it,
so each look is a random sample that never splits a cluster; where clusters have unequal sizes or
outnumber n_max, one item per cluster is taken
(docs/methods/quality-slices.md#the-order-items-are-scored-in). `Pace`: a model's seconds per item
per slice; `Allowance`: a variant's time (docs/methods/budget.md).
"""
from __future__ import annotations

import hashlib
import json
import random

from pipeline.core import budget as budget_mod
from pipeline.core.budget import fmt_s
from pipeline.stats.paired import merge_clusters


def order_items(blob: bytes, seed: int, slice_name: str, n_max: int) -> tuple[bytes, list[int]]:
    """(the first items of the slice's seeded cluster order, at most n_max, as JSONL bytes; the
    item counts at which each cluster ends)."""
    lines = blob.splitlines(keepends=True)
    rows = [json.loads(line) for line in lines]
    labels = [r.get("cluster") for r in rows]
    prompts = [hashlib.sha256(str(r.get("prompt", "")).encode()).hexdigest() if "prompt" in r else None
               for r in rows]
    codes = merge_clusters(len(rows), labels, prompts)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        members.setdefault(c, []).append(i)
    rng = random.Random(f"waves:{slice_name}:{seed}")
    clusters = list(members.values())  # in order of first appearance: deterministic
    rng.shuffle(clusters)
    chosen: list[list[int]] = []
    sizes = {len(c) for c in clusters}
    if max(sizes) > 1 and (len(clusters) >= n_max or len(sizes) > 1):
        chosen = [[rng.choice(c)] for c in clusters[:n_max]]
    else:
        total = 0
        for c in clusters:
            if total + len(c) > n_max:
                break
            chosen.append(c)
            total += len(c)
    out, ends = [], []
    for c in chosen:
        out += [lines[i] if lines[i].endswith(b"\n") else lines[i] + b"\n" for i in c]
        ends.append(len(out))
    return b"".join(out), ends


class Pace:
    """Seconds per item of one model, per slice, from the calls that scored it: a call of one
    slice measures it (`solo`); every call enters one rate per unit of `weights` (each slice's
    prior cost per item; missing: the mean), which prices a slice never scored alone. `state`:
    an earlier run's `to_json()` (kept in scoring.json)."""

    def __init__(self, weights: dict[str, float] | None = None, state: dict | None = None):
        self.weights = dict(weights or {})
        state = state if isinstance(state, dict) else {}
        try:
            self.solo = {str(s): [int(v[0]), float(v[1])] for s, v in (state.get("solo") or {}).items()}
            w = state.get("weighted") or [0.0, 0.0]
            self.weighted = [float(w[0]), float(w[1])]
        except (TypeError, ValueError, IndexError):
            self.solo, self.weighted = {}, [0.0, 0.0]

    def weight(self, s: str) -> float:
        if s in self.weights:
            return float(self.weights[s])
        return sum(self.weights.values()) / len(self.weights) if self.weights else 1.0

    def record(self, items: dict[str, int], seconds: float) -> None:
        """One call: `items` per slice (or lm-eval task) it scored, in `seconds`."""
        items = {s: int(n) for s, n in items.items() if n > 0}
        if not items or seconds < 0:
            return
        if len(items) == 1:
            (s, n), = items.items()
            have = self.solo.setdefault(s, [0, 0.0])
            have[0], have[1] = have[0] + n, have[1] + seconds
        self.weighted[0] += sum(n * self.weight(s) for s, n in items.items())
        self.weighted[1] += seconds

    @property
    def known(self) -> bool:
        return self.weighted[0] > 0

    def per_item(self, s: str) -> float | None:
        """Seconds an item of slice `s` takes (None before any call)."""
        if self.solo.get(s, [0])[0] > 0:
            return self.solo[s][1] / self.solo[s][0]
        if self.weighted[0] > 0:
            return self.weighted[1] / self.weighted[0] * self.weight(s)
        return None

    def cost(self, items: dict[str, int]) -> float | None:
        """Seconds for `items` per slice (0 for none; None when a slice has no estimate yet)."""
        total = 0.0
        for s, n in items.items():
            if n > 0:
                rate = self.per_item(s)
                if rate is None:
                    return None
                total += n * rate
        return total

    def to_json(self) -> dict:
        return {"solo": {s: [n, round(t, 3)] for s, (n, t) in sorted(self.solo.items())},
                "weighted": [round(self.weighted[0], 3), round(self.weighted[1], 3)],
                "per_item_s": {s: round(r, 4) for s in sorted(set(self.weights) | set(self.solo))
                               if (r := self.per_item(s)) is not None}}


def pace_priors(metas: dict[str, dict], reference: str) -> dict[str, float]:
    """variant -> its forward's seconds over the reference's (the quantize stage's
    `forward_seconds` in variants/<v>/meta.json): its pace before it has scored an item."""
    ref = ((metas.get(reference) or {}).get("forward_seconds") or {}).get("seconds")
    if not ref:
        return {}
    out = {}
    for name, meta in metas.items():
        got = ((meta or {}).get("forward_seconds") or {}).get("seconds")
        if name != reference and got:
            out[name] = float(got) / float(ref)
    return out


class Allowance(budget_mod.Allowance):
    """One variant's share of the quality stage's budget: the time left over the `variants_left`
    variants still to score (this one included); what one leaves unused goes to the next.
    Without a budget it affords everything."""

    def __init__(self, budget, variants_left: int):
        super().__init__(budget, "variant", max(budget.left() / max(variants_left, 1), 0.0)
                         if budget.active else None)

    def affords(self, estimate_s: float | None) -> bool:
        """Whether a look estimated at `estimate_s` fits (an unknown estimate: while time is left)."""
        if not self.active:
            return True
        return self.left() > 0 if estimate_s is None else estimate_s <= self.left()

    def why_not(self, estimate_s: float | None) -> str:
        """The reason a look was not taken, as meta.json and gate.json say it."""
        need = "an unknown time" if estimate_s is None else f"~{fmt_s(estimate_s)}"
        return f"budget: {fmt_s(max(self.left(), 0.0))} left, the next look needs {need}"

    def to_json(self) -> dict:
        return {"allowance_s": None if self.seconds is None else round(self.seconds, 1),
                "spent_s": round(self.spent(), 1)}

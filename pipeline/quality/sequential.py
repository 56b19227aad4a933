"""Scoring in looks: each model's item files grown a look at a time (Waves), and the order in
which the quality stage spends its looks over the variants (score_variants).

    from pipeline.quality.sequential import Waves, score_variants
    waves = Waves(out_dir, lines, plans, named, configs, timings)
    waves.first_look(reference, ref_score)
    score_variants(waves, reference, pending, ref_score, scorer, config, budget)

A variant is scored a look at a time on its open cells (the gate's own replay), the reference
first. Without a budget each variant goes to its end in turn. With one, in two passes, so that a
variant its first look settles leaves its time to the open ones: every variant's first look, then
the later looks of the variants still open, each given the time left over them (docs/methods/budget.md)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.core.budget import fmt_s
from pipeline.core.stage import (SCHEMA_VERSION, StageError, atomic_write_bytes, atomic_write_json, hash_obj,
                                 other_schema, progress, read_json)
from pipeline.gate.decision import open_slices
from pipeline.quality import lm_tasks
from pipeline.quality.row_sizing import SIZING_CONSTANTS
from pipeline.quality.waves import Allowance, Pace


def _add_counters(into: dict, new: dict, digits: int | None = None) -> None:
    """Add the evaluator's counts in `new` to `into` (float sums rounded to `digits`); its
    constants (row_sizing.SIZING_CONSTANTS) replace, never add; other non-numbers are left out."""
    for k, v in new.items():
        if k in SIZING_CONSTANTS:
            into[k] = v
        elif isinstance(v, (int, float)):
            total = into.get(k, 0) + v
            into[k] = round(total, digits) if digits is not None and isinstance(v, float) else total


class Waves:
    """Per-model item files grown a look at a time: quality/<model>/<slice>.jsonl holds one line
    per item scored, in the data file's order, always at a planned look; quality/<model>/
    scoring.json records what the lines were scored with (the model, the items, the generation
    settings), so an interrupted or re-planned run re-uses them; meta.json is written last.
    A slice is a built-in one (its wave's items are written to quality/data/waves/ for its YAML)
    or an lm-eval task in `named` (pipeline/quality/lm_tasks.py: NamedSlice; a look asks lm-eval
    for the look's documents by id); both have a plan and a data file in `lines`."""

    def __init__(self, out_dir: Path, lines: dict, plans: dict, named: list, configs, timings,
                 weights: dict[str, float] | None = None, clock=time.perf_counter):
        self.out_dir, self.lines, self.plans = out_dir, lines, plans
        self.named = {s.name: s for s in named}
        self.configs, self.timings = configs, timings
        self.weights, self.clock = weights, clock
        self.stats: dict[str, dict] = {}
        self.items: dict[str, object] = {}
        self.hashes: dict[str, str] = {}
        self.pace: dict[str, Pace] = {}  # model -> seconds per item per slice (kept in scoring.json)
        self.allowances: dict[str, Allowance] = {}
        # model -> its seconds per item against the reference's before it has scored one (the
        # quantize stage's timed forward, pipeline/quality/waves.py: pace_priors)
        self.prior: dict[str, float] = {}

    def open(self, item, scored_with: dict):
        """Fresh (finished with these inputs), resumed (lines scored with the same model, items
        and settings are kept, cut to a planned look) or started empty."""
        d, h = item.path, hash_obj(scored_with)
        self.items[d.name] = item
        self.hashes[d.name] = h
        self.stats[d.name] = {"items": 0, "seconds": 0.0, "counters": {}, "grew": False, "stop": None}
        state = d / "scoring.json"
        try:
            old = read_json(state, "quality scoring state") if state.is_file() else {}
        except StageError:
            if not item.fresh:
                raise
            old = {}  # a finished item's pace is only an estimate: never a reason to stop
        reusable = isinstance(old, dict) and old.get("score_hash") == h and other_schema(old) is None
        self.pace[d.name] = Pace(self.weights, old.get("pace") if reusable else None)
        if item.fresh:
            return item
        if not reusable and d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        (d / "meta.json").unlink(missing_ok=True)
        self._save_state(d.name)
        for s, p in self.plans.items():
            f = d / f"{s}.jsonl"
            if f.is_file():
                have = f.read_bytes().splitlines(keepends=True)
                keep = max([n for n in p["looks"] if n <= len(have)], default=0)
                if have[:keep] and [json.loads(x)["id"] for x in have[:keep]] != \
                        [json.loads(x)["id"] for x in self.lines[s][:keep]]:
                    keep = 0  # other items than the plan's: score again
                if keep != len(have):
                    atomic_write_bytes(f, b"".join(have[:keep]))
        return item

    def scored(self, name: str) -> dict[str, int]:
        d = self.out_dir / name
        return {s: _count(d / f"{s}.jsonl") for s in self.plans}

    def grew(self, name: str) -> bool:
        return self.stats[name]["grew"]

    def stopped(self, name: str) -> bool:
        """Whether `name` skipped a look in this run: on the budget, or (budgeted) on its verdict."""
        return bool(self.stats[name]["stop"])

    def stop(self, name: str, need: dict[str, int], why: str, kind: str = "budget") -> None:
        """Record that `name`'s next looks (`need`: slice -> items) were not taken, and why: on the
        "budget", or on the "verdict" (the variant is no-go already)."""
        self.stats[name]["stop"] = {"need": dict(need), "why": why, "kind": kind}

    def _save_state(self, name: str) -> None:
        atomic_write_json(self.out_dir / name / "scoring.json", {"score_hash": self.hashes[name], "schema": SCHEMA_VERSION,
                                                                 "pace": self.pace[name].to_json()})

    def first_items(self, name: str) -> dict[str, int]:
        """Items `name` lacks for its first look, per slice."""
        have = self.scored(name)
        return {s: max(p["looks"][0] - have[s], 0) for s, p in self.plans.items()}

    def items_left(self, name: str) -> dict[str, int]:
        """Items `name` lacks to every slice's maximum."""
        have = self.scored(name)
        return {s: max(p["n_max"] - have[s], 0) for s, p in self.plans.items()}

    def model_cost(self, name: str, items: dict[str, int], fallback: str) -> float | None:
        """Seconds for `name` to score `items` at its measured pace (before it has one: `fallback`'s,
        the reference's, which runs the same architecture on the same items, times `name`'s prior
        ratio where it has one)."""
        pace, ratio = self.pace.get(name), 1.0
        if pace is None or not pace.known:
            pace, ratio = self.pace.get(fallback), self.prior.get(name, 1.0)
        cost = None if pace is None else pace.cost(items)
        return None if cost is None else cost * ratio

    def look_cost(self, reference: str, name: str, need: dict[str, int]) -> float | None:
        """Seconds the look `need` (slice -> items) costs: the items the reference lacks for it and
        the items `name` lacks, each at its own pace; None when a pace is not known yet."""
        have_ref, have = self.scored(reference), self.scored(name)
        ref = self.model_cost(reference, {s: max(n - have_ref[s], 0) for s, n in need.items()}, reference)
        var = self.model_cost(name, {s: max(n - have[s], 0) for s, n in need.items()}, reference)
        return None if ref is None or var is None else ref + var

    def budget_record(self, name: str) -> dict:
        """Per slice: the items scored, the looks done, planned and skipped, and where scoring
        stopped: "settled" (a look decided every cell), "last look", "budget" (with why), or
        "verdict" (a budgeted stage stopped a variant that was no-go already, with why)."""
        have, stop = self.scored(name), self.stats[name]["stop"]
        allowance = self.allowances.get(name)
        slices = {}
        for s, p in self.plans.items():
            looks, n = p["looks"], have[s]
            done = sum(1 for x in looks if x <= n)
            rec = {"items": n, "n_max": p["n_max"], "looks_done": done, "looks_planned": len(looks)}
            if stop and s in stop["need"]:
                rec.update(stopped_on=stop.get("kind", "budget"), looks_skipped=len(looks) - done, why=stop["why"])
            else:
                rec.update(stopped_on="last look" if n >= looks[-1] else "settled", looks_skipped=0, why=None)
            slices[s] = rec
        return {**(allowance.to_json() if allowance else {"allowance_s": None, "spent_s": None}),
                "stopped": bool(stop), "why": stop["why"] if stop else None, "slices": slices}

    def first_look(self, name: str, score) -> None:
        self.cover(name, score, {s: p["looks"][0] for s, p in self.plans.items()})

    def next_looks(self, name: str, open_slices: set[str]) -> dict[str, int]:
        have = self.scored(name)
        need = {}
        for s in open_slices:
            if s in self.plans:
                later = [n for n in self.plans[s]["looks"] if n > have[s]]
                if later:
                    need[s] = later[0]
        return need

    def cover(self, name: str, score, need: dict[str, int]) -> None:
        """Score `name` on the items it lacks up to `need[slice]` and append them to its files: one
        lm-eval call per planned look it lacks (every slice's items of that look together), so a
        look's items are scored in calls of exactly them whichever model scores them (an lm-eval
        task that draws few-shot examples at random draws them per call: lm_tasks' docstring)."""
        have = self.scored(name)
        steps: list[dict[str, tuple[int, int]]] = []
        for s, n in need.items():
            lo = have[s]
            if n <= lo:
                continue
            for i, hi in enumerate([x for x in self.plans[s]["looks"] if lo < x < n] + [n]):
                if len(steps) <= i:
                    steps.append({})
                steps[i][s] = (lo, hi)
                lo = hi
        for step in steps:
            self._score(name, score, step)

    def _score(self, name: str, score, step: dict[str, tuple[int, int]]) -> None:
        """One lm-eval call: `name` on items [lo, hi) of each slice in `step`, appended."""
        d = self.out_dir / name
        files, tasks, want = {}, [], {}
        for s, (lo, hi) in step.items():
            chunk = b"".join(self.lines[s][lo:hi])
            if s in self.named:
                want[s] = [json.loads(x)["id"] for x in self.lines[s][lo:hi]]
                tasks.append(lm_tasks.subset(self.named[s], want[s]))
                continue
            f = self.out_dir / "data" / "waves" / f"{s}-{lo:05d}-{hi:05d}.jsonl"
            if not f.is_file() or f.read_bytes() != chunk:
                atomic_write_bytes(f, chunk)
            files[s] = f
        start = self.clock()
        records, counters = score(self.configs(files), tasks)
        took = self.clock() - start
        for s, ids in want.items():  # lm-eval's order (subtask, document) -> the look's order
            got = {r["id"]: r for r in records.get(s, [])}
            if sorted(got) != sorted(ids) or len(records.get(s, [])) != len(ids):
                raise StageError(f"quality: lm-eval returned {len(records.get(s, []))} records of '{s}' for "
                                 f"{len(ids)} documents asked ({name}, items {step[s][0]}-{step[s][1]})")
            records[s] = [got[i] for i in ids]
        load = (counters or {}).get("load_seconds") or 0.0
        self.pace.setdefault(name, Pace(self.weights)).record({t: len(recs) for t, recs in records.items()},
                                                              max(took - load, 0.0))
        self._save_state(name)
        st = self.stats[name]
        st["seconds"] += took
        st["grew"] = True
        _add_counters(st["counters"], counters or {})
        count = 0
        for task, recs in records.items():
            count += len(recs)
            f = d / f"{task}.jsonl"
            old = f.read_bytes() if (task in self.plans and f.is_file()) else b""
            atomic_write_bytes(f, old + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
        st["items"] += count
        where = ", ".join(f"{s} {lo}->{hi}" for s, (lo, hi) in step.items())
        progress(f"quality: {name}: {count} items in {took:.1f} s ({where})")

    def finish(self, name: str, evaluator: str, ran: dict | None = None) -> None:
        """Write `name`'s meta.json; `ran` (vllm_backend.Choice.record) says what scored it."""
        st, item = self.stats[name], self.items[name]
        old = item.meta if item.fresh else {}
        items = old.get("items", 0) + st["items"]
        seconds = round(old.get("eval_seconds", 0.0) + st["seconds"], 2)
        counters = dict(old.get("counters") or {})
        _add_counters(counters, st["counters"], digits=2)
        meta = dict(old)
        meta.update({"variant": name, "items": items, "eval_seconds": seconds,
                     "items_per_second": round(items / seconds, 3) if seconds > 0 else None,
                     "evaluator": evaluator, **(ran or {}), "items_scored": self.scored(name),
                     **({"counters": counters} if counters else {}),
                     **({"budget": self.budget_record(name)} if name in self.allowances else {})})
        atomic_write_json(item.path / "meta.json", item.record(meta))


def _count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


def first_look(waves: Waves, reference: str, name: str, score, allowance: Allowance | None = None) -> None:
    """Variant `name`'s first look (the reference has scored its own). With `allowance` (the
    variant's share of the stage's budget) its estimate is announced; it is scored even when it
    is over the allowance: the gate needs a first look."""
    if allowance is not None:
        waves.allowances[name] = allowance
        first = waves.first_items(name)
        if sum(first.values()):
            est = waves.look_cost(reference, name, first)
            allowance.parent.announce(
                f"{name}: first look, {sum(first.values())} items; allowance "
                f"{fmt_s(allowance.seconds) if allowance.active else 'unlimited'}", est)
            if not allowance.affords(est):
                progress(f"quality: {name}: the first look is over the allowance ({allowance.why_not(est)}); "
                         "scored anyway: the gate needs a first look")
    waves.first_look(name, score)


def next_need(waves: Waves, reference: str, name: str, cfg, budgeted: bool) -> tuple[dict[str, int], list[str]]:
    """(the look each open slice of `name` needs next, slice -> items, pipeline/gate/decision.py:
    open_slices; the rows a look has failed). Budgeted, a variant with a failed row needs nothing
    more (its no-go is settled): the failed rows are returned so the caller can record why it
    stopped."""
    open_, failed = open_slices(waves.out_dir, reference, name, cfg, waves.plans)
    need = waves.next_looks(name, open_)
    if budgeted and failed and need:
        return need, failed
    return need, []


def later_looks(waves: Waves, reference: str, name: str, ref_score, score, cfg,
                allowance: Allowance | None = None) -> None:
    """A look at a time for the slices of `name` whose cells are open (each look every open
    slice's next), the reference first scoring whatever the look needs. With an active
    `allowance`, before each look its cost is estimated (the items the variant and the reference
    lack for it, at each one's measured seconds per item) and a look that does not fit what is
    left is not taken: the variant stops there, its open cells stay open and its meta.json says
    which looks were skipped and why; a variant that has a failed cell stops too (its no-go is
    settled). None, or no budget: every look of every open cell."""
    budgeted = allowance is not None and allowance.active
    if allowance is not None:
        waves.allowances[name] = allowance
    while True:
        need, failed = next_need(waves, reference, name, cfg, budgeted)
        if not need:
            return
        if failed:
            _stop_on_verdict(waves, name, need, failed, allowance.parent)
            return
        if budgeted:
            est = waves.look_cost(reference, name, need)
            if not allowance.affords(est):
                why = allowance.why_not(est)
                waves.stop(name, need, why)
                allowance.parent.skip(_looks_skipped(name, need), why)
                return
        waves.cover(reference, ref_score, need)
        waves.cover(name, score, need)
        if budgeted:
            progress(f"quality: {name}: allowance {fmt_s(max(allowance.left(), 0.0))} left of "
                     f"{fmt_s(allowance.seconds)}; stage budget {fmt_s(max(allowance.parent.left(), 0.0))} left")


def score_in_waves(waves: Waves, reference: str, name: str, ref_score, score, cfg,
                   allowance: Allowance | None = None) -> None:
    """Variant `name` whole: its first look, then its later looks (first_look, later_looks).
    `score(configs, tasks)` (built-in slices' task configs, lm-eval tasks restricted to the
    look's documents) returns ({task: records}, counters), as pipeline.quality.evaluate.evaluate
    does (tests inject one). `allowance`: the variant's share of the stage's budget."""
    first_look(waves, reference, name, score, allowance)
    later_looks(waves, reference, name, ref_score, score, cfg, allowance)


def score_variants(waves: Waves, reference: str, pending: list[str], ref_score, scorer, cfg, budget,
                   after_first=None, finish=None, park=None) -> None:
    """Every variant in `pending` (the reference's first look already scored): `scorer(name)`
    gives its score function, `after_first(name)` runs once its first look is scored (the
    stage's drift, while the model is loaded), `finish(name)` once it is done (its meta.json,
    freeing its memory), `park(name)` when it waits, open, for the second pass (freeing its
    memory: it is loaded again for its later looks). Without an active `budget` (a StageBudget)
    each variant is scored whole in turn; with one, in two passes (the module's docstring says
    why): every first look, then the later looks of the variants still open, each with the time
    left over the ones to go."""
    after_first = after_first or (lambda name: None)
    finish = finish or (lambda name: None)
    park = park or (lambda name: None)
    if not budget.active:  # (an inactive Allowance affords every look; meta.json still has its record)
        for i, name in enumerate(pending):
            score, allowance = scorer(name), Allowance(budget, len(pending) - i)
            first_look(waves, reference, name, score, allowance)
            after_first(name)
            later_looks(waves, reference, name, ref_score, score, cfg, allowance)
            finish(name)
        return
    later = []
    for i, name in enumerate(pending):
        first_look(waves, reference, name, scorer(name), Allowance(budget, len(pending) - i))
        after_first(name)
        need, failed = next_need(waves, reference, name, cfg, budgeted=True)
        if failed:
            _stop_on_verdict(waves, name, need, failed, budget)
        elif need:
            later.append(name)
            progress(f"quality: {name}: open after its first look ({', '.join(sorted(need))}); "
                     "its later looks come after every variant's first")
            park(name)
            continue
        finish(name)
    for i, name in enumerate(later):
        later_looks(waves, reference, name, ref_score, scorer(name), cfg, Allowance(budget, len(later) - i))
        finish(name)


def _stop_on_verdict(waves: Waves, name: str, need: dict[str, int], failed: list[str], budget) -> None:
    """Record that `name`, no-go on its `failed` rows, is not scored on its open slices (`need`)."""
    why = (f"no-go already ({', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''} failed): "
           "no item of its open cells can change the decision")
    waves.stop(name, need, why, kind="verdict")
    budget.skip(_looks_skipped(name, need), why)
    progress(f"quality: {name}: {why}; its open cells are not scored further")


def _looks_skipped(name: str, need: dict[str, int]) -> str:
    """What a stop skips, as the stage budget records it: 'v: looks at b 200, c 80 and after'."""
    return f"{name}: looks at {', '.join(f'{s} {n}' for s, n in sorted(need.items()))} and after"


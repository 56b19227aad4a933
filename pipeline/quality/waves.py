"""Scoring in waves: each model's item files grown a look at a time (`Waves`), what re-opens them
(`item_inputs`), each model's seconds per item (`Pace`), and the order in which the stage spends
its looks (`score_variants`), each variant on its share of the stage's time (StageBudget.part).

    waves = Waves(out_dir, lines, plans, named, configs)
    waves.first_look(reference, ref_score)
    score_variants(waves, reference, pending, ref_score, scorer, config, budget)

A variant is scored a look at a time on its open cells (the gate's own replay), the reference
first. Without a budget each variant goes to its end in turn; with one, every variant's first
look, then the later looks of those still open, each given the time left (docs/methods/budget.md).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.core.budget import Allowance, StageBudget, fmt_s
from pipeline.core.stage import (SCHEMA_VERSION, StageError, atomic_write_bytes, atomic_write_json, hash_obj,
                                 old_meta, other_schema, progress, sha256_file)
from pipeline.gate.decision import open_slices
from pipeline.quality import lm_tasks
from pipeline.quality.row_sizing import SIZING_CONSTANTS


class Pace:
    """Seconds per item of one model, per slice: a call of one slice measures it (`solo`); every
    call enters one rate per unit of `weights` (each slice's prior cost per item), which prices a
    slice never scored alone. `state`: an earlier run's `to_json()` (kept in scoring.json)."""

    def __init__(self, weights: dict[str, float] | None = None, state: dict | None = None):
        self.weights = weights or {}
        state = state or {}
        self.solo = {s: list(v) for s, v in state.get("solo", {}).items()}
        self.weighted = list(state.get("weighted", [0.0, 0.0]))

    def weight(self, s: str) -> float:
        if s in self.weights:
            return self.weights[s]
        return sum(self.weights.values()) / len(self.weights) if self.weights else 1.0

    def record(self, items: dict[str, int], seconds: float) -> None:
        """One call: `items` per slice (or lm-eval task) it scored, in `seconds`."""
        items = {s: n for s, n in items.items() if n > 0}
        if not items:
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
    def seconds(name: str) -> float | None:
        return ((metas.get(name) or {}).get("forward_seconds") or {}).get("seconds")

    ref = seconds(reference)
    return {n: float(seconds(n)) / float(ref) for n in metas if ref and n != reference and seconds(n)}


def share(budget: StageBudget, variants_left: int) -> Allowance:
    """One variant's share of the stage's budget: the time left over the `variants_left` variants
    still to score (this one included); what one leaves unused goes to the next."""
    return budget.part("variant", of_items=variants_left)


def _why_not(allowance: Allowance, estimate_s: float | None) -> str:
    """The reason a look was not taken, as meta.json and gate.json say it."""
    need = "an unknown time" if estimate_s is None else f"~{fmt_s(estimate_s)}"
    return f"budget: {fmt_s(max(allowance.left(), 0.0))} left, the next look needs {need}"


def _add_counters(into: dict, new: dict, digits: int | None = None) -> None:
    """Add the evaluator's counts in `new` to `into` (float sums rounded to `digits`); its
    constants (row_sizing.SIZING_CONSTANTS) replace, never add; other non-numbers are left out."""
    for k, v in new.items():
        if k in SIZING_CONSTANTS:
            into[k] = v
        elif isinstance(v, (int, float)):
            total = into.get(k, 0) + v
            into[k] = round(total, digits) if digits is not None and isinstance(v, float) else total


# Config keys that change when scoring stops, never what an item scores: a run that changes only
# these re-uses every item already scored.
STOPPING_KEYS = ("wave_items", "max_items", "items_per_slice", "distribution_docs", "distribution_tokens")
# quality.vllm keys that change where engines live or what happens after scoring, never a line.
VLLM_STOPPING_KEYS = ("keep_reference", "distribution", "fallback", "devices")


def item_inputs(ctx, vdir: Path, ref_dir: Path, data_hashes: dict, named: list,
                backend: dict | None = None) -> tuple[dict, object]:
    """(what a model's lines were scored with, so lines scored with the same are kept; a function
    of `stopped` giving its item's inputs, the budget in them only when it stopped the variant).
    `backend`: vllm_backend.Choice.scored_with."""
    cfg = ctx.config
    quality = cfg.section("quality")
    if quality.get("backend", "hf") == "hf":
        quality = {k: v for k, v in quality.items() if k != "vllm"}
    scoring = {k: v for k, v in quality.items() if k not in STOPPING_KEYS}
    if isinstance(scoring.get("per_slice"), dict):  # a slice's own wave_items is a stopping key too
        kept = {n: {k: v for k, v in e.items() if k not in STOPPING_KEYS and v is not None}
                for n, e in scoring["per_slice"].items() if isinstance(e, dict)}
        scoring["per_slice"] = {n: e for n, e in kept.items() if e}  # an entry left empty says nothing
    if "vllm" in scoring:
        scoring["vllm"] = {k: v for k, v in scoring["vllm"].items() if k not in VLLM_STOPPING_KEYS}
    scored_with = {"variant_meta": sha256_file(vdir / "meta.json"), "data": data_hashes,
                   "tasks": {s.name: s.info() for s in named}, "quality": scoring,
                   "device": cfg.device, "seed": cfg.seed,
                   "code": ctx.code, **({"backend": backend} if backend is not None else {})}
    inputs = {**scored_with, "reference_meta": sha256_file(ref_dir / "meta.json"),
              "quality": quality, "gate": cfg.section("gate"), "confidence": cfg.confidence,
              "release": sorted(n for n, v in cfg.quantize.variants.items() if v.release)}
    stage_budget = {"minutes": cfg.budget.minutes, "share": cfg.budget.shares.get("quality")}
    return scored_with, lambda stopped: {**inputs, "budget": stage_budget} if stopped else inputs


def read_meta(vdir: Path) -> dict:
    """A directory's meta.json, {} where it is missing or unreadable."""
    return old_meta(vdir / "meta.json")


def budget_stopped(item_dir: Path) -> bool:
    """Whether a model's last finished scoring skipped a look on the budget (its meta.json)."""
    return bool((read_meta(item_dir).get("budget") or {}).get("stopped"))


class Waves:
    """Per-model item files grown a look at a time: quality/<model>/<slice>.jsonl holds one line
    per item scored, in the data file's order, always at a planned look; scoring.json records what
    the lines were scored with, so an interrupted or re-planned run re-uses them; meta.json is
    written last. A built-in slice's look is written to quality/data/waves/ for its YAML; an
    lm-eval task in `named` (lm_tasks.NamedSlice) is asked for the look's documents by id."""

    def __init__(self, out_dir: Path, lines: dict, plans: dict, named: list, configs,
                 weights: dict[str, float] | None = None, clock=time.perf_counter):
        self.out_dir, self.lines, self.plans = out_dir, lines, plans
        self.named = {s.name: s for s in named}
        self.configs, self.weights, self.clock = configs, weights, clock
        self.stats: dict[str, dict] = {}
        self.items: dict[str, object] = {}
        self.hashes: dict[str, str] = {}
        self.pace: dict[str, Pace] = {}  # model -> seconds per item per slice (kept in scoring.json)
        self.allowances: dict[str, Allowance] = {}
        self.prior: dict[str, float] = {}  # model -> its pace over the reference's (pace_priors)

    def open(self, item, scored_with: dict):
        """Fresh (finished with these inputs), resumed (lines scored with the same model, items
        and settings are kept, cut to a planned look) or started empty."""
        d, h = item.path, hash_obj(scored_with)
        self.items[d.name] = item
        self.hashes[d.name] = h
        self.stats[d.name] = {"items": 0, "seconds": 0.0, "counters": {}, "grew": False, "stop": None}
        old = old_meta(d / "scoring.json")  # unreadable: scored again
        reusable = old.get("score_hash") == h and other_schema(old) is None
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
        files = {s: self.out_dir / name / f"{s}.jsonl" for s in self.plans}
        return {s: len(f.read_bytes().splitlines()) if f.is_file() else 0 for s, f in files.items()}

    def grew(self, name: str) -> bool:
        return self.stats[name]["grew"]

    def stopped(self, name: str) -> bool:
        """Whether `name` skipped a look in this run: on the budget, or (budgeted) on its verdict."""
        return bool(self.stats[name]["stop"])

    def stop(self, name: str, need: dict[str, int], why: str, kind: str = "budget") -> None:
        """Record that `name`'s next looks (`need`) were not taken, and why ("budget" or "verdict")."""
        self.stats[name]["stop"] = {"need": dict(need), "why": why, "kind": kind}

    def _save_state(self, name: str) -> None:
        atomic_write_json(self.out_dir / name / "scoring.json", {"score_hash": self.hashes[name], "schema": SCHEMA_VERSION,
                                                                 "pace": self.pace[name].to_json()})

    def lacks(self, name: str, upto: dict[str, int]) -> dict[str, int]:
        """Items `name` lacks to reach `upto` (slice -> items)."""
        have = self.scored(name)
        return {s: max(n - have[s], 0) for s, n in upto.items()}

    def first_items(self, name: str) -> dict[str, int]:
        return self.lacks(name, {s: p["looks"][0] for s, p in self.plans.items()})

    def model_cost(self, name: str, items: dict[str, int], fallback: str) -> float | None:
        """Seconds for `name` to score `items` at its measured pace (before it has one: the
        reference `fallback`'s times `name`'s prior ratio)."""
        pace, ratio = self.pace.get(name), 1.0
        if pace is None or not pace.known:
            pace, ratio = self.pace.get(fallback), self.prior.get(name, 1.0)
        cost = None if pace is None else pace.cost(items)
        return None if cost is None else cost * ratio

    def look_cost(self, reference: str, name: str, need: dict[str, int]) -> float | None:
        """Seconds the look `need` (slice -> items) costs the reference and `name`, each at its own
        pace; None when a pace is not known yet."""
        ref = self.model_cost(reference, self.lacks(reference, need), reference)
        var = self.model_cost(name, self.lacks(name, need), reference)
        return None if ref is None or var is None else ref + var

    def budget_record(self, name: str) -> dict:
        """Per slice: the items scored, the looks done, planned and skipped, and where scoring
        stopped: "settled", "last look", "budget" or "verdict" (with why)."""
        have, stop = self.scored(name), self.stats[name]["stop"]
        a = self.allowances.get(name)
        slices = {}
        for s, p in self.plans.items():
            looks, n = p["looks"], have[s]
            done = sum(1 for x in looks if x <= n)
            rec = {"items": n, "n_max": p["n_max"], "looks_done": done, "looks_planned": len(looks)}
            if stop and s in stop["need"]:
                rec.update(stopped_on=stop["kind"], looks_skipped=len(looks) - done, why=stop["why"])
            else:
                rec.update(stopped_on="last look" if n >= looks[-1] else "settled", looks_skipped=0, why=None)
            slices[s] = rec
        return {"allowance_s": None if a is None or a.seconds is None else round(a.seconds, 1),
                "spent_s": None if a is None else round(a.spent(), 1),
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
        lm-eval call per planned look it lacks (few-shot draws are per call, so every model scores
        a look's items in one call of exactly them)."""
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
        load = counters.get("load_seconds", 0.0)
        self.pace.setdefault(name, Pace(self.weights)).record({t: len(recs) for t, recs in records.items()},
                                                              max(took - load, 0.0))
        self._save_state(name)
        st = self.stats[name]
        st["seconds"] += took
        st["grew"] = True
        _add_counters(st["counters"], counters)
        count = 0
        for task, recs in records.items():
            count += len(recs)
            f = d / f"{task}.jsonl"
            old = f.read_bytes() if (task in self.plans and f.is_file()) else b""
            atomic_write_bytes(f, old + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
        st["items"] += count
        where = ", ".join(f"{s} {lo}->{hi}" for s, (lo, hi) in step.items())
        progress(f"quality: {name}: {count} items in {took:.1f} s ({where})")

    def announce(self, budget: StageBudget, reference: str, pending: list[str], first: bool) -> None:
        """The stage's estimate: the reference and the `pending` variants to every slice's maximum,
        at the seconds per item measured so far (`first`: before the reference's first look)."""
        if not pending:  # nothing to score but what the reference lacks for variants already done
            return
        left = {n: self.lacks(n, {s: p["n_max"] for s, p in self.plans.items()}) for n in [reference, *pending]}
        total = sum(sum(v.values()) for v in left.values())
        costs = [self.model_cost(n, v, reference) for n, v in left.items()]
        est = None if None in costs else sum(costs)
        if first:
            what = (f"up to {total} items: the reference and {len(pending)} variant(s) to every slice's maximum "
                    f"({', '.join(str(s) + ' ' + str(p['n_max']) for s, p in self.plans.items())})"
                    + ("" if est is not None else "; s/item not measured yet"))
        else:
            firsts = [self.model_cost(n, self.first_items(n), reference) for n in pending]
            rates = self.pace[reference].to_json()["per_item_s"] if reference in self.pace else {}
            what = (f"after the reference's first look (s/item: "
                    f"{', '.join(f'{s} {r:.2f}' for s, r in rates.items()) or '-'}): up to {total} more items; "
                    f"the variants' first looks ~{fmt_s(None if None in firsts else sum(firsts))}")
        budget.announce(what, est)

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


def first_look(waves: Waves, reference: str, name: str, score, allowance: Allowance | None = None) -> None:
    """Variant `name`'s first look, its estimate announced against `allowance` (its share of the
    stage's budget); scored even over the allowance: the gate needs a first look."""
    if allowance is not None:
        waves.allowances[name] = allowance
        first = waves.first_items(name)
        if sum(first.values()):
            est = waves.look_cost(reference, name, first)
            allowance.parent.announce(
                f"{name}: first look, {sum(first.values())} items; allowance "
                f"{fmt_s(allowance.seconds) if allowance.active else 'unlimited'}", est)
            if not allowance.affords(est):
                progress(f"quality: {name}: the first look is over the allowance ({_why_not(allowance, est)}); "
                         "scored anyway: the gate needs a first look")
    waves.first_look(name, score)


def later_looks(waves: Waves, reference: str, name: str, ref_score, score, cfg,
                allowance: Allowance | None = None) -> None:
    """A look at a time for the slices of `name` whose cells are open, the reference first scoring
    what the look needs. With an active `allowance`, a look whose estimated cost does not fit what
    is left is not taken (the cells stay open; meta.json says which looks were skipped and why),
    and a variant with a failed cell stops (its no-go is settled). Else every look of every open cell."""
    budgeted = allowance is not None and allowance.active
    if allowance is not None:
        waves.allowances[name] = allowance
    while True:
        open_, failed = open_slices(waves.out_dir, reference, name, cfg, waves.plans)  # the gate's own replay
        need = waves.next_looks(name, open_)
        if not need:
            return
        if budgeted:
            if failed:
                _stop_on_verdict(waves, name, need, failed, allowance.parent)
                return
            est = waves.look_cost(reference, name, need)
            if not allowance.affords(est):
                why = _why_not(allowance, est)
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
    """Variant `name` whole: its first look, then its later looks. `score(configs, tasks)` returns
    ({task: records}, counters), as pipeline.quality.evaluate.evaluate does."""
    first_look(waves, reference, name, score, allowance)
    later_looks(waves, reference, name, ref_score, score, cfg, allowance)


def _nothing(name: str) -> None:
    pass


def score_variants(waves: Waves, reference: str, pending: list[str], ref_score, scorer, cfg, budget,
                   after_first=_nothing, finish=_nothing, park=_nothing) -> None:
    """Every variant in `pending` (the reference's first look already scored): `scorer(name)`
    gives its score function; `after_first(name)` runs after its first look (the stage's drift),
    `finish(name)` once it is done, `park(name)` when it waits, open, for the second pass. Without
    an active `budget` (a StageBudget) each variant whole in turn; with one, in two passes."""
    later = []
    for i, name in enumerate(pending):
        score, allowance = scorer(name), share(budget, len(pending) - i)
        first_look(waves, reference, name, score, allowance)
        after_first(name)
        if not budget.active:  # (an inactive allowance affords every look; meta.json still has its record)
            later_looks(waves, reference, name, ref_score, score, cfg, allowance)
        else:
            open_, failed = open_slices(waves.out_dir, reference, name, cfg, waves.plans)
            need = waves.next_looks(name, open_)
            if need and failed:
                _stop_on_verdict(waves, name, need, failed, budget)
            elif need:
                later.append(name)
                progress(f"quality: {name}: open after its first look ({', '.join(sorted(need))}); "
                         "its later looks come after every variant's first")
                park(name)
                continue
        finish(name)
    for i, name in enumerate(later):
        later_looks(waves, reference, name, ref_score, scorer(name), cfg, share(budget, len(later) - i))
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


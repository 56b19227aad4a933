"""The gate's error rates, simulated through the project's own functions. Not a test (pytest
collects test_*.py only); run it for a closing note or docs/validation/sequential-gate.md:

    .venv/bin/python tests/sim_gate_rates.py [--before main]   # issue 13: before vs this tree, a few minutes
    .venv/bin/python tests/sim_gate_rates.py --sequential      # issue 26: the sequential gate (this tree)

Default mode (issue 13's findings, fixed-n gate): the `before` tree is `git archive <ref> pipeline
evals` unpacked in a temporary directory; each side runs in its own subprocess with that tree
first on sys.path, prints JSON, and this script prints a markdown table. Refs from before the
split into subpackages (0e99f32) are reached through tree_module's flat names.

--sequential: false pass and false fail of one gated 0/1 cell on the margin under
group-sequential looks (the waves' order, looks.plan, looks.levels, cluster_split and binary_p at
each look, checked against paired_difference -> looks.settle), by discordance mix, cluster
design and number of looks, and the items a cell spends on the default config and gpu.yaml.
On slices whose clusters have unequal sizes the stage scores one item per cluster (one look or
many), so there the margin is put on the cluster-weighted difference; a second table shows what
the gate does with an item-weighted regression confined to the big clusters (it passes).
Monte-Carlo standard errors are printed beside the rates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MARGIN, ALPHA = 0.05, 0.025
MIXES = [(0.05, 0.0), (0.06, 0.01), (0.10, 0.05), (0.20, 0.15)]


def tree_module(name: str):
    """A module of the tree on sys.path under today's name, or under the flat layout it had
    before pipeline/ was split into subpackages (0e99f32), so `--before` reaches older refs."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        flat = {"pipeline.stats.paired": "pipeline.stats", "pipeline.stats.tango": "pipeline.tango",
                "pipeline.stats.scoring_rules": "pipeline.scoring_rules",
                "pipeline.quality.evaluate": "pipeline.quality"}
        return importlib.import_module(flat[name])


def step_levels(p_values: Sequence[float], passes_at: Callable[[int, float], bool], alpha: float,
                method: str) -> list[float]:
    """The one-sided alpha each test's bound is drawn at under Holm's step-down (or bonferroni,
    none): the r-th smallest p at alpha / (m - r) until one is not rejected (`passes_at(i, level)`);
    it and every later test at that stopping level."""
    m = len(p_values)
    if method == "none" or m == 0:
        return [alpha] * m
    if method == "bonferroni":
        return [alpha / m] * m
    if method != "holm":
        raise ValueError(f"unknown multiplicity method {method!r} (holm, bonferroni, none)")
    levels = [alpha] * m
    stopped_at: float | None = None
    for rank, i in enumerate(np.argsort(p_values, kind="stable")):
        level = stopped_at if stopped_at is not None else alpha / (m - rank)
        levels[i] = level
        if stopped_at is None and not passes_at(int(i), level):
            stopped_at = level
    return levels


def rate(hits, sims: int) -> list[float]:
    """[rate, its MC standard error]; `hits` is a count or an array of 0/1 outcomes."""
    r = float(np.mean(hits)) if np.ndim(hits) else float(hits) / sims
    return [round(r, 4), round(float(np.sqrt(r * (1 - r) / sims)), 4)]


def arrays(better: int, worse: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    ref = np.r_[np.zeros(better), np.ones(worse), np.ones(n - better - worse)]
    var = np.r_[np.ones(better), np.zeros(worse), np.ones(n - better - worse)]
    return ref, var


class Side:
    """The two trees' gate through one interface."""

    def __init__(self):
        S = tree_module("pipeline.stats.paired")
        self.S = S
        self.new = hasattr(S, "PairedBinary")

    def estimate(self, ref, var, clusters=None, prompts=None):
        S = self.S
        if self.new:
            codes = S.merge_clusters(len(ref), clusters, prompts)
            return S.paired_difference(ref, var, codes)
        return S.paired_difference(ref, var, clusters, min_clusters=10)  # main's gate: prompts ignored

    def lower(self, est, alpha):
        return est.lower(alpha) if self.new else est.ci(alpha, MARGIN)[0]

    def upper(self, est, alpha):
        return est.upper(alpha) if self.new else est.ci(alpha)[1]

    def p_pass(self, est):
        return est.p_pass(MARGIN) if self.new else est.p_value(MARGIN)

    def variant_decisions(self, family: dict[str, list]) -> dict[str, str]:
        """Decisions of every variant (name -> cell estimates), the way each tree's gate draws
        the bounds: main: one Holm family over every cell of every variant, both sides; this
        tree: pass side unadjusted (intersection-union), fail side Holm within the variant."""
        S = self.S
        names = [(v, k) for v, cells in family.items() for k in range(len(cells))]
        ests = [family[v][k] for v, k in names]
        if self.new:
            lo = [ALPHA] * len(ests)
            hi = []
            for v, cells in family.items():
                q = [e.p_fail(MARGIN) for e in cells]
                hi += step_levels(q, lambda i, a: cells[i].upper(a) < -MARGIN, ALPHA, "holm")
        else:
            p = [e.p_value(MARGIN) for e in ests]
            q = [e.p_value_inferior(MARGIN) for e in ests]
            lo = step_levels(p, lambda i, a: ests[i].ci(a, MARGIN)[0] > -MARGIN, ALPHA, "holm")
            hi = step_levels(q, lambda i, a: ests[i].ci(a)[1] < -MARGIN, ALPHA, "holm")
        status = {}
        for (v, _), e, a, b in zip(names, ests, lo, hi):
            s = S.noninferiority_status(self.lower(e, a), self.upper(e, b), MARGIN)
            status.setdefault(v, []).append(s)
        return {v: "no-go" if "fail" in s else "go" if all(x == "pass" for x in s) else "inconclusive"
                for v, s in status.items()}


def f1_multiplicity(side: Side, rng) -> dict:
    """An equivalent variant (5 slices, 3%/3% discordance, n = 400): P(go) alone, with three
    good siblings, with one broken release: false sibling; and how often the broken sibling
    changes the same data's verdict."""
    n, sims, slices = 400, 400, 5

    def cells(worse, better):
        out = []
        for _ in range(slices):
            b, w, _ = rng.multinomial(n, [better, worse, 1 - better - worse])
            out.append(side.estimate(*arrays(b, w, n)))
        return out

    go = {"alone": 0, "three good siblings": 0, "one broken sibling": 0}
    changed = 0
    for _ in range(sims):
        good = cells(0.03, 0.03)
        sibs = [cells(0.03, 0.03) for _ in range(3)]
        broken = cells(0.30, 0.0)
        alone = side.variant_decisions({"good": good})["good"]
        with_good = side.variant_decisions({"good": good, **{f"s{i}": s for i, s in enumerate(sibs)}})["good"]
        with_broken = side.variant_decisions({"good": good, "broken": broken})["good"]
        go["alone"] += alone == "go"
        go["three good siblings"] += with_good == "go"
        go["one broken sibling"] += with_broken == "go"
        changed += alone != with_broken
    return {**{f"P(go) {k}": rate(v, sims) for k, v in go.items()},
            "verdict changed by a broken release:false sibling": rate(changed, sims)}


def f2_duplicates(side: Side, rng) -> dict:
    """False pass at the margin when the variant's discordance is drawn per PROMPT (greedy copies
    of a prompt agree), for the tree's own generators at gpu.yaml size (1000 items)."""
    from evals import generate as gen

    out = {}
    for name in ("tool_args", "reasoning", "calibration"):
        items = gen.generate(name, 1000)
        prompts = [it["prompt"] for it in items]
        labels = [it["cluster"] for it in items]
        _, prompt_code = np.unique(prompts, return_inverse=True)
        g = int(prompt_code.max()) + 1
        out[f"{name}: distinct prompts in 1000"] = g
        for worse, better in ((0.05, 0.0), (0.20, 0.15)):
            sims, hits = 1500, 0
            for _ in range(sims):
                u = rng.random(g)[prompt_code]
                ref = np.ones(1000)
                var = np.where(u < worse, 0.0, 1.0)
                ref = np.where((u >= worse) & (u < worse + better), 0.0, ref)
                est = side.estimate(ref, var, labels, prompts)
                hits += side.lower(est, ALPHA) > -MARGIN
            out[f"{name}: false pass, per-prompt mix {worse:.0%}/{better:.0%}"] = rate(hits, sims)
    items = gen.generate("language", 200)
    in_shots = sum(it["prompt"].count(f"Q: {it['prompt'].rsplit(chr(10) + 'Q: ', 1)[1].removesuffix(chr(10) + 'A:')}\n") > 1
                   for it in items)
    out["language: question repeats a shot (of 200)"] = in_shots
    return out


def f3_calibration(side: Side, rng) -> dict:
    """The calibration cell at the margin. main gated ECE (percentile cluster bootstrap of the
    plug-in ECE difference): reference calibrated, variant off by 0.05 everywhere (true ECE
    difference = -margin). This tree gates Brier (t, CR1): per-item Brier differences drawn from
    a population whose mean is exactly -margin."""
    S = side.S
    out = {}
    if not side.new:
        for n, sims in ((200, 200), (1000, 100)):
            hits = 0
            for _ in range(sims):
                conf = rng.uniform(0.35, 1.0, n)
                ref_ok = (rng.random(n) < conf).astype(float)
                var_ok = (rng.random(n) < conf - MARGIN).astype(float)
                est = S.cluster_bootstrap(S.ece_statistic(conf, ref_ok), S.ece_statistic(conf, var_ok), n,
                                          metric="ece", higher_is_better=False, n_resamples=2000,
                                          seed=int(rng.integers(1 << 30)), score_range=(0.0, 1.0))
                hits += est.ci(ALPHA, MARGIN)[0] > -MARGIN
            out[f"ECE cell false pass, n={n}"] = rate(hits, sims)
        return out
    population = brier_population(rng)
    margin = -float(population.mean())
    for n, sims in ((40, 10000), (200, 10000), (1000, 4000)):
        d = population[rng.integers(population.size, size=(sims, n))]
        mean, se, df = S.mean_se(d)
        out[f"Brier cell false pass, n={n}"] = rate(S.t_bound(mean, se, df, ALPHA, -1) > -margin, sims)
    return out


def brier_population(rng, size: int = 200_000, sigma: float = 0.575) -> np.ndarray:
    """As tests/test_gate_sims.py: brier_population (not imported: that file imports today's
    layout, and this one runs under older trees too)."""
    R = tree_module("pipeline.stats.scoring_rules")
    label = rng.integers(4, size=size)
    logits = rng.standard_normal((size, 4))
    logits[np.arange(size), label] += 1.2

    def brier(x):
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return R.brier_per_item(p, label)

    return brier(logits) - brier(logits + sigma * rng.standard_normal(logits.shape))


def f4_paired_ci(side: Side, rng) -> dict:
    out = {}
    for n in (40, 200, 1000):
        for worse, better in MIXES:
            sims = 3000 if not side.new else 20000
            counts = rng.multinomial(n, [better, worse, 1 - better - worse], size=sims)
            if side.new:
                tango = tree_module("pipeline.stats.tango")
                hits = tango.p_value(counts[:, 0], counts[:, 1], n, -MARGIN) < ALPHA
            else:
                cache: dict = {}
                hits = 0
                for b, w, _ in counts:
                    if (b, w) not in cache:
                        est = side.estimate(*arrays(b, w, n))
                        cache[(b, w)] = side.lower(est, ALPHA) > -MARGIN
                    hits += cache[(b, w)]
            out[f"false pass n={n} mix {worse:.0%}/{better:.0%}"] = rate(hits, sims)
        # A/A: as good as the reference, 5%/5% discordance: P(fail).
        sims = 2000
        counts = rng.multinomial(n, [0.05, 0.05, 0.9], size=sims)
        fails = sum(side.upper(side.estimate(*arrays(b, w, n)), ALPHA) < -MARGIN for b, w, _ in counts[:300])
        out[f"A/A false no-go n={n} (5%/5%)"] = rate(fails, 300)
    for n in (40, 200):
        lows = {}
        for b in range(0, 12):
            for w in range(0, 12):
                lows[(b, w)] = side.lower(side.estimate(*arrays(b, w, n)), ALPHA)
        bad = sum(lows[(b + 1, w)] < lows[(b, w)] for b in range(11) for w in range(12))
        out[f"tables (n={n}, <12 discordant) where one more better item LOWERS the bound"] = f"{bad} of 132"
        out[f"lower bound n={n}: no item differs / one item better"] = \
            f"{lows[(0, 0)]:+.4f} / {lows[(1, 0)]:+.4f}"
    return out


def f6_descriptive(side: Side, rng) -> dict:
    """Per-slice and per-group CIs in quality/<variant>.json: share outside [0, 1]."""
    quality = tree_module("pipeline.quality.evaluate")

    out = {}
    cases = {"30 clusters x 4, p=0.92": (30, 4, 0.92), "20 haystacks x 3, p=0.9": (20, 3, 0.9),
             "group of 10 items, p=0.9": (10, 1, 0.9), "group of 10 items, p=0.1": (10, 1, 0.1)}
    for label, (g, m, p) in cases.items():
        sims, outside = 500, 0
        from scipy import stats as sps

        a = sps.norm.ppf(p) * np.sqrt(1.3)
        for _ in range(sims):
            z = np.repeat(rng.normal(0, np.sqrt(0.3), g), m) + rng.standard_normal(g * m)
            y = (z < a).astype(float)
            # Groups (m = 1): main's language data labelled 4 templates as clusters; the new data
            # labels each item its own (its templates are strata).
            clusters = ([f"c{i // m}" for i in range(g * m)] if m > 1 else
                        [f"t{i % 4}" for i in range(g * m)] if not side.new else [f"i{i}" for i in range(g)])
            if side.new:
                recs = [{"score": s, "cluster": c, "prompt_hash": None, "group": None, "metric": "m",
                         "scores": {"m": s}} for s, c in zip(y, clusters)]
                lo, hi = quality.summarize_slice(recs, 0.95)["ci"]
            else:
                lo, hi = quality.mean_ci(y, clusters, 0.95)[1]
            outside += lo is not None and (lo < 0 or hi > 1)
        out[f"CI outside [0, 1]: {label}"] = rate(outside, sims)
    return out


def measure() -> dict:
    rng = np.random.default_rng(13)
    side = Side()
    return {"F1 multiplicity": f1_multiplicity(side, rng), "F2 duplicated prompts": f2_duplicates(side, rng),
            "F3 calibration cell": f3_calibration(side, rng), "F4 paired CI": f4_paired_ci(side, rng),
            "F6 descriptive CIs": f6_descriptive(side, rng)}


# ---------------------------------------------------------------- --sequential (issue 26)
#
# One gated 0/1 cell under group-sequential looks, the way the quality stage and the gate run it:
# the slice's pool put in its seeded cluster order (pipeline/quality/items.py: order_items, which
# the quality stage calls for one look and for waves alike), looks planned at cluster ends
# (pipeline/gate/looks.py: plan), each look's nominal level from looks.levels (what looks.settle
# draws the bounds at), and at each look the cell's clusters split as the gate splits them
# (paired.cluster_split on the look's items, clustered by paired.merge_clusters as
# decision.item_clusters does) and tested with paired.binary_p, which decides exactly as
# PairedBinary's bounds do. Some simulations of every
# kind of design are also replayed through paired.paired_difference -> looks.settle, and the
# script stops if one decision or item count differs.
#
# Cost: sequential.boundaries integrates on a 4001-point grid (seconds for 6 looks); a design
# with unequal clusters has different looks in each seeded order, so this script draws the levels
# on a GRID-point grid (the same function otherwise) and prints how far that moves them.

SEQ_SIMS = 5000  # MC SE of a rate at 0.025: 0.0022
ORDERS = 50  # seeded cluster orders per design with unequal clusters (the looks and the split depend on it)
GRID = 801
SPENDING = "obf"  # gate.spending of the --sequential tables (--spending)
LOOK_COUNTS = (1, 2, 4, 6)
REPLAY = 50  # simulations per checked scenario replayed through paired_difference -> settle
REPLAYED = [0]


def pool(parts) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """A slice pool from (clusters, size, worse, better) parts: JSONL with a `cluster` label per
    item (what order_items and the gate cluster by), and per item its cluster, worse and better
    rates."""
    sizes = np.concatenate([np.full(c, m) for c, m, _, _ in parts])
    cl = np.repeat(np.arange(sizes.size), sizes)
    worse = np.concatenate([np.full(c * m, w) for c, m, w, _ in parts])
    better = np.concatenate([np.full(c * m, b) for c, m, _, b in parts])
    blob = "".join(json.dumps({"id": f"i{j}", "cluster": f"c{g}"}) + "\n" for j, g in enumerate(cl)).encode()
    return blob, cl, worse, better


class Schedule:
    """One run's looks at a slice: the items in scoring order, the planned looks, and per look
    the gate's cluster split and the bulk's items, with both sides' nominal levels."""

    def __init__(self, blob: bytes, n_max: int, wave: int | None, seed: int, alpha_fail: float):
        from pipeline.gate import looks as L
        from pipeline.quality.items import order_items
        from pipeline.stats import paired as S

        # As pipeline/quality/items.py: slice_data: one look or many, the same selection
        # (order_items with the budget: whole clusters in seeded order, or one item per cluster
        # where the clusters' sizes differ); one look is plan(n_max, None), the fixed-n gate.
        ordered, ends = order_items(blob, seed, "sim", n_max)
        rows = [json.loads(x) for x in ordered.splitlines()]
        self.items = np.array([int(r["id"][1:]) for r in rows])
        self.labels = [r["cluster"] for r in rows]
        self.n_max = len(rows)
        sequential = bool(wave) and wave < n_max
        self.looks = L.plan(self.n_max, wave if sequential else None, ends if sequential else None)
        self.level_pass = L.levels(tuple(self.looks), self.n_max, ALPHA, SPENDING)
        self.level_fail = L.levels(tuple(self.looks), self.n_max, alpha_fail, SPENDING)
        self.alpha_fail = alpha_fail
        self.codes, self.splits, self.bulk = [], [], []
        for n in self.looks:
            codes = S.merge_clusters(n, self.labels[:n])
            split = S.cluster_split(codes)
            self.codes.append(codes)
            self.splits.append(split)
            self.bulk.append(split.bulk[codes])

    def run(self, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per simulation (rows of d: -1 worse, +1 better, 0 same, per item in scoring order):
        status (+1 pass, -1 fail, 0 inconclusive at the last look) and items spent."""
        from pipeline.stats import paired as S

        status = np.zeros(d.shape[0], dtype=np.int8)
        spent = np.full(d.shape[0], self.looks[-1])
        for n, split, bulk, lp, lf in zip(self.looks, self.splits, self.bulk, self.level_pass, self.level_fail):
            idx = np.flatnonzero(status == 0)
            if idx.size == 0:
                break
            head = d[idx, :n]
            b = np.count_nonzero((head == 1) & bulk, axis=1)
            w = np.count_nonzero((head == -1) & bulk, axis=1)
            passed = S.binary_p(b, w, split, MARGIN, "pass") < lp
            failed = ~passed & (S.binary_p(b, w, split, MARGIN, "fail") < lf)
            status[idx[passed]], status[idx[failed]] = 1, -1
            spent[idx[passed | failed]] = n
        return status, spent

    def replay(self, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The same runs through the gate's own path: at each look paired_difference on the look's
        item scores and clusters, then looks.settle (as decision.settle_variant calls it)."""
        from pipeline.gate import looks as L
        from pipeline.stats import paired as S

        status, spent = [], []
        for row in d:
            ref = np.where(row == 1, 0.0, 1.0)
            var = np.where(row == -1, 0.0, 1.0)
            ests = {k: S.paired_difference(ref[:n], var[:n], codes)
                    for k, (n, codes) in enumerate(zip(self.looks, self.codes))}
            k, record = L.settle(ests, self.looks, self.n_max, MARGIN, ALPHA, self.alpha_fail, SPENDING)
            status.append({"pass": 1, "fail": -1}.get(record[-1]["status"], 0))
            spent.append(self.looks[k])
        return np.array(status, dtype=np.int8), np.array(spent)


def draw(rng, sims: int, sched: Schedule, cl, worse, better, icc: float) -> np.ndarray:
    """Per simulation and item (in scoring order): -1 worse, +1 better, 0 same. Each cluster draws
    one shared outcome from its rates; each of its items takes it with probability `icc`, else
    draws its own (icc 1: the cluster moves as one; 0: independent items), as
    tests/test_gate_sims.py: clustered_counts."""
    idx = sched.items
    u = rng.random((sims, idx.size), dtype=np.float32)
    if icc > 0:
        shared = rng.random((sims, int(cl.max()) + 1), dtype=np.float32)[:, cl[idx]]
        u = shared if icc >= 1 else np.where(rng.random((sims, idx.size), dtype=np.float32) < icc, shared, u)
    w, b = worse[idx].astype(np.float32), better[idx].astype(np.float32)
    return np.where(u < w, -1, np.where(u < w + b, 1, 0)).astype(np.int8)


_SCHEDULES: dict = {}


def schedules(parts, n_max: int, wave: int | None, alpha_fail: float = ALPHA) -> list[Schedule]:
    """The runs' schedules of a design: ORDERS seeded cluster orders when cluster sizes differ
    (which item of a cluster, which clusters fit the budget, where the looks fall), one look or
    many; else one (clusters of one size with one mix are exchangeable: any order is the same run)."""
    structure = tuple((c, m) for c, m, _, _ in parts)
    key = (structure, n_max, wave, alpha_fail, SPENDING)
    if key not in _SCHEDULES:
        blob = pool(parts)[0]
        unequal = len({m for _, m in structure}) > 1
        seeds = range(ORDERS if unequal else 1)
        _SCHEDULES[key] = [Schedule(blob, n_max, wave, s, alpha_fail) for s in seeds]
    return _SCHEDULES[key]


def simulate(rng, parts, n_max: int, wave: int | None, icc: float, sims: int, replay: int = 0,
             alpha_fail: float = ALPHA) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(status, spent, order index) of `sims` runs, split evenly over the design's schedules;
    `replay` of them (spread over the orders) are also decided through paired_difference ->
    looks.settle and must agree."""
    _, cl, worse, better = pool(parts)
    scheds = schedules(parts, n_max, wave, alpha_fail)
    chunks = np.diff(np.linspace(0, sims, len(scheds) + 1).astype(int))
    per_order = -(-replay // len(scheds))
    status, spent, order = [], [], []
    for o, (sched, m) in enumerate(zip(scheds, chunks)):
        d = draw(rng, int(m), sched, cl, worse, better, icc)
        st, sp = sched.run(d)
        if replay:
            r = min(per_order, int(m))
            gst, gsp = sched.replay(d[:r])
            if not (np.array_equal(gst, st[:r]) and np.array_equal(gsp, sp[:r])):
                bad = int(np.flatnonzero((gst != st[:r]) | (gsp != sp[:r]))[0])
                raise SystemExit(f"vectorised gate and looks.settle disagree: {parts}, looks {sched.looks}, "
                                 f"simulation {bad}: {st[bad]}/{sp[bad]} vs {gst[bad]}/{gsp[bad]}")
            REPLAYED[0] += r
        status.append(st)
        spent.append(sp)
        order.append(np.full(int(m), o))
    return np.concatenate(status), np.concatenate(spent), np.concatenate(order)


def mc_se(hits: np.ndarray, order: np.ndarray) -> float:
    """MC SE of a rate: binomial for one order; over several orders (equal simulations each) the
    SE of the mean of the orders' rates, which includes how much the order moves the rate."""
    if order.max() == 0:
        r = float(hits.mean())
        return float(np.sqrt(r * (1 - r) / hits.size))
    rates = np.bincount(order, weights=hits) / np.bincount(order)
    return float(rates.std(ddof=1) / np.sqrt(rates.size))


def mix(worse: float, better: float) -> str:
    return f"{100 * worse:.3g}/{100 * better:.3g}"


def big_and_singletons(big: tuple, singletons: int, weighting: str, better: float = 0.01) -> tuple[str, tuple]:
    """(label, parts) of a pool of `big` = (clusters, size, worse, better) plus `singletons`
    one-item clusters whose worse rate is solved so that the pool's `weighting` difference
    ("cluster": every cluster counts once; "item": every item) is exactly -margin."""
    c, m, w, b = big
    weight = c if weighting == "cluster" else c * m
    worse = better + (MARGIN * (weight + singletons) + weight * (b - w)) / singletons
    return (f"{c} x {m} + {singletons} singletons, {mix(w, b)} vs {mix(worse, better)}",
            ((c, m, w, b), (singletons, 1, worse, better)))


def rate_rows() -> tuple[list, list, list]:
    """(design, n, ICC label, parts, icc) rows. Independent items and equal clusters: the pool's
    difference exactly -margin. Unequal clusters (tests/test_gate_sims.py: CONCENTRATED and
    relatives), where the stage scores one item per cluster: the CLUSTER-weighted difference
    exactly -margin (the gate's estimand there), the big clusters' mix as in CONCENTRATED and the
    singletons' solved for; then the same big clusters with the ITEM-weighted difference at
    -margin (a regression the gate, weighing clusters, sees as milder)."""
    rows = []
    for n in (240, 1000):
        for w, b in MIXES:
            rows.append((f"independent items, {mix(w, b)}", n, "-", ((n, 1, w, b),), 0.0))
    for w, b, icc in ((0.05, 0.0, 1.0), (0.06, 0.01, 1.0), (0.06, 0.01, 0.7), (0.20, 0.15, 1.0)):
        rows.append((f"100 x 10 equal, {mix(w, b)}", 1000, f"{icc:g}", ((100, 10, w, b),), icc))
    for w, b in ((0.06, 0.01), (0.20, 0.15)):
        rows.append((f"80 x 3 equal (long_context), {mix(w, b)}", 240, "1", ((80, 3, w, b),), 1.0))
    concentrated = [((5, 20, 0.33, 0.01), 900, (0.7, 1.0)), ((4, 10, 0.33, 0.01), 360, (0.7, 1.0)),
                    ((10, 20, 0.18, 0.01), 800, (0.7, 1.0)), ((5, 20, 0.15, 0.01), 900, (0.7, 1.0)),
                    ((20, 10, 0.15, 0.01), 800, (1.0,)), ((50, 5, 0.15, 0.01), 750, (1.0,)),
                    ((1, 50, 0.61, 0.01), 950, (1.0,))]

    def design(weighting, cases):
        out = []
        for big, singletons, iccs in cases:
            label, parts = big_and_singletons(big, singletons, weighting)
            n = sum(c * m for c, m, _, _ in parts)
            out += [(label, n, f"{icc:g}", parts, icc) for icc in iccs]
        return out

    even = ((5, 20, 0.06, 0.01), (900, 1, 0.06, 0.01))
    unequal = design("cluster", concentrated) + [("5 x 20 + 900 singletons, 6/1 everywhere", 1000, "1", even, 1.0)]
    item_weighted = design("item", [(big, s, (1.0,)) for big, s, _ in concentrated])
    for label, n, _, parts, _ in rows + item_weighted:
        assert abs(item_weighted_diff(parts) + MARGIN) < 1e-9, (label, item_weighted_diff(parts))
    for label, n, _, parts, _ in unequal:
        assert abs(cluster_weighted(parts) + MARGIN) < 1e-9, (label, cluster_weighted(parts))
    return rows, unequal, item_weighted


def item_weighted_diff(parts) -> float:
    """The pool's difference with every item weighted alike."""
    return sum(c * m * (b - w) for c, m, w, b in parts) / sum(c * m for c, m, _, _ in parts)


def cluster_weighted(parts) -> float:
    """The difference with every cluster weighted alike: what a slice of one item per cluster
    (order_items on unequal clusters) estimates."""
    return sum(c * (b - w) for c, _, w, b in parts) / sum(c for c, _, _, _ in parts)


def grid_check() -> tuple[float, int]:
    """(largest relative change of the nominal levels from drawing them on GRID points instead of
    sequential's own grid, over the default config's looks and 4 and 6 looks at 1000; sequential's
    own grid size). From here on the levels are drawn on GRID points."""
    from pipeline.stats import sequential as Q

    cases = ([40, 80, 120, 160, 200, 240], [167, 334, 501, 668, 835, 1000], [250, 500, 750, 1000])
    full = [np.array(Q.nominal_levels(c, c[-1], ALPHA)) for c in cases]
    own, Q._GRID = Q._GRID, GRID
    coarse = [np.array(Q.nominal_levels(c, c[-1], ALPHA)) for c in cases]
    return float(max(np.max(np.abs(a / b - 1)) for a, b in zip(coarse, full))), own


def spent_table(rng, sims: int, n_max: int, wave: int) -> list[str]:
    from pipeline.gate import looks as L

    out = [f"looks at {', '.join(map(str, L.plan(n_max, wave)))}; {sims} simulations a row, "
           f"both sides at {ALPHA}:", "",
           "| slice | variant | worse/better | P(pass) | P(fail) | mean items | 90th percentile |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    variants = (("clear fail", 0.10, 0.0), ("clear pass", 0.02, 0.02), ("identical", 0.0, 0.0),
                ("on the margin", 0.06, 0.01))
    for design, size, icc in (("independent items", 1, 0.0), ("haystacks of 3, ICC 0.7", 3, 0.7)):
        for name, w, b in variants:
            parts = ((n_max // size, size, w, b),)
            replay = REPLAY if name == "clear pass" else 0
            status, spent, _ = simulate(rng, parts, n_max, wave, icc, sims, replay)
            out.append(f"| {design} | {name} | {mix(w, b)} | {np.mean(status == 1):.3f} | "
                       f"{np.mean(status == -1):.3f} | {spent.mean():.0f} | {np.percentile(spent, 90):.0f} |")
    return out


def spent_tables(rng, sims: int) -> str:
    """spent_table on the default config's and configs/gpu.yaml's looks."""
    import yaml

    from pipeline.core.quality_config import QualityConfig

    q, out = QualityConfig(), []
    gpu = (yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text()) or {}).get("quality", {})
    for name, n_max, wave in (("the default config", q.max_items, q.wave_items),
                              ("configs/gpu.yaml", gpu.get("max_items"), gpu.get("wave_items"))):
        if n_max and wave:
            out += [f"Items spent by one cell on {name} (quality.max_items {n_max}, quality.wave_items "
                    f"{wave}): " + "\n".join(spent_table(rng, sims, n_max, wave)), ""]
    return "\n".join(out)


def sequential_tables(sims: int = SEQ_SIMS) -> str:
    import time

    t0 = time.time()
    moved, own_grid = grid_check()
    rng = np.random.default_rng(26)
    se0 = float(np.sqrt(ALPHA * (1 - ALPHA) / sims))
    out = [f"False pass / false fail of one 0/1 cell whose true difference is exactly -margin "
           f"({MARGIN}), each side at one-sided {ALPHA} (the gate draws the fail side at {ALPHA} / m "
           f"over a variant's m rows, which only lowers it); {sims} simulations a cell, MC SE "
           f"{se0:.4f} at {ALPHA}. K looks: waves of ceil(n / K) items, each look at a cluster's end "
           f"(looks.plan). Unequal clusters: {ORDERS} seeded cluster orders (waves.order_items), "
           f"their MC SE from the spread between orders. * marks a rate above {ALPHA} + 2 MC SE. "
           f"Mixes: worse/better in percent; 'A vs B': the big clusters' mix, then the singletons'.", "",
           "| design | n | ICC | " + " | ".join(f"{k} look{'s' if k > 1 else ''}" for k in LOOK_COUNTS)
           + " | MC SE (largest) |", "| --- | --- | --- |" + " --- |" * (len(LOOK_COUNTS) + 1)]
    flagged = []
    main_rows, unequal, item_weighted = rate_rows()
    # Replayed through paired_difference -> looks.settle: (label, n, looks), at ICC "-" or 1.
    checked = {("independent items, 6/1", 240, 6), ("100 x 10 equal, 6/1", 1000, 6),
               (unequal[0][0], 1000, 1), (unequal[0][0], 1000, 4),
               (next(r[0] for r in unequal if r[0].startswith("1 x 50")), 1000, 6),
               (item_weighted[0][0], 1000, 1), (item_weighted[0][0], 1000, 4)}
    largest: list = []  # (rate, MC SE, where) of every error rate of the group being drawn

    def row(label, n, icc_label, parts, icc, errors: bool = True) -> tuple[list[str], float, list[int]]:
        """Per look count 'P(pass) / P(fail)'; `errors`: both are error rates (truth on the
        margin of the gate's estimand), star and record those above nominal + 2 MC SE."""
        cells, ses, scored = [], [se0], []
        for k in LOOK_COUNTS:
            replay = REPLAY if (label, n, k) in checked and icc_label in ("-", "1") else 0
            status, _, order = simulate(rng, parts, n, None if k == 1 else -(-n // k), icc, sims, replay)
            scored.append(schedules(parts, n, None if k == 1 else -(-n // k))[0].n_max)
            marks = []
            for side, hits in (("false pass", status == 1), ("false fail", status == -1)):
                r, se = float(hits.mean()), max(mc_se(hits, order), se0)
                ses.append(se)
                over = errors and r > ALPHA + 2 * se
                if errors:
                    largest.append((r, se, f"{label}, ICC {icc_label}, {k} look{'s' if k > 1 else ''}, {side}"))
                marks.append(f"{r:.3f}{'*' if over else ''}")
                if over:
                    flagged.append(f"{label}, n {n}, ICC {icc_label}, {k} looks: {side} {r:.4f} "
                                   f"(MC SE {se:.4f}, {(r - ALPHA) / se:+.1f} SE)")
            cells.append(" / ".join(marks))
        return cells, max(ses), scored

    def top() -> str:
        r, se, where = max(largest)
        largest.clear()
        return f"largest {r:.4f} ({where}; MC SE {se:.4f}, {(r - ALPHA) / se:+.1f} SE from {ALPHA})"

    for label, n, icc_label, parts, icc in main_rows:
        cells, se, _ = row(label, n, icc_label, parts, icc)
        out.append(f"| {label} | {n} | {icc_label} | " + " | ".join(cells) + f" | {se:.4f} |")
    out += ["", "Above nominal + 2 MC SE: " + ("; ".join(flagged) if flagged else "none") + f"; {top()}.", ""]
    flagged.clear()
    looks_head = " | ".join(f"{k} look{'s' if k > 1 else ''}" for k in LOOK_COUNTS)
    out += ["Unequal clusters: waves.order_items takes one item per cluster, with one look and with "
            "waves (items scored: with 1 look / with waves), so the cell estimates the difference with "
            "every cluster weighted alike, and that CLUSTER-weighted difference is set at exactly "
            "-margin ('33/1 vs 5.85/1': the big clusters' mix, then the singletons'). The column "
            "'item-weighted' is the same truth's difference over the pool's items:", "",
            f"| design | n | ICC | item-weighted | items scored | {looks_head} | MC SE (largest) |",
            "| --- | --- | --- | --- | --- |" + " --- |" * (len(LOOK_COUNTS) + 1)]
    for label, n, icc_label, parts, icc in unequal:
        cells, se, scored = row(label, n, icc_label, parts, icc)
        out.append(f"| {label} | {n} | {icc_label} | {item_weighted_diff(parts):+.4f} | {scored[0]} / "
                   f"{'-'.join(map(str, sorted(set(scored[1:]))))} | " + " | ".join(cells) + f" | {se:.4f} |")
    out += ["", f"Above {ALPHA} + 2 MC SE against the cluster-weighted margin: {len(flagged)} of "
            f"{2 * len(LOOK_COUNTS) * len(unequal)} rates (marked *)"
            + (": " + "; ".join(flagged) if flagged else "") + f"; {top()}.", ""]
    flagged.clear()
    out += ["Item-weighted regression, damage in big clusters: the gate weighs clusters, so this "
            "passes. The pool's ITEM-weighted difference is exactly -margin, the damage sits in the "
            "big clusters, and the cluster-weighted difference the cell estimates is milder "
            "('cluster-weighted'); P(pass) / P(fail), not error rates of the gate's estimand:", "",
            f"| design | n | ICC | cluster-weighted | items scored | {looks_head} | MC SE (largest) |",
            "| --- | --- | --- | --- | --- |" + " --- |" * (len(LOOK_COUNTS) + 1)]
    for label, n, icc_label, parts, icc in item_weighted:
        cells, se, scored = row(label, n, icc_label, parts, icc, errors=False)
        out.append(f"| {label} | {n} | {icc_label} | {cluster_weighted(parts):+.4f} | {scored[0]} / "
                   f"{'-'.join(map(str, sorted(set(scored[1:]))))} | " + " | ".join(cells) + f" | {se:.4f} |")
    out.append("")

    out += [spent_tables(rng, sims)]
    out += [f"{REPLAYED[0]} simulations replayed through paired_difference -> looks.settle: the same "
            f"status and items spent as the vectorised gate. Nominal levels drawn on a {GRID}-point "
            f"grid (sequential.py: {own_grid}): at most {moved:.1e} relative to the full grid's.",
            f"`.venv/bin/python tests/sim_gate_rates.py --sequential --sims {sims}"
            f"{'' if SPENDING == 'obf' else ' --spending ' + SPENDING}`: {time.time() - t0:.0f} s."]
    return "\n".join(out)


def run_side(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--measure"], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="main", help="git ref of the 'before' tree")
    p.add_argument("--sequential", action="store_true",
                   help="this tree only: the sequential gate's false pass / false fail by design and "
                        "number of looks, and the items it spends (issue 26; markdown tables)")
    p.add_argument("--sims", type=int, default=SEQ_SIMS, help="--sequential: simulations per cell")
    p.add_argument("--spending", default="obf", choices=["obf", "pocock"],
                   help="--sequential: the gate.spending function the looks' levels are drawn with")
    p.add_argument("--spent-only", action="store_true",
                   help="--sequential: only the items-spent tables (default config and gpu.yaml)")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sequential:
        global SPENDING
        SPENDING = args.spending
        print(f"gate.spending: {SPENDING}")
        print(spent_tables(np.random.default_rng(26), args.sims) if args.spent_only else sequential_tables(args.sims))
        return 0
    if args.measure:
        print(json.dumps(measure()))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "before.tar"
        subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), args.before, "pipeline", "evals"],
                       check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(Path(tmp) / "tree", filter="data")
        before = run_side(Path(tmp) / "tree")
    after = run_side(REPO)
    print(f"| finding | measure | before ({args.before}) | after |\n|---|---|---|---|")
    for section in after:
        for key in dict.fromkeys([*before.get(section, {}), *after[section]]):
            fmt = lambda v: "-" if v is None else (f"{v[0]} (MC SE {v[1]})" if isinstance(v, list) and
                                                     len(v) == 2 and isinstance(v[0], float) else str(v))
            print(f"| {section} | {key} | {fmt(before.get(section, {}).get(key))} | {fmt(after[section].get(key))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

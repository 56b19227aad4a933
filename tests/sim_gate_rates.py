"""Issue 13's error rates, before (main's gate) and after (this tree's), simulated through each
tree's own functions. Not a test (pytest collects test_*.py only); run it for the closing note:

    .venv/bin/python tests/sim_gate_rates.py [--before main]     # a few minutes on 2 cores

The `before` tree is `git archive <ref> pipeline evals` unpacked in a temporary directory; each side
runs in its own subprocess with that tree first on sys.path, prints JSON, and this script prints a
markdown table. Monte-Carlo standard errors are printed beside each rate.
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MARGIN, ALPHA = 0.05, 0.025
MIXES = [(0.05, 0.0), (0.06, 0.01), (0.10, 0.05), (0.20, 0.15)]


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
        from pipeline.stats import paired as S

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
                hi += S.step_levels(q, lambda i, a: cells[i].upper(a) < -MARGIN, ALPHA, "holm")
        else:
            p = [e.p_value(MARGIN) for e in ests]
            q = [e.p_value_inferior(MARGIN) for e in ests]
            lo = S.step_levels(p, lambda i, a: ests[i].ci(a, MARGIN)[0] > -MARGIN, ALPHA, "holm")
            hi = S.step_levels(q, lambda i, a: ests[i].ci(a)[1] < -MARGIN, ALPHA, "holm")
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
    sys.path.insert(0, str(REPO / "tests"))
    from test_gate_sims import brier_population

    population = brier_population(rng)
    margin = -float(population.mean())
    for n, sims in ((40, 10000), (200, 10000), (1000, 4000)):
        d = population[rng.integers(population.size, size=(sims, n))]
        mean, se, df = S.mean_se(d)
        out[f"Brier cell false pass, n={n}"] = rate(S.t_bound(mean, se, df, ALPHA, -1) > -margin, sims)
    return out


def f4_paired_ci(side: Side, rng) -> dict:
    out = {}
    for n in (40, 200, 1000):
        for worse, better in MIXES:
            sims = 3000 if not side.new else 20000
            counts = rng.multinomial(n, [better, worse, 1 - better - worse], size=sims)
            if side.new:
                from pipeline.stats import tango

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
    from pipeline.quality import evaluate as quality

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


def run_side(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--measure"], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="main", help="git ref of the 'before' tree")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
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

"""Issue 27: a latency cell's repeats stop once the figures the recommendation depends on are
settled (pipeline/latency/speculative.py SETTLE_RULE), at latency.repeats, or when the stage's time
budget cannot afford another.

- the rule on synthetic samples (no model): a low-noise cell stops at min_repeats ("settled"), a
  noisy one runs to the maximum ("max"); rare drafted counts are not asked to settle;
- a simulation of round times by drafted count: the k recommended from the early-stopped repeats
  against the one from every repeat (figures in test_early_stop_keeps_the_recommendation);
- the tiny random Llama: speculative_pair and plain_grid stop at min_repeats with a
  huge tolerance, do exactly `repeats` with settle off, and stop after one repeat (recording the
  skip) on a budget that is already spent.

    .venv/bin/python -m pytest -x -q tests/test_latency_repeats.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.budget import StageBudget
from pipeline.core.config import Config
from pipeline.latency.speculative import MIN_TIMING_REPEATS, Repeats, carrying, settle_widths

CPU = torch.device("cpu")


def _lat(**kw):
    base = {"batch_sizes": [1], "context_lengths": [8], "new_tokens": 3, "warmup": 0, "repeats": 4,
            "min_repeats": 2}
    return Config.model_validate({"latency": {**base, **kw}}).latency


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _spent_budget() -> StageBudget:
    """A latency budget (0.3 x 1 minute) whose clock has already run past it."""
    clock = Clock()
    budget = StageBudget(Config.model_validate({"budget": {"minutes": 1}}), "latency", clock=clock)
    clock.t += 1000.0
    assert budget.active and budget.left() < 0
    return budget


# ---------------------------------------------------------------- the rule, synthetic


def _run_rule(lat, noise: float, seed: int = 0, d_max: int = 3) -> Repeats:
    """Repeats of a synthetic model-draft pair: T(d) = 10 + 3 d ms and plain 9 ms, each repeat's
    samples off by a lognormal factor of sd `noise`; 50 rounds per k, all drafting k."""
    rng = np.random.default_rng(seed)
    truth = {d: 10.0 + 3.0 * d for d in range(d_max + 1)}
    counts = {k: {k: 50} for k in range(1, d_max + 1)}
    plain, by_d = [], {d: [] for d in truth}
    loop = Repeats(lat, "synthetic", verbose=False)
    while loop.next():
        plain.append(9.0 * np.exp(noise * rng.standard_normal()))
        for d, t in truth.items():
            by_d[d].append(t * np.exp(noise * rng.standard_normal()) if d else None)  # d = 0: no rounds
        loop.finished(lambda: settle_widths(plain, by_d, counts, 0.95, 0))
    return loop


def test_a_quiet_cell_settles_at_min_repeats_and_a_noisy_one_runs_to_max():
    lat = _lat(repeats=8, min_repeats=3, settle_rel=0.05)
    quiet = _run_rule(lat, noise=0.002).to_json()
    assert quiet["repeats_done"] == 3 and quiet["stopped"] == "settled" and quiet["repeats"] == 8
    # Checked: plain and every drafted count with rounds (d = 0 drafted none), all within 5%.
    assert set(quiet["settle_widths"]) == {"plain", "d=1", "d=2", "d=3"}
    assert max(quiet["settle_widths"].values()) <= 0.05
    noisy = _run_rule(lat, noise=0.3).to_json()
    assert noisy["repeats_done"] == 8 and noisy["stopped"] == "max"
    assert max(noisy["settle_widths"].values()) > 0.05
    # Settle off: the maximum, whatever the noise (today's behaviour).
    off = _run_rule(_lat(repeats=8, min_repeats=3, settle=False), noise=0.002).to_json()
    assert off["repeats_done"] == 8 and off["stopped"] == "max" and off["settle_widths"] is None
    # min_repeats above repeats: every repeat, never "settled".
    few = _run_rule(_lat(repeats=2, min_repeats=3), noise=0.002).to_json()
    assert few["repeats_done"] == 2 and few["stopped"] == "max"


def test_one_sample_never_settles_and_rare_counts_are_left_out():
    lat = _lat(repeats=4, min_repeats=1, settle_rel=0.05)
    loop = Repeats(lat, "one", verbose=False)
    xs = []
    while loop.next():
        xs.append(1.0)
        loop.finished(lambda: settle_widths(xs, {}, {}, 0.95, 0))
    assert loop.done == 2 and loop.stopped == "settled"  # a width needs two samples
    # At k = 3, d = 0 and d = 1 hold 3 of 100 rounds (<= 5%): left out; d = 1 is kept through k = 1.
    assert carrying({1: {1: 40}, 3: {0: 2, 1: 1, 2: 7, 3: 90}}) == [1, 2, 3]
    assert carrying({3: {0: 2, 1: 1, 2: 7, 3: 90}}) == [2, 3]
    assert carrying({3: {0: 0, 3: 10}}) == [3]


def test_min_repeats_is_checked():
    from pipeline.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="min_repeats must be >= 1"):
        load_config("configs/smoke.yaml", {"latency": {"min_repeats": 0}})


def test_a_spent_budget_stops_after_one_repeat_and_says_so():
    budget = _spent_budget()
    loop = Repeats(_lat(repeats=5), "pair", budget, verbose=False)
    n = 0
    while loop.next():
        n += 1
        loop.finished()
    assert n == 1 and loop.to_json()["stopped"] == "budget"
    assert budget.skipped[0]["what"] == "pair: repeats 2-5" and budget.skipped[0]["why"].startswith("budget: 0 s left")
    # A timed pair's floor (MIN_TIMING_REPEATS, what a k is recommended from): the budget stops it
    # only after that many, and never above latency.repeats.
    budget = _spent_budget()
    loop = Repeats(_lat(repeats=5), "pair", budget, verbose=False, floor=MIN_TIMING_REPEATS)
    while loop.next():
        loop.finished()
    assert loop.done == MIN_TIMING_REPEATS == 2 and loop.to_json()["stopped"] == "budget"
    assert loop.to_json()["budget_floor"] == 2 and budget.skipped[0]["what"] == "pair: repeats 3-5"
    loop = Repeats(_lat(repeats=1), "pair", _spent_budget(), verbose=False, floor=MIN_TIMING_REPEATS)
    while loop.next():
        loop.finished()
    assert loop.done == 1 and loop.stopped == "max" and loop.to_json()["budget_floor"] == 1
    # No budget (None) or an inactive one: every repeat.
    for b in (None, StageBudget(Config.model_validate({}), "latency")):
        loop = Repeats(_lat(repeats=3, settle=False), "pair", b, verbose=False)
        while loop.next():
            loop.finished()
        assert loop.done == 3 and loop.stopped == "max"


# ---------------------------------------------------------------- the simulation


def _recommend(t_round: np.ndarray, share: np.ndarray, e: np.ndarray) -> int:
    """argmin_k median over repeats of sum_d P(d|k) T_r(d), over E(k) (the marginal stage's point)."""
    return int(np.argmin(np.median(t_round @ share.T, axis=0) / e)) + 1


def _cell(rng, k_max: int, tol: float):
    """A pair whose true best k beats the runner-up by >= 2 tol: (T(d), P(d|k) [K, D], E(k))."""
    while True:
        d = np.arange(k_max + 1)
        t = 10.0 * (1.0 + rng.uniform(0.05, 0.6) * d)  # one target step + d draft steps, wider verify
        alpha = rng.uniform(0.4, 0.9)
        e_d = (1 - alpha ** (d + 1)) / (1 - alpha)  # tokens per round when d are drafted
        share = np.zeros((k_max, k_max + 1))
        for k in range(1, k_max + 1):
            if rng.random() < 0.5:  # a model draft drafts k
                share[k - 1, k] = 1.0
            else:  # prompt lookup: often nothing, else 1..k
                p0 = rng.uniform(0.2, 0.6)
                share[k - 1, 0] = p0
                share[k - 1, 1:k + 1] = (1 - p0) / k
        e = share @ e_d
        ms = share @ t / e
        best, runner = np.sort(ms)[:2]
        if runner / best - 1 >= 2 * tol:
            return t, share, e


def test_early_stop_keeps_the_recommendation():
    """400 cells (k_max = 4; per k a model draft, drafting k, or prompt lookup, drafting 0 with
    probability 0.2-0.6 else 1..k; T(d) = 10 (1 + c d) ms, c in [0.05, 0.6]; E from a per-token
    acceptance in [0.4, 0.9]) whose true best k beats the runner-up by >= 2 settle_rel = 10%;
    repeats min 3, max 10, 95% CIs. A cell's noise sd (log scale) is drawn log-uniform in
    [0.003, 0.1]: each repeat a drift shared by all its round times and plain, plus independent
    noise per drafted count. Measured (seed 0): the early-stopped recommendation equals the
    all-repeats one in 400/400 cells; 275 cells stopped early (248 at 3 repeats), 275/275 of them
    agreeing; 54% of the maximum's repeats were done; both recommendations are the true best k in
    400/400. For contrast, 400 near-tie cells (margin < 10%, not asserted): 386/400 agree, 257/271
    of the early-stopped. Asserted: >= 95% agreement over all cells and over the early-stopped
    ones (>= 100 of them)."""
    tol, k_max, lo, hi = 0.05, 4, 3, 10
    lat = _lat(repeats=hi, min_repeats=lo, settle_rel=tol)
    rng = np.random.default_rng(0)
    agree = early = early_agree = done = 0
    for _ in range(400):
        t, share, e = _cell(rng, k_max, tol)
        sigma = float(np.exp(rng.uniform(np.log(0.003), np.log(0.1))))
        drift = sigma * rng.standard_normal(hi)
        rounds = t * np.exp(drift[:, None] + sigma * rng.standard_normal((hi, k_max + 1)))  # [R, D]
        plain = 9.0 * np.exp(drift + sigma * rng.standard_normal(hi))
        counts = {k: {d: int(round(100 * share[k - 1, d])) for d in range(k_max + 1)} for k in range(1, k_max + 1)}
        loop = Repeats(lat, "sim", verbose=False)
        while loop.next():
            n = loop.done + 1
            loop.finished(lambda: settle_widths(plain[:n], {d: list(rounds[:n, d]) for d in range(k_max + 1)},
                                                counts, 0.95, 0))
        n = loop.done
        done += n
        same = _recommend(rounds[:n], share, e) == _recommend(rounds, share, e)
        agree += same
        if loop.stopped == "settled":
            early += 1
            early_agree += same
    print(f"\nagree {agree}/400, early {early}, early agree {early_agree}/{early}, "
          f"repeats done {done / (400 * hi):.0%} of the maximum")
    assert agree >= 0.95 * 400
    assert early >= 100 and early_agree >= 0.95 * early
    assert done < 400 * hi


# ---------------------------------------------------------------- the tiny model


def _pair(tiny_model, tiny_tokenizer, lat, budget=None):
    from pipeline.decode.drafts import ModelDraft
    from pipeline.latency.speculative import speculative_pair

    acc = Config.model_validate({"acceptance": {"temperatures": [0.0]}}).acceptance
    prompts = {"chat": [("chat-0", tiny_tokenizer.encode("the cat"))]}
    draft = ModelDraft("self:tiny", tiny_model, len(tiny_tokenizer))
    return speculative_pair("tiny", "self:tiny", tiny_model, draft, prompts, lat, acc, CPU, 0.95, 0, [1, 2],
                            budget=budget)


def test_speculative_pair_settles_at_min_repeats_or_does_every_repeat(tiny_model, tiny_tokenizer):
    out = _pair(tiny_model, tiny_tokenizer, _lat(new_tokens=7, settle_rel=1e9))
    assert out["repeats"] == 4 and out["repeats_done"] == 2 and out["stopped"] == "settled"
    assert out["min_repeats"] == 2 and out["settle"] is True and "min_repeats" in out["settle_rule"]
    # Plain and the drafted counts 1 and 2 (k = 1 and k = 2 of a self draft) were checked.
    assert set(out["settle_widths"]) == {"T=0.0 plain", "T=0.0 d=1", "T=0.0 d=2"}
    assert len(out["plain_ms_per_token"]["samples"]) == 2
    assert len(out["by_temperature"]["0.0"]["round_ms_by_drafted"]["1"]["samples"]) == 2
    off = _pair(tiny_model, tiny_tokenizer, _lat(new_tokens=7, settle=False))
    assert off["repeats"] == off["repeats_done"] == 4 and off["stopped"] == "max" and off["settle_widths"] is None
    assert len(off["plain_ms_per_token"]["samples"]) == 4
    assert all(len(r["ms_per_token"]["samples"]) == 4 for r in off["rows"])


def test_speculative_pair_on_a_spent_budget_does_the_repeats_a_k_needs(tiny_model, tiny_tokenizer):
    """A spent budget still leaves a timed pair MIN_TIMING_REPEATS repeats: the marginal report
    recommends no k from fewer, so one repeat would be time spent on nothing it may use."""
    budget = _spent_budget()
    out = _pair(tiny_model, tiny_tokenizer, _lat(new_tokens=7, settle=False), budget=budget)
    assert out["repeats_done"] == MIN_TIMING_REPEATS == 2 and out["stopped"] == "budget"
    assert len(out["plain_ms_per_token"]["samples"]) == 2
    assert budget.skipped == [{"what": "tiny + self:tiny: repeats 3-4", "why": budget.skipped[0]["why"],
                               "at_s": budget.skipped[0]["at_s"]}]


def test_plain_grid_cells_settle_or_stop_on_the_budget(tiny_model):
    from pipeline.latency.grid import plain_grid

    out = plain_grid("tiny", tiny_model, _lat(batch_sizes=[1, 2], settle_rel=1e9), CPU, {"gbps": 10.0}, seed=0,
                     confidence=0.95)
    assert out["repeats"] == 4 and out["settle"] is True and "TPOT" in out["settle_rule"]
    for c in out["grid"]:
        assert c["repeats_done"] == 2 and c["stopped"] == "settled" and len(c["tpot_ms"]["samples"]) == 2
        assert set(c["settle_widths"]) == {"tpot"}
    off = plain_grid("tiny", tiny_model, _lat(settle=False), CPU, {"gbps": 10.0}, seed=0, confidence=0.95)
    assert [(c["repeats_done"], c["stopped"], len(c["tpot_ms"]["samples"])) for c in off["grid"]] == [(4, "max", 4)]
    budget = _spent_budget()
    spent = plain_grid("tiny", tiny_model, _lat(batch_sizes=[1, 2]), CPU, {"gbps": 10.0}, seed=0, confidence=0.95,
                       budget=budget)
    assert [(c["repeats_done"], c["stopped"]) for c in spent["grid"]] == [(1, "budget"), (1, "budget")]
    assert [s["what"] for s in budget.skipped] == ["tiny B=1 context=8: repeats 2-4", "tiny B=2 context=8: repeats 2-4"]

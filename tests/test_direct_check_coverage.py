"""The sampled direct check's coverage (issue 28 point 5), fast: per-prompt figures from the toy
engine of tests/sim_direct_check.py (a context-dependent target that copies, the real prompt-lookup
draft and the project's round chain), a population of prompts that copy heavily, a little or not
at all, and `direct_check` run on a few hundred simulated checks where the engine is right.

For a prompt-lookup draft, rounds given the text are a function of the text (acceptance is 0/1
given it), so a text's chain rounds and a direct run's rounds are draws of one distribution: the
bank pools them per prompt and the true difference direct - derived is exactly 0 in the
simulated world. test_chain_equals_engine_run_by_run checks that premise on the toy engine.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_direct_check as sim  # noqa: E402
from pipeline.speculation.acceptance_stats import MIN_CHECK_PROMPTS, direct_check, summarize_slice  # noqa: E402

K, N_NEW, REPS = 3, 48, 400
# Monte-Carlo se of a 95% coverage over REPS checks: 0.011; allow 3 se.
TOL = 3 * np.sqrt(0.95 * 0.05 / REPS)


@pytest.fixture(scope="module")
def copying_bank():
    """A copying category (the output copies the prompt's passage from the start, by a varying
    amount: the hard case, few ties), texts and direct runs pooled."""
    target = sim.ToyTarget(seed=0)
    prompts = sim.make_prompts(target, 8, 1, sim.POPULATIONS["copying"])
    return sim.pooled(sim.bank(target, sim.NgramDraft("ngram", max_n=3), prompts, 20, N_NEW, (K,), 2), (K,))


def test_chain_equals_engine_run_by_run():
    """The premise: the chain on a direct run's own output text gives that run's round count."""
    target, draft = sim.ToyTarget(seed=3), sim.NgramDraft("ngram", max_n=3)
    rng = np.random.default_rng(0)
    for prompt in sim.make_prompts(target, 6, 4):
        for k in (2, 5):
            tokens, rounds, out = sim.speculative(target, draft, prompt, N_NEW, k, rng, with_text=True)
            assert tokens == len(out) - 1
            assert sim.chain_rounds(draft, prompt, out, 5, N_NEW, (k,))[k] == pytest.approx(rounds, abs=1e-12)


@pytest.mark.parametrize("n", [3, 8])
def test_sampled_check_covers_at_its_nominal_level(copying_bank, n):
    row = sim.coverage_table(copying_bank, [n], REPS, K, 0.95, seed=10 + n)[0]
    print(row)
    assert row["abstain"] == 0.0
    assert abs(row["cover_t"] - 0.95) <= TOL, row
    # The percentile prompt bootstrap the check used before undercovers badly at these counts.
    assert row["cover_bootstrap"] < 0.95 - TOL, row


def test_too_few_prompts_is_no_verdict_and_a_real_gap_is_found():
    rng = np.random.default_rng(0)
    recs = [{"tokens": 47.0, "expected_rounds": {"3": float(r)}} for r in rng.integers(20, 40, size=6)]
    one = direct_check(recs[:1], {3: [{"tokens": 47, "rounds": 10}]}, greedy=False)["3"]
    assert MIN_CHECK_PROMPTS == 2 and one["agree"] is None and one["difference_ci"] is None
    assert "too few prompts" in one["test"]
    # Direct runs taking 30% fewer rounds on every prompt: a real difference, which the check finds.
    runs = {3: [{"tokens": 47, "rounds": 0.7 * r["expected_rounds"]["3"]} for r in recs]}
    out = direct_check(recs, runs, greedy=False)["3"]
    assert out["agree"] is False and out["difference_ci"][0] > 0


def test_slices_say_when_they_have_few_prompts():
    def rec(i, rounds):
        return {"tokens": 20, "expected_rounds": {"1": rounds, "2": rounds}, "drafted_rounds": {"1": [0, rounds], "2": [0, 0, rounds]},
                "full_rounds": rounds, "reached": [rounds, 0.0], "accepted": [0.0, 0.0], "beta_sum": [0.0, 0.0],
                "histogram": [rounds, 0.0, 0.0]}
    few = summarize_slice([rec(i, 20.0 - i) for i in range(3)], 2)
    assert few["few_prompts"] is True and few["min_prompts"] > 3
    many = summarize_slice([rec(i, 20.0 - i % 3) for i in range(few["min_prompts"])], 2)
    assert many["few_prompts"] is False


def test_no_verdict_names_its_cause():
    """Review 6: with enough prompts but no derived (or direct) rounds there is no interval either;
    the check says why, not 'too few prompts'."""
    from pipeline.speculation.acceptance_stats import agree_mark

    zero = [{"tokens": 0.0, "expected_rounds": {"3": 0.0}} for _ in range(4)]
    runs = {3: [{"tokens": 40, "rounds": 20} for _ in range(4)]}
    c = direct_check(zero, runs, greedy=False)["3"]
    assert c["agree"] is None and c["difference_ci"] is None
    assert c["no_verdict"] == "no rounds on the derived side" == c["test"] and "too few" not in c["test"]
    assert agree_mark(c) == " (no rounds on the derived side)"
    recs = [{"tokens": 40.0, "expected_rounds": {"3": 20.0}} for _ in range(4)]
    c = direct_check(recs, {3: [{"tokens": 0, "rounds": 0} for _ in range(4)]}, greedy=False)["3"]
    assert c["no_verdict"] == "no rounds on the direct side"
    one = direct_check(recs[:1], {3: runs[3][:1]}, greedy=False)["3"]
    assert one["no_verdict"].startswith("too few prompts") and agree_mark(one) == f" ({one['no_verdict']})"
    ok = direct_check(recs, {3: [{"tokens": 40, "rounds": 20 + i} for i in range(4)]}, greedy=False)["3"]
    assert ok["agree"] is not None and ok["no_verdict"] is None and agree_mark(ok) in ("", " DISAGREE")

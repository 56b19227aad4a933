"""Acceptance, losslessness and k from a serving engine's per-request counts (no engine needed):
each figure against a hand count or a closed form, the lossless tests by simulation, the k rule
and the speculative_config it writes."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.serving.served_k import derived_vs_engine, engine_tables, recommend, served_report, speed_row
from pipeline.speculation.engine_stats import (greedy_lossless, judge_divergence, request_record, sampled_lossless,
                                               summarize_requests)


def completion(steps: list[int], accepted: list[int] | None, drafted: list[int] | None, step_s: float = 0.01,
               ttft_s: float = 0.05) -> dict:
    """A streamed request: `steps` tokens per chunk (the first is the prefill's), arriving every step_s."""
    ids, t = [], 0
    for n in steps:
        ids.append(list(range(t, t + n)))
        t += n
    spec = None if accepted is None else {"per_step_accepted": accepted, "per_step_drafted": drafted}
    return {"step_ids": ids, "step_times": [ttft_s + i * step_s for i in range(len(steps))], "spec": spec,
            "finish_reason": "length"}


def test_request_record_counts_steps_positions_and_times():
    # prompt lookup at k = 3: steps 2..6; drafted steps accept 1, 0, 3 (4 tokens), one step without a draft
    c = completion([1, 2, 1, 4, 1], accepted=[1, 0, 3], drafted=[3, 2, 3])
    r = request_record("p", "chat", c, 3)
    assert r["tokens"] == 9 and r["decode_tokens"] == 8 and r["steps"] == 4 and r["drafts"] == 3
    assert r["accepted_per_pos"] == [2, 1, 1]  # steps accepting >= 1, >= 2, >= 3
    assert r["offered_per_pos"] == [3, 3, 2]
    assert r["reached_per_pos"] == [3, 2, 1]  # drafted >= i and accepted >= i - 1
    assert r["tpot_ms"] == pytest.approx(4 * 10.0 / 8)  # (E2E - TTFT) / (tokens - 1)
    assert r["ttft_ms"] == pytest.approx(50.0) and len(r["itl_ms"]) == 4


def test_merged_chunks_take_the_steps_from_the_counts():
    # a slow client: two steps (2 + 4 tokens) arrived as one chunk of 6, more than k + 1 = 4
    c = completion([1, 6, 1], accepted=[1, 3], drafted=[3, 3])
    r = request_record("p", "chat", c, 3)
    assert r["steps_from"] == "counts" and r["steps"] == 3  # 2 drafted + (7 - 6) undrafted


def test_two_definitions_of_tokens_per_step():
    # half the steps draft (k = 2, both accepted), half propose nothing
    recs = [request_record(f"p{i}", "c", completion([1] + [3, 1] * 5, [2] * 5, [2] * 5), 2) for i in range(4)]
    s = summarize_requests(recs, 2)
    assert s["expected_tokens_per_step"] == pytest.approx(20 / 10)  # specq's: every step
    assert s["mean_acceptance_length"] == pytest.approx(3.0)  # vLLM's: drafted steps only
    assert s["drafted_share"] == pytest.approx(0.5)
    assert [p["prefix"] for p in s["per_position"]] == pytest.approx([0.5, 0.5])
    assert [p["per_draft"] for p in s["per_position"]] == pytest.approx([1.0, 1.0])


def test_tokens_per_step_matches_the_closed_form_under_constant_acceptance():
    """Each drafted position accepted with probability a until the first rejection: E = (1 - a^(k+1)) / (1 - a)."""
    rng = np.random.default_rng(0)
    a, k = 0.6, 3
    recs = []
    for p in range(40):
        acc = []
        for _ in range(200):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            acc.append(n)
        recs.append(request_record(f"p{p}", "c", completion([1] + [n + 1 for n in acc], acc, [k] * len(acc)), k))
    s = summarize_requests(recs, k)
    want = (1 - a ** (k + 1)) / (1 - a)
    assert s["expected_tokens_per_step"] == pytest.approx(want, rel=0.02)
    lo, hi = s["expected_tokens_per_step_ci"]
    assert lo <= want <= hi
    assert [p["conditional"] for p in s["per_position"]] == pytest.approx([a] * k, abs=0.02)
    assert [p["prefix"] for p in s["per_position"]] == pytest.approx([a, a ** 2, a ** 3], abs=0.02)


def _lp(token: int, top: dict[int, float]) -> dict:
    return {"token": token, "logprob": top[token], "top": top}


def test_greedy_divergence_at_a_near_tie_is_explained_and_a_wrong_token_is_not():
    plain = [5, 6, 7, 8]
    plain_lp = [_lp(5, {5: -0.1}), _lp(6, {6: -0.5, 9: -0.6}), _lp(7, {7: -0.2}), _lp(8, {8: -0.3})]
    tie = [5, 9, 7, 8]  # 9 is 0.1 nats below 6 at position 1, and the spec run is greedy after
    tie_lp = [_lp(5, {5: -0.1}), _lp(9, {9: -0.55, 6: -0.58}), _lp(7, {7: -0.2}), _lp(8, {8: -0.3})]
    v = judge_divergence(plain, tie, plain_lp, tie_lp, tolerance=0.25)
    assert v["at"] == 1 and v["logprob_gap"] == pytest.approx(0.1) and v["explained"]
    # an engine error: a token far below the top of its own verify distribution
    wrong_lp = [_lp(5, {5: -0.1}), _lp(9, {9: -3.0, 6: -0.1}), _lp(7, {7: -0.2}), _lp(8, {8: -0.3})]
    plain_far = [_lp(5, {5: -0.1}), _lp(6, {6: -0.1, 9: -3.0}), _lp(7, {7: -0.2}), _lp(8, {8: -0.3})]
    assert not judge_divergence(plain, tie, plain_far, wrong_lp, tolerance=0.25)["explained"]
    g = greedy_lossless({"a": {"output": plain, "logprobs": plain_lp}, "b": {"output": plain, "logprobs": plain_lp}},
                        {"a": {"output": tie, "logprobs": tie_lp}, "b": {"output": plain, "logprobs": plain_lp}})
    assert g["identical"] == 1 and not g["greedy_identical"] and g["greedy_lossless"]
    assert g["tolerance"] >= 0.125


def test_sampled_lossless_holds_its_level_and_catches_a_changed_distribution():
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.2, 0.15, 0.1, 0.45])  # what a broken sampler emits at some positions

    def draws(dist, n=120, positions=8, bad_from=None):
        out = rng.choice(len(p), size=(n, positions), p=dist).tolist()
        if bad_from is not None:
            for s in out:
                s[bad_from:] = rng.choice(len(p), size=positions - bad_from, p=q).tolist()
        return out
    reps, alpha = 200, 0.05
    false = sum(not sampled_lossless(draws(p), draws(p), alpha)["passed"] for _ in range(reps))
    caught = sum(not sampled_lossless(draws(p), draws(p, bad_from=1), alpha)["passed"] for _ in range(reps))
    assert false / reps <= 0.08  # Bonferroni over 7 positions: at most alpha (conservative)
    assert caught / reps >= 0.95


def _records(ms_per_token: float, n: int = 10, tokens: int = 21, jitter: float = 0.0, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"p{i}", "tokens": tokens,
             "decode_ms": ms_per_token * (tokens - 1) * (1 + jitter * rng.standard_normal())} for i in range(n)]


def test_speed_row_pairs_prompts():
    row = speed_row(2, _records(30.0), _records(20.0), 0.95, 0)
    assert row["speedup"] == pytest.approx(1.5) and row["ms_per_token"] == pytest.approx(20.0)
    noisy = speed_row(2, _records(30.0, jitter=0.05), _records(20.0, jitter=0.05, seed=1), 0.95, 0)
    lo, hi = noisy["speedup_ci"]
    assert lo < noisy["speedup"] < hi and lo < 1.5 < hi


def _pair(ks_ms: dict[int, dict[str, float]], lossless=None) -> tuple[dict, dict]:
    """plain and pair documents: ks_ms[k][B] = spec ms/token (plain 30 at every B)."""
    plain = {"measure": {"b1": {"0.0": _records(30.0)}, "closed_loop": {"4": {"0.0": {"records": _records(30.0)}}}}}
    by_k = {}
    for k, per_b in ks_ms.items():
        summ = {"expected_tokens_per_step": 1.5, "expected_tokens_per_step_ci": [1.4, 1.6],
                "mean_acceptance_length": 1.8, "drafted_share": 0.8, "per_position": []}
        by_k[str(k)] = {"b1": {"0.0": _records(per_b["1"], jitter=0.01, seed=k)},
                        "closed_loop": {"4": {"0.0": {"records": _records(per_b["4"], jitter=0.01, seed=k),
                                                      "tpot_ms": {"p50": per_b["4"]}}}},
                        "summary": {"all": {"0.0": summ}},
                        "lossless": (lossless or {}).get(k, {"greedy": {"greedy_lossless": True}})}
    return plain, {"variant": "v", "draft": "ngram", "target_dir": "/runs/x/variants/v", "by_k": by_k}


def test_recommendation_by_batch_becomes_vllms_schedule(tmp_path):
    plain, pair = _pair({1: {"1": 24.0, "4": 27.0}, 2: {"1": 20.0, "4": 33.0}})
    tables = engine_tables(plain, pair)
    rec = recommend(tables, pair, tmp_path)
    assert rec["recommended_k"] == 2 and rec["recommended_k_by_batch"] == {1: 2, 4: 1}
    assert rec["speculative_config"] == {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                         "num_speculative_tokens": 2,
                                         "num_speculative_tokens_per_batch_size": [[1, 3, 2], [4, 4, 1]]}
    assert "--speculative-config" in rec["serve_command"]
    assert rec["best_fixed_config"]["num_speculative_tokens"] == 2
    report = served_report({**pair, "tables": tables, "recommendation": rec}, None)
    assert report["recommended_k"] == 2 and report["baseline_ms_per_token"] == pytest.approx(30.0)
    assert [r["k"] for r in report["rows"]] == [1, 2] and report["rows"][1]["round_ms"] == pytest.approx(30.0, rel=0.02)
    assert report["derived_vs_engine"] is None


def test_a_k_that_is_not_lossless_is_never_recommended(tmp_path):
    bad = {2: {"greedy": {"greedy_lossless": False}}}
    plain, pair = _pair({1: {"1": 24.0, "4": 40.0}, 2: {"1": 15.0, "4": 40.0}}, lossless=bad)
    rec = recommend(engine_tables(plain, pair), pair, tmp_path)
    assert rec["recommended_k"] == 1 and rec["by_temperature"]["0.0"]["not_lossless_k"] == [2]
    plain, pair = _pair({1: {"1": 40.0, "4": 40.0}})
    rec = recommend(engine_tables(plain, pair), pair, tmp_path)
    assert rec["speculative_config"] is None and rec["verdict"] == "do not speculate"
    assert rec["serve_command"] == "vllm serve /runs/x/variants/v"


def test_derived_vs_engine_pairs_prompts():
    recs = [{"id": f"p{i}", "tokens": 21, "steps": 10} for i in range(6)]
    pair = {"by_k": {"1": {"b1": {"0.0": recs}, "summary": {"all": {"0.0": {"per_position": [{"prefix": 0.5}]}}}}}}
    same = {"slices": {"all": {"0.0": {"expected_tokens_per_round": {"1": 2.0}, "per_position": [{"prefix": 0.5}],
                                       "per_prompt": [{"prompt": f"p{i}", "tokens": 20 + (i % 2),
                                                       "expected_rounds": {"1": 10.0 + (i % 2) * 0.5}}
                                                      for i in range(6)]}}}}
    c = derived_vs_engine(same, pair)["0.0"]["1"]
    assert c["engine"] == pytest.approx(2.0) and c["agree"] is True and not c["flag"]
    far = {"slices": {"all": {"0.0": {**same["slices"]["all"]["0.0"], "per_prompt": [
        {"prompt": f"p{i}", "tokens": 20, "expected_rounds": {"1": 16.0 + (i % 2)}} for i in range(6)]}}}}
    c = derived_vs_engine(far, pair)["0.0"]["1"]
    assert c["agree"] is False and c["flag"]

"""k per category (issue #28): pipeline/serving/marginal.py `recommended_k_by_category` on synthetic
acceptance and latency artifacts with known answers, and the marginal report's category table."""
from __future__ import annotations

import pytest

from pipeline.report.marginal import category_rows, render_markdown
from pipeline.serving.marginal import CATEGORY_RULE, pair_report
from tests.test_marginal import _acc, _expected, _latency


def _workload(categories: list[str], per: int) -> dict:
    return {"name": "builtin", "source": "evals/data/speculation_prompts.json", "seed": 0, "categories": categories,
            "n_prompts": per * len(categories), "skipped_too_long": 0, "cut": 0,
            "prompts": [{"id": f"{c}-{i}", "category": c, "prompt_tokens": 20 + i, "output_tokens": None}
                        for c in categories for i in range(per)]}


def _acceptance(slices: dict[str, dict], workload: dict | None) -> dict:
    acc = {"variant": "bf16", "draft": "ngram", "k_max": 4,
           "slices": {s: {"0.0": block, "0.7": block} for s, block in slices.items()}}
    if workload is not None:
        acc["workload"] = workload
    return acc


def _three_categories(**extra) -> dict:
    """summarize: copying pays (a = 0.9); chat: almost nothing accepted; rag: E(1) = 1.25 over three
    prompts that disagree (round counts x0.7, x1, x1.3). Round time 12.5 + 2 d ms, plain 10 ms
    (tests/test_marginal.py _latency), the same for every category."""
    summarize = _acc(_expected(0.9, 4), 0.9, prompts=8, spread=0.05)
    chat = _acc({k: 1.0 + 0.05 * k for k in range(1, 5)}, 0.05, prompts=8, spread=0.01)  # every prompt E >= 1
    rag = _acc({1: 1.4, 2: 1.5, 3: 1.55, 4: 1.58}, 0.4, prompts=3, spread=0.3)
    pooled = _acc(_expected(0.6, 4), 0.6, prompts=19, spread=0.02)
    for block in (summarize, chat, rag, pooled):
        block.update(extra)
    return {"all": pooled, "summarize": summarize, "chat": chat, "rag": rag}


def test_copying_category_recommends_k_while_chat_recommends_zero():
    """summarize: ms/token at k = (12.5 + 2k) / (1 + 0.9 + ... + 0.9^k) = 7.63, 6.09, 5.38, 5.01 for
    k = 1..4 against 10 plain: k > 0 (4, or 3 if their CIs overlap), settled. chat: E(k) = 1 + 0.05k,
    speedup 0.72 at k = 1 and less above, with a narrow CI: k = 0, settled ('do not speculate')."""
    rep = pair_report(_acceptance(_three_categories(), _workload(["summarize", "chat", "rag"], 3)), _latency(4))
    cats = rep["recommended_k_by_category"]
    assert list(cats) == ["summarize", "chat", "rag"]  # the workload's order
    s, c = cats["summarize"]["0.0"], cats["chat"]["0.0"]
    assert s["k"] >= 1 and s["settled"] and s["verdict"] == "speculate"
    assert s["k"] == rep["slices"]["summarize"]["0.0"]["recommended_k"]
    assert s["speedup_ci"][0] > 1.0 and s["speedup_ci"][0] <= s["speedup"] <= s["speedup_ci"][1]
    row = next(r for r in rep["slices"]["summarize"]["0.0"]["rows"] if r["k"] == s["k"])
    assert s["tokens_per_round"] == pytest.approx(row["tokens_per_round"]) and s["at_k"] == s["k"]
    assert s["tokens_per_round"] == pytest.approx(_expected(0.9, 4)[s["k"]])
    assert s["n_prompts"] == 8
    assert c["k"] == 0 and c["settled"] and c["verdict"] == "do not speculate"
    assert c["speedup_ci"][1] < 1.0 and c["at_k"] == c["best_k"]
    assert "few_prompts" not in s  # the acceptance slice carries no flag: none is invented
    # every temperature gets its entry; "all" stays the primary table, not a category
    assert set(cats["chat"]) == {"0.0", "0.7"} and "all" not in cats
    assert rep["category_rule"] == CATEGORY_RULE


def test_a_wide_interval_is_not_settled_and_falls_back_to_zero():
    """rag: E(1) = 1.4 -> 14.5 / 1.4 = 10.36 ms vs plain 10 (a point speedup of 0.97 at its best k)
    over three prompts whose resamples move E(1) by +-30%: the speedup CI contains 1, so k = 0
    with settled false, verdict 'inconclusive' and the best k named."""
    rep = pair_report(_acceptance(_three_categories(), _workload(["summarize", "chat", "rag"], 3)), _latency(4))
    r = rep["recommended_k_by_category"]["rag"]["0.0"]
    assert r["k"] == 0 and r["settled"] is False and r["verdict"] == "inconclusive"
    assert r["speedup_ci"][0] < 1.0 < r["speedup_ci"][1]
    assert r["at_k"] == r["best_k"] and f"best k = {r['best_k']}" in r["reason"] and r["n_prompts"] == 3


def test_few_prompts_flag_is_carried_and_unsettles():
    rep = pair_report(_acceptance(_three_categories(few_prompts=True), None), _latency(4))
    for cat in ("summarize", "chat"):
        e = rep["recommended_k_by_category"][cat]["0.0"]
        assert e["few_prompts"] is True and e["settled"] is False and "few_prompts" in e["reason"]
    # the pooled row of the report's table reads the flag from its own table
    assert rep["slices"]["all"]["0.0"]["few_prompts"] is True
    assert category_rows(rep)[0][4] == "no (speculate; few prompts)"
    # the verdict itself is still the rule's: summarize still recommends its k
    assert rep["recommended_k_by_category"]["summarize"]["0.0"]["k"] >= 1
    # one prompt and no flag (an acceptance JSON made before it): the CI is the timing repeats' alone
    one = _three_categories()
    one["summarize"] = _acc(_expected(0.9, 4), 0.9, prompts=1)
    e = pair_report(_acceptance(one, None), _latency(4))["recommended_k_by_category"]["summarize"]["0.0"]
    assert e["k"] >= 1 and e["settled"] is False and "one prompt" in e["reason"] and "few_prompts" not in e


def test_workload_named_in_the_report():
    slices = _three_categories()
    rep = pair_report(_acceptance(slices, _workload(["summarize", "chat", "rag"], 3)), _latency(4))
    assert rep["workload"]["name"] == "builtin" and "prompts" not in rep["workload"]
    md = render_markdown(rep)
    assert "## k per category" in md and "Workload: `builtin` (9 prompts in 3 categories, 0 skipped" in md
    table = {(r[0], r[1]): r for r in category_rows(rep)}
    assert table[("summarize", "0.0 (greedy)")][3] == str(rep["recommended_k_by_category"]["summarize"]["0.0"]["k"])
    assert table[("rag", "0.0 (greedy)")][4] == "no (inconclusive)"
    assert "(best k = " in table[("chat", "0.0 (greedy)")][6]
    assert next(iter(table))[0] == "all"  # the pooled slice first


@pytest.mark.parametrize("prompts,spread", [(2, 0.3), (3, 0.3), (8, 0.1)])
def test_e_draws_and_speedup_ci_stay_feasible(prompts, spread):
    """E(k) lies in [1, k + 1], so with round time 12.5 + 2k ms and plain 10 ms (constant timing,
    _latency) the speedup can be at most 10 (k + 1) / (12.5 + 2k) (1.38 at k = 1) and ms/token at
    least (12.5 + 2k) / (k + 1). Few prompts that disagree give heavy t draws on the log(E - 1)
    scale; unclipped they reached E = 1e303 and speedup CIs like [0.69, 123] at 2 prompts."""
    import numpy as np

    from pipeline.speculation.acceptance_stats import ratio_t_draws

    block = _acc(_expected(0.6, 4), 0.6, prompts=prompts, spread=spread)
    tokens = np.array([r["tokens"] for r in block["per_prompt"]])
    t_b = np.random.default_rng(0).standard_t(prompts - 1, size=4000)
    for k in range(1, 5):
        rounds = np.array([r["expected_rounds"][str(k)] for r in block["per_prompt"]])
        e = ratio_t_draws(tokens, rounds, _expected(0.6, 4)[k], t_b, log_above=1.0, bounds=(1.0, k + 1.0))
        assert e.min() >= 1.0 and e.max() <= k + 1.0
    rep = pair_report(_acceptance({"all": block, "rag": block}, None), _latency(4))
    for row in rep["slices"]["rag"]["0.0"]["rows"]:
        k = row["k"]
        top = 10.0 * (k + 1) / (12.5 + 2 * k)
        assert row["speedup_ci"][1] <= top * (1 + 1e-9)
        assert row["ms_per_token_ci"][0] >= (12.5 + 2 * k) / (k + 1) * (1 - 1e-9)
        assert 1.0 <= row["tokens_per_round_ci"][0] <= row["tokens_per_round_ci"][1] <= k + 1.0

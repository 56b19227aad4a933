"""Acceptance statistics: the per-position algebra, the k <= k_max derivation against direct runs,
and the stage end to end on the tiny random Llama."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draft_models import build_draft
from pipeline.acceptance import expected_tokens_from_runs, summarize, temp_key, two_sample_chi2
from pipeline.decode import SamplingParams, generate
from tests.conftest import make_tiny_llama, save_as_prepared


def test_summarize_by_hand():
    # k_max = 3; accepted per round: 0, 1, 3, 3, 2 (5 rounds); the round with 1 drafted only 1.
    accepted, drafted = [0, 1, 3, 3, 2], [3, 1, 3, 3, 3]
    betas = [[0.2, 0.5, 0.5], [0.9], [1.0, 0.8, 0.6], [0.7, 0.9, 0.9], [0.8, 0.6, 0.1]]
    s = summarize(accepted, drafted, betas, 3, tokens=14)
    pos = s["per_position"]
    assert [p["n"] for p in pos] == [5, 4, 3]  # rounds reaching position i
    assert [p["accepted"] for p in pos] == [4, 3, 2]
    assert pos[0]["conditional"] == pytest.approx(4 / 5) and pos[1]["conditional"] == pytest.approx(3 / 4)
    assert [p["prefix"] for p in pos] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    # beta at position 2 over the 4 rounds that reached it; the 1-draft round contributes 0.
    assert pos[1]["expected_beta"] == pytest.approx((0.0 + 0.8 + 0.9 + 0.6) / 4)
    assert s["expected_tokens_per_round"] == pytest.approx({"1": 1.8, "2": 2.4, "3": 2.8})
    assert s["expected_tokens_per_round"]["3"] == pytest.approx(1 + np.mean(accepted))
    assert s["histogram"] == [1, 1, 1, 2] and s["rounds"] == 5
    lo, hi = pos[0]["ci"]
    assert lo < 0.8 < hi and 0 <= lo and hi <= 1
    # E(k) is the mean over rounds of 1 + min(accepted, k)
    assert expected_tokens_from_runs(accepted, 2)[0] == pytest.approx(2.4)
    assert temp_key(0) == "0.0" and temp_key(0.7) == "0.7"


def test_two_sample_chi2():
    rng = np.random.default_rng(0)
    a = rng.choice(5, 400, p=[0.4, 0.3, 0.2, 0.05, 0.05]).tolist()
    b = rng.choice(5, 400, p=[0.4, 0.3, 0.2, 0.05, 0.05]).tolist()
    c = rng.choice(5, 400, p=[0.1, 0.1, 0.2, 0.3, 0.3]).tolist()
    assert two_sample_chi2(a, b) > 1e-3 and two_sample_chi2(a, c) < 1e-6
    assert two_sample_chi2([3] * 10, [3] * 10) == 1.0


def _rounds_at(model, draft, prompts, k, seed, n_new):
    g = torch.Generator().manual_seed(seed)
    accepted = []
    for ids in prompts:
        res = generate(model, ids, n_new, draft=draft, k=k, sampling=SamplingParams(1.0), generator=g)
        accepted += [r.accepted for r in res.rounds if r.k == k]
    return accepted


def test_expected_tokens_derived_from_k_max_match_direct_runs(tiny_tokenizer):
    """E[tokens/round] at k = 1 and 2, derived from one k_max = 4 pass, against runs at k = 1, 2.

    Both are means of per-round quantities (1 + min(A, k) vs 1 + A_k) over a few hundred rounds
    of temperature-1 sampling, so their difference is about normal with the pooled standard error;
    the contexts where rounds start differ between the runs (round boundaries move with k), which
    can shift acceptance slightly, so the tolerance is 4 pooled standard errors + 0.05 tokens.
    Seeds are fixed, so the outcome is deterministic."""
    model = make_tiny_llama(tiny_tokenizer, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # broader distributions: acceptance well inside (0, 1)
    draft = build_draft("layerskip:2", model, tiny_tokenizer, None, "cpu")
    texts = ["the quick brown fox", "def add(a, b):", "Le chat est", "{\"name\": ", "One two three"]
    prompts = [torch.tensor([tiny_tokenizer.encode(t)]) for t in texts]
    at_max = _rounds_at(model, draft, prompts * 4, 4, seed=1, n_new=40)
    derived = summarize(at_max, at_max, [[]] * len(at_max), 4, tokens=0)["expected_tokens_per_round"]
    assert len(at_max) > 150
    for k in (1, 2):
        direct = _rounds_at(model, draft, prompts * 3, k, seed=10 + k, n_new=40)
        mean_direct, se_direct = expected_tokens_from_runs(direct, k)
        mean_derived, se_derived = expected_tokens_from_runs(at_max, k)
        assert mean_derived == pytest.approx(derived[str(k)])
        assert 1.05 < mean_direct < k + 0.95  # acceptance is neither 0 nor 1: a real check
        tol = 4 * np.hypot(se_direct, se_derived) + 0.05
        assert abs(mean_direct - mean_derived) < tol, (k, mean_direct, mean_derived, tol)


@pytest.fixture
def tiny_run(tmp_path, tiny_model, tiny_tokenizer):
    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    (run / "variants" / "meta.json").write_text(json.dumps({"input_hash": "test"}))
    return run


def test_acceptance_stage_end_to_end(tiny_run):
    from pipeline.__main__ import STAGES
    from pipeline.config import load_config
    from pipeline.stage import run_stage

    cfg = load_config("configs/smoke.yaml", {"drafts": ["ngram", "layerskip:2", "self:bf16"], "device": "cpu"})
    cfg.acceptance.lossless_samples = 40
    run_stage(STAGES["drafts"], tiny_run, cfg, {}, STAGES)
    run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES)
    k_max = cfg.acceptance.k_max
    for slug in ("ngram", "layerskip-2", "self-bf16"):
        data = json.loads((tiny_run / "acceptance" / f"bf16__{slug}.json").read_text())
        assert data["variant"] == "bf16" and data["k_max"] == k_max
        assert set(data["slices"]) == {"chat", "code", "long_context", "structured", "all"}
        for slice_ in data["slices"].values():
            assert set(slice_) == {"0.0", "0.7"}
            for s in slice_.values():
                assert [p["position"] for p in s["per_position"]] == list(range(1, k_max + 1))
                assert set(s["expected_tokens_per_round"]) == {str(k) for k in range(1, k_max + 1)}
                assert len(s["histogram"]) == k_max + 1 and sum(s["histogram"]) == s["rounds"]
        pooled = data["slices"]["all"]["0.0"]
        assert pooled["rounds"] == sum(data["slices"][k]["0.0"]["rounds"] for k in
                                       ("chat", "code", "long_context", "structured"))
        lossless = data["lossless"]
        assert lossless["greedy_identical"] and lossless["prompts"] == 4 and lossless["sampling"]["pass"]
    same = json.loads((tiny_run / "acceptance" / "bf16__self-bf16.json").read_text())["slices"]["all"]["0.0"]
    assert all(p["conditional"] == 1.0 for p in same["per_position"])  # the sanity pair
    assert same["expected_tokens_per_round"][str(k_max)] == pytest.approx(k_max + 1)
    # Unchanged inputs: the stage is a no-op; the items are fresh.
    before = (tiny_run / "acceptance" / "bf16__ngram.json").stat().st_mtime_ns
    run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES, force=True)
    assert (tiny_run / "acceptance" / "bf16__ngram.json").stat().st_mtime_ns == before

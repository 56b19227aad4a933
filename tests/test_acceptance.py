"""Acceptance: per-prompt records and slice summaries by hand, derived E(k) against direct engine
runs on the real embedded model (ngram and layerskip, greedy and sampled), and the stage end to
end on the tiny random Llama. The estimator's maths against simulation is in
tests/test_expected_rounds.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.speculation.prompts import KINDS
from pipeline.speculation.measure import temp_key
from pipeline.speculation.acceptance_stats import direct_check, prompt_record, summarize_slice
from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows, round_chain
from pipeline.speculation.lossless import two_sample_chi2
from tests.conftest import save_as_prepared


def _record(pid: str, per_token, k_max=3, n_new=12):
    per_token = np.asarray(per_token, float)
    text = TextAcceptance(model_draft_rows(per_token, k_max), model_draft_rows(per_token, k_max),
                          np.full(per_token.size, k_max), per_token.size + 1, n_new)
    return prompt_record(pid, "code", text, {k: round_chain(text, k) for k in range(1, k_max + 1)})


def test_records_and_slice_summary_by_hand():
    # Prompt a: every draft right (N = 12, k = 3): rounds at starts 1, 5, 9 (the last shortened
    # to k = 2: 9 + 2 + 1 = 12): 3 rounds, 2 of them full, 11 tokens.
    a = _record("code-0", [1.0] * 11)
    assert a["tokens"] == 11 and a["expected_rounds"]["3"] == 3.0 and a["full_rounds"] == 2.0
    assert a["drafted_rounds"]["3"] == [0.0, 0.0, 1.0, 2.0]
    # Prompt b: nothing right: 11 rounds of one token at every k.
    b = _record("code-1", [0.0] * 11)
    assert b["expected_rounds"]["1"] == b["expected_rounds"]["3"] == 11.0
    s = summarize_slice([a, b], 3, confidence=0.95)
    assert s["expected_tokens_per_round"]["3"] == pytest.approx(22 / 14)
    assert s["expected_tokens_per_round"]["1"] == pytest.approx(22 / (6 + 11))  # a: 6 rounds of 2 at k = 1
    pos = s["per_position"]
    # Full rounds at k = 3: a's 2 (all accepted), b's 8 (starts 1..8; from 9 on N - s - 1 < 3).
    assert s["rounds"] == pytest.approx(10.0) and pos[0]["n"] == pytest.approx(10.0)
    assert pos[0]["conditional"] == pytest.approx(2 / 10) and pos[1]["conditional"] == pytest.approx(1.0)
    assert [p["prefix"] for p in pos] == pytest.approx([2 / 10] * 3)
    for p in pos:  # every interval inside [0, 1] and around its point
        assert 0.0 <= p["ci"][0] <= p["conditional"] <= p["ci"][1] <= 1.0
        assert 0.0 <= p["prefix_ci"][0] <= p["prefix"] <= p["prefix_ci"][1] <= 1.0
    # Position 2 is 2/2 accepted: the Wilson interval keeps it from claiming certainty.
    assert pos[1]["ci"][0] < 0.5
    for k, (lo, hi) in s["expected_tokens_per_round_ci"].items():
        assert 1.0 <= lo <= s["expected_tokens_per_round"][k] <= hi <= int(k) + 1
    # a drafts [3, 3, 2]; b drafts 3 at starts 1..8, then 2, 1, 0.
    assert s["drafted_distribution"]["3"] == pytest.approx([1 / 14, 1 / 14, 2 / 14, 10 / 14])
    assert temp_key(0) == "0.0" and temp_key(0.7) == "0.7"


def test_direct_check_greedy_is_exact_and_sampled_uses_the_difference_ci():
    recs = [_record(f"p{i}", np.r_[np.ones(5), np.zeros(6)]) for i in range(4)]
    runs = {k: [{"tokens": r["tokens"], "rounds": r["expected_rounds"][str(k)]} for r in recs] for k in (1, 2)}
    out = direct_check(recs, runs, greedy=True)
    assert all(c["agree"] and c["derived"] == c["direct"] for c in out.values())
    runs[2][0]["rounds"] += 1
    assert not direct_check(recs, runs, greedy=True)["2"]["agree"]
    # Sampled: one more round on one prompt of four is inside the noise the prompts show...
    mixed = [_record(f"q{i}", np.random.default_rng(i).random(11)) for i in range(6)]
    runs = {1: [{"tokens": r["tokens"], "rounds": round(r["expected_rounds"]["1"]) + (i == 0)} for i, r in
                enumerate(mixed)]}
    near = direct_check(mixed, runs, greedy=False)["1"]
    assert near["difference_ci"][0] <= near["direct"] - near["derived"] <= near["difference_ci"][1]
    # ...twice the rounds everywhere is not.
    runs = {1: [{"tokens": r["tokens"], "rounds": 2 * r["expected_rounds"]["1"]} for r in mixed]}
    assert not direct_check(mixed, runs, greedy=False)["1"]["agree"]


def test_two_sample_chi2():
    rng = np.random.default_rng(0)
    a = rng.choice(5, 400, p=[0.4, 0.3, 0.2, 0.05, 0.05]).tolist()
    b = rng.choice(5, 400, p=[0.4, 0.3, 0.2, 0.05, 0.05]).tolist()
    c = rng.choice(5, 400, p=[0.1, 0.1, 0.2, 0.3, 0.3]).tolist()
    assert two_sample_chi2(a, b) > 1e-3 and two_sample_chi2(a, c) < 1e-6
    assert two_sample_chi2([3] * 10, [3] * 10) == 1.0


def test_derived_matches_direct_runs_on_the_embedded_model(embedded_model_dir):
    """The real model, fp32, 4 prompts (one per kind), 24 new tokens, k_max = 3: derived E(k) vs
    real engine runs at k = 1, 2. Greedy: equal (same text). T = 0.7: the 95% paired t CI
    of direct - derived contains 0. Fixed seeds: deterministic."""
    from draft_models.registry import build_draft
    from pipeline.speculation.measure import generate_texts, measure_pair
    from pipeline.core.config import Config
    from pipeline.variants.schemes import load_variant
    from pipeline.speculation.workload import workload_prompts

    model, tok = load_variant(embedded_model_dir, device="cpu", dtype="float32")
    config = Config.model_validate({"acceptance": {"k_max": 3, "max_new_tokens": 24, "prompts_per_kind": 1,
                                                   "temperatures": [0.0, 0.7], "lossless_samples": 12,
                                                   "direct_check_k": [1, 2],
                                                   "categories": ["chat", "code", "long_context", "structured"]}})
    cfg = config.acceptance
    prompts = workload_prompts(config, tok, "test")
    texts = generate_texts(model, prompts, cfg, 0, tok.eos_token_id)
    for spec in ("ngram", "layerskip:8"):
        draft = build_draft(spec, model, tok, None, torch.device("cpu"))
        result = measure_pair(model, tok, draft, cfg, 0, prompts, texts)
        assert result["lossless"]["greedy_identical"], result["lossless"]["mismatches"]
        for t, block in result["slices"]["all"].items():
            for k, c in block["direct_check"].items():
                print(f"{spec} T={t} k={k}: derived {c['derived']:.4f} direct {c['direct']:.4f} "
                      f"diff CI {c['difference_ci']}")
                assert c["agree"], (spec, t, k, c)
                if t == "0.0":
                    assert c["derived"] == pytest.approx(c["direct"], abs=1e-12)
            assert 1.0 < block["expected_tokens_per_round"]["3"] < 4.0


@pytest.fixture
def tiny_run(tmp_path, tiny_model, tiny_tokenizer):
    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    (run / "variants" / "meta.json").write_text(json.dumps({"input_hash": "test"}))
    return run


def test_acceptance_stage_end_to_end(tiny_run):
    from pipeline.__main__ import STAGES
    from pipeline.core.config import load_config
    from pipeline.core.stage import run_stage

    cfg = load_config("configs/smoke.yaml", {"drafts": ["ngram", "layerskip:2", "self:bf16"], "device": "cpu"})
    cfg.acceptance.lossless_samples = 40
    cfg.acceptance.temperatures = [0.0, 0.7]  # the smoke run is greedy only; here both paths
    cfg.budget.minutes = None  # every prompt's direct check (tests/test_acceptance_budget.py: the budget)
    run_stage(STAGES["drafts"], tiny_run, cfg, {}, STAGES)
    meta = json.loads(run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES).read_text())
    assert set(meta["seconds"]) >= {"bf16 texts", "bf16__ngram"}
    k_max = cfg.acceptance.k_max
    for slug in ("ngram", "layerskip-2", "self-bf16"):
        data = json.loads((tiny_run / "acceptance" / f"bf16__{slug}.json").read_text())
        assert data["variant"] == "bf16" and data["k_max"] == k_max and data["direct_check_k"] == [1, 2]
        assert set(data["slices"]) == {*KINDS, "all"}
        for slice_ in data["slices"].values():
            assert set(slice_) == {"0.0", "0.7"}
            for s in slice_.values():
                assert [p["position"] for p in s["per_position"]] == list(range(1, k_max + 1))
                assert set(s["expected_tokens_per_round"]) == {str(k) for k in range(1, k_max + 1)}
                assert len(s["histogram"]) == k_max + 1 and sum(s["histogram"]) == pytest.approx(s["rounds"])
                assert set(s["direct_check"]) == {"1", "2"}
        pooled = data["slices"]["all"]["0.0"]
        assert pooled["prompts"] == len(KINDS) and len(pooled["per_prompt"]) == len(KINDS)
        assert all(c["agree"] for t in data["slices"]["all"].values() for c in t["direct_check"].values())
        lossless = data["lossless"]
        assert lossless["greedy_identical"] and lossless["prompts"] == len(KINDS) and lossless["sampling"]["pass"]
    same = json.loads((tiny_run / "acceptance" / "bf16__self-bf16.json").read_text())["slices"]["all"]["0.0"]
    assert all(p["conditional"] == pytest.approx(1.0) for p in same["per_position"])  # the sanity pair
    # Everything accepted: rounds emit k + 1 tokens except where the budget shortens them.
    assert same["expected_tokens_per_round"][str(k_max)] == pytest.approx(same["tokens"] / sum(
        -(-(r["tokens"]) // (k_max + 1)) for r in same["per_prompt"]))
    # Unchanged inputs: the stage is a no-op; the items are fresh. A latency key the stage does
    # not read (repeats) re-runs the stage (the latency section is among its inputs, for the
    # prompt-length limit's new_tokens) but leaves every item fresh.
    before = (tiny_run / "acceptance" / "bf16__ngram.json").stat().st_mtime_ns
    run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES, force=True)
    assert (tiny_run / "acceptance" / "bf16__ngram.json").stat().st_mtime_ns == before
    cfg.latency.repeats += 1
    run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES)
    assert (tiny_run / "acceptance" / "bf16__ngram.json").stat().st_mtime_ns == before

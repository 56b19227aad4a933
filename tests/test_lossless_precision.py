"""The greedy lossless check at reduced precision (issue 24, point 1).

In bf16 a verify over k + 1 tokens and a one-token step round the same logits differently, so at a
near-tie a correct engine's greedy output can flip away from plain greedy. The check used to call
that a lossless failure ("no-go for speculation whatever its speed"). Now each divergence is judged
by a tie rule measured on the model (pipeline/speculation/lossless.py). These tests run the real
engine on the embedded SmolLM2 at bf16 and fp32, with a correct engine and with a planted error
(the verify rule accepts the first draft token whatever the target says), and take the result
through the gate's speculation verdict.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

# Two acceptance prompts whose n-gram greedy runs at k = 1 flip at a bf16 near-tie within 32 tokens
# on this machine's CPU kernels (avx512_bf16): measured 2026-12-02 over the 12 acceptance prompts
# x 64 tokens x k = 1, 2, where 8 of 24 bf16 runs diverged, every one with a logit gap of 0-0.25.
PROMPTS = ("chat-2", "code-2")
NEW_TOKENS = 32


def _planted(monkeypatch):
    """A wrong engine: the verify rule keeps the first draft token whatever the target's argmax."""
    import pipeline.decode.engine as engine

    real = engine.verify

    def accept_first(target, last, draft_tokens, sampling):
        p = real(target, last, draft_tokens, sampling)
        p[0] = torch.nn.functional.one_hot(draft_tokens[0], p.shape[-1]).to(p.dtype)
        return p

    monkeypatch.setattr(engine, "verify", accept_first)


def _verdict(tmp_path, greedy: dict) -> str:
    """The gate's speculation verdict for one pair with this greedy check."""
    import json

    from pipeline.gate.speculation import speculation

    (tmp_path / "acceptance").mkdir(exist_ok=True)
    (tmp_path / "acceptance" / "v__ngram.json").write_text(
        json.dumps({"variant": "v", "draft": "ngram", "lossless": {**greedy, "prompts": len(PROMPTS)}}))
    return speculation(tmp_path, "holm")["pairs"]["v__ngram"]["decision"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_correct_engine_passes_and_a_planted_error_fails(embedded_model_dir, tmp_path, monkeypatch, dtype):
    from pipeline.decode.drafts import NgramDraft
    from pipeline.decode.engine import generate
    from pipeline.speculation.lossless import greedy_check
    from pipeline.core.config import Config
    from pipeline.speculation.workload import workload_prompts
    from pipeline.variants.schemes import load_variant

    model, tok = load_variant(embedded_model_dir, device="cpu", dtype=dtype)
    every = {pid: ids for rows in workload_prompts(Config(), tok, "acceptance", 3, quiet=True).values() for pid, ids in rows}
    prompts = {"all": [(pid, every[pid]) for pid in PROMPTS]}
    plain = {pid: generate(model, torch.tensor([ids]), NEW_TOKENS).tokens for pid, ids in prompts["all"]}

    def runs():
        return {1: {pid: {"output": generate(model, torch.tensor([ids]), NEW_TOKENS, draft=NgramDraft("ngram"),
                                             k=1).tokens} for pid, ids in prompts["all"]}}

    correct = greedy_check(model, prompts, plain, runs())
    if dtype == "bfloat16":
        # The case the old check got wrong: the outputs may differ, at near-ties only. Whether a
        # near-tie flips on these prompts depends on the CPU's bf16 kernels (the same code and
        # model diverged on one 2-core machine and not on another, 2026-12-02), so the divergence
        # is not required; where there is one it must be explained by the tie rule.
        assert correct["greedy_identical"] == (correct["divergences"] == 0), correct
        if correct["divergences"]:
            rule = correct["tie_rule"]
            assert rule["dtype"] == "bfloat16" and 0 < rule["logit_noise"] \
                and rule["tolerance"] >= 2 * rule["resolution"]
            for m in correct["mismatches"]:
                assert m["explained"] and abs(m["gap"]) <= rule["tolerance"] \
                    and m["max_shortfall"] <= rule["tolerance"]
        else:  # no divergence: no tie rule is needed, none is computed
            assert correct["tie_rule"] is None and correct["unexplained"] == 0
    else:
        assert correct["greedy_identical"] and correct["divergences"] == 0, correct
    assert correct["greedy_lossless"] and _verdict(tmp_path, correct) == "go"

    _planted(monkeypatch)
    wrong = greedy_check(model, prompts, plain, runs())
    assert not wrong["greedy_lossless"] and wrong["unexplained"] >= 1, wrong
    tol = wrong["tie_rule"]["tolerance"]
    assert all(m["max_shortfall"] > tol for m in wrong["mismatches"] if not m["explained"])
    assert _verdict(tmp_path, wrong) == "no-go"


def test_a_run_that_stops_early_or_runs_on_is_never_a_near_tie(tiny_model):
    """One output a strict prefix of the other (an engine that stops early, or emits past the
    plain text's EOS) is unexplained, whatever the logits."""
    from pipeline.decode.engine import generate
    from pipeline.speculation.lossless import greedy_check

    ids = list(range(5, 17))
    full = generate(tiny_model, torch.tensor([ids]), 20).tokens
    prompts = {"all": [("p", ids)]}
    for plain, spec in ((full, full[:10]), (full[:10], full)):
        out = greedy_check(tiny_model, prompts, {"p": plain}, {1: {"p": {"output": spec}}})
        assert out["divergences"] == 1 and out["unexplained"] == 1 and not out["greedy_lossless"]
        assert out["mismatches"][0]["index"] == 10


def test_direct_check_at_reduced_precision_tests_like_sampling():
    """Greedy in bf16: direct runs may follow another text after a near-tie, so derived and direct
    E(k) are compared by the paired t CI on the prompts, not for equality; in fp32 equality still holds."""
    from pipeline.speculation.acceptance_stats import direct_check

    rng = np.random.default_rng(0)
    recs = [_record(f"p{i}", (rng.random(30) < 0.6).astype(float)) for i in range(8)]
    # One prompt of eight took one more round after a flip: noise for bf16, an error for fp32.
    runs = {1: [{"tokens": r["tokens"], "rounds": r["expected_rounds"]["1"] + (i == 0)} for i, r in enumerate(recs)]}
    assert not direct_check(recs, runs, greedy=True)["1"]["agree"]
    reduced = direct_check(recs, runs, greedy=True, exact=False)["1"]
    assert reduced["agree"] and "reduced precision" in reduced["test"]
    # Twice the rounds everywhere is an error at any precision.
    runs = {1: [{"tokens": r["tokens"], "rounds": 2 * r["expected_rounds"]["1"]} for r in recs]}
    assert not direct_check(recs, runs, greedy=True, exact=False)["1"]["agree"]


def _record(pid: str, per_token):
    from pipeline.speculation.acceptance_stats import prompt_record
    from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows, round_chain

    text = TextAcceptance(model_draft_rows(per_token, 1), model_draft_rows(per_token, 1), np.full(per_token.size, 1),
                          per_token.size + 1, per_token.size + 1)
    return prompt_record(pid, "chat", text, {1: round_chain(text, 1)})

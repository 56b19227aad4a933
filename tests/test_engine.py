"""The decode engine on a tiny random Llama (seconds) and, once, on the embedded SmolLM2.

Greedy checks are exact token equality in float32. The sampled check is the seeds' third layer:
speculative vs plain sampled tokens at positions 2 and 3 from the real tiny model, two-sample
chi-square at alpha = 1e-3 (fixed seeds: deterministic).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import two_sample_p

from pipeline.decode.drafts import ModelDraft

from pipeline.decode.engine import generate

from pipeline.decode.cache import EngineError

from pipeline.decode.sampling import SamplingParams

from pipeline.decode.timing import Timer
from tests.conftest import make_tiny_llama

PROMPTS = ["the quick brown fox", "def add(a, b): return", "Le chat est sur la", "{\"name\": \"get_"]


@pytest.fixture(scope="module")
def other_draft(tiny_tokenizer):
    """A different random model as the draft: it disagrees often, so rejections happen."""
    m = make_tiny_llama(tiny_tokenizer, layers=2, seed=1)
    return ModelDraft("test:other", m, vocab_size=m.config.vocab_size)


def _ids(tok, text):
    return torch.tensor([tok.encode(text)])


def _hf_greedy(model, ids, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_plain_greedy_matches_transformers(tiny_model, tiny_tokenizer):
    for text in PROMPTS:
        ids = _ids(tiny_tokenizer, text)
        res = generate(tiny_model, ids, 12)
        assert res.tokens == _hf_greedy(tiny_model, ids, 12)
        assert res.rounds == [] and res.prefill_s > 0 and res.decode_s > 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculative_greedy_equals_plain(tiny_model, tiny_tokenizer, other_draft, k):
    self_draft = ModelDraft("test:self", tiny_model, tiny_model.config.vocab_size)
    for text in PROMPTS:
        ids = _ids(tiny_tokenizer, text)
        plain = generate(tiny_model, ids, 16).tokens
        for draft in (other_draft, self_draft):
            res = generate(tiny_model, ids, 16, draft=draft, k=k)
            assert res.tokens == plain, (draft.spec, text)
            assert sum(r.emitted for r in res.rounds) + 1 == len(res.tokens) == 16
            assert all(r.accepted <= r.drafted <= k for r in res.rounds)
    # The different draft is rejected somewhere (the rollback path ran), the self-draft never.
    res = generate(tiny_model, _ids(tiny_tokenizer, PROMPTS[1]), 16, draft=other_draft, k=k)
    assert any(r.accepted < r.drafted for r in res.rounds)
    res = generate(tiny_model, _ids(tiny_tokenizer, PROMPTS[1]), 16, draft=self_draft, k=k)
    assert all(r.accepted == r.drafted for r in res.rounds)


def test_plain_batch_rows_match_single(tiny_model, tiny_tokenizer):
    rows = [tiny_tokenizer.encode(t) for t in PROMPTS]
    n = min(len(r) for r in rows)
    batch = torch.tensor([r[:n] for r in rows])  # [4, n] equal-length prompts
    res = generate(tiny_model, batch, 10)
    assert len(res.tokens) == 4
    for row, out in zip(batch, res.tokens):
        assert out == generate(tiny_model, row.unsqueeze(0), 10).tokens


def test_eos_inside_an_accepted_draft_ends_the_output(tiny_model, tiny_tokenizer):
    ids = _ids(tiny_tokenizer, PROMPTS[3])
    plain = generate(tiny_model, ids, 16).tokens
    # Choose as EOS a token that first appears at position >= 1 of the output, so with k = 5 it
    # sits inside the first round's draft, followed by accepted draft tokens that must not appear.
    pos = next(i for i in range(1, 16) if plain[i] not in plain[:i])
    eos = plain[pos]
    self_draft = ModelDraft("test:self", tiny_model, tiny_model.config.vocab_size)
    for k in (0, 2, 5):
        res = generate(tiny_model, ids, 16, draft=self_draft, k=k, eos_token_id=eos)
        assert res.tokens == plain[: pos + 1] and res.stop == "eos"
        if k == 5:
            assert res.rounds[0].accepted > pos  # EOS was accepted with drafts after it...
            assert res.rounds[0].emitted == pos  # ...which were not emitted


def test_timer_sections_and_round_times(tiny_model, tiny_tokenizer, other_draft):
    timer = Timer("cpu")
    res = generate(tiny_model, _ids(tiny_tokenizer, PROMPTS[2]), 10, draft=other_draft, k=3, timer=timer)
    s = timer.collect()
    assert len(s["prefill"]) == 1 and len(s["round"]) == len(res.rounds) == len(s["draft"]) == len(s["verify"])
    for r in res.rounds:
        assert 0 < r.draft_s + r.verify_s <= r.round_s
    generate(tiny_model, _ids(tiny_tokenizer, PROMPTS[2]), 10, timer=timer)
    assert len(timer.collect()["decode"]) == 9


def test_bad_arguments(tiny_model, tiny_tokenizer, other_draft):
    ids = _ids(tiny_tokenizer, PROMPTS[0])
    with pytest.raises(EngineError):
        generate(tiny_model, ids, 4, draft=other_draft, k=-1)
    with pytest.raises(EngineError):
        generate(tiny_model, ids, 0)


def _token_counts(model, ids, draft, k, seed, n_runs):
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    pos2, pos3 = [], []
    for _ in range(n_runs):
        out = generate(model, ids, 3, draft=draft, k=k, sampling=params, generator=g).tokens
        pos2.append(out[1])
        pos3.append(out[2])
    return pos2, pos3



def test_sampled_speculative_matches_plain_on_tiny_model(tiny_tokenizer, other_draft):
    """Positions 2 and 3 come from the verify rule (position 1 from prefill in both modes);
    200 runs each, two-sample chi-square, alpha = 1e-3. A cooler model than the fixture's makes
    the token distribution broad enough to test."""
    model = make_tiny_llama(tiny_tokenizer, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # tied: also scales the embedding, fine for a random model
    ids = _ids(tiny_tokenizer, PROMPTS[3])
    plain = _token_counts(model, ids, None, 0, seed=11, n_runs=200)
    spec = _token_counts(model, ids, other_draft, 2, seed=12, n_runs=200)
    assert len(set(plain[0])) > 3  # the test has something to compare
    for a, b in zip(plain, spec):
        assert two_sample_p(a, b) > 1e-3


def test_embedded_model_greedy_speculative_equals_plain_and_transformers(embedded_model_dir):
    from draft_models.layerskip import build as build_layerskip
    from pipeline.variants.schemes import load_variant

    model, tok = load_variant(embedded_model_dir, device="cpu", dtype="float32")
    draft = build_layerskip("layerskip:8", model, tok, None, torch.device("cpu"))
    for text in ["The capital of France is", "def fibonacci(n):"]:
        ids = tok(text, return_tensors="pt").input_ids
        plain = generate(model, ids, 12).tokens
        assert plain == _hf_greedy(model, ids, 12)
        res = generate(model, ids, 12, draft=draft, k=3)
        assert res.tokens == plain
        assert any(r.accepted < r.drafted for r in res.rounds)  # layerskip:8 is not the target


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_other_architectures_greedy(family):
    """GPT-2 (transformer.h, learned positions) and Qwen2 run through the same cache and rollback."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from draft_models.layerskip import truncate

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                           bos_token_id=0, eos_token_id=0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2))
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    ids = torch.randint(1, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    plain = generate(model, ids, 12).tokens
    assert plain == _hf_greedy(model, ids, 12)
    draft = ModelDraft("layerskip:2", truncate(model, 2), 300)
    assert generate(model, ids, 12, draft=draft, k=3).tokens == plain


def test_plain_decode_without_eos_reads_tokens_back_once(tiny_model, tiny_tokenizer, monkeypatch):
    """No EOS: the step count is known, so no step waits on a device->host copy (.tolist()); with an
    EOS each step must look at its token."""
    calls = {"n": 0}
    real = torch.Tensor.tolist

    def counting(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    ids = _ids(tiny_tokenizer, PROMPTS[0])
    res = generate(tiny_model, ids, 12)
    assert calls["n"] == 1 and len(res.tokens) == 12 and len(res.step_s) == 11
    calls["n"] = 0
    generate(tiny_model, ids, 12, eos_token_id=tiny_tokenizer.eos_token_id)
    assert calls["n"] >= 11


class _SleepyDraft(ModelDraft):
    """Sleeps a known time in every propose (k = 0 included): each round's draft_s must hold its
    own sleep. Only lower bounds are checked, which a loaded machine cannot break."""

    def __init__(self, model, sleeps):
        super().__init__("test:sleepy", model, model.config.vocab_size)
        self.sleeps, self.calls = sleeps, 0

    def propose(self, seq, k, sampling, generator):
        import time

        time.sleep(self.sleeps[min(self.calls, len(self.sleeps) - 1)])
        self.calls += 1
        return super().propose(seq, k, sampling, generator)


def test_each_round_carries_its_own_times_and_the_last_step_times_propose(tiny_model, tiny_tokenizer):
    # max_new_tokens = 5 with k = 3: rounds at k = 3 (1 + 4 tokens if all accepted), then the
    # one-token-left plain step, whose propose(k = 0) is timed as its draft.
    sleeps = [0.01, 0.03, 0.05, 0.07]
    draft = _SleepyDraft(tiny_model, sleeps)
    res = generate(tiny_model, _ids(tiny_tokenizer, PROMPTS[1]), 6, draft=draft, k=3)
    assert res.rounds[-1].k == 0 and res.rounds[-1].drafted == 0  # the last-token step ran
    for i, r in enumerate(res.rounds):
        assert r.draft_s >= sleeps[min(i, 3)] and r.round_s >= r.draft_s + r.verify_s

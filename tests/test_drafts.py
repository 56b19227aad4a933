"""Draft builders and the drafts stage on the tiny random Llama (seconds)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draft_models.registry import build_draft, draft_slug
from pipeline.models.loading import compare_tokenizers
from pipeline.decode.drafts import NgramDraft
from pipeline.decode.engine import generate
from pipeline.decode.sampling import SamplingParams
from pipeline.core.stage import StageError
from tests.conftest import make_tiny_tokenizer, save_as_prepared


def test_slugs_and_unknown_kind():
    assert draft_slug("layerskip:8") == "layerskip-8"
    assert draft_slug("self:w4a16-gptq") == "self-w4a16-gptq"
    assert draft_slug("ngram") == "ngram"
    assert draft_slug("hf:HuggingFaceTB/SmolLM2-135M") == "hf-HuggingFaceTB-SmolLM2-135M"
    with pytest.raises(StageError, match="unknown draft 'medusa:2'"):
        draft_slug("medusa:2")


def test_ngram_lookup_prefers_longest_match_earliest_like_vllm():
    d = NgramDraft("ngram", max_n=3)
    seq = np.array([5, 1, 2, 3, 7, 8, 1, 2, 3, 9, 4, 1, 2, 3])
    assert d.lookup(seq, 3).tolist() == [7, 8, 1]  # earliest earlier [1, 2, 3] is at index 1 (vLLM's rule)
    assert NgramDraft("ngram", max_n=3, latest=True).lookup(seq, 3).tolist() == [9, 4, 1]  # latest: index 6
    assert d.lookup(np.array([4, 6, 1, 2, 9, 9, 2]), 2).tolist() == [9, 9]  # falls back to n = 1: [2]
    assert d.lookup(np.array([1, 2, 3, 4]), 3).tolist() == []  # no earlier occurrence
    assert d.lookup(np.array([7, 7, 7]), 5).tolist() == [7]  # continuation shorter than k
    # vLLM's own proposer on these (ngram_proposer._find_longest_matched_ngram_and_propose_tokens,
    # min 1, max 3, run in .venv-vllm): [9, 1, 2] and [5, 2, 6]; test_vllm_engine.py compares
    # the two on random sequences wherever the vLLM environment is installed.
    assert d.lookup(np.array([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]), 3).tolist() == [9, 1, 2]
    assert d.lookup(np.array([7, 1, 2, 5, 2, 6, 1, 2]), 3).tolist() == [5, 2, 6]


def test_ngram_round_without_match_is_a_plain_step(tiny_model, tiny_tokenizer):
    draft = build_draft("ngram", tiny_model, tiny_tokenizer, None, "cpu")
    ids = torch.tensor([tiny_tokenizer.encode("the quick brown fox jumps over the lazy dog")])
    plain = generate(tiny_model, ids, 12).tokens
    res = generate(tiny_model, ids, 12, draft=draft, k=3)
    assert res.tokens == plain
    # The first round drafts exactly what lookup finds in prompt + first token.
    expect = draft.lookup(np.array(ids[0].tolist() + plain[:1]), 3)
    assert res.rounds[0].drafted == len(expect)
    for r in res.rounds:  # a round without a match is one plain step
        assert r.drafted > 0 or (r.accepted, r.emitted, r.betas) == (0, 1, [])
    none, q = draft.propose(torch.tensor([1, 2, 3, 4]), 3, SamplingParams(), None)
    assert none.numel() == 0 and q is None
    # Greedy output of the tiny model repeats itself, so lookup finds drafts and they are accepted.
    assert sum(r.accepted for r in res.rounds) > 0
    # One-hot q: beta is p(d) (0 or 1 under greedy).
    assert all(b in (0.0, 1.0) for r in res.rounds for b in r.betas)


def test_layerskip_shares_weights_and_matches_truncated_forward(tiny_model, tiny_tokenizer):
    draft = build_draft("layerskip:2", tiny_model, tiny_tokenizer, None, "cpu")
    sub = draft.model
    assert len(sub.model.layers) == 2 and sub.config.num_hidden_layers == 2
    assert len(tiny_model.model.layers) == 4 and tiny_model.config.num_hidden_layers == 4  # untouched
    assert sub.model.layers[1].mlp.up_proj.weight.data_ptr() == tiny_model.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert sub.lm_head.weight.data_ptr() == tiny_model.lm_head.weight.data_ptr()
    ids = torch.tensor([tiny_tokenizer.encode("def add(a, b):")])
    with torch.no_grad():
        hidden = tiny_model(ids, output_hidden_states=True).hidden_states[2]  # after layer 2
        expected = tiny_model.lm_head(tiny_model.model.norm(hidden))
        got = sub(ids).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    with pytest.raises(StageError, match="between 1 and 3"):
        build_draft("layerskip:4", tiny_model, tiny_tokenizer, None, "cpu")
    with pytest.raises(StageError, match="integer"):
        build_draft("layerskip:x", tiny_model, tiny_tokenizer, None, "cpu")


def test_layerskip_speculative_sampling_runs_and_rolls_back(tiny_model, tiny_tokenizer):
    draft = build_draft("layerskip:1", tiny_model, tiny_tokenizer, None, "cpu")
    ids = torch.tensor([tiny_tokenizer.encode("Le chat est sur la table")])
    g = torch.Generator().manual_seed(0)
    res = generate(tiny_model, ids, 20, draft=draft, k=3, sampling=SamplingParams(1.0), generator=g)
    assert len(res.tokens) == 20
    assert all(len(r.betas) == r.drafted and all(0 <= b <= 1 + 1e-6 for b in r.betas) for r in res.rounds)
    assert any(r.accepted < r.drafted for r in res.rounds)


def test_self_draft_loads_the_variant_and_names_missing_ones(tmp_path, tiny_model, tiny_tokenizer):
    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    draft = build_draft("self:bf16", tiny_model, tiny_tokenizer, run, "cpu")
    ids = torch.tensor([tiny_tokenizer.encode("One two three")])
    res = generate(tiny_model, ids, 8, draft=draft, k=3)
    assert all(r.accepted == r.drafted for r in res.rounds)  # the same weights: all accepted
    with pytest.raises(StageError, match=r"no variant 'nf4' .*have: bf16"):
        build_draft("self:nf4", tiny_model, tiny_tokenizer, run, "cpu")


def test_hf_draft_accepts_same_tokenizer_and_refuses_a_different_one(tmp_path, tiny_model, tiny_tokenizer,
                                                                      tiny_model_dir):
    draft = build_draft(f"hf:{tiny_model_dir}", tiny_model, tiny_tokenizer, None, "cpu")
    assert draft.vocab_size == tiny_model.config.vocab_size
    other = make_tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    save_as_prepared(tiny_model, other, tmp_path / "other")
    with pytest.raises(StageError, match="vocab has 321 entries, the target's has 320"):
        build_draft(f"hf:{tmp_path / 'other'}", tiny_model, tiny_tokenizer, None, "cpu")
    with pytest.raises(StageError, match="cannot load"):
        build_draft(f"hf:{tmp_path / 'nowhere'}", tiny_model, tiny_tokenizer, None, "cpu")


def test_compare_tokenizers_names_a_remapped_id(tiny_tokenizer):
    class Swapped:
        eos_token_id, bos_token_id = tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id

        def get_vocab(self):
            v = dict(tiny_tokenizer.get_vocab())
            a, b = sorted(v, key=v.get)[10:12]
            v[a], v[b] = v[b], v[a]
            return v

        def encode(self, text):
            return tiny_tokenizer.encode(text)

    with pytest.raises(StageError, match="has id .* in the draft's tokenizer"):
        compare_tokenizers("draft hf:x", tiny_tokenizer, Swapped(), "draft", "target")


def test_drafts_stage_writes_one_meta_per_draft(tmp_path, tiny_model, tiny_tokenizer):
    from pipeline.__main__ import STAGES
    from pipeline.core.config import load_config
    from pipeline.core.stage import run_stage

    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    (run / "variants" / "meta.json").write_text(json.dumps({"input_hash": "test"}))
    cfg = load_config("configs/smoke.yaml", {"drafts": ["ngram", "layerskip:2", "self:bf16"], "device": "cpu"})
    run_stage(STAGES["drafts"], run, cfg, {}, STAGES)
    metas = {p.parent.name: json.loads(p.read_text()) for p in (run / "drafts").glob("*/meta.json")}
    assert set(metas) == {"ngram", "layerskip-2", "self-bf16"}
    assert metas["layerskip-2"]["layers"] == 2 and metas["layerskip-2"]["target_layers"] == 4
    assert metas["self-bf16"]["variant_dir"] == "variants/bf16"
    bad = load_config("configs/smoke.yaml", {"drafts": ["self:missing"], "device": "cpu"})
    with pytest.raises(StageError, match="no variant 'missing'"):
        run_stage(STAGES["drafts"], run, bad, {}, STAGES)
    assert not (run / "drafts" / "self-missing").exists()

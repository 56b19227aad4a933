"""The prefix-shared evaluator against lm-eval's HFLM on a tiny random model: the same
log-likelihoods (float32, 1e-4 nats), greedy flags and generated texts; each distinct prefix
computed once; sampling requests handed to HFLM."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from pipeline.quality.prefix_lm import PrefixCachedLM, PrefixWalk, common_prefix, forward_kwargs, plan_batches

SHARED = "the quick brown fox jumps over the lazy dog. a cat sat on the mat"
CONTEXTS = [SHARED + " and looked at", SHARED + " and", "Le chat est sur la table.",
            SHARED + ". One two three", "def add(a, b): return", SHARED + " and looked"]
CONTINUATIONS = [" the dog.", " a cat", " Der Hund ist", " four five", " a + b", " at the"]


@pytest.fixture(scope="module")
def lms(tiny_model, tiny_tokenizer):
    torch.manual_seed(0)
    return (PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3),
            HFLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3))


def _ll_requests(lm):
    reqs = []
    for ctx in CONTEXTS:
        for cont in CONTINUATIONS:
            c, w = lm._encode_pair(ctx, cont)
            reqs.append(((ctx, cont), c, w))
    return reqs


def test_loglikelihoods_match_hflm(lms):
    ours, ref = lms
    reqs = _ll_requests(ours)
    got = ours._loglikelihood_tokens(reqs, disable_tqdm=True)
    want = ref._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert len(got) == len(want) == len(CONTEXTS) * len(CONTINUATIONS)
    for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want):
        assert g_ll == pytest.approx(w_ll, abs=1e-4)
        assert g_greedy == w_greedy
    # Every context's options share its tokens: far fewer tokens computed than requested.
    before = ours.stats["computed_tokens"]
    assert before < 0.5 * ours.stats["prompt_tokens"]


def test_rolling_loglikelihood_matches_hflm(lms):
    ours, ref = lms
    text = " ".join([SHARED] * 3)
    reqs = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(reqs, disable_tqdm=True)[0] == pytest.approx(
        ref.loglikelihood_rolling(reqs, disable_tqdm=True)[0], abs=1e-3)


def _gen_requests(until, max_gen_toks, contexts=CONTEXTS):
    kwargs = {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}
    return [Instance("generate_until", {}, (ctx, dict(kwargs)), i) for i, ctx in enumerate(contexts)]


@pytest.mark.parametrize("until,max_gen", [(["\n"], 6), ([".", "e"], 12), ([], 9)])
def test_greedy_generations_match_hflm(lms, until, max_gen):
    ours, ref = lms
    got = ours.generate_until(_gen_requests(until, max_gen), disable_tqdm=True)
    want = ref.generate_until(_gen_requests(until, max_gen), disable_tqdm=True)
    assert got == want
    assert any(len(t) > 0 for t in got)


def test_each_distinct_prefix_is_computed_once(tiny_model, tiny_tokenizer):
    """Moving one cache from head to head in sorted order computes exactly the number of distinct
    prefixes (the size of the prefix tree), whatever order the heads arrive in; the logits of a
    branch on a moved cache equal a fresh forward's."""
    prompts = [tiny_tokenizer.encode(c) for c in CONTEXTS]
    tree = {tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)}
    walk = PrefixWalk(tiny_model, torch.device("cpu"), forward_kwargs(tiny_model))
    with torch.inference_mode():
        for p in sorted(prompts):
            walk.move_to(p)
        assert walk.computed == len(tree)
        for p in prompts:
            # Two rows of different lengths (the shorter left-padded) on the moved cache.
            logits, _ = walk.branch(p[:-3], [p[-3:], p[-3:-1]], keep=2)
            assert torch.allclose(logits[0], tiny_model(torch.tensor([p])).logits[0, -2:], atol=1e-4)
            assert torch.allclose(logits[1], tiny_model(torch.tensor([p[:-1]])).logits[0, -2:], atol=1e-4)


def test_plan_shares_long_heads_and_batches_short_prompts():
    """Three long prompts on one haystack share it; unrelated short prompts are batched
    together rather than run one call each; batches never exceed max_rows."""
    hay_a, hay_b = list(range(100, 700)), list(range(1000, 1600))
    seqs = [hay_a + [1, 2, i] for i in range(3)] + [hay_b + [3, i] for i in range(3)]
    seqs += [[5000 + i] + list(range(20)) for i in range(6)]
    plan = plan_batches(seqs, [1] * len(seqs), max_rows=4)
    by_member = {i: (head, members) for head, members in plan for i in members}
    assert by_member[0][1] == [0, 1, 2] and by_member[0][0] == 602
    assert by_member[3][1] == [3, 4, 5] and by_member[3][0] == 601
    short = [members for head, members in plan if members[0] >= 6]
    assert [len(m) for m in short] == [4, 2]
    assert sorted(i for _, m in plan for i in m) == list(range(len(seqs)))
    assert all(len(seqs[i]) - head >= 1 for head, m in plan for i in m)


def test_sampling_requests_go_to_hflm(lms, monkeypatch):
    ours, _ = lms
    seen = []

    def fake(self, requests, disable_tqdm=False):
        seen.extend(requests)
        return ["sampled"] * len(requests)

    monkeypatch.setattr(HFLM, "generate_until", fake)
    reqs = _gen_requests(["\n"], 4, CONTEXTS[:2])
    reqs.append(Instance("generate_until", {}, (CONTEXTS[2], {"until": ["\n"], "do_sample": True,
                                                              "temperature": 0.7}), 2))
    out = ours.generate_until(reqs, disable_tqdm=True)
    assert seen == [reqs[2]] and out[2] == "sampled"
    assert out[0] != "sampled" and out[1] != "sampled"


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5, 6], [5, 6, 7]) == 2

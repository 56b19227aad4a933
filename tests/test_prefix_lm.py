"""The prefix-shared evaluator against lm-eval's HFLM on a tiny random model: the same
log-likelihoods (float32, 1e-4 nats), greedy flags and generated texts; each distinct prefix
computed once; sampling requests handed to HFLM. Calibration: the measured call/token ratio is
bucketed to a power of 4 and pinned constants are used as given; the incremental stop check
stops where the whole-text check first would."""
from __future__ import annotations

import random
import weakref

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from pipeline.quality import prefix_lm, row_sizing
from pipeline.quality.prefix_lm import PrefixCachedLM, PrefixWalk, StopCheck, forward_kwargs
from pipeline.quality.row_sizing import (DECODE_KV_TOKENS, MAX_CALL_TOKENS, bucket_call_tokens, common_prefix,
                                         decode_kv_budget, measure_call_tokens, plan_batches)

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


# The last case's stop strings span token boundaries in what the tiny model generates
# ("ffff...", "????...", "...enenen", "):" "?" "en" ...): each is found only a token after it began.
@pytest.mark.parametrize("until,max_gen", [(["\n"], 6), ([".", "e"], 12), ([], 9),
                                           (["ff", "nen", ":?e", "???"], 16)])
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


# ------------------------------------------------------------------ row sizing


def _is_power_of_4(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def test_bucket_call_tokens():
    """The nearest power of 4 on a log scale: the 2-core CPU's 46-48 lands in 64, well inside
    (its edges are 32 and 128); no measurable token cost gives the largest ratio, no measurable
    call cost the smallest."""
    assert [bucket_call_tokens(r) for r in (46, 47.8, 33, 31, 3000, 0.3, 1)] == [64, 64, 64, 16, 4096, 1, 1]
    assert bucket_call_tokens(float("nan")) == bucket_call_tokens(float("inf")) == MAX_CALL_TOKENS
    assert bucket_call_tokens(1e12) == MAX_CALL_TOKENS
    assert bucket_call_tokens(0.0) == bucket_call_tokens(-3) == 1


@pytest.mark.parametrize("call_s,token_s,want_n,want", [(0.11, 0.0023, 64, 64), (0.012, 1e-6, 16384, 16384),
                                                        (0.01, 1e-9, MAX_CALL_TOKENS, MAX_CALL_TOKENS)])
def test_measure_call_tokens_on_a_model_clock(monkeypatch, call_s, token_s, want_n, want):
    """On a clock where a call costs call_s + token_s per token, the ladder climbs until n tokens
    cost twice a 1-token call (or its cap) and recovers the ratio exactly."""
    now = [0.0]
    monkeypatch.setattr(row_sizing.time, "perf_counter", lambda: now[0])

    def forward(rows, width):
        assert width <= row_sizing.MEASURE_WIDTH
        now[0] += call_s + token_s * rows * width

    m = measure_call_tokens(forward)
    assert m["tokens"] == want_n
    assert m["call_s"] == pytest.approx(call_s) and m["token_s"] == pytest.approx(token_s)
    assert m["ratio"] == pytest.approx(call_s / token_s)
    assert bucket_call_tokens(m["ratio"]) == want


def test_row_sizing_on_a_tiny_model(tiny_model, tiny_tokenizer, monkeypatch):
    """Measured on the model itself: a power-of-4 call_tokens consistent with the measured ratio,
    the K/V bytes of a position from the cache (2 x layers x kv heads x head dim x 4 bytes), a
    power-of-2 decode budget within the CPU's; recorded in stats once: a second evaluator of the
    same model reuses the measurement without measuring or recording it again."""
    monkeypatch.setattr(prefix_lm, "_MEASURED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(row_sizing, "MEASURE_ON_CPU", True)
    lm = PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3)
    cal = lm.sizing()
    assert cal["call_tokens_source"] == "measured"
    assert _is_power_of_4(cal["call_tokens"]) and cal["call_tokens"] <= MAX_CALL_TOKENS
    assert cal["call_tokens"] == bucket_call_tokens(cal["call_tokens_measured"])
    assert cal["call_ms"] > 0 and cal["token_ns"] > 0 and cal["calibration_seconds"] < 30
    c = tiny_model.config
    assert cal["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads) * 4
    d = cal["decode_kv_tokens"]
    assert d & (d - 1) == 0 and d <= DECODE_KV_TOKENS
    assert {k: lm.stats[k] for k in cal} == cal
    assert set(row_sizing.SIZING_CONSTANTS) | {"calibration_seconds"} == set(cal)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured twice")

    monkeypatch.setattr(prefix_lm, "measure_call_tokens", no_measuring)
    again = PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3)
    assert again.sizing() == cal
    assert "call_tokens" not in again.stats


def test_a_cpu_plan_uses_the_fixed_ratio_and_records_the_measured_one(tiny_model, tiny_tokenizer, monkeypatch):
    """By default a CPU's measured ratio is recorded but not used (it moves with load): the plan
    takes CPU_CALL_TOKENS, whatever the measurement said."""
    monkeypatch.setattr(prefix_lm, "_MEASURED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(prefix_lm, "measure_call_tokens",
                        lambda *a, **k: {"ratio": 0.3, "call_s": 0.01, "token_s": 0.03, "tokens": 16})
    cal = PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3).sizing()
    assert cal["call_tokens"] == row_sizing.CPU_CALL_TOKENS and cal["call_tokens_measured"] == 0.3
    assert cal["call_tokens_source"].startswith("CPU_CALL_TOKENS")


def test_pinned_constants_steer_the_plan(tiny_model, tiny_tokenizer, monkeypatch):
    """Pinned constants are used as given, nothing is measured, and they are what the planner
    gets: with a call worth 1 token, requests with little in common get calls of their own (4
    batches here), with one worth MAX_CALL_TOKENS all go in one; both score like HFLM."""
    def no_measuring(*args, **kwargs):
        raise AssertionError("pinned constants must not be measured")

    monkeypatch.setattr(prefix_lm, "measure_call_tokens", no_measuring)
    seen = []
    real_plan = prefix_lm.plan_batches

    def spy(seqs, need, max_rows, call_tokens=row_sizing.CPU_CALL_TOKENS):
        seen.append(call_tokens)
        return real_plan(seqs, need, max_rows, call_tokens)

    monkeypatch.setattr(prefix_lm, "plan_batches", spy)
    ref = HFLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=3)
    reqs = _ll_requests(ref)
    want = ref._loglikelihood_tokens(reqs, disable_tqdm=True)
    calls = {}
    for pinned in (1, MAX_CALL_TOKENS):
        lm = PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, batch_size=len(reqs),
                            call_tokens=pinned, decode_kv_tokens=2048)
        assert lm.sizing() == {"call_tokens": pinned, "decode_kv_tokens": 2048}
        got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
        assert [g[1] for g in got] == [w[1] for w in want]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
        assert seen[-1] == pinned and lm.stats["call_tokens"] == pinned
        calls[pinned] = lm.stats["prefill_calls"]
    assert calls[1] > calls[MAX_CALL_TOKENS]
    with pytest.raises(ValueError):
        PrefixCachedLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, call_tokens=0)


def test_decode_kv_budget():
    """CUDA: 1/8 of free memory over a position's K/V bytes, a power of 2; CPU: the fixed speed
    limit, lowered only where the RAM would not hold it."""
    assert decode_kv_budget("cuda", 131072, 80 * 10 ** 9) == 65536       # Llama-8B-like bf16 cache
    assert decode_kv_budget("cuda", 23040, 120 * 10 ** 9) == 524288      # SmolLM2-135M bf16 on an H200
    assert decode_kv_budget("cpu", 46080, 20 * 10 ** 9) == DECODE_KV_TOKENS
    assert decode_kv_budget("cpu", 46080, 10 ** 9) == 2048
    assert decode_kv_budget("cpu", 46080, None) == DECODE_KV_TOKENS
    assert decode_kv_budget("cuda", 10 ** 6, 10 ** 6) == row_sizing.MIN_DECODE_KV_TOKENS


# ------------------------------------------------------------------ stop strings


def _first_hit(check, toks):
    """The first length at which `check(prefix)` says done, growing the row a token at a time."""
    return next((t for t in range(1, len(toks) + 1) if check(toks[:t])), None)


def test_stop_check_stops_where_the_whole_text_check_would(tiny_tokenizer):
    """StopCheck decodes only a row's tail: on random rows (special tokens and lone bytes
    included) and on crafted ones where a stop string spans token boundaries, is spelled one
    byte-token at a time, or comes from a special token, it first says done at the same token
    as the whole-text check (the evaluator's former test), and its row's final text is the same."""
    tok = tiny_tokenizer
    rng = random.Random(0)
    vocab = len(tok)

    def whole(until, stop_ids, max_gen):
        def check(toks):
            text = tok.decode(toks, skip_special_tokens=False)
            return len(toks) >= max_gen or toks[-1] in stop_ids or any(s and s in text for s in until)
        return check

    def spelled(text):  # one token per character: a stop string spread over as many tokens as it can be
        return [i for ch in text for i in tok.encode(ch)]

    cases = []
    for _ in range(300):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        text = tok.decode(toks, skip_special_tokens=False)
        a = rng.randrange(len(text)) if text else 0
        until = [text[a:a + rng.randint(1, 12)], rng.choice(["\n", "the", "<|im_end|>", ""])]
        cases.append((toks, until, set(), 64))
    prose = "the quick brown fox jumps over the lazy dog.\n\nLe chat est sur la table. caf\u00e9\n"
    for until in (["fox jumps"], ["\n\n"], ["\u00e9\n"], ["zzz"], ["e l", "dog."], ["<|im_end|>"]):
        for toks in (tok.encode(prose), spelled(prose),
                     tok.encode("a cat sat") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" x")):
            cases.append((toks, until, set(), 80))
    cases.append((tok.encode(prose), ["\n"], {tok.encode(" fox")[0]}, 80))  # a stop id first
    cases.append((spelled(prose), ["\n"], set(), 5))                          # the cap first
    hits = 0
    for toks, until, stop_ids, max_gen in cases:
        stop = StopCheck(tok, until, stop_ids, max_gen)
        first = _first_hit(lambda t: stop([t])[0], toks)
        assert first == _first_hit(whole(until, stop_ids, max_gen), toks), (toks, until)
        hits += first is not None
        # Batched: several rows at once give what each gives alone.
        rows = [toks[:t] for t in range(1, len(toks) + 1)]
        assert stop(rows) == [stop([r])[0] for r in rows]
    assert hits > 250

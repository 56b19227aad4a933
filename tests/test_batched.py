"""Batched speculative decoding (B > 1, the synchronised scheme of pipeline/decode/batched.py).

Checked as the verify rule is (tests/test_verify.py, tests/test_engine.py), now for a batch whose
rows reject at different positions: greedy equals plain greedy row by row in float32 (tiny model,
and the embedded SmolLM2); exact enumeration of the batched rule on a small vocabulary (each
row's first two tokens are distributed as p1 p2 to 1e-6); chi-square of sampled rounds and of
the engine's sampled output against plain sampling at alpha = 1e-3 (fixed seeds: deterministic).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import two_sample_p
from scipy import stats

from pipeline.decode.drafts import ModelDraft, NgramDraft

from pipeline.decode.engine import generate

from pipeline.decode.errors import EngineError

from pipeline.decode.sampling import SamplingParams
from pipeline.decode.batched import (BatchRoundRecord, batch_accept_probs, emit_tokens, synchronised_cut,
                                     verify_batch)
from tests.conftest import make_tiny_llama

PROMPTS = ["the quick brown fox", "def add(a, b): return", "Le chat est sur la", "{\"name\": \"get_"]
ALPHA = 1e-3


@pytest.fixture(scope="module")
def other_draft(tiny_tokenizer):
    m = make_tiny_llama(tiny_tokenizer, layers=2, seed=1)
    return ModelDraft("test:other", m, vocab_size=m.config.vocab_size)


def _batch(tok, texts=PROMPTS) -> torch.Tensor:
    rows = [tok.encode(t) for t in texts]
    n = min(len(r) for r in rows)
    return torch.tensor([r[-n:] for r in rows])  # [B, n]: equal lengths, each row's own ending


def _check_rounds(rounds: list[BatchRoundRecord]) -> None:
    for r in rounds:
        acc = [n for n, a in zip(r.accepted, r.active) if a]
        assert r.kept == min(acc)
        assert r.thrown_away == sum(n - r.kept for n in acc) >= 0
        assert all(n <= d <= r.k for n, d in zip(r.accepted, r.drafted))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_batch_equals_plain_greedy_per_row(tiny_model, tiny_tokenizer, other_draft, k):
    batch = _batch(tiny_tokenizer)
    plain = [generate(tiny_model, row.unsqueeze(0), 16).tokens for row in batch]
    spread = 0
    for draft in (other_draft, ModelDraft("test:self", tiny_model, tiny_model.config.vocab_size),
                  NgramDraft("ngram")):
        res = generate(tiny_model, batch, 16, draft=draft, k=k)
        assert res.tokens == plain, draft.spec
        _check_rounds(res.rounds)
        assert all(sum(r.emitted[i] for r in res.rounds) + 1 == 16 for i in range(4))
        spread += sum(max(r.accepted) > r.kept for r in res.rounds)
    assert spread > 0  # some round had rows rejecting at different positions (tokens thrown away)


def test_eos_in_one_row_stops_that_row_only(tiny_model, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    plain = [generate(tiny_model, row.unsqueeze(0), 16).tokens for row in batch]
    pos = next(i for i in range(2, 16) if plain[0][i] not in plain[0][:i])
    eos = plain[0][pos]
    expected = [p[: p.index(eos) + 1] if eos in p else p for p in plain]
    assert any(len(e) == 16 for e in expected)  # another row runs on past row 0's EOS
    self_draft = ModelDraft("test:self", tiny_model, tiny_model.config.vocab_size)
    for draft in (self_draft, NgramDraft("ngram")):
        res = generate(tiny_model, batch, 16, draft=draft, k=3, eos_token_id=eos)
        assert res.tokens == expected
        assert any(not all(r.active) for r in res.rounds)
        _check_rounds(res.rounds)


def test_a_draft_without_a_batched_form_is_refused(tiny_model, tiny_tokenizer):
    class Custom:
        spec = "custom"

    with pytest.raises(EngineError, match="no batched form"):
        generate(tiny_model, _batch(tiny_tokenizer)[:2], 4, draft=Custom(), k=2)


def _dist(g: torch.Generator, v: int, zeros: int = 0) -> torch.Tensor:
    x = torch.rand(v, generator=g, dtype=torch.float64) + 1e-3
    if zeros:
        x[torch.randperm(v, generator=g)[:zeros]] = 0.0
    return (x / x.sum()).to(torch.float32)


@pytest.mark.parametrize("offered", [(2, 2), (2, 1), (2, 0)])
def test_enumeration_rows_rejecting_at_different_positions(offered):
    """B = 2, w = 2, V = 4, context-dependent p and q. Every draft path of both rows, every
    accept pattern (n_0, n_1) and every residual draw, through the module's own accept_prob,
    residual, cut and emission: each row's first two output tokens are distributed as
    p1(x1) p2(x2 | x1) (a row that emitted one token continues with p2(. | x1) next round).
    Row 1 offering fewer tokens (an n-gram draft) is padded with forced rejections."""
    g = torch.Generator().manual_seed(5)
    v, w = 4, 2
    p1 = [_dist(g, v, 1), _dist(g, v)]
    q1 = [_dist(g, v), _dist(g, v, 2)]
    p2 = [{x: _dist(g, v, x % 2) for x in range(v)} for _ in range(2)]  # p2[b][x1]
    q2 = [{y: _dist(g, v, (y + 1) % 2) for y in range(v)} for _ in range(2)]
    bonus = [{y: _dist(g, v) for y in range(v)} for _ in range(2)]
    off = torch.tensor(offered)
    joint = [torch.zeros(v, v, dtype=torch.float64) for _ in range(2)]
    seen_cuts = set()
    paths = [list(itertools.product(range(v), repeat=w)) for _ in range(2)]
    for y0, y1 in itertools.product(*paths):
        ys = (y0, y1)
        # Padded positions propose token 0 with q = 0 (never drawn): weight 1 there.
        wq = 1.0
        for b, y in enumerate(ys):
            if offered[b] >= 1:
                wq *= float(q1[b][y[0]])
            elif y[0] != 0:
                wq = 0.0
            if offered[b] >= 2:
                wq *= float(q2[b][y[0]][y[1]])
            elif y[1] != 0:
                wq = 0.0
        if wq == 0.0:
            continue
        p = torch.stack([torch.stack([p1[b], p2[b][ys[b][0]], bonus[b][ys[b][1]]]) for b in range(2)])  # [2, 3, V]
        q = torch.stack([torch.stack([q1[b], q2[b][ys[b][0]]]) for b in range(2)])  # [2, 2, V]
        pad = torch.arange(w)[None, :] < off[:, None]
        q = q * pad.unsqueeze(-1)
        d = torch.tensor(ys)
        a, r = batch_accept_probs(p, q, d, off)
        a, r = a.double(), r.double()
        for ns in itertools.product(range(w + 1), repeat=2):
            pn = 1.0
            for b, n in enumerate(ns):
                pn *= float(torch.prod(a[b, :n]) * (1 - a[b, n] if n < w else 1.0))
            if pn == 0.0:
                continue
            accepted = torch.tensor([[i < n for i in range(w)] + [False] for n in ns])[:, :w]
            n_vec, n_min = synchronised_cut(accepted, torch.tensor([True, True]))
            assert n_vec.tolist() == list(ns) and n_min == min(ns)
            seen_cuts.add(ns)
            for res in itertools.product(range(v), repeat=2):
                pr = float(r[0, n_min, res[0]] * r[1, n_min, res[1]])
                if pr == 0.0:
                    continue
                toks = emit_tokens(d, n_vec, n_min, torch.tensor(res))  # [2, n_min + 1]
                weight = wq * pn * pr
                for b in range(2):
                    x1 = int(toks[b, 0])
                    if toks.shape[1] >= 2:
                        joint[b][x1, int(toks[b, 1])] += weight
                    else:  # the round ended after one token: the next round samples p2(. | x1)
                        joint[b][x1] += weight * p2[b][x1].double()
    for b in range(2):
        expected = torch.stack([p1[b][x].double() * p2[b][x].double() for x in range(v)])
        assert torch.allclose(joint[b], expected, atol=1e-6), (b, (joint[b] - expected).abs().max())
    assert any(n0 != n1 for n0, n1 in seen_cuts)  # rows did reject at different positions


def test_sampled_batched_rounds_follow_p():
    """B = 3 rows with different p and q (one near-agreeing, one disagreeing, one one-hot q with
    zeros), k = 3, 3000 rounds through verify_batch: for every row, chi-square of the first and
    second emitted tokens against p1 and p2 (context-free here, so the pair is p1 x p2), alpha = 1e-3."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(9)
    v, k, n = 6, 3, 3000
    p = torch.tensor(rng.dirichlet(np.full(v, 0.8), size=(3, k + 1)), dtype=torch.float32)  # [B, k+1, V]
    q = torch.tensor(rng.dirichlet(np.full(v, 0.8), size=(3, k)), dtype=torch.float32)
    q[0] = 0.8 * p[0, :k] + 0.2 * q[0]  # row 0 accepts often, row 1 rarely: different cut points
    q[2] = torch.nn.functional.one_hot(torch.tensor([1, 4, 2]), v).float()
    params = SamplingParams(1.0)
    first = np.zeros((3, v))
    second = np.zeros((3, v))
    spread = 0
    active = torch.ones(3, dtype=torch.bool)
    for _ in range(n):
        d = torch.stack([torch.multinomial(q[b], 1, generator=g).squeeze(-1) for b in range(3)])  # [B, k]
        verdict = verify_batch(p, q, d, torch.full((3,), k), active, params, g)
        spread += max(verdict.accepted) > verdict.kept
        toks = verdict.tokens
        for b in range(3):
            first[b, int(toks[b, 0])] += 1
            x2 = int(toks[b, 1]) if toks.shape[1] > 1 else int(torch.multinomial(p[b, 1], 1, generator=g))
            second[b, x2] += 1
    assert spread > n // 4
    for b in range(3):
        for counts, target in ((first[b], p[b, 0]), (second[b], p[b, 1])):
            exp = target.double().numpy() * n
            keep = exp >= 5
            obs, e = np.append(counts[keep], counts[~keep].sum()), np.append(exp[keep], exp[~keep].sum())
            obs, e = obs[e > 0], e[e > 0]
            assert stats.chisquare(obs, e * obs.sum() / e.sum()).pvalue > ALPHA



def test_sampled_batch_matches_plain_sampling_on_tiny_model(tiny_tokenizer, other_draft):
    """The engine at B = 4 (one prompt in every row, a disagreeing draft, k = 2): tokens 2 and 3
    of every row, 80 runs, pooled over rows (rows are independent, as in plain batched
    sampling: see pipeline/decode/batched.py), against plain B = 3 sampling; two-sample
    chi-square at alpha = 1e-3."""
    model = make_tiny_llama(tiny_tokenizer, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[3])] * 4)
    params = SamplingParams(1.0)

    def draws(draft, k, seed):
        gen = torch.Generator().manual_seed(seed)
        pos2, pos3, cuts = [], [], 0
        for _ in range(80):
            res = generate(model, ids, 3, draft=draft, k=k, sampling=params, generator=gen)
            for row in res.tokens:
                pos2.append(row[1])
                pos3.append(row[2])
            cuts += sum(max(r.accepted) > r.kept for r in res.rounds)
        return pos2, pos3, cuts

    plain = draws(None, 0, 21)
    spec = draws(other_draft, 2, 22)
    assert len(set(plain[0])) > 3 and spec[2] > 0
    for a, b in zip(plain[:2], spec[:2]):
        assert two_sample_p(a, b) > ALPHA


def test_embedded_model_batch_greedy_equals_plain(embedded_model_dir):
    from draft_models.layerskip import build as build_layerskip
    from pipeline.variants.schemes import load_variant

    model, tok = load_variant(embedded_model_dir, device="cpu", dtype="float32")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there",
             "The three primary colours are"]
    batch = _batch(tok, texts)
    plain = [generate(model, row.unsqueeze(0), 10).tokens for row in batch]
    spread = {}
    for draft in (build_layerskip("layerskip:8", model, tok, None, torch.device("cpu")), NgramDraft("ngram")):
        res = generate(model, batch, 10, draft=draft, k=3)
        assert res.tokens == plain, draft.spec
        _check_rounds(res.rounds)
        spread[draft.spec] = sum(max(r.accepted) > r.kept for r in res.rounds)
    assert spread["layerskip:8"] > 0  # rows rejected at different positions

"""The verify rule and the p/q shaping, checked in the seeds' first two layers:
(1) exact enumeration on a small vocabulary: the emitted token's distribution equals p to 1e-6;
(2) many random p/q pairs (zeros, one-hot q, q = 0 where p > 0, extreme logits): a chi-square
goodness-of-fit test on sampled outputs does not reject at alpha = 1e-3 per pair. All sampling
uses fixed seeds, so a run is deterministic; alpha states how unlikely a false alarm was when the
seeds were chosen, not a flake rate.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline.decode.sampling import (SamplingParams, betas, logits_to_probs, pick, sample, unpack_verdict,
                                      verify_on_device, verify_probs)


def verify_draft(p, q, draft, params, generator=None):
    """The rule as the engine runs it: on the device, read back in one transfer."""
    return unpack_verdict(verify_on_device(p, q, draft, params, generator).packed().tolist(), draft.shape[0])


ALPHA = 1e-3


def _dist(g: torch.Generator, v: int, zeros: int = 0) -> torch.Tensor:
    x = torch.rand(v, generator=g, dtype=torch.float64) + 1e-3
    if zeros:
        x[torch.randperm(v, generator=g)[:zeros]] = 0.0
    return (x / x.sum()).to(torch.float32)


def _emitted_first(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first token a k=1 round emits: sum over the draft token y ~ q of
    accept(y) * [x = y] + (1 - accept(y)) * residual(x), with the module's own accept/residual."""
    v = p.shape[-1]
    out = torch.zeros(v, dtype=torch.float64)
    for y in range(v):
        if q[0, y] == 0:
            continue
        a, r = verify_probs(p, q, torch.tensor([y]))
        out[y] += q[0, y].double() * a[0].double()
        out += q[0, y].double() * (1 - a[0].double()) * r[0].double()
    return out


@pytest.mark.parametrize("case", ["dense", "zeros_in_p", "zeros_in_q", "one_hot_q", "equal"])
def test_enumeration_first_token_equals_p(case):
    g = torch.Generator().manual_seed(1)
    v = 6
    p1 = _dist(g, v, zeros=2 if case == "zeros_in_p" else 0)
    q1 = _dist(g, v, zeros=3 if case == "zeros_in_q" else 0)  # q = 0 where p > 0
    if case == "one_hot_q":
        q1 = torch.nn.functional.one_hot(torch.tensor(2), v).float()
    if case == "equal":
        q1 = p1.clone()
    p = torch.stack([p1, _dist(g, v)])  # [k+1, V]
    emitted = _emitted_first(p, q1.unsqueeze(0))
    assert torch.allclose(emitted, p1.double(), atol=1e-6), (emitted - p1.double()).abs().max()


def test_enumeration_two_positions_joint_equals_p():
    """k = 2, V = 5: the first two output tokens, over every draft path (y1, y2), are distributed
    as p1(x1) p2(x2 | x1). A round that stops after one token continues with a plain step from
    p2(. | x1), which is what the next round's target computes."""
    g = torch.Generator().manual_seed(2)
    v = 5
    p1, q1 = _dist(g, v, 1), _dist(g, v, 1)
    p2 = {x: _dist(g, v, x % 2) for x in range(v)}  # p2(. | x1), q2(. | y1): context-dependent
    q2 = {y: _dist(g, v, (y + 1) % 2) for y in range(v)}
    joint = torch.zeros(v, v, dtype=torch.float64)
    for y1, y2 in itertools.product(range(v), range(v)):
        w = q1[y1].double() * q2[y1][y2].double()  # probability the draft proposes (y1, y2)
        if w == 0:
            continue
        p = torch.stack([p1, p2[y1], _dist(g, v)])
        q = torch.stack([q1, q2[y1]])
        a, r = verify_probs(p, q, torch.tensor([y1, y2]))
        a, r = a.double(), r.double()
        # reject at 1: x1 ~ r1, then the next round draws x2 ~ p2(. | x1)
        for x1 in range(v):
            joint[x1] += w * (1 - a[0]) * r[0, x1] * p2[x1].double()
        # accept 1, reject at 2: (y1, x2 ~ r2); accept both: (y1, y2)
        joint[y1] += w * a[0] * (1 - a[1]) * r[1]
        joint[y1, y2] += w * a[0] * a[1]
    expected = torch.stack([p1[x].double() * p2[x].double() for x in range(v)])
    assert torch.allclose(joint, expected, atol=1e-6), (joint - expected).abs().max()


def test_topk_topp_making_q_zero_keeps_the_identity():
    g = torch.Generator().manual_seed(3)
    v = 8
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.8)
    p_logits, q_logits = torch.randn(2, v, generator=g) * 3, torch.randn(1, v, generator=g) * 3
    p = logits_to_probs(p_logits, params)
    q = logits_to_probs(q_logits, params)
    assert (q == 0).sum() >= v - 4 and (p == 0).sum() >= v - 4
    emitted = _emitted_first(p, q)
    assert torch.allclose(emitted, p[0].double(), atol=1e-6)


def _random_case(rng: np.random.Generator, kind: str, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "extreme":  # logits far apart: near-one-hot p and q, ratios near 0/0
        pl, ql = rng.normal(0, 40, v), rng.normal(0, 40, v)
        p = torch.softmax(torch.tensor(pl, dtype=torch.float32), -1)
        q = torch.softmax(torch.tensor(ql, dtype=torch.float32), -1)
        return p, q
    p = rng.dirichlet(np.full(v, 0.7))
    q = rng.dirichlet(np.full(v, 0.7))
    if kind == "zeros":
        p[rng.choice(v, v // 3, replace=False)] = 0
        q[rng.choice(v, v // 3, replace=False)] = 0
    if kind == "one_hot_q":
        q = np.eye(v)[rng.integers(v)]
    if kind == "q_zero_where_p":
        q[p > np.median(p)] = 0
    p, q = p / p.sum(), q / q.sum()
    return torch.tensor(p, dtype=torch.float32), torch.tensor(q, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["dense", "zeros", "one_hot_q", "q_zero_where_p", "extreme"])
def test_sampled_outputs_follow_p(kind):
    """4 random pairs per kind, 600 rounds each (k = 1): chi-square goodness of fit of the
    emitted token against p, alpha = 1e-3 per pair; no NaN anywhere."""
    rng = np.random.default_rng(["dense", "zeros", "one_hot_q", "q_zero_where_p", "extreme"].index(kind))
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=1.0)
    v, n = 7, 600
    for _ in range(4):
        p1, q1 = _random_case(rng, kind, v)
        p = torch.stack([p1, p1])
        q = q1.unsqueeze(0)
        counts = np.zeros(v)
        for _ in range(n):
            d = sample(q1, g).view(1)
            verdict = verify_draft(p, q, d, params, g)
            assert all(np.isfinite(verdict.betas))
            x = int(d[0]) if verdict.accepted == 1 else verdict.next_token
            counts[x] += 1
        expected = p1.double().numpy() * n
        assert counts[expected == 0].sum() == 0, "emitted a token with p = 0"
        # Pool cells with small expectation so the chi-square approximation holds.
        keep = expected >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        if len(obs) < 2:
            continue
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


def test_greedy_round_is_the_target_argmax():
    v = 6
    p = torch.nn.functional.one_hot(torch.tensor([1, 4, 2]), v).float()
    q = torch.nn.functional.one_hot(torch.tensor([1, 3]), v).float()
    verdict = verify_draft(p, q, torch.tensor([1, 3]), SamplingParams(0.0))
    assert (verdict.accepted, verdict.next_token) == (1, 4)
    assert verdict.betas == [1.0, 0.0]
    all_in = verify_draft(p, torch.nn.functional.one_hot(torch.tensor([1, 4]), v).float(),
                          torch.tensor([1, 4]), SamplingParams(0.0))
    assert (all_in.accepted, all_in.next_token) == (2, 2)


def test_beta_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(4)
    p, q = torch.rand(3, 9, generator=g), torch.rand(3, 9, generator=g)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(betas(p, q), 1 - tv, atol=1e-6)
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 3, 5]), 9).float()
    assert torch.allclose(betas(p, one_hot), p[torch.arange(3), torch.tensor([0, 3, 5])])


def test_logits_to_probs_shaping():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    t = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(t, torch.softmax(logits / 0.5, -1))
    k2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (k2[0, 2:] == 0).all() and torch.allclose(k2[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits, -1)[0]  # [0.574, 0.211, 0.128, 0.078, 0.029]
    p6 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))  # needs 2 tokens
    assert (p6[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(p6[0, :2], full[:2] / full[:2].sum())
    p_small = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))  # top token only
    assert p_small[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    greedy = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0]]), SamplingParams(0.0))
    assert greedy.tolist() == [[0.0, 1.0, 0.0]]  # ties -> lowest id, as torch.argmax
    huge = logits_to_probs(torch.tensor([[1e4, -1e4, 0.0]]), SamplingParams(1.0))
    assert torch.isfinite(huge).all() and huge[0, 0] == 1.0


def test_exponential_race_sampler_matches_probs():
    g = torch.Generator().manual_seed(5)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = sample(probs.expand(20000, 5).contiguous(), g)
    counts = np.bincount(draws.numpy(), minlength=5)
    assert counts[4] == 0
    assert stats.chisquare(counts[:4], probs[:4].numpy() * 20000).pvalue > ALPHA
    assert int(pick(probs, SamplingParams(0.0))) == 0

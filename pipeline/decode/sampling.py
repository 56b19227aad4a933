"""Logits -> probabilities (temperature, top-k, top-p), sampling, and the speculative verify rule.

The verify rule (Leviathan et al. 2023; Chen et al. 2023): draft token d_i, drawn from q_i, is
accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order; at the first rejection a token is
drawn from normalize(max(p_i - q_i, 0)), after k acceptances a bonus token from p_{k+1}, so the
output follows p. beta_i = sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i) is the chance position i
is accepted given its prefix was. Checked against enumeration in tests/test_verify.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (the argmax limit of the rule)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] in float32, shaped by `params`. Greedy gives the
    one-hot of the argmax, so the verify rule accepts exactly when the argmaxes agree."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(torch.float32)
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        # Keep the k largest logits (ties at the k-th value are all kept).
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        # Drop a token when the mass strictly before it (in descending order) already reaches
        # top_p; the most likely token always survives.
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs: [..., V] -> token ids [...] by the exponential race argmax_x p(x) / E_x, E_x ~ Exp(1):
    exact, and unlike torch.multinomial no CPU-GPU sync."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(1e-20)
    return torch.argmax(probs / e, dim=-1)


def pick(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample from probs, or take the argmax when greedy (consumes no random numbers)."""
    if params.greedy:
        return probs.argmax(-1)
    return sample(probs, generator)


def betas(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q: [k, V] -> beta: [k], beta_i = sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i)."""
    return torch.minimum(p, q).sum(-1)


def verify_probs(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p: [k(+1), V] target probabilities, q: [k, V] draft probabilities, draft: [k] token ids ->
    accept_prob [k] = min(1, p_i(d_i) / q_i(d_i)) (1 where q_i(d_i) = 0 < p_i(d_i)) and
    residual [k, V] = normalize(max(p_i - q_i, 0)) (p_i where that is empty: never sampled)."""
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    px = p[rows, draft]  # [k]
    qx = q[rows, draft]  # [k]
    ratio = torch.where(qx > 0, px / qx.clamp_min(1e-30), (px > 0).to(px.dtype))
    accept_prob = ratio.clamp(max=1.0)
    residual = (p[:k] - q).clamp_min(0.0)  # [k, V]
    mass = residual.sum(-1, keepdim=True)  # [k, 1]
    # Rounding can leave a residual of ~1e-9 mass when p == q in exact arithmetic: fall back to p.
    empty = mass <= 1e-12
    residual = torch.where(empty, p[:k], residual / mass.clamp_min(1e-30))
    return accept_prob, residual


@dataclass
class Verdict:
    accepted: int  # n: the draft tokens d_1..d_n are kept
    next_token: int  # from the residual at n+1 (n < k) or the bonus from p_{k+1} (n = k)
    betas: list[float]  # beta_i for every drafted position i = 1..k
    tokens: list[int] = field(default_factory=list)  # what the round emits: d_1..d_n, next_token


@dataclass
class DeviceVerdict:
    """The rule's outcome still on the device. accepted: [] long, n; emitted: [k+1] long,
    d_1..d_n then the next token at index n (later entries stale); betas: [k] float32."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    betas: torch.Tensor

    def packed(self) -> torch.Tensor:
        """[2 + 2k] float32 = (n, emitted_0..emitted_k, beta_1..beta_k): the outcome in one transfer
        (float32 holds every integer below 2^24 exactly)."""
        return torch.cat([self.accepted.view(1).to(torch.float32), self.emitted.to(torch.float32),
                          self.betas.to(torch.float32)])


def unpack_verdict(values: list[float], k: int) -> Verdict:
    """DeviceVerdict.packed(), read back as a list (.tolist()), for a round that drafted k."""
    n = int(values[0])
    tokens = [int(x) for x in values[1: 2 + n]]
    return Verdict(n, tokens[-1], [float(x) for x in values[2 + k:]], tokens)


def verify_on_device(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, params: SamplingParams,
                     generator: torch.Generator | None = None) -> DeviceVerdict:
    """Apply the rule to one round without reading anything back to the host. p: [k+1, V],
    q: [k, V], draft: [k] (k may be 0). Random numbers: u [k], then one draw from the emitted row
    (residual_{n+1} or p_{k+1}, chosen on the device)."""
    k = draft.shape[0]
    draft = draft.to(torch.long)
    if k == 0:
        nxt = pick(p[0], params, generator)
        return DeviceVerdict(torch.zeros((), dtype=torch.long, device=p.device), nxt.view(1), p.new_zeros(0))
    accept_prob, residual = verify_probs(p, q, draft)
    if params.greedy:
        accepted = accept_prob >= 1.0
    else:
        u = torch.rand(k, device=p.device, generator=generator)
        accepted = u < accept_prob  # u in [0, 1): accept_prob = 1 always accepts, 0 never
    n = accepted.to(torch.int64).cumprod(0).sum()  # [] number of leading accepts, on the device
    # The emitted row without a branch on n (a branch would be a CPU-GPU sync): residual_{n+1}
    # when n < k, else the bonus row p_{k+1}.
    row = torch.where(n < k, residual.index_select(0, n.clamp(max=k - 1).view(1))[0], p[k])  # [V]
    nxt = pick(row, params, generator)
    emitted = torch.cat([draft, draft.new_zeros(1)]).index_put((n.view(1),), nxt.view(1))  # [k+1]
    return DeviceVerdict(n, emitted, betas(p[:k], q))


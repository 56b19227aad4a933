"""Batched speculative decoding (B > 1) on one shared cache offset: the synchronised scheme.

    from pipeline.decode.engine import generate
    res = generate(model, ids_BxT, 32, draft=d, k=3)      # B > 1 lands here
    res.batch_tokens, res.rounds                           # rounds: BatchRoundRecord

StaticLayer writes every row at one offset, so each round every row still generating (no EOS yet)
keeps n_min + 1 tokens, n_min the fewest leading accepts among them: what its own round emits at
positions 1..n_min + 1. Exact per row: its round stops at its own first rejection or where the
other rows' draws cut it, whichever comes first, and a Leviathan/Chen round stopped that way emits
each token with law p given its prefix (pipeline/decode/sampling.py). Short drafts are padded with
forced rejections (q = 0); each round records what the cut threw away (`ragged_tokens`, `kept_tokens`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.decode.cache import CachedModel
from pipeline.decode.drafts import ModelDraft, NgramDraft
from pipeline.decode.errors import EngineError
from pipeline.decode.sampling import SamplingParams, betas, logits_to_probs, pick
from pipeline.decode.steps import GenerationResult, cut_at_eos, decode_one_token, prefill
from pipeline.decode.timing import Timer, synchronize

__all__ = ["BatchRoundRecord", "BatchedModelDraft", "BatchedNgramDraft", "batched_draft", "batch_accept_probs",
           "synchronised_cut", "emit_tokens", "verify_batch", "generate_batched"]


@dataclass
class BatchRoundRecord:
    k: int  # draft length asked of every row this round (k, or fewer near max_new_tokens)
    drafted: list[int]  # per row: tokens the draft offered (< k when it had fewer; 0 for finished rows)
    accepted: list[int]  # per row: n_b, leading accepts of the row's own draft
    kept: int  # n_min over active rows: every active row keeps kept + 1 tokens
    emitted: list[int]  # per row: tokens appended to the output (kept + 1, less after EOS; 0 when finished)
    active: list[bool]  # rows still generating at the start of the round
    betas: list[list[float]] = field(default_factory=list)  # per row, beta_i at each offered position
    draft_s: float = 0.0
    verify_s: float = 0.0
    round_s: float = 0.0

    @property
    def ragged_tokens(self) -> int:
        """Tokens the active rows would keep with per-row offsets: sum_b (n_b + 1)."""
        return sum(n + 1 for n, a in zip(self.accepted, self.active) if a)

    @property
    def kept_tokens(self) -> int:
        """Tokens the synchronised scheme keeps: B_active (n_min + 1)."""
        return sum(self.active) * (self.kept + 1)

    @property
    def thrown_away(self) -> int:
        """Accepted draft tokens discarded to keep one shared cache offset."""
        return self.ragged_tokens - self.kept_tokens


# ---------------------------------------------------------------- batched drafts


class BatchedModelDraft:
    """A ModelDraft's model drafting for B rows through one [B, ...] static cache.

    Same bookkeeping as ModelDraft (pipeline/decode/drafts.py), once for all rows: under the
    synchronised scheme every row commits the same number of tokens, so one length serves all.
    """

    def __init__(self, draft: ModelDraft, batch: int):
        self.spec, self.inner, self.batch = draft.spec, draft, batch
        self.cached: CachedModel | None = None
        self._round = (0, 0)

    def prefill(self, input_ids: torch.Tensor, max_len: int, exact: bool = False) -> None:
        self.cached = CachedModel(self.inner.model, batch=self.batch, max_len=max_len, slot="draft", exact=exact)
        self.cached.forward(input_ids, all_logits=False)
        self._round = (0, 0)

    def propose(self, seqs: torch.Tensor, k: int, sampling: SamplingParams, generator,
                active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """seqs: [B, L] -> tokens [B, k], q [B, k, V], offered [B] (k per active row, 0 otherwise)."""
        assert self.cached is not None, "prefill first"
        length = seqs.shape[1]
        self._round = (length, k)
        feed = seqs[:, self.cached.length:length]  # [B, catch-up]: 1 token, or 2 after a full accept
        tokens, qs = [], []
        for i in range(k):
            logits = self.cached.forward(feed, all_logits=False)[:, -1]  # [B, V]
            q = self.inner.probs(logits, sampling)
            tok = pick(q, sampling, generator)  # [B]
            tokens.append(tok)
            qs.append(q)
            feed = tok.unsqueeze(1)
        offered = active.to(torch.long) * k
        return torch.stack(tokens, 1), torch.stack(qs, 1), offered  # [B, k], [B, k, V], [B]

    def accept(self, n_min: int) -> None:
        length, k = self._round
        if k > 0 and self.cached is not None:
            self.cached.rollback(min(self.cached.length, length + min(n_min, k - 1)))


class BatchedNgramDraft:
    """Prompt lookup per row; a row with a shorter (or no) match is padded with forced rejections."""

    def __init__(self, draft: NgramDraft, batch: int, vocab: int):
        self.spec, self.inner, self.batch, self.vocab = draft.spec, draft, batch, vocab

    def prefill(self, input_ids: torch.Tensor, max_len: int, exact: bool = False) -> None:
        pass

    def propose(self, seqs, k, sampling, generator, active):
        host = seqs.cpu().numpy()  # a CPU-GPU sync point on CUDA: the lookup is host work
        b = host.shape[0]
        tokens = torch.zeros(b, k, dtype=torch.long)
        offered = torch.zeros(b, dtype=torch.long)
        for row in range(b):
            if bool(active[row]):
                found = self.inner.lookup(host[row], k)
                tokens[row, :len(found)] = torch.as_tensor(found, dtype=torch.long)
                offered[row] = len(found)
        tokens, offered = tokens.to(seqs.device), offered.to(seqs.device)
        q = torch.nn.functional.one_hot(tokens, self.vocab).to(torch.float32)  # [B, k, V]
        q *= (torch.arange(k, device=seqs.device)[None, :] < offered[:, None]).unsqueeze(-1)  # padding: q = 0
        return tokens, q, offered

    def accept(self, n_min: int) -> None:
        pass


def batched_draft(draft, batch: int, vocab: int):
    """The batched form of a runtime draft (ModelDraft or NgramDraft)."""
    if isinstance(draft, ModelDraft):
        return BatchedModelDraft(draft, batch)
    if isinstance(draft, NgramDraft):
        return BatchedNgramDraft(draft, batch, vocab)
    raise EngineError(f"draft {getattr(draft, 'spec', type(draft).__name__)} has no batched form "
                      "(speculative decoding at B > 1 takes ModelDraft or NgramDraft drafts)")


# ---------------------------------------------------------------- the batched rule


def batch_accept_probs(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                       offered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p: [B, w+1, V], q: [B, w, V], d: [B, w], offered: [B] -> accept_prob [B, w], residual [B, w+1, V].

    accept_prob = min(1, p(d)/q(d)) at offered positions (1 where q(d) = 0 < p(d), as in
    sampling.verify_probs) and 0 at padded ones (forced rejection). residual[:, i] =
    normalize(max(p_i - q_i, 0)), with q_i = 0 at padded positions and at i = w (so both are p).
    """
    b, w = d.shape
    px = p[:, :w].gather(-1, d.unsqueeze(-1)).squeeze(-1)  # [B, w]
    qx = q.gather(-1, d.unsqueeze(-1)).squeeze(-1)  # [B, w]
    ratio = torch.where(qx > 0, px / qx.clamp_min(1e-30), (px > 0).to(px.dtype))
    real = torch.arange(w, device=d.device)[None, :] < offered[:, None]  # [B, w]
    accept_prob = torch.where(real, ratio.clamp(max=1.0), torch.zeros_like(ratio))
    q_ext = torch.cat([q * real.unsqueeze(-1), torch.zeros_like(p[:, :1])], 1)  # [B, w+1, V]
    residual = (p - q_ext).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q in exact arithmetic can leave ~1e-9 of mass: fall back to p (never sampled then).
    residual = torch.where(mass <= 1e-12, p, residual / mass.clamp_min(1e-30))
    return accept_prob, residual


def synchronised_cut(accepted: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, int]:
    """accepted: [B, w] bool per position, active: [B] -> n: [B] leading accepts, n_min over active rows."""
    n = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    # `.item()` is a CPU-GPU sync point, once per round: the host must know n_min to move the cache.
    n_min = int(n[active].min().item()) if bool(active.any()) else 0
    return n, n_min


def emit_tokens(d: torch.Tensor, n: torch.Tensor, n_min: int, residual_token: torch.Tensor) -> torch.Tensor:
    """d: [B, w], n: [B], residual_token: [B] drawn at position n_min + 1 -> tokens [B, n_min + 1]:
    d_b,1..d_b,n_min, then d_b,n_min+1 where the row accepted it (n_b > n_min), else its residual."""
    if n_min < d.shape[1]:
        last = torch.where(n > n_min, d[:, n_min], residual_token)
    else:  # every row accepted all w: the bonus
        last = residual_token
    return torch.cat([d[:, :n_min], last.unsqueeze(1)], 1)


@dataclass
class BatchVerdict:
    accepted: list[int]  # n_b per row
    kept: int  # n_min
    tokens: torch.Tensor  # [B, n_min + 1]
    betas: list[list[float]]


def verify_batch(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, offered: torch.Tensor, active: torch.Tensor,
                 params: SamplingParams, generator: torch.Generator | None = None) -> BatchVerdict:
    """The synchronised rule for one round. p: [B, w+1, V], q: [B, w, V], d: [B, w], offered/active: [B]."""
    accept_prob, residual = batch_accept_probs(p, q, d, offered)
    if params.greedy:
        accepted = accept_prob >= 1.0
    else:
        u = torch.rand(d.shape, device=p.device, generator=generator)
        accepted = u < accept_prob
    n, n_min = synchronised_cut(accepted, active)
    residual_token = pick(residual[:, n_min], params, generator)  # [B]
    tokens = emit_tokens(d, n, n_min, residual_token)
    row_betas = [betas(p[i, :m], q[i, :m]).tolist() for i, m in enumerate(offered.tolist())]
    return BatchVerdict(n.tolist(), n_min, tokens, row_betas)


# ---------------------------------------------------------------- the loop


@torch.inference_mode()
def generate_batched(target, input_ids: torch.Tensor, max_new_tokens: int, draft, k: int,
                     sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
                     timer: Timer | None = None, eos_token_id: int | list[int] | None = None,
                     cache_len: int | None = None):
    """Speculative decoding of B equal-length prompts input_ids [B, T] with draft length k.

    Called by pipeline.decode.engine.generate for B > 1 (same arguments, same timer sections:
    "prefill" once, then "round" containing "draft" and "verify" per round); returns its
    GenerationResult with per-row tokens and BatchRoundRecord rounds. cache_len: the target's
    and a model draft's static caches get exactly this many positions (as in generate), so a
    compiled step (pipeline/decode/compiled.py) sees one planned cache length at this B.
    """
    b, t = input_ids.shape
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    need = t + max_new_tokens + 1
    if cache_len is not None and cache_len < need:
        raise EngineError(f"cache_len {cache_len} < prompt {t} + max_new_tokens {max_new_tokens} + 1")
    length, exact = cache_len or need, cache_len is not None
    cached = CachedModel(target, batch=b, max_len=length, exact=exact)
    device = cached.device
    input_ids = input_ids.to(device)
    drafter = batched_draft(draft, b, cached.vocab)
    own = Timer(device)

    synchronize(device)
    t0 = time.perf_counter()
    with own.measure("prefill"):
        first = prefill(cached, input_ids, sampling, generator)  # [B]
        drafter.prefill(input_ids, length, exact=exact)
    synchronize(device)
    t1 = time.perf_counter()

    out: list[list[int]] = [[x] for x in first.tolist()]
    done = [bool(eos) and row[0] in eos for row in out]
    seqs = torch.cat([input_ids, first.unsqueeze(1)], 1)  # [B, L]; every row the same length
    rounds: list[BatchRoundRecord] = []
    produced = 1  # tokens each active row has emitted (equal across active rows)
    while not all(done) and produced < max_new_tokens:
        # Timed start to start, as at B = 1 (engine.py): the host work between rounds is in.
        own.lap("round")
        k_round = min(k, max_new_tokens - produced - 1)
        active = torch.tensor([not x for x in done], device=device)
        with own.measure("draft"):
            if k_round > 0:
                d, q, offered = drafter.propose(seqs, k_round, sampling, generator, active)
                width = int(offered.max().item())  # host sync: the verify width
                d, q = d[:, :width], q[:, :width]
            else:
                width = 0
        with own.measure("verify"):
            if width > 0:
                start = cached.length  # = L - 1
                logits = cached.forward(torch.cat([seqs[:, -1:], d], 1), all_logits=True)  # [B, w+1, V]
                verdict = verify_batch(logits_to_probs(logits, sampling), q, d, offered, active, sampling,
                                       generator)
                cached.rollback(start + 1 + verdict.kept)  # keep [last, d_1..d_n_min] in every row
                new, accepted, kept, row_betas = verdict.tokens, verdict.accepted, verdict.kept, verdict.betas
                drafted = offered.tolist()
            else:  # nothing offered (or one token left): a plain step for every row
                new = decode_one_token(cached, seqs[:, -1], sampling, generator).unsqueeze(1)  # [B, 1]
                accepted, kept, row_betas, drafted = [0] * b, 0, [[] for _ in range(b)], [0] * b
        if k_round > 0:
            drafter.accept(kept)
        emitted = [0] * b
        for row, toks in enumerate(new.tolist()):
            if done[row]:
                continue
            toks, hit = cut_at_eos(toks, eos)
            out[row].extend(toks)
            emitted[row] = len(toks)
            done[row] = hit
        produced += kept + 1
        seqs = torch.cat([seqs, new], 1)
        rounds.append(BatchRoundRecord(k_round, drafted, accepted, kept, emitted, active.tolist(), row_betas))
    own.end_lap("round")
    synchronize(device)
    t2 = time.perf_counter()

    samples = own.collect()
    for i, r in enumerate(rounds):
        r.draft_s, r.verify_s, r.round_s = samples["draft"][i], samples["verify"][i], samples["round"][i]
    if timer is not None:
        for name, vals in samples.items():
            timer.samples[name].extend(vals)
    per_seq = [cut_at_eos(row, eos)[0] for row in out]
    stop = "eos" if per_seq[0] and per_seq[0][-1] in eos else "length"
    return GenerationResult(tokens=per_seq, rounds=rounds, prefill_s=t1 - t0, decode_s=t2 - t1,
                            batch_tokens=per_seq, stop=stop, cache_positions=cached.max_len)

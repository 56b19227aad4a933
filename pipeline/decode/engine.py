"""The decode engine: plain and speculative decoding on a static KV cache.

    from pipeline.decode.engine import generate
    from pipeline.decode.sampling import SamplingParams
    res = generate(model, input_ids, max_new_tokens=32)                    # plain (k = 0)
    res = generate(model, input_ids, 32, draft=d, k=4, sampling=SamplingParams(0.7))
    res.tokens, res.rounds, res.prefill_s, res.decode_s

One set of small functions (`prefill`, `decode_one_token`, `draft_k`, `verify`, `speculative_step`)
serves both modes, so acceptance and latency describe one computation. A round makes one
device-to-host transfer. Speculation runs one row (B = 1); vLLM measures it under batching.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.decode.cache import CachedModel
from pipeline.decode.errors import EngineError
from pipeline.decode.drafts import Draft
from pipeline.decode.sampling import (DeviceVerdict, SamplingParams, logits_to_probs, pick, unpack_verdict,
                                      verify_on_device)
from pipeline.decode.timing import Timer, synchronize


@dataclass
class GenerationResult:
    # New token ids: a flat list for one prompt; a list of per-sequence lists when B > 1.
    tokens: list
    # Speculative only (empty for k = 0): one RoundRecord per round.
    rounds: list = field(default_factory=list)
    prefill_s: float = 0.0  # prompt forward(s) + first token (target and draft prefill)
    decode_s: float = 0.0  # every token after the first
    batch_tokens: list[list[int]] = field(default_factory=list)  # always per sequence
    stop: str = "length"  # "eos" or "length" (sequence 0)
    step_s: list[float] = field(default_factory=list)  # plain decode: seconds of each step after the first
    # Slots of the target's static cache: every step's attention reads all of them (cache.py).
    cache_positions: int = 0


def prefill(target: CachedModel, input_ids: torch.Tensor, sampling: SamplingParams,
            generator: torch.Generator | None, chunk: int | None = None) -> torch.Tensor:
    """input_ids: [B, T] -> first new token per sequence [B]; chunk: forwards of at most that many tokens."""
    logits = target.prefill(input_ids, chunk)[:, -1]  # [B, V]
    return next_token(logits, sampling, generator)


def decode_one_token(target: CachedModel, token: torch.Tensor, sampling: SamplingParams,
                     generator: torch.Generator | None) -> torch.Tensor:
    """token: [B] the last emitted token (not yet in the cache) -> the next token [B]."""
    logits = target.forward(token.unsqueeze(1), all_logits=False)[:, -1]  # [B, V]
    return next_token(logits, sampling, generator)


def next_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits: [B, V] -> [B]. Greedy skips building the one-hot: argmax of the logits is the same."""
    if sampling.greedy:
        return logits.argmax(-1)
    return pick(logits_to_probs(logits, sampling), sampling, generator)


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """tokens up to and including the first EOS, and whether there was one."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


@dataclass
class RoundRecord:
    drafted: int  # draft tokens proposed this round (< k when the draft had fewer to offer)
    accepted: int  # of those, how many the target kept (leading accepts)
    emitted: int  # tokens appended to the output this round (accepted + 1, less after EOS)
    betas: list[float]  # beta_i = sum_x min(p_i, q_i) for each drafted position i = 1..drafted
    draft_s: float  # seconds drafting
    verify_s: float  # seconds in the target's verify forward + the accept/reject rule
    round_s: float  # from this round's start to the next round's: the rounds add up to decode_s
    k: int = 0  # draft length requested this round (k, or fewer near max_new_tokens)
    # This round's own timer blocks (draft, verify, round): read after Timer.collect().
    measured: tuple = field(default=(), repr=False, compare=False)


def draft_k(draft: Draft, seq: torch.Tensor, k: int, sampling: SamplingParams,
            generator: torch.Generator | None, vocab: int,
            host: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """seq: [L] committed tokens -> draft tokens [k'] and q [k', V] (one-hot rows for a model-free
    draft). host: the same tokens on the host, for a draft that reads them there."""
    if host is not None and getattr(draft, "reads_host_tokens", False):
        tokens, q = draft.propose(seq, k, sampling, generator, host=host)
    else:
        tokens, q = draft.propose(seq, k, sampling, generator)
    tokens = tokens.to(seq.device, torch.long)
    if q is None:
        q = torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)  # [k', V]
    return tokens, q


def verify(target: CachedModel, last: torch.Tensor, draft_tokens: torch.Tensor,
           sampling: SamplingParams) -> torch.Tensor:
    """last: [1] the newest committed token, draft_tokens: [k] -> p: [k+1, V]: one target forward
    scores every draft token (row i gives p for d_{i+1}) and the bonus position (row k)."""
    tokens = torch.cat([last, draft_tokens]).unsqueeze(0)  # [1, k+1]
    logits = target.forward(tokens, all_logits=True)[0]  # [k+1, V]
    return logits_to_probs(logits, sampling)


def speculative_step(target: CachedModel, draft: Draft, seq: torch.Tensor, k: int, sampling: SamplingParams,
                     generator: torch.Generator | None, timer: Timer,
                     host: np.ndarray | None = None) -> tuple[list[int], RoundRecord, torch.Tensor]:
    """One round on seq: [L] (B = 1; the target cache holds L-1 positions). host: the same tokens
    on the host (saves a prompt-lookup draft a copy). Returns the new tokens (accepted drafts + the
    residual/bonus token), the round's record (timed once the timer is collected) and the emitted
    tokens on the device (the first len(new) are `new`). A round that drafts nothing is a plain step."""
    start = target.length  # = L - 1
    with timer.measure("draft") as t_draft:
        d, q = draft_k(draft, seq, k, sampling, generator, target.vocab, host)
    drafted = int(d.shape[0])
    with timer.measure("verify") as t_verify:
        if drafted == 0:
            # Nothing drafted (no lookup match, or k = 0 with one token left): a plain decode step.
            nxt = decode_one_token(target, seq[-1:], sampling, generator)  # [1]
            outcome = DeviceVerdict(nxt.new_zeros(()), nxt, torch.zeros(0, device=nxt.device))
        else:
            p = verify(target, seq[-1:], d, sampling)
            outcome = verify_on_device(p, q, d, sampling, generator)
        # The round's one CPU-GPU sync point: the host needs n (cache positions) and the tokens (EOS).
        verdict = unpack_verdict(outcome.packed().tolist(), drafted)
    n = verdict.accepted
    # Keep [last, d_1..d_n] in the target cache; the rest of this round's writes are stale.
    target.rollback(start + 1 + n)
    draft.accept(n)
    new = verdict.tokens
    record = RoundRecord(drafted, n, len(new), verdict.betas, 0.0, 0.0, 0.0, k, (t_draft, t_verify))
    return new, record, outcome.emitted



@torch.inference_mode()
def generate(target, input_ids: torch.Tensor, max_new_tokens: int, draft: Draft | None = None, k: int = 0,
             sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
             timer: Timer | None = None, eos_token_id: int | list[int] | None = None,
             prefill_chunk: int | None = None, cache_len: int | None = None) -> GenerationResult:
    """Decode up to max_new_tokens new tokens after input_ids [B, T] (equal-length prompts): plain
    when k = 0 or no draft (any B), else speculative at k (B = 1, k shrinking near the end); stops
    at an EOS (emitted). cache_len: static caches of exactly that many positions (timed cells).
    Timer sections: "prefill", then "decode" per plain step or "round", "draft", "verify" per round."""
    if max_new_tokens < 1:
        raise EngineError("max_new_tokens must be >= 1")
    speculative = draft is not None and k > 0
    if k < 0:
        raise EngineError(f"draft length k must be >= 0 (got {k})")
    b, t = input_ids.shape
    if speculative and b != 1:
        raise EngineError(f"speculative decoding runs one row (B = 1), got B = {b}: vLLM measures it under batching")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    need = t + max_new_tokens + 1
    if cache_len is not None and cache_len < need:
        raise EngineError(f"cache_len {cache_len} < prompt {t} + max_new_tokens {max_new_tokens} + 1")
    cached = CachedModel(target, batch=b, max_len=cache_len or need, exact=cache_len is not None)
    device = cached.device
    prompt_host = input_ids[0].cpu().numpy() if speculative else None
    input_ids = input_ids.to(device)
    own = Timer(device)  # per-round figures; merged into the caller's timer at the end

    synchronize(device)
    t0 = time.perf_counter()
    with own.measure("prefill"):
        first = prefill(cached, input_ids, sampling, generator, prefill_chunk)  # [B]
        if speculative:
            if cache_len is None:
                draft.prefill(input_ids, need)
            else:
                draft.prefill(input_ids, cache_len, exact=True)
    synchronize(device)
    t1 = time.perf_counter()

    rounds: list[RoundRecord] = []
    if speculative or eos:
        out: list[list[int]] = [[x] for x in first.tolist()]
        done = [bool(eos) and x[0] in eos for x in out]
    if speculative:
        # The committed sequence on the device (target and model draft) and on the host (prompt
        # lookup, EOS check), each extended in place from the round's own outputs: no extra copies.
        capacity = t + max_new_tokens + k + 1
        seq_dev = torch.empty(capacity, dtype=torch.long, device=device)
        seq_dev[:t] = input_ids[0]
        seq_dev[t:t + 1] = first
        seq_host = np.empty(capacity, dtype=np.int64)
        seq_host[:t] = prompt_host
        seq_host[t] = out[0][0]
        length = t + 1
        while not done[0] and len(out[0]) < max_new_tokens:
            t_round = own.lap("round")
            k_round = min(k, max_new_tokens - len(out[0]) - 1)  # 0 with one token left: a plain step
            new, record, emitted = speculative_step(cached, draft, seq_dev[:length], k_round, sampling, generator, own,
                                          seq_host[:length])
            kept, hit = cut_at_eos(new, eos)
            out[0].extend(kept)
            done[0] = hit
            seq_dev[length:length + len(kept)] = emitted[:len(kept)]
            seq_host[length:length + len(kept)] = kept
            length += len(kept)
            record.emitted, record.measured = len(kept), (*record.measured, t_round)
            rounds.append(record)
        own.end_lap("round")
    elif eos:
        last = first
        while not all(done) and len(out[0]) < max_new_tokens:
            with own.measure("decode"):
                last = decode_one_token(cached, last, sampling, generator)  # [B]
            for row, x in zip(out, last.tolist()):
                row.append(x)
            done = [d or (x[-1] in eos) for d, x in zip(done, out)]
    else:
        # No EOS: the tokens stay on the device and are read back in one transfer.
        steps = [first]
        for _ in range(max_new_tokens - 1):
            with own.measure("decode"):
                steps.append(decode_one_token(cached, steps[-1], sampling, generator))  # [B]
        out = torch.stack(steps, 1).tolist()  # [B, max_new_tokens]
    synchronize(device)
    t2 = time.perf_counter()

    samples = own.collect()
    for r in rounds:  # each record holds its own blocks: draft, verify, round
        r.draft_s, r.verify_s, r.round_s = (m.seconds for m in r.measured)
    if timer is not None:
        for name, vals in samples.items():
            timer.samples[name].extend(vals)
    per_seq = [cut_at_eos(row, eos)[0] for row in out]
    stop = "eos" if per_seq[0] and per_seq[0][-1] in eos else "length"
    return GenerationResult(tokens=per_seq[0] if b == 1 else per_seq, rounds=rounds, prefill_s=t1 - t0,
                            decode_s=t2 - t1, batch_tokens=per_seq, stop=stop, step_s=samples.get("decode", []),
                            cache_positions=cached.max_len)

"""Measuring one (target, draft) pair's acceptance: the target's texts, the teacher-forced round
chain on them, direct engine runs beside it, the lossless checks.

    from pipeline.speculation.measure import generate_texts, measure_pair
    texts = generate_texts(model, prompts, cfg.acceptance, seed, tokenizer.eos_token_id)
    result = measure_pair(model, tokenizer, draft, cfg.acceptance, seed, prompts, texts, batch_sizes=[2, 4])

The target generates each prompt's text once with plain decoding (speculation is lossless, so that
text is distributed as any speculative run's, at any k and with any draft). Per draft: one
teacher-forced pass of target and draft over each text (teacher_forced.py) gives, at every
position, the probability that a draft token there would be accepted given the text; the round
chain (expected_rounds.py, which shows why this is exact) turns those into E[rounds | text] at
every k = 1..k_max; `direct_check` runs the real engine at each k in acceptance.direct_check_k on
the same prompts. `temp_key` is the one key by which acceptance and latency JSON name a temperature.
"""
from __future__ import annotations

import torch

from pipeline.decode.drafts import Draft
from pipeline.decode.engine import generate
from pipeline.decode.sampling import SamplingParams
from pipeline.speculation.acceptance_stats import direct_check, prompt_record, summarize_slice
from pipeline.speculation.batch_rounds import by_batch_blocks
from pipeline.speculation.expected_rounds import round_chain
from pipeline.speculation.lossless import lossless_checks
from pipeline.speculation.teacher_forced import score_text


def temp_key(t: float) -> str:
    """A temperature as a JSON key: "0.0", "0.7" (one decimal when that is exact, else repr)."""
    return f"{float(t):.1f}" if round(t, 1) == t else repr(float(t))


def sampling_of(sampling_cfg, t: float) -> SamplingParams:
    """The engine's sampling at temperature t with the config's top-k / top-p (acceptance.sampling):
    the acceptance and latency stages build it the same way, so they measure the same decoding."""
    return SamplingParams(t, sampling_cfg.top_k, sampling_cfg.top_p)


def generate_texts(model, prompts: dict, cfg, seed: int, eos, on_text=None) -> dict[str, dict[str, list[int]]]:
    """temperature key -> prompt id -> the target's own output (plain decode, one per prompt).
    on_text(done, total), if given, is called after each text (the stage's progress line)."""
    device = next(model.parameters()).device
    texts: dict[str, dict[str, list[int]]] = {}
    total = len(cfg.temperatures) * sum(len(rows) for rows in prompts.values())
    done = 0
    for ti, t in enumerate(cfg.temperatures):
        g = torch.Generator(device).manual_seed(seed * 1000 + ti)
        out = texts[temp_key(t)] = {}
        for rows in prompts.values():
            for pid, ids in rows:
                out[pid] = generate(model, torch.tensor([ids], device=device), cfg.max_new_tokens,
                                    sampling=sampling_of(cfg.sampling, t), generator=g, eos_token_id=eos).tokens
                done += 1
                if on_text is not None:
                    on_text(done, total)
    return texts


def direct_runs(model, draft: Draft, prompts: dict, k: int, sampling: SamplingParams, max_new_tokens: int,
                eos, generator) -> dict[str, dict]:
    """prompt id -> {"tokens" (emitted by rounds), "rounds", "output"} of a real run at k."""
    device = next(model.parameters()).device
    out = {}
    for rows in prompts.values():
        for pid, ids in rows:
            res = generate(model, torch.tensor([ids], device=device), max_new_tokens, draft=draft, k=k,
                           sampling=sampling, generator=generator, eos_token_id=eos)
            out[pid] = {"tokens": len(res.tokens) - 1, "rounds": len(res.rounds), "output": res.tokens}
    return out


def measure_pair(model, tokenizer, draft: Draft, cfg, seed: int, prompts: dict, texts: dict,
                 batch_sizes: list[int] = ()) -> dict:
    """The acceptance JSON for one (target, draft) pair (without the variant/draft names);
    batch_sizes: B > 1 for `expected_tokens_per_round_by_batch` (pipeline/speculation/batch_rounds.py)."""
    k_max, eos = cfg.k_max, tokenizer.eos_token_id
    check_ks = sorted({k for k in cfg.direct_check_k if 1 <= k <= k_max})
    device = next(model.parameters()).device
    # Greedy direct runs reproduce the texts exactly only in full precision (lossless.py says why).
    exact = next(model.parameters()).dtype in (torch.float32, torch.float64)
    slices: dict[str, dict] = {}
    greedy_runs: dict[int, dict] = {}
    for ti, t in enumerate(cfg.temperatures):
        sampling, key = sampling_of(cfg.sampling, t), temp_key(t)
        records: dict[str, dict] = {}
        scored = {}
        for kind, rows in prompts.items():
            for pid, ids in rows:
                text = scored[pid] = score_text(model, draft, ids, texts[key][pid], sampling, k_max,
                                                cfg.max_new_tokens)
                records[pid] = prompt_record(pid, kind, text, {k: round_chain(text, k) for k in range(1, k_max + 1)})
        direct = {}
        for k in check_ks:
            g = torch.Generator(device).manual_seed(seed * 1000 + 100 * k + ti + 17)
            direct[k] = direct_runs(model, draft, prompts, k, sampling, cfg.max_new_tokens, eos, g)
            if sampling.greedy:
                greedy_runs[k] = direct[k]
        groups = {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()}
        groups["all"] = [pid for rows in prompts.values() for pid, _ in rows]
        for name, pids in groups.items():
            if not pids:
                continue
            recs = [records[p] for p in pids]
            summary = summarize_slice(recs, k_max, cfg.confidence, seed)
            summary.update(by_batch_blocks([scored[p] for p in pids], [b for b in batch_sizes if b > 1], k_max,
                                           cfg.confidence, seed))
            summary["direct_check"] = direct_check(recs, {k: [direct[k][p] for p in pids] for k in check_ks},
                                                   sampling.greedy, cfg.confidence, seed, exact=exact)
            slices.setdefault(name, {})[key] = summary
    if "0.0" in texts and greedy_runs:
        greedy_plain = texts["0.0"]
    else:  # no greedy temperature (or no direct k) configured: the lossless check runs its own pair
        greedy_plain = {pid: generate(model, torch.tensor([ids], device=device), cfg.max_new_tokens,
                                      eos_token_id=eos).tokens for rows in prompts.values() for pid, ids in rows}
        greedy_runs = {1: direct_runs(model, draft, prompts, 1, SamplingParams(0.0), cfg.max_new_tokens, eos, None)}
    return {"k_max": k_max, "method": "teacher-forced round chain (pipeline/speculation/expected_rounds.py)",
            "direct_check_k": check_ks, "max_new_tokens": cfg.max_new_tokens,
            "prompts": {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()},
            "slices": slices,
            "lossless": lossless_checks(model, prompts, draft, cfg, seed, greedy_plain, greedy_runs)}

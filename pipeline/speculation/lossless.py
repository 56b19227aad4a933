"""The acceptance stage's lossless checks: speculative decoding must not change what is generated.

    from pipeline.speculation.lossless import lossless_checks
    lossless_checks(model, prompts, draft, cfg, seed, texts, greedy_runs)

- Greedy: every direct greedy run (acceptance.direct_check_k) must reproduce the target's own
  greedy text token for token (float32; in bf16 a divergence is only acceptable at a near-tie).
  (Without a greedy temperature in the config, the stage runs one plain and one k = 1 greedy
  run per prompt for this.)
- Sampling: the first token the verify rule emits (the output's second token; the first comes
  from the prefill in both modes), speculative vs plain, on the first prompt, compared by a
  two-sample chi-square at acceptance.lossless_alpha. The target's prompt forward is run once and
  rolled back for every sample (the static cache is rewound, not refilled).
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from pipeline.decode.cache import CachedModel
from pipeline.decode.drafts import Draft
from pipeline.decode.engine import generate, speculative_step
from pipeline.decode.sampling import SamplingParams, logits_to_probs, pick
from pipeline.decode.timing import Timer


def two_sample_chi2(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of token ids share one distribution; tokens
    with fewer than 10 draws in total are pooled into one category."""
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    rare = table.sum(0) < 10
    if rare.any():
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0  # one category: the samples agree entirely
    return float(stats.chi2_contingency(table)[1])


@torch.inference_mode()
def first_verified_tokens(model, ids: list[int], draft: Draft, sampling: SamplingParams, generator,
                          samples: int, k: int = 1) -> list[int]:
    """`samples` draws of the second output token of a speculative run at draft length k."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    length = len(ids)
    cached = CachedModel(model, batch=1, max_len=length + k + 2)
    first_probs = logits_to_probs(cached.forward(x, all_logits=False)[:, -1], sampling)  # [1, V]
    off = Timer(device, enabled=False)
    out = []
    for _ in range(samples):
        cached.rollback(length)  # the prompt stays; this sample's round overwrites the rest
        first = pick(first_probs, sampling, generator)  # [1], as the engine's prefill picks it
        draft.prefill(x, length + k + 2)
        new, _ = speculative_step(cached, draft, torch.cat([x[0], first]), k, sampling, generator, off)
        out.append(new[0])
    return out


def _greedy_mismatches(texts: dict[str, list[int]], runs: dict[int, dict], prompts: dict) -> list[dict]:
    out = []
    for k, by_prompt in sorted(runs.items()):
        for rows in prompts.values():
            for pid, _ in rows:
                plain, spec = texts[pid], by_prompt[pid]["output"]
                if plain != spec:
                    at = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
                    out.append({"prompt": pid, "k": k, "index": at, "plain": plain[at:at + 3],
                                "speculative": spec[at:at + 3]})
    return out


def lossless_checks(model, prompts: dict, draft: Draft, cfg, seed: int, plain: dict[str, list[int]],
                    greedy_runs: dict) -> dict:
    """plain: prompt id -> the target's greedy output; greedy_runs: k -> prompt id -> direct run."""
    device = next(model.parameters()).device
    mismatches = _greedy_mismatches(plain, greedy_runs, prompts)
    params = SamplingParams(cfg.lossless_temperature, cfg.sampling.top_k, cfg.sampling.top_p)
    ids = next(iter(prompts.values()))[0][1]
    g = torch.Generator(device).manual_seed(seed + 1)
    m = cfg.lossless_samples
    plain_second = [row[1] for row in
                    generate(model, torch.tensor([ids] * m, device=device), 2, sampling=params, generator=g).tokens]
    spec_second = first_verified_tokens(model, ids, draft, params, g, m)
    p_value = two_sample_chi2(plain_second, spec_second)
    return {
        "greedy_identical": not mismatches,
        "prompts": len(plain),
        "greedy_k": sorted(greedy_runs),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "mismatches": mismatches,
        "sampling": {"test": "two-sample chi-square on the first verify-emitted token (k = 1)",
                     "temperature": params.temperature, "samples": m, "p_value": p_value,
                     "alpha": cfg.lossless_alpha, "pass": p_value > cfg.lossless_alpha},
    }

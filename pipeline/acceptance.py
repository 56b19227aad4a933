"""The acceptance stage: per-position acceptance of every (target variant, draft) pair.

    python -m pipeline acceptance --run runs/smollm2-135m --config configs/default.yaml

For each target (acceptance.targets, default the reference), each draft, each prompt kind (slice)
and each temperature it runs `pipeline.decode.generate` at k = k_max (the loop latency times) and
writes acceptance/<variant>__<draft_slug>.json. From the one k_max pass, per position i:

    n_i          rounds that reached position i (positions 1..i-1 accepted)
    conditional  P(A_i | A_1..A_{i-1}) = #(accepted >= i) / n_i, with a 95% Wilson CI
    prefix       P(A_1..A_i) = #(accepted >= i) / rounds
    expected_beta mean of beta_i = sum_x min(p_i, q_i) over the n_i rounds (0 where the draft
                 proposed fewer than i tokens: nothing there could be accepted)

and for every k <= k_max, E[tokens/round](k) = 1 + sum_{i<=k} prefix_i, the mean over rounds of
1 + min(accepted, k): position i is accepted at draft length k iff it is at k_max, because a
draft's first k proposals do not depend on k (the +1 is the residual or bonus token).
Rounds shortened near max_new_tokens (k < k_max) are left out of these figures.

`lossless`: greedy speculative == greedy plain on the pair's prompts, and a two-sample chi-square
of the first verify-emitted token (speculative vs plain sampling) at acceptance.lossless_alpha.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats
from statsmodels.stats.proportion import proportion_confint

from draft_models import build_draft, draft_slug
from pipeline.device import resolve_device
from pipeline.decode import CachedModel, Draft, SamplingParams, Timer, generate, prefill, speculative_step
from pipeline.prompts import prompt_ids, prompts_by_kind
from pipeline.stage import StageContext, StageError, progress, read_json


def temp_key(t: float) -> str:
    return f"{float(t):.1f}" if round(t, 1) == t else repr(float(t))


# ---------------------------------------------------------------- statistics from rounds


def summarize(accepted: list[int], drafted: list[int], betas: list[list[float]], k_max: int,
              tokens: int) -> dict:
    """Per-position figures from rounds run at k_max (accepted/drafted/betas: one entry per round)."""
    acc = np.asarray(accepted, dtype=int)
    rounds = int(acc.size)
    per_position = []
    for i in range(1, k_max + 1):
        reached = acc >= i - 1  # positions 1..i-1 accepted: position i was tested (or had no draft)
        n = int(reached.sum())
        hits = int((acc >= i).sum())
        beta = [b[i - 1] if len(b) >= i else 0.0 for b, r in zip(betas, reached) if r]
        lo, hi = proportion_confint(hits, n, alpha=0.05, method="wilson") if n else (None, None)
        per_position.append({
            "position": i,
            "conditional": hits / n if n else None,
            "prefix": hits / rounds if rounds else None,
            "expected_beta": float(np.mean(beta)) if beta else None,
            "n": n,
            "accepted": hits,
            "ci": [float(lo), float(hi)] if n else None,
        })
    expected = {str(k): 1.0 + sum(p["prefix"] or 0.0 for p in per_position[:k]) for k in range(1, k_max + 1)}
    histogram = np.bincount(acc, minlength=k_max + 1).tolist() if rounds else [0] * (k_max + 1)
    return {
        "per_position": per_position,
        "expected_tokens_per_round": expected,
        "histogram": histogram,
        "rounds": rounds,
        "tokens": tokens,
        "mean_drafted": float(np.mean(drafted)) if rounds else None,
    }


def expected_tokens_from_runs(accepted: list[int], k: int) -> tuple[float, float]:
    """Mean and standard error of 1 + min(accepted, k) over rounds (the estimator above, per round)."""
    x = 1.0 + np.minimum(np.asarray(accepted, dtype=float), k)
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("inf")


# ---------------------------------------------------------------- measuring one pair


def run_prompts(model, prompts: dict[str, list[list[int]]], draft: Draft, k_max: int, sampling: SamplingParams,
                max_new_tokens: int, eos, generator) -> dict[str, list]:
    """slice -> list of (rounds run at k_max, tokens emitted), one generate() per prompt."""
    out = {}
    device = next(model.parameters()).device
    for kind, rows in prompts.items():
        out[kind] = []
        for ids in rows:
            res = generate(model, torch.tensor([ids], device=device), max_new_tokens, draft=draft, k=k_max,
                           sampling=sampling, generator=generator, eos_token_id=eos)
            full = [r for r in res.rounds if r.k == k_max]
            out[kind].append((full, len(res.tokens)))
    return out


def slice_stats(runs: list, k_max: int) -> dict:
    rounds = [r for full, _ in runs for r in full]
    return summarize([r.accepted for r in rounds], [r.drafted for r in rounds], [r.betas for r in rounds],
                     k_max, tokens=sum(n for _, n in runs))


def first_verified_token(model, ids: list[int], draft: Draft, k: int, sampling: SamplingParams, generator) -> int:
    """The second output token of a speculative run: the first one the verify rule emits (the
    first comes from the prefill in both modes). Runs the engine's own prefill and
    speculative_step, one round."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        cached = CachedModel(model, batch=1, max_len=len(ids) + k + 2)
        first = prefill(cached, x, sampling, generator)
        draft.prefill(x, len(ids) + k + 2)
        new, *_ = speculative_step(cached, draft, torch.cat([x[0], first]), k, sampling, generator,
                                   Timer(device, enabled=False))
    return new[0]


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


def lossless_checks(model, prompts: dict[str, list[list[int]]], draft: Draft, k_max: int, cfg, seed: int,
                    max_new_tokens: int, eos) -> dict:
    device = next(model.parameters()).device
    mismatches, n = [], 0
    greedy = SamplingParams(0.0)
    for kind, rows in prompts.items():
        for j, ids in enumerate(rows):
            x = torch.tensor([ids], device=device)
            plain = generate(model, x, max_new_tokens, eos_token_id=eos).tokens
            spec = generate(model, x, max_new_tokens, draft=draft, k=k_max, sampling=greedy, eos_token_id=eos).tokens
            n += 1
            if plain != spec:
                at = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
                mismatches.append({"prompt": f"{kind}-{j}", "index": at, "plain": plain[at:at + 3],
                                   "speculative": spec[at:at + 3]})
    # Sampling: the first verify-emitted token, speculative vs plain, on the first prompt.
    params = SamplingParams(cfg.lossless_temperature, cfg.sampling.top_k, cfg.sampling.top_p)
    ids = next(iter(prompts.values()))[0]
    g = torch.Generator(device).manual_seed(seed + 1)
    m = cfg.lossless_samples
    plain = generate(model, torch.tensor([ids] * m, device=device), 2, sampling=params, generator=g).tokens
    plain_second = [row[1] for row in plain]
    spec_second = [first_verified_token(model, ids, draft, k_max, params, g) for _ in range(m)]
    p_value = two_sample_chi2(plain_second, spec_second)
    return {
        "greedy_identical": not mismatches,
        "prompts": n,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "mismatches": mismatches,
        "sampling": {"test": "two-sample chi-square on the first verify-emitted token", "temperature":
                     params.temperature, "samples": m, "p_value": p_value, "alpha": cfg.lossless_alpha,
                     "pass": p_value > cfg.lossless_alpha},
    }


def measure_pair(model, tokenizer, draft: Draft, cfg, seed: int) -> dict:
    """The acceptance JSON for one (target, draft) pair (without the variant/draft names)."""
    k_max = cfg.k_max
    eos = tokenizer.eos_token_id
    prompts = {kind: [prompt_ids(tokenizer, text) for _, text in rows]
               for kind, rows in prompts_by_kind(cfg.prompts_per_kind).items()}
    if not any(prompts.values()):
        raise StageError("acceptance: prompts_per_kind must be >= 1 (no prompts to measure)")
    device = next(model.parameters()).device
    slices: dict[str, dict] = {}
    for ti, t in enumerate(cfg.temperatures):
        sampling = SamplingParams(t, cfg.sampling.top_k, cfg.sampling.top_p)
        g = torch.Generator(device).manual_seed(seed * 1000 + ti)
        runs = run_prompts(model, prompts, draft, k_max, sampling, cfg.max_new_tokens, eos, g)
        for kind, r in runs.items():
            slices.setdefault(kind, {})[temp_key(t)] = slice_stats(r, k_max)
        slices.setdefault("all", {})[temp_key(t)] = slice_stats([x for r in runs.values() for x in r], k_max)
    return {"k_max": k_max, "slices": slices,
            "lossless": lossless_checks(model, prompts, draft, k_max, cfg, seed, cfg.max_new_tokens, eos)}


# ---------------------------------------------------------------- the stage


def run(ctx: StageContext) -> None:
    from pipeline.models import load_variant

    cfg = ctx.config.acceptance
    device = resolve_device(ctx.config.device)
    targets = cfg.targets or [ctx.config.quantize.reference]
    pairs = {}
    for variant in targets:
        vdir = ctx.run_dir / "variants" / variant
        vmeta = read_json(vdir / "meta.json", f"variant '{variant}' meta.json")
        model = tokenizer = None
        for spec in ctx.config.drafts:
            slug = draft_slug(spec)
            dmeta = read_json(ctx.run_dir / "drafts" / slug / "meta.json", f"draft '{spec}' meta.json")
            name = f"{variant}__{slug}"
            inputs = {"variant": vmeta.get("input_hash"), "draft": dmeta.get("input_hash"),
                      "acceptance": ctx.config.section("acceptance"), "seed": ctx.config.seed, "device": str(device)}
            item = ctx.item(f"{name}.json", inputs, is_dir=False)
            pairs[name] = {"variant": variant, "draft": spec, "file": f"acceptance/{name}.json"}
            if item.fresh:
                continue
            if model is None:
                model, tokenizer = load_variant(vdir, device=device)
            progress(f"acceptance: {name}")
            draft = build_draft(spec, model, tokenizer, ctx.run_dir, device)
            result = measure_pair(model, tokenizer, draft, cfg, ctx.config.seed)
            item.write_json({"variant": variant, "draft": spec, "draft_slug": slug, **result})
            summary = result["slices"]["all"]
            progress("acceptance: " + name + " " + ", ".join(
                f"T={t}: E[tokens/round]@k_max={v['expected_tokens_per_round'][str(cfg.k_max)]:.2f}"
                for t, v in summary.items()))
    ctx.meta["pairs"] = pairs

"""The acceptance stage: per-position acceptance and E[tokens/round] at every k, per (target, draft).

    python -m pipeline acceptance --run runs/smollm2-135m --config configs/default.yaml

For each target variant (acceptance.targets, default the reference), each temperature and each
prompt of every kind (slice), the target generates its text once with plain decoding
(pipeline.decode.generate; speculation is lossless, so that text is distributed as any
speculative run's, at any k and with any draft). Then, per draft:

1. One teacher-forced pass of target and draft over each text (pipeline/speculation/teacher_forced.py) gives,
   at every position, the probability that a draft token there would be accepted given the text.
2. The round chain (pipeline/speculation/expected_rounds.py, which shows why this is exact) turns those into
   E[rounds | text] at every k = 1..k_max, with the engine's own shortening of k near
   max_new_tokens and its EOS handling. E(k) = sum(tokens) / sum(E[rounds]) over the slice's
   prompts; the per-position rates come from the same chain at k_max.
3. `direct_check`: real engine runs at each k in acceptance.direct_check_k on the same prompts.
   Greedy, derived and direct must be equal (same text); sampled, the prompt-bootstrap CI of
   direct - derived must contain 0.

Writes acceptance/<variant>__<draft_slug>.json: per slice ("all" pools every prompt) and
temperature, `per_position` (position, conditional, prefix, expected_beta, n, ci, ...),
`expected_tokens_per_round` k -> E(k) with CIs, the drafted-count distribution per k (what the
marginal stage weights round times by), the per-prompt records, `direct_check`; and `lossless`.
Intervals resample prompts (pipeline/speculation/acceptance_stats.py).

4. At every B from 1 to the largest of latency.spec_batch_sizes, `expected_tokens_per_round_by_batch`
   B -> k -> E_B(k): tokens per row per round of the engine's synchronised batched scheme, exact
   given the texts of B distinct prompts, averaged over seeded groups of the slice's prompts, with
   `expected_tokens_per_round_by_batch_ci` (unit: prompt) and `by_batch_design`
   (pipeline/speculation/batch_rounds.py), `accepted_distribution_by_batch` B -> k -> P(n_min = j) per
   round, `width_distribution_by_batch` B -> k -> share of rounds by verify width (what the batched
   round time is weighted by) and `by_batch_jackknife` (the delete-one-prompt replicates of both).
   B = 1 equals `expected_tokens_per_round`.
"""
from __future__ import annotations

import time

import torch

from draft_models.registry import build_draft, draft_slug
from pipeline.speculation.batch_rounds import by_batch_blocks
from pipeline.speculation.acceptance_stats import direct_check, prompt_record, summarize_slice
from pipeline.decode.drafts import Draft
from pipeline.decode.engine import generate
from pipeline.decode.sampling import SamplingParams
from pipeline.core.device import resolve_device
from pipeline.speculation.expected_rounds import round_chain
from pipeline.speculation.lossless import lossless_checks
from pipeline.speculation.prompts import acceptance_prompts
from pipeline.core.stage import StageContext, progress, read_json
from pipeline.speculation.teacher_forced import score_text


def temp_key(t: float) -> str:
    return f"{float(t):.1f}" if round(t, 1) == t else repr(float(t))


def sampling_of(cfg, t: float) -> SamplingParams:
    return SamplingParams(t, cfg.sampling.top_k, cfg.sampling.top_p)


def generate_texts(model, prompts: dict, cfg, seed: int, eos) -> dict[str, dict[str, list[int]]]:
    """temperature key -> prompt id -> the target's own output (plain decode, one per prompt)."""
    device = next(model.parameters()).device
    texts: dict[str, dict[str, list[int]]] = {}
    for ti, t in enumerate(cfg.temperatures):
        g = torch.Generator(device).manual_seed(seed * 1000 + ti)
        texts[temp_key(t)] = {
            pid: generate(model, torch.tensor([ids], device=device), cfg.max_new_tokens, sampling=sampling_of(cfg, t),
                          generator=g, eos_token_id=eos).tokens
            for rows in prompts.values() for pid, ids in rows}
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
    slices: dict[str, dict] = {}
    greedy_runs: dict[int, dict] = {}
    for ti, t in enumerate(cfg.temperatures):
        sampling, key = sampling_of(cfg, t), temp_key(t)
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
                                                   sampling.greedy, cfg.confidence, seed)
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


# ---------------------------------------------------------------- the stage


def run(ctx: StageContext) -> None:
    from pipeline.variants.schemes import load_variant

    cfg = ctx.config.acceptance
    device = resolve_device(ctx.config.device)
    targets = cfg.targets or [ctx.config.quantize.reference]
    # Every B from 2 to the largest speculative batch size: the serving simulation's running batch
    # takes every size in between, and draws its rounds' n_min from the chain at that B.
    batch_sizes = list(range(2, max([1, *map(int, ctx.config.latency.spec_batch_sizes)]) + 1))
    pairs, timings = {}, {}
    for variant in targets:
        vdir = ctx.run_dir / "variants" / variant
        vmeta = read_json(vdir / "meta.json", f"variant '{variant}' meta.json")
        model = tokenizer = prompts = texts = None
        for spec in ctx.config.drafts:
            slug = draft_slug(spec)
            dmeta = read_json(ctx.run_dir / "drafts" / slug / "meta.json", f"draft '{spec}' meta.json")
            name = f"{variant}__{slug}"
            inputs = {"variant": vmeta.get("input_hash"), "draft": dmeta.get("input_hash"),
                      "acceptance": ctx.config.section("acceptance"), "seed": ctx.config.seed, "device": str(device),
                      "spec_batch_sizes": batch_sizes}
            item = ctx.item(f"{name}.json", inputs, is_dir=False)
            pairs[name] = {"variant": variant, "draft": spec, "file": f"acceptance/{name}.json"}
            if item.fresh:
                continue
            t0 = time.time()
            if model is None:
                model, tokenizer = load_variant(vdir, device=device)
                prompts = acceptance_prompts(cfg.prompts_per_kind, tokenizer, "acceptance")
                progress(f"acceptance: {variant}: generating the texts ({sum(map(len, prompts.values()))} prompts "
                         f"x {len(cfg.temperatures)} temperatures)")
                texts = generate_texts(model, prompts, cfg, ctx.config.seed, tokenizer.eos_token_id)
                timings[f"{variant} texts"] = round(time.time() - t0, 1)
                t0 = time.time()
            progress(f"acceptance: {name}")
            draft = build_draft(spec, model, tokenizer, ctx.run_dir, device)
            result = measure_pair(model, tokenizer, draft, cfg, ctx.config.seed, prompts, texts, batch_sizes)
            item.write_json({"variant": variant, "draft": spec, "draft_slug": slug, **result})
            timings[name] = round(time.time() - t0, 1)
            for t, v in result["slices"]["all"].items():
                checks = ", ".join(f"k={k}: {c['derived']:.3f} vs {c['direct']:.3f}"
                                   f"{'' if c['agree'] else ' DISAGREE'}" for k, c in v["direct_check"].items())
                progress(f"acceptance: {name} T={t}: E[tokens/round]@k_max="
                         f"{v['expected_tokens_per_round'][str(cfg.k_max)]:.2f}; derived vs direct {checks}")
    ctx.meta["pairs"] = pairs
    ctx.meta["seconds"] = timings

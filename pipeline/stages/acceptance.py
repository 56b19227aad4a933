"""The acceptance stage: per-position acceptance and E[tokens/round] at every k, per (target, draft).

    python -m pipeline acceptance --run runs/smollm2-135m --config configs/default.yaml

For each target variant (acceptance.targets, default the reference), each temperature and each
prompt of the workload's categories (the slices; acceptance.workload: the built-in prompts,
ShareGPT or the user's file, drawn by pipeline/speculation/workload.py), the target generates its
text once with plain decoding (pipeline.decode.engine.generate; speculation is lossless, so that
text is distributed as any speculative run's, at any k and with any draft). Then, per draft (pipeline/speculation/measure.py):

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
marginal stage weights round times by), the per-prompt records, `direct_check`; `lossless`; and
`workload` (workload_summary: its name, source, seed, categories, the prompts measured with their
token lengths and reference output lengths, and how many were skipped as too long).
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

from draft_models.registry import build_draft, draft_slug
from pipeline.core.device import resolve_device
from pipeline.core.stage import StageContext, progress, read_json
from pipeline.decode.release import collect, release_caches
from pipeline.models.architecture import context_length
from pipeline.speculation.acceptance_stats import agree_mark
from pipeline.speculation.measure import generate_texts, measure_pair
from pipeline.speculation.workload import prompt_limit_inputs, workload_prompts, workload_summary
from pipeline.variants.schemes import load_variant


def _every(seconds: float, label: str):
    """on_text callback: a progress line with the time left, at most once every `seconds`."""
    start = last = time.time()

    def tick(done: int, total: int) -> None:
        nonlocal last
        now = time.time()
        if now - last >= seconds and done < total:
            last = now
            left = (now - start) / done * (total - done)
            progress(f"{label} {done}/{total}, about {left / 60:.1f} min left")
    return tick


def run(ctx: StageContext) -> None:
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
                      "spec_batch_sizes": batch_sizes, "prompt_limit": prompt_limit_inputs(ctx.config)}
            item = ctx.item(f"{name}.json", inputs, is_dir=False)
            pairs[name] = {"variant": variant, "draft": spec, "file": f"acceptance/{name}.json"}
            if item.fresh:
                continue
            t0 = time.time()
            if model is None:
                model, tokenizer = load_variant(vdir, device=device)
                prompts = workload_prompts(ctx.config, tokenizer, "acceptance",
                                           context=context_length(model))
                progress(f"acceptance: {variant}: generating the texts ({sum(map(len, prompts.values()))} prompts "
                         f"x {len(cfg.temperatures)} temperatures)")
                texts = generate_texts(model, prompts, cfg, ctx.config.seed, tokenizer.eos_token_id,
                                       on_text=_every(30.0, f"acceptance: {variant}: texts"))
                timings[f"{variant} texts"] = round(time.time() - t0, 1)
                t0 = time.time()
            progress(f"acceptance: {name}")
            draft = build_draft(spec, model, tokenizer, ctx.run_dir, device)
            result = measure_pair(model, tokenizer, draft, cfg, ctx.config.seed, prompts, texts, batch_sizes)
            release_caches(getattr(draft, "model", None))
            del draft  # a layer-skip draft holds the target's layers: it goes before the next one is built
            collect(device)
            item.write_json({"variant": variant, "draft": spec, "draft_slug": slug, **result,
                             "workload": workload_summary(prompts)})
            timings[name] = round(time.time() - t0, 1)
            for t, v in result["slices"]["all"].items():
                checks = ", ".join(f"k={k}: {c['derived']:.3f} vs {c['direct']:.3f}"
                                   f"{agree_mark(c)}" for k, c in v["direct_check"].items())
                progress(f"acceptance: {name} T={t}: E[tokens/round]@k_max="
                         f"{v['expected_tokens_per_round'][str(cfg.k_max)]:.2f}; derived vs direct {checks}")
        # Done with this variant: its memory goes back before the next one loads (pipeline/decode/release.py).
        release_caches(model)
        model = tokenizer = prompts = texts = None
        collect(device)
    ctx.meta["pairs"] = pairs
    ctx.meta["seconds"] = timings

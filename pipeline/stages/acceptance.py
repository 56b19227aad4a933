"""The acceptance stage: per-position acceptance and E[tokens/round] at every k, per (target, draft).

    python -m pipeline acceptance --run runs/smollm2-135m --config configs/default.yaml

Per target, temperature and workload prompt (pipeline/speculation/workload.py) the target writes
its text once with plain decoding; speculation is lossless, so one teacher-forced pass of target
and draft over that text gives E(k) at every k exactly (pipeline/speculation/measure.py), beside a
`direct_check` of real engine runs and the lossless checks. Writes acceptance/<variant>__<draft_slug>.json,
per slice and temperature. The derivation and intervals: docs/methods/acceptance.md; the budget's
cut of the direct check: docs/methods/budget.md.
"""
from __future__ import annotations

import math
import time

from draft_models.registry import build_draft, draft_slug, engine_specs
from pipeline.core.budget import StageBudget, fmt_s
from pipeline.core.device import resolve_device
from pipeline.core.stage import StageContext, progress, read_json
from pipeline.decode.cache import collect, release_caches
from pipeline.models.architecture import context_length
from pipeline.speculation.acceptance_stats import agree_mark
from pipeline.speculation.measure import CheckPlan, generate_texts, measure_pair
from pipeline.speculation.workload import prompt_limit_inputs, workload_prompts, workload_summary
from pipeline.stages.targets import engine_drafts, speculation_targets
from pipeline.variants.schemes import load_variant

# The stage's estimate before any pair is measured, in plain texts' time: a pair's teacher-forced
# passes cost about TF_PER_TEXT of a text each, its sampled lossless test about LOSSLESS_TEXTS texts,
# each direct run about DIRECT_PER_TEXT texts; a measured pair's own time replaces the first two. It
# is printed after ANNOUNCE_AFTER texts (the first carries the warm-up), from the fastest.
TF_PER_TEXT = 0.15
LOSSLESS_TEXTS = 6.0
DIRECT_PER_TEXT = 1.2
ANNOUNCE_AFTER = 2


def _every(seconds: float, label: str, budget: StageBudget | None = None, clock=time.time):
    """tick(done, total[, spent_s, left_s]) (measure.CheckPlan's on_progress): a progress line with
    the time left (at the rate so far unless given) and the budget's, at most once every `seconds`."""
    start = last = clock()

    def tick(done: int, total: int, spent_s: float | None = None, left_s: float | None = None) -> None:
        nonlocal last
        now = clock()
        if now - last >= seconds and done < total:
            last = now
            left = (now - start) / done * (total - done) if left_s is None else left_s
            tail = f"; budget {fmt_s(max(budget.left(), 0.0))} left" if budget is not None and budget.active else ""
            progress(f"{label} {done}/{total}, about {fmt_s(left)} left{tail}")
    return tick


class _Planner:
    """The stage's running estimate: texts per variant, then per pair its measurement (always whole)
    and its direct check, which gets an equal part of what the budget has left once every pair's
    measurement is reserved."""

    def __init__(self, budget: StageBudget, todo: dict[str, list], n_prompts: int, cfg):
        self.budget, self.todo, self.cfg = budget, todo, cfg
        self.n_prompts, self.n_texts = n_prompts, n_prompts * len(cfg.temperatures)
        self.cells = len(cfg.temperatures) * len({k for k in cfg.direct_check_k if 1 <= k <= cfg.k_max})
        self.pairs_left = sum(len(v) for v in todo.values())
        self.variants_left = len(todo)
        self.text_s: float | None = None  # mean seconds of a plain text
        self.measured: list[float] = []  # each measured pair's teacher-forced passes + lossless test
        self.announced = False

    def measurement_s(self, pairs: int, variants: int) -> float:
        per_pair = max(self.measured) if self.measured else (TF_PER_TEXT * self.n_texts + LOSSLESS_TEXTS) * self.text_s
        return variants * self.n_texts * self.text_s + pairs * per_pair

    def announce(self, first_text_s: float | None) -> None:
        """The stage's estimate, once a text's time is known (None: no text was timed)."""
        if self.announced:
            return
        self.announced = True
        if not first_text_s:
            self.budget.announce(f"{self.n_texts} texts x {self.variants_left} target(s), then "
                                 f"{self.pairs_left} pair(s)", None)
            return
        self.text_s = first_text_s
        must = self.measurement_s(self.pairs_left, self.variants_left)
        checks = self.pairs_left * self.cells * self.n_prompts * DIRECT_PER_TEXT * first_text_s
        what = (f"{self.n_texts} texts x {self.variants_left} target(s), then {self.pairs_left} pair(s): "
                f"teacher-forced passes and the lossless test (about {fmt_s(must)} in all), and the direct check "
                f"({self.cells} runs per prompt, about {fmt_s(checks)})")
        if self.budget.active:
            if must >= self.budget.seconds:
                what += ("; the measurement alone exceeds the stage's share: it runs whole, the direct check "
                         "gets what is left (likely none)")
            elif must + checks > self.budget.seconds:
                what += (f"; the direct check is cut to what fits (about {fmt_s(self.budget.seconds - must)}), "
                         "round-robin over the categories")
        self.budget.announce(what, must + checks)

    def allot(self, measured_s: float) -> float:
        """A pair's seconds for its direct check, once its measurement took measured_s."""
        self.measured.append(measured_s)
        self.pairs_left -= 1
        if not self.budget.active:
            return math.inf
        reserve = self.measurement_s(self.pairs_left, self.variants_left) if self.text_s else 0.0
        return max(self.budget.left() - reserve, 0.0) / (self.pairs_left + 1)


def run(ctx: StageContext) -> None:
    cfg = ctx.config.acceptance
    device = resolve_device(ctx.config.device)
    budget = StageBudget(ctx.config, "acceptance", run_dir=ctx.run_dir)
    targets = speculation_targets(ctx.config, ctx.run_dir)
    pairs, timings, checks = {}, {}, {}
    todo: dict[str, list] = {}  # variant -> the pairs to measure: (spec, slug, name, item)
    for variant in targets:
        vmeta = read_json(ctx.run_dir / "variants" / variant / "meta.json", f"variant '{variant}' meta.json")
        for spec in engine_drafts(engine_specs(ctx.config.drafts, "acceptance", progress if variant == targets[0] else None),
                                  variant, "acceptance", progress, reference=ctx.config.quantize.reference):
            slug = draft_slug(spec)
            dmeta = read_json(ctx.run_dir / "drafts" / slug / "meta.json", f"draft '{spec}' meta.json")
            name = f"{variant}__{slug}"
            # budget_s: a budget may have cut the pair's direct check.
            inputs = {"variant": vmeta.get("input_hash"), "draft": dmeta.get("input_hash"),
                      "acceptance": ctx.config.section("acceptance"), "confidence": ctx.config.confidence,
                      "seed": ctx.config.seed, "device": str(device), "prompt_limit": prompt_limit_inputs(ctx.config),
                      "budget_s": budget.seconds}
            item = ctx.item(f"{name}.json", inputs, is_dir=False)
            pairs[name] = {"variant": variant, "draft": spec, "file": f"acceptance/{name}.json"}
            if not item.fresh:
                todo.setdefault(variant, []).append((spec, slug, name, item))
    planner = None
    for variant, stale in todo.items():
        t0 = time.time()
        model, tokenizer = load_variant(ctx.run_dir / "variants" / variant, device=device)
        prompts = workload_prompts(ctx.config, tokenizer, "acceptance", context=context_length(model))
        n_prompts = sum(map(len, prompts.values()))
        planner = planner or _Planner(budget, todo, n_prompts, cfg)
        progress(f"acceptance: {variant}: generating the texts ({n_prompts} prompts "
                 f"x {len(cfg.temperatures)} temperatures)")
        tick = _every(30.0, f"acceptance: {variant}: texts", budget)
        text_s: dict = {}

        def on_text(done: int, total: int) -> None:
            if done == min(ANNOUNCE_AFTER, total):
                planner.announce(min((s for by_pid in text_s.values() for s in by_pid.values()), default=None))
            tick(done, total)
        texts = generate_texts(model, prompts, cfg, ctx.config.seed, tokenizer.eos_token_id, on_text=on_text,
                               seconds=text_s)
        timings[f"{variant} texts"] = round(time.time() - t0, 1)
        all_text_s = [s for by_pid in text_s.values() for s in by_pid.values()]
        planner.announce(None)  # no-op once announced; else (no text was timed) the plan without times
        if all_text_s:
            planner.text_s = sum(all_text_s) / len(all_text_s)
        planner.variants_left -= 1
        for spec, slug, name, item in stale:
            t0 = time.time()
            progress(f"acceptance: {name}")
            draft = build_draft(spec, model, tokenizer, ctx.run_dir, device)
            plan = CheckPlan(allot=planner.allot, budgeted=budget.active, text_s=text_s or None,
                             on_progress=_every(30.0, f"acceptance: {name}: direct check, runs", budget))
            result = measure_pair(model, tokenizer, draft, cfg, ctx.config.seed, prompts, texts, plan=plan,
                                  confidence=ctx.config.confidence)
            release_caches(getattr(draft, "model", None))
            del draft  # a layer-skip draft holds the target's layers: it goes before the next one is built
            collect(device)
            item.write_json({"variant": variant, "draft": spec, "draft_slug": slug, **result,
                             "workload": workload_summary(prompts)})
            timings[name] = round(time.time() - t0, 1)
            checks[name] = _record_check(name, plan.record, budget)
            for t, v in result["slices"]["all"].items():
                line = ", ".join(f"k={k}: {c['derived']:.3f} vs {c['direct']:.3f}"
                                 f"{agree_mark(c)}" for k, c in v["direct_check"].items()) or (
                    "not run (budget)" if (result.get("direct_check_plan") or {}).get("stopped") else "-")
                progress(f"acceptance: {name} T={t}: E[tokens/round]@k_max="
                         f"{v['expected_tokens_per_round'][str(cfg.k_max)]:.2f}; derived vs direct {line}")
        release_caches(model)
        model = tokenizer = prompts = texts = None
        collect(device)
    ctx.meta["pairs"] = pairs
    ctx.meta["seconds"] = timings
    ctx.meta["direct_check"] = checks
    ctx.meta["budget"] = budget.to_json()


def _record_check(name: str, record: dict, budget: StageBudget) -> dict:
    """meta.json's account of one pair's direct check; a cut one is also a budget skip."""
    if not record:
        return {}
    run, skipped = record.get("prompts_run", []), record.get("prompts_skipped", [])
    out = {"measured_s": round(record.get("measured_s", 0.0), 1),
           "allotted_s": None if record.get("allotted_s") is None else round(record["allotted_s"], 1),
           "spent_s": round(record.get("spent_s", 0.0), 1), "runs_per_prompt": record.get("runs_per_prompt"),
           "prompts_run": len(run), "prompts_skipped": len(skipped), "stopped": record.get("stopped")}
    if skipped:
        nxt = record.get("next_prompt_s")
        budget.skip(f"{name}: direct check on {len(skipped)} of {len(run) + len(skipped)} prompts "
                    f"({', '.join(skipped)})",
                    f"budget: {fmt_s(out['allotted_s'])} for this pair's checks, {fmt_s(out['spent_s'])} spent, "
                    f"the next prompt's {record.get('runs_per_prompt')} runs about {fmt_s(nxt)}")
    return out

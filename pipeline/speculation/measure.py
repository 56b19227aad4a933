"""Measuring one (target, draft) pair's acceptance: the target's texts, the teacher-forced round
chain on them, direct engine runs beside it, the lossless checks.

    from pipeline.speculation.measure import generate_texts, measure_pair
    texts = generate_texts(model, prompts, cfg.acceptance, seed, tokenizer.eos_token_id)
    result = measure_pair(model, tokenizer, draft, cfg.acceptance, seed, prompts, texts, confidence=cfg.confidence)

The measurement always runs whole; the direct check beside it may be cut by a time budget
(CheckPlan) but keeps its first prompt. Method: docs/methods/acceptance.md, budget.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.decode.drafts import Draft
from pipeline.decode.engine import generate
from pipeline.decode.sampling import SamplingParams
from pipeline.speculation.acceptance_stats import direct_check, prompt_record, summarize_slice
from pipeline.speculation.expected_rounds import round_chain
from pipeline.speculation.lossless import lossless_checks, sampling_check
from pipeline.speculation.teacher_forced import score_text
from pipeline.speculation.workload import interleave

# A direct run is planned at this many times its prompt's plain text until one has been timed.
PRIOR_DIRECT_PER_TEXT_S = 2.0
# Prompts a budgeted direct check runs whatever its allotment (a pair checked on none is unchecked).
MIN_DIRECT_PROMPTS = 1


def temp_key(t: float) -> str:
    """A temperature as a JSON key: "0.0", "0.7" (one decimal when that is exact, else repr)."""
    return f"{float(t):.1f}" if round(t, 1) == t else repr(float(t))


def sampling_of(sampling_cfg, t: float) -> SamplingParams:
    """The engine's sampling at temperature t with acceptance.sampling's top-k / top-p (the
    acceptance and latency stages both build it here)."""
    return SamplingParams(t, sampling_cfg.top_k, sampling_cfg.top_p)


def generate_texts(model, prompts: dict, cfg, seed: int, eos, on_text=None,
                   seconds: dict | None = None) -> dict[str, dict[str, list[int]]]:
    """temperature key -> prompt id -> the target's plain output. on_text(done, total) after each;
    `seconds`, if given, gets each text's wall-clock seconds, keyed like the result."""
    device = next(model.parameters()).device
    texts: dict[str, dict[str, list[int]]] = {}
    total = len(cfg.temperatures) * sum(len(rows) for rows in prompts.values())
    done = 0
    for ti, t in enumerate(cfg.temperatures):
        g = torch.Generator(device).manual_seed(seed * 1000 + ti)
        out = texts[temp_key(t)] = {}
        for rows in prompts.values():
            for pid, ids in rows:
                t0 = time.perf_counter()
                out[pid] = generate(model, torch.tensor([ids], device=device), cfg.max_new_tokens,
                                    sampling=sampling_of(cfg.sampling, t), generator=g, eos_token_id=eos).tokens
                if seconds is not None:
                    seconds.setdefault(temp_key(t), {})[pid] = time.perf_counter() - t0
                done += 1
                if on_text is not None:
                    on_text(done, total)
    return texts


def direct_run(model, draft: Draft, ids: list[int], k: int, sampling: SamplingParams, max_new_tokens: int,
               eos, generator) -> dict:
    """{"tokens" (emitted by rounds), "rounds", "output"} of one real run at k."""
    device = next(model.parameters()).device
    res = generate(model, torch.tensor([ids], device=device), max_new_tokens, draft=draft, k=k,
                   sampling=sampling, generator=generator, eos_token_id=eos)
    return {"tokens": len(res.tokens) - 1, "rounds": len(res.rounds), "output": res.tokens}


@dataclass
class CheckPlan:
    """How much of a pair's check work (direct runs, or the lossless check's own greedy pair) runs.
    allot(measured_s) -> seconds the checks may take (inf: all, cell by cell). budgeted: prompts
    round-robin over the categories, the sampled lossless test inside the measurement. text_s:
    temperature key -> prompt id -> plain text seconds (costs are planned from them).
    on_progress(done runs, total runs, spent_s, left_s or None); `record` gets what ran."""
    allot: Callable[[float], float] = lambda measured_s: math.inf
    budgeted: bool = False
    text_s: dict | None = None
    clock: Callable[[], float] = time.perf_counter
    on_progress: Callable | None = None
    record: dict = field(default_factory=dict)


def planned_runs(cells: list[tuple[str, str, Callable]], order: list[tuple[str, list[int]]], allot_s: float,
                 plan: CheckPlan) -> tuple[dict[str, dict[str, dict]], dict]:
    """Every prompt of `order` through every cell (name, temperature key, run(ids) -> result):
    cell by cell when allot_s is infinite, else prompt by prompt while the next prompt's estimated
    cost fits (the first MIN_DIRECT_PROMPTS always). Returns (cell -> prompt id -> result, what ran)."""
    known = plan.text_s is not None and all(key in plan.text_s for _, key, _ in cells)
    spent, weighed = [0.0] * len(cells), [0.0] * len(cells)
    out: dict[str, dict[str, dict]] = {name: {} for name, _, _ in cells}
    total = len(cells) * len(order)
    used = 0.0

    def weight(j: int, pid: str) -> float:
        return plan.text_s[cells[j][1]].get(pid, 1.0) if known else 1.0

    def rate(j: int) -> float:
        if weighed[j] > 0:
            return spent[j] / weighed[j]
        seen = [s / w for s, w in zip(spent, weighed) if w > 0]
        return max(seen) if seen else PRIOR_DIRECT_PER_TEXT_S if known else 0.0

    def cost(pid: str) -> float:
        return sum(rate(j) * weight(j, pid) for j in range(len(cells)))

    def one(j: int, pid: str, ids: list[int]) -> None:
        nonlocal used
        t0 = plan.clock()
        out[cells[j][0]][pid] = cells[j][2](ids)
        dt = plan.clock() - t0
        spent[j] += dt
        weighed[j] += weight(j, pid)
        used += dt

    ran, stopped, next_cost = [], None, None
    if not math.isfinite(allot_s):
        for j in range(len(cells)):
            for i, (pid, ids) in enumerate(order):
                one(j, pid, ids)
                if plan.on_progress is not None:
                    plan.on_progress(j * len(order) + i + 1, total, used, None)
        ran = [pid for pid, _ in order] if cells else []
    else:
        for i, (pid, ids) in enumerate(order if cells else []):
            next_cost = cost(pid)
            if len(ran) >= MIN_DIRECT_PROMPTS and (allot_s <= 0 or used + next_cost > allot_s):
                stopped = "budget"
                break
            for j in range(len(cells)):
                one(j, pid, ids)
            ran.append(pid)
            next_cost = None
            if plan.on_progress is not None:
                plan.on_progress((i + 1) * len(cells), total, used, sum(cost(p) for p, _ in order[i + 1:]))
    done = set(ran)
    skipped = [pid for pid, _ in order if pid not in done] if cells else []
    return out, {"prompts_run": ran, "prompts_skipped": skipped, "stopped": stopped, "spent_s": used,
                 "next_prompt_s": next_cost}


def measure_pair(model, tokenizer, draft: Draft, cfg, seed: int, prompts: dict, texts: dict,
                 plan: CheckPlan | None = None, confidence: float = 0.95) -> dict:
    """The acceptance JSON for one pair (without the variant/draft names); plan: None = all of it."""
    plan = plan or CheckPlan()
    k_max, eos = cfg.k_max, tokenizer.eos_token_id
    check_ks = sorted({k for k in cfg.direct_check_k if 1 <= k <= k_max})
    device = next(model.parameters()).device
    # Greedy direct runs reproduce the texts exactly only in full precision (lossless.py says why).
    exact = next(model.parameters()).dtype in (torch.float32, torch.float64)
    temps = [(temp_key(t), sampling_of(cfg.sampling, t)) for t in cfg.temperatures]
    start = plan.clock()
    records: dict[str, dict[str, dict]] = {}
    for key, sampling in temps:
        records[key] = {}
        for kind, rows in prompts.items():
            for pid, ids in rows:
                text = score_text(model, draft, ids, texts[key][pid], sampling, k_max, cfg.max_new_tokens)
                records[key][pid] = prompt_record(pid, kind, text,
                                                  {k: round_chain(text, k) for k in range(1, k_max + 1)})
    sampled = sampling_check(model, prompts, draft, cfg, seed) if plan.budgeted else None
    measured_s = plan.clock() - start
    allot_s = plan.allot(measured_s)

    # The check: direct runs at each (temperature, k), each cell with its own seeded generator.
    order = interleave(prompts) if plan.budgeted else [row for rows in prompts.values() for row in rows]
    cells = []
    for ti, (key, sampling) in enumerate(temps):
        for k in check_ks:
            g = torch.Generator(device).manual_seed(seed * 1000 + 100 * k + ti + 17)
            cells.append((f"{key} k={k}", key,
                          lambda ids, k=k, s=sampling, g=g: direct_run(model, draft, ids, k, s, cfg.max_new_tokens,
                                                                       eos, g)))
    runs, ran = planned_runs(cells, order, allot_s, plan)
    done = set(ran["prompts_run"])
    greedy_runs = {k: runs[f"{key} k={k}"] for key, s in temps for k in check_ks if s.greedy}
    if "0.0" in texts and greedy_runs:
        greedy_plain = texts["0.0"]
    else:  # no greedy temperature (or no direct k) configured: the lossless check runs its own pair
        plain_key = temps[0][0]
        own = [("plain", plain_key, lambda ids: {"output": generate(
                   model, torch.tensor([ids], device=device), cfg.max_new_tokens, eos_token_id=eos).tokens}),
               ("k=1", plain_key, lambda ids: direct_run(model, draft, ids, 1, SamplingParams(0.0),
                                                         cfg.max_new_tokens, eos, None))]
        pair, own_ran = planned_runs(own, order, allot_s - ran["spent_s"], plan)
        greedy_plain = {pid: r["output"] for pid, r in pair["plain"].items()}
        greedy_runs = {1: pair["k=1"]}
        ran["spent_s"] += own_ran["spent_s"]
        ran["lossless_pair"] = own_ran

    slices: dict[str, dict] = {}
    groups = {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()}
    groups["all"] = [pid for rows in prompts.values() for pid, _ in rows]
    for key, sampling in temps:
        for name, pids in groups.items():
            if not pids:
                continue
            recs = [records[key][p] for p in pids]
            summary = summarize_slice(recs, k_max, confidence)
            run_pids = [p for p in pids if p in done]
            skipped = [p for p in pids if p not in done]
            check = direct_check([records[key][p] for p in run_pids],
                                 {k: [runs[f"{key} k={k}"][p] for p in run_pids] for k in check_ks},
                                 sampling.greedy, confidence, exact=exact) if run_pids else {}
            for entry in check.values():
                entry.update({"prompts_run": run_pids, "prompts_skipped": skipped,
                              "stopped": ran["stopped"] if skipped else None})
            summary["direct_check"] = check
            slices.setdefault(name, {})[key] = summary
    plan.record.update({"measured_s": measured_s, "allotted_s": allot_s if math.isfinite(allot_s) else None,
                        "runs_per_prompt": len(cells), **ran})
    return {"k_max": k_max, "method": "teacher-forced round chain (pipeline/speculation/expected_rounds.py)",
            "direct_check_k": check_ks, "max_new_tokens": cfg.max_new_tokens,
            "prompts": {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()},
            "slices": slices,
            "direct_check_plan": {"order": "round-robin over the categories" if plan.budgeted
                                  else "category by category",
                                  "runs_per_prompt": len(cells), "prompts_run": ran["prompts_run"],
                                  "prompts_skipped": ran["prompts_skipped"], "stopped": ran["stopped"]},
            "lossless": lossless_checks(model, prompts, draft, cfg, seed, greedy_plain, greedy_runs, sampled)}

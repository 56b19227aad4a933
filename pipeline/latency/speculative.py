"""Speculative round times of one (target, draft) pair, on the acceptance prompts and temperatures.

    from pipeline.latency.speculative import speculative_pair
    out = speculative_pair("bf16", "ngram", model, draft, prompts, lat, acc, device, confidence, seed)

ms/token(k) = T_round(k) / E(k) is only a like-with-like join when T_round is measured on the
content E(k) comes from. What a round costs depends on the content through one number: how many
tokens the draft proposed (a model draft always k, less only near max_new_tokens; prompt lookup
anything from 0 = a plain step to k). So this module times rounds on the acceptance stage's own
prompts and temperatures at every k = 1..k_max and plain decoding (k = 0) in each repeat, and
reports the round time as a function of the drafted count d, per temperature:
`round_ms_by_drafted[d]` = per repeat, the mean time of the rounds that drafted d tokens (any k:
a round that drafted d does the same work whichever k was asked). The marginal stage weights it by
the acceptance stage's distribution of drafted counts at each k, per slice and temperature.

Runs use no EOS (every run emits latency.new_tokens tokens, so plain ms/token is over a fixed
count). Every run gets a static cache of one length, the memory plan's for the longest prompt
(pipeline/latency/plan.py), so every timed run attends the same number of cache slots and a
compiled step (latency.compile) has one shape per width for every prompt. Each row (and plain
decoding, `plain_run_mode`) records how its steps really ran, from the compile record, and each
speedup whether both sides ran the same way (`like_with_like`, pipeline/latency/modes.py).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.core.stage import StageError, progress
from pipeline.decode.cache import CachedModel
from pipeline.decode.compiled import not_compiled
from pipeline.decode.engine import generate
from pipeline.latency.modes import calls_before, compare, merge_ran, run_mode, steps_ran
from pipeline.latency.plan import draft_label, speculative_phase, speculative_shapes, why_not_compiled
from pipeline.models.kernels import device_name, quantized_kernels
from pipeline.speculation.measure import sampling_of, temp_key
from pipeline.stats.intervals import median_ci


def one_repeat(model, draft, prompts: dict, temperatures: list[float], sampling_cfg, ks: list[int],
               new_tokens: int, seed: int, cache_len: int | None = None, session=None) -> dict:
    """temperature key -> {k: {"decode_s", "tokens", "rounds": [(k_round, drafted, emitted, round_s,
    draft_s, verify_s)], "ran": the step shapes used and how each ran}}, k = 0 being plain
    decoding, over every prompt (`session`: the compile session, for "ran")."""
    device = next(model.parameters()).device
    out = {}
    for ti, t in enumerate(temperatures):
        sampling = sampling_of(sampling_cfg, t)
        g = torch.Generator(device).manual_seed(seed * 7919 + ti)
        per_k = {}
        for k in [0, *ks]:
            fig = {"decode_s": 0.0, "tokens": 0, "rounds": []}
            before = calls_before(session)
            for rows in prompts.values():
                for _, ids in rows:
                    res = generate(model, torch.tensor([ids], device=device), new_tokens, draft=draft if k else None,
                                   k=k, sampling=sampling, generator=g, cache_len=cache_len)
                    fig["decode_s"] += res.decode_s
                    fig["tokens"] += len(res.tokens) - 1
                    fig["rounds"] += [(r.k, r.drafted, r.emitted, r.round_s, r.draft_s, r.verify_s) for r in res.rounds]
            fig["ran"] = steps_ran(session, before)
            per_k[k] = fig
        out[temp_key(t)] = per_k
    return out


def round_time_block(times_per_repeat: list[list[float]]) -> dict:
    """{"samples": per repeat the mean of its round times (None where a repeat had none),
    "rounds": how many rounds in all}: one entry of round_ms_by_drafted (here, by drafted count)
    and of round_ms_by_width (pipeline/latency/batched.py), which
    pipeline.serving.marginal.by_drafted_matrix reads."""
    return {"samples": [float(np.mean(t)) if t else None for t in times_per_repeat],
            "rounds": sum(len(t) for t in times_per_repeat)}


def _by_drafted(reps: list[dict], k_max: int, part: int) -> dict:
    """d -> round_time_block of the rounds that drafted d (ms), over every k > 0."""
    return {str(d): round_time_block([[r[part] * 1e3 for k, fig in rep.items() if k for r in fig["rounds"] if r[1] == d]
                                      for rep in reps])
            for d in range(k_max + 1)}


def summarize_temperature(reps: list[dict], ks: list[int], confidence: float, seed: int,
                          why_eager: str | None = None) -> dict:
    """One temperature's figures over repeats (reps: one_repeat(...)[temperature] per repeat).
    Each k's row carries its `run_mode` and whether its speedup compares like with like
    (pipeline/latency/modes.py)."""
    k_max = max(ks)
    plain = [rep[0]["decode_s"] / max(rep[0]["tokens"], 1) * 1e3 for rep in reps]
    modes = {k: run_mode(merge_ran(*(rep[k].get("ran") for rep in reps)), why_eager=why_eager) for k in [0, *ks]}
    rows = []
    for k in ks:
        per_rep = []
        for rep in reps:
            rounds = rep[k]["rounds"]
            n = max(len(rounds), 1)
            draft_s, verify_s, round_s = (sum(r[i] for r in rounds) for i in (4, 5, 3))
            per_rep.append({"ms_per_token": rep[k]["decode_s"] / max(rep[k]["tokens"], 1) * 1e3,
                            "round_ms": round_s / n * 1e3, "draft_ms": draft_s / n * 1e3,
                            "verify_ms": verify_s / n * 1e3, "overhead_ms": (round_s - draft_s - verify_s) / n * 1e3,
                            "rounds": len(rounds), "emitted": sum(r[2] for r in rounds)})
        col = {key: [x[key] for x in per_rep] for key in per_rep[0]}
        ms = median_ci(col["ms_per_token"], confidence, seed)
        rows.append({
            "k": k,
            **{key: median_ci(col[key], confidence, seed) for key in ("draft_ms", "verify_ms", "overhead_ms", "round_ms")},
            "tokens_per_round": sum(col["emitted"]) / max(sum(col["rounds"]), 1),
            "rounds": int(sum(col["rounds"])),
            "ms_per_token": ms,
            "tokens_per_s": 1e3 / ms["median"],
            # Paired: plain and speculative of the same repeat, so drift between repeats cancels.
            "speedup": median_ci([p / s for p, s in zip(plain, col["ms_per_token"])], confidence, seed),
            "run_mode": modes[k], **compare(modes[k], modes[0], ("speculative", "plain")),
        })
    return {"plain_ms_per_token": median_ci(plain, confidence, seed), "plain_run_mode": modes[0],
            "round_ms_by_drafted": _by_drafted(reps, k_max, 3),
            "draft_ms_by_drafted": _by_drafted(reps, k_max, 4),
            "verify_ms_by_drafted": _by_drafted(reps, k_max, 5),
            "rows": rows}


def speculative_pair(target: str, draft_spec: str, model, draft, prompts: dict, lat, acc, device: torch.device,
                     confidence: float, seed: int, ks: list[int], session=None) -> dict:
    """The latency/<target>__<draft>.json document (prompts: kind -> [(prompt id, ids)]). With a
    compile `session` (pipeline.decode.compiled), this pair's step shapes compile before any timed run."""
    longest = max(len(ids) for rows in prompts.values() for _, ids in rows)
    plan, budget = speculative_phase(model, {draft_spec: draft}, lat, max(ks), longest, device)
    if plan.dropped:
        raise StageError(f"latency: {target} + {draft_spec}: the speculative cell does not fit: "
                         f"{plan.dropped[0]['reason']}")
    length = plan.cells[0].cache_len
    has_model = getattr(draft, "model", None) is not None
    if session is not None:
        labels = [draft_label(draft_spec)] if has_model else []
        session.expect(speculative_shapes(length, max(ks), labels))
        made = session.warm(model) + (session.warm(draft.model, slot="draft") if labels else 0)
        progress(f"latency: {target} + {draft_spec}: compiled {made} step graphs")
    for w in range(lat.warmup):
        one_repeat(model, draft, prompts, acc.temperatures, acc.sampling, ks, lat.new_tokens, seed + 1000 + w, length)
    reps = []
    for r in range(lat.repeats):
        progress(f"latency: {target} + {draft_spec}: repeat {r + 1}/{lat.repeats}")
        reps.append(one_repeat(model, draft, prompts, acc.temperatures, acc.sampling, ks, lat.new_tokens, seed + r,
                               length, session=session))
    if has_model:
        CachedModel.release(draft.model)  # the next pair's draft gets its own
    why_eager = why_not_compiled(lat, device) or "requested; this call was given no compile session"
    by_temp = {t: summarize_temperature([rep[t] for rep in reps], ks, confidence, seed, why_eager) for t in reps[0]}
    primary = min(by_temp, key=float)  # greedy when measured: the top-level figures (older readers)
    return {"variant": target, "draft": draft_spec, "device": str(device), "device_name": device_name(device),
            "prompts": {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()},
            "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats,
            "timing_unit": "repeat (every prompt, temperature and k once)",
            "primary_temperature": primary,
            "plain_ms_per_token": by_temp[primary]["plain_ms_per_token"], "rows": by_temp[primary]["rows"],
            "by_temperature": by_temp, "cache_len": length,
            "memory_plan": {**plan.to_json(), "budget": budget},
            "compile": session.record() if session is not None else not_compiled(
                why_not_compiled(lat, device) or "requested; this call was given no compile session"),
            "kernels": quantized_kernels(model),
            "draft_kernels": quantized_kernels(draft.model) if has_model else None}

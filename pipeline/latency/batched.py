"""Speculative decoding under batching, measured: round time and ms/token per (batch size, k), and
a closed loop that the serving simulation (pipeline/serving/simulation.py) is checked against.

    python -m pipeline latency --run runs/smollm2-135m --config configs/default.yaml

The latency stage calls `run_batched` after its own figures and writes
`latency/batched/<variant>__<draft_slug>.json`: `cells` per (B, k), `round_ms_by_width` (what the
marginal stage weights by the acceptance texts' verify widths) and `closed_loop` waves. Every run
at a batch size uses one static cache length, so with latency.compile every shape is compiled
before timing and each cell records its `run_mode` (pipeline/latency/modes.py). What the cells
hold, and how repeats and waves stop: docs/methods/batching.md.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pipeline.core.budget import fmt_s
from pipeline.core.stage import StageError, progress
from pipeline.decode.batched import generate_batched
from pipeline.decode.compiled import not_compiled
from pipeline.decode.engine import generate
from pipeline.latency.memory import cache_len
from pipeline.latency.modes import calls_before, compare, merge_ran, run_mode, steps_ran
from pipeline.latency.plan import batched_shapes, draft_label, why_not_compiled
from pipeline.latency.speculative import MIN_TIMING_REPEATS, WARMUP_TOKENS, Repeats, round_time_block, settle_widths
from pipeline.speculation.prompts import KINDS, PROMPTS, prompt_ids
from pipeline.stats.intervals import median_ci


def batch_prompts(tokenizer, batch: int, offset: int = 0, rows: list[list[int]] | None = None) -> torch.Tensor:
    """[B, T]: B distinct prompts (starting at prompt `offset`, from the start again past the
    end), each cut from the left to the shortest one's length, so every row keeps its own
    chat-template ending. `rows`: the workload's prompts as token ids, categories in turn (the
    latency stage's; pipeline/speculation/workload.py); None = the built-in prompts, kinds in turn."""
    if rows:
        rows = [list(rows[(offset + j) % len(rows)]) for j in range(batch)]
    else:
        texts = [t for i in range(max(len(v) for v in PROMPTS.values())) for kind in KINDS
                 for t in PROMPTS[kind][i:i + 1]]
        rows = [prompt_ids(tokenizer, texts[(offset + j) % len(texts)]) for j in range(batch)]
    length = min(len(r) for r in rows)
    return torch.tensor([r[len(r) - length:] for r in rows], dtype=torch.long)


def round_width(r) -> int:
    """The verify width of one round record of either kind: the most any row's draft offered
    (0: nothing offered, the round was a plain step)."""
    drafted = r.drafted
    return int(max(drafted, default=0)) if isinstance(drafted, (list, tuple)) else int(drafted)


def round_tokens(r) -> tuple[float, float, int]:
    """(tokens kept per active row, tokens per-row offsets would keep per active row, accepted
    tokens thrown away) for one round record of either kind (B = 1 RoundRecord: nothing lost)."""
    if hasattr(r, "kept_tokens"):
        active = max(sum(r.active), 1)
        return r.kept + 1, r.ragged_tokens / active, r.thrown_away
    return r.accepted + 1, r.accepted + 1, 0


def run_generate(model, ids: torch.Tensor, new_tokens: int, draft, k: int, cache_len: int | None = None):
    """Plain (k = 0) or speculative decoding of ids [B, T] on a cache of exactly `cache_len`
    positions (None: the engine's own pooled length). B > 1 speculative goes to the batched
    engine directly, which takes the cache length (engine.generate does not pass it on)."""
    if k and ids.shape[0] > 1:
        return generate_batched(model, ids, new_tokens, draft, k, cache_len=cache_len)
    return generate(model, ids, new_tokens, draft=draft if k else None, k=k, cache_len=cache_len)


def batched_repeat(model, draft, prompts: dict[int, torch.Tensor], ks: list[int], new_tokens: int,
                   session=None, cache_lens: dict[int, int] | None = None) -> dict:
    """One repeat: at every B, plain decode then speculative decode at every k on the same B
    prompts. Returns B -> k -> figures (k = 0 is plain); a speculative k's figures carry
    `by_width`, width -> the times (ms) of its rounds of that verify width; every figure carries
    `ran`, the step shapes its run used and how each ran (pipeline/latency/modes.py steps_ran)."""
    out: dict[int, dict[int, dict]] = {}
    for b, ids in prompts.items():
        out[b] = {}
        for k in [0, *ks]:
            before = calls_before(session)
            res = run_generate(model, ids, new_tokens, draft, k, (cache_lens or {}).get(b))
            n = len(res.batch_tokens[0])
            if n != new_tokens:
                raise StageError(f"latency: the engine produced {n} tokens at B={b}, asked {new_tokens}")
            fig = {"ms_per_token": res.decode_s / (n - 1) * 1e3, "prefill_ms": res.prefill_s * 1e3,
                   "ran": steps_ran(session, before)}
            if k:
                # Rounds near max_new_tokens are shortened; T_round(k) uses the rounds that drafted k.
                full = [r for r in res.rounds if r.k == k] or res.rounds
                toks = np.array([round_tokens(r) for r in full], dtype=float)  # [rounds, 3]
                fig.update(round_ms=float(np.mean([r.round_s for r in full])) * 1e3,
                           draft_ms=float(np.mean([r.draft_s for r in full])) * 1e3,
                           verify_ms=float(np.mean([r.verify_s for r in full])) * 1e3,
                           tokens_per_round=float(toks[:, 0].mean()),
                           ragged_tokens_per_round=float(toks[:, 1].mean()),
                           thrown_away_per_round=float(toks[:, 2].mean()), rounds=len(full),
                           mean_width=float(np.mean([round_width(r) for r in res.rounds])) if res.rounds else 0.0,
                           by_width={})
                for r in res.rounds:
                    fig["by_width"].setdefault(round_width(r), []).append(r.round_s * 1e3)
            out[b][k] = fig
    return out


def _mode(reps: list[dict], b: int, k: int, why_eager: str | None) -> dict:
    """The run mode of cell (b, k) over every repeat's runs."""
    return run_mode(merge_ran(*(rep[b][k].get("ran") for rep in reps)), why_eager=why_eager)


def batched_cells(reps: list[dict], batch_sizes: list[int], ks: list[int], confidence: float, seed: int,
                  why_eager: str | None = None) -> list[dict]:
    """why_eager: why no step was compiled where no session ran them (compile off, ...)."""
    cells = []
    for b in batch_sizes:
        plain = [rep[b][0]["ms_per_token"] for rep in reps]
        plain_mode = _mode(reps, b, 0, why_eager)
        cells.append({"batch": b, "k": 0, "ms_per_token": median_ci(plain, confidence, seed),
                      "prefill_ms": median_ci([rep[b][0]["prefill_ms"] for rep in reps], confidence, seed),
                      "run_mode": plain_mode})
        for k in ks:
            col = {key: [rep[b][k][key] for rep in reps] for key in reps[0][b][k] if key not in ("by_width", "ran")}
            mode = _mode(reps, b, k, why_eager)
            kept, ragged = float(np.mean(col["tokens_per_round"])), float(np.mean(col["ragged_tokens_per_round"]))
            ms = median_ci(col["ms_per_token"], confidence, seed)
            cells.append({
                "batch": b, "k": k,
                **{key: median_ci(col[key], confidence, seed)
                   for key in ("round_ms", "draft_ms", "verify_ms", "prefill_ms")},
                "ms_per_token": ms,
                "tokens_per_s": b * 1e3 / ms["median"],
                # Paired: plain and speculative of the same repeat and the same B prompts.
                "speedup": median_ci([p / s for p, s in zip(plain, col["ms_per_token"])], confidence, seed),
                "tokens_per_round": kept,  # per row, synchronised scheme (n_min + 1)
                "ragged_tokens_per_round": ragged,  # per row, had each row kept n_b + 1
                "thrown_away_per_round": float(np.mean(col["thrown_away_per_round"])),  # whole batch
                "thrown_away_fraction": 1.0 - kept / ragged if ragged else 0.0,
                "rounds": int(sum(col["rounds"])),
                "mean_width": float(np.mean(col["mean_width"])),  # these B prompts' verify width
                "run_mode": mode,
                # The speedup compares this cell with the plain one: only like with like counts.
                **compare(mode, plain_mode, ("speculative", "plain")),
            })
    return cells


def by_width(reps: list[dict], batch_sizes: list[int], ks: list[int]) -> dict:
    """B -> width -> round_time_block (pipeline/latency/speculative.py) of every k's rounds of that
    verify width (ms)."""
    out = {}
    for b in batch_sizes:
        widths = sorted({w for rep in reps for k in ks for w in rep[b][k].get("by_width", {})})
        out[str(b)] = {str(w): round_time_block([[t for k in ks for t in rep[b][k].get("by_width", {}).get(w, [])]
                                                 for rep in reps])
                       for w in widths}
    return out


def batched_widths(reps: list[dict], batch_sizes: list[int], ks: list[int], confidence: float,
                   seed: int) -> dict[str, float]:
    """SETTLE_RULE's figures of a pair's batched cells over the repeats so far: at every B, plain
    ms/token and the round time of every verify width that carries rounds (round_ms_by_width)."""
    out = {}
    for b in batch_sizes:
        counts = {k: {} for k in ks}
        for rep in reps:
            for k in ks:
                for w, times in rep[b][k].get("by_width", {}).items():
                    counts[k][w] = counts[k].get(w, 0) + len(times)
        by_w = {int(w): block["samples"] for w, block in by_width(reps, [b], ks)[str(b)].items()}
        out.update(settle_widths([rep[b][0]["ms_per_token"] for rep in reps], by_w, counts, confidence, seed,
                                 label=f"B={b} ", unit="w"))
    return out


def closed_loop_wave(model, draft, tokenizer, batch: int, k: int, wave: int, new_tokens: int,
                     session=None, cache_len: int | None = None, rows: list[list[int]] | None = None) -> dict:
    """One wave of `batch` requests (prompts from `wave * batch` on), plain then speculative."""
    ids = batch_prompts(tokenizer, batch, offset=wave * batch, rows=rows)
    out = {}
    for mode in ("plain", "speculative"):
        before = calls_before(session)
        res = run_generate(model, ids, new_tokens, draft, k if mode == "speculative" else 0, cache_len)
        n = len(res.batch_tokens[0])
        out[mode] = {"wave": wave, "prompt_tokens": int(ids.shape[1]), "ttft_ms": res.prefill_s * 1e3,
                     "tpot_ms": res.decode_s / (n - 1) * 1e3, "output_tokens": n,
                     "ran": steps_ran(session, before)}
        if mode == "speculative":
            drafted = [r for r in res.rounds if r.k > 0]
            full = [r for r in res.rounds if r.k == k]
            out[mode].update(
                tokens_per_round=float(np.mean([round_tokens(r)[0] for r in res.rounds])),
                # The rounds as they ran, for the simulation's replay (pipeline/serving/batching.py validate):
                # tokens kept per row in every round that drafted, in order, and the round time
                # at the full k (beside the cells' round_ms).
                kept_per_round=[int(round_tokens(r)[0]) for r in drafted],
                k_per_round=[int(r.k) for r in drafted],
                width_per_round=[round_width(r) for r in drafted],
                round_ms=float(np.mean([r.round_s for r in full]) * 1e3) if full else None)
    return out


def closed_loop_summary(waves: list[dict], batch: int, k: int, new_tokens: int, confidence: float, seed: int,
                        why_eager: str | None = None) -> dict:
    """Medians over waves (the unit of resampling) of TTFT and TPOT, per mode, with the mode's
    run mode over its waves; raw waves kept."""
    out = {"batch": batch, "k": k, "waves": len(waves), "new_tokens": new_tokens, "requests": len(waves) * batch}
    for mode in ("plain", "speculative"):
        rows = sorted((w[mode] for w in waves), key=lambda w: w["wave"])
        ran = merge_ran(*(r.get("ran") for r in rows))
        rows = [{key: v for key, v in r.items() if key != "ran"} for r in rows]
        out[mode] = {"tpot_ms": median_ci([r["tpot_ms"] for r in rows], confidence, seed),
                     "ttft_ms": median_ci([r["ttft_ms"] for r in rows], confidence, seed),
                     "tpot_mean_ms": float(np.mean([r["tpot_ms"] for r in rows])), "waves": rows,
                     "run_mode": run_mode(ran, why_eager=why_eager)}
    out.update(compare(out["speculative"]["run_mode"], out["plain"]["run_mode"], ("speculative", "plain")))
    return out


def best_k(figures: dict[int, dict], batch: int) -> int:
    """The k with the lowest ms/token in one repeat's figures (B -> k -> figures) at the measured B
    nearest to `batch`."""
    b = min(figures, key=lambda x: (abs(x - batch), x))
    return min((k for k in figures[b] if k > 0), key=lambda k: (figures[b][k]["ms_per_token"], k))


def batched_cache_lens(tokenizer, prompts: dict[int, torch.Tensor], lat, loop_sizes: list[int],
                       rows: list[list[int]] | None = None) -> dict[int, int]:
    """B -> the one cache length every run at B uses: the longest of its cells' (prompt + new
    tokens + 1) and its closed-loop waves' (each wave's prompt + closed-loop tokens + 1)."""
    lens = {b: cache_len(int(ids.shape[1]), lat.new_tokens) for b, ids in prompts.items()}
    for b in loop_sizes:
        longest = max(int(batch_prompts(tokenizer, b, offset=w * b, rows=rows).shape[1])
                      for w in range(lat.closed_loop_waves))
        lens[b] = max(lens.get(b, 0), cache_len(longest, lat.closed_loop_tokens))
    return lens


def spec_batch_sizes(lat) -> list[int]:
    """latency.spec_batch_sizes sorted and deduplicated; one line (StageError) when empty or below 1
    (the stage asks before any model loads, batched_pair again for its other callers)."""
    batch_sizes = sorted(set(lat.spec_batch_sizes))
    if not batch_sizes or min(batch_sizes) < 1:
        raise StageError(f"latency.spec_batch_sizes must be batch sizes >= 1 (got {lat.spec_batch_sizes})")
    return batch_sizes


def batched_pair(target: str, draft_spec: str, model, draft, tokenizer, ks: list[int], lat, device,
                 confidence: float, seed: int, session=None, rows: list[list[int]] | None = None, *,
                 budget=None) -> dict:
    """The latency/batched/<target>__<draft>.json document. With a compile `session` (the model and
    a model draft attached), every (B, width) step shape compiles before any timed run. `rows`: the
    prompts (token ids, categories in turn; None = the built-in ones, see batch_prompts). Repeats:
    up to lat.repeats, fewer once settled (lat.settle) or when `budget` (a StageBudget; None = no
    budget) cannot afford another; the waves of repeats not run follow (module docstring)."""
    batch_sizes = spec_batch_sizes(lat)
    prompts = {b: batch_prompts(tokenizer, b, rows=rows) for b in batch_sizes}
    loop_sizes = list(lat.closed_loop_batch_sizes) if lat.closed_loop_waves > 0 else []
    lens = batched_cache_lens(tokenizer, prompts, lat, loop_sizes, rows)
    has_model = getattr(draft, "model", None) is not None
    why_eager = why_not_compiled(lat, device) or "requested; this call was given no compile session"
    if session is not None:
        labels = [draft_label(draft_spec)] if has_model else []
        session.expect(batched_shapes(lens, max(ks), labels))
        ran, made = session.warm_pair(model, draft.model if labels else None)  # made: this pair's graphs
        progress(f"latency: {target} + {draft_spec}: batched: compiled {made} graphs for {ran} step shapes"
                 + (f" ({session.graphs_compiled()} graphs in the target's session)"
                    if session.graphs_compiled() > made else ""))
    run = {"session": session, "cache_lens": lens}
    # Warm-up (untimed): every step shape of a repeat once, on WARMUP_TOKENS new tokens instead of
    # new_tokens (the shapes are the same; pipeline/latency/speculative.py: WARMUP_UNIT).
    for _ in range(lat.warmup):
        batched_repeat(model, draft, prompts, ks, min(lat.new_tokens, WARMUP_TOKENS), **run)
    loop_k: dict[int, int] = {}
    waves: dict[int, list[dict]] = {b: [] for b in loop_sizes}
    reps = []
    wave_s: list[float] = []

    def run_waves(r: int | None, todo: list[int]) -> None:
        """Waves `todo` at every closed-loop B (after repeat r; None: after the last repeat, as
        far as the budget affords)."""
        for b in loop_sizes:
            for w in todo:
                if r is None and budget is not None and wave_s and not budget.affords(float(np.mean(wave_s))):
                    budget.skip(f"{target} + {draft_spec}: closed-loop B={b} wave {w + 1}/{lat.closed_loop_waves}",
                                f"budget: {fmt_s(max(budget.left(), 0.0))} left, a wave takes "
                                f"{fmt_s(float(np.mean(wave_s)))}")
                    continue
                t0 = time.perf_counter()
                waves[b].append(closed_loop_wave(model, draft, tokenizer, b, loop_k[b], w, lat.closed_loop_tokens,
                                                 session=session, cache_len=lens[b], rows=rows))
                wave_s.append(time.perf_counter() - t0)

    loop = Repeats(lat, f"{target} + {draft_spec}: B = {', '.join(map(str, batch_sizes))}", budget,
                   confidence=confidence, seed=seed, floor=MIN_TIMING_REPEATS)
    while loop.next():
        r = loop.done
        reps.append(batched_repeat(model, draft, prompts, ks, lat.new_tokens, **run))
        # The closed loop's k: the fastest in the first repeat. Its waves are spread over the
        # repeats, so cells and closed loop see the same machine load.
        loop_k = loop_k or {b: best_k(reps[0], b) for b in loop_sizes}
        run_waves(r, list(range(r, lat.closed_loop_waves, lat.repeats)))
        loop.finished(lambda: batched_widths(reps, batch_sizes, ks, confidence, seed))
    # The waves of the repeats that did not run (stopped early): after the last repeat.
    run_waves(None, [w for w in range(lat.closed_loop_waves) if w % lat.repeats >= loop.done])
    record = loop.to_json()
    cells = [{**c, "repeats_done": record["repeats_done"], "stopped": record["stopped"]}
             for c in batched_cells(reps, batch_sizes, ks, confidence, seed, why_eager)]
    loops = [{**closed_loop_summary(waves[b], b, loop_k[b], lat.closed_loop_tokens, confidence, seed, why_eager),
              "waves_asked": lat.closed_loop_waves}
             for b in loop_sizes]
    return {"variant": target, "draft": draft_spec, "device": str(device), "threads": torch.get_num_threads(),
            "batch_sizes": batch_sizes, "ks": ks,
            "prompt_tokens": {str(b): int(p.shape[1]) for b, p in prompts.items()},
            "cache_len": {str(b): n for b, n in sorted(lens.items())},
            "new_tokens": lat.new_tokens, "warmup": lat.warmup,
            "warmup_unit": f"every cell once on {min(lat.new_tokens, WARMUP_TOKENS)} new tokens", **record,
            "cells": cells, "round_ms_by_width": by_width(reps, batch_sizes, ks), "closed_loop": loops,
            "compile": ({**session.record(), "compiled_for_this_pair": made} if session is not None
                        else not_compiled(why_eager))}

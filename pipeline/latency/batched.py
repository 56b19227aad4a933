"""Speculative decoding under batching, measured: round time and ms/token per (batch size, k), and
a closed-loop run that the serving simulation (pipeline/serving/simulation.py) is checked against.

    python -m pipeline latency --run runs/smollm2-135m --config configs/default.yaml

The latency stage calls `run_batched` after its own figures; it writes
`latency/batched/<variant>__<draft_slug>.json` (a sub-directory, so nothing that globs the
pair files `latency/*__*.json` sees it):

- `cells`: for every B in latency.spec_batch_sizes and k = 1..k_max, the speculative round time,
  ms/token per row (decode time / (new_tokens - 1), the TPOT every row sees), the speedup over
  plain decoding of the same B prompts timed in the same repeat (paired), prefill time, tokens
  kept per row per round under the synchronised scheme and what per-row offsets would have kept
  (`ragged_tokens_per_round`), the thrown-away share and the mean verify width (the most any row's
  draft offered, which is what the round's forward pass costs). k = 0 rows are plain decode at that B.
- `round_ms_by_width`: B -> verify width w -> per repeat the mean time of the rounds of width w
  at that B, any k (a round of width w does the same work whichever k was asked; for a model draft
  the width is k), and the round count. The marginal stage weights it by the acceptance stage's
  width distribution at (B, k) (pipeline/serving/batch_k.py): these B prompts are not the acceptance
  prompts, and a prompt-lookup draft offers far less on some prompts than on others.
  B rows are B distinct acceptance prompts (pipeline/speculation/prompts.py, kinds taken in turn), cut from
  the left to the shortest one's length (the engine runs equal-length prompts).
- `closed_loop`: at each B in latency.closed_loop_batch_sizes, `closed_loop_waves` waves of B
  requests run to completion one after another (a closed loop at concurrency B with equal output
  lengths, where static and continuous batching coincide), plain and speculative in turn in each
  wave, the waves spread between the cells' repeats so both see the same machine load. Per wave:
  prompt length, TTFT (the batched prefill and first token) and TPOT; speculative waves also keep
  their rounds (tokens kept per row, k, verify width) for the simulation's replay, and their mean
  round time. The speculative k is the
  fastest at that B (the nearest measured B) in the warm-up repeat, or the first repeat.

Every figure is a median over `latency.repeats` repeats (cells) or over waves (closed loop) with a
percentile-bootstrap CI whose unit of resampling is the repeat or the wave; raw samples are kept.
The model runs eager here even where latency.compile is on (one compiled graph per (B, verify
width) would be a compile path of its own).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.core.stage import StageError, progress
from pipeline.decode.engine import generate
from pipeline.latency.speculative import round_time_block
from pipeline.speculation.prompts import KINDS, PROMPTS, prompt_ids
from pipeline.stats.intervals import median_ci


def batch_prompts(tokenizer, batch: int, offset: int = 0) -> torch.Tensor:
    """[B, T]: B distinct acceptance prompts (kinds in turn, starting at prompt `offset`), each cut
    from the left to the shortest one's length, so every row keeps its own chat-template ending."""
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


def batched_repeat(model, draft, prompts: dict[int, torch.Tensor], ks: list[int], new_tokens: int) -> dict:
    """One repeat: at every B, plain decode then speculative decode at every k on the same B
    prompts. Returns B -> k -> figures (k = 0 is plain); a speculative k's figures carry
    `by_width`, width -> the times (ms) of its rounds of that verify width."""
    out: dict[int, dict[int, dict]] = {}
    for b, ids in prompts.items():
        out[b] = {}
        for k in [0, *ks]:
            res = generate(model, ids, new_tokens, draft=draft if k else None, k=k)
            n = len(res.batch_tokens[0])
            if n != new_tokens:
                raise StageError(f"latency: the engine produced {n} tokens at B={b}, asked {new_tokens}")
            fig = {"ms_per_token": res.decode_s / (n - 1) * 1e3, "prefill_ms": res.prefill_s * 1e3}
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


def batched_cells(reps: list[dict], batch_sizes: list[int], ks: list[int], confidence: float, seed: int) -> list[dict]:
    cells = []
    for b in batch_sizes:
        plain = [rep[b][0]["ms_per_token"] for rep in reps]
        cells.append({"batch": b, "k": 0, "ms_per_token": median_ci(plain, confidence, seed),
                      "prefill_ms": median_ci([rep[b][0]["prefill_ms"] for rep in reps], confidence, seed)})
        for k in ks:
            col = {key: [rep[b][k][key] for rep in reps] for key in reps[0][b][k] if key != "by_width"}
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


def closed_loop_wave(model, draft, tokenizer, batch: int, k: int, wave: int, new_tokens: int) -> dict:
    """One wave of `batch` requests (prompts from `wave * batch` on), plain then speculative."""
    ids = batch_prompts(tokenizer, batch, offset=wave * batch)
    out = {}
    for mode in ("plain", "speculative"):
        res = generate(model, ids, new_tokens, draft=draft if mode == "speculative" else None,
                       k=k if mode == "speculative" else 0)
        n = len(res.batch_tokens[0])
        out[mode] = {"wave": wave, "prompt_tokens": int(ids.shape[1]), "ttft_ms": res.prefill_s * 1e3,
                     "tpot_ms": res.decode_s / (n - 1) * 1e3, "output_tokens": n}
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


def closed_loop_summary(waves: list[dict], batch: int, k: int, new_tokens: int, confidence: float, seed: int) -> dict:
    """Medians over waves (the unit of resampling) of TTFT and TPOT, per mode; raw waves kept."""
    out = {"batch": batch, "k": k, "waves": len(waves), "new_tokens": new_tokens, "requests": len(waves) * batch}
    for mode in ("plain", "speculative"):
        rows = sorted((w[mode] for w in waves), key=lambda w: w["wave"])
        out[mode] = {"tpot_ms": median_ci([r["tpot_ms"] for r in rows], confidence, seed),
                     "ttft_ms": median_ci([r["ttft_ms"] for r in rows], confidence, seed),
                     "tpot_mean_ms": float(np.mean([r["tpot_ms"] for r in rows])), "waves": rows}
    return out


def best_k(figures: dict[int, dict], batch: int) -> int:
    """The k with the lowest ms/token in one repeat's figures (B -> k -> figures) at the measured B
    nearest to `batch`."""
    b = min(figures, key=lambda x: (abs(x - batch), x))
    return min((k for k in figures[b] if k > 0), key=lambda k: (figures[b][k]["ms_per_token"], k))


def batched_pair(target: str, draft_spec: str, model, draft, tokenizer, ks: list[int], lat, device,
                 confidence: float, seed: int) -> dict:
    batch_sizes = sorted(set(lat.spec_batch_sizes))
    if not batch_sizes or min(batch_sizes) < 1:
        raise StageError(f"latency.spec_batch_sizes must be batch sizes >= 1 (got {lat.spec_batch_sizes})")
    prompts = {b: batch_prompts(tokenizer, b) for b in batch_sizes}
    warm = None
    for _ in range(lat.warmup):
        warm = batched_repeat(model, draft, prompts, ks, lat.new_tokens)
    loop_sizes = list(lat.closed_loop_batch_sizes) if lat.closed_loop_waves > 0 else []
    loop_k: dict[int, int] = {}
    waves: dict[int, list[dict]] = {b: [] for b in loop_sizes}
    reps = []
    for r in range(lat.repeats):
        progress(f"latency: {target} + {draft_spec}: B = {', '.join(map(str, batch_sizes))}: "
                 f"repeat {r + 1}/{lat.repeats}")
        reps.append(batched_repeat(model, draft, prompts, ks, lat.new_tokens))
        # The closed loop's k: the fastest in the warm-up (else the first repeat). Its waves are
        # spread over the repeats, so cells and closed loop see the same machine load.
        loop_k = loop_k or {b: best_k(warm or reps[0], b) for b in loop_sizes}
        for b in loop_sizes:
            for w in range(r, lat.closed_loop_waves, lat.repeats):
                waves[b].append(closed_loop_wave(model, draft, tokenizer, b, loop_k[b], w, lat.closed_loop_tokens))
    cells = batched_cells(reps, batch_sizes, ks, confidence, seed)
    loops = [closed_loop_summary(waves[b], b, loop_k[b], lat.closed_loop_tokens, confidence, seed)
             for b in loop_sizes]
    return {"variant": target, "draft": draft_spec, "device": str(device), "threads": torch.get_num_threads(),
            "batch_sizes": batch_sizes, "ks": ks,
            "prompt_tokens": {str(b): int(p.shape[1]) for b, p in prompts.items()},
            "new_tokens": lat.new_tokens, "warmup": lat.warmup, "repeats": lat.repeats,
            "cells": cells, "round_ms_by_width": by_width(reps, batch_sizes, ks), "closed_loop": loops}

"""Speculative round times of one (target, draft) pair, on the acceptance prompts and temperatures.

    from pipeline.latency.speculative import speculative_pair
    out = speculative_pair("bf16", "ngram", model, draft, prompts, lat, acc, device, confidence, seed)

A round's cost depends on its content through how many tokens the draft proposed, so rounds are
timed on the acceptance prompts at every k and reported by drafted count (`round_ms_by_drafted[d]`),
which the marginal stage weights by the acceptance stage's drafted counts. Repeats stop once every
figure the recommendation uses is settled (SETTLE_RULE, also the grid's) or the budget runs out.
Why: docs/methods/stages.md, docs/methods/budget.md.
"""
from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import torch

from pipeline.core.budget import fmt_s
from pipeline.core.stage import StageError, progress
from pipeline.decode.cache import CachedModel
from pipeline.decode.engine import generate
from pipeline.latency.modes import compare, run_mode
from pipeline.latency.memory import plan_loaded
from pipeline.models.kernels import device_name, quantized_kernels
from pipeline.speculation.measure import sampling_of, temp_key
from pipeline.stats.intervals import median_ci

# The rarest drafted counts that together hold at most this share of the timed rounds at every k
# are not asked to settle: they move no T_round(k) much, and would keep a pair running to the maximum.
SETTLE_MIN_SHARE = 0.05

SETTLE_RULE = (
    "After each repeat from latency.min_repeats on, stop when every figure the recommendation is "
    "computed from has a CI (median_ci, the config's confidence, over the repeats so far) whose half-width is at "
    "most latency.settle_rel of its median: B = 1 pairs: plain ms/token and the round time of every "
    "drafted count d, at every temperature; plain grid: each cell's TPOT. Drafted counts (widths) that together hold at most "
    f"{SETTLE_MIN_SHARE:g} of the timed rounds at every k are left out; a figure with fewer than 2 samples "
    "is never settled. T_round(k) is a weighted mean of the round times by drafted count, so all of them "
    "within settle_rel puts every T_round(k) and ms/token(k) within it too, whatever a slice's weights. "
    "Otherwise repeats stop at latency.repeats, or when the stage's budget cannot afford another (the mean "
    "repeat so far)."
)


def rel_half_width(samples, confidence: float, seed: int) -> float:
    """median_ci's half-width / |median| (inf with fewer than 2 samples or a zero median)."""
    xs = [float(x) for x in samples if x is not None]
    if len(xs) < 2:
        return math.inf
    ci = median_ci(xs, confidence, seed)
    return (ci["ci"][1] - ci["ci"][0]) / 2 / abs(ci["median"]) if ci["median"] else math.inf


def carrying(counts_by_k: dict, min_share: float = SETTLE_MIN_SHARE) -> list[int]:
    """The drafted counts asked to settle (counts_by_k: k -> {d: rounds}): at each k all but the
    rarest that together hold at most `min_share` of its rounds; what any k keeps is kept."""
    keep = set()
    for counts in counts_by_k.values():
        total, dropped = sum(counts.values()), 0
        for d, c in sorted(counts.items(), key=lambda x: (x[1], x[0])):
            if c <= 0:
                continue
            if dropped + c <= min_share * total:
                dropped += c
            else:
                keep.add(d)
    return sorted(keep)


def settle_widths(plain, by_d: dict, counts_by_k: dict, confidence: float, seed: int, label: str = "",
                  unit: str = "d") -> dict[str, float]:
    """name -> CI half-width / median of the figures SETTLE_RULE settles: `plain` (per repeat ms/token)
    and by_d[d] (per repeat mean round time drafting d) for every d `carrying` keeps."""
    out = {f"{label}plain": rel_half_width(plain, confidence, seed)}
    for d in carrying(counts_by_k):
        out[f"{label}{unit}={d}"] = rel_half_width(by_d.get(d, []), confidence, seed)
    return out


# The fewest timing repeats a k is recommended from (a speedup CI from one repeat has no timing
# spread in it), so the budget never stops a timed pair's loop before this many (Repeats' `floor`).
MIN_TIMING_REPEATS = 2


class Repeats:
    """One cell's (or pair's) repeat loop: up to latency.repeats; SETTLE_RULE after each repeat from
    latency.min_repeats on when latency.settle; with a `budget` (a StageBudget), no further repeat
    once it cannot afford one at the mean repeat time so far (after at least `floor`), recorded with
    budget.skip. Use: `while loop.next(): ...; loop.finished(lambda: widths)`, then loop.to_json()."""

    def __init__(self, lat, what: str, budget=None, *, confidence: float = 0.95, seed: int = 0,
                 verbose: bool | None = True, clock=time.perf_counter, floor: int = 1):
        self.max = int(lat.repeats)
        self.floor = min(max(int(floor), 1), self.max)  # repeats the budget cannot stop
        self.settle = bool(getattr(lat, "settle", False))
        self.min = max(int(getattr(lat, "min_repeats", self.max)), 1)
        self.rel = float(getattr(lat, "settle_rel", 0.05))
        self.what, self.budget, self.confidence, self.seed = what, budget, confidence, seed
        self.verbose = verbose  # True: a line per repeat; None: only once a repeat takes >= 5 s
        self.clock = clock
        self.done, self.times, self.stopped, self.widths, self._t0 = 0, [], None, None, None

    def mean_s(self) -> float | None:
        return float(np.mean(self.times)) if self.times else None

    def eta(self) -> str:
        """' (at most 2.1 min left; budget 7.5 min left)': this loop's time left, and the budget's."""
        parts = []
        if self.times:
            parts.append(f"at most {fmt_s(self.mean_s() * (self.max - self.done))} left")
        if self.budget is not None and self.budget.active:
            parts.append(f"budget {fmt_s(max(self.budget.left(), 0.0))} left")
        return f" ({'; '.join(parts)})" if parts else ""

    def next(self) -> bool:
        """Whether to run another repeat (and start its clock)."""
        if self.stopped:
            return False
        if self.done >= self.max:
            self.stopped = "max"
            return False
        if self.done >= self.floor and self.budget is not None and not self.budget.affords(self.mean_s()):
            self.stopped = "budget"
            self.budget.skip(f"{self.what}: repeats {self.done + 1}-{self.max}",
                             f"budget: {fmt_s(max(self.budget.left(), 0.0))} left, a repeat takes "
                             f"{fmt_s(self.mean_s())}")
            return False
        if self.verbose or (self.verbose is None and self.times and self.times[-1] >= 5.0):
            progress(f"latency: {self.what}: repeat {self.done + 1}/{self.max}{self.eta()}")
        self._t0 = self.clock()
        return True

    def finished(self, widths=None) -> None:
        """After a repeat: `widths` (a callable giving settle_widths so far) is checked when settling."""
        self.times.append(self.clock() - self._t0)
        self.done += 1
        if self.settle and widths is not None and self.min <= self.done < self.max:
            self.widths = widths()
            if self.widths and max(self.widths.values()) <= self.rel:
                self.stopped = "settled"

    def to_json(self) -> dict:
        stopped = self.stopped or ("max" if self.done >= self.max else None)
        return {"repeats": self.max, "repeats_done": self.done, "stopped": stopped,
                "settle": self.settle, "min_repeats": self.min, "settle_rel": self.rel,
                "budget_floor": self.floor,
                "settle_rule": SETTLE_RULE if self.settle else
                "off (latency.settle: false): latency.repeats repeats, unless the budget stops them",
                "settle_widths": None if self.widths is None else
                {key: (round(v, 5) if math.isfinite(v) else None) for key, v in self.widths.items()},
                "repeat_s": None if not self.times else round(self.mean_s(), 3)}


def one_repeat(model, draft, prompts: dict, temperatures: list[float], sampling_cfg, ks: list[int],
               new_tokens: int, seed: int, cache_len: int | None = None) -> dict:
    """temperature key -> {k: {"decode_s", "tokens", "rounds": [(k_round, drafted, emitted, round_s,
    draft_s, verify_s)]}}, k = 0 being plain decoding, over every prompt."""
    device = next(model.parameters()).device
    out = {}
    for ti, t in enumerate(temperatures):
        sampling = sampling_of(sampling_cfg, t)
        g = torch.Generator(device).manual_seed(seed * 7919 + ti)
        per_k = {}
        for k in [0, *ks]:
            fig = {"decode_s": 0.0, "tokens": 0, "rounds": []}
            for rows in prompts.values():
                for _, ids in rows:
                    res = generate(model, torch.tensor([ids], device=device), new_tokens, draft=draft if k else None,
                                   k=k, sampling=sampling, generator=g, cache_len=cache_len)
                    fig["decode_s"] += res.decode_s
                    fig["tokens"] += len(res.tokens) - 1
                    fig["rounds"] += [(r.k, r.drafted, r.emitted, r.round_s, r.draft_s, r.verify_s) for r in res.rounds]
            per_k[k] = fig
        out[temp_key(t)] = per_k
    return out


# A warm-up (latency.warmup of them, untimed) runs every step shape a timed repeat uses once: they
# do not depend on the prompt, so one short run per (temperature, k) on the shortest prompt.
WARMUP_TOKENS = 8
WARMUP_UNIT = (f"one run of {WARMUP_TOKENS} tokens per (temperature, k) on the shortest prompt, "
               "on the pair's cache length (every step shape a repeat uses, once)")


def warm_up(model, draft, prompts: dict, temperatures: list[float], sampling_cfg, ks: list[int], new_tokens: int,
            seed: int, cache_len: int | None, times: int = 1) -> int:
    """`times` warm-ups of a B = 1 pair (WARMUP_UNIT); returns the runs made."""
    rows = [ids for kind_rows in prompts.values() for _, ids in kind_rows]
    if not rows or times < 1:
        return 0
    shortest = {"warm-up": [("", min(rows, key=len))]}
    for w in range(times):
        one_repeat(model, draft, shortest, temperatures, sampling_cfg, ks, min(new_tokens, WARMUP_TOKENS),
                   seed + 1000 + w, cache_len)
    return times * len(temperatures) * (len(ks) + 1)


def _by_drafted(reps: list[dict], k_max: int, part: int) -> dict:
    """d -> {"samples": per repeat the mean time (ms) of its rounds that drafted d, over every k > 0
    (None where it had none), "rounds": how many in all}: what serving.marginal.by_drafted_matrix reads."""
    out = {}
    for d in range(k_max + 1):
        times = [[r[part] * 1e3 for k, fig in rep.items() if k for r in fig["rounds"] if r[1] == d] for rep in reps]
        out[str(d)] = {"samples": [float(np.mean(t)) if t else None for t in times], "rounds": sum(map(len, times))}
    return out


def summarize_temperature(reps: list[dict], ks: list[int], confidence: float, seed: int) -> dict:
    """One temperature's figures over repeats (reps: one_repeat(...)[temperature] per repeat)."""
    k_max = max(ks)
    plain = [rep[0]["decode_s"] / max(rep[0]["tokens"], 1) * 1e3 for rep in reps]
    modes = {k: run_mode() for k in [0, *ks]}
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


def pair_widths(reps: list[dict], ks: list[int], confidence: float, seed: int) -> dict[str, float]:
    """SETTLE_RULE's figures of a B = 1 pair over the repeats so far (one_repeat outputs)."""
    out = {}
    for t in reps[0]:
        per = [rep[t] for rep in reps]
        plain = [rep[0]["decode_s"] / max(rep[0]["tokens"], 1) * 1e3 for rep in per]
        by_d = {int(d): b["samples"] for d, b in _by_drafted(per, max(ks), 3).items()}
        counts = {k: Counter(r[1] for rep in per for r in rep[k]["rounds"]) for k in ks}
        out.update(settle_widths(plain, by_d, counts, confidence, seed, label=f"T={t} "))
    return out


def speculative_pair(target: str, draft_spec: str, model, draft, prompts: dict, lat, acc, device: torch.device,
                     confidence: float, seed: int, ks: list[int], *, budget=None) -> dict:
    """The latency/<target>__<draft>.json document (prompts: kind -> [(prompt id, ids)]); its
    repeats as Repeats runs them (`budget`: a StageBudget or None), the JSON says how many and why."""
    longest = max(len(ids) for rows in prompts.values() for _, ids in rows)
    plan, memory_budget = plan_loaded(model, lat, device, [longest], {draft_spec: draft}, max(ks))
    if plan.dropped:
        raise StageError(f"latency: {target} + {draft_spec}: the speculative cell does not fit: "
                         f"{plan.dropped[0]['reason']}")
    length = plan.cells[0].cache_len
    has_model = getattr(draft, "model", None) is not None
    warm = warm_up(model, draft, prompts, acc.temperatures, acc.sampling, ks, lat.new_tokens, seed, length,
                   lat.warmup)
    reps = []
    loop = Repeats(lat, f"{target} + {draft_spec}", budget, confidence=confidence, seed=seed,
                   floor=MIN_TIMING_REPEATS)
    while loop.next():
        reps.append(one_repeat(model, draft, prompts, acc.temperatures, acc.sampling, ks, lat.new_tokens,
                               seed + loop.done, length))
        loop.finished(lambda: pair_widths(reps, ks, confidence, seed))
    if has_model:
        CachedModel.release(draft.model)  # the next pair's draft gets its own
    by_temp = {t: summarize_temperature([rep[t] for rep in reps], ks, confidence, seed) for t in reps[0]}
    primary = min(by_temp, key=float)  # greedy when measured: the top-level figures (older readers)
    return {"variant": target, "draft": draft_spec, "device": str(device), "device_name": device_name(device),
            "prompts": {kind: [pid for pid, _ in rows] for kind, rows in prompts.items()},
            "new_tokens": lat.new_tokens, "warmup": lat.warmup, "warmup_runs": warm, "warmup_unit": WARMUP_UNIT,
            **loop.to_json(),
            "timing_unit": "repeat (every prompt, temperature and k once)",
            "primary_temperature": primary,
            "plain_ms_per_token": by_temp[primary]["plain_ms_per_token"], "rows": by_temp[primary]["rows"],
            "by_temperature": by_temp, "cache_len": length,
            "memory_plan": {**plan.to_json(), "budget": memory_budget},
            "kernels": quantized_kernels(model),
            "draft_kernels": quantized_kernels(draft.model) if has_model else None}

"""What pays at a request rate: a discrete-event simulation of a continuous-batching server driven
only by measured step costs.

    from pipeline.serving.simulation import CostModel, simulate, open_loop
    costs = CostModel.from_artifacts(grid_json, batched_json, prefix)   # latency + acceptance
    done = simulate(costs, policy=lambda b: 2, requests=open_loop(rate, 200, 128, 64, rng), ...)
    open_loop(rate, 200, 128, 64, rng, lengths=[[p, o], ...])   # lengths drawn from a workload

The marginal stage runs it (pipeline/serving/batching.py): a sweep of open-loop Poisson rates up to past
saturation, plain vs speculative at a fixed k vs the per-batch k table, and a check against the
latency stage's closed-loop measurement. ASSUMPTIONS below (with the run's lengths sentence: assumptions()) is
printed next to the plot.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from scipy.interpolate import RegularGridInterpolator

from pipeline.serving.marginal import by_drafted_matrix

LENGTHS_FIXED = ("Fixed prompt and output lengths (serving.prompt_tokens, serving.output_tokens): the acceptance "
                 "JSON names no workload to draw them from.")

ASSUMPTIONS = [
    "One model instance with iteration-level scheduling: between steps, waiting requests join the running "
    "batch first come first served, up to the largest measured speculative batch size.",
    "Prefill first: newly admitted requests are prefilled together as one step (cost: the measured prefill "
    "at that many prompts, plus the draft's prefill when speculating), which stalls the running rows, as a "
    "scheduler without chunked prefill does. Prefill emits each request's first token.",
    "A plain step of b rows costs the measured plain step at b; a speculative round the measured round time "
    "at b by verify width, weighted by the acceptance chain's share of rounds of each width at (b, k) (a "
    "prompt-lookup round that verifies nothing costs a plain step; a replayed round costs its own width). Both move with context as the plain-decode grid does between its context lengths (the "
    "verify pass's context cost is taken to be a plain step's). Costs are linear in batch between measured "
    "batch sizes and linear in context (extrapolated outside the grid).",
    "Every running row keeps n_min + 1 tokens a round (the engine's synchronised scheme), n_min the fewest "
    "accepted in the batch. A round of b rows at k draws n_min from the acceptance stage's exact batch round "
    "chain at (b, k): the per-round distribution of n_min over groups of b distinct prompts run together "
    "(at b = 1 the round chain at k, whose mean is the exact E(k) over full-length rounds). Rounds are drawn "
    "independently of each other, so the mean tokens per round is right while its spread across requests "
    "(real text runs in easy and hard stretches) is too small: TPOT p99 is optimistic. Rows that join the "
    "batch mid-way are taken to accept like rows that started together. Where the acceptance JSON has no "
    "chain at b, each row's count is drawn independently from the B = 1 distribution (stated in "
    "serving.acceptance). Near a request's end k shrinks so no row overshoots.",
    LENGTHS_FIXED + " Open-loop Poisson arrivals; a round's tokens reach the client when the round ends; no "
    "preemption, no memory limit, no network.",
]


def assumptions(lengths_source: str | None = None) -> list[str]:
    """ASSUMPTIONS with the lengths sentence of the run: fixed (None), or where the workload's
    lengths came from (pipeline/serving/lengths.py request_lengths' `source`)."""
    if lengths_source is None:
        return list(ASSUMPTIONS)
    return ASSUMPTIONS[:-1] + [
        f"Request lengths from the workload, one pair per request: {lengths_source}; as vLLM's serving "
        "benchmark draws ShareGPT's first turn and first reply. Lengths and acceptance are drawn independently: every "
        "request accepts like the pooled acceptance slice, whatever its category. The closed-loop check below "
        "keeps the lengths the latency stage measured at. Open-loop Poisson arrivals; a round's tokens reach the "
        "client when the round ends; no preemption, no memory limit, no network."]


def _axis(values) -> tuple[np.ndarray, bool]:
    """Grid axis as floats; a single point is widened to two (the function is flat along it)."""
    v = np.asarray(sorted(values), dtype=float)
    return (np.array([v[0], v[0] + 1.0]), True) if v.size == 1 else (v, False)


class Table2D:
    """f(batch, context) on a measured grid: linear inside, batch clamped to the measured range,
    context extrapolated linearly (scipy's RegularGridInterpolator)."""

    def __init__(self, batches, contexts, values: np.ndarray):
        self.b_axis, flat_b = _axis(batches)
        self.c_axis, flat_c = _axis(contexts)
        v = np.asarray(values, dtype=float).reshape(len(set(batches)), len(set(contexts)))
        if flat_b:
            v = np.vstack([v, v])
        if flat_c:
            v = np.hstack([v, v])
        self.f = RegularGridInterpolator((self.b_axis, self.c_axis), v, method="linear", bounds_error=False,
                                         fill_value=None)
        self._memo: dict[tuple[float, float], float] = {}  # the simulation asks the same points thousands of times

    def __call__(self, batch: float, context: float) -> float:
        b = min(max(float(batch), self.b_axis[0]), self.b_axis[-1])
        key = (b, round(float(context), 1))
        if key not in self._memo:
            self._memo[key] = float(self.f([key])[0])
        return self._memo[key]


@dataclass
class CostModel:
    """Measured costs in ms. `step`, `prefill`: plain decode step and prefill by (batch, context) from
    the latency grid, anchored on the batched run's own plain figures (`anchor_*`, by batch, at
    `anchor_context`); `round_ms`: speculative round by (batch, k) from the batched run (weighted by
    verify width where both JSONs have the width keys); `width_ms`: per anchor batch, round time
    by verify width w = 0..(for a replayed round of known width);
    `accept_pmf`: P(A = 0..k_max) accepted tokens per round from acceptance, clipped at k when a
    round runs at k < k_max, unless `accept_pmf_by_k` has that k: P(A = 0..k) per round of the
    acceptance round chain at k itself (the acceptance JSON's `accepted_distribution`)."""

    step: Table2D
    prefill_grid: Table2D
    anchor_batches: list[int]
    anchor_step_ms: list[float]
    anchor_prefill_ms: list[float]
    anchor_spec_prefill_ms: list[float]
    anchor_context: float  # mean context of the batched run's decode steps
    anchor_prompt: float  # its prompt length
    round_ms: dict[int, list[float]]  # k -> per anchor batch
    accept_pmf: np.ndarray
    width_ms: list[np.ndarray] | None = None  # per anchor batch: round ms by verify width
    accept_pmf_by_k: dict[int, np.ndarray] | None = None
    # b -> k -> P(n_min = j) for a round of b rows (the acceptance JSON's accepted_distribution_by_batch)
    accept_pmf_by_batch: dict[int, dict[int, np.ndarray]] | None = None
    max_batch: int = field(init=False)
    k_max: int = field(init=False)

    def __post_init__(self):
        self.max_batch = int(max(self.anchor_batches))
        self.k_max = len(self.accept_pmf) - 1
        self._memo: dict[tuple, float] = {}  # the simulation asks the same points thousands of times
        self._usable = [max((x for x in self.round_ms if x <= k), default=0) for k in range(self.k_max + 1)]
        # Inverse CDFs per k, applied to one shared stream of uniforms (common random numbers across
        # policies; for the k_max pmf this is exactly what Generator.choice(p=...) does).
        by_k = {int(k): np.asarray(v, dtype=float) for k, v in (self.accept_pmf_by_k or {}).items()}
        self._cdf = {}
        for k in range(1, self.k_max + 1):
            pmf = by_k.get(k)
            if pmf is None or pmf.sum() <= 0:
                self._cdf[k] = (np.cumsum(self.accept_pmf) / np.sum(self.accept_pmf), True)  # clip at k
            else:
                self._cdf[k] = (np.cumsum(pmf) / pmf.sum(), False)
        self._cdf_b = {(int(b), int(k)): np.cumsum(np.asarray(v, float)) / np.sum(v)
                       for b, by_k in (self.accept_pmf_by_batch or {}).items() if int(b) > 1
                       for k, v in (by_k or {}).items() if v is not None and np.sum(v) > 0}

    def has_batch_chain(self, b: int, k: int) -> bool:
        return (b, k) in self._cdf_b

    def kept_per_row(self, u: np.ndarray, k: int, b: int) -> int:
        """n_min + 1 for a round of b rows at k: one uniform from the exact batch chain at (b, k)
        where the acceptance JSON has it, else b independent B = 1 draws (u holds b uniforms)."""
        cdf = self._cdf_b.get((b, k))
        if cdf is not None:
            return int(min(cdf.searchsorted(u[0], side="right"), len(cdf) - 1)) + 1
        return int(self.accepted(u, k).min()) + 1

    def mean_kept_per_row(self, k: int, b: int) -> float:
        """E[n_min + 1] of what kept_per_row draws at (b, k), exactly: 1 + sum_j P(n_min >= j), with
        P(n_min >= j) = P(A >= j)^b for b independent rows."""
        cdf = self._cdf_b.get((b, k))
        if cdf is not None:
            return 1.0 + float(np.sum(1.0 - cdf[:-1]))
        cdf, clip = self._cdf[k]
        survival = np.clip(1.0 - cdf[:-1], 0.0, 1.0)  # P(A >= j), j = 1..
        return 1.0 + float(np.sum((survival[:k] if clip else survival) ** b))

    def accepted(self, u: np.ndarray, k: int) -> np.ndarray:
        """Accepted counts (0..k) for uniforms u at draft length k."""
        cdf, clip = self._cdf[k]
        a = np.minimum(cdf.searchsorted(u, side="right"), len(cdf) - 1)
        return np.minimum(a, k) if clip else a

    def _at(self, values: list[float], batch: float) -> float:
        return float(np.interp(batch, self.anchor_batches, values))

    def usable_k(self, k: int) -> int:
        """The largest measured k <= k (0: none, a plain step)."""
        return self._usable[max(0, min(k, self.k_max))]

    def plain_step(self, batch: int, context: float) -> float:
        return self.round(batch, 0, context)

    def round(self, batch: int, k: int, context: float, width: int | None = None) -> float:
        """A speculative round at a measured k, or a plain step for k = 0 (ms); with `width` (a
        replayed round) the measured round time at that verify width instead of the k average."""
        if width is not None and (not k or self.width_ms is None):
            width = None
        key = ("round", batch, k, round(context, 1), width)
        if key not in self._memo:
            if width is not None:
                base = self._at([float(t[min(int(width), t.size - 1)]) for t in self.width_ms], batch)
            else:
                base = self._at(self.round_ms[k] if k else self.anchor_step_ms, batch)
            self._memo[key] = base + self.step(batch, context) - self.step(batch, self.anchor_context)
        return self._memo[key]

    def prefill(self, batch: int, prompt: float, speculative: bool) -> float:
        key = ("prefill", batch, speculative, round(prompt, 1))
        if key not in self._memo:
            base = self._at(self.anchor_spec_prefill_ms if speculative else self.anchor_prefill_ms, batch)
            self._memo[key] = base + self.prefill_grid(batch, prompt) - self.prefill_grid(batch, self.anchor_prompt)
        return self._memo[key]

    @classmethod
    def from_artifacts(cls, grid: dict, batched: dict, prefix: np.ndarray, rng: np.random.Generator | None = None,
                       accept_by_k: dict | None = None, accept_by_batch: dict | None = None,
                       width_by_batch: dict | None = None):
        """grid: latency/<variant>.json; batched: latency/batched/<pair>.json; prefix: P(A >= i),
        i = 1..k_max; accept_by_k: the acceptance slice's `accepted_distribution` (k -> P(A = j)),
        used at every k it has; accept_by_batch: its `accepted_distribution_by_batch` (B -> k ->
        P(n_min = j)), used for rounds of B > 1 rows; width_by_batch: its `width_distribution_by_batch`
        (B -> k -> share of rounds by verify width), which with the batched JSON's `round_ms_by_width`
        makes a round's cost the width-weighted one (pipeline/serving/batch_k.py), else the cells' round time
        at k. With `rng`, every measured median is replaced by the median of a bootstrap resample of
        its repeats (for a prediction interval that carries the timing noise)."""

        def med(rec: dict) -> float:
            x = np.asarray(rec["samples"], dtype=float)
            return float(np.median(rng.choice(x, x.size) if rng is not None else x))

        cells = [c for c in grid["grid"] if not c.get("skipped")]
        new = float(grid.get("new_tokens") or 0)
        gb = sorted({c["batch"] for c in cells})
        gc = sorted({c["context"] for c in cells})
        by = {(c["batch"], c["context"]): c for c in cells}
        # A cell missing from the grid (skipped) takes its batch row's nearest context.
        def val(b, c, key):
            cell = by.get((b, c)) or min((x for x in cells if x["batch"] == b), key=lambda x: abs(x["context"] - c))
            return cell[key]["median"]

        step = Table2D(gb, [c + new / 2 for c in gc], np.array([[val(b, c, "tpot_ms") for c in gc] for b in gb]))
        pre = Table2D(gb, gc, np.array([[val(b, c, "ttft_ms") for c in gc] for b in gb]))
        bs = sorted(batched["batch_sizes"])
        spec = {(c["batch"], c["k"]): c for c in batched["cells"]}
        ks = sorted({c["k"] for c in batched["cells"] if c["k"] > 0})
        prompt = float(np.mean([batched["prompt_tokens"][str(b)] for b in bs]))
        round_ms = {k: [med(spec[(b, k)]["round_ms"]) for b in bs] for k in ks}
        width_ms = None
        by_width = batched.get("round_ms_by_width") or {}
        if all(by_width.get(str(b)) for b in bs):
            width_ms = []
            for b in bs:
                m, _ = by_drafted_matrix(by_width[str(b)], max(max(ks), max(int(w) for w in by_width[str(b)])))
                m = m[rng.integers(0, m.shape[0], m.shape[0])] if rng is not None else m  # resample repeats
                width_ms.append(np.median(m, axis=0))
            for k in ks:  # the width-weighted round where acceptance has the shares at (b, k)
                for i, b in enumerate(bs):
                    share = ((width_by_batch or {}).get(str(b)) or {}).get(str(k))
                    if share is not None:
                        round_ms[k][i] = float(np.asarray(share, float) @ width_ms[i][: len(share)])
        tail = np.concatenate([[1.0], np.asarray(prefix[:max(ks)], dtype=float), [0.0]])
        pmf = np.clip(tail[:-1] - tail[1:], 0.0, None)
        return cls(step=step, prefill_grid=pre, anchor_batches=bs,
                   anchor_step_ms=[med(spec[(b, 0)]["ms_per_token"]) for b in bs],
                   anchor_prefill_ms=[med(spec[(b, 0)]["prefill_ms"]) for b in bs],
                   anchor_spec_prefill_ms=[float(np.median([med(spec[(b, k)]["prefill_ms"]) for k in ks]))
                                           for b in bs],
                   anchor_context=prompt + float(batched["new_tokens"]) / 2, anchor_prompt=prompt,
                   round_ms=round_ms, width_ms=width_ms,
                   accept_pmf=pmf / pmf.sum(),
                   accept_pmf_by_k={int(k): np.asarray(v, dtype=float) for k, v in (accept_by_k or {}).items()},
                   accept_pmf_by_batch={int(b): {int(k): v for k, v in (by_k or {}).items()}
                                        for b, by_k in (accept_by_batch or {}).items()})


# ---------------------------------------------------------------- the simulation


@dataclass
class Request:
    arrival: float  # ms
    prompt: int
    output: int
    first: float = float("nan")  # first token delivered (ms)
    finish: float = float("nan")
    produced: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first) / (self.output - 1) if self.output > 1 else float("nan")


def open_loop(rate_per_s: float, n: int, prompt: int, output: int, rng: np.random.Generator,
              lengths: np.ndarray | list | None = None) -> list[Request]:
    """n requests with Poisson arrivals at `rate_per_s` (exponential gaps), times in ms. With
    `lengths` ([N, 2] (prompt, output) pairs) each request draws one pair, with replacement, after
    the arrival times (so the times are the fixed-length run's under the same rng); else every
    request has `prompt` and `output` tokens."""
    times = np.cumsum(rng.exponential(1e3 / rate_per_s, n))
    if lengths is None:
        return [Request(float(t), prompt, output) for t in times]
    pairs = np.asarray(lengths, dtype=int).reshape(-1, 2)
    pick = pairs[rng.integers(0, len(pairs), n)]
    return [Request(float(t), int(p), int(o)) for t, (p, o) in zip(times, pick)]


def simulate(costs: CostModel, policy: Callable[[int], int], requests: list[Request], rng: np.random.Generator,
             speculative: bool, max_batch: int | None = None, gains: Iterator[int] | None = None) -> list[Request]:
    """Run the server until every request is done; returns the finished requests (times filled in).

    policy(b) -> k for a round of b running rows (0 = a plain step); `requests` carry their
    arrival times; at most max_batch (default: the largest measured batch) run at once.
    gains: replay instead of drawing: every speculative round takes the next value as its tokens
    kept per row (n_min + 1, capped at k + 1), e.g. the rounds a measured run actually had; a
    value (kept, width) also costs the round at that verify width; a round past the end of the
    sequence draws."""
    cap = max_batch or costs.max_batch
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    waiting: deque[Request] = deque()
    running: list[Request] = []
    done: list[Request] = []
    t = 0.0
    draws, used = [], 0  # uniforms for the accepted counts, drawn in blocks (one rng call per block)
    while pending or waiting or running:
        while pending and pending[0].arrival <= t:
            waiting.append(pending.popleft())
        if not running and not waiting:
            t = pending[0].arrival
            continue
        if waiting and len(running) < cap:
            new = [waiting.popleft() for _ in range(min(len(waiting), cap - len(running)))]
            t += costs.prefill(len(new), sum(r.prompt for r in new) / len(new), speculative)
            for r in new:
                r.first, r.produced = t, 1
            finished = [r for r in new if r.produced >= r.output]
            running += [r for r in new if r.produced < r.output]
        else:
            b = len(running)
            context = sum(r.prompt + r.produced for r in running) / b
            k = costs.usable_k(min(policy(b), min(r.output - r.produced for r in running) - 1, costs.k_max))
            gain, width = 1, None
            replayed = next(gains, None) if k > 0 and gains is not None else None
            if isinstance(replayed, tuple):
                replayed, width = replayed
            t += costs.round(b, k, context, width)
            if replayed is not None:
                gain = min(int(replayed), k + 1)  # a replayed round: its measured n_min + 1
            elif k > 0:  # drawn (also past the end of a replayed sequence)
                if used + b > len(draws):
                    draws, used = rng.random(4096), 0
                gain = costs.kept_per_row(draws[used:used + b], k, b)  # n_min + 1 for every row
                used += b
            for r in running:
                r.produced += gain
            finished = [r for r in running if r.produced >= r.output]
            running = [r for r in running if r.produced < r.output]
        for r in finished:
            r.finish = t
            done.append(r)
    return done


def summarize(done: list[Request], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """TTFT and TPOT percentiles (ms), goodput (requests meeting both SLOs per second of the run)."""
    ttft = np.array([r.ttft for r in done])
    tpot = np.array([r.tpot for r in done])
    span_s = (max(r.finish for r in done) - min(r.arrival for r in done)) / 1e3
    ok = (ttft <= slo_ttft_ms) & (tpot <= slo_tpot_ms)
    return {"requests": len(done),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "slo_attainment": float(ok.mean()), "goodput_rps": float(ok.sum() / span_s) if span_s > 0 else 0.0,
            "throughput_tokens_per_s": float(sum(r.output for r in done) / span_s) if span_s > 0 else 0.0}


def table_policy(by_batch: dict[int, int]) -> Callable[[int], int]:
    """vLLM's lookup: the k of the largest configured batch size <= b (the first one below all)."""
    bs = sorted(by_batch)

    def k_for(b: int) -> int:
        below = [x for x in bs if x <= b]
        return by_batch[below[-1] if below else bs[0]]

    return k_for


def plain_capacity_rps(costs: CostModel, prompt: float, output: float) -> float:
    """Requests/s a plain server sustains with its batch always full (prefill + decode of a full batch);
    with lengths drawn from a workload, at its mean prompt and output lengths (the scale of the rate
    sweep, not a bound)."""
    b = costs.max_batch
    per_batch_ms = costs.prefill(b, prompt, False) + (output - 1) * costs.plain_step(b, prompt + output / 2)
    return b * 1e3 / per_batch_ms


def crossover(rates: list[float], plain: list[float], spec: list[float], rel_tol: float = 0.01) -> dict:
    """The rate above which speculation stops paying on a lower-is-better metric: the first swept
    rate from which spec is worse than plain by more than rel_tol (of plain) and never better again,
    interpolated linearly on spec - plain between it and the rate before it. Ties (within rel_tol,
    e.g. goodput = offered rate for both at low load) neither pay nor lose."""
    plain_a, spec_a = np.asarray(plain, dtype=float), np.asarray(spec, dtype=float)
    diff = spec_a - plain_a
    tol = rel_tol * np.abs(plain_a)
    worse, better = diff > tol, diff < -tol
    if not worse.any():
        return {"rate_rps": None, "status": f"never worse up to {rates[-1]:.3g} req/s"}
    last_better = int(np.max(np.flatnonzero(better))) if better.any() else -1
    later = [i for i in np.flatnonzero(worse) if i > last_better]
    if not later:
        return {"rate_rps": None, "status": f"never worse up to {rates[-1]:.3g} req/s"}
    i = int(later[0])
    if i == 0:
        return {"rate_rps": None, "status": "worse at every simulated rate"}
    r0, r1, d0, d1 = rates[i - 1], rates[i], diff[i - 1], diff[i]
    rate = r0 + (r1 - r0) * max(0.0, -d0) / (d1 - d0) if d1 != d0 else r1
    return {"rate_rps": float(rate), "status": "stops paying", "last_not_worse_rps": float(r0),
            "first_worse_rps": float(r1)}

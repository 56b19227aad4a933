"""Timing noise pooled over a timing loop's figures (or the run's), for speedup intervals from few repeats.

    from pipeline.serving.timing_noise import noise_for, pooled_noise, timing_factors
    noise = pooled_noise(latency_pair_docs)       # None when the run has too few repeats
    marginal_table(..., noise=noise_for(noise, "bf16__ngram"))

With n repeats resampled, a median's interval is at most their range, which holds the true median
only with probability 1 - 2^(1 - n). So the timing part of each replicate is a t draw at the noise
pooled over every figure timed in the same repeats, on Welch-Satterthwaite degrees of freedom.
Method and assumptions: docs/methods/timing-intervals.md.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

MIN_ROUNDS = 10  # per repeat: a figure averaged over fewer rounds is noisier than a repeat's load
MIN_DF = 4  # plain and effective df a pool needs: a loop below takes the run's, a run below is no pool

UNIT = ("one timing repeat; pooled over the figures of a timing loop, or of the run (per-repeat log plain / "
        "round time, and log round time, per drafted count with every repeat holding at least "
        f"{MIN_ROUNDS} rounds)")


def _samples(col) -> list | None:
    if isinstance(col, dict):
        col = col.get("samples")
    return list(col) if isinstance(col, (list, tuple)) else None


def _logs(samples, n: int | None = None) -> np.ndarray | None:
    """log of the first n samples (all when None), or None where one is missing or not positive."""
    x = samples[:n] if n is not None else samples
    if len(x) < 2 or any(v is None or v <= 0 for v in x):
        return None
    return np.log(np.asarray(x, float))


def _ss(x: np.ndarray) -> float:
    return float(np.sum((x - x.mean()) ** 2))


class _Pool:
    """Sums of squared deviations of per-repeat log plain / round, log round and log plain."""

    def __init__(self) -> None:
        self.ratio_ss = self.round_ss = self.plain_ss = 0.0
        self.df = self.plain_df = self.figures = 0

    def add(self, plain, cols: list[dict]) -> None:
        """One plain sequence and the round-time blocks {"samples", "rounds"} timed in its repeats."""
        plain = _samples(plain) or []
        used = False
        for col in cols:
            rounds = _samples(col) or []
            n = min(len(rounds), len(plain))
            t, p = _logs(rounds, n), _logs(plain, n)
            if t is None or p is None or (col.get("rounds") or 0) < MIN_ROUNDS * n:
                continue
            self.ratio_ss += _ss(p - t)
            self.round_ss += _ss(t)
            self.df += n - 1
            self.figures += 1
            used = True
        p = _logs(plain)
        if used and p is not None:
            self.plain_ss += _ss(p)
            self.plain_df += p.size - 1

    def figure(self, over: str) -> dict | None:
        """The pooled figure, or None below MIN_DF plain or effective degrees of freedom (Welch-
        Satterthwaite's for var(log plain) + var(log round): the figures share the plain repeats)."""
        if self.df < 1 or self.plain_df < MIN_DF:  # Satterthwaite's df is itself a guess on fewer
            return None
        v_p, v_r = self.plain_ss / self.plain_df, self.round_ss / self.df
        parts = v_p ** 2 / self.plain_df + v_r ** 2 / self.df
        df_eff = (v_p + v_r) ** 2 / parts if parts > 0 else float(self.df)
        if df_eff < MIN_DF:
            return None
        return {"ratio_sd": math.sqrt(self.ratio_ss / self.df), "round_sd": math.sqrt(v_r), "df": round(df_eff, 2),
                "figure_df": self.df, "plain_df": self.plain_df, "figures": self.figures, "pooled_over": over,
                "unit": UNIT}


def pooled_noise(pairs: dict[str, dict]) -> dict | None:
    """The run's pooled timing noise from its latency pair documents (pair -> doc): {"ratio_sd",
    "round_sd", "df", "figure_df", "plain_df", "figures", "pooled_over", "unit", "phases": {pair: the
    same over its own figures, or None}}; None below MIN_DF effective degrees of freedom."""
    run, phases = _Pool(), {}

    def phase(name: str, sequences) -> None:
        own = _Pool()
        for plain, cols in sequences:
            own.add(plain, cols)
            run.add(plain, cols)
        phases[name] = own.figure(f"{name}: its own figures")

    for pair, doc in pairs.items():
        if isinstance(doc, dict) and not doc.get("screened"):
            phase(pair, [(block.get("plain_ms_per_token"), list((block.get("round_ms_by_drafted") or {}).values()))
                         for block in (doc.get("by_temperature") or {}).values()])
    whole = run.figure("the run")
    return None if whole is None else {**whole, "phases": phases}


def noise_for(noise: dict | None, phase: str | None = None) -> dict | None:
    """The noise one phase's intervals use: its own pool where it has MIN_DF degrees of freedom, else
    the run's."""
    if noise is None:
        return None
    own = (noise.get("phases") or {}).get(phase) if phase is not None else None
    return own or {k: v for k, v in noise.items() if k != "phases"}


@lru_cache(maxsize=None)
def median_factor(n: int) -> float:
    """The median's standard error over sigma / sqrt(n) (1 for n <= 2; Monte Carlo, fixed seed)."""
    if n <= 2:
        return 1.0
    z = np.random.default_rng(20261203).standard_normal((200_000, n))
    return float(np.median(z, axis=1).std() * math.sqrt(n))


def timing_factors(rng, sd: float, n: int, df: int, size: int) -> np.ndarray:
    """`size` multiplicative draws of a median of n repeats around its point: exp(sd m_n / sqrt(n) t_df)."""
    return np.exp(sd * median_factor(max(int(n), 1)) / math.sqrt(max(int(n), 1)) * rng.standard_t(df, size))


def noise_line(noise: dict | None) -> str:
    """A sentence for the reports."""
    if not noise:
        return ("timing part: the pair's own repeats resampled (the run had too few repeated figures to pool "
                "their noise)")
    return (f"timing part: pooled repeat noise ({noise.get('pooled_over', 'the run')}), {100 * noise['ratio_sd']:.2f}% "
            f"per repeat on plain / round time ({noise['figures']} figures, {noise['df']} df), as a t draw around "
            "each median")

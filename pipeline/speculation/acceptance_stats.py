"""Acceptance figures for one slice and temperature, from per-prompt records, with intervals that
resample prompts.

    from pipeline.speculation.acceptance_stats import prompt_record, summarize_slice
    rec = prompt_record("code-0", "code", text, chains)     # one prompt's expectations (JSON-able)
    summary = summarize_slice([rec, ...], k_max, confidence=0.95)

Every figure is a ratio of sums over prompts, and a prompt's rounds share one text, so the prompt
is the unit: t intervals on the prompts (n - 1 df, the ratio linearized around its point), E(k)'s
on the log(E(k) - 1) scale because it is skewed. Below MIN_PROMPTS a slice says `few_prompts`.
The intervals, their floors and the direct check's test: docs/methods/acceptance.md.
"""
from __future__ import annotations

import numpy as np

from pipeline.speculation.expected_rounds import RoundChain, TextAcceptance
from pipeline.stats.intervals import clip_contain, t_interval, t_quantile

# The sampled direct check needs a spread of per-prompt differences: below this, no interval.
MIN_CHECK_PROMPTS = 2
# A slice's intervals are trusted from this many prompts on: the smallest n whose 95% E(k) interval
# covered >= 0.92 in every simulated population (tests/sim_direct_check.py); below: `few_prompts`.
MIN_PROMPTS = 8
# How summarize_slice's intervals are made (the slice's `ci_method`).
CI_METHOD = ("t interval on the prompts, n - 1 df, the ratio of sums linearized around its point "
             "(ratio_t_interval); E(k) on the log(E(k) - 1) scale; rates also at least their Wilson interval")


def agree_mark(check: dict) -> str:
    """The progress line's mark for one direct_check entry (its `no_verdict` reason without a verdict)."""
    if check["agree"] is None:
        return f" ({check['no_verdict']})"
    return "" if check["agree"] else " DISAGREE"


def prompt_record(prompt: str, kind: str, text: TextAcceptance, chains: dict[int, RoundChain]) -> dict:
    """One prompt's expectations for every k (chains: k -> round_chain(text, k))."""
    k_max = max(chains)
    top = chains[k_max]
    return {
        "prompt": prompt, "kind": kind,
        "tokens": int(text.tokens) - 1,  # emitted by rounds (the prefill's first token is not)
        "expected_rounds": {str(k): c.rounds for k, c in chains.items()},
        "drafted_rounds": {str(k): c.drafted_rounds.tolist() for k, c in chains.items()},
        "full_rounds": top.full_rounds, "reached": top.reached.tolist(), "accepted": top.accepted.tolist(),
        "beta_sum": top.beta_sum.tolist(), "histogram": top.histogram.tolist(),
    }


def ratio_t_interval(num, den, point: float | None, confidence: float, bounds: tuple[float, float],
                     log_above: float | None = None) -> list[float] | None:
    """sum(num)/sum(den) over n prompts with a t interval on n - 1 df, clipped to `bounds` and
    containing the point (`bounds` itself below two prompts or with no denominator). log_above = f:
    built on log(ratio - f) by the delta method (E(k) uses f = 1). Its ends are ratio_t_draws at
    -/+ the t quantile, so the marginal stage's draws follow this interval."""
    if point is None:
        return None
    num, den = np.asarray(num, float), np.asarray(den, float)
    n = num.size
    if n < 2 or den.sum() <= 0:
        return [float(bounds[0]), float(bounds[1])]
    q = t_quantile(confidence, n - 1)
    lo, hi = ratio_t_draws(num, den, point, np.array([-q, q]), log_above)
    return clip_contain(float(lo), float(hi), point, bounds)


def ratio_t_draws(num, den, point: float, draws: np.ndarray, log_above: float | None = None,
                  bounds: tuple[float, float] | None = None) -> np.ndarray:
    """Replicates of the ratio distributed as ratio_t_interval's pivot for given t draws, clipped
    to `bounds`; the point, repeated, below two prompts or with no denominator. se: the ratio
    linearized around its point, sd(num - point den) / sqrt(n) / mean den."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    draws = np.asarray(draws, float)
    if num.size < 2 or den.sum() <= 0:
        out = np.full(draws.shape, float(point))
    else:
        se = float(np.std(num - point * den, ddof=1) / np.sqrt(num.size) / den.mean())
        if log_above is None or point <= log_above:
            out = point + se * draws
        else:
            with np.errstate(over="ignore"):
                out = log_above + (point - log_above) * np.exp(np.minimum(se / (point - log_above) * draws, 700.0))
    return out if bounds is None else np.clip(out, float(bounds[0]), float(bounds[1]))


def rate_interval(hits_p, trials_p, confidence: float) -> list[float] | None:
    """A rate sum(hits_p) / sum(trials_p): its prompt t interval, widened to at least the pooled
    Wilson interval (which a slice with no spread between prompts still has)."""
    from statsmodels.stats.proportion import proportion_confint

    hits, trials = float(np.sum(hits_p)), float(np.sum(trials_p))
    point = _ratio(hits, trials)
    boot = ratio_t_interval(hits_p, trials_p, point, confidence, (0.0, 1.0))
    if boot is None:
        return None
    lo, hi = proportion_confint(hits, trials, alpha=1 - confidence, method="wilson")
    return clip_contain(min(boot[0], float(lo)), max(boot[1], float(hi)), point, (0.0, 1.0))


def _ratio(num: float, den: float) -> float | None:
    return float(num / den) if den > 0 else None


def summarize_slice(records: list[dict], k_max: int, confidence: float = 0.95) -> dict:
    """The acceptance JSON's per-slice, per-temperature block, with CIs and the per-prompt records
    the marginal stage resamples; `few_prompts` below MIN_PROMPTS (intervals indicative only)."""
    n_prompts = len(records)
    ks = list(range(1, k_max + 1))
    tokens = np.array([r["tokens"] for r in records], float)  # [P]
    rounds = np.array([[r["expected_rounds"][str(k)] for k in ks] for r in records], float).reshape(n_prompts, k_max)
    full = np.array([r["full_rounds"] for r in records], float)
    reached = np.array([r["reached"] for r in records], float).reshape(n_prompts, k_max)
    accepted = np.array([r["accepted"] for r in records], float).reshape(n_prompts, k_max)
    beta_sum = np.array([r["beta_sum"] for r in records], float).reshape(n_prompts, k_max)
    hist = np.array([r["histogram"] for r in records], float).reshape(n_prompts, k_max + 1)
    expected, expected_ci = {}, {}
    for j, k in enumerate(ks):
        e = _ratio(tokens.sum(), rounds[:, j].sum())
        expected[str(k)] = e if e is not None else 1.0  # no rounds at all: nothing to gain, 1 token/round
        expected_ci[str(k)] = ratio_t_interval(tokens, rounds[:, j], expected[str(k)], confidence, (1.0, k + 1.0),
                                               log_above=1.0)
    per_position = []
    for i in range(k_max):
        cond = _ratio(accepted[:, i].sum(), reached[:, i].sum())
        prefix = _ratio(accepted[:, i].sum(), full.sum())
        per_position.append({
            "position": i + 1,
            "conditional": cond,
            "prefix": prefix,
            "expected_beta": _ratio(beta_sum[:, i].sum(), reached[:, i].sum()),
            "n": float(reached[:, i].sum()),  # expected full-k rounds that tested position i
            "accepted": float(accepted[:, i].sum()),
            "ci": rate_interval(accepted[:, i], reached[:, i], confidence),
            "prefix_ci": rate_interval(accepted[:, i], full, confidence),
        })
    drafted = {}
    for j, k in enumerate(ks):
        counts = np.array([r["drafted_rounds"][str(k)] for r in records], float).reshape(n_prompts, k + 1).sum(0)
        drafted[str(k)] = (counts / counts.sum()).tolist() if counts.sum() > 0 else [1.0] + [0.0] * k
    top = np.array(drafted[str(k_max)])
    return {
        "per_position": per_position,
        "expected_tokens_per_round": expected,
        "expected_tokens_per_round_ci": expected_ci,
        "expected_rounds": {str(k): float(rounds[:, j].sum()) for j, k in enumerate(ks)},
        "drafted_distribution": drafted,
        "histogram": hist.sum(0).tolist(),
        "rounds": float(full.sum()),
        "tokens": int(tokens.sum()),
        "mean_drafted": float(top @ np.arange(k_max + 1)),
        "prompts": n_prompts,
        "few_prompts": n_prompts < MIN_PROMPTS, "min_prompts": MIN_PROMPTS,
        "ci_unit": "prompt", "ci_method": CI_METHOD,
        "per_prompt": records,
    }


def ratio_difference(num_a, den_a, num_b, den_b, confidence: float,
                     bounds: tuple[float, float] | None = None) -> tuple[float, list[float] | None]:
    """D = sum(num_b)/sum(den_b) - sum(num_a)/sum(den_a) over n paired prompts and its t interval
    D -/+ t_{n-1} se (clipped to `bounds`; None below MIN_CHECK_PROMPTS or with no rounds on a
    side). se linearizes D around the pooled ratio (the test of D = 0 inverted), which keeps its
    level at 2-3 prompts; as a CI for D itself it is approximate when D != 0."""
    num_a, den_a, num_b, den_b = (np.asarray(x, float) for x in (num_a, den_a, num_b, den_b))
    n = num_a.size
    r_a, r_b = _ratio(num_a.sum(), den_a.sum()) or 1.0, _ratio(num_b.sum(), den_b.sum()) or 1.0
    diff = r_b - r_a
    if n < MIN_CHECK_PROMPTS or den_a.sum() <= 0 or den_b.sum() <= 0:
        return diff, None
    pooled = (num_a.sum() + num_b.sum()) / (den_a.sum() + den_b.sum())
    z = (num_b - pooled * den_b) - (num_a - pooled * den_a)
    se = float(np.std(z, ddof=1) / np.sqrt(n) / ((den_a.sum() + den_b.sum()) / (2 * n)))
    return diff, t_interval(diff, se, n - 1, confidence, bounds)


def direct_check(records: list[dict], direct: dict[int, list[dict]], greedy: bool, confidence: float = 0.95,
                 exact: bool = True) -> dict:
    """derived E(k) (from the texts) vs direct E(k) (engine runs at k on the same prompts; direct:
    k -> one {"tokens", "rounds"} per record). Greedy in full precision (`exact`): they must be
    equal. Otherwise `difference_ci` (ratio_difference) must contain 0 (None below
    MIN_CHECK_PROMPTS prompts, and so is `agree`)."""
    n_prompts = len(records)
    tokens = np.array([r["tokens"] for r in records], float)
    out = {}
    for k, runs in sorted(direct.items()):
        rounds = np.array([r["expected_rounds"][str(k)] for r in records], float)
        d_tokens = np.array([x["tokens"] for x in runs], float)
        d_rounds = np.array([x["rounds"] for x in runs], float)
        derived = _ratio(tokens.sum(), rounds.sum()) or 1.0
        measured = _ratio(d_tokens.sum(), d_rounds.sum()) or 1.0
        # Clipped to the range of a difference of two values in [1, k+1].
        _, diff_ci = ratio_difference(tokens, rounds, d_tokens, d_rounds, confidence, (-float(k), float(k)))
        same_text = greedy and exact
        if same_text:
            agree = abs(measured - derived) <= 1e-9
        else:
            agree = None if diff_ci is None else diff_ci[0] <= 0.0 <= diff_ci[1]
        no_verdict = None
        if agree is None:  # why there is no verdict: ratio_difference's None has three causes
            sides = [side for side, r in (("derived", rounds), ("direct", d_rounds)) if r.sum() <= 0]
            no_verdict = (f"too few prompts to check (sampled needs {MIN_CHECK_PROMPTS})"
                          if n_prompts < MIN_CHECK_PROMPTS else f"no rounds on the {' and '.join(sides)} side")
        out[str(k)] = {
            "derived": derived, "direct": measured,
            "ci": ratio_t_interval(tokens, rounds, derived, confidence, (1.0, k + 1.0), log_above=1.0),
            "difference_ci": diff_ci, "agree": None if agree is None else bool(agree),
            "direct_rounds": int(d_rounds.sum()), "direct_tokens": int(d_tokens.sum()),
            "prompts": n_prompts, "min_prompts": 1 if same_text else MIN_CHECK_PROMPTS,
            "no_verdict": no_verdict,  # None when `agree` is a verdict; else why there is none
            "test": ("equal (greedy: same text)" if same_text else no_verdict
                     or f"{int(confidence * 100)}% paired t CI (prompts, se at D = 0) of direct - derived contains 0")
                    + (" (greedy in a reduced precision: near-ties may change the text)" if greedy else ""),
        }
    return out

"""Acceptance figures for one slice and temperature, from per-prompt records, with intervals that
resample prompts.

    from pipeline.speculation.acceptance_stats import prompt_record, summarize_slice
    rec = prompt_record("code-0", "code", text, chains)     # one prompt's expectations (JSON-able)
    summary = summarize_slice([rec, ...], k_max, confidence=0.95, seed=0)

Every figure is a ratio of sums over prompts (tokens / expected rounds, accepted / reached, ...),
so a prompt, whose rounds share one text, is the unit of resampling: the intervals are percentile
intervals of the same ratio over prompts drawn with replacement (a cluster bootstrap). It is
written out with multinomial prompt weights because a resample can leave a ratio undefined (no
resampled prompt reached position 6) and those resamples must be dropped, which
scipy.stats.bootstrap cannot do. With fewer than two prompts nothing can be resampled and the
interval is the whole range of the quantity. Every interval is clipped to that range and
contains its point estimate. A rate is also never narrower than the Wilson interval on its
(expected) round counts: when every prompt accepted nothing, or everything, at a position, all
resamples agree and the bootstrap alone would claim certainty that a few rounds cannot give.
"""
from __future__ import annotations

import numpy as np

from pipeline.speculation.expected_rounds import RoundChain, TextAcceptance
from pipeline.stats.intervals import clip_contain, percentile_interval

RESAMPLES = 2000


def prompt_record(prompt: str, kind: str, text: TextAcceptance, chains: dict[int, RoundChain]) -> dict:
    """One prompt's expectations for every k (chains: k -> round_chain(text, k)); k_max = max key."""
    k_max = max(chains)
    top = chains[k_max]
    return {
        "prompt": prompt, "kind": kind,
        "tokens": int(text.tokens) - 1,  # emitted by rounds (the prefill's first token is not)
        "expected_rounds": {str(k): c.rounds for k, c in chains.items()},
        "drafted_rounds": {str(k): c.drafted_rounds.tolist() for k, c in chains.items()},
        "full_rounds": top.full_rounds, "reached": top.reached.tolist(), "accepted": top.accepted.tolist(),
        "beta_sum": top.beta_sum.tolist(), "histogram": top.histogram.tolist(),
        # E[full rounds with j accepted] at every k: the per-round draws a simulation at k needs.
        "histogram_by_k": {str(k): c.histogram.tolist() for k, c in chains.items()},
    }


def prompt_weights(n_prompts: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[resamples, P]: how often each prompt appears in each resample (P drawn with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_prompts, np.full(n_prompts, 1.0 / n_prompts), size=resamples).astype(float)


def ratio_interval(num_b: np.ndarray, den_b: np.ndarray, point: float | None, confidence: float,
                   bounds: tuple[float, float], n_prompts: int) -> list[float] | None:
    """Percentile interval of num/den over prompt resamples (undefined resamples dropped), clipped
    to `bounds` and widened to contain `point` (pipeline.stats.intervals.percentile_interval);
    `bounds` itself with one prompt or fewer than 10 defined resamples."""
    if point is None:
        return None
    if n_prompts < 2:
        return [float(bounds[0]), float(bounds[1])]
    ok = den_b > 0
    return percentile_interval(num_b[ok] / den_b[ok], confidence, point, bounds, min_replicates=10, too_few=bounds)


def rate_interval(num_b: np.ndarray, den_b: np.ndarray, hits: float, trials: float, confidence: float,
                  n_prompts: int) -> list[float] | None:
    """A rate's interval: the prompt bootstrap's, widened to at least the Wilson interval of
    `hits` in `trials` rounds (the i.i.d.-rounds interval; statsmodels)."""
    from statsmodels.stats.proportion import proportion_confint

    point = _ratio(hits, trials)
    boot = ratio_interval(num_b, den_b, point, confidence, (0.0, 1.0), n_prompts)
    if boot is None:
        return None
    lo, hi = proportion_confint(hits, trials, alpha=1 - confidence, method="wilson")
    return clip_contain(min(boot[0], float(lo)), max(boot[1], float(hi)), point, (0.0, 1.0))


def _ratio(num: float, den: float) -> float | None:
    return float(num / den) if den > 0 else None


def summarize_slice(records: list[dict], k_max: int, confidence: float = 0.95, seed: int = 0) -> dict:
    """The acceptance JSON's per-slice, per-temperature block (DESIGN.md keys plus CIs and the
    per-prompt records the marginal stage resamples)."""
    n_prompts = len(records)
    ks = list(range(1, k_max + 1))
    tokens = np.array([r["tokens"] for r in records], float)  # [P]
    rounds = np.array([[r["expected_rounds"][str(k)] for k in ks] for r in records], float).reshape(n_prompts, k_max)
    full = np.array([r["full_rounds"] for r in records], float)
    reached = np.array([r["reached"] for r in records], float).reshape(n_prompts, k_max)
    accepted = np.array([r["accepted"] for r in records], float).reshape(n_prompts, k_max)
    beta_sum = np.array([r["beta_sum"] for r in records], float).reshape(n_prompts, k_max)
    hist = np.array([r["histogram"] for r in records], float).reshape(n_prompts, k_max + 1)
    w = prompt_weights(max(n_prompts, 1), seed)[:, :n_prompts]  # [B, P]

    expected, expected_ci = {}, {}
    for j, k in enumerate(ks):
        e = _ratio(tokens.sum(), rounds[:, j].sum())
        expected[str(k)] = e if e is not None else 1.0  # no rounds at all: nothing to gain, 1 token/round
        expected_ci[str(k)] = ratio_interval(w @ tokens, w @ rounds[:, j], expected[str(k)], confidence,
                                             (1.0, k + 1.0), n_prompts)
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
            "ci": rate_interval(w @ accepted[:, i], w @ reached[:, i], accepted[:, i].sum(), reached[:, i].sum(),
                                confidence, n_prompts),
            "prefix_ci": rate_interval(w @ accepted[:, i], w @ full, accepted[:, i].sum(), full.sum(), confidence,
                                       n_prompts),
        })
    drafted = {}
    for j, k in enumerate(ks):
        counts = np.array([r["drafted_rounds"][str(k)] for r in records], float).reshape(n_prompts, k + 1).sum(0)
        drafted[str(k)] = (counts / counts.sum()).tolist() if counts.sum() > 0 else [1.0] + [0.0] * k
    top = np.array(drafted[str(k_max)])
    accepted_pmf = {}
    for k in ks:  # records written before histogram_by_k (k_max only) give no per-k distribution
        counts = sum((np.asarray(r["histogram_by_k"][str(k)], float) for r in records if "histogram_by_k" in r),
                     np.zeros(k + 1))
        if counts.sum() > 0:
            accepted_pmf[str(k)] = (counts / counts.sum()).tolist()
    return {
        "per_position": per_position,
        "expected_tokens_per_round": expected,
        "expected_tokens_per_round_ci": expected_ci,
        "expected_rounds": {str(k): float(rounds[:, j].sum()) for j, k in enumerate(ks)},
        "drafted_distribution": drafted,
        "histogram": hist.sum(0).tolist(),
        # k -> P(j accepted in a full round at k), j = 0..k, from the chain at that k (not the k_max
        # rounds clipped at k, which is the biased shortcut): what pipeline/serving/simulation.py draws.
        "accepted_distribution": accepted_pmf,
        "rounds": float(full.sum()),
        "tokens": int(tokens.sum()),
        "mean_drafted": float(top @ np.arange(k_max + 1)),
        "prompts": n_prompts,
        "ci_unit": "prompt (cluster bootstrap, percentile)",
        "per_prompt": records,
    }


def direct_check(records: list[dict], direct: dict[int, list[dict]], greedy: bool, confidence: float = 0.95,
                 seed: int = 0, exact: bool = True) -> dict:
    """derived E(k) (from the texts) vs direct E(k) (real engine runs at k on the same prompts).

    direct: k -> one {"tokens", "rounds"} per record, in the same order. `ci` is the derived
    figure's interval; `difference_ci` (direct - derived) resamples prompts for both at once.
    Greedy in float32 (`exact`): the texts are the same, so the two must be equal. Sampled, or
    greedy in a reduced precision (where a near-tie can flip an argmax between the teacher-forced
    forward, a verify and a decode step, so a direct run may follow another text and accept
    differently: pipeline/speculation/lossless.py): the difference CI must contain 0."""
    n_prompts = len(records)
    tokens = np.array([r["tokens"] for r in records], float)
    w = prompt_weights(max(n_prompts, 1), seed + 7)[:, :n_prompts]
    out = {}
    for k, runs in sorted(direct.items()):
        rounds = np.array([r["expected_rounds"][str(k)] for r in records], float)
        d_tokens = np.array([x["tokens"] for x in runs], float)
        d_rounds = np.array([x["rounds"] for x in runs], float)
        derived = _ratio(tokens.sum(), rounds.sum()) or 1.0
        measured = _ratio(d_tokens.sum(), d_rounds.sum()) or 1.0
        diff_b_ok = ((w @ rounds) > 0) & ((w @ d_rounds) > 0)
        diff_b = (w @ d_tokens)[diff_b_ok] / (w @ d_rounds)[diff_b_ok] - (w @ tokens)[diff_b_ok] / (w @ rounds)[diff_b_ok]
        # Too few to resample (one prompt, or under 10 defined resamples): the whole range of a
        # difference of two values in [1, k+1].
        whole = [-float(k), float(k)]
        diff_ci = (percentile_interval(diff_b, confidence, measured - derived, min_replicates=10, too_few=whole)
                   if n_prompts >= 2 else whole)
        same_text = greedy and exact
        agree = abs(measured - derived) <= 1e-9 if same_text else diff_ci[0] <= 0.0 <= diff_ci[1]
        out[str(k)] = {
            "derived": derived, "direct": measured,
            "ci": ratio_interval(w @ tokens, w @ rounds, derived, confidence, (1.0, k + 1.0), n_prompts),
            "difference_ci": diff_ci, "agree": bool(agree),
            "direct_rounds": int(d_rounds.sum()), "direct_tokens": int(d_tokens.sum()),
            "test": "equal (greedy: same text)" if same_text else
                    f"{int(confidence * 100)}% prompt-bootstrap CI of direct - derived contains 0"
                    + (" (greedy in a reduced precision: near-ties may change the text)" if greedy else ""),
        }
    return out

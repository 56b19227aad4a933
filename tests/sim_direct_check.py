"""The direct check of derived E(k) (issue 28 point 5), simulated through the project's own
functions. Not a test (pytest collects test_*.py only); run it for a closing note or
docs/validation/direct-check.md:

    .venv/bin/python tests/sim_direct_check.py bias       # is the derived sampled E(k) exact for prompt lookup?
    .venv/bin/python tests/sim_direct_check.py coverage   # does direct_check's interval cover 0 as it claims?

`bias`: a toy target whose next-token distribution is a function of the whole context (a random
bigram table plus an induction term: the token that followed the latest earlier occurrence of
the last token gets `copy` extra logit, so a text that enters its prompt's passage keeps copying
it, as SmolLM2 does on long_context) at T = 0.7 with an EOS token, and the real prompt-lookup
draft (pipeline.decode.drafts.NgramDraft). Rounds are run as the engine runs them (k shortened
near max_new_tokens, accept d with probability p(d), else resample from p with d removed, the
bonus token after k accepts, cut at EOS); the derived figure is the project's round chain
(pipeline.speculation.expected_rounds.round_chain) on plain-sampled texts, scored as
pipeline/speculation/teacher_forced.py scores them. Per prompt, the mean of E[rounds | text]
over many texts is compared with the mean rounds of many direct runs (z = difference / its
Monte-Carlo standard error). A bias of the chain would show as |z| >> 2.

`coverage`: how often `direct_check`'s sampled test says `agree` when the engine is right (the
derived and direct figures have the same expectation), at the prompt counts the configs use, for
the check as it was (a percentile prompt bootstrap of direct - derived, `--method bootstrap`) and
as it is (`pipeline.speculation.acceptance_stats.direct_check`). Per-prompt data come from a bank
of toy-engine draws (one text's chain rounds, one direct run's rounds, per draw) over a
population of prompts that copy heavily, a little or not at all; each simulated check draws n
prompts from the population and one text and one direct run per prompt, independently, as the
stage does. Also (issue 28 point 5, second half): the coverage and width of a slice's E(k)
interval for the population's E(k), the percentile prompt bootstrap summarize_slice used before
against the candidates and the t interval on log(E - 1) it uses now (what MIN_PROMPTS, the
`few_prompts` flag, is set from), and of marginal_table's speedup CI on toy records with
synthetic timing, old (joint percentile bootstrap) and new. `--cache banks.npz` keeps the banks
(about 1.5 minutes to build) for re-runs; `--tables check,slice,marginal` picks the tables:

    .venv/bin/python tests/sim_direct_check.py coverage --cache /tmp/banks.npz --tables slice,marginal --n 2,3,4,6,8,12,16,24,32
    .venv/bin/python tests/sim_direct_check.py coverage --cache /tmp/banks.npz --tables slice --slice-k 3,5 --n 6,8,12,16 --reps 3000
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.decode.drafts import NgramDraft  # noqa: E402
from pipeline.speculation.expected_rounds import TextAcceptance, round_chain  # noqa: E402

EOS = 0


class ToyTarget:
    """p(. | context) over `vocab` tokens at temperature `temp`: bigram logits of the last token
    plus `copy` on the token that followed the latest earlier occurrence of the last two (an
    induction head)."""

    def __init__(self, vocab: int = 64, copy: float = 6.0, temp: float = 0.7, eos_logit: float = -1.0, spread: float = 0.5,
                 seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab, self.copy, self.temp = vocab, copy, temp
        self.bigram = rng.normal(0.0, spread, (vocab, vocab))
        self.bigram[:, EOS] = eos_logit

    def probs(self, ctx: np.ndarray) -> np.ndarray:
        last = ctx[-1]
        logits = self.bigram[last].copy()
        if ctx.size >= 3:  # the latest earlier occurrence of the last two tokens
            earlier = np.flatnonzero((ctx[:-2] == ctx[-2]) & (ctx[1:-1] == last))
            if earlier.size:
                logits[ctx[earlier[-1] + 2]] += self.copy
        z = logits / self.temp
        e = np.exp(z - z.max())
        return e / e.sum()


def _draw(rng, p: np.ndarray) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), p.size - 1))


def plain(target: ToyTarget, prompt: np.ndarray, n_new: int, rng) -> list[int]:
    """The target's own sampling: x_0 (the prefill's) .. up to n_new tokens, the EOS included."""
    seq, out = list(prompt), []
    while len(out) < n_new:
        x = _draw(rng, target.probs(np.asarray(seq)))
        out.append(x)
        seq.append(x)
        if x == EOS:
            break
    return out


def speculative(target: ToyTarget, draft: NgramDraft, prompt: np.ndarray, n_new: int, k: int, rng,
                with_text: bool = False) -> tuple:
    """One engine run at draft length k (pipeline/decode/engine.py's rounds, B = 1) -> (tokens
    emitted by rounds, rounds), and the output text with `with_text`."""
    first = _draw(rng, target.probs(np.asarray(prompt)))
    out, rounds = [first], 0
    done = first == EOS
    while not done and len(out) < n_new:
        seq = np.concatenate([prompt, out]).astype(np.int64)
        k_round = min(k, n_new - len(out) - 1)
        proposal = draft.lookup(seq, k_round) if k_round > 0 else seq[:0]
        new = []
        for d in proposal:
            p = target.probs(np.concatenate([seq, new]).astype(np.int64))
            if rng.random() < p[int(d)]:
                new.append(int(d))
                continue
            residual = p.copy()
            residual[int(d)] = 0.0
            new.append(_draw(rng, residual))
            break
        else:  # every draft accepted (or none drafted): the bonus token
            new.append(_draw(rng, target.probs(np.concatenate([seq, new]).astype(np.int64))))
        rounds += 1
        for x in new:
            out.append(x)
            if x == EOS:
                done = True
                break
    return (len(out) - 1, rounds, out) if with_text else (len(out) - 1, rounds)


def chain_rounds(draft: NgramDraft, prompt: np.ndarray, tokens: list[int], k_max: int, n_new: int,
                 ks) -> dict[int, float]:
    """E[rounds | text] at each k by the project's round chain, the text scored as
    teacher_forced.score_text scores a prompt-lookup draft."""
    n = len(tokens)
    accept, beta = np.zeros((max(n - 1, 0), k_max)), np.zeros((max(n - 1, 0), k_max))
    available = np.zeros(max(n - 1, 0), dtype=int)
    full = np.concatenate([prompt, tokens]).astype(np.int64)
    for s in range(1, n):
        proposal = draft.lookup(full[: len(prompt) + s], k_max)
        available[s - 1] = proposal.size
        for i, d in enumerate(proposal[: n - s]):
            accept[s - 1, i] = float(d == tokens[s + i])
    text = TextAcceptance(accept, beta, available, n, n_new)
    return {k: round_chain(text, k).rounds for k in ks}


PROMPT_KINDS = ("repeats", "once", "random")
# Slice populations: a category whose output copies its input (summarize, extract, code_edit), one
# whose output may wander into a passage or not (long_context, doc_qa), one with little to copy
# (chat), and the pooled slice.
POPULATIONS = {"copying": ("repeats",), "sometimes": ("once",), "free": ("random",), "pooled": PROMPT_KINDS}


def make_prompts(target: ToyTarget, count: int, seed: int, kinds=PROMPT_KINDS) -> list[np.ndarray]:
    """Toy prompts, the kinds in turn: "repeats" holds one passage three times (copied from the
    first token on), "once" a passage then four random tokens (copied once the text wanders into
    it, or never), "random" a short random string (little to copy)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        passage = rng.integers(1, target.vocab, size=int(rng.integers(8, 20)))
        if kind == "repeats":
            out.append(np.tile(passage, 3))
        elif kind == "once":
            out.append(np.concatenate([passage, rng.integers(1, target.vocab, size=4)]))
        else:
            out.append(rng.integers(1, target.vocab, size=int(rng.integers(3, 7))))
    return [p.astype(np.int64) for p in out]


def bank(target, draft, prompts, draws: int, n_new: int, ks, seed: int) -> dict:
    """Per prompt and draw: the plain text's tokens and chain rounds at each k, and one direct
    run's tokens and rounds at each k. Arrays [P, draws] (per k: dict k -> [P, draws])."""
    rng = np.random.default_rng(seed)
    k_max = max(ks)
    P = len(prompts)
    out = {"tokens": np.zeros((P, draws)), "rounds": {k: np.zeros((P, draws)) for k in ks},
           "d_tokens": {k: np.zeros((P, draws)) for k in ks}, "d_rounds": {k: np.zeros((P, draws)) for k in ks}}
    for i, prompt in enumerate(prompts):
        for m in range(draws):
            text = plain(target, prompt, n_new, rng)
            out["tokens"][i, m] = len(text) - 1
            for k, r in chain_rounds(draft, prompt, text, k_max, n_new, ks).items():
                out["rounds"][k][i, m] = r
            for k in ks:
                out["d_tokens"][k][i, m], out["d_rounds"][k][i, m] = speculative(target, draft, prompt, n_new, k, rng)
    return out


def pooled(b: dict, ks) -> dict:
    """One bank whose derived and direct draws per prompt are the same pool (texts' chain rounds
    and direct runs' rounds together). For a prompt-lookup draft the chain's rounds given a text
    are the rounds a run with that text took (`bias` checks it run by run), and the texts are
    distributed alike (speculation is lossless), so the two are draws of one distribution; pooled,
    the true direct - derived is exactly 0 in the simulated world, not 0 up to the bank's own
    Monte-Carlo error."""
    tokens = {k: np.concatenate([b["tokens"], b["d_tokens"][k]], axis=1) for k in ks}
    rounds = {k: np.concatenate([b["rounds"][k], b["d_rounds"][k]], axis=1) for k in ks}
    first = next(iter(ks))
    return {"tokens": tokens[first], "tokens_by_k": tokens, "rounds": rounds, "d_tokens": tokens, "d_rounds": rounds}


# ---------------------------------------------------------------- bias


def run_bias(args) -> None:
    ks = (3, 5)
    target = ToyTarget(copy=args.copy, temp=args.temperature, seed=args.seed)
    draft = NgramDraft("ngram", max_n=3)
    prompts = make_prompts(target, 6, args.seed + 1)
    t0 = time.time()
    b = bank(target, draft, prompts, args.draws, args.max_new_tokens, ks, args.seed + 2)
    print(f"toy target: vocab {target.vocab}, copy {args.copy}, T = {args.temperature}, max_new_tokens "
          f"{args.max_new_tokens}, {args.draws} texts and {args.draws} direct runs per prompt and k "
          f"({time.time() - t0:.0f} s)\n")
    print("| prompt | k | derived E[rounds] | direct E[rounds] | direct - derived (MC se) | z | derived E(k) | direct E(k) |")
    print("|---|---|---|---|---|---|---|---|")
    zs = []
    for i in range(len(prompts)):
        for k in ks:
            a, d = b["rounds"][k][i], b["d_rounds"][k][i]
            se = math.sqrt(a.var(ddof=1) / a.size + d.var(ddof=1) / d.size)
            z = (d.mean() - a.mean()) / se if se > 0 else 0.0
            zs.append(z)
            print(f"| {i} ({['repeats', 'once', 'random'][i % 3]}) | {k} | {a.mean():.3f} | {d.mean():.3f} | "
                  f"{d.mean() - a.mean():+.3f} ({se:.3f}) | {z:+.2f} | {b['tokens'][i].sum() / a.sum():.3f} | "
                  f"{b['d_tokens'][k][i].sum() / d.sum():.3f} |")
    print(f"\nmax |z| over {len(zs)} cells: {max(abs(z) for z in zs):.2f}; "
          f"sum of z^2 = {sum(z * z for z in zs):.1f} (chi-square, {len(zs)} df, if the chain is exact)")
    # Run by run: the chain on a direct run's own output text gives that run's round count (for a
    # prompt-lookup draft acceptance given the text is 0/1), so only the texts' distribution,
    # which speculation leaves alone, could make derived and direct differ.
    rng, same, total = np.random.default_rng(args.seed + 3), 0, 0
    for prompt in prompts:
        for k in ks:
            for _ in range(50):
                _, rounds, out = speculative(target, draft, prompt, args.max_new_tokens, k, rng, with_text=True)
                same += chain_rounds(draft, prompt, out, max(ks), args.max_new_tokens, (k,))[k] == rounds
                total += 1
    print(f"run by run: the chain on a direct run's own text gave its round count in {same} of {total} runs")


# ---------------------------------------------------------------- coverage


def prompt_weights(n_prompts: int, seed: int, resamples: int = 2000) -> np.ndarray:
    """[resamples, P]: how often each prompt appears in each resample (P drawn with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_prompts, np.full(n_prompts, 1.0 / n_prompts), size=resamples).astype(float)


def ratio_interval(num_b: np.ndarray, den_b: np.ndarray, point: float | None, confidence: float,
                   bounds: tuple[float, float], n_prompts: int) -> list[float] | None:
    """The slice E(k) interval summarize_slice gave before its t interval: the percentile interval
    of num/den over prompt resamples (undefined resamples dropped), clipped to `bounds` and
    containing `point`; `bounds` itself with one prompt or fewer than 10 defined resamples."""
    from pipeline.stats.intervals import percentile_interval

    if point is None:
        return None
    if n_prompts < 2:
        return [float(bounds[0]), float(bounds[1])]
    ok = den_b > 0
    return percentile_interval(num_b[ok] / den_b[ok], confidence, point, bounds, min_replicates=10, too_few=bounds)


def bootstrap_check(tokens, rounds, d_tokens, d_rounds, confidence: float, seed: int) -> bool:
    """The check as it was before issue 28: a percentile prompt bootstrap of direct - derived
    (2000 resamples); agree = the interval contains 0."""
    from pipeline.stats.intervals import percentile_interval

    n = len(tokens)
    w = prompt_weights(n, seed + 7)[:, :n]
    ok = ((w @ rounds) > 0) & ((w @ d_rounds) > 0)
    diff_b = (w @ d_tokens)[ok] / (w @ d_rounds)[ok] - (w @ tokens)[ok] / (w @ rounds)[ok]
    # As the old check: a slice with no rounds at all (every text ended at its first token) has E = 1.
    point = ((d_tokens.sum() / d_rounds.sum() if d_rounds.sum() > 0 else 1.0)
             - (tokens.sum() / rounds.sum() if rounds.sum() > 0 else 1.0))
    lo, hi = percentile_interval(diff_b, confidence, point, min_replicates=10, too_few=[-9.0, 9.0])
    return lo <= 0.0 <= hi


def check_records(tokens, rounds, k: int) -> list[dict]:
    """Minimal acceptance records for direct_check / summarize_slice at one k."""
    return [{"tokens": float(t), "expected_rounds": {str(k): float(r)}} for t, r in zip(tokens, rounds)]


def _tokens(b: dict, k: int) -> np.ndarray:
    return b["tokens_by_k"][k] if "tokens_by_k" in b else b["tokens"]


def coverage_table(b: dict, ns, reps: int, k: int, confidence: float, seed: int, methods=("bootstrap", "t")) -> list[dict]:
    """For each n: the share of simulated checks that agree (the CI of direct - derived covers 0),
    by method, the share where the check abstains (agree null) and the new interval's median width."""
    from pipeline.speculation.acceptance_stats import direct_check

    rng = np.random.default_rng(seed)
    tok = _tokens(b, k)
    P, draws = tok.shape
    rows = []
    for n in ns:
        agree = {m: 0 for m in methods}
        abstain = 0
        width = []
        for r in range(reps):
            idx = rng.integers(0, P, size=n)  # prompts drawn from the population
            m1, m2 = rng.integers(0, draws, size=n), rng.integers(0, draws, size=n)
            tokens, rounds = tok[idx, m1], b["rounds"][k][idx, m1]
            d_tokens, d_rounds = b["d_tokens"][k][idx, m2], b["d_rounds"][k][idx, m2]
            if "bootstrap" in methods:
                agree["bootstrap"] += bootstrap_check(tokens, rounds, d_tokens, d_rounds, confidence, r)
            if "t" in methods:
                out = direct_check(check_records(tokens, rounds, k),
                                   {k: [{"tokens": t, "rounds": x} for t, x in zip(d_tokens, d_rounds)]},
                                   greedy=False, confidence=confidence)[str(k)]
                if out["agree"] is None:
                    abstain += 1
                else:
                    agree["t"] += bool(out["agree"])
                    width.append(out["difference_ci"][1] - out["difference_ci"][0])
        decided = reps - abstain
        rows.append({"n": n, "reps": reps, "cover_bootstrap": agree.get("bootstrap", 0) / reps,
                     "cover_t": agree["t"] / decided if "t" in methods and decided else None,
                     "abstain": abstain / reps, "median_width_t": float(np.median(width)) if width else None})
    return rows


SLICE_METHODS = {
    "bootstrap": "old: percentile prompt bootstrap (ratio_interval)",
    "calibrated": "t-calibrated bootstrap (calibrated_interval)",
    "t": "linearized t, n - 1 df (ratio_t_interval)",
    "tlog": "new: linearized t on log(E - 1), n - 1 df (ratio_t_interval(log_above=1), summarize_slice's)",
}


def small_sample_factor(n: int, confidence: float) -> float:
    """t_{n-1} / z * sqrt(n / (n - 1)): how much wider a t interval on n - 1 df with the unbiased
    variance is than the normal interval a percentile bootstrap imitates (plug-in variance)."""
    from scipy import stats

    return float(stats.t.ppf((1 + confidence) / 2, n - 1) / stats.norm.ppf((1 + confidence) / 2) * math.sqrt(n / (n - 1)))


def calibrated_interval(num_b, den_b, point: float, confidence: float, bounds, n: int) -> list[float]:
    """The t-calibrated prompt bootstrap (a candidate, not adopted): each resample's deviation from
    the point scaled by small_sample_factor, then ratio_interval's percentile, clip and containment."""
    from pipeline.stats.intervals import percentile_interval

    if n < 2:
        return [float(bounds[0]), float(bounds[1])]
    ok = den_b > 0
    reps = point + small_sample_factor(n, confidence) * (num_b[ok] / den_b[ok] - point)
    return percentile_interval(reps, confidence, point, bounds, min_replicates=10, too_few=bounds)


def slice_coverage(b: dict, ns, reps: int, k: int, confidence: float, seed: int) -> tuple[list[dict], float]:
    """Coverage and median width of a slice's E(k) interval for the population's E(k) (sum of
    expected tokens / sum of expected rounds over the whole bank), by method (SLICE_METHODS): the
    percentile prompt bootstrap summarize_slice used before, two candidates (the t-calibrated
    bootstrap, the linearized t interval) and the linearized t interval on log(E - 1) it uses now."""
    from pipeline.speculation.acceptance_stats import ratio_t_interval

    tok = _tokens(b, k)
    truth = tok.mean(1).sum() / b["rounds"][k].mean(1).sum()
    rng = np.random.default_rng(seed)
    P, draws = tok.shape
    rows = []
    for n in ns:
        hit = {m: 0 for m in SLICE_METHODS}
        width = {m: [] for m in SLICE_METHODS}
        for r in range(reps):
            idx, m = rng.integers(0, P, size=n), rng.integers(0, draws, size=n)
            tokens, rounds = tok[idx, m], b["rounds"][k][idx, m]
            w = prompt_weights(n, r)[:, :n]
            point = tokens.sum() / rounds.sum() if rounds.sum() > 0 else 1.0  # as summarize_slice
            bounds = (1.0, k + 1.0)
            cis = {"bootstrap": ratio_interval(w @ tokens, w @ rounds, point, confidence, bounds, n),
                   "calibrated": calibrated_interval(w @ tokens, w @ rounds, point, confidence, bounds, n),
                   "t": ratio_t_interval(tokens, rounds, point, confidence, bounds),
                   "tlog": ratio_t_interval(tokens, rounds, point, confidence, bounds, log_above=1.0)}
            for name, (lo, hi) in cis.items():
                hit[name] += lo <= truth <= hi
                width[name].append(hi - lo)
        rows.append({"n": n, "reps": reps, "cover": hit["tlog"] / reps,
                     **{f"cover_{name}": hit[name] / reps for name in SLICE_METHODS},
                     **{f"width_{name}": float(np.median(width[name])) for name in SLICE_METHODS}})
    return rows, truth


def toy_acceptance(tokens, rounds: dict[int, np.ndarray]) -> dict:
    """An acceptance slice block for marginal_table from per-prompt tokens and expected rounds at
    each k; every round drafts k (a model draft), so T_round(k) is the timing of d = k."""
    ks = sorted(rounds)
    recs = [{"tokens": float(t), "expected_rounds": {str(k): float(rounds[k][i]) for k in ks},
             "drafted_rounds": {str(k): [0.0] * k + [float(rounds[k][i])] for k in ks}} for i, t in enumerate(tokens)]
    e = {str(k): float(np.sum(tokens) / np.sum(rounds[k])) for k in ks}
    return {"expected_tokens_per_round": e, "per_prompt": recs, "per_position": []}


def toy_timing(rng, repeats: int, noise: float, d_max: int, plain: float = 10.0, base: float = 12.0,
               per_draft: float = 1.0) -> dict:
    """A latency block with `repeats` timing repeats: round time base + per_draft d ms and plain
    ms/token, each repeat scaled by its own lognormal factor (sd `noise`; the medians are the
    nominal values) and each round time by a smaller one of its own."""
    f_round = np.exp(rng.normal(0.0, noise, repeats))
    f_plain = np.exp(rng.normal(0.0, noise, repeats))
    by_d = {str(d): {"samples": ((base + per_draft * d) * f_round * np.exp(rng.normal(0.0, noise / 4, repeats))).tolist(),
                     "rounds": 100} for d in range(d_max + 1)}
    return {"round_ms_by_drafted": by_d, "plain_ms_per_token": {"samples": (plain * f_plain).tolist()}}


def old_speedup_ci(acc: dict, timing: dict, confidence: float, seed: int, resamples: int = 2000) -> dict[int, list[float]]:
    """The speedup CI marginal_table gave before issue 28 point 5, for toy_acceptance's records
    (every round drafts k): the joint percentile bootstrap of prompts (multinomial weights) and
    timing repeats, drawn from the same random stream as marginal_table draws them."""
    from pipeline.stats.intervals import percentile_interval

    ks = sorted(int(k) for k in acc["expected_tokens_per_round"])
    tokens = np.array([r["tokens"] for r in acc["per_prompt"]], float)
    rounds = np.array([[r["expected_rounds"][str(k)] for k in ks] for r in acc["per_prompt"]], float)
    plain = np.asarray(timing["plain_ms_per_token"]["samples"], float)
    t_round = np.array([timing["round_ms_by_drafted"][str(k)]["samples"] for k in ks], float).T  # [R, K]
    rng = np.random.default_rng(seed)
    n = tokens.size
    w = rng.multinomial(n, np.full(n, 1 / n), size=resamples).astype(float)
    idx = rng.integers(0, plain.size, (resamples, plain.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        e_b = (w @ tokens)[:, None] / (w @ rounds)
        sp_b = np.median(plain[idx], axis=1)[:, None] / (np.median(t_round[idx], axis=1) / e_b)
    point = {k: float(np.median(plain)) / (float(np.median(t_round[:, j])) / (tokens.sum() / rounds[:, j].sum()))
             for j, k in enumerate(ks)}
    return {k: percentile_interval(sp_b[:, j], confidence, point[k], drop_nonfinite=True, too_few=(point[k], point[k]))
            for j, k in enumerate(ks)}


def marginal_coverage(b: dict, ns, reps: int, ks, confidence: float, seed: int, repeats: int = 10,
                      noise: float = 0.01) -> tuple[list[dict], dict]:
    """Coverage of marginal_table's speedup_ci for the population's speedup at each k (plain
    10 ms/token over (12 + k) ms per round / the population's E(k)): toy per-prompt records drawn
    as in slice_coverage (one text per prompt, shared by the ks), synthetic timing (toy_timing),
    the real marginal_table (new) and the joint percentile bootstrap it used before (old,
    old_speedup_ci)."""
    from pipeline.serving.marginal import marginal_table

    truth = {k: 10.0 / ((12.0 + k) / (_tokens(b, k).mean(1).sum() / b["rounds"][k].mean(1).sum())) for k in ks}
    rng = np.random.default_rng(seed)
    P, draws = _tokens(b, ks[0]).shape
    rows = []
    for n in ns:
        hit = {(m, k): 0 for m in ("old", "new") for k in ks}
        width = {(m, k): [] for m in ("old", "new") for k in ks}
        for r in range(reps):
            idx, m = rng.integers(0, P, size=n), rng.integers(0, draws, size=n)
            acc = toy_acceptance(_tokens(b, ks[0])[idx, m], {k: b["rounds"][k][idx, m] for k in ks})
            timing = toy_timing(rng, repeats, noise, max(ks))
            cis = {"new": {row["k"]: row["speedup_ci"] for row in marginal_table(acc, timing, confidence, seed=r)["rows"]},
                   "old": old_speedup_ci(acc, timing, confidence, r)}
            for method, by_k in cis.items():
                for k in ks:
                    lo, hi = by_k[k]
                    hit[(method, k)] += lo <= truth[k] <= hi
                    width[(method, k)].append(hi - lo)
        for k in ks:
            rows.append({"n": n, "k": k, "reps": reps, **{f"cover_{m}": hit[(m, k)] / reps for m in ("old", "new")},
                         **{f"width_{m}": float(np.median(width[(m, k)])) for m in ("old", "new")}})
    return rows, truth


def load_banks(args, target, draft, ks) -> dict:
    """The populations' pooled banks: built (minutes), or read from `--cache` (an .npz this
    function wrote with the same settings) so the tables can be re-run without rebuilding."""
    cache = Path(args.cache) if getattr(args, "cache", None) else None
    if cache is not None and cache.exists():
        z = np.load(cache)
        return {name: {"tokens": z[f"{name}/tokens/{ks[0]}"],
                       "tokens_by_k": {k: z[f"{name}/tokens/{k}"] for k in ks},
                       "rounds": {k: z[f"{name}/rounds/{k}"] for k in ks},
                       "d_tokens": {k: z[f"{name}/tokens/{k}"] for k in ks},
                       "d_rounds": {k: z[f"{name}/rounds/{k}"] for k in ks}} for name in POPULATIONS}
    banks = {}
    for pi, (name, kinds) in enumerate(POPULATIONS.items()):
        prompts = make_prompts(target, args.population, args.seed + 1 + pi, kinds)
        banks[name] = pooled(bank(target, draft, prompts, args.draws, args.max_new_tokens, ks, args.seed + 11 + pi), ks)
    if cache is not None:
        arrays = {}
        for name, b in banks.items():
            for k in ks:
                arrays[f"{name}/tokens/{k}"], arrays[f"{name}/rounds/{k}"] = b["tokens_by_k"][k], b["rounds"][k]
        tmp = cache.with_name(cache.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(cache)
    return banks


def run_coverage(args) -> None:
    ks = (3, 5)
    target = ToyTarget(copy=args.copy, temp=args.temperature, seed=args.seed)
    draft = NgramDraft("ngram", max_n=3)
    ns = [int(x) for x in args.n.split(",")]
    se = math.sqrt(0.95 * 0.05 / args.reps)
    t0 = time.time()
    banks = load_banks(args, target, draft, ks)
    print(f"banks: {len(POPULATIONS)} populations x {args.population} toy prompts x {2 * args.draws} draws "
          f"(texts and direct runs, pooled), max_new_tokens {args.max_new_tokens}, T = {args.temperature} "
          f"({time.time() - t0:.0f} s)\n")
    print("| population | E(3) | E(5) | per-prompt E(5): min - median - max | per-draw E(5) sd within a prompt (median) |")
    print("|---|---|---|---|---|")
    for name, b in banks.items():
        e = {k: _tokens(b, k).mean(1).sum() / b["rounds"][k].mean(1).sum() for k in ks}
        per = _tokens(b, 5).mean(1) / b["rounds"][5].mean(1)
        sd = np.median((_tokens(b, 5) / np.maximum(b["rounds"][5], 1)).std(1))
        print(f"| {name} | {e[3]:.3f} | {e[5]:.3f} | {per.min():.2f} - {np.median(per):.2f} - {per.max():.2f} | {sd:.2f} |")
    tables = args.tables.split(",")
    if "check" in tables:
        print(f"\ndirect_check, sampled: share of {args.reps} simulated checks whose 95% CI of direct - derived "
              f"contains 0 (the truth); Monte-Carlo se {se:.3f} at 0.95\n")
        print("| population | prompts in the slice | k | old: percentile prompt bootstrap | new: paired t (n - 1 df) | new: median CI width |")
        print("|---|---|---|---|---|---|")
        for pi, (name, b) in enumerate(banks.items()):
            for k in ks:
                for row in coverage_table(b, ns, args.reps, k, 0.95, args.seed + 100 * pi + k):
                    t_cov = "-" if row["cover_t"] is None else f"{row['cover_t']:.3f}"
                    width = "-" if row["median_width_t"] is None else f"{row['median_width_t']:.2f}"
                    print(f"| {name} | {row['n']} | {k} | {row['cover_bootstrap']:.3f} | {t_cov} | {width} |")
    if "slice" in tables:
        for sk in (int(x) for x in args.slice_k.split(",")):
            print(f"\nA slice's 95% E({sk}) interval covering the population's E({sk}), share of {args.reps} simulated "
                  f"slices (Monte-Carlo se {se:.3f} at 0.95), old / calibrated / t / new: "
                  + "; ".join(f"{m}: {d}" for m, d in SLICE_METHODS.items()) + "\n")
            table = {name: slice_coverage(b, ns, args.reps, sk, 0.95, args.seed + 7 + pi + 100 * (sk != 5))
                     for pi, (name, b) in enumerate(banks.items())}
            print("| prompts | " + " | ".join(f"{name} (E({sk}) = {truth:.2f})" for name, (_, truth) in table.items())
                  + " | median width, copying: old / calibrated / t / new | free: old / calibrated / t / new |")
            print("|---:|" + "---|" * len(table) + "---|---|")
            for i, n in enumerate(ns):
                cells = [" / ".join(f"{rows[i]['cover_' + m]:.3f}" for m in SLICE_METHODS) for rows, _ in table.values()]
                widths = [" / ".join(f"{table[p][0][i]['width_' + m]:.2f}" for m in SLICE_METHODS) for p in ("copying", "free")]
                print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(widths) + " |")
            print("\nlowest coverage over the populations (old / calibrated / t / new): "
                  + ", ".join(f"{n}: " + " / ".join(f"{min(rows[i]['cover_' + m] for rows, _ in table.values()):.3f}"
                                                     for m in SLICE_METHODS) for i, n in enumerate(ns)))
    if "marginal" in tables:
        m_ns = [n for n in (3, 8, 16) if n in ns] or [3, 8, 16]
        print(f"\nmarginal_table's 95% speedup CI covering the population's speedup (toy records as above, "
              f"every round drafting k, 10 timing repeats with 1% lognormal noise, plain 10 ms/token, round "
              f"12 + k ms), share of {args.marginal_reps} simulated tables (Monte-Carlo se "
              f"{math.sqrt(0.95 * 0.05 / args.marginal_reps):.3f}): old = joint percentile bootstrap, "
              f"new = E(k) drawn from its t interval on log(E - 1)\n")
        print("| population | prompts | k | speedup (truth) | old | new | old median width | new median width |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for pi, (name, b) in enumerate(banks.items()):
            rows, truth = marginal_coverage(b, m_ns, args.marginal_reps, (3, 5), 0.95, args.seed + 300 + pi)
            for row in rows:
                print(f"| {name} | {row['n']} | {row['k']} | {truth[row['k']]:.3f} | {row['cover_old']:.3f} | "
                      f"{row['cover_new']:.3f} | {row['width_old']:.3f} | {row['width_new']:.3f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["bias", "coverage"])
    ap.add_argument("--draws", type=int, default=None, help="texts and direct runs per prompt (bias 1500, coverage 120)")
    ap.add_argument("--reps", type=int, default=600, help="simulated checks per cell (coverage)")
    ap.add_argument("--population", type=int, default=24, help="toy prompts in the population (coverage)")
    ap.add_argument("--n", default="2,3,4,6,8,12,16,24,32,64", help="prompts per slice (coverage)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--copy", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=None, help="coverage: .npz of the banks (read if it exists, else written)")
    ap.add_argument("--tables", default="check,slice,marginal", help="coverage: which tables to print")
    ap.add_argument("--slice-k", default="5", help="coverage: the k of the slice E(k) tables (comma-separated)")
    ap.add_argument("--marginal-reps", type=int, default=300, help="coverage: simulated marginal tables per cell")
    args = ap.parse_args(argv)
    if args.draws is None:
        args.draws = 1500 if args.mode == "bias" else 60
    (run_bias if args.mode == "bias" else run_coverage)(args)


if __name__ == "__main__":
    main()

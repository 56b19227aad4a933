"""E_B(k) from the batched round chain (pipeline/speculation/batch_rounds.py) against the synchronised scheme run
directly, on acceptance that is not i.i.d.

Three layers. (1) Fixed per-row acceptance patterns (easy/hard blocks, a period, a prompt-lookup
[start, offset] matrix with starts that offer nothing, rows ending at different lengths) and the
engine's rules (a shared start, n_min + 1 kept, k shortened near max_new_tokens): the chain's
exact expectation against a vectorised simulation of the rounds at B = 2 and 4, tolerance 1e-2
with the Monte-Carlo standard error printed beside it (about 1e-3). The old batch_k formula
1 + sum_i prefix_i^B is shown to be off by far more. (2) Texts sampled from a position-indexed
target and draft, direct runs through the engine's own batched verify rule
(pipeline.decode.batched.verify_batch), the estimator fed only the texts: 4 Monte-Carlo standard
errors of the difference. (3) The real engine, greedy fp32: batched `generate` at B = 2 on the
tiny model with an ngram and a layerskip draft must take exactly the derived number of rounds
(greedy is deterministic given the texts; no EOS is set, so every row runs to max_new_tokens,
the case the chain is exact in without condition), and every round's verify width must be the
derived one. Seeds are fixed: the outcomes are deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.speculation.batch_rounds import batch_block, batch_chain, by_batch_blocks
from pipeline.decode.batched import verify_batch
from pipeline.decode.sampling import SamplingParams
from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows, round_chain

BLOCKS = np.tile(np.r_[np.full(12, 0.95), np.full(12, 0.15)], 10)
PERIODIC = np.tile(np.r_[0.95, 0.95, 0.95, 0.05], 60)
SHIFTED_BLOCKS = np.roll(BLOCKS, 7)


def _text(per_token, k_max, big_n, eos_at=None) -> TextAcceptance:
    n = big_n if eos_at is None else eos_at + 1
    acc = model_draft_rows(np.asarray(per_token, float)[: n - 1], k_max)
    return TextAcceptance(accept=acc, beta=acc, available=np.full(n - 1, k_max), tokens=n, max_new_tokens=big_n)


def _lookup_text(seed, k_max, big_n, eos_at=None) -> TextAcceptance:
    rng = np.random.default_rng(seed)
    n = big_n if eos_at is None else eos_at + 1
    acc = (rng.random((n - 1, k_max)) < np.linspace(0.9, 0.2, n - 1)[:, None]).astype(float)
    avail = rng.integers(0, k_max + 1, n - 1)
    acc *= np.arange(k_max)[None, :] < avail[:, None]
    for s in range(1, n):  # nothing past the end of the text
        acc[s - 1, n - s:] = 0.0
    return TextAcceptance(accept=acc, beta=acc, available=avail, tokens=n, max_new_tokens=big_n)


def _noisy_lookup_text(seed, k_max, big_n, eos_at=None) -> TextAcceptance:
    """A prompt-lookup row whose accepts are random draws (0.35-0.9 per offered position), so the
    path over starts, and with it the widths met, is random."""
    t = _lookup_text(seed, k_max, big_n, eos_at)
    rng = np.random.default_rng(seed + 1000)
    acc = np.where(t.accept > 0, rng.uniform(0.35, 0.9, t.accept.shape), 0.0)
    return TextAcceptance(accept=acc, beta=acc, available=t.available, tokens=t.tokens, max_new_tokens=big_n)


def _simulate_batch(texts: list[TextAcceptance], k: int, runs: int, seed: int,
                    hist: np.ndarray | None = None, widths: np.ndarray | None = None,
                    cost: np.ndarray | None = None) -> tuple[float, float]:
    """The synchronised scheme run directly (vectorised over runs): every row draws its own
    accepts along its matrix; the round keeps n_min + 1 over the rows still generating.
    -> (tokens per row-round, its Monte-Carlo SE by the delta method). hist ([k+1]), when given,
    counts n_min over the full-length rounds (k not shortened); widths ([k+1]) counts every round
    by its verify width (the engine's: the most any active row offers, at most k_s); cost ([k+1],
    ms by width) makes it return (ms per row-token, its SE) instead: the batch's total round time
    over the tokens each row emitted."""
    rng = np.random.default_rng(seed)
    big_n = texts[0].max_new_tokens
    ends = np.array([t.tokens for t in texts])
    n_max = int(ends.max())
    k_max = texts[0].accept.shape[1]
    pads = [np.concatenate([t.accept, np.zeros((n_max + k + 2 - t.accept.shape[0], k_max))]) for t in texts]
    avails = [np.concatenate([t.available, np.zeros(n_max + k + 2 - t.available.shape[0], dtype=int)])
              for t in texts]
    s = np.ones(runs, dtype=int)
    row_rounds, spent = np.zeros(runs), np.zeros(runs)
    while (going := s < n_max).any():
        active = s[:, None] < ends[None, :]  # [runs, B]
        k_s = np.minimum(k, big_n - s - 1)
        d = k_s.copy()
        widest = np.zeros(runs, dtype=int)
        for b in range(len(texts)):
            d = np.where(active[:, b], np.minimum(d, avails[b][s - 1]), d)
            widest = np.where(active[:, b], np.maximum(widest, np.minimum(k_s, avails[b][s - 1])), widest)
        width = np.clip(widest, 0, None)
        if widths is not None:
            np.add.at(widths, width[going], 1)
        if cost is not None:
            spent += going * cost[width]
        n_min = d.copy()
        for b in range(len(texts)):
            ok = rng.random((runs, k)) < pads[b][s - 1, :k]
            n_b = np.where((~ok).any(1), (~ok).argmax(1), k)
            n_min = np.where(active[:, b], np.minimum(n_min, n_b), n_min)
        row_rounds += going * active.sum(1)
        if hist is not None:
            np.add.at(hist, n_min[going & (k_s == k)], 1)
        s = np.where(going, s + n_min + 1, s)
    tokens = float((ends - 1).sum())
    if cost is not None:  # every row runs to the end here: tokens per row = tokens / B
        per_row = tokens / len(texts)
        return spent.mean() / per_row, spent.std(ddof=1) / np.sqrt(runs) / per_row
    mean, se = row_rounds.mean(), row_rounds.std(ddof=1) / np.sqrt(runs)
    return tokens / mean, tokens / mean**2 * se


def _old_formula(texts, k, batch, k_max):
    """pipeline/serving/batch_k.py before: 1 + sum_{i<=k} prefix_i^B with prefix from the k_max chain."""
    chains = [round_chain(t, k_max) for t in texts]
    prefix = sum(c.accepted for c in chains) / sum(c.full_rounds for c in chains)
    return 1.0 + float(np.sum(prefix[:k] ** batch))


CASES = {
    "blocks+periodic": lambda km, n: [_text(BLOCKS, km, n), _text(PERIODIC, km, n)],
    "blocks+shifted": lambda km, n: [_text(BLOCKS, km, n), _text(SHIFTED_BLOCKS, km, n)],
    "four mixed, two end early": lambda km, n: [_text(BLOCKS, km, n), _text(PERIODIC, km, n, eos_at=70),
                                                _lookup_text(3, km, n), _lookup_text(4, km, n, eos_at=41)],
    "four lookup": lambda km, n: [_lookup_text(s, km, n) for s in (5, 6, 7, 8)],
}
WIDTH_CASES = {
    **CASES,
    "two noisy lookup, one ends early": lambda km, n: [_noisy_lookup_text(9, km, n),
                                                      _noisy_lookup_text(10, km, n, eos_at=52)],
    "three noisy lookup": lambda km, n: [_noisy_lookup_text(s, km, n) for s in (11, 12, 13)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_batch_chain_matches_the_synchronised_scheme_run_directly(name):
    k_max, big_n = 5, 97
    texts = CASES[name](k_max, big_n)
    worst_old = 0.0
    for k in range(1, k_max + 1):
        chain = batch_chain(texts, k)
        derived = chain.tokens / chain.row_rounds
        direct, mc_se = _simulate_batch(texts, k, runs=20000, seed=100 + k)
        old = _old_formula(texts, k, len(texts), k_max)
        print(f"{name} B={len(texts)} k={k}: chain {derived:.4f}, simulated {direct:.4f} (MC se {mc_se:.4f}), "
              f"old formula {old:.4f}")
        assert mc_se < 2.5e-3
        assert abs(derived - direct) < 1e-2, (k, derived, direct)
        worst_old = max(worst_old, abs(old - direct))
    if "lookup" not in name:  # the non-i.i.d. patterns: the old formula is far off
        assert worst_old > 0.05  # >> the 1e-2 tolerance and ~100 MC standard errors


@pytest.mark.parametrize("name", ["blocks+periodic", "four mixed, two end early"])
def test_batch_chain_n_min_distribution_matches_the_scheme_run_directly(name):
    """accepted_distribution_by_batch (what the serving simulation draws a round of B rows from)
    against the n_min histogram of full-length rounds in direct runs: total variation < 0.02
    (the Monte-Carlo TV noise at ~10^5 rounds is ~0.005)."""
    k_max, big_n = 4, 97
    texts = CASES[name](k_max, big_n)
    for k in (1, 2, 4):
        hist = batch_chain(texts, k).histogram
        counts = np.zeros(k + 1)
        _simulate_batch(texts, k, runs=8000, seed=300 + k, hist=counts)
        tv = 0.5 * np.abs(hist / hist.sum() - counts / counts.sum()).sum()
        print(f"{name} k={k}: chain {np.round(hist / hist.sum(), 3)}, direct {np.round(counts / counts.sum(), 3)}, "
              f"TV {tv:.4f}")
        assert tv < 0.02, (k, tv)


@pytest.mark.parametrize("name", ["four mixed, two end early", "two noisy lookup, one ends early", "three noisy lookup"])
def test_batch_chain_width_distribution_matches_the_scheme_run_directly(name):
    """width_distribution_by_batch (what the batched round time is weighted by) against the verify
    widths of direct runs, every round: total variation < 0.02 (MC noise ~0.005), on lookup rows
    whose offers vary by start, and rows that end early."""
    k_max, big_n = 4, 97
    texts = WIDTH_CASES[name](k_max, big_n)
    for k in (1, 2, 4):
        chain = batch_chain(texts, k)
        counts = np.zeros(k + 1)
        _simulate_batch(texts, k, runs=8000, seed=500 + k, widths=counts)
        share, direct = chain.widths / chain.widths.sum(), counts / counts.sum()
        tv = 0.5 * np.abs(share - direct).sum()
        print(f"{name} k={k}: chain widths {np.round(share, 3)}, direct {np.round(direct, 3)}, TV {tv:.4f}")
        assert tv < 0.02, (k, tv)
        assert abs(chain.widths.sum() - chain.rounds) < 1e-9  # every round has one width


@pytest.mark.parametrize("name", ["three noisy lookup", "four lookup", "blocks+periodic"])
def test_width_weighted_round_cost_matches_the_time_of_direct_runs(name):
    """ms per row-token = sum_w share_w T(w) / E_B (pipeline/serving/batch_k.py) against the total round
    time of direct runs over the tokens each row emitted, with a round costing T(w) = 40 + 9 w ms
    by its verify width (rows run to max_new_tokens: the case where the two are the same
    quantity): within 1% and 4 MC standard errors. The time of rounds that verify nothing (what a
    latency run on prompts a lookup draft finds nothing in times) is far off: the bias this fixes."""
    k_max, big_n = 5, 97
    texts = WIDTH_CASES[name](k_max, big_n)
    t_w = 40.0 + 9.0 * np.arange(k_max + 1)
    for k in (1, 3, 5):
        chain = batch_chain(texts, k)
        e_b = chain.tokens / chain.row_rounds
        model = float(chain.widths / chain.widths.sum() @ t_w[: k + 1]) / e_b
        direct, se = _simulate_batch(texts, k, runs=8000, seed=700 + k, cost=t_w[: k + 1])
        empty = t_w[0] / e_b
        print(f"{name} k={k}: model {model:.3f} ms/token, direct {direct:.3f} (MC se {se:.3f}), "
              f"rounds that verify nothing {empty:.3f}")
        assert abs(model - direct) < max(0.01 * direct, 4 * se), (k, model, direct, se)
        assert empty < 0.9 * direct


def test_batch_one_is_the_acceptance_stages_expected_tokens_exactly():
    from pipeline.speculation.acceptance_stats import prompt_record, summarize_slice

    k_max, big_n = 4, 60
    texts = [_text(BLOCKS, k_max, big_n), _text(PERIODIC, k_max, big_n, eos_at=33), _lookup_text(1, k_max, big_n),
             _lookup_text(2, k_max, big_n, eos_at=20), _text(SHIFTED_BLOCKS[5:], k_max, big_n)]
    recs = [prompt_record(f"p{i}", "code", t, {k: round_chain(t, k) for k in range(1, k_max + 1)})
            for i, t in enumerate(texts)]
    summary = summarize_slice(recs, k_max)
    blocks = by_batch_blocks(texts, [2, 4], k_max, 0.95, 0)
    assert blocks["expected_tokens_per_round_by_batch"]["1"] == summary["expected_tokens_per_round"]  # bit for bit
    one = blocks["accepted_distribution_by_batch"]["1"]
    drafted = sum(np.asarray(r["drafted_rounds"][str(k)]) for r in recs for k in [k_max])
    assert np.allclose(blocks["width_distribution_by_batch"]["1"][str(k_max)], drafted / drafted.sum(), atol=1e-12)
    for k in range(1, k_max + 1):
        assert np.allclose(one[str(k)], summary["accepted_distribution"][str(k)], atol=1e-12)
        # At B = 1 the verify width is the drafted count: the shares the marginal stage weights by.
        drafted = sum(np.asarray(r["drafted_rounds"][str(k)], float) for r in recs)
        assert np.allclose(blocks["width_distribution_by_batch"]["1"][str(k)], drafted / drafted.sum(), atol=1e-12)
        jack = blocks["by_batch_jackknife"]["2"][str(k)]
        assert len(jack["tokens_per_round"]) == len(texts) == len(jack["width_share"])
        for b in ("2", "4"):  # a pmf over n_min = 0..k
            pmf = np.asarray(blocks["accepted_distribution_by_batch"][b][str(k)])
            assert pmf.shape == (k + 1,) and abs(pmf.sum() - 1) < 1e-12 and (pmf >= 0).all()
    assert set(blocks["expected_tokens_per_round_by_batch"]) == {"1", "2", "4"}
    for b in ("2", "4"):
        e_b, ci = blocks["expected_tokens_per_round_by_batch"][b], blocks["expected_tokens_per_round_by_batch_ci"][b]
        for k in range(1, k_max + 1):
            assert 1.0 <= ci[str(k)][0] <= e_b[str(k)] <= ci[str(k)][1] <= k + 1
            assert e_b[str(k)] <= blocks["expected_tokens_per_round_by_batch"]["1"][str(k)] + 0.05
    design = blocks["by_batch_design"]["4"]
    assert design["groups"] == design["partitions"] * (5 // 4) and design["prompts"] == 5
    assert batch_block(texts[:3], 4, k_max)["expected_tokens_per_round"] is None  # fewer prompts than B


def _position_model(length, vocab, hard, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(length, vocab, generator=g) * 1.5, -1)
    other = torch.softmax(torch.randn(length, vocab, generator=g) * 1.5, -1)
    q = torch.where(torch.as_tensor(hard)[:, None], 0.3 * p + 0.7 * other.roll(1, -1), 0.9 * p + 0.1 * other)
    return p, q


def test_estimator_on_sampled_texts_matches_runs_through_the_batched_verify_rule():
    """Two rows with different position models (blocks of 8 vs a period of 3), B = 2, T = 1."""
    big_n, vocab, k_max, runs = 32, 4, 3, 300
    models = [_position_model(big_n, vocab, (np.arange(big_n) // 8) % 2 == 1, 0),
              _position_model(big_n, vocab, np.arange(big_n) % 3 == 2, 1)]
    g = torch.Generator().manual_seed(2)
    rows = torch.arange(big_n)
    texts = []
    for p, q in models:  # lossless: each row's text is distributed as its p
        x_all = torch.multinomial(p, runs, replacement=True, generator=g).T
        texts.append([_text(torch.clamp(q[rows, x] / p[rows, x], max=1.0).numpy()[1:], k_max, big_n) for x in x_all])
    params = SamplingParams(1.0)
    for k in (1, 3):
        derived_rr = np.array([batch_chain([a, b], k).row_rounds for a, b in zip(*texts)])
        g = torch.Generator().manual_seed(30 + k)
        direct_rr = np.zeros(runs)
        for r in range(runs):
            s = 1
            while s < big_n:
                k_s = min(k, big_n - s - 1)
                ps = torch.stack([p[s: s + k_s + 1] for p, _ in models])  # [2, k_s+1, V]
                qs = torch.stack([q[s: s + k_s] for _, q in models])  # [2, k_s, V]
                d = (torch.multinomial(qs.reshape(-1, vocab), 1, generator=g).reshape(2, k_s) if k_s
                     else torch.zeros(2, 0, dtype=torch.long))
                if k_s:
                    v = verify_batch(ps, qs, d, torch.full((2,), k_s), torch.ones(2, dtype=torch.bool), params, g)
                    kept = v.kept
                else:
                    kept = 0
                s += kept + 1
                direct_rr[r] += 2
        tokens = 2 * (big_n - 1)
        derived, direct = tokens / derived_rr.mean(), tokens / direct_rr.mean()
        se_d = derived / derived_rr.mean() * derived_rr.std(ddof=1) / np.sqrt(runs)
        se_x = direct / direct_rr.mean() * direct_rr.std(ddof=1) / np.sqrt(runs)
        tol = 4 * np.hypot(se_d, se_x)
        print(f"B=2 k={k}: derived {derived:.4f} +- {se_d:.4f}, direct {direct:.4f} +- {se_x:.4f}, tol {tol:.4f}")
        assert 1.1 < derived < k + 0.9
        assert abs(derived - direct) < tol, (k, derived, direct, tol)


@pytest.mark.parametrize("draft_kind", ["ngram", "layerskip:2"])
def test_real_engine_greedy_batch_of_two_takes_exactly_the_derived_rounds(tiny_model, tiny_tokenizer, draft_kind):
    from draft_models.layerskip import truncate
    from pipeline.latency.batched import batch_prompts, round_width
    from pipeline.decode.drafts import ModelDraft, NgramDraft
    from pipeline.decode.engine import generate
    from pipeline.speculation.teacher_forced import score_text

    draft = (NgramDraft("ngram") if draft_kind == "ngram" else
             ModelDraft(draft_kind, truncate(tiny_model, 2), tiny_model.config.vocab_size))
    big_n, k_max, greedy = 24, 4, SamplingParams(0.0)
    checked, widths_seen = 0, set()
    for offset in (0, 2):
        ids = batch_prompts(tiny_tokenizer, 2, offset=offset)
        plain = [generate(tiny_model, ids[b:b + 1], big_n).tokens for b in range(2)]
        texts = [score_text(tiny_model, draft, ids[b].tolist(), plain[b], greedy, k_max, big_n) for b in range(2)]
        for k in (1, 2, 4):
            res = generate(tiny_model, ids, big_n, draft=draft, k=k)
            assert res.batch_tokens == plain  # greedy at B = 2 is plain greedy per row (the precondition)
            chain = batch_chain(texts, k)
            print(f"{draft_kind} prompts {offset}-{offset + 1} k={k}: derived rounds {chain.rounds}, "
                  f"engine {len(res.rounds)}; tokens/row-round {chain.tokens / chain.row_rounds:.4f}")
            assert chain.rounds == len(res.rounds)
            assert chain.row_rounds == sum(sum(r.active) for r in res.rounds)
            # The verify width of every round (what its forward pass costs), as the engine ran it.
            engine_widths = np.bincount([round_width(r) for r in res.rounds], minlength=k + 1)
            assert np.array_equal(chain.widths, engine_widths), (chain.widths, engine_widths)
            widths_seen.update(round_width(r) for r in res.rounds)
            checked += any(r.kept > 0 for r in res.rounds)
    assert checked > 0  # some round kept a draft: the check is not on plain steps only
    if draft_kind == "ngram":  # rounds where lookup offered nothing and rounds where it offered some
        assert 0 in widths_seen and max(widths_seen) >= 1, widths_seen


def test_prompt_jackknife_interval_covers_on_clustered_prompts():
    """Coverage of the E_B(k) interval by simulation. A population of 300 synthetic prompts, each
    its own easy/hard level and block length (so rounds cluster within a prompt) and 30% ending
    early (EOS); the target is the population's E_4(k) (all 300 prompts, 75 groups x 8
    partitions). 200 samples of 12 prompts, B = 4: the nominal 95% interval must cover at k = 1
    and 3 at a rate >= 0.90 (Monte-Carlo SE of a rate of 0.95 over 200 samples: 0.015; 0.90 is
    3 SE below; measured when written: 0.955 and 0.95)."""
    k_max, big_n = 3, 40

    def prompt(rng):
        easy, hard, block = rng.uniform(0.6, 0.98), rng.uniform(0.0, 0.4), rng.integers(3, 10)
        pattern = np.where((np.arange(big_n) // block) % 2 == 0, easy, hard)
        return _text(pattern, k_max, big_n, eos_at=None if rng.random() < 0.7 else int(rng.integers(9, big_n - 1)))

    rng = np.random.default_rng(0)
    population = [prompt(rng) for _ in range(300)]
    truth = batch_block(population, 4, k_max, seed=1)["expected_tokens_per_round"]
    hits, samples = {"1": 0, "3": 0}, 200
    for r in range(samples):
        idx = rng.choice(len(population), 12, replace=False)
        ci = batch_block([population[i] for i in idx], 4, k_max, 0.95, seed=r)["ci"]
        for k in hits:
            hits[k] += ci[k][0] <= truth[k] <= ci[k][1]
    print("coverage", {k: v / samples for k, v in hits.items()})
    assert all(v / samples >= 0.90 for v in hits.values()), hits

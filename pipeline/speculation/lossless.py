"""The acceptance stage's lossless checks: speculative decoding must not change what is generated.

    from pipeline.speculation.lossless import lossless_checks
    lossless_checks(model, prompts, draft, cfg, seed, texts, greedy_runs)

Greedy: every direct greedy run must match the target's plain greedy text; in a reduced precision
a divergence at a near-tie is forgiven within a tolerance measured on the model. Sampled: the first
verified token, speculative against plain, by a two-sample chi-square. docs/methods/acceptance.md.
"""
from __future__ import annotations

import copy
import weakref

import numpy as np
import torch
from scipy import stats

from pipeline.decode.cache import CachedModel, hf_model
from pipeline.decode.drafts import Draft, ModelDraft
from pipeline.decode.engine import generate, speculative_step
from pipeline.decode.sampling import SamplingParams, logits_to_probs, pick
from pipeline.decode.timing import Timer
from pipeline.speculation.teacher_forced import last_logits

# The sampled check (both engines) fails at p <= LOSSLESS_ALPHA, drawn at LOSSLESS_TEMPERATURE.
LOSSLESS_ALPHA = 0.001
LOSSLESS_TEMPERATURE = 1.0


def two_sample_chi2(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of token ids share one distribution; tokens
    with fewer than 10 draws in total are pooled into one category."""
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    rare = table.sum(0) < 10
    if rare.any():
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0  # one category: the samples agree entirely
    return float(stats.chi2_contingency(table)[1])


@torch.inference_mode()
def first_verified_tokens(model, ids: list[int], draft: Draft, sampling: SamplingParams, generator,
                          samples: int, k: int = 1) -> list[int]:
    """`samples` draws of the second output token of a speculative run at draft length k."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    length = len(ids)
    cached = CachedModel(model, batch=1, max_len=length + k + 2)
    first_probs = logits_to_probs(cached.forward(x, all_logits=False)[:, -1], sampling)  # [1, V]
    off = Timer(device, enabled=False)
    # A model draft's prompt is prefilled once and rolled back like the target's.
    rewind = isinstance(draft, ModelDraft)
    out = []
    for i in range(samples):
        cached.rollback(length)  # the prompt stays; this sample's round overwrites the rest
        first = pick(first_probs, sampling, generator)  # [1], as the engine's prefill picks it
        if rewind and i:
            draft.cached.rollback(length)
        else:
            draft.prefill(x, length + k + 2)
        new = speculative_step(cached, draft, torch.cat([x[0], first]), k, sampling, generator, off)[0]
        out.append(new[0])
    return out


TIE_CALIBRATION_PROMPTS = 2
TIE_TOP_TOKENS = 16  # per position, the logits whose movement the noise is measured on


def _teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 logits [n, V]: row j predicts tokens[j] from prompt + tokens[:j] (one forward, no cache)."""
    device = next(hf_model(model).parameters()).device
    return last_logits(model, torch.tensor([list(prompt) + list(tokens[:-1])], device=device), len(tokens))


def _engine_logits(model, prompt: list[int], tokens: list[int], width: int) -> torch.Tensor:
    """The same rows as _teacher_forced_logits, as the engine computes them: a prefill, then
    forwards of `width` tokens on the static cache (1: decode steps; k + 1: verifies)."""
    device = next(hf_model(model).parameters()).device
    cached = CachedModel(model, batch=1, max_len=len(prompt) + len(tokens) + 1)
    rows = [cached.prefill(torch.tensor([list(prompt)], device=device))[0, -1:]]
    feed = list(tokens[:-1])
    for i in range(0, len(feed), width):
        rows.append(cached.forward(torch.tensor([feed[i:i + width]], device=device), all_logits=True)[0])
    return torch.cat(rows)


def dtype_resolution(dtype: torch.dtype, largest: float) -> float:
    """The spacing of representable numbers of `dtype` at magnitude `largest` (one ulp)."""
    return float(torch.finfo(dtype).eps * 2.0 ** np.floor(np.log2(max(largest, 1e-30))))


@torch.inference_mode()
def tie_tolerance(model, samples: list[tuple[list[int], list[int]]], widths: list[int]) -> dict:
    """How far one logit moves between the engine's forward widths and the teacher-forced forward,
    over samples (prompt ids, plain greedy text), and the tolerance that follows."""
    dtype = next(hf_model(model).parameters()).dtype
    noise, largest = 0.0, 0.0
    for prompt, tokens in samples:
        if len(tokens) < 2:
            continue
        ways = [_teacher_forced_logits(model, prompt, tokens)]
        ways += [_engine_logits(model, prompt, tokens, w) for w in sorted(set(widths))]
        # The logits that compete for the argmax: each position's TIE_TOP_TOKENS largest.
        top = ways[0].topk(min(TIE_TOP_TOKENS, ways[0].shape[-1]), dim=-1).indices
        ways = [w.gather(-1, top) for w in ways]
        largest = max(largest, float(ways[0].abs().max()))
        for a in range(len(ways)):
            for b in range(a + 1, len(ways)):
                noise = max(noise, float((ways[a] - ways[b]).abs().max()))
    floor = 2 * dtype_resolution(dtype, largest)
    return {"dtype": str(dtype).replace("torch.", ""), "logit_noise": noise, "largest_logit": largest,
            "resolution": dtype_resolution(dtype, largest), "tolerance": max(2 * noise, floor),
            "calibration": f"max |logit difference| of each position's {TIE_TOP_TOKENS} largest logits, over "
                           f"{len(samples)} plain texts, between a teacher-forced forward and engine forwards "
                           f"of width {sorted(set(widths))}; tolerance = max(2 x noise, 2 units of the dtype's "
                           "resolution at the largest of those logits)"}


_TOLERANCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def shared_tie_tolerance(model, samples: list[tuple[list[int], list[int]]], widths: list[int]) -> dict:
    """tie_tolerance, once per target model, texts and widths (every draft of the target shares it)."""
    key = (tuple((tuple(p), tuple(t)) for p, t in samples), tuple(sorted(set(widths))))
    memo = _TOLERANCES.setdefault(hf_model(model), {})
    if key not in memo:
        memo[key] = tie_tolerance(model, samples, widths)
    return copy.deepcopy(memo[key])


@torch.inference_mode()
def judge_divergence(model, prompt: list[int], plain: list[int], spec: list[int], at: int, tolerance: float) -> dict:
    """Is the divergence at index `at` a near-tie: the plain token at `at` and every speculative
    token from there within `tolerance` of their position's largest (teacher-forced) logit?"""
    logits = _teacher_forced_logits(model, prompt, spec)  # row j predicts spec[j]
    rows = logits[at:]
    top = rows.max(-1).values
    chosen = rows.gather(-1, torch.tensor(spec[at:], device=rows.device).unsqueeze(-1)).squeeze(-1)
    shortfall = (top - chosen).cpu()
    gap = float(logits[at, plain[at]] - logits[at, spec[at]]) if at < len(plain) else 0.0
    plain_short = float(top[0] - logits[at, plain[at]]) if at < len(plain) else 0.0
    worst = int(shortfall.argmax()) if shortfall.numel() else 0
    largest = max(float(shortfall.max()) if shortfall.numel() else 0.0, plain_short)
    return {"gap": gap, "plain_shortfall": plain_short, "max_shortfall": largest,
            "max_shortfall_index": at + worst, "explained": largest <= tolerance}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where a and b differ; the shorter length when one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _greedy_mismatches(texts: dict[str, list[int]], runs: dict[int, dict], prompts: dict) -> list[dict]:
    out = []
    for k, by_prompt in sorted(runs.items()):
        for rows in prompts.values():
            for pid, ids in rows:
                plain, spec = texts[pid], by_prompt[pid]["output"]
                if plain != spec:
                    at = first_difference(plain, spec)
                    out.append({"prompt": pid, "k": k, "index": at, "plain": plain[at:at + 3],
                                "speculative": spec[at:at + 3], "_ids": ids, "_plain": plain, "_spec": spec})
    return out


def greedy_check(model, prompts: dict, plain: dict[str, list[int]], greedy_runs: dict) -> dict:
    """The greedy half: identical, or every divergence a near-tie, on the prompts every greedy run
    covers; with none the verdicts are None (not checked)."""
    compared = {kind: [(pid, ids) for pid, ids in rows if pid in plain and all(pid in r for r in greedy_runs.values())]
                for kind, rows in prompts.items()}
    n_compared = sum(map(len, compared.values()))
    mismatches = _greedy_mismatches(plain, greedy_runs, compared)
    rule = None
    if mismatches:
        samples = [(ids, plain[pid]) for rows in compared.values() for pid, ids in rows][:TIE_CALIBRATION_PROMPTS]
        rule = shared_tie_tolerance(model, samples, [1] + [k + 1 for k in greedy_runs])
        for m in mismatches:
            ids, p, s = m.pop("_ids"), m.pop("_plain"), m.pop("_spec")
            if m["index"] >= min(len(s), len(p)):
                # One output is a prefix of the other: no near-tie explains that.
                m.update({"gap": None, "max_shortfall": None, "explained": False})
                continue
            m.update(judge_divergence(model, ids, p, s, m["index"], rule["tolerance"]))
    unexplained = sum(not m["explained"] for m in mismatches)
    checked = n_compared > 0 and bool(greedy_runs)
    return {"greedy_identical": not mismatches if checked else None,
            "greedy_lossless": unexplained == 0 if checked else None,
            "divergences": len(mismatches), "unexplained": unexplained, "tie_rule": rule,
            "mismatches": mismatches, "prompts": n_compared,
            "prompts_skipped": [pid for kind, rows in prompts.items() for pid, _ in rows
                                if pid not in {p for p, _ in compared[kind]}]}


def sampling_check(model, prompts: dict, draft: Draft, cfg, seed: int) -> dict:
    """The sampled half: the first verify-emitted token, speculative vs plain, on the first prompt."""
    device = next(model.parameters()).device
    params = SamplingParams(LOSSLESS_TEMPERATURE, cfg.sampling.top_k, cfg.sampling.top_p)
    ids = next(iter(prompts.values()))[0][1]
    g = torch.Generator(device).manual_seed(seed + 1)
    m = cfg.lossless_samples
    plain_second = [row[1] for row in
                    generate(model, torch.tensor([ids] * m, device=device), 2, sampling=params, generator=g).tokens]
    spec_second = first_verified_tokens(model, ids, draft, params, g, m)
    p_value = two_sample_chi2(plain_second, spec_second)
    return {"test": "two-sample chi-square on the first verify-emitted token (k = 1)",
            "temperature": params.temperature, "samples": m, "p_value": p_value,
            "alpha": LOSSLESS_ALPHA, "pass": p_value > LOSSLESS_ALPHA}


def lossless_checks(model, prompts: dict, draft: Draft, cfg, seed: int, plain: dict[str, list[int]],
                    greedy_runs: dict, sampling: dict | None = None) -> dict:
    """plain: prompt id -> greedy output; greedy_runs: k -> prompt id -> direct run; sampling:
    sampling_check's block if already run."""
    greedy = greedy_check(model, prompts, plain, greedy_runs)
    if sampling is None:
        sampling = sampling_check(model, prompts, draft, cfg, seed)
    return {
        **greedy,
        "greedy_k": sorted(greedy_runs),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "sampling": sampling,
    }

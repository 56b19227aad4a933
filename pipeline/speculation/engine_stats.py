"""Acceptance and losslessness from a serving engine's own per-request counts (vLLM).

    from pipeline.speculation.engine_stats import request_record, summarize_requests, greedy_lossless
    rec = request_record(pid, category, completion_json, k)      # one streamed request at draft length k
    block = summarize_requests([rec, ...], k, confidence)          # per-position rates, E(k), CIs over prompts

Two definitions, never mixed: specq's E[tokens per step] counts every decode step (as the
acceptance stage does); vLLM's mean acceptance length, 1 + accepted / drafts, only the drafted
steps. Steps come from the stream, one chunk per engine step. Method: docs/methods/vllm-engine.md.
"""
from __future__ import annotations

import numpy as np

from pipeline.speculation.lossless import first_difference, two_sample_chi2
from pipeline.speculation.acceptance_stats import MIN_PROMPTS, rate_interval, ratio_t_interval


def steps_from_counts(tokens: int, accepted: list[int]) -> int:
    """Decode steps implied by the tokens and the drafted steps' accepted counts (each drafted step
    emits 1 + accepted, each other step 1; a lower bound when the last step was cut)."""
    return len(accepted) + max(0, tokens - 1 - sum(a + 1 for a in accepted))


def request_record(pid: str, category: str, comp: dict, k: int) -> dict:
    """One request's counts. comp: client.Completion.to_json(); k: num_speculative_tokens (0: plain)."""
    step_ids = comp["step_ids"]
    tokens = sum(len(s) for s in step_ids)
    spec = comp.get("spec") or {}
    accepted = list(spec.get("per_step_accepted") or [])
    drafted = list(spec.get("per_step_drafted") or [])
    stream_steps = len(step_ids) - 1  # the first chunk is the prefill's token
    counted = steps_from_counts(tokens, accepted)
    # A stream step carries at most k + 1 tokens; more means merged chunks: trust the counts.
    merged = any(len(s) > k + 1 for s in step_ids[1:]) or stream_steps < len(accepted)
    steps = counted if merged else stream_steps
    times = comp["step_times"]
    return {
        "id": pid, "category": category, "tokens": tokens, "decode_tokens": tokens - 1, "steps": steps, "stream_steps": stream_steps,
        "steps_from": "counts" if merged else "stream", "drafts": len(accepted),
        "accepted": int(sum(accepted)), "draft_tokens": int(sum(drafted)),
        # per position i = 1..k: drafted steps that offered i tokens / accepted positions 1..i
        "offered_per_pos": [sum(d >= i for d in drafted) for i in range(1, k + 1)],
        "accepted_per_pos": [sum(a >= i for a in accepted) for i in range(1, k + 1)],
        "reached_per_pos": [sum(d >= i and a >= i - 1 for a, d in zip(accepted, drafted)) for i in range(1, k + 1)],
        "ttft_ms": times[0] * 1e3, "e2e_ms": times[-1] * 1e3,
        "tpot_ms": (times[-1] - times[0]) / (tokens - 1) * 1e3 if tokens > 1 else None,
        "decode_ms": (times[-1] - times[0]) * 1e3,
        "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
        "finish_reason": comp.get("finish_reason"),
        "output": [t for s in step_ids for t in s],
    }


def summarize_requests(records: list[dict], k: int, confidence: float = 0.95) -> dict:
    """Per-position rates and E[tokens per step] in both definitions, with t intervals over prompts."""
    tokens = np.array([r["tokens"] - 1 for r in records], float)  # emitted by decode steps
    steps = np.array([r["steps"] for r in records], float)
    drafts = np.array([r["drafts"] for r in records], float)
    acc = np.array([r["accepted"] for r in records], float)
    e = float(tokens.sum() / steps.sum()) if steps.sum() > 0 else 1.0
    mal = float(1 + acc.sum() / drafts.sum()) if drafts.sum() > 0 else None
    per_position = []
    for i in range(k):
        a = np.array([r["accepted_per_pos"][i] for r in records], float)
        reached = np.array([r["reached_per_pos"][i] for r in records], float)
        per_position.append({
            "position": i + 1,
            "prefix": float(a.sum() / steps.sum()) if steps.sum() else None,
            "prefix_ci": rate_interval(a, steps, confidence),
            "per_draft": float(a.sum() / drafts.sum()) if drafts.sum() else None,
            "per_draft_ci": rate_interval(a, drafts, confidence) if drafts.sum() else None,
            "conditional": float(a.sum() / reached.sum()) if reached.sum() else None,
            "ci": rate_interval(a, reached, confidence) if reached.sum() else None,
            "accepted": float(a.sum()), "reached": float(reached.sum()),
        })
    return {
        "expected_tokens_per_step": e,
        "expected_tokens_per_step_ci": ratio_t_interval(tokens, steps, e, confidence, (1.0, k + 1.0), log_above=1.0),
        "mean_acceptance_length": mal,
        "mean_acceptance_length_ci": (ratio_t_interval(drafts + acc, drafts, mal, confidence, (1.0, k + 1.0),
                                                       log_above=1.0) if mal is not None else None),
        "drafted_share": float(drafts.sum() / steps.sum()) if steps.sum() else 0.0,
        "per_position": per_position,
        "decode_tokens": int(tokens.sum()), "steps": int(steps.sum()), "drafts": int(drafts.sum()),
        "accepted": int(acc.sum()), "prompts": len(records),
        "few_prompts": len(records) < MIN_PROMPTS, "steps_from_counts": sum(r["steps_from"] == "counts" for r in records),
        "ci_unit": "prompt",
    }


def percentiles(xs: list[float], qs=(50, 90, 99)) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {f"p{q}": float(np.percentile(xs, q)) for q in qs} | {"mean": float(np.mean(xs)), "n": len(xs)}


def latency_summary(records: list[dict], wall_s: float | None = None) -> dict:
    """TTFT, TPOT and ITL percentiles over requests (ITL over every chunk gap), and throughput."""
    out = {"ttft_ms": percentiles([r["ttft_ms"] for r in records]),
           "tpot_ms": percentiles([r["tpot_ms"] for r in records]),
           "itl_ms": percentiles([x for r in records for x in r["itl_ms"]]),
           "requests": len(records), "output_tokens": int(sum(r["tokens"] for r in records))}
    if wall_s:
        out.update(wall_s=wall_s, output_tokens_per_s=out["output_tokens"] / wall_s, requests_per_s=len(records) / wall_s)
    return out


# ---------------------------------------------------------------- lossless, from the engine's logprobs

# The smallest tie tolerance, in nats (two units of bf16's resolution at a logit near 16).
FLOOR_NATS = 0.125


def logprob_noise(plain: list[dict | None], spec: list[dict | None], upto: int) -> float:
    """Largest |log p_plain(t) - log p_spec(t)| of the same token and position before the texts part."""
    out = 0.0
    for a, b in zip(plain[:upto], spec[:upto]):
        if a and b and a.get("logprob") is not None and b.get("logprob") is not None:
            out = max(out, abs(a["logprob"] - b["logprob"]))
    return out


def judge_divergence(plain_out: list[int], spec_out: list[int], plain_lp: list[dict | None],
                     spec_lp: list[dict | None], tolerance: float) -> dict:
    """Where two greedy texts first differ, and whether it is a near-tie (the rule greedy_lossless states)."""
    i = first_difference(plain_out, spec_out)
    if i == min(len(plain_out), len(spec_out)):
        if len(plain_out) == len(spec_out):
            return {"identical": True}
        return {"identical": False, "at": i, "explained": True, "note": "one text is a prefix of the other (a stop)"}
    a, b = plain_out[i], spec_out[i]
    here = plain_lp[i] if i < len(plain_lp) else None
    gap = None
    if here and b in here.get("top", {}) and a in here.get("top", {}):
        gap = float(here["top"][a] - here["top"][b])
    shortfall = 0.0
    for lp in spec_lp[i:]:
        if lp and lp.get("top") and lp.get("logprob") is not None:
            shortfall = max(shortfall, float(max(lp["top"].values()) - lp["logprob"]))
    explained = gap is not None and abs(gap) <= tolerance and shortfall <= tolerance
    return {"identical": False, "at": i, "plain_token": a, "token": b, "logprob_gap": gap,
            "largest_shortfall_after": shortfall, "explained": bool(explained)}


def greedy_lossless(plain: dict[str, dict], spec: dict[str, dict]) -> dict:
    """Greedy speculative vs plain outputs of the same engine, per prompt id (each {"output",
    "logprobs"}). The tolerance is twice the engine's own logprob noise, at least FLOOR_NATS."""
    ids = [p for p in spec if p in plain]
    noise = 0.0
    for p in ids:
        upto = first_difference(plain[p]["output"], spec[p]["output"])
        noise = max(noise, logprob_noise(plain[p].get("logprobs") or [], spec[p].get("logprobs") or [], upto))
    tolerance = max(2 * noise, FLOOR_NATS)
    verdicts = {p: judge_divergence(plain[p]["output"], spec[p]["output"], plain[p].get("logprobs") or [],
                                    spec[p].get("logprobs") or [], tolerance) for p in ids}
    diverged = {p: v for p, v in verdicts.items() if not v["identical"]}
    return {"prompts": len(ids), "identical": len(ids) - len(diverged), "diverged": diverged,
            "logprob_noise": noise, "tolerance": tolerance,
            "greedy_identical": not diverged, "greedy_lossless": all(v["explained"] for v in diverged.values()),
            "rule": "a divergence is a near-tie when the speculative token lies within the tolerance of the plain "
                    "token in the plain run's distribution and every later speculative token within the tolerance "
                    "of its own verify distribution's top; tolerance = 2 x the largest logprob difference of "
                    f"the same token between the two runs before they part (at least {FLOOR_NATS})"}


def sampled_lossless(plain: list[list[int]], spec: list[list[int]], alpha: float) -> dict:
    """Sampled completions of one prompt, plain vs speculative: a two-sample chi-square of the token
    at each position after the prefill's, Bonferroni over the positions."""
    n = min(min(map(len, plain)), min(map(len, spec)))
    pvals = [two_sample_chi2([s[j] for s in plain], [s[j] for s in spec]) for j in range(1, n)]
    p = min(1.0, min(pvals) * len(pvals)) if pvals else 1.0
    return {"test": f"two-sample chi-square per output position 2..{n} (Bonferroni over {len(pvals)})",
            "samples": [len(plain), len(spec)], "p_values": pvals, "p_value": p, "alpha": alpha,
            "passed": bool(p > alpha)}

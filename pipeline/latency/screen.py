"""Screening a (target, draft) pair before it is timed: an upper bound on its speedup at every k,
from acceptance's upper CI and a probe of a few seconds.

    from pipeline.latency.screen import screen_pair
    rec = screen_pair(model, draft, prompt_ids, ks, acceptance_json, acc_cfg, device, cache_len)
    rec["verdict"]      # "does not pay" (the bound is below 1 at every k) or "may pay"

upper_speedup(k) = E_hi(k) x T_plain_hi / (T_verify_lo(k + 1) + T_draft_lo(k)), each term taken in
the direction that keeps a pair timed: a pair below 1 at every k cannot have a k recommended, and
one that may pay is timed only at the k whose bound reaches 1 (`ks_to_time`). Prompt lookup is
never screened. The terms, and when the screen is off: docs/methods/marginal.md.
"""
from __future__ import annotations

import time

import torch

from pipeline.decode.cache import CachedModel
from pipeline.decode.engine import generate, prefill
from pipeline.decode.sampling import SamplingParams, logits_to_probs
from pipeline.decode.timing import Timer, synchronize
from pipeline.speculation.measure import sampling_of

PROBE_REPEATS = 3  # timed repeats of every probe measurement (plus PROBE_WARMUP untimed)
PROBE_WARMUP = 1
PLAIN_STEPS = 8  # plain decode steps per plain-probe run (after the first token): a repeat is their mean
DOES_NOT_PAY, MAY_PAY = "does not pay", "may pay"
FORMULA = "upper_speedup(k) = E_hi(k) x T_plain_hi / (T_verify_lo(k+1) + T_draft_lo(k))"
ASSUMES = [
    "a round costs at least the draft's k-token proposal plus one target forward of width k + 1 "
    "(the accept rule, host transfer and bookkeeping only add to it)",
    "tokens per round are at most the upper end of the acceptance CI of E(k) on the pooled slice 'all' "
    "(largest over temperatures; k + 1 where there is no CI), so the bound holds at the CI's level, not surely",
    "plain ms/token is at most the largest probe repeat (engine.generate without a draft, hottest temperature, "
    "the timed runs' static cache length); the round's parts at least the smallest probe repeat (greedy); a "
    "pair is screened only when a second probe, pooled with the first, agrees",
    "the probe runs eagerly, as the timed steps do",
]
MODEL_FREE = ("the draft proposes without a model forward (prompt lookup): a round that drafts nothing is a "
              "plain decode step, so a round costs at least a plain step and the bound E_hi(k) x T_plain_hi / "
              "T_plain_lo is at least 1; never screened, not probed")


def e_upper(acceptance: dict | None, ks: list[int], slice_name: str = "all") -> dict[int, dict]:
    """k -> {"e_hi", "by_temperature": {t: hi}, "source"}: the upper CI end of E(k) on the slice,
    the largest over temperatures; k + 1 where the acceptance JSON has no CI at k."""
    temps = ((acceptance or {}).get("slices") or {}).get(slice_name) or {}
    out = {}
    for k in ks:
        by_t = {}
        for t, block in temps.items():
            ci = (block.get("expected_tokens_per_round_ci") or {}).get(str(k))
            by_t[t] = float(ci[1]) if ci and ci[1] is not None else None
        if by_t and None not in by_t.values():
            out[k] = {"e_hi": max(by_t.values()), "by_temperature": by_t, "source": f"acceptance CI, slice {slice_name}"}
        else:
            out[k] = {"e_hi": float(k + 1), "by_temperature": by_t,
                      "source": "k + 1, the most a round can emit (no acceptance CI at this k)"}
    return out


@torch.inference_mode()
def probe_costs(model, draft, ids: torch.Tensor, ks: list[int], cache_len: int, plain_sampling: SamplingParams,
                repeats: int = PROBE_REPEATS, warmup: int = PROBE_WARMUP, seed: int = 0) -> dict:
    """Probe timings (ms) per repeat for one model draft at ids [1, T] on a static cache of at least
    `cache_len` positions: `plain_ms` (plain ms/token), `verify_ms[k + 1]`, `draft_ms[k]`, and the
    `cache_len` used."""
    device = next(model.parameters()).device
    b, t = ids.shape
    cache_len = max(cache_len, t + PLAIN_STEPS + 2, t + max(ks) + 2)
    ids = ids.to(device)
    greedy = SamplingParams(0.0)
    out = {"cache_len": cache_len, "plain_ms": [], "verify_ms": {str(k + 1): [] for k in ks},
           "draft_ms": {str(k): [] for k in ks}}
    for r in range(warmup + repeats):
        keep = r >= warmup
        g = torch.Generator(device).manual_seed(seed * 7919 + r)
        res = generate(model, ids, PLAIN_STEPS + 1, sampling=plain_sampling, generator=g, cache_len=cache_len)
        if keep:
            out["plain_ms"].append(res.decode_s / PLAIN_STEPS * 1e3)
        target = CachedModel(model, batch=b, max_len=cache_len, exact=True)
        first = prefill(target, ids, greedy, None)  # [B]
        draft.prefill(ids, cache_len, exact=True)
        seqs = torch.cat([ids, first.unsqueeze(1)], 1)  # [B, T + 1]
        timer = Timer(device)
        marks = []
        for k in ks:
            with timer.measure("draft") as m_draft:
                d, _ = draft.propose(seqs[0], k, greedy, None)
                d = d.view(1, -1)
            _rewind(draft, ids, cache_len, t)
            with timer.measure("verify") as m_verify:
                logits = target.forward(torch.cat([seqs[:, -1:], d.to(device)], 1), all_logits=True)
                logits_to_probs(logits, greedy)
            target.rollback(t)
            marks.append((k, m_draft, m_verify))
        timer.collect()
        if keep:
            for k, m_draft, m_verify in marks:
                out["draft_ms"][str(k)].append(m_draft.seconds * 1e3)
                out["verify_ms"][str(k + 1)].append(m_verify.seconds * 1e3)
    synchronize(device)
    return out


def _rewind(drafter, ids: torch.Tensor, cache_len: int, t: int) -> None:
    """The draft's cache back to the prompt (T positions), untimed."""
    cached = getattr(drafter, "cached", None)
    if isinstance(cached, CachedModel):
        cached.rollback(min(cached.length, t))
    else:
        drafter.prefill(ids, cache_len, exact=True)


def bound_rows(upper: dict[int, dict], probe: dict, ks: list[int]) -> list[dict]:
    """Per k: the bound and its terms (ms), from e_upper(...) and probe_costs(...)."""
    t_plain_hi = float(max(probe["plain_ms"]))
    rows = []
    for k in ks:
        verify_lo = float(min(probe["verify_ms"][str(k + 1)]))
        draft_lo = float(min(probe["draft_ms"][str(k)]))
        e_hi = upper[k]["e_hi"]
        rows.append({"k": k, "e_hi": e_hi, "e_hi_by_temperature": upper[k]["by_temperature"],
                     "e_hi_source": upper[k]["source"], "t_plain_hi_ms": t_plain_hi,
                     "t_verify_lo_ms": verify_lo, "t_draft_lo_ms": draft_lo, "round_lo_ms": verify_lo + draft_lo,
                     "bound": e_hi * t_plain_hi / max(verify_lo + draft_lo, 1e-12)})
    return rows


def verdict_of(rows: list[dict]) -> tuple[str, float, dict]:
    """(verdict, the largest bound, the row it is at)."""
    top = max(rows, key=lambda r: (r["bound"], -r["k"]))
    return (DOES_NOT_PAY if top["bound"] < 1.0 else MAY_PAY), float(top["bound"]), top


def categories_not_ruled_out(acceptance: dict | None, ks: list[int], rows: list[dict]) -> list[str]:
    """The slices other than "all" whose own E CI puts the bound at or above 1 at some k (same probe)."""
    rounds = {r["k"]: r for r in rows}
    out = []
    for name in sorted(((acceptance or {}).get("slices") or {})):
        if name == "all":
            continue
        upper = e_upper(acceptance, ks, name)
        if any(upper[k]["e_hi"] * rounds[k]["t_plain_hi_ms"] / max(rounds[k]["round_lo_ms"], 1e-12) >= 1.0
               for k in ks):
            out.append(name)
    return out


def screen_pair(model, draft, prompt_ids: list[int], ks: list[int], acceptance: dict | None, acc_cfg, device,
                cache_len: int, seed: int = 0, prompt_id: str | None = None) -> dict:
    """The B = 1 screen of one pair on one prompt (module docstring): the record the latency JSON
    carries, under `screened` when it does not pay, else under `screen`. A pair (or a k) is only
    ruled out when a second probe, pooled with the first, still puts it below 1: a burst of load
    could rule out one that pays."""
    if getattr(draft, "model", None) is None:
        return {"verdict": MAY_PAY, "model_free": True, "reason": MODEL_FREE, "max_bound": None, "at_k": None,
                "rows": [], "probe": None, "formula": FORMULA, "assumes": ASSUMES}
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    hottest = max(acc_cfg.temperatures, default=0.0)
    plain_sampling = sampling_of(acc_cfg.sampling, hottest)
    upper = e_upper(acceptance, ks)
    t0 = time.perf_counter()
    probe = probe_costs(model, draft, ids, ks, cache_len, plain_sampling, seed=seed)
    probes = 1
    rows = bound_rows(upper, probe, ks)
    if any(r["bound"] < 1.0 for r in rows):  # a k it would rule out (the pair, or k past the cut: ks_to_time)
        more = probe_costs(model, draft, ids, ks, cache_len, plain_sampling, seed=seed + 1)
        probe = {"cache_len": probe["cache_len"], "plain_ms": probe["plain_ms"] + more["plain_ms"],
                 **{key: {w: probe[key][w] + more[key][w] for w in probe[key]} for key in ("verify_ms", "draft_ms")}}
        probes = 2
        rows = bound_rows(upper, probe, ks)
    seconds = time.perf_counter() - t0
    verdict, top, at = verdict_of(rows)
    rec = {"batch": 1, "verdict": verdict, "max_bound": top, "at_k": at["k"], "rows": rows,
           "categories_not_ruled_out": categories_not_ruled_out(acceptance, ks, rows),
           "probe": {"prompt_id": prompt_id, "prompt_tokens": int(ids.shape[1]), "batch": 1,
                     "probes": probes, "repeats": PROBE_REPEATS * probes, "warmup": PROBE_WARMUP,
                     "plain_steps": PLAIN_STEPS, "plain_temperature": hottest, "seconds": round(seconds, 3),
                     **probe}, "model_free": False}
    return {**rec, "reason": reason(rec), "formula": FORMULA, "assumes": ASSUMES}


def ks_to_time(rec: dict, ks: list[int]) -> tuple[list[int], dict[str, float]]:
    """The k a pair that may pay is timed at, and the bound of each k it is not: 1..k_hi, k_hi the
    largest k whose bound is at least 1 (a k past it cannot be recommended; the marginal stage reads
    a prefix of k). A model-free or unscreened record, or one with no bound at 1, keeps every k."""
    bound = {int(row["k"]): float(row["bound"]) for row in rec.get("rows") or []}
    if rec.get("model_free") or rec.get("verdict") != MAY_PAY or not bound or any(k not in bound for k in ks):
        return list(ks), {}
    paying = [k for k in ks if bound[k] >= 1.0]
    timed = [k for k in ks if k <= max(paying)] if paying else list(ks)
    return timed, {str(k): round(bound[k], 4) for k in ks if k not in timed}


def cut_line(ks: list[int], cut: dict[str, float]) -> str:
    """'k = 3..6 not timed: speedup at most 0.97 there (at k = 3; timed at k = 1..2)', or '' when
    none is cut (ks: the k timed)."""
    if not cut:
        return ""
    cut_ks = sorted(int(k) for k in cut)
    span = f"{cut_ks[0]}" if len(cut_ks) == 1 else f"{cut_ks[0]}..{cut_ks[-1]}"
    top = max(cut_ks, key=lambda k: (cut[str(k)], -k))
    timed = f"; timed at k = {min(ks)}..{max(ks)}" if len(ks) > 1 else (f"; timed at k = {ks[0]}" if ks else "")
    bound = cut[str(top)]
    shown = f"{bound:.2f}" if bound < 0.995 else f"{bound:.3f}"  # below 1, never printed as 1.00
    return f"k = {span} not timed: speedup at most {shown} there (at k = {top}{timed})"


def reason(rec: dict) -> str:
    """'speedup at most 0.62 at k=1' (and B) in words, or the model-free line."""
    if rec.get("model_free"):
        return MODEL_FREE
    return f"speedup at most {rec['max_bound']:.2f} at k={rec['at_k']}"


def summary(rec: dict) -> dict:
    """The stage meta.json's few keys of a screen record."""
    return {"verdict": rec["verdict"], "max_bound": rec.get("max_bound"), "at_k": rec.get("at_k"),
            "model_free": rec.get("model_free", False), "reason": reason(rec),
            **({"ks_not_timed": rec["ks_not_timed"]} if rec.get("ks_not_timed") else {})}


def screened_note(rec: dict) -> str:
    """The sentence the marginal page and the report give a screened pair."""
    return (f"does not pay: speedup at most {rec['max_bound']:.2f} at any k (bound from acceptance's upper CI "
            "and probe timings), not timed")

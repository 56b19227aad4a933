"""Which k to deploy, from what vLLM itself measured: speedup per k at B = 1 and per concurrency,
the recommendation as the `speculative_config` vLLM takes, and the derivation checked against it.

    from pipeline.serving.served_k import engine_tables, recommend, derived_vs_engine
    tables = engine_tables(plain_doc, pair_doc, confidence, seed)     # temperature -> B -> rows per k
    rec = recommend(tables, pair_doc, run_dir)                        # k at B = 1, k per B, config, command

A row's ms/token is TPOT pooled over the workload's requests, its speedup the plain engine's over it
on the same prompts with a paired bootstrap over prompts. k is chosen by marginal.RULE, leaving out
any k whose lossless check failed at that temperature. The open-loop check's verdict is here too.
"""
from __future__ import annotations

import numpy as np

from pipeline.serving.marginal import RULE, recommend_k
from pipeline.speculation.acceptance_stats import ratio_difference
from pipeline.stats.intervals import percentile_interval
from pipeline.vllm.spec_config import serve_command, speculative_config

RESAMPLES = 2000


def _pooled(records: list[dict], w: np.ndarray) -> np.ndarray:
    """ms per decode token per bootstrap replicate (w: [R, P] prompt weights)."""
    dec = np.array([r["decode_ms"] for r in records], float)
    tok = np.array([max(r["tokens"] - 1, 0) for r in records], float)
    return (w @ dec) / np.maximum(w @ tok, 1e-9)


def speed_row(k: int, plain: list[dict], spec: list[dict], confidence: float, seed: int) -> dict:
    """ms/token and speedup of `spec` over `plain` on the prompts both ran (matched by id)."""
    by_id = {r["id"]: r for r in plain}
    pairs = [(by_id[r["id"]], r) for r in spec if r["id"] in by_id]
    p, s = [a for a, _ in pairs], [b for _, b in pairs]
    n = len(pairs)
    ones = np.ones((1, n))
    base, ms = float(_pooled(p, ones)[0]), float(_pooled(s, ones)[0])
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=RESAMPLES).astype(float) if n > 1 else ones
    base_b, ms_b = _pooled(p, w), _pooled(s, w)
    return {"k": k, "prompts": n, "ms_per_token": ms, "baseline_ms_per_token": base, "speedup": base / ms,
            "baseline_ci": percentile_interval(base_b, confidence, base),
            "ms_per_token_ci": percentile_interval(ms_b, confidence, ms),
            "speedup_ci": percentile_interval(base_b / ms_b, confidence, base / ms),
            "ci_unit": "prompt (paired bootstrap)"}


def engine_tables(plain: dict, pair: dict, confidence: float = 0.95, seed: int = 0) -> dict:
    """temperature -> {"1": rows, "<C>": rows}: one row per k, B = 1 and each closed loop."""
    out: dict = {}
    sampled = next((r["lossless"]["sampled"] for r in pair["by_k"].values() if r["lossless"].get("sampled")), None)
    for k_key, run in sorted(pair["by_k"].items(), key=lambda kv: int(kv[0])):
        k = int(k_key)
        for t, spec_recs in run["b1"].items():
            row = speed_row(k, plain["measure"]["b1"][t], spec_recs, confidence, seed)
            s = run["summary"]["all"][t]
            row.update(tokens_per_step=s["expected_tokens_per_step"],
                       tokens_per_step_ci=s["expected_tokens_per_step_ci"],
                       mean_acceptance_length=s["mean_acceptance_length"], drafted_share=s["drafted_share"],
                       lossless=_lossless_ok(run, t, sampled))
            out.setdefault(t, {}).setdefault("1", []).append(row)
        for c, temps in run.get("closed_loop", {}).items():
            for t, block in temps.items():
                base = plain["measure"]["closed_loop"].get(c, {}).get(t)
                if base is None:
                    continue
                row = speed_row(k, base["records"], block["records"], confidence, seed)
                row.update(tpot_p50_ms=block["tpot_ms"]["p50"] if block.get("tpot_ms") else None,
                           output_tokens_per_s=block.get("output_tokens_per_s"),
                           baseline_output_tokens_per_s=base.get("output_tokens_per_s"),
                           lossless=_lossless_ok(run, t, sampled))
                out.setdefault(t, {}).setdefault(c, []).append(row)
    return out


def _lossless_ok(run: dict, t: str, sampled: dict | None) -> bool:
    """False where speculation measurably changed the output at temperature t: this k's greedy check,
    or above 0 the pair's sampled check (run once, at k_max: one code path for every k)."""
    if float(t) == 0.0:
        g = run.get("lossless", {}).get("greedy")
        return True if g is None else bool(g["greedy_lossless"])
    return True if sampled is None else bool(sampled["passed"])


def vllm_rows(by_batch: dict[int, int]) -> list[list[int]]:
    """{B: k} -> the [[start_bs, end_bs, k], ...] rows of vLLM's num_speculative_tokens_per_batch_size:
    each measured B up to the next minus one, the last only itself; rows with the same k merge."""
    rows: list[list[int]] = []
    bs = sorted(by_batch)
    for i, b in enumerate(bs):
        end = bs[i + 1] - 1 if i + 1 < len(bs) else b
        if rows and rows[-1][2] == by_batch[b]:
            rows[-1][1] = end
        else:
            rows.append([b, end, int(by_batch[b])])
    return rows


def recommend(tables: dict, pair: dict, run_dir) -> dict:
    """The k to deploy at the primary temperature (greedy when measured): at B = 1 and per measured
    concurrency, the speculative_config and the `vllm serve` line; per temperature the same."""
    per_temp = {}
    for t, by_b in tables.items():
        by_batch = {int(b): recommend_k([r for r in rows if r.get("lossless", True)]) for b, rows in by_b.items()}
        lossy = sorted({r["k"] for rows in by_b.values() for r in rows if not r.get("lossless", True)})
        per_temp[t] = {"recommended_k": by_batch.get(1, 0), "recommended_k_by_batch": by_batch,
                       "not_lossless_k": lossy}
    primary = min(per_temp, key=float)
    rec = per_temp[primary]
    by_batch = rec["recommended_k_by_batch"]
    top = max(by_batch.values(), default=0)
    config, schedule = None, None
    if top > 0:
        rows = vllm_rows(by_batch)
        schedule = rows if len({r[2] for r in rows}) > 1 else None
        config = speculative_config(pair["draft"], top, run_dir, by_batch=schedule)
        if isinstance(config, str):
            config = None
    fixed = None
    if rec["recommended_k"] > 0:
        fixed = speculative_config(pair["draft"], rec["recommended_k"], run_dir)
    return {
        "primary_temperature": primary, "recommended_k": rec["recommended_k"],
        "recommended_k_by_batch": by_batch, "by_temperature": per_temp,
        "speculative_config": config, "best_fixed_config": fixed if isinstance(fixed, dict) else None,
        "serve_command": serve_command(pair["target_dir"], config),
        "rule": RULE + " A k whose lossless check failed at that temperature is never recommended.",
        "verdict": ("do not speculate" if config is None else
                    f"k = {rec['recommended_k']} at B = 1" + (f", by batch size {schedule}" if schedule else "")),
    }


def derived_vs_engine(acceptance: dict | None, pair: dict, confidence: float = 0.95) -> dict | None:
    """specq's teacher-forced E(k) beside vLLM's measured E[tokens per step], paired by prompt: the
    difference and its t interval (None without an acceptance artifact)."""
    if not acceptance:
        return None
    out = {}
    for k_key, run in pair["by_k"].items():
        k = int(k_key)
        for t, recs in run["b1"].items():
            block = acceptance.get("slices", {}).get("all", {}).get(t)
            if not block or str(k) not in block.get("expected_tokens_per_round", {}):
                continue
            derived = {r["prompt"]: r for r in block.get("per_prompt", [])}
            both = [(derived[r["id"]], r) for r in recs if r["id"] in derived]
            if not both:
                continue
            d_tok, d_rnd, e_tok, e_rnd = (list(col) for col in zip(*[
                (a["tokens"], a["expected_rounds"][str(k)], b["tokens"] - 1, b["steps"]) for a, b in both]))
            diff, ci = ratio_difference(d_tok, d_rnd, e_tok, e_rnd, confidence, (-float(k), float(k)))
            engine = run["summary"]["all"][t]
            agree = None if ci is None else bool(ci[0] <= 0.0 <= ci[1])
            out.setdefault(t, {})[str(k)] = {
                "derived": float(np.sum(d_tok) / np.sum(d_rnd)), "engine": float(np.sum(e_tok) / np.sum(e_rnd)),
                "difference": diff, "difference_ci": ci, "agree": agree, "prompts": len(both),
                "derived_prefix": [p.get("prefix") for p in block.get("per_position", [])][:k],
                "engine_prefix": [p["prefix"] for p in engine["per_position"]],
                "flag": agree is False,
            }
    return out


def latency_percentiles(plain: dict, pair: dict) -> dict:
    """temperature -> B -> k (0: plain) -> TTFT / TPOT / ITL percentiles, as vLLM measured them."""
    out: dict = {}

    def put(k: str, b1: dict | None, closed: dict | None) -> None:
        for c, temps in [("1", b1 or {}), *(closed or {}).items()]:
            for t, block in temps.items():
                out.setdefault(t, {}).setdefault(c, {})[k] = {m: block.get(m) for m in ("ttft_ms", "tpot_ms", "itl_ms")}
    put("0", plain.get("latency"), (plain.get("measure") or {}).get("closed_loop"))
    for k, run in pair["by_k"].items():
        put(k, run.get("latency"), run.get("closed_loop"))
    return out


def served_report(pair: dict, acceptance: dict | None, confidence: float = 0.95, plain: dict | None = None) -> dict:
    """The marginal artifact of a pair measured in vLLM: DESIGN.md's keys from the engine's B = 1
    table at the primary temperature, the recommendation as vLLM takes it, and the derived-vs-engine check."""
    rec = pair["recommendation"]
    t = rec["primary_temperature"]
    table = pair["tables"][t]["1"]
    base = table[0]["baseline_ms_per_token"]
    rows, prev_round, prev_e = [], base, 1.0
    for r in table:
        e = r["tokens_per_step"]
        round_ms = r["ms_per_token"] * e
        marginal = (round_ms - prev_round) / (e - prev_e) if e > prev_e + 1e-9 else None
        rows.append({**r, "tokens_per_round": e, "tokens_per_round_ci": r["tokens_per_step_ci"], "round_ms": round_ms,
                     "marginal_ms_per_token": marginal,
                     "marginal_pays": marginal is not None and marginal < (prev_round / prev_e)})
        prev_round, prev_e = round_ms, e
    k_top = str(max(int(k) for k in pair["by_k"]))
    derived = derived_vs_engine(acceptance, pair, confidence)
    flagged = [f"T={tt} k={k}" for tt, ks in (derived or {}).items() for k, c in ks.items() if c["flag"]]
    lossless = {k: run["lossless"] for k, run in pair["by_k"].items()}
    return {
        "variant": pair["variant"], "draft": pair["draft"], "engine": "vllm",
        "engine_info": pair.get("engine"), "device": f"vLLM {(pair.get('engine') or {}).get('vllm')} "
                                                     f"({(pair.get('engine') or {}).get('platform')})",
        "confidence": confidence, "primary": {"slice": "all", "temperature": t},
        "baseline_ms_per_token": base, "baseline_ci": table[0].get("baseline_ci"),
        "rows": rows, "recommended_k": rec["recommended_k"],
        "recommended_k_by_batch": {str(b): k for b, k in rec["recommended_k_by_batch"].items()},
        "recommended_k_by_temperature": {tt: v["recommended_k"] for tt, v in rec["by_temperature"].items()},
        "speculative_config": rec["speculative_config"], "serve_command": rec["serve_command"],
        "verdict": rec["verdict"], "rule": rec["rule"], "tables": pair["tables"],
        "per_position": {tt: blk["per_position"] for tt, blk in pair["by_k"][k_top]["summary"]["all"].items()},
        "per_position_k": int(k_top),
        "derived_vs_engine": derived, "derived_vs_engine_flagged": flagged,
        "lossless": lossless, "lossless_ok": all(
            (v.get("greedy") or {}).get("greedy_lossless", True) and (v.get("sampled") or {}).get("passed", True)
            for v in lossless.values()),
        "validation": pair.get("validation"), "workload": pair.get("workload"),
        "latency_percentiles": latency_percentiles(plain or {}, pair),
        "ci_unit": "prompt (paired bootstrap of the engine's per-request times)",
    }


def b1_check(plain: dict, b1: list[dict], rec: dict, tables: dict, t: str, confidence: float) -> dict:
    """The deployed config's B = 1 speedup over plain decoding, measured again on its own engine,
    against the interval the report gives for that k."""
    k = rec["recommended_k"]
    row = speed_row(k, plain["measure"]["b1"][t], b1, confidence, 0)
    report = next(r for r in tables[t]["1"] if r["k"] == k)
    lo, hi = report["speedup_ci"]
    return {"k": k, "temperature": t, "report_speedup": report["speedup"], "report_ci": report["speedup_ci"],
            "measured_speedup": row["speedup"], "measured_ci": row["speedup_ci"],
            "within_report_ci": bool(lo <= row["speedup"] <= hi)}


def _median_ci(xs: list[float]) -> list[float] | None:
    """95% percentile-bootstrap interval of the median (requests resampled)."""
    if len(xs) < 2:
        return None
    a = np.asarray(xs, float)
    idx = np.random.default_rng(0).integers(0, a.size, size=(2000, a.size))
    return percentile_interval(np.median(a[idx], axis=1), 0.95, float(np.median(a)))


def _compare(a: dict, b: dict) -> str:
    """a against b: fewer requests within the SLO is worse; else by TPOT p50 when the CIs part."""
    if a["slo_met"] != b["slo_met"]:
        return "better" if a["slo_met"] > b["slo_met"] else "worse"
    ca, cb = a.get("tpot_p50_ci"), b.get("tpot_p50_ci")
    if ca and cb and ca[1] < cb[0]:
        return "faster"
    if ca and cb and cb[1] < ca[0]:
        return "slower"
    return "indistinguishable"


PHRASE = {"better": "served more requests within the SLO than", "worse": "served fewer requests within the SLO than",
          "faster": "had a lower TPOT p50 than", "slower": "had a higher TPOT p50 than",
          "indistinguishable": "was indistinguishable from", "same config": "is"}


def open_loop_verdict(v: dict) -> dict:
    """Per load: each config's requests within the SLO and TPOT p50 [CI], and the recommendation
    against no speculation and the best fixed k (the same arrivals for each)."""
    per, sentences, beat = [], [], []
    for i, rate in enumerate(v["rates"]):
        cands = {"no speculation": v["plain"][i] if i < len(v["plain"]) else None,
                 **{lab: c["runs"][i] for lab, c in v["configs"].items() if "runs" in c and i < len(c["runs"])}}
        row = {"rate": rate}
        for lab, x in cands.items():
            if x:
                row[lab] = {"slo_met": x["slo_met"], "requests": x["requests"], "goodput_rps": x["goodput_rps"],
                            "tpot_p50_ms": (x["tpot_ms"] or {}).get("p50"), "tpot_p99_ms": (x["tpot_ms"] or {}).get("p99"),
                            "tpot_p50_ci": _median_ci(x.get("tpot_per_request_ms") or []),
                            "output_tokens_per_s": x.get("output_tokens_per_s")}
        rec = row.get("recommended")
        if rec and row.get("no speculation"):
            row["recommended_vs_no_speculation"] = _compare(rec, row["no speculation"])
            row["recommended_vs_best_fixed_k"] = (_compare(rec, row["best_fixed_k"]) if row.get("best_fixed_k")
                                                  and v["configs"]["best_fixed_k"].get("same_as") is None else "same config")
            beat.append(row["recommended_vs_no_speculation"] in ("better", "faster")
                        and row["recommended_vs_best_fixed_k"] not in ("worse", "slower"))
            sentences.append(f"at {rate:.2f} requests/s, {PHRASE[row['recommended_vs_no_speculation']]} no speculation "
                             f"and {PHRASE.get(row['recommended_vs_best_fixed_k'], 'the same config as')} the best fixed k")
        per.append(row)
    if not v["configs"].get("recommended", {}).get("started", True):
        sentences = [f"did not start ({v['configs']['recommended']['error']})"]
    return {"per_rate": per, "recommendation_beat_alternatives": bool(beat) and all(beat),
            "rule": "requests within the SLO first, then TPOT p50 where the 95% CIs (requests resampled) part",
            "sentence": ("the recommended config, " + "; ".join(sentences)) if sentences else "no open-loop load was run"}

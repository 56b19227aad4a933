"""The page of a pair measured in vLLM: what to deploy first, then the tables behind it.

    from pipeline.report.served import render_served, served_plot
    text = render_served(report)            # report: pipeline.serving.served_k.served_report(...)

Sections: the `vllm serve` line (or "do not speculate") and its open-loop check, the table per k
and concurrency, per-position acceptance, the derivation beside the engine's counts, lossless.
`served_blocks` gives the report the same deploy lines and the checks' verdicts.
"""
from __future__ import annotations

from pipeline.report.document import Block, to_markdown
from pipeline.report.figures import ci_errors, finish_axes, png_bytes, pyplot
from pipeline.report.format import MISSING, interval, number
from pipeline.report.marginal import temp_label

DEFINITIONS = (
    "E[tokens/step]: tokens the decode steps emitted / decode steps (every step, drafted or not: specq's "
    "E[tokens/round]). Mean acceptance length: vLLM's own, 1 + accepted / drafted steps (steps where the "
    "draft proposed nothing are left out, so for prompt lookup it is larger). ms/token: decode time / decode "
    "tokens pooled over the workload's requests; speedup: the plain engine's ms/token on the same prompts over "
    "it, with a paired bootstrap over prompts.")


def _temp(t: str) -> str:
    return f"T = {temp_label(t)}"


def _by_int(d: dict) -> list:
    return sorted(d.items(), key=lambda kv: int(kv[0]))


def deploy_blocks(r: dict) -> list[Block]:
    """The `vllm serve` line (or "do not speculate"), its B = 1 check and its open-loop check."""
    if r.get("speculative_config"):
        out: list[Block] = [("p", f"**Deploy: {r['verdict']}.**"), ("code", r["serve_command"])]
    else:
        out = [("p", "**Do not speculate** with this draft: no k was measurably faster than plain decoding in "
                     "vLLM (or its lossless check failed).")]
    val = r.get("validation") or {}
    c = val.get("b1_check")
    if c:
        out.append(("p", f"Started as written, the config's own B = 1 speedup at T = {c['temperature']} was "
                         f"{number(c['measured_speedup'], 2)}x {interval(c['measured_ci'], 2)}, against the "
                         f"{number(c['report_speedup'], 2)}x {interval(c['report_ci'], 2)} reported for k = "
                         f"{c['k']}: " + ("within the report's CI." if c["within_report_ci"]
                                          else "**outside the report's CI**.")))
    if val.get("verdict"):
        out.append(("p", f"Open-loop check: {val['verdict']['sentence']} ({val['verdict']['rule']})."))
    return out


def render_served(r: dict) -> str:
    out = deploy_blocks(r) + [("p", f"All intervals are {int(round(r['confidence'] * 100))}% CIs over prompts. "
                                    + DEFINITIONS)]
    for t, by_b in r["tables"].items():
        for b, rows in _by_int(by_b):
            out += [("h2", f"{_temp(t)}, {'B = 1' if b == '1' else f'closed loop at concurrency {b}'}"),
                    ("p", f"Plain decoding: {number(rows[0]['baseline_ms_per_token'], 2)} ms/token "
                          f"{interval(rows[0].get('baseline_ci'), 2)}."),
                    ("table", ["k", "E[tokens/step]", "mean acceptance length", "drafted share", "ms/token",
                               "speedup", "lossless"],
                     [[str(x["k"]), f"{number(x.get('tokens_per_step'), 2)} {interval(x.get('tokens_per_step_ci'), 2)}",
                       number(x.get("mean_acceptance_length"), 2), number(x.get("drafted_share"), 2),
                       f"{number(x['ms_per_token'], 2)} {interval(x['ms_per_token_ci'], 2)}",
                       f"{number(x['speedup'], 2)}x {interval(x['speedup_ci'], 2)}",
                       "yes" if x.get("lossless", True) else "**no**"] for x in rows], None)]
    out += _percentile_blocks(r)
    out += [("h2", "Recommended k per temperature and batch size"),
            ("p", ", ".join(f"{_temp(t)}: {k}" for t, k in r["recommended_k_by_temperature"].items())
                  + f". By batch size at the primary temperature: {r['recommended_k_by_batch']}."),
            ("p", r["rule"]),
            ("h2", f"Per-position acceptance at k = {r['per_position_k']}"),
            ("p", "prefix: steps accepting positions 1..i over all steps (specq's); per draft: over drafted steps "
                  "(vLLM's accepted_per_pos / num_drafts); conditional: over steps that reached position i."),
            ("table", ["temperature", "position", "prefix [CI]", "per draft [CI]", "conditional [CI]"],
             [[t, str(p["position"]), f"{number(p['prefix'], 3)} {interval(p['prefix_ci'], 3)}",
               f"{number(p['per_draft'], 3)} {interval(p['per_draft_ci'], 3)}",
               f"{number(p['conditional'], 3)} {interval(p['ci'], 3)}"]
              for t, pos in r["per_position"].items() for p in pos], None)]
    out += _derived_blocks(r) + _lossless_blocks(r) + _validation_blocks(r)
    return to_markdown(f"Draft length k for `{r['variant']}` drafted by `{r['draft']}`, measured in {r['device']}",
                       out)


def _percentile_blocks(r: dict) -> list[Block]:
    lat = r.get("latency_percentiles") or {}
    if not lat:
        return []

    def p3(x):
        return " / ".join(number(x.get(q), 1) for q in ("p50", "p90", "p99")) if x else MISSING
    rows = [[t, b, k, p3(c["ttft_ms"]), p3(c["tpot_ms"]), p3(c["itl_ms"])]
            for t, by_b in lat.items() for b, by_k in _by_int(by_b) for k, c in _by_int(by_k)]
    return [("h2", "Latency across k (ms; k = 0 is plain decoding)"),
            ("table", ["temperature", "B", "k", "TTFT p50 / p90 / p99", "TPOT p50 / p90 / p99",
                       "ITL p50 / p90 / p99"], rows, None),
            ("p", "ITL is the gap between chunks of the stream: a speculative step delivers several tokens in one "
                  "chunk, so its ITL is per step, not per token.")]


def _derived_blocks(r: dict) -> list[Block]:
    d = r.get("derived_vs_engine")
    if d is None:
        return [("h2", "Derived vs engine"), ("p", "No acceptance artifact for this pair (acceptance.targets does "
                                                   "not include the target): nothing to check the engine's figures "
                                                   "against.")]
    rows = [[t, k, number(c["derived"], 3), number(c["engine"], 3),
             f"{number(c['difference'], 3)} {interval(c['difference_ci'], 3)}",
             "too few prompts" if c["agree"] is None else "yes" if c["agree"] else "**no (flagged)**"]
            for t, ks in d.items() for k, c in _by_int(ks)]
    return [("h2", "Derived (specq, teacher-forced) vs measured in vLLM"),
            ("p", "The acceptance stage derives E(k) from one teacher-forced pass over the target's text; vLLM "
                  "measured it on the same prompts. The difference's paired t CI (prompts) should contain 0, up "
                  "to kernel-level near-ties (bf16, another GPTQ kernel). A flag marks a disagreement beyond the CI."),
            ("table", ["temperature", "k", "derived", "vLLM", "vLLM - derived [CI]", "agree"], rows, None)]


def _lossless_blocks(r: dict) -> list[Block]:
    rows, rule = [], ""
    for k, ll in _by_int(r["lossless"]):
        g, s = ll.get("greedy") or {}, ll.get("sampled")
        div = g.get("diverged") or {}
        rule = g.get("rule", rule)
        rows.append([k, f"{g.get('identical', MISSING)} of {g.get('prompts', MISSING)}",
                     f"{len(div)} ({sum(v['explained'] for v in div.values())})",
                     f"{s['p_value']:.2g} ({'pass' if s['passed'] else '**FAIL**'}, {s['test']}, T = "
                     f"{s['temperature']})" if s else MISSING])
    return [("h2", "Lossless in vLLM"),
            ("p", "Greedy: speculative output against the plain engine's on every prompt; a divergence is forgiven "
                  "only at a near-tie (the rule below). Sampled: the distribution of each output position, "
                  "speculative against plain."),
            ("table", ["k", "greedy identical", "diverged (explained)", "sampled p"], rows, None)] \
        + ([("p", rule)] if rule else [])


def _validation_blocks(r: dict) -> list[Block]:
    v = r.get("validation")
    if not v:
        return []
    rows = [[number(p["rate"], 2), lab, f"{x['slo_met']} / {x['requests']}",
             f"{number(x['tpot_p50_ms'], 1)} {interval(x.get('tpot_p50_ci'), 1)}", number(x["tpot_p99_ms"], 1),
             number(x["output_tokens_per_s"], 1)]
            for p in v["verdict"]["per_rate"] for lab in ("no speculation", "best_fixed_k", "recommended")
            if (x := p.get(lab))]
    return [("h2", "The recommendation under open-loop load"),
            ("p", "Poisson arrivals at shares of the plain engine's closed-loop capacity, the same arrivals for "
                  "each config; each config started exactly as written above. Requests within the SLO, TPOT p50 "
                  "[95% CI, requests resampled] and p99 (ms), output tokens/s."),
            ("table", ["requests/s", "config", "within SLO", "TPOT p50", "TPOT p99", "tokens/s"], rows, None),
            ("p", f"Measured in vLLM: {v['verdict']['sentence']}.")]


def served_plot(r: dict, dpi: int) -> bytes:
    """ms/token vs k at B = 1 (each temperature) with CIs, and the plain lines."""
    fig, ax = pyplot().subplots(figsize=(6, 3.4))
    for t, by_b in r["tables"].items():
        rows = by_b["1"]
        ms = [x["ms_per_token"] for x in rows]
        line = ax.errorbar([x["k"] for x in rows], ms, yerr=ci_errors(ms, [x["ms_per_token_ci"] for x in rows]),
                           marker="o", capsize=3, label=f"{_temp(t)} speculative")
        ax.axhline(rows[0]["baseline_ms_per_token"], ls="--", color=line[0].get_color(), alpha=0.7,
                   label=f"{_temp(t)} plain")
    finish_axes(ax, "draft length k", "ms / token (vLLM, B = 1)", f"{r['variant']}__{r['draft']}: measured in vLLM")
    return png_bytes(fig, dpi)


def served_blocks(r: dict) -> list[Block]:
    """The report's blocks for a vLLM-measured pair: what to deploy and its checks, the
    derived-vs-engine flags and the lossless verdict (the full tables are on the pair's page)."""
    out = [("p", f"Measured in {r['device']}."), *deploy_blocks(r)]
    if r.get("derived_vs_engine") is None:
        out.append(("p", "No specq derivation for this pair (its target is not in acceptance.targets)."))
    elif r.get("derived_vs_engine_flagged"):
        out.append(("p", "Derived and vLLM-measured E(k) disagree beyond the CI at "
                         + ", ".join(r["derived_vs_engine_flagged"]) + " (see the pair's page)."))
    else:
        out.append(("p", "The teacher-forced E(k) agrees with vLLM's measured E[tokens/step] within the CI at every "
                         "k and temperature checked."))
    if not r.get("lossless_ok"):
        bad = [f"k={k}" for k, ll in r["lossless"].items()
               if not (ll.get("greedy") or {}).get("greedy_lossless", True)
               or not (ll.get("sampled") or {}).get("passed", True)]
        out.append(("p", "vLLM's speculative output differs from its plain output beyond near-ties at "
                         + ", ".join(bad) + ": speculation with this engine is not lossless here."))
    return out

"""The report's speculation section: per (variant, draft) pair, whether speculation is lossless,
the recommended k and its speed, k per category, and each pair's figures.

    blocks += speculation_blocks(run_dir, gate, figures, dpi)

Reads acceptance/, marginal/ (with its <pair>.png) and latency/<pair>.json, and the gate's lossless decisions.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.report.document import Block
from pipeline.report.figures import ci_errors, finish_axes, png_bytes, pyplot
from pipeline.report.format import MISSING, interval, json_files, number
from pipeline.report.marginal import CATEGORY_HEADER, category_rows, workload_line
from pipeline.report.served import served_blocks


def acceptance_plot(pair: str, acc: dict, dpi: int) -> bytes | None:
    """Per-position acceptance (all slices) per temperature: conditional with CIs, prefix, E[beta]."""
    pooled = (acc.get("slices") or {}).get("all") or {}
    if not pooled:
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.4))
    for temp, rec in sorted(pooled.items()):
        # A position no round reached (n = 0) has no conditional rate and no CI: not drawn.
        pos = [p for p in rec.get("per_position") or [] if p.get("conditional") is not None]
        if not pos:
            continue
        x = [p["position"] for p in pos]
        y = [p["conditional"] for p in pos]
        ci = [p.get("ci") or [p["conditional"]] * 2 for p in pos]
        line = ax.errorbar(x, y, yerr=ci_errors(y, ci), marker="o", capsize=3, label=f"T={temp} conditional")
        prefix = [p for p in rec["per_position"] if p.get("prefix") is not None]
        ax.plot([p["position"] for p in prefix], [p["prefix"] for p in prefix], ls=":",
                color=line[0].get_color(), label=f"T={temp} prefix P(A1..Ai)")
        if all(p.get("expected_beta") is not None for p in pos):
            ax.plot(x, [p["expected_beta"] for p in pos], ls="--", color=line[0].get_color(), alpha=0.6,
                    label=f"T={temp} E[beta]")
    ax.set_ylim(0, 1.05)
    finish_axes(ax, "draft position i", "acceptance", f"{pair}: per-position acceptance (all slices)")
    return png_bytes(fig, dpi)


def speed_plot(pair: str, marginal: dict | None, latency: dict | None, dpi: int) -> bytes | None:
    """ms/token vs k with CIs and the plain-decode line, from marginal (or else latency) JSON."""
    if marginal and marginal.get("rows"):
        rows, base = marginal["rows"], marginal["baseline_ms_per_token"]
        med = [r["ms_per_token"] for r in rows]
        cis = [r.get("ms_per_token_ci") or [m, m] for r, m in zip(rows, med)]
    elif latency and latency.get("rows"):
        rows, base = latency["rows"], latency["plain_ms_per_token"]["median"]
        med = [r["ms_per_token"]["median"] for r in rows]
        cis = [r["ms_per_token"].get("ci") or [m, m] for r, m in zip(rows, med)]
    else:
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.4))
    ax.errorbar([r["k"] for r in rows], med, yerr=ci_errors(med, cis), marker="o", capsize=3,
                label="speculative ms/token")
    ax.axhline(base, color="grey", ls="--", label="plain decode ms/token")
    finish_axes(ax, "draft length k", "ms / token", f"{pair}: decode time per token vs k", legend=8)
    return png_bytes(fig, dpi)


def speculation_blocks(run_dir: Path, gate: dict, figures: dict[str, bytes], dpi: int) -> list[Block]:
    """Per (variant, draft) pair: lossless decision, recommended k and its speed, then each pair's
    acceptance and speed figures (added to `figures`)."""
    acceptance = json_files(run_dir / "acceptance", "*__*.json", "acceptance result")
    marginal = json_files(run_dir / "marginal", "*__*.json", "marginal report")
    latency = json_files(run_dir / "latency", "*__*.json", "latency result")
    lossless = (gate.get("speculation") or {}).get("pairs", {})
    pairs = sorted(set(acceptance) | set(marginal) | set(latency))
    out: list[Block] = [("h2", "Speculative decoding per (variant, draft) pair")]
    if not pairs:
        return out + [("p", "No acceptance, latency or marginal results for any pair in this run.")]
    rows, classes, screened = [], [], []
    for pair in pairs:
        m = marginal.get(pair) or {}
        rec = m.get("recommended_k")
        at = next((r for r in m.get("rows", []) if r["k"] == rec), None)
        if m.get("screened"):
            screened.append(f"{pair}: {m.get('screened_note')}; skipped: {m['screened'].get('skipped') or 'its timing'}")
        elif m.get("not_timed"):
            screened.append(f"{pair}: not timed ({m['not_timed']})")
        elif m.get("ks_not_timed_note"):  # timed at the k that may pay only (screen.ks_to_time)
            screened.append(f"{pair}: {m['ks_not_timed_note']}")
        loss = lossless.get(pair, {}).get("decision", "unchecked")
        if m.get("engine") == "vllm":
            loss = "go" if m.get("lossless_ok") else "no-go"
        rows.append([pair, m.get("engine", "specq"), loss,
                     MISSING if rec is None else str(rec) + (" (does not pay, not timed)" if m.get("screened") else ""),
                     f"{number(at['speedup'], 2)}x {interval(at.get('speedup_ci'), 2)}" if at else MISSING,
                     number(at["ms_per_token"], 2) if at else MISSING,
                     number(at["tokens_per_round"], 2) if at else MISSING, number(m.get("baseline_ms_per_token"), 2)])
        classes.append([None, None, {"go": "pass", "no-go": "fail"}.get(loss, "inconclusive"), *[None] * 5])
    out += [("p", "Lossless: greedy speculative output identical to the target's own (up to near-ties), and the "
                  "sampling test, in the engine that measured the pair (specq's own engine, or vLLM against its "
                  "own plain output); a pair that fails is no-go for speculation whatever its speed. It does not "
                  "change the variant's quality decision."),
            ("table", ["pair", "measured in", "lossless", "recommended k", "speedup at k [CI]", "ms/token at k",
                       "E[tokens/round] at k", "plain ms/token"], rows, classes)]
    if screened:  # pairs screened out before timing (latency.screen)
        out.append(("p", "Screened before timing (latency.screen): where the speedup's upper bound (the pair's "
                         "page shows its terms) is below 1 the k were not timed, and plain ms/token is the "
                         "probe's. " + " ".join(f"{x}." for x in screened)))
    for pair in pairs:
        out.append(("h3", pair))
        m = marginal.get(pair) or {}
        if m.get("engine") == "vllm":
            out += served_blocks(m)
        if m.get("screened"):
            out.append(("p", f"This pair {m['screened_note']}. {m.get('recommended_k_by_category_note') or ''}."))
        if category_rows(m):  # the workload, and k per category with CIs
            out += [("p", workload_line(m) + " k per category: RULE on each category's own prompts; where k = 0 "
                          "the figures are at the best k, and 'settled' says whether the CIs decide it."),
                    ("table", CATEGORY_HEADER, category_rows(m), None)]
        png = acceptance_plot(pair, acceptance[pair], dpi) if pair in acceptance else None
        if png:
            figures[f"acceptance-{pair}.png"] = png
            out.append(("img", f"acceptance-{pair}.png", "per-position acceptance with CIs"))
        theirs = run_dir / "marginal" / f"{pair}.png"
        png = theirs.read_bytes() if theirs.is_file() else speed_plot(pair, m, latency.get(pair), dpi)
        if png:
            figures[f"speed-{pair}.png"] = png
            out.append(("img", f"speed-{pair}.png", "speedup upper bound vs k (screened, not timed)"
                        if m.get("screened") else "ms/token vs k with CIs (marginal report)"))
        else:
            out.append(("p", "No timing for this pair."))
    return out

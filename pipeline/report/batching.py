"""Speculation under batching for people: the marginal stage's figures and Markdown section
(speedup_plot, serving_plot, batch_markdown), and the report stage's blocks (batching_blocks).

    marginal/<pair>.batch.png     speedup against batch size, one line per k (CIs over repeats)
    marginal/<pair>.serving.png   TPOT, TTFT and goodput against request rate (simulated)

A pair screened out under batching (`by_batch_screened`, pipeline/latency/screen.py) gets the bound
per batch size instead (screened_batch_markdown, screened_blocks): k = 0 at every B, no simulation.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.stage import read_json
from pipeline.report.figures import png_bytes, pyplot
from pipeline.report.format import MISSING, interval, number, percent
from pipeline.report.modes import footnote
from pipeline.report.modes import mark as like_mark

# ---------------------------------------------------------------- figures


def speedup_plot(report: dict, dpi: int) -> bytes:
    plt = pyplot()
    rows = report["by_batch"]["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k in sorted({r["k"] for r in rows}):
        pts = sorted((r for r in rows if r["k"] == k), key=lambda r: r["batch"])
        x = [r["batch"] for r in pts]
        y = [r["speedup"] for r in pts]
        err = [[max(0.0, v - r["speedup_ci"][0]) for v, r in zip(y, pts)],
               [max(0.0, r["speedup_ci"][1] - v) for v, r in zip(y, pts)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"k={k}")
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="plain decoding")
    ax.set_xscale("log", base=2)
    bs = sorted({r["batch"] for r in rows})
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size B (rows decoded together)")
    ax.set_ylabel("speedup over plain decode at the same B")
    ax.set_title(f"{report['variant']} / {report['draft']}: speedup vs batch size", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return png_bytes(fig, dpi)


def serving_plot(report: dict, dpi: int) -> bytes:
    plt = pyplot()
    sv = report["serving"]
    rates = sv["rates_rps"]
    names = list(sv["policies"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, name in enumerate(names):
        colour = f"C{i}"
        for ax, key in ((axes[0], "tpot"), (axes[1], "ttft")):
            ax.plot(rates, [r[name][f"{key}_p50_ms"] for r in sv["rows"]], "o-", color=colour, label=f"{name} p50")
            ax.plot(rates, [r[name][f"{key}_p99_ms"] for r in sv["rows"]], "s:", color=colour, label=f"{name} p99")
        axes[2].plot(rates, [r[name]["goodput_rps"] for r in sv["rows"]], "o-", color=colour, label=name)
    for name, c in sv["crossover"].items():
        rate = c["tpot_p50"].get("rate_rps")
        if rate is not None:
            for ax in axes:
                ax.axvline(rate, color="k", ls="--", lw=0.8)
            axes[0].annotate(f"{name} stops paying\n{rate:.2g} req/s", (rate, axes[0].get_ylim()[1]),
                             fontsize=7, va="top")
    axes[0].set_ylabel("TPOT ms")
    axes[1].set_ylabel("TTFT ms")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("goodput, requests/s within the SLO")
    axes[2].set_title(f"SLO: TTFT <= {sv['slo']['ttft_ms']:.0f} ms and TPOT <= {sv['slo']['tpot_ms']:.0f} ms",
                      fontsize=9)
    axes[2].plot(rates, rates, color="grey", lw=0.8, ls="--", label="offered rate")
    for ax in axes:
        ax.set_xlabel("arrival rate, requests/s (Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{report['variant']} / {report['draft']}: simulated server, max batch "
                 f"{sv['workload']['max_batch']}, {lengths_phrase(sv)}", fontsize=10)
    fig.tight_layout()
    return png_bytes(fig, dpi)


# ---------------------------------------------------------------- text


def lengths_phrase(sv: dict) -> str:
    """The simulated requests' lengths in a few words: fixed, or drawn from the workload (issue #28)."""
    w = sv["workload"]
    if sv.get("lengths") == "workload":
        return (f"lengths drawn from workload {w.get('name')!r} (mean {number(w['prompt_tokens_mean'], 0)} prompt + "
                f"{number(w['output_tokens_mean'], 0)} output tokens)")
    return f"{w['prompt_tokens']} prompt + {w['output_tokens']} output tokens (fixed)"



def speedup_matrix(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per B, one column per k, 'speedup [CI]'; the recommended k marked."""
    rows = report["by_batch"]["rows"]
    ks = sorted({r["k"] for r in rows})
    rec = report.get("recommended_k_by_batch") or {}
    cells = {(r["batch"], r["k"]): r for r in rows}
    out = []
    for b in sorted({r["batch"] for r in rows}):
        line = [str(b), str(rec.get(str(b), MISSING))]
        for k in ks:
            r = cells.get((b, k))
            mark = " *" if r and str(k) == str(rec.get(str(b))) else ""
            line.append(f"{number(r['speedup'], 2)}x{like_mark(r)} {interval(r['speedup_ci'], 2)}{mark}" if r else MISSING)
        top = cells.get((b, ks[-1]))
        measured = top.get("measured_thrown_away_fraction") if top else None
        line.append(f"{percent(top['thrown_away_share'], 0)} / {percent(measured, 0)}" if top else MISSING)
        out.append(line)
    return ["B", "recommended k", *[f"k={k}" for k in ks],
            f"accepted tokens thrown away at k={ks[-1]}: model / measured"], out


def b1_line(report: dict) -> str:
    """The sentence saying where B = 1's recommended k comes from when the batched rows' own rule
    differs (pipeline/serving/batch_k.py B1_RULE), or ""."""
    own = (report.get("recommended_k_by_batch_own") or {}).get("1")
    rec = (report.get("recommended_k_by_batch") or {}).get("1")
    if own is None or rec is None or own == rec:
        return ""
    one = [r for r in report["by_batch"]["rows"] if r["batch"] == 1]
    phase = [r.get("timing_repeats") for r in report.get("rows") or []]
    reps = f" ({one[0].get('timing_repeats')} timing repeats; the B = 1 phase: {phase[0]})" if one and phase else ""
    return (f"At B = 1 the recommended k is {rec}, the B = 1 phase's (it times one row in detail, on every "
            f"temperature); the batched rows alone, one prompt{reps}, would give k = {own}.")


def mode_footnote(report: dict) -> str:
    """The footnote of the (B, k) speedups whose cell and plain cell ran differently, or ""."""
    return footnote(report["by_batch"]["rows"], "speedup", lambda r: f"B={r['batch']} k={r['k']}")


ROUND_HEADER = ["B", "k", "round ms used (by verify width) [CI]", "mean verify width: acceptance prompts",
                "round ms on the latency run's own prompts", "mean verify width there", "modelled / measured speedup"]

ROUND_NOTE = ("A round costs what its verify width costs (the most any row's draft offered). The round time "
              "used is the latency run's time by width, weighted by how often the acceptance prompts' batch "
              "chain verifies each width at (B, k), so it and E_B come from the same texts; the latency run's "
              "own prompts can offer a prompt-lookup draft far less (a round verifying nothing costs a plain "
              "step), which is why its measured speedup can differ from the model's.")


def round_rows(report: dict) -> list[list[str]]:
    """Per (B, k): the width-weighted round time against the latency run's own, with mean widths."""
    out = []
    for r in report["by_batch"]["rows"]:
        weighted = r.get("mean_width") is not None
        out.append([str(r["batch"]), str(r["k"]),
                    f"{number(r['round_ms'], 2)} {interval(r.get('round_ms_ci'), 2)}"
                    + ("" if weighted else " (cells' own)"),
                    number(r.get("mean_width"), 2), number(r.get("cell_round_ms", r["round_ms"]), 2),
                    number(r.get("cell_mean_width"), 2),
                    f"{number(r['speedup'], 2)} / {number(r.get('measured_speedup'), 2)}"])
    return out


def crossover_lines(report: dict) -> list[str]:
    sv = report["serving"]
    out = []
    for name, c in sv["crossover"].items():
        for metric, label in (("tpot_p50", "TPOT p50"), ("goodput", "goodput")):
            x = c[metric]
            out.append(f"{name} ({sv['policies'][name]}), {label}: " +
                       (f"stops paying above {x['rate_rps']:.3g} req/s" if x.get("rate_rps") is not None
                        else x["status"]))
    return out


def validation_rows(report: dict) -> list[list[str]]:
    rows = []
    for v in report["serving"]["validation"]:
        for metric in ("tpot_ms", "ttft_ms"):
            m = v[metric]
            rel_ci = m.get("relative_error_ci")
            agrees = m.get("agrees", m["within_measured_ci"])  # older marginal JSON: the old rule
            unc = v.get("unconditional") if metric == "tpot_ms" else None
            acc = v.get("acceptance_check") if metric == "tpot_ms" else None
            rows.append([str(v["batch"]), v["mode"], str(v["k"]), metric.replace("_ms", ""), number(m["measured"], 2),
                         interval(m["measured_ci"], 2), number(m["predicted"], 2),
                         percent(m["relative_error"], 1, signed=True)
                         + (f" {interval(rel_ci, 1, signed=True, as_percent=True)}" if rel_ci else ""),
                         "yes" if agrees else "no",
                         _familywise(m),
                         f"{percent(unc['relative_error'], 1, signed=True)} "
                         f"{interval(unc['relative_error_ci'], 1, signed=True, as_percent=True)}" if unc else "",
                         f"{number(acc['measured_tokens_per_round'], 2)} {interval(acc['measured_ci'], 2)} / "
                         f"{number(acc['model_tokens_per_round'], 2)}" if acc else ""])
    return rows


def _familywise(m: dict) -> str:
    ci = m.get("relative_error_ci_familywise")
    if not ci:
        return ""
    return (f"{'yes' if m['agrees_familywise'] else 'no'} {interval(ci, 1, signed=True, as_percent=True)} "
            f"at {percent(m['familywise_confidence'], 2)}")


VALIDATION_HEADER = ["B", "mode", "k", "metric", "measured ms (median over waves)", "CI (unit: wave)",
                     "simulated ms (rounds replayed)", "error [CI: waves and cost repeats]", "agrees (CI holds 0)",
                     "agrees family-wise (gated) [CI]",
                     "error with drawn rounds [CI]", "tokens/round: loop [CI] / model"]

VALIDATION_NOTE = ("The simulated speculative waves replay the rounds each measured wave had (tokens kept per row, "
                   "each round costed at its verify width), "
                   "so the check is on the cost model and the scheduler. The gated verdict is family-wise "
                   "over the pair's m TPOT rows (Bonferroni: each row's CI at 1 - alpha/m), aiming at a right "
                   "model passing with probability 1 - alpha; the per-row 'agrees' at 1 - alpha would miss "
                   "somewhere in about 1 - (1 - alpha)^m of runs (19% for four rows at 95%) by chance alone. 'Error with drawn rounds' "
                   "draws the rounds from the acceptance model as the sweep does; 'tokens/round' sets the closed "
                   "loop's own prompts against the acceptance model (a different prompt set). Neither is gated.")


def batch_markdown(report: dict, batch_png: str, serving_png: str) -> str:
    head, rows = speedup_matrix(report)
    sv = report["serving"]
    cfg = report["speculative_config_by_batch"]
    out = ["", "## Speculation under batching", "",
           "Speedup over plain decoding of the same B rows (E_B(k), tokens per row per round, from acceptance: "
           "exact given the texts of B distinct prompts, averaged over groups of the slice's prompts; times "
           "plain step time over round time, the round time by verify width weighted by the same texts' "
           "widths, both from the same repeats); * = recommended k at that B. Every "
           "row keeps n_min + 1 tokens a round (synchronised scheme); the last column is the share of "
           "accepted tokens that throws away against per-row offsets.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    note = mode_footnote(report)
    if note:
        out += ["", note]
    b1 = b1_line(report)
    if b1:
        out += ["", b1]
    out += ["", ROUND_NOTE, "", "| " + " | ".join(ROUND_HEADER) + " |", "|" + "---|" * len(ROUND_HEADER)]
    out += ["| " + " | ".join(r) + " |" for r in round_rows(report)]
    out += ["", f"vLLM dynamic speculation (`{cfg['config_key']}`): {cfg['note']}", "", "```json",
            json.dumps(cfg["vllm_speculative_config"]), "```", "",
            f"![speedup vs batch size]({batch_png})", "", "## What pays at a request rate (simulated)", ""]
    out += [f"- {line}" for line in crossover_lines(report)]
    out += ["", f"Requests: {lengths_phrase(sv)}; {sv.get('lengths_source') or 'fixed lengths'}.", "",
            f"Plain server capacity at full batch: {number(sv['plain_capacity_rps'], 3)} req/s. Assumptions:", ""]
    out += [f"{i + 1}. {a}" for i, a in enumerate(sv["assumptions"])]
    out += ["", f"![simulated server]({serving_png})", "", "### The simulation against a measured closed loop", "",
            f"Validation: {'agrees' if sv.get('validation_agrees') else 'does NOT agree everywhere'} "
            f"({sv.get('validation_rule', 'prediction inside the measured CI')}). {VALIDATION_NOTE}", "",
            "| " + " | ".join(VALIDATION_HEADER) + " |", "|" + "---|" * len(VALIDATION_HEADER)]
    out += ["| " + " | ".join(r) + " |" for r in validation_rows(report)]
    return "\n".join(out) + "\n"


def screened_batch_lines(report: dict) -> list[str]:
    """Why a pair was not timed under batching, what was skipped, and the bound at each B."""
    rec = report["by_batch_screened"]
    out = [f"Under batching this pair {report.get('by_batch_note') or 'was screened'} (latency.screen): "
           f"recommended k = 0 at every batch size ({', '.join(str(b) for b in rec.get('batch_sizes') or [])}). "
           f"Not timed: {rec.get('skipped') or 'the batched cells'}. Simulated server: "
           f"{report.get('serving_note') or 'not simulated'}."]
    for b, one in sorted((rec.get("by_batch") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"B = {b}: speedup at most " + ", ".join(f"{number(r['bound'], 2)} at k={r['k']}"
                                                            for r in one.get("rows") or [])
                   + f" (E_B_hi x T_plain_hi / round_lo; probe at {b} rows, cache {one['probe'].get('cache_len')}).")
    return out


def screened_batch_markdown(report: dict) -> str:
    """The marginal page's batching section for a pair screened out under batching."""
    cfg = report["speculative_config_by_batch"]
    out = ["", "## Speculation under batching", ""]
    for line in screened_batch_lines(report):
        out += [line, ""]
    out += [f"vLLM dynamic speculation (`{cfg['config_key']}`): {cfg['note']}", ""]
    return "\n".join(out) + "\n"


def batching_blocks(run_dir: Path, figures: dict[str, bytes]) -> list[tuple]:
    """The report stage's section: per pair, the (B, k) speedups, the vLLM table, the simulation."""
    out: list[tuple] = [("h2", "Speculation under batching and what pays at a request rate")]
    found = False
    for path in sorted((run_dir / "marginal").glob("*__*.json")):
        m = read_json(path, "marginal report")
        if isinstance(m, dict) and m.get("by_batch_screened"):  # not timed under batching: why, and the bound
            found = True
            out += [("h3", path.stem), *(("p", line) for line in screened_batch_lines(m))]
            continue
        if not isinstance(m, dict) or not m.get("by_batch"):
            continue
        found = True
        pair = path.stem
        head, rows = speedup_matrix(m)
        cfg = m["speculative_config_by_batch"]
        out += [("h3", pair),
                ("p", "Speedup over plain decoding at the same batch size [CI over repeats and acceptance rounds]; "
                      "* = recommended k. Rows keep n_min + 1 tokens a round; the last column is the share of "
                      "accepted tokens thrown away against per-row offsets."),
                ("table", head, rows, None),
                *([("p", mode_footnote(m))] if mode_footnote(m) else []),
                ("p", ROUND_NOTE), ("table", ROUND_HEADER, round_rows(m), None),
                ("p", f"vLLM: {cfg['config_key']}. {cfg['note']} Sources: {', '.join(cfg['sources'])}"),
                ("pre", json.dumps(cfg["vllm_speculative_config"]))]
        for suffix, caption in (("batch", "speedup vs batch size, one line per k"),
                                ("serving", "simulated TPOT, TTFT and goodput vs request rate")):
            png = run_dir / "marginal" / f"{pair}.{suffix}.png"
            if png.is_file():
                figures[f"{suffix}-{pair}.png"] = png.read_bytes()
                out.append(("img", f"{suffix}-{pair}.png", caption, "wide"))
        sv = m["serving"]
        out += [("p", f"Simulated requests: {lengths_phrase(sv)}."),
                ("p", "Crossover: " + "; ".join(crossover_lines(m)) + "."),
                ("p", "Model assumptions: " + " ".join(f"({i + 1}) {a}" for i, a in enumerate(sv["assumptions"]))),
                ("p", "Check against a real closed loop (the engine, waves of B requests, plain and speculative "
                      f"interleaved): {'agrees' if sv.get('validation_agrees') else 'does NOT agree everywhere'} "
                      f"({sv.get('validation_rule', 'prediction inside the measured CI')}). {VALIDATION_NOTE}"),
                ("table", VALIDATION_HEADER, validation_rows(m), None)]
    if not found:
        out.append(("p", "No batched speculation results (latency/batched/ missing or marginal not re-run)."))
    return out

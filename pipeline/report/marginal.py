"""The marginal-cost page of a pair specq's engine measured: Markdown that reads without the JSON,
and a plot (ms/token vs k, acceptance per position); `report` is pipeline.serving.marginal.pair_report's.
A pair the latency stage screened out gets the speedup bound per k instead of a measured table.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import atomic_write_bytes
from pipeline.report.document import Block, to_markdown
from pipeline.report.figures import ci_errors, finish_axes, png_bytes, pyplot
from pipeline.report.format import MISSING, footnote, interval, number
from pipeline.report.format import mark as like_mark
from pipeline.serving.marginal import MIN_TIMING_REPEATS, category_entry, timed_enough


def temp_label(t: str) -> str:
    return f"{t} (greedy)" if float(t) == 0.0 else t


SCREEN_HEADER = ["k", "E_hi(k): upper end of acceptance's CI", "T_plain_hi ms", "T_verify_lo(k+1) ms",
                 "T_draft_lo(k) ms", "speedup at most"]
MAIN_HEADER = ["k", "E[tokens/round]", "mean drafted", "round ms", "ms/token", "speedup",
               "marginal ms/token (k-1 to k)", "Leviathan ms/token"]


def _screened_blocks(report: dict) -> list[Block]:
    """A pair the latency stage screened out: why it does not pay, the bound per k and what it assumes."""
    rec, p = report["screened"], report["screened"].get("probe") or {}
    rows = [[str(r["k"]), number(r["e_hi"], 2) + ("" if r["e_hi_source"].startswith("acceptance") else " (k + 1)"),
             number(r["t_plain_hi_ms"], 2), number(r["t_verify_lo_ms"], 2), number(r["t_draft_lo_ms"], 2),
             f"{number(r['bound'], 2)}x"] for r in rec.get("rows") or []]
    where = f"prompt {p['prompt_id']}" if p.get("prompt_id") else f"{p.get('batch')} rows"
    assumes = "\n".join(f"{i}. {a}" for i, a in enumerate(rec.get("assumes") or [], 1))
    return [
        ("p", f"Device: {report.get('device') or 'unknown'}.\n{workload_line(report)}"),
        ("p", f"**Recommended k = 0: do not speculate.** This pair {report['screened_note']} (latency.screen)."),
        ("p", f"Not timed: {rec.get('skipped') or 'the pair'}. {report.get('recommended_k_by_category_note') or ''}."),
        ("p", "Upper bound on the speedup at each k: tokens per round at most the upper end of the acceptance "
              "stage's CI of E(k) (slice 'all', the largest over temperatures), plain time per token at most the "
              "probe's slowest repeat, and a round at least the probe's fastest draft of k tokens plus its fastest "
              "verify forward of k + 1. Every k is below 1, so no k can be recommended and timing it in detail "
              "could not change that."),
        ("table", SCREEN_HEADER, rows, None),
        ("p", f"Probe: {p.get('repeats')} repeats (after {p.get('warmup')} warm-up) on {where} of "
              f"{p.get('prompt_tokens')} tokens, static cache of {p.get('cache_len')} positions, "
              f"{p.get('plain_steps')} plain steps per repeat at T = {p.get('plain_temperature')}; "
              f"{number(p.get('seconds'), 1)} s. Bound: {rec.get('formula')}."),
        ("p", "What the bound assumes:\n\n" + assumes),
    ]


def _recommendation(report: dict) -> str:
    rows, rec = report["rows"], report["recommended_k"]
    if rec:
        r = next(r for r in rows if r["k"] == rec)
        return (f"**Recommended k = {rec}**: {number(r['ms_per_token'], 2)} ms/token "
                f"{interval(r['ms_per_token_ci'], 2)}, speedup **{number(r['speedup'], 2)}x** "
                f"{interval(r['speedup_ci'], 2)}.")
    best = min(rows, key=lambda r: r["ms_per_token"])
    why = ("No k was measurably faster than plain decoding" if timed_enough(best) else
           "Timed in a single repeat, so no k can be shown faster than plain decoding (its interval "
           f"resamples the prompts only; k is recommended from {MIN_TIMING_REPEATS} repeats on)")
    return (f"**Recommended k = 0: do not speculate.** {why} (best: k = {best['k']}, speedup "
            f"{number(best['speedup'], 2)}x {interval(best['speedup_ci'], 2)}).")


def _leviathan_gaps(rows: list[dict]) -> str:
    """A sentence on the k where measured and predicted ms/token differ by more than 10%, or ""."""
    gaps = [r for r in rows if r.get("predicted_ms_per_token")
            and abs(r["ms_per_token"] / r["predicted_ms_per_token"] - 1) > 0.10]
    if not gaps:
        return ""
    ks = ", ".join(f"k={r['k']} ({number(r['ms_per_token'] / r['predicted_ms_per_token'], 2)}x)" for r in gaps)
    if sum(r["ms_per_token"] > r["predicted_ms_per_token"] for r in gaps) >= len(gaps) / 2:
        why = ("rounds cost more than 1 + k c plain steps: verifying k+1 tokens costs more than one "
               "plain step, or per-round overhead adds up")
    else:
        why = ("rounds cost less than the model says: the verify pass of k+1 tokens is nearly as "
               "cheap as one plain step and the draft is cheaper in the loop than alone")
    return f"\nMeasured / predicted ms/token differ by more than 10% at {ks}: {why}."


def _measured_blocks(report: dict) -> list[Block]:
    """A timed pair: plain decoding, the recommendation, the table per k and how to read it."""
    p, rows, base = report["primary"], report["rows"], report["baseline_ms_per_token"]
    ci_notes = "".join(f"; {report[key]}" for key in ("ci_method", "timing_ci") if report.get(key))
    table = []
    for r in rows:
        m = r["marginal_ms_per_token"]
        marginal = "n/a (no extra tokens)" if m is None else \
            f"{number(m, 2)} {'pays' if r['marginal_pays'] else 'does not pay'}"
        table.append([f"{r['k']}" + (" **<-**" if r["k"] == report["recommended_k"] else ""),
                      f"{number(r['tokens_per_round'], 2)} {interval(r['tokens_per_round_ci'], 2)}",
                      number(r.get("mean_drafted"), 2),
                      f"{number(r['round_ms'], 2)} {interval(r.get('round_ms_ci') or [None, None], 2)}",
                      f"{number(r['ms_per_token'], 2)} {interval(r['ms_per_token_ci'], 2)}",
                      f"{number(r['speedup'], 2)}x{like_mark(r)} {interval(r['speedup_ci'], 2)}", marginal,
                      number(r.get("predicted_ms_per_token"), 2)])
    out: list[Block] = [
        ("p", f"Device: {report.get('device') or 'unknown'}. Acceptance: slice `{p['slice']}`, temperature "
              f"{temp_label(p['temperature'])}. All intervals are {int(round(report['confidence'] * 100))}% CIs "
              f"({report.get('ci_unit', 'timing repeats')}{ci_notes}).\n{workload_line(report)}"),
        ("p", f"Plain decoding of `{report['variant']}`: **{number(base, 2)} ms/token** "
              f"{interval(report['baseline_ci'], 2)}.\n{_recommendation(report)}"),
        ("table", MAIN_HEADER, table, None)]
    note = footnote(rows, "speedup")
    if note:
        out.append(("p", note))
    if report.get("ks_not_timed_note"):
        out.append(("p", f"{report['ks_not_timed_note']}: they cannot be recommended, so the latency stage did "
                         "not time them (latency.screen)."))
    return out + [
        ("p", "How to read it: E[tokens/round] comes from the acceptance stage (emitted tokens / expected rounds "
              "at that k, from one teacher-forced pass over the target's own text, checked against direct runs "
              "below); the round time (draft up to k tokens + verify them in one target pass + bookkeeping) is "
              "the latency stage's time per drafted count, on the same prompts and temperature, weighted by this "
              "slice's share of rounds drafting each count at k (mean drafted); ms/token = round ms / "
              "E[tokens/round]. The marginal column is the extra round time per extra expected token when k "
              "grows by one (from plain decoding for k = 1); a step *pays* when that is below the ms/token at "
              f"k-1 (the average falls); SEEDS' looser test, below the plain {number(base, 2)} ms/token, only "
              "says the extra tokens come cheaper than plain decoding would make them."),
        ("p", "The Leviathan column predicts ms/token = plain x (1 + k c) / E[tokens/round] with the measured "
              f"per-position acceptance and the measured draft cost ratio c = {number(report.get('cost_ratio_c'), 3)} "
              "(one draft step / one plain target step). It assumes verifying k+1 tokens costs one plain step "
              "and that rounds have no other overhead." + _leviathan_gaps(rows))]


def render_markdown(report: dict, png_name: str | None = None) -> str:
    screened = bool(report.get("screened"))
    blocks = _screened_blocks(report) if screened else _measured_blocks(report)
    blocks += [("h2", "Rule for the recommended k"), ("p", report["rule"])]
    blocks += _direct_blocks(report) + ([] if screened else _slice_blocks(report)) + _position_blocks(report)
    measured = [r for r in report.get("rows") or [] if "measured_tokens_per_round" in r]
    if measured:
        blocks += [("h2", "Tokens per round in the latency run itself"),
                   ("p", f"The latency stage's timed runs ({report.get('latency_new_tokens')} new tokens per "
                         "prompt, so more of their rounds are shortened near the end than the acceptance runs') "
                         "gave, per k: " + ", ".join(f"k={r['k']}: {number(r['measured_tokens_per_round'], 2)} "
                                                     f"tokens/round, {number(r.get('measured_ms_per_token'), 2)} "
                                                     "ms/token" for r in measured) + ".")]
    if png_name:
        what = "speedup bound vs k" if screened else "ms/token vs k"
        blocks.append(("img", png_name, f"{what} and acceptance per position"))
    return to_markdown(f"Draft length k for `{report['variant']}` drafted by `{report['draft']}`", blocks)


def _direct_blocks(report: dict) -> list[Block]:
    checks = report.get("direct_check") or {}
    if not checks:
        return []
    rows = [[k, f"{number(c['derived'], 3)} {interval(c['ci'], 3)}", number(c["direct"], 3),
             f"{number(c['direct'] - c['derived'], 3)} {interval(c['difference_ci'], 3)}",
             (c.get("no_verdict") or "too few prompts") if c["agree"] is None else "yes" if c["agree"] else "**no**"]
            for k, c in sorted(checks.items(), key=lambda kv: int(kv[0]))]
    return [("h2", "E[tokens/round] derived vs direct runs"),
            ("p", "Derived: from the teacher-forced pass; direct: real engine runs at that k on the same prompts. "
                  "Greedy, they must be equal (the same text); sampled, the paired t CI (prompts) of the "
                  "difference must contain 0 (no verdict with fewer than two prompts)."),
            ("table", ["k", "derived [CI]", "direct", "direct - derived [CI]", "agree"], rows, None)]


def workload_line(report: dict) -> str:
    """One sentence naming the workload the acceptance prompts came from."""
    w = report.get("workload")
    if not w:
        return "Workload: not recorded."
    skipped, short, cut = w.get("skipped_too_long"), w.get("skipped_too_short"), w.get("cut")
    extra = "".join([f", {skipped} skipped as too long" if skipped is not None else "",
                     f", {short} skipped as too short" if short else "", f", {cut} cut" if cut else ""])
    return (f"Workload: `{w.get('name')}` ({w.get('n_prompts')} prompts in {len(w.get('categories') or [])} "
            f"categories{extra}; seed {w.get('seed')}; source: {w.get('source')}).")


def category_rows(report: dict) -> list[list[str]]:
    """One row per (category, temperature), the pooled slice "all" first: prompts, recommended k,
    whether it is settled, E[tokens/round] and speedup at k (or at the best k when k = 0) with CIs,
    and E at every k."""
    slices = report.get("slices") or {}
    cats = dict(report.get("recommended_k_by_category") or {})
    out = []
    names = list(cats) or sorted(x for x in slices if x != "all")  # no per-category entries: every slice
    for s in (["all"] if "all" in slices else []) + names:
        for t in sorted(slices.get(s, {}), key=float):
            tab = slices[s][t]
            # the pooled slice (or a slice without an entry): the same rule on its own table
            e = cats.get(s, {}).get(t) or category_entry(tab, tab)  # the table carries the slice's few_prompts
            shown = "" if e["at_k"] == e["k"] else f" (best k = {e['at_k']})"
            notes = "; ".join(x for x in (e.get("verdict"), "few prompts" if e.get("few_prompts") else "") if x)
            settled = {True: "yes", False: "no", None: MISSING}[e.get("settled")] + (f" ({notes})" if notes else "")
            out.append([s, temp_label(t), str(e.get("n_prompts", MISSING)), str(e["k"]), settled,
                        f"{number(e['tokens_per_round'], 2)} {interval(e['tokens_per_round_ci'], 2)}{shown}",
                        f"{number(e['speedup'], 2)}x {interval(e['speedup_ci'], 2)}{shown}",
                        ", ".join(number(r["tokens_per_round"], 2) for r in tab["rows"])])
    return out


CATEGORY_HEADER = ["category", "temperature", "prompts", "recommended k", "settled", "E[tokens/round] at k [CI]",
                   "speedup at k [CI]", "E[tokens/round] at k=1..k_max"]


def _slice_blocks(report: dict) -> list[Block]:
    rows = category_rows(report)
    if not rows:
        return []
    out = [("h2", "k per category"), ("p", workload_line(report)),
           ("p", "Same round times, each category's own acceptance (`recommended_k_by_category`): prompt lookup "
                 "can pay where the output copies the input and not on open chat. Where the recommended k is 0 "
                 "the E[tokens/round] and speedup columns are at the best k, marked."),
           ("table", CATEGORY_HEADER, rows, None)]
    return out + ([("p", report["category_rule"])] if report.get("category_rule") else [])


def _position_blocks(report: dict) -> list[Block]:
    pos = report.get("acceptance_per_position") or []
    if not pos:
        return []
    rows = [[str(p["position"]), number(p.get("conditional"), 3), number(p.get("prefix"), 3),
             number(p.get("expected_beta"), 3), number(p.get("n"), 1), interval(p.get("ci") or [None, None], 3)]
            for p in pos]
    return [("h2", "Acceptance per position"),
            ("p", "Rounds at k = k_max (not shortened near the end), in expectation over the accept/reject "
                  "outcomes given the texts: conditional = P(position i accepted | 1..i-1 accepted); prefix = "
                  "P(1..i all accepted); beta = mean of 1 - TV(p, q) at that position; the CI resamples prompts "
                  "and is never narrower than the Wilson interval on the expected round counts."),
            ("table", ["position", "conditional", "prefix", "mean beta", "rounds reaching it (expected)",
                       "CI (conditional)"], rows, None)]


def _bound_axes(ax, report: dict) -> None:
    """A screened pair's left panel: the speedup bound per k against the break-even line."""
    rows = report["screened"].get("rows") or []
    ax.plot([r["k"] for r in rows], [r["bound"] for r in rows], "o-", color="C0", label="speedup upper bound (screen)")
    ax.axhline(1.0, color="C3", label="plain decoding (speedup 1)")
    ax.set_ylim(0, max([1.2, *(r["bound"] * 1.1 for r in rows)]))
    finish_axes(ax, "draft length k", "speedup at most", f"{report['variant']} / {report['draft']}: does not pay, "
                "not timed", legend=8)


def _speed_axes(ax, report: dict) -> None:
    """A timed pair's left panel: ms/token per k with its CI band, the prediction and plain decoding."""
    rows, rec = report["rows"], report["recommended_k"]
    ks = [r["k"] for r in rows]
    ax.plot(ks, [r["ms_per_token"] for r in rows], "o-", color="C0", label="speculative, measured")
    ax.fill_between(ks, [r["ms_per_token_ci"][0] for r in rows], [r["ms_per_token_ci"][1] for r in rows],
                    color="C0", alpha=0.25, label=f"{int(report['confidence'] * 100)}% CI")
    pred = [(r["k"], r["predicted_ms_per_token"]) for r in rows if r.get("predicted_ms_per_token")]
    if pred:
        ax.plot(*zip(*pred), "s--", color="C2", label="Leviathan prediction")
    ax.axhline(report["baseline_ms_per_token"], color="C3", label="plain decoding")
    ax.axhspan(*report["baseline_ci"], color="C3", alpha=0.15)
    if rec:
        ax.axvline(rec, color="k", ls=":", label=f"recommended k={rec}")
    finish_axes(ax, "draft length k", "ms per token", f"{report['variant']} / {report['draft']}", legend=8)


def write_plot(report: dict, path: Path) -> None:
    fig, (ax, ax2) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    (_bound_axes if report.get("screened") else _speed_axes)(ax, report)
    _position_axes(ax2, report)
    fig.tight_layout()
    atomic_write_bytes(path, png_bytes(fig, dpi=110, tight=False))


def _position_axes(ax2, report: dict) -> None:
    """The right panel: acceptance per position with CIs."""
    pos = report.get("acceptance_per_position") or []
    if pos:
        x = [p["position"] for p in pos]
        cond = [p.get("conditional") if p.get("conditional") is not None else float("nan") for p in pos]
        cis = [p.get("ci") or [c, c] for c, p in zip(cond, pos)]
        ax2.errorbar(x, cond, yerr=ci_errors(cond, cis), fmt="o-", capsize=3, label="conditional")
        ax2.plot(x, [p.get("prefix") for p in pos], "s--", label="prefix (all up to i)")
        if any(p.get("expected_beta") is not None for p in pos):
            ax2.plot(x, [p.get("expected_beta") for p in pos], "^:", label="mean beta = 1 - TV")
        ax2.set_ylim(-0.02, 1.02)
        ax2.set_xticks(x)
        ax2.legend(fontsize=8)
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("acceptance")
    ax2.set_title(f"acceptance per position ({report['primary']['slice']}, T={report['primary']['temperature']})")

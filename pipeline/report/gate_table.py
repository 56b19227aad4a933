"""The gate's table for people: the headline, one row per release variant and slice, speculation;
and the report's gate section (the go/no-go table, the forest plot, groups, distribution).

    from pipeline.report.gate_table import render_table, cell_text
    print(render_table(json.load(open("runs/x/gate.json"))))
    blocks = gate_blocks(gate, figures, dpi)      # report blocks (pipeline/report/document.py)

The table is written by the gate stage (gate/table.md) and printed by `gate-check`; the blocks
open the report.
"""
from __future__ import annotations

from pipeline.report.document import Block, to_markdown
from pipeline.report.figures import png_bytes, pyplot
from pipeline.report.format import interval, number


def cell_text(c: dict) -> str:
    """diff [CI] status, with ': open (budget) at 80 of 240 items' where scoring stopped early."""
    settle = opened = ""
    if c["status"] == "inconclusive":
        settle = (f" (~{c['items_to_settle']} items per slice would settle it)" if c.get("items_to_settle")
                  else " (diff sits on -margin: no n settles it)")
        if c.get("stopped_on") in ("budget", "verdict", "early"):
            why = {"budget": "budget", "verdict": "variant already no-go"}.get(c["stopped_on"], "stopped early")
            scored = c.get("slice_items", (c.get("n_max") or 0) - (c.get("items_left") or 0))
            opened = f": open ({why}) at {scored} of {c.get('n_max')} items"
    return f"{number(c['diff'], 3, signed=True)} {interval(c['ci'], 3, signed=True)} {c['status']}{opened}{settle}"


def headline(gate: dict) -> str:
    """One sentence on what the decision means, in words a release manager reads."""
    decision = gate["decision"]
    release = gate.get("release_variants") or []
    by = {d: [n for n in release if gate["variants"].get(n, {}).get("decision") == d]
          for d in ("no-go", "inconclusive")}
    if decision == "go":
        return f"Every release variant ({', '.join(release)}) passes every gated cell."
    if decision == "no-go":
        return f"Release variant(s) {', '.join(by['no-go'])} fail: a cell's CI lies wholly below -margin."
    why = (f"INCONCLUSIVE: nothing fails, but {', '.join(by['inconclusive'])} lack(s) the evidence to pass. "
           "The inconclusive cells say how many items per slice would settle them; `make gate` exits 3 until "
           "they do.")
    stopped = {n: k for n in release if (k := gate["variants"].get(n, {}).get("stopped_on_budget"))}
    if stopped:
        why += (f" Scoring stopped on the time budget (quality's share of `budget.minutes`), not on the data, "
                f"with {sum(map(len, stopped.values()))} cell(s) of {', '.join(stopped)} open; a re-run with a "
                "larger budget continues from the items already scored.")
    return why


def render_table(gate: dict) -> str:
    """Markdown: the headline, then one row per gated cell (diff, CI, margin, status)."""
    rows = []
    for name, v in gate["variants"].items():
        head = [name, "yes" if v["release"] else "no", f"**{v['decision']}**"]
        if not v["slices"]:
            rows.append([*head, "-", "-", "-", "-", f"missing: {', '.join(v['missing']) or 'nothing gated'}",
                         "-", "-", "-", "-"])
        for i, (key, c) in enumerate(v["slices"].items()):
            cells = [(key, c, "")] + [(f"{key}/{g}", gc, "" if gc.get("gated", True) else " (reported, not gated)")
                                      for g, gc in (c.get("groups") or {}).items()]
            for j, (label, x, tag) in enumerate(cells):
                rows.append([*(head if i == j == 0 else ["", "", ""]), label, x["metric"],
                             number(x["reference"], 3), number(x["variant"], 3), cell_text(x) + tag,
                             f"{x['ci_level']:.4f}", f"{x['margin']:g}", str(x["n"]),
                             str(x.get("items_to_settle") or "-")])
            for what, ce in (c.get("calibration_error") or {}).items():
                if isinstance(ce, dict):
                    rows.append(["", "", "", f"{key}:{what}", what, number(ce["reference"], 3),
                                 number(ce["variant"], 3), f"{number(ce['diff'], 3, signed=True)} (reported, "
                                 "not gated)", "-", "-", str(c["n"]), "-"])
        for what, chk in (v.get("distribution") or {}).get("checks", {}).items():
            rows.append(["", "", "", "distribution", what, "-", "-", f"{interval(chk['ci'], 3)} {chk['status']} "
                         f"(threshold {chk['threshold']:g})", "-", "-", "-", "-"])
    blocks = [("p", headline(gate)), ("p", f"Reference `{gate['reference']}`. {gate['method']}."),
              ("table", ["variant", "release", "decision", "slice", "metric", "reference", "variant",
                         "diff [CI] status", "CI level", "margin", "n", "items/slice to settle"], rows, None)]
    spec = gate.get("speculation") or {"pairs": {}}
    if spec["pairs"]:
        blocks += [("p", f"Speculation (lossless check, judged apart from quality): **{spec['decision']}**"),
                   ("table", ["pair", "greedy identical (dtype)", "sampling p (adjusted)", "decision"],
                    [[key, f"{_greedy_cell(p)} ({p.get('dtype') or '-'})",
                      f"{number(p['sampling_p'], 3)} ({number(p['sampling_p_adjusted'], 3)})",
                      f"**{p['decision']}**"] for key, p in spec["pairs"].items()], None)]
    return to_markdown(f"specq gate: {gate['decision'].upper()}", blocks)


def _greedy_cell(pair: dict) -> str:
    """True / False, or how many divergences the dtype's near-ties explain (lossless.py)."""
    n, bad = pair.get("mismatches") or 0, pair.get("unexplained_mismatches")
    if pair.get("greedy_identical") or not n or bad is None:
        return str(pair.get("greedy_identical"))
    return (f"False: {n} divergences, all near-ties (tolerance {number(pair.get('tie_tolerance'), 3)})" if bad == 0
            else f"False: {bad} of {n} divergences not near-ties")


def forest_plot(gate: dict, dpi: int) -> bytes | None:
    """Each (variant, slice) difference with its CI, coloured by status, beside -margin; None when no cells."""
    rows = [(f"{v} / {k}", c) for v, e in gate["variants"].items() for k, c in e["slices"].items()]
    if not rows:
        return None
    colour = {"pass": "#2e7d32", "fail": "#c62828", "inconclusive": "#ef8f00"}
    fig, ax = pyplot().subplots(figsize=(7.5, 0.32 * len(rows) + 1.2))
    for y, (label, c) in enumerate(reversed(rows)):
        lo, hi = c["ci"]
        ax.plot([lo, hi], [y, y], color=colour[c["status"]], lw=2)
        ax.plot(c["diff"], y, "o", color=colour[c["status"]], ms=5)
        ax.plot([-c["margin"]] * 2, [y - 0.4, y + 0.4], color="#c62828", lw=1.5)
    ax.axvline(0.0, color="grey", lw=0.8)
    margins = {c["margin"] for _, c in rows}
    if len(margins) == 1:
        ax.axvline(-margins.pop(), color="#c62828", ls="--", lw=1, label="-margin")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("paired difference, variant - reference (negative = worse); red tick = -margin")
    ax.set_title(f"Paired differences with multiplicity-adjusted CIs ({gate['multiplicity']})", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return png_bytes(fig, dpi)


def gate_blocks(gate: dict, figures: dict[str, bytes], dpi: int) -> list[Block]:
    """The report's first section: the decision, the go/no-go table (one row per variant, one column
    per slice), the forest plot (added to `figures`), then per group and the distribution checks."""
    keys = list(dict.fromkeys(k for v in gate["variants"].values() for k in v["slices"]))
    rows, classes = [], []
    for name, v in gate["variants"].items():
        rows.append([name, "yes" if v["release"] else "no", v["decision"].upper(),
                     *[cell_text(v["slices"][k]) if k in v["slices"] else "-" for k in keys]])
        classes.append([None, None, v["decision"],
                        *[v["slices"][k]["status"] if k in v["slices"] else None for k in keys]])
    out: list[Block] = [
        ("h2", f"Decision: {gate['decision'].upper()}"),
        ("p", f"Each release variant against `{gate['reference']}`, per slice: the difference (negative = "
              "worse), its CI and status (green passes, red fails, orange is open)."),
        ("table", ["variant", "release", "decision", *keys], rows, classes),
    ]
    forest = forest_plot(gate, dpi)
    if forest:
        figures["forest.png"] = forest
        out.append(("img", "forest.png", "paired differences (dots) with their CIs; red tick = -margin", "wide"))
    out += [("h3", "How a cell is decided"),
            ("p", f"Release variants: {', '.join(gate['release_variants']) or 'none'}. {gate['method']}. "
                  "'Items to settle' is the n that would give 80% power to decide an open cell, assuming "
                  "the observed difference and spread.")]
    grows, gclasses = [], []
    for name, v in gate["variants"].items():
        for key, c in v["slices"].items():
            for g, gc in (c.get("groups") or {}).items():
                grows.append([name, f"{key}/{g}", cell_text(gc), str(gc["n"]),
                              "gated" if gc.get("gated") else "reported"])
                gclasses.append([None, None, gc["status"], None, None])
    if grows:
        out += [("h3", "Per group (sub-slices)"),
                ("p", "Groups are reported at the unadjusted level and are not gated unless "
                      "gate.gate_groups is set (few items each: low power, and a larger family)."),
                ("table", ["variant", "group", "diff [CI] status", "n", ""], grows, gclasses)]
    drows = []
    for name, v in gate["variants"].items():
        d = v.get("distribution") or {}
        if d.get("kl_mean") is not None:
            checks = "; ".join(f"{k}: {c['status']}" for k, c in d.get("checks", {}).items()) or "not gated"
            drows.append([name, f"{number(d['kl_mean'], 4)} {interval(d.get('kl_ci'), 4)}",
                          f"{number(d.get('top1_agreement'), 3)} {interval(d.get('top1_ci'), 3)}",
                          f"{number(d.get('ppl_ratio'), 3)} {interval(d.get('ppl_ratio_ci'), 3)}", str(d.get("n_docs")),
                          checks])
    if drows:
        out += [("h3", "Distribution vs the reference"),
                ("table", ["variant", "KL", "top-1 agreement", "perplexity ratio", "docs", "gated"],
                 drows, None)]
    return out

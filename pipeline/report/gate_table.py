"""The gate's table for people: the headline, one row per release variant and slice, speculation.

    from pipeline.report.gate_table import render_table, cell_text
    print(render_table(json.load(open("runs/x/gate.json"))))

Written by the gate stage (gate/table.md), printed by `gate-check`, embedded in the report.
"""
from __future__ import annotations

import math


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def cell_text(c: dict) -> str:
    lo, hi = c["ci"]
    settle = ""
    if c["status"] == "inconclusive":
        settle = (f" (~{c['items_to_settle']} items per slice would settle it)" if c.get("items_to_settle")
                  else " (diff sits on -margin: no n settles it)")
    return f"{_fmt(c['diff'], True)} [{_fmt(lo, True)}, {_fmt(hi, True)}] {c['status']}{settle}"


def headline(gate: dict) -> list[str]:
    """The decision and one sentence on what it means, in words a release manager reads."""
    decision = gate["decision"]
    release = gate.get("release_variants") or []
    by = {d: [n for n in release if gate["variants"].get(n, {}).get("decision") == d]
          for d in ("go", "no-go", "inconclusive")}
    if decision == "go":
        why = f"Every release variant ({', '.join(release)}) passes every gated cell."
    elif decision == "no-go":
        why = (f"Release variant(s) {', '.join(by['no-go'])} fail: a cell's CI lies wholly below "
               f"-margin.")
    else:
        why = (f"INCONCLUSIVE: nothing fails, but {', '.join(by['inconclusive'])} lack(s) the "
               f"evidence to pass. The inconclusive cells say how many items per slice would settle "
               f"them; `make gate` exits 3 until they do.")
    return [f"# specq gate: {decision.upper()}", "", why]


def render_table(gate: dict) -> str:
    """Markdown: the headline, then one row per gated cell (diff, CI, margin, status)."""
    lines = headline(gate) + [
        "", f"Reference `{gate['reference']}`. {gate['method']}.", "",
        "| variant | release | decision | slice | metric | reference | variant | diff [CI] status "
        "| CI level | margin | n | items/slice to settle |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in gate["variants"].items():
        rel = "yes" if v["release"] else "no"
        if not v["slices"]:
            lines.append(f"| {name} | {rel} | **{v['decision']}** | - | - | - | - | missing: "
                         f"{', '.join(v['missing']) or 'nothing gated'} | - | - | - | - |")
        for i, (key, c) in enumerate(v["slices"].items()):
            head = f"| {name} | {rel} | **{v['decision']}** " if i == 0 else "| | | "
            lines.append(f"{head}| {key} | {c['metric']} | {_fmt(c['reference'])} | {_fmt(c['variant'])} "
                         f"| {cell_text(c)} | {c['ci_level']:.4f} | {c['margin']:g} | {c['n']} "
                         f"| {c.get('items_to_settle') or '-'} |")
            for g, gc in (c.get("groups") or {}).items():
                tag = "" if gc.get("gated", True) else " (reported, not gated)"
                lines.append(f"| | | | {key}/{g} | {gc['metric']} | {_fmt(gc['reference'])} "
                             f"| {_fmt(gc['variant'])} | {cell_text(gc)}{tag} | {gc['ci_level']:.4f} "
                             f"| {gc['margin']:g} | {gc['n']} | {gc.get('items_to_settle') or '-'} |")
            for what, ce in ((c.get("calibration_error") or {}).items()):
                if isinstance(ce, dict):
                    lines.append(f"| | | | {key}:{what} | {what} | {_fmt(ce['reference'])} "
                                 f"| {_fmt(ce['variant'])} | {_fmt(ce['diff'], True)} (reported, not "
                                 f"gated) | - | - | {c['n']} | - |")
        for what, chk in (v.get("distribution") or {}).get("checks", {}).items():
            lo, hi = chk["ci"]
            lines.append(f"| | | | distribution | {what} | - | - | [{_fmt(lo)}, {_fmt(hi)}] "
                         f"{chk['status']} (threshold {chk['threshold']:g}) | - | - | - | - |")
    spec = gate.get("speculation") or {"pairs": {}}
    if spec["pairs"]:
        lines += ["", f"Speculation (lossless check, judged apart from quality): "
                      f"**{spec['decision']}**", "",
                  "| pair | greedy identical (dtype) | sampling p (adjusted) | decision |", "|---|---|---|---|"]
        for key, p in spec["pairs"].items():
            lines.append(f"| {key} | {p['greedy_identical']} ({p.get('dtype') or '-'}) | {_fmt(p['sampling_p'])} "
                         f"({_fmt(p['sampling_p_adjusted'])}) | **{p['decision']}** |")
    return "\n".join(lines) + "\n"

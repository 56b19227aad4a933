"""The gate stage, and gate-check: the release decision from the quality results, as a table and an exit status.

    specq gate --run runs/smollm2-135m [--variant int8] [--table]   # exit 0 go, 1 no-go, 3 inconclusive
    specq gate-check --run runs/smollm2-135m                        # the table of a gated run

Reads the quality stage's per-item scores and the acceptance stage's lossless checks, decides every
(variant, slice) cell (pipeline/gate/decision.py), writes `runs/<run>/gate.json` and `gate/table.md`
(pipeline/report/gate_table.py). `specq gate` runs the stage where it is not up to date, then prints
the decision; exit 2 is bad input. With --variant, the decision is over those variants' cells only.
How cells are decided: docs/methods/gate.md.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import (StageContext, StageError, atomic_write_json, atomic_write_text, read_json,
                                 require_schema)
from pipeline.gate.decision import EXIT_CODES, build_gate, overall_decision
from pipeline.report.gate_table import render_table


def run(ctx: StageContext) -> None:
    gate = build_gate(ctx.run_dir, ctx.config)
    atomic_write_json(ctx.run_dir / "gate.json", gate)
    table = render_table(gate)
    atomic_write_text(ctx.out_dir / "table.md", table)
    ctx.meta["decision"] = gate["decision"]
    ctx.meta["gate_json"] = str(ctx.run_dir / "gate.json")


def gate_check(run_dir: str | Path, variants: list[str] | None = None, table: bool = True) -> int:
    """Print a finished gate's decision (the whole table, or one line per release variant); the
    exit status of the decision (EXIT_CODES). `variants`: decide on these release variants only."""
    from pipeline.report.summary import deciding_cell

    require_schema(Path(run_dir) / "gate" / "meta.json")
    path = Path(run_dir) / "gate.json"
    gate = read_json(path, "gate result")
    if not isinstance(gate, dict) or gate.get("decision") not in EXIT_CODES:
        raise StageError(f"corrupt artifact: {path} has no decision (go, no-go or inconclusive)")
    release = list(gate.get("release_variants") or [])
    if not release:
        raise StageError(f"{path}: no release variant, nothing was decided (re-run the gate)")
    chosen = list(dict.fromkeys(variants or release))
    unknown = [v for v in chosen if v not in release]
    if unknown:
        raise StageError(f"gate --variant {unknown[0]}: not a release variant of this run "
                         f"(release variants: {', '.join(release)})")
    decision = overall_decision([gate["variants"][v]["decision"] for v in chosen]) if variants else gate["decision"]
    if table:
        print(render_table(gate), end="")
    else:
        for v in chosen:
            entry = gate["variants"][v]
            print(f"{v:<14} {entry['decision']:<13} {deciding_cell(entry)}")
    if variants:
        print(f"decision for {', '.join(chosen)}: {decision}")
    return EXIT_CODES[decision]

"""The gate stage, and gate-check: the release decision from the quality results, as a table and an exit status.

    python -m pipeline gate       --run runs/smollm2-135m --config configs/default.yaml
    python -m pipeline gate-check --run runs/smollm2-135m   # the table; exit 0 go, 1 no-go, 3 inconclusive

The gate reads the quality stage's per-item scores and the acceptance stage's lossless checks and
decides every (variant, slice) cell (pipeline/gate/decision.py says how), then writes
`runs/<run>/gate.json` and `gate/table.md` (pipeline/report/gate_table.py) and prints the table.

gate-check's exit status: 0 go (every release variant passes every gated cell), 1 no-go (a release
variant fails a cell), 3 inconclusive (nothing fails, but some release cell lacks the evidence to
pass; the table says how many items per slice would settle it), 2 bad input (no or corrupt
gate.json).
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.core.stage import StageContext, StageError, atomic_write_json, atomic_write_text, read_json
from pipeline.gate.decision import EXIT_CODES, build_gate
from pipeline.report.gate_table import render_table


def run(ctx: StageContext) -> None:
    gate = build_gate(ctx.run_dir, ctx.config)
    atomic_write_json(ctx.run_dir / "gate.json", gate)
    table = render_table(gate)
    atomic_write_text(ctx.out_dir / "table.md", table)
    ctx.meta["decision"] = gate["decision"]
    ctx.meta["gate_json"] = str(ctx.run_dir / "gate.json")
    print(table, file=sys.stderr)


def gate_check(run_dir: str | Path) -> int:
    """Print the table of a finished gate; the exit status of its decision (EXIT_CODES)."""
    path = Path(run_dir) / "gate.json"
    gate = read_json(path, "gate result")
    if not isinstance(gate, dict) or gate.get("decision") not in EXIT_CODES:
        raise StageError(f"corrupt artifact: {path} has no decision (go, no-go or inconclusive)")
    if not gate.get("release_variants"):
        raise StageError(f"{path}: no release variant, nothing was decided (re-run the gate)")
    print(render_table(gate), end="")
    return EXIT_CODES[gate["decision"]]

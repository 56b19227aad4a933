"""The report: the go/no-go table, the forest plot, speculation per pair, the variants, provenance.

    python -m pipeline report --run runs/smollm2-135m --config configs/default.yaml

Writes `report/report.md` (figures beside it as report/*.png) and `report/index.html`, which is
self-contained (figures embedded as base64, inline CSS) so it can be mailed or attached to a
release ticket. Both are rendered from one list of blocks, so they say the same thing. Inputs a
stage did not produce (no pairs, no latency grid) become a line saying so; a corrupt one is an error.
The sections and their figures are drawn by pipeline/report/; provenance is drawn here.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.core.stage import StageContext, atomic_write_bytes, atomic_write_text, library_versions, read_json
from pipeline.report.document import Block, to_html, to_markdown
from pipeline.report.format import number, optional_json
from pipeline.report.gate_table import gate_blocks
from pipeline.report.speculation import speculation_blocks
from pipeline.report.summary import summary_blocks
from pipeline.report.variants import runtime_blocks, variant_blocks


def provenance_blocks(run_dir: Path, cfg, gate_meta: dict) -> list[Block]:
    """The model and host, each stage's start, wall time and input hash, library versions (as the
    gate recorded them, else this process's) and the resolved config."""
    model = optional_json(run_dir / "model" / "meta.json", "model meta.json")
    libs = gate_meta.get("libraries") or library_versions()
    host = gate_meta.get("host") or {}
    arch = {k: model[k] for k in ("architecture", "layers", "hidden_size", "vocab_size", "parameters")
            if k in model}
    stages = []
    for stage in ("model", "variants", "drafts", "acceptance", "latency", "marginal", "quality", "gate"):
        m = optional_json(run_dir / stage / "meta.json", f"{stage} meta.json")
        if m:
            stages.append([stage, m.get("started", "-"), number(m.get("wall_s"), 1),
                           str(m.get("input_hash", ""))[:12]])
    facts = [["model", str(model.get("source") or model.get("model") or "-")],
             ["architecture", str(arch or "-")], ["run", str(run_dir)],
             ["report date", time.strftime("%Y-%m-%d %H:%M:%S %Z")], ["seed", str(cfg.seed)],
             ["device (config)", cfg.device],
             ["host", f"{host.get('platform', '-')}, {host.get('cpus', '-')} CPUs"]]
    return [
        ("h2", "Provenance"),
        ("table", ["", ""], facts, None),
        ("h3", "Stages"),
        ("table", ["stage", "started", "wall s", "input hash"], stages, None),
        ("h3", "Library versions"),
        ("table", ["library", "version"], [[k, str(v)] for k, v in libs.items()], None),
        ("h3", "Resolved config"),
        ("pre", json.dumps(cfg.model_dump(mode="json"), indent=1)),
    ]


def run(ctx: StageContext) -> None:
    run_dir, cfg, dpi = ctx.run_dir, ctx.config, ctx.config.report.dpi
    gate = read_json(run_dir / "gate.json", "gate result")
    gate_meta = optional_json(run_dir / "gate" / "meta.json", "gate meta.json")

    # Each section reads its own artifacts from the run; figures collects the PNGs they draw or copy.
    figures: dict[str, bytes] = {}
    blocks = summary_blocks(run_dir)  # what make evaluate prints last, as tables
    blocks += gate_blocks(gate, figures, dpi)  # gate.json: decision, forest plot, groups, distribution
    blocks += speculation_blocks(run_dir, gate, figures, dpi)  # acceptance/, marginal/, latency/ per pair
    blocks += variant_blocks(run_dir, figures)  # variants/*/meta.json, latency/<variant>.json grid
    blocks += runtime_blocks(run_dir)  # latency/*.json: device, kernels, memory plan
    blocks += provenance_blocks(run_dir, cfg, gate_meta)  # every stage's meta.json, the config

    title = f"{cfg.report.title}: {run_dir.name}"
    for name, png in figures.items():
        atomic_write_bytes(ctx.out_dir / name, png)
    atomic_write_text(ctx.out_dir / "report.md", to_markdown(title, blocks))
    atomic_write_text(ctx.out_dir / "index.html", to_html(title, blocks, figures, gate["decision"]))
    ctx.meta["figures"] = sorted(figures)
    ctx.meta["decision"] = gate["decision"]

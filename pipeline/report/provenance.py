"""The report's provenance section: what was measured, where, when and with what, from the stages'
meta.json files: `blocks += provenance_blocks(run_dir, cfg, gate_meta)`."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.core.stage import library_versions
from pipeline.report.document import Block
from pipeline.report.format import number, optional_json


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

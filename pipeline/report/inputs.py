"""Reading a run's artifacts for the report: what a stage did not write is empty, what is corrupt
or of another specq version is an error.

    from pipeline.report.inputs import json_files, optional_json
    pairs = json_files(run_dir / "marginal", "*__*.json", "marginal report")   # {stem: document}
    meta = optional_json(run_dir / "gate" / "meta.json", "gate meta.json")      # {} when absent
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import StageError, read_json, require_schema


def json_files(folder: Path, pattern: str, what: str) -> dict[str, dict]:
    """{file stem: JSON object} for the files matching `pattern` in `folder`, meta.json left out,
    in name order; {} when there are none. StageError when a file is not a JSON object, or when
    the folder's meta.json is of another specq version (require_schema)."""
    require_schema(folder / "meta.json")
    out = {}
    for path in sorted(folder.glob(pattern)):
        if path.name == "meta.json":
            continue
        doc = read_json(path, what)
        if not isinstance(doc, dict):
            raise StageError(f"corrupt {what}: {path} is not a JSON object")
        out[path.stem] = doc
    return out


def optional_json(path: Path, what: str) -> dict:
    """{} when the file is absent (a stage that wrote nothing); StageError when it is corrupt."""
    return read_json(path, what) if path.is_file() else {}

"""A stage's code hash covers everything it runs: its own module, every project module that module
imports (however indirectly, lazily included), the runner and the config schema, and its data files.

The import graph here is the one tests/test_imports.py builds from the source, independently of
pipeline.core.stage.import_closure, which the hash uses.
"""
from __future__ import annotations

import shutil

import pytest

from pipeline.core import stage
from pipeline.core.stage import RUNNER_CODE, REPO, StageError, code_files, code_hash
from pipeline.stages.table import STAGES
from test_imports import import_graph, project_modules


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


@pytest.mark.parametrize("name", list(STAGES))
def test_a_stage_hashes_every_module_it_imports(name):
    spec = STAGES[name]
    graph, paths = import_graph(), project_modules()
    entry = spec.entry.split(":")[0]
    assert entry in paths, f"{name}: entry {spec.entry} is not a project module"
    assert f"import:{entry}" in spec.code, f"{name}: its code entries do not include its entry module"
    needed = set()
    for root in [entry, *(e.removeprefix("import:") for e in RUNNER_CODE)]:
        needed |= {paths[m] for m in _reachable(graph, root)}
    hashed = code_files(spec.code + RUNNER_CODE)
    missing = sorted(str(p.relative_to(REPO)) for p in needed - hashed)
    assert not missing, f"stage {name} runs these files but does not hash them: {missing}"
    assert REPO / "pipeline/core/stage.py" in hashed and REPO / "pipeline/core/config.py" in hashed


def test_a_stale_code_entry_is_an_error_not_a_gap():
    """The runner's own files used to be named by path; after a move such a glob matched nothing
    and was dropped silently. Now an entry that matches nothing stops the stage."""
    with pytest.raises(StageError, match="matches no file"):
        code_hash(["pipeline/stage.py"])
    with pytest.raises(StageError, match="no module pipeline.nonexistent"):
        code_hash(["import:pipeline.nonexistent"])


def test_editing_any_file_a_stage_imports_changes_its_hash(tmp_path, monkeypatch):
    """On a copy of the tree: append a comment to each file of the latency stage's code (and to
    the runner and the config schema, which every stage imports) and the hash moves; a file it
    does not import (the gate) leaves it alone."""
    for pkg in ("pipeline", "draft_models", "evals"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(stage, "REPO", tmp_path)
    entries = STAGES["latency"].code + RUNNER_CODE
    files = sorted(code_files(entries))
    assert tmp_path / "pipeline/core/config.py" in files and tmp_path / "pipeline/latency/speculative.py" in files
    before = code_hash(entries)
    for path in files:
        original = path.read_text()
        path.write_text(original + "\n# edited\n")
        assert code_hash(entries) != before, f"editing {path.relative_to(tmp_path)} left the hash unchanged"
        path.write_text(original)
    assert code_hash(entries) == before
    gate = tmp_path / "pipeline/stages/gate.py"
    assert gate not in files
    gate.write_text(gate.read_text() + "\n# edited\n")
    assert code_hash(entries) == before


def test_the_stages_that_draw_the_builtin_prompts_hash_their_data_file():
    """The builtin workload's texts are data, not a module: the stages that draw prompts list the
    file, so editing a prompt re-runs them."""
    from pipeline.speculation.prompts import PROMPTS_FILE
    for name in ("acceptance", "latency", "vllm"):
        assert PROMPTS_FILE in code_files(STAGES[name].code), name

"""The house rule, read from the source: imports run one way, and no module imports itself back.

The README's architecture section states the rule; this test is what keeps it true. The graph is
built with ast (nothing is imported), from every import statement in every project module,
including the ones inside functions: a lazy import still ties two modules together.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "draft_models", "evals")

# Rank of each part of the house. A module may import its own part, and parts of a lower rank;
# parts of one rank do not import each other. core and decode import nothing else of specq.
RANKS = {
    "core": 0, "evals": 0,
    "decode": 1, "stats": 1, "models": 1, "vllm": 1,
    "variants": 2, "speculation": 2, "gate": 2,
    "latency": 3, "quality": 3,
    "serving": 4,
    "report": 5,
    "draft_models": 6,
    "stages": 7,
    "tools": 8, "__main__": 8,
}
IMPORTS_NOTHING = {"core", "decode", "evals"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "tasks" not in p.relative_to(ROOT).parts}  # evals/tasks: lm-eval's YAML helpers


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports (an imported name that is a module counts as that module)."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
                    if node.level else node.module or "")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                out.add(t)
    return out


def part(module: str) -> str:
    """The part of the house a module belongs to: pipeline.latency.memory -> latency."""
    bits = module.split(".")
    if bits[0] != "pipeline":
        return bits[0]
    return bits[1] if len(bits) > 1 else "pipeline"


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in sorted(graph.items()):
        a = part(src)
        if a == "pipeline":  # pipeline/__init__.py documents only
            out += [f"{src} -> {t} (pipeline/__init__.py imports nothing)" for t in sorted(targets)]
            continue
        for t in sorted(targets):
            b = part(t)
            if a == b:
                continue
            if a in IMPORTS_NOTHING:
                out.append(f"{src} -> {t} ({a} imports nothing else of specq)")
            elif b not in RANKS or a not in RANKS:
                out.append(f"{src} -> {t} (part '{a if a not in RANKS else b}' has no rank in the rule)")
            elif RANKS[b] >= RANKS[a]:
                out.append(f"{src} -> {t} ({a}, rank {RANKS[a]}, may not import {b}, rank {RANKS[b]})")
    return out


def test_the_graph_reads_module_and_name_imports():
    """The reader itself: `from pkg import module` names the module, a name imported from a
    module counts as that module, and Tarjan finds a circle."""
    graph = import_graph()
    assert "pipeline.decode.timing" in graph["pipeline.decode.engine"]  # from pipeline.decode.timing import ...
    assert "pipeline.stats.tango" in graph["pipeline.stats.paired"]  # from pipeline.stats import tango
    # The STAGES table names its entry modules as strings (imported on use, nothing loops); the
    # stage hash test checks those strings resolve.
    assert not any(t.startswith("pipeline.stages.") for t in graph["pipeline.stages.table"])
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": set()}
    assert circles(fake) == [["a", "b", "c"]]


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_follow_the_rule():
    breaks = rule_breaks(import_graph())
    assert not breaks, "imports against the rule (tests/test_imports.py RANKS):\n" + "\n".join(breaks)


def test_every_part_has_a_rank():
    parts = {part(m) for m in project_modules()} - {"pipeline"}
    assert parts <= set(RANKS), f"parts without a rank: {sorted(parts - set(RANKS))}"


def test_the_top_of_pipeline_holds_only_init_and_main():
    top = sorted(p.name for p in (ROOT / "pipeline").glob("*.py"))
    assert top == ["__init__.py", "__main__.py"]


@pytest.mark.parametrize("init", sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES[:1]
                                        for p in (ROOT / pkg).rglob("__init__.py")))
def test_package_inits_only_document(init):
    """`__init__.py` files of pipeline/ hold a docstring and nothing else: no re-exports (so a
    name has one home) and no work done on import."""
    tree = ast.parse((ROOT / init).read_text())
    body = tree.body
    assert body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), \
        f"{init} has no docstring"
    assert len(body) == 1, f"{init} holds code besides its docstring (line {body[1].lineno})"


def test_a_rule_break_is_reported():
    """The checker catches what it should: an upward import, a sibling import, and anything out
    of decode or core."""
    graph = {
        "pipeline.stats.paired": {"pipeline.serving.served_k"},  # upward
        "pipeline.latency.memory": {"pipeline.quality.lm_tasks"},  # same rank
        "pipeline.decode.engine": {"pipeline.core.stage"},  # decode imports nothing
        "pipeline.stages.gate": {"pipeline.gate.decision"},  # fine
    }
    breaks = rule_breaks(graph)
    assert len(breaks) == 3 and not any("stages.gate" in b for b in breaks)


def test_the_readme_architecture_table_is_the_rule():
    """The README's architecture table (part, rank) is the same rule this file enforces, and names
    every part that exists."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Architecture"):]
    section = section[: section.find("\n## ", 5) if "\n## " in section[5:] else len(section)]
    rows = re.findall(r"^\| `([\w/]+)` \| (\d+) \|", section, flags=re.M)
    table = {path.split("/")[-1]: int(rank) for path, rank in rows}
    assert table == RANKS, f"README architecture table {table} differs from RANKS {RANKS}"
    for part_name in IMPORTS_NOTHING:
        assert f"`{part_name}`" in section

"""README.md and docs/ say only what the code has: every `make` target, every sub-command and every
config key the README names exists, every relative link resolves, and the README stays a short guide.

    .venv/bin/python -m pytest -q tests/test_readme.py

Fast: it reads text, the Makefile and the argparse and pydantic objects; it loads no model.
Commands are read from code only (fenced blocks and `inline code`), so prose words are not taken
for commands. The user-facing pages (README, docs/*.md, docs/methods, docs/validation) state facts
without issue numbers; docs/results/ holds dated records.
"""
from __future__ import annotations

import argparse
import re
import shlex
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 330
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
ISSUE = re.compile(r"#\d{2}\b|issue \d+", re.I)
TARGET = re.compile(r"[a-z][a-z0-9_.-]*")
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
COMMAND = re.compile(r"(?:python -m pipeline|(?<![\w.-])specq)[ \t]+(\S+)")


def _readme() -> str:
    return README.read_text()


def _fenced(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def _code_lines(text: str) -> list[str]:
    """Every line of every fenced block, and every inline code span (whitespace folded)."""
    lines = [line for _, body in _fenced(text) for line in body.splitlines()]
    prose = FENCE.sub("", text)
    lines += [" ".join(span.split()) for span in INLINE.findall(prose)]
    return lines


def _make_targets_named(text: str) -> set[str]:
    """The targets of every `make ...` command in the README's code: after `make`, VAR=value and
    flags are skipped and every following word is a target, up to a comment or shell punctuation."""
    named = set()
    for line in _code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an inline span with an unbalanced quote: fall back to plain words
            words = line.split("#")[0].split()
        for i, word in enumerate(words):
            if word != "make":
                continue
            for arg in words[i + 1:]:
                if VARIABLE.fullmatch(arg) or arg.startswith("-"):
                    continue
                if not TARGET.fullmatch(arg):
                    break
                named.add(arg)
    return named


def _makefile_targets() -> set[str]:
    """Rules (`name:` at the start of a line, not `name :=`) and the .PHONY list."""
    text = (ROOT / "Makefile").read_text()
    rules = set(re.findall(r"^([A-Za-z0-9][\w.-]*)[ \t]*:(?!=)", text, flags=re.M))
    phony = set()
    for m in re.finditer(r"^\.PHONY:((?:[^\n]*\\\n)*[^\n]*)", text, flags=re.M):
        phony |= set(m.group(1).replace("\\\n", " ").split())
    return rules | phony


def _subcommands() -> set[str]:
    from pipeline.__main__ import _parser

    parser = _parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subs, "pipeline.__main__._parser() has no sub-commands"
    return {name for action in subs for name in action.choices}


def _commands_named(text: str) -> set[str]:
    """Sub-commands after `python -m pipeline` or `specq` in the README's code (flags skipped)."""
    named = set()
    for line in _code_lines(text):
        for name in COMMAND.findall(line):
            if not name.startswith("-") and TARGET.fullmatch(name):
                named.add(name)
    return named


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds (through Optional / unions), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model = _model_of(arg)
            if model is not None:
                return model
    return None


def _is_mapping(annotation) -> bool:
    """A dict-typed field (through Optional / unions): any key below it is the user's."""
    if annotation is typing.Any or typing.get_origin(annotation) is dict or annotation is dict:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_mapping(arg) for arg in typing.get_args(annotation))
    return False


def _unknown_keys(model: type[BaseModel], data: dict, path: str = "") -> list[str]:
    unknown = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            unknown.append(f"{path}{key} (keys of {model.__name__}: {', '.join(model.model_fields)})")
            continue
        if not isinstance(value, dict) or _is_mapping(field.annotation):
            continue
        section = _model_of(field.annotation)
        if section is None:
            unknown.append(f"{path}{key} is not a section (a mapping was given)")
        else:
            unknown += _unknown_keys(section, value, f"{path}{key}.")
    return unknown


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", text, flags=re.M)}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _user_facing_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "methods").glob("*.md")),
            *sorted((DOCS / "validation").glob("*.md"))]


def test_every_make_target_in_the_readme_is_a_makefile_target():
    named = _make_targets_named(_readme())
    assert {"evaluate", "test", "gate"} <= named, f"the README's commands were not found: {sorted(named)}"
    missing = sorted(named - _makefile_targets())
    assert not missing, f"README.md names make targets the Makefile does not have: {missing}"


def test_every_subcommand_in_the_readme_is_a_pipeline_subcommand():
    named = _commands_named(_readme())
    assert named, "the README names no `python -m pipeline <command>`"
    missing = sorted(named - _subcommands())
    assert not missing, (f"README.md names sub-commands pipeline.__main__._parser() does not have: {missing} "
                         f"(it has {sorted(_subcommands())})")


def test_the_command_readers_find_what_they_should():
    """The parsers above on known text: variables, flags, comments and quotes are not targets."""
    text = ('```sh\nmake evaluate MODEL=x DRAFTS="ngram layerskip:8"   # make nothing\n'
            'make -j2 gate report\n.venv/bin/specq summary --run r\n```\n'
            'Run `make quality-equivalence ITEMS=4`, `python -m pipeline gate-check --run r`, '
            '`python -m pipeline.tools.bench`, `python -m pipeline --help`, `speculation_engine: specq`.')
    assert _make_targets_named(text) == {"evaluate", "gate", "report", "quality-equivalence"}
    assert _commands_named(text) == {"summary", "gate-check"}


def test_every_config_key_in_the_readmes_yaml_blocks_is_in_the_schema():
    from pipeline.core.config import Config

    blocks = [body for info, body in _fenced(_readme()) if info in ("yaml", "yml")]
    assert blocks, "the README has no yaml block"
    for body in blocks:
        data = yaml.safe_load(body)
        assert isinstance(data, dict), f"a yaml block in README.md is not a mapping:\n{body}"
        unknown = _unknown_keys(Config, data)
        assert not unknown, f"README.md's yaml names keys the config schema does not have: {unknown}"


def test_the_schema_walk_rejects_an_unknown_key_and_accepts_user_keys_below_a_dict():
    from pipeline.core.config import Config

    assert _unknown_keys(Config, {"quantize": {"variants": {"anything": {"scheme": "none"}}},
                                  "quality": {"vllm": {"engine_args": {"any_flag": 1}}}}) == []
    assert _unknown_keys(Config, {"quality": {"vlm": {}}})[0].startswith("quality.vlm ")
    assert _unknown_keys(Config, {"seed": {"x": 1}}) == ["seed is not a section (a mapping was given)"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.is_file():
            broken.append(f"{target} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {path.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_readme_is_a_short_guide():
    lines = _readme().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}); move detail to docs/"


def test_the_sections_code_refers_to_are_there():
    """pipeline/core/device.py's error and tests/test_imports.py name these README headings."""
    headings = set(re.findall(r"^#{1,6} (.+)$", FENCE.sub("", _readme()), flags=re.M))
    assert any("Any Hugging Face model on a GPU box" in h for h in headings)
    assert "Architecture" in headings


@pytest.mark.parametrize("page", _user_facing_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_pages_cite_no_issue_numbers(page):
    hits = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not hits, f"{page.relative_to(ROOT)} cites issue numbers (state the fact instead): {hits}"

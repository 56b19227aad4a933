"""Every config key with its type, its default and what it means, read from the schema itself.

    specq config --explain                  # the reference, as Markdown (docs/config.md is this output)
    for k in keys(): k.path, k.type, k.default, k.meaning

A key's meaning is the comment above its field in the schema, or at the end of its line; a section's
is its class docstring. The schema is the one place a key is described, and this page follows it.
"""
from __future__ import annotations

import ast
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Key:
    path: str
    type: str
    default: str
    meaning: str
    section: bool = False


@lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """field name -> the comment above it (contiguous comment lines) and at the end of its line."""
    src = textwrap.dedent(inspect.getsource(cls))
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, i = [], node.lineno - 1
        while i >= 1 and lines[i - 1].strip().startswith("#"):
            above.insert(0, by_line.get(i, ""))
            i -= 1
        inline = [by_line[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                  if n in by_line and not lines[n - 1].strip().startswith("#")]
        out[node.target.id] = " ".join(x for x in above + inline if x)
    return out


def _type_name(ann) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    if origin in (list, dict, tuple):
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    name = getattr(ann, "__name__", None) or str(ann)
    return {"PositiveInt": "int > 0", "PositiveFloat": "float > 0"}.get(name, name)


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, dict):
        value = {k: (v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v)
                 for k, v in value.items()}
    return json.dumps(value, separators=(", ", ": "))


def _model_in(ann) -> tuple[type | None, bool]:
    """(the section model a field holds, whether it is a dict of them)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, False
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], True
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a, False
    return None, False


def _doc(model: type) -> str:
    doc = inspect.getdoc(model) or ""
    if doc.startswith(model.__name__ + "(") or model.__doc__ is None:  # pydantic's generated docstring
        return ""
    first = " ".join(doc.split("\n\n")[0].split())
    head, dot, _ = first.partition(". ")  # a section's row: its docstring's first sentence
    return head + "." if dot else first


def keys(model: type | None = None, prefix: str = "") -> list[Key]:
    """Every key of the schema under `model` (default: the whole Config), depth first."""
    if model is None:
        from pipeline.core.config import Config

        model = Config
    comments: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if issubclass(klass, BaseModel) and klass is not BaseModel:
            comments.update({k: v for k, v in _comments(klass).items() if v})
    out = []
    for name, field in model.model_fields.items():
        path = prefix + name
        sub, many = _model_in(field.annotation)
        meaning = comments.get(name, "") or (_doc(sub) if sub is not None else "")
        if sub is not None and many:
            out.append(Key(path, f"dict[str, {sub.__name__}]", _default(field), meaning, section=True))
            out += keys(sub, f"{path}.<name>.")
        elif sub is not None and _type_name(field.annotation) == "section":
            out.append(Key(path, "section", "", meaning, section=True))
            out += keys(sub, f"{path}.")
        else:
            out.append(Key(path, _type_name(field.annotation), _default(field), meaning))
    return out


def render() -> str:
    """The reference as Markdown: a table per top-level section, then the keys no longer read."""
    from pipeline.core.config import DEPRECATED

    head = ["# Config reference", "",
            "Every key of the config schema, its type, its default and what it means. Generated from the "
            "schema (`pipeline/core/config.py`, `quality_config.py`) by `specq config --explain`; "
            "a config file sets any of them, and an unknown key is an error naming it (a key no longer read, "
            "listed last, loads with a one-line warning and is ignored).", ""]
    out, section = list(head), None
    for k in keys():
        top = k.path.split(".")[0]
        if top != section:
            section = top
            title = top if "." in k.path or k.section else "top level"
            if title == "top level" and any(line == "## top level" for line in out):
                title = None
            if title:
                out += ["", f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        default = f"`{cell(k.default)}`" if k.default else ""
        out.append(f"| `{k.path}` | {cell(k.type)} | {default} | {cell(k.meaning)} |")
    out += ["", "## keys no longer read", "", "| key | why |", "|---|---|"]
    out += [f"| `{key}` | {why} |" for key, why in DEPRECATED.items()]
    return "\n".join(out) + "\n"

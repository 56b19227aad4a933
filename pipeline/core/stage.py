"""Stage plumbing: atomic writes, meta.json, and input hashing.

A stage is a function `run(ctx)` that writes under `ctx.out_dir`. The runner hashes what it reads
(config sections, upstream input hashes, its source files, arguments such as MODEL); when the hash
equals its `meta.json`'s the stage is a no-op, else `meta.json` is removed, the stage runs, and
`meta.json` is written last. Independent outputs are *items*: `ctx.item(name, inputs)` is fresh when
its own hash matches, else written into `name.tmp` and renamed, so a re-run resumes. Records carry
`schema` (SCHEMA_VERSION): another version is never fresh, and readers refuse it (require_schema).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[2]  # pipeline/core/stage.py -> the repository root
# The artifacts' layout version; raise it when older artifacts become unreadable (they then re-run).
SCHEMA_VERSION = 1
LIBRARIES = (
    "torch", "transformers", "accelerate", "gptqmodel", "bitsandbytes", "torchao", "lm_eval",
    "datasets", "gguf", "scipy", "numpy", "statsmodels",
)


class StageError(Exception):
    """A failure the user can act on; the message is one line."""


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `path.tmp`, then rename it over `path`: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield `path.tmp`; on success replace `path` by it, on error remove it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def read_json(path: str | Path, what: str = "artifact", made_by_specq: bool = True) -> Any:
    """Read a JSON file; a missing or corrupt one is a StageError naming the file (with what to do
    for specq's own artifacts)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        hint = " (run the stage that makes it first)" if made_by_specq else ""
        raise StageError(f"missing {what}: {path}{hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        hint = " (delete it and re-run)" if made_by_specq else ""
        raise StageError(f"corrupt {what}: {path} is not valid JSON{hint}") from None


def read_jsonl(path: str | Path, what: str = "artifact",
               validate: Callable[[Any], Any] | None = None) -> list:
    """Read a JSON-lines artifact (blank lines skipped); a missing or corrupt one is a StageError
    naming the file and line. `validate(row)` returns the row to keep or raises ValueError."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise StageError(f"missing {what}: {path} (run the stage that makes it first)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StageError(f"cannot read {what}: {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for no, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise StageError(f"corrupt {what}: {path}:{no} is not valid JSON (delete it and re-run)") from None
            if validate is not None:
                try:
                    row = validate(row)
                except ValueError as e:
                    raise StageError(f"corrupt {what}: {path}:{no} {e} (delete it and re-run)") from None
            rows.append(row)
    return rows


def hash_obj(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# Top-level packages of this repository: imports of these are followed when hashing a stage's code.
PROJECT_PACKAGES = ("pipeline", "evals", "draft_models")


def _module_file(dotted: str) -> Path | None:
    """pipeline.decode.engine -> pipeline/decode/engine.py; a package -> its __init__.py; None if not ours."""
    if dotted.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = REPO.joinpath(*dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def import_closure(entry_modules: list[str]) -> list[Path]:
    """The project's source files that `entry_modules` import, directly or not, including imports
    inside functions (read with ast): what a stage's code hash covers."""
    import ast

    seen: dict[Path, None] = {}
    todo = list(entry_modules)
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen[path] = None
        pkg_parts = list(path.relative_to(REPO).with_suffix("").parts)[:-1]
        todo += [".".join(pkg_parts[:i]) for i in range(1, len(pkg_parts) + 1)]  # their __init__s run too
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                todo.append(mod)
                todo.extend(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return sorted(seen)


def code_files(modules: list[str]) -> set[Path]:
    """The source and data files a stage runs: globs relative to the repository root, or
    `import:<dotted module>` (its import_closure). An entry that matches no file is an error."""
    files: set[Path] = set()
    for rel in modules:
        if rel.startswith("import:"):
            module = rel.removeprefix("import:")
            if _module_file(module) is None:
                raise StageError(f"stage code entry {rel!r}: no module {module} in {REPO}")
            files.update(import_closure([module]))
        else:
            matched = [p for p in REPO.glob(rel) if p.is_file()]
            if not matched:
                raise StageError(f"stage code entry {rel!r} matches no file under {REPO}")
            files.update(matched)
    return files


def code_hash(modules: list[str]) -> str:
    """Hash of code_files(modules): their paths and bytes."""
    h = hashlib.sha256()
    for p in sorted(code_files(modules)):
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


# What every stage runs besides its own code: the runner and the config schema.
RUNNER_CODE = ["import:pipeline.core.stage", "import:pipeline.core.config"]


def library_version(dist: str) -> str | None:
    """The installed version of a distribution (pip name), or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """Python and every library in LIBRARIES (import names; lm_eval's distribution is lm-eval)."""
    return {"python": platform.python_version(),
            **{name: library_version({"lm_eval": "lm-eval"}.get(name, name)) for name in LIBRARIES}}


def dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def progress(msg: str) -> None:
    """One progress line on stderr, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def other_schema(meta: Any) -> str | None:
    """None when `meta` carries SCHEMA_VERSION, else "schema <its>, this is <ours>"."""
    got = meta.get("schema") if isinstance(meta, dict) else None
    if got == SCHEMA_VERSION:
        return None
    return f"schema {'none' if got is None else got}, this is {SCHEMA_VERSION}"


def require_schema(meta_path: str | Path) -> None:
    """For readers outside the runner: a StageError when the stage's meta.json (where there is one)
    was written by another specq version."""
    meta_path = Path(meta_path)
    if not meta_path.is_file():
        return
    meta = read_json(meta_path, "stage meta.json")
    why = other_schema(meta)
    if why:
        stage = (meta.get("stage") if isinstance(meta, dict) else None) or meta_path.parent.name
        raise StageError(f"{stage}: artifacts from another specq version ({why}) in {meta_path.parent}: "
                         f"re-run make {stage}")


@dataclass
class Item:
    """One independently finished piece of a stage's output: a directory with its own meta.json,
    or a JSON file with its own `input_hash`."""

    path: Path
    input_hash: str
    is_dir: bool
    fresh: bool = False
    meta: dict = field(default_factory=dict)

    def record(self, obj: dict) -> dict:
        """`obj` with what makes it this item's record: the schema version and the input hash."""
        return {**obj, "schema": SCHEMA_VERSION, "input_hash": self.input_hash}

    @contextlib.contextmanager
    def writing(self) -> Iterator[Path]:
        """Directory items: a temporary directory that replaces `path`, with `self.meta` as meta.json."""
        assert self.is_dir
        with atomic_dir(self.path) as tmp:
            yield tmp
            atomic_write_json(tmp / "meta.json", self.record(self.meta))

    def write_json(self, obj: dict) -> None:
        """JSON-file items: write `obj` atomically."""
        assert not self.is_dir
        atomic_write_json(self.path, self.record(obj))


@dataclass
class StageContext:
    name: str
    run_dir: Path
    out_dir: Path
    config: Any  # pipeline.core.config.Config
    args: dict
    input_hash: str
    upstream: dict[str, dict]  # stage name -> its meta.json
    code: str = ""  # hash of the stage's source files
    meta: dict = field(default_factory=dict)  # extra keys the stage adds to its meta.json

    def item(self, name: str, inputs: Any, is_dir: bool = True) -> Item:
        """An item at out_dir/name, fresh when `inputs`, the stage's code and the schema are unchanged."""
        path = self.out_dir / name
        item = Item(path=path, input_hash=hash_obj({"inputs": inputs, "code": self.code}), is_dir=is_dir)
        old = old_meta(path / "meta.json" if is_dir else path)
        if old.get("input_hash") == item.input_hash and other_schema(old) is None:
            item.fresh, item.meta = True, old
        return item


def old_meta(path: Path) -> dict:
    """A meta.json or item record; {} when missing or unreadable (the work is then done again)."""
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return {}
    return old if isinstance(old, dict) else {}


@dataclass
class StageSpec:
    name: str
    sections: list[str]  # config sections (or top-level keys) the stage reads
    upstream: list[str]  # stages whose outputs it reads
    out: str  # output directory, relative to the run dir
    code: list[str]  # source globs, relative to the repo root
    entry: str  # "module:function"
    # Optional "module:function(config, args)" that validates input before anything is created.
    precheck: str | None = None
    # Stages whose output is read (and hashed) when it exists, but which need not have run (vllm).
    after: list[str] = field(default_factory=list)


def _function(ref: str) -> Callable:
    """"module:function" -> the function."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def run_stage(spec: StageSpec, run_dir: Path, config: Any, args: dict, specs: dict[str, StageSpec],
              force: bool = False) -> Path:
    """Run one stage if its inputs changed. Returns the stage's meta.json path."""
    upstream = {}
    for up in spec.upstream + spec.after:
        meta_path = run_dir / specs[up].out / "meta.json"
        if not meta_path.exists() and up in spec.upstream:
            raise StageError(f"{spec.name}: stage '{up}' has not run for {run_dir} (make {up} first)")
        upstream[up] = read_json(meta_path, f"{up} meta.json") if meta_path.exists() else {}
    code = code_hash(spec.code + RUNNER_CODE)
    inputs = {
        "stage": spec.name,
        "config": {s: config.section(s) for s in spec.sections},
        "upstream": {k: v.get("input_hash") for k, v in upstream.items()},
        "args": args,
        "code": code,
    }
    input_hash = hash_obj(inputs)
    out_dir = run_dir / spec.out
    meta_path = out_dir / "meta.json"
    old = {} if force else old_meta(meta_path)
    if old:
        why = other_schema(old)
        if why:
            print(f"{spec.name}: artifacts from another specq version ({why}): re-running", file=sys.stderr)
        elif old.get("input_hash") == input_hash:
            os.utime(meta_path)  # Make compares mtimes; the artifact is current
            print(f"{spec.name}: up to date ({out_dir})", file=sys.stderr)
            return meta_path

    if spec.precheck:
        _function(spec.precheck)(config, args)
    created_run = not run_dir.exists()
    created_out = not out_dir.exists()
    meta_path.unlink(missing_ok=True)
    ctx = StageContext(name=spec.name, run_dir=run_dir, out_dir=out_dir, config=config, args=args,
                       input_hash=input_hash, upstream=upstream, code=code)
    fn = _function(spec.entry)
    progress(f"{spec.name}: running -> {out_dir}")
    start = time.time()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fn(ctx)
    except BaseException:
        # Leave nothing that looks like output: an empty directory we made goes again.
        for d, made in ((out_dir, created_out), (run_dir, created_run)):
            if made and d.exists() and not any(d.iterdir()):
                d.rmdir()
        raise
    meta = {
        "stage": spec.name,
        "schema": SCHEMA_VERSION,
        "input_hash": input_hash,
        "inputs": {k: v for k, v in inputs.items() if k != "config"},
        "config": config.model_dump(mode="json"),
        "libraries": library_versions(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
        "wall_s": round(time.time() - start, 3),
        **ctx.meta,
    }
    atomic_write_json(meta_path, meta)
    progress(f"{spec.name}: done in {meta['wall_s']:.1f} s")
    return meta_path

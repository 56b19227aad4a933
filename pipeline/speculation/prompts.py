"""The built-in prompt set for acceptance measurement, grouped by kind: the categories of the
`builtin` workload (pipeline/speculation/workload.py), which are the acceptance slices.

    from pipeline.speculation.prompts import KINDS, PROMPTS, prompt_ids

The texts live in evals/data/speculation_prompts.json, one {"id", "kind", "text"} object a line
(docs/methods/workloads.md). An id is f"{kind}-{i}" by position and artifacts name them: existing
kinds and prompts must not change or reorder; new ones go at the end.
"""
from __future__ import annotations

import json

from pipeline.core.stage import REPO

PROMPTS_FILE = REPO / "evals" / "data" / "speculation_prompts.json"


def _load(path=PROMPTS_FILE) -> dict[str, list[str]]:
    """kind -> its texts, in file order; an id that is not f"{kind}-{position}" is refused."""
    prompts: dict[str, list[str]] = {}
    for obj in json.loads(path.read_text(encoding="utf-8")):
        texts = prompts.setdefault(obj["kind"], [])
        if obj["id"] != f"{obj['kind']}-{len(texts)}":
            raise ValueError(f"{path}: id {obj['id']!r} is not {obj['kind']}-{len(texts)}, its position")
        texts.append(obj["text"])
    return prompts


PROMPTS: dict[str, list[str]] = _load()
KINDS = tuple(PROMPTS)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn, through the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(text)

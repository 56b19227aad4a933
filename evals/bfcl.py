"""The `bfcl` slice: Berkeley Function Calling Leaderboard (v4) non-live single-turn Python calls.

    python -m evals.bfcl    # per category: items, clusters, and the prompt of the first item

Categories (each is a `group` of the slice, with its own CI): simple_python, multiple, parallel,
parallel_multiple, irrelevance. The questions, function docs and possible answers are read from
the installed `bfcl-eval` package's data files (bfcl_eval/data/BFCL_v4_<category>.json and
possible_answer/), located with importlib.util.find_spec. The package's dependency tree is large
(API clients, tree-sitter, an older numpy), so it is installed with --no-deps and only its
prompt-text module bfcl_eval.constants.default_prompts (no dependencies) is imported.

Prompting is BFCL's for models without native function calling, in its default format
(`ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic`): a
system prompt built from BFCL's own text that lists the function docs as JSON, each description
given BFCL's Python hint, then the question as the user turn, rendered with the model's chat
template and a generation prompt (BFCL's OSS handler does the same). The expected output is
`[func(arg=val), ...]`; evals.bfcl_checker decodes and scores it.

Clusters: items that share a function doc or a question are not independent, so a cluster is a
connected component of the graph linking items through identical function docs or questions
(over all five categories, so it does not depend on how many items a run takes).
Items: each category in its own seeded order, taken round-robin, so the first n of a CPU-sized
run cover every category evenly and any larger n extends it.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Callable

import numpy as np

PACKAGE = "bfcl_eval"
PIP_NAME = "bfcl-eval==2026.3.23"
SLICE = "bfcl"
CATEGORIES = ["simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance"]
# BFCL's default prompt variation (bfcl_eval.constants.default_prompts.DEFAULT_SYSTEM_PROMPT_FORMAT).
PROMPT_FORMAT = {"return_format": "python", "function_doc_format": "json", "prompt_format": "plaintext",
                 "style": "classic"}
# What BFCL appends to each function description for Python categories (bfcl_eval/utils.py).
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


class MissingPackage(RuntimeError):
    """The package that ships the data is not installed; the message says how to install it."""


def data_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" if spec else None
    if path is None or not (path / f"BFCL_v4_{CATEGORIES[0]}.json").is_file():
        raise MissingPackage(f"the bfcl slice needs BFCL's data from the '{PIP_NAME}' package: "
                             f".venv/bin/python -m pip install --no-deps {PIP_NAME} (make install does)")
    return path


def _read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_category(category: str) -> list[dict]:
    """BFCL's entries of one category, each with its possible answer (None for irrelevance)."""
    d = data_dir()
    entries = _read_lines(d / f"BFCL_v4_{category}.json")
    answer_path = d / "possible_answer" / f"BFCL_v4_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _read_lines(answer_path)} if answer_path.is_file() else {}
    for e in entries:
        if len(e["question"]) != 1:
            raise ValueError(f"{e['id']}: {len(e['question'])} turns; the bfcl slice is single-turn")
        e["category"] = category
        e["possible_answer"] = answers.get(e["id"])
        if category != "irrelevance" and e["possible_answer"] is None:
            raise ValueError(f"{e['id']}: no possible answer in {answer_path}")
    return entries


def clusters(entries: list[dict]) -> dict[str, str]:
    """Entry id -> cluster id: connected components of entries linked by an identical function
    doc or an identical question (scipy.sparse.csgraph); a cluster is named by its first id."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    keys: dict[tuple[str, str], int] = {}
    rows, cols = [], []
    for i, e in enumerate(entries):
        links = [("doc", json.dumps(f, sort_keys=True)) for f in e["function"]]
        links += [("question", json.dumps(e["question"], sort_keys=True))]
        for key in links:
            rows.append(i)
            cols.append(len(entries) + keys.setdefault(key, len(keys)))
    size = len(entries) + len(keys)
    graph = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(size, size))
    _, label = connected_components(graph, directed=False)
    first: dict[int, str] = {}
    for i, e in enumerate(entries):
        first.setdefault(int(label[i]), e["id"])
    return {e["id"]: f"{SLICE}:{first[int(label[i])]}" for i, e in enumerate(entries)}


def select(n: int | None, seed: int = 0) -> list[dict]:
    """The first `n` entries (all when None): categories in seeded orders, taken round-robin."""
    per_category = []
    for category in CATEGORIES:
        entries = load_category(category)
        random.Random(f"{SLICE}:{category}:{seed}").shuffle(entries)
        per_category.append(entries)
    order = []
    for rank in range(max(map(len, per_category))):
        order += [entries[rank] for entries in per_category if rank < len(entries)]
    return order[:n]


def _prompt_text() -> dict:
    from bfcl_eval.constants import default_prompts as bp  # plain strings, no dependencies

    return {"templates": bp.PROMPT_STYLE_TEMPLATES[PROMPT_FORMAT["style"]],
            "layout": bp.PROMPT_TEMPLATE_MAPPING[PROMPT_FORMAT["prompt_format"]],
            "output_format": bp.OUTPUT_FORMAT_MAPPING[PROMPT_FORMAT["return_format"]],
            "param_types": bp.PARAM_TYPE_MAPPING[PROMPT_FORMAT["return_format"]]}


def with_python_hint(functions: list[dict]) -> list[dict]:
    out = copy.deepcopy(functions)
    for f in out:
        f["description"] = f["description"] + PYTHON_HINT
    return out


def system_prompt(functions: list[dict]) -> str:
    """BFCL's system prompt in its default format, assembled from its own text the way
    bfcl_eval.model_handler.utils.formulate_system_prompt does (that module cannot be imported
    without the package's dependencies)."""
    t = _prompt_text()
    style = t["templates"]
    return t["layout"].format(
        persona=style["persona"], task=style["task"],
        tool_call_format=style["tool_call_no_tag"].format(output_format=t["output_format"],
                                                          param_types=t["param_types"]),
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=style["available_tools"].format(
            format=PROMPT_FORMAT["function_doc_format"], functions=json.dumps(functions, indent=4)))


def messages(entry: dict) -> list[dict]:
    """The conversation BFCL sends: its system prompt first (merged into the question's own
    system turn if there is one), then the question's turns."""
    turns = copy.deepcopy(entry["question"][0])
    system = system_prompt(with_python_hint(entry["function"]))
    if turns and turns[0]["role"] == "system":
        turns[0]["content"] = system + "\n\n" + turns[0]["content"]
        return turns
    return [{"role": "system", "content": system}, *turns]


def plain_render(msgs: list[dict]) -> str:
    """For a tokenizer without a chat template: the turns as labelled paragraphs."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"


def chat_renderer(tokenizer) -> tuple[Callable[[list[dict]], str], str]:
    """The model's chat template with a generation prompt, or plain_render when it has none."""
    if getattr(tokenizer, "chat_template", None):
        return (lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                "chat_template")
    return plain_render, "plain"


def items(n: int | None, seed: int = 0, render: Callable[[list[dict]], str] = plain_render,
          prompt_format: str = "plain") -> list[dict]:
    """The slice's items. `functions` and `possible_answer` are JSON strings: lm-eval loads the
    items through `datasets` (Arrow), which would unify every row's nested dicts into one schema."""
    from evals.bfcl_checker import canonical_call

    chosen = select(n, seed)
    cluster_of = clusters([e for c in CATEGORIES for e in load_category(c)])
    out = []
    for e in chosen:
        answer = e["possible_answer"]
        out.append({"id": e["id"], "slice": SLICE, "cluster": cluster_of[e["id"]], "group": e["category"],
                    "prompt": render(messages(e)), "prompt_format": prompt_format,
                    "target": canonical_call(answer) if answer is not None else "(no function call)",
                    "answer_type": "bfcl_ast", "functions": json.dumps(e["function"]),
                    "possible_answer": json.dumps(answer) if answer is not None else None})
    return out


def to_jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def main() -> int:
    everything = [e for c in CATEGORIES for e in load_category(c)]
    cluster_of = clusters(everything)
    for c in CATEGORIES:
        ids = [e["id"] for e in everything if e["category"] == c]
        print(f"{c}: {len(ids)} items, {len({cluster_of[i] for i in ids})} clusters")
    print(f"all: {len(everything)} items, {len(set(cluster_of.values()))} clusters\n")
    print(plain_render(messages(select(1)[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

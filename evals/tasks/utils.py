"""Result functions lm-eval calls for specq's built-in slices (referenced as `!function utils.X`
from the task YAMLs beside this file); the scoring itself lives in evals/metrics.py,
evals/bfcl_checker.py and evals/humaneval.py."""
from evals import humaneval
from evals.bfcl_checker import score_item as score_bfcl
from evals.metrics import score_answer, score_tool_call
from evals.sandbox import Limits


def process_exact(doc: dict, results: list[str]) -> dict:
    return {"exact_match": score_answer(doc, results[0])["exact_match"]}


def process_tool_call(doc: dict, results: list[str]) -> dict:
    return score_tool_call(doc, results[0])


def process_bfcl(doc: dict, results: list[str]) -> dict:
    s = score_bfcl(doc, results[0])
    return {"accuracy": s["accuracy"], "decoded": s["decoded"]}


def run_code_tests(resps: list[list[str]], docs: list[dict], limits: Limits = Limits(),
                   workers: int | None = None) -> list[dict]:
    """lm-eval filter: every document's first completion run against its tests in the sandbox
    (all documents at once, `workers` processes at a time); the outcome replaces the response."""
    completions = [r[0] for r in resps]
    outcomes = humaneval.score(list(docs), completions, limits, workers)
    return [{**o, "completion": c} for o, c in zip(outcomes, completions)]


def process_code(doc: dict, results: list) -> dict:
    return {"pass@1": results[0]["pass@1"]}

"""Result functions lm-eval calls for specq's built-in slices (referenced as `!function utils.X`
from the task YAMLs beside this file); the scoring itself lives in evals/metrics.py."""
from evals.metrics import score_answer, score_tool_call


def process_exact(doc: dict, results: list[str]) -> dict:
    return {"exact_match": score_answer(doc, results[0])["exact_match"]}


def process_tool_call(doc: dict, results: list[str]) -> dict:
    return score_tool_call(doc, results[0])

"""Item scores for the built-in slices (calibration summaries, ECE and Brier: pipeline/stats/scoring_rules.py).

Every score is a float in [0, 1], higher is better. Answers are extracted from the first non-empty
line of the prediction: an instruct model often restates the question ("2 + 3 = 5"), so a number
answer is the LAST integer on that line and a name answer is the first candidate name it mentions.
"""
from __future__ import annotations

import json
import re

import numpy as np

_INT = re.compile(r"-?\d+")


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def extract_number(text: str) -> str | None:
    found = _INT.findall(first_line(text).replace(",", ""))
    return str(int(found[-1])) if found else None


def extract_name(text: str, candidates: list[str]) -> str | None:
    line = first_line(text)
    hits = [(m.start(), c) for c in candidates for m in re.finditer(rf"\b{re.escape(c)}\b", line)]
    return min(hits)[1] if hits else None


def score_answer(doc: dict, prediction: str) -> dict:
    """Exact match after extraction; `extracted` is what was compared (null if nothing was found)."""
    if doc["answer_type"] == "name":
        got = extract_name(prediction, doc.get("candidates") or [])
    else:
        got = extract_number(prediction)
    return {"exact_match": float(got is not None and got == doc["target"]), "extracted": got}


# ------------------------------------------------------------------ tool calls


def parse_json_object(text: str):
    """The first balanced {...} in `text`, parsed; None if there is none or it is not JSON."""
    start = text.find("{")
    if start < 0:
        return None
    depth, in_str, esc = 0, False, False
    for k in range(start, len(text)):
        ch = text[k]
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                try:
                    return json.loads(text[start : k + 1])
                except json.JSONDecodeError:
                    return None
    return None


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool}


def conforms(call, tool: dict) -> bool:
    """`call` is {"name": tool name, "arguments": {...}} with every required argument, no unknown
    argument, each of the declared type and inside its enum."""
    if not isinstance(call, dict) or call.get("name") != tool["name"]:
        return False
    args = call.get("arguments")
    if not isinstance(args, dict) or set(call) - {"name", "arguments"}:
        return False
    params = tool["parameters"]
    if set(args) - set(params) or set(tool.get("required", [])) - set(args):
        return False
    for key, value in args.items():
        spec = params[key]
        want = _TYPES.get(spec.get("type"), object)
        if not isinstance(value, want) or (isinstance(value, bool) and spec.get("type") != "boolean"):
            return False
        if "enum" in spec and value not in spec["enum"]:
            return False
    return True


def score_tool_call(doc: dict, prediction: str) -> dict:
    """Three scores, each 0/1: the output holds a JSON object; it conforms to the schema; the name
    and every argument value equal the expected ones exactly (the primary score)."""
    call = parse_json_object(prediction)
    valid = call is not None
    ok = valid and conforms(call, doc["tool"])
    exact = valid and call.get("name") == doc["expected"]["name"] and \
        call.get("arguments") == doc["expected"]["arguments"]
    return {"args_exact": float(exact), "schema_ok": float(ok), "valid_json": float(valid)}


# ------------------------------------------------------------------ multiple choice / calibration


def option_probs(loglikelihoods: list[float]) -> list[float]:
    """Softmax over the options' log-likelihoods: the model's probability of each option given
    that the answer is one of them."""
    ll = np.asarray(loglikelihoods, dtype=np.float64)
    p = np.exp(ll - ll.max())
    return (p / p.sum()).tolist()

"""Decode and score a model's BFCL answer: BFCL's AST rules for Python, written out here.

bfcl-eval's own checker (bfcl_eval/eval_checker/ast_eval/ast_checker.py) imports the package's
model registry, which needs every API client it supports (anthropic, openai, ...), so it does not
import with the --no-deps install. This module follows its rules for the Python categories, and
tests/test_bfcl.py checks it against that checker loaded with a stub registry, on the possible
answers themselves and on perturbations of them. The rules:
  * decoding (BFCL's default_decode_ast_prompting): strip backticks, newlines and spaces at the
    ends, wrap in [ ] if missing, parse as a Python expression: a call or a list of calls, keyword
    arguments only, values literal (names become strings, calls without keywords their source).
    Unlike BFCL, nothing is eval()'d: arithmetic on number or string literals is computed here,
    anything else does not decode (BFCL would run it in its own process);
  * simple_python: exactly one call; multiple: exactly one call, checked against the expected
    function; parallel and parallel_multiple: as many calls as expected, matched in any order;
  * a call: the expected function name; every required parameter present; no parameter the doc
    or the answer does not know; each value of the doc's type (an int passes for a float, a tuple
    for a tuple-typed list; a value of the answer's type when that differs from the doc's counts
    as a variable) and among the possible values; strings compared after removing spaces and
    ,./-_*^, case-folded, ' read as "; lists element-wise the same way; dicts key by key; a
    parameter the answer lists is omitted only if "" is among its possible values;
  * irrelevance: correct when the output does not decode into at least one call.
"""
from __future__ import annotations

import ast
import json
import operator
import re

PY_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
            "tuple": list, "dict": dict, "any": str}
NESTED = ("array", "tuple")


class DecodeError(ValueError):
    pass


# ------------------------------------------------------------------ decoding


def decode(text: str) -> list[dict]:
    """`[f(a=1), g.h(b='x')]` -> [{"f": {"a": 1}}, {"g.h": {"b": "x"}}]; DecodeError if it is
    not a call or a list of calls with literal keyword arguments."""
    s = text.strip("`\n ")
    if not s.startswith("["):
        s = "[" + s
    if not s.endswith("]"):
        s = s + "]"
    try:
        body = ast.parse(s.strip().strip("'"), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise DecodeError(f"not a Python expression: {type(e).__name__}") from None
    if isinstance(body, ast.Call):
        return [_call(body)]
    if not isinstance(body, (ast.List, ast.Tuple, ast.Set)):
        raise DecodeError(f"not a list of calls ({type(body).__name__})")
    out = []
    for elt in body.elts:
        if not isinstance(elt, ast.Call):
            raise DecodeError(f"a list element is not a call ({type(elt).__name__})")
        out.append(_call(elt))
    return out


def _call(node: ast.Call) -> dict:
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return {".".join(reversed(parts)): {kw.arg: _value(kw.value) for kw in node.keywords}}


def _value(node):
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, (ast.UnaryOp, ast.BinOp)):
        return _arithmetic(node)
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise DecodeError("** in a dict literal")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _call(node) if node.keywords else ast.unparse(node)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node)
    raise DecodeError(f"unsupported value ({type(node).__name__})")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arithmetic(node):
    """+ - * / // % ** on number literals (and + on strings), computed without eval; bounded so
    a crafted answer cannot make the scorer build a huge number or string."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arithmetic(node.operand)
        if type(v) not in (int, float):
            raise DecodeError("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _arithmetic(node.left), _arithmetic(node.right)
        numbers = type(a) in (int, float) and type(b) in (int, float)
        if not numbers and not (isinstance(node.op, ast.Add) and type(a) is str and type(b) is str):
            raise DecodeError("arithmetic on non-numbers")
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
            raise DecodeError("power too large to compute")
        if numbers and max(abs(a), abs(b)) > 1e300:
            raise DecodeError("number too large")
        try:
            return _OPS[type(node.op)](a, b)
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            raise DecodeError(f"arithmetic fails: {type(e).__name__}") from None
    raise DecodeError(f"unsupported expression ({type(node).__name__})")


def is_call_list(decoded) -> bool:
    """[{name: {param: value, ...}}, ...] (an empty list included)."""
    return isinstance(decoded, list) and all(
        isinstance(d, dict) and len(d) == 1 and isinstance(next(iter(d.values())), dict) for d in decoded)


def is_empty(decoded) -> bool:
    return not is_call_list(decoded) or len(decoded) == 0 or (len(decoded) == 1 and len(decoded[0]) == 0)


# ------------------------------------------------------------------ value checks


def standardize(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _answer_type(options: list):
    for o in options:
        if o != "":
            return type(o)
    return None


def type_ok(value, options: list, type_name: str, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(valid, is_variable). A value of the answer's own type, when that differs from the doc's,
    is a variable the answer names (e.g. a string where the doc says integer)."""
    answer_type = _answer_type(options)
    is_variable = answer_type is not None and answer_type != expected
    if type(value) == expected:
        if nested is None:
            return True, is_variable
        for option in options:
            if type(option) != list or all(type_ok(v, option, str(nested), nested, None)[0] for v in value):
                return True, is_variable
        return False, is_variable
    if answer_type is not None and type(value) == answer_type:
        return True, True
    return False, is_variable


def _std_options(options: list) -> list:
    return [standardize(o) if type(o) == str else o for o in options]


def string_ok(value: str, options: list) -> bool:
    return standardize(value) in [standardize(o) for o in options if type(o) == str]


def list_ok(value: list, options: list) -> bool:
    got = [standardize(v) if type(v) == str else v for v in value]
    want = [_std_options(list(o)) for o in options if isinstance(o, (list, tuple, str))]
    return got in want


def dict_ok(value: dict, options: list) -> bool:
    for option in options:
        if option == "" or not isinstance(option, dict):
            continue
        good = all(k in option and (standardize(v) if type(v) == str else v) in _std_options(option[k])
                   for k, v in value.items())
        if good and all(k in value or "" in opts for k, opts in option.items()):
            return True
    return False


def list_of_dicts_ok(value: list, options: list) -> bool:
    for option in options:
        if isinstance(option, (list, str)) and len(value) == len(option) and \
                all(isinstance(v, dict) and dict_ok(v, [o]) for v, o in zip(value, option)):
            return True
    return False


# ------------------------------------------------------------------ one call, and the categories


def check_call(doc: dict, call: dict, answer: dict) -> str | None:
    """None if `call` ({name: params}) matches `answer` ({name: {param: options}}) under the
    function `doc`; else the kind of error (BFCL's error_type)."""
    options_by_param = next(iter(answer.values()))
    name, props = doc["name"], doc["parameters"]["properties"]
    if name not in call:
        return "wrong_func_name"
    params = call[name]
    if any(p not in params for p in doc["parameters"].get("required", [])):
        return "missing_required"
    for param, value in params.items():
        if param not in props or param not in options_by_param:
            return "unexpected_param"
        options = options_by_param[param]
        type_name = props[param]["type"]
        expected = PY_TYPES[type_name]
        nested = PY_TYPES[props[param]["items"]["type"]] if type_name in NESTED else None
        if type_name == "tuple" and type(value) == tuple:
            value = list(value)
        if type_name == "float" and type(value) == int:
            value = float(value)
        valid, is_variable = type_ok(value, options, type_name, expected, nested)
        if not valid:
            return "type_error"
        if not is_variable:
            if expected == dict:
                if not dict_ok(value, options):
                    return "value_error:dict"
                continue
            if expected == list and nested == dict:
                if not list_of_dicts_ok(value, options):
                    return "value_error:list_dict"
                continue
            if expected == str:
                if not string_ok(value, options):
                    return "value_error:string"
                continue
            if expected == list:
                if not list_ok(value, options):
                    return "value_error:list"
                continue
        if value not in options:
            return "value_error:others"
    if any(p not in params and "" not in opts for p, opts in options_by_param.items()):
        return "missing_optional"
    return None


def _doc(functions: list[dict], name: str) -> dict:
    return next(f for f in functions if f["name"] == name)


def check(functions: list[dict], calls: list[dict], answers: list[dict], category: str) -> str | None:
    """None if the decoded `calls` answer the item; else BFCL's error kind."""
    if "parallel" in category:
        if len(calls) != len(answers):
            return "wrong_count"
        matched: set[int] = set()
        for answer in answers:
            doc = _doc(functions, next(iter(answer)))
            hit = next((i for i, c in enumerate(calls) if i not in matched and check_call(doc, c, answer) is None), None)
            if hit is None:
                return "cannot_find_match"
            matched.add(hit)
        return None
    if len(calls) != len(answers) or len(calls) != 1:
        return "wrong_count"
    doc = _doc(functions, next(iter(answers[0]))) if "multiple" in category else functions[0]
    return check_call(doc, calls[0], answers[0])


def score(functions: list[dict], possible_answer: list[dict] | None, category: str, text: str) -> dict:
    """{"accuracy": 0/1, "decoded": 0/1, "error": kind or None} for one model output.
    `decoded`: the output decodes into at least one call (for irrelevance that is the error)."""
    try:
        calls = decode(text)
        decoded = not is_empty(calls)
    except DecodeError:
        calls, decoded = None, False
    if category == "irrelevance":
        return {"accuracy": float(not decoded), "decoded": float(decoded),
                "error": "irrelevance:called" if decoded else None}
    if calls is None or not is_call_list(calls):
        return {"accuracy": 0.0, "decoded": 0.0, "error": "decoder_failed" if calls is None else "wrong_format"}
    error = check(functions, calls, possible_answer, category)
    return {"accuracy": float(error is None), "decoded": float(decoded), "error": error}


def score_item(item: dict, prediction: str) -> dict:
    """score() for a slice item (evals/bfcl.py keeps the docs and answers as JSON strings)."""
    answer = json.loads(item["possible_answer"]) if item.get("possible_answer") else None
    return score(json.loads(item["functions"]), answer, item["group"], prediction)


# ------------------------------------------------------------------ the canonical answer


def _first(options):
    """The first possible value, with nested dict answers resolved the same way."""
    value = options[0]
    if isinstance(value, dict):
        return {k: _first(v) for k, v in value.items() if v and v[0] != ""}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [{k: _first(o) for k, o in v.items() if o and o[0] != ""} for v in value]
    return value


def canonical_call(answers: list[dict]) -> str:
    """The possible answer as model output: each call with the first possible value of every
    parameter whose first option is not "" (omitted = optional)."""
    calls = []
    for answer in answers:
        name, params = next(iter(answer.items()))
        args = ", ".join(f"{p}={_first(opts)!r}" for p, opts in params.items() if opts and opts[0] != "")
        calls.append(f"{name}({args})")
    return "[" + ", ".join(calls) + "]"

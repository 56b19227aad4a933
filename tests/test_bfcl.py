"""The bfcl slice: BFCL's data from the installed package, BFCL's prompt, and an AST checker
that gives BFCL's own verdict (its checker, loaded with a stub for the model registry it cannot
import here, is the reference) on the possible answers and on thousands of perturbations."""
from __future__ import annotations

import collections
import copy
import importlib
import json
import random
import sys
import types
from unittest import mock

import pytest

from evals import bfcl
from evals import bfcl_checker as bc

CALL_CATEGORIES = [c for c in bfcl.CATEGORIES if c != "irrelevance"]


@pytest.fixture(scope="module")
def reference_checker():
    """bfcl-eval's ast_checker module. It imports the model registry only to ask whether a
    model's API turns '.' into '_' in function names; prompted models keep the dots."""
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = collections.defaultdict(lambda: types.SimpleNamespace(underscore_to_dot=False))
    with mock.patch.dict(sys.modules, {"bfcl_eval.constants.model_config": stub}):
        return importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")


def _reference_valid(ref, entry, calls) -> bool:
    return ref.ast_checker(entry["function"], calls, entry["possible_answer"], ref.Language.PYTHON,
                           entry["category"], "prompted-model")["valid"]


def test_possible_answers_pass_as_bfcl_says(reference_checker):
    """Each category's possible answer, written out as a model would, decoded and checked: our
    verdict is the reference's on every item; the only failures are items whose answer file
    contradicts its own function doc (the reference rejects them too)."""
    verdicts = collections.Counter()
    for category in CALL_CATEGORIES:
        for entry in bfcl.load_category(category):
            calls = bc.decode(bc.canonical_call(entry["possible_answer"]))
            ours = bc.check(entry["function"], calls, entry["possible_answer"], category) is None
            assert ours == _reference_valid(reference_checker, entry, calls), entry["id"]
            verdicts[ours] += 1
    assert verdicts[True] + verdicts[False] == 1000
    assert verdicts[False] <= 2, verdicts  # simple_python_200 and parallel_multiple_26


def _perturbations(calls: list[dict], rng: random.Random) -> list[list[dict]]:
    """Variants of a correct answer: reordered (passes for parallel), restyled strings (pass),
    and wrong ones (a call missing or repeated, a renamed function, a missing, extra, changed or
    retyped argument)."""
    out = []

    def variant(edit):
        c = copy.deepcopy(calls)
        if edit(c) is not False:
            out.append(c)

    def pick(c):
        call = c[rng.randrange(len(c))]
        name = next(iter(call))
        return call, name, call[name]

    def rename(c):
        call, name, _ = pick(c)
        call[name + "_v2"] = call.pop(name)

    def drop_arg(c):
        _, _, args = pick(c)
        if not args:
            return False
        args.pop(rng.choice(sorted(args)))

    def change_arg(c, how):
        _, _, args = pick(c)
        if not args:
            return False
        key = rng.choice(sorted(args))
        args[key] = how(args[key])

    def bump(v):
        if isinstance(v, bool):
            return not v
        if isinstance(v, (int, float)):
            return v + 1
        if isinstance(v, str):
            return v + "zz"
        if isinstance(v, list):
            return v[:-1] if v else [1]
        return {**v, "extra": 1} if isinstance(v, dict) else v

    def retype(v):
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, int):
            return float(v) if rng.random() < 0.5 else str(v)
        if isinstance(v, float):
            return int(v) if v == int(v) else str(v)
        if isinstance(v, str):
            return 7
        return tuple(v) if isinstance(v, list) else [v]

    def restyle(v):
        if isinstance(v, str):
            return v.upper().replace(" ", "  ")
        return [x.upper() if isinstance(x, str) else x for x in v] if isinstance(v, list) else v

    variant(lambda c: c.reverse())
    variant(lambda c: c.pop())
    variant(lambda c: c.append(copy.deepcopy(c[0])))
    variant(rename)
    variant(drop_arg)
    variant(lambda c: pick(c)[2].__setitem__("unknown_param", 1))
    for how in (bump, retype, restyle, bump, retype):
        variant(lambda c, how=how: change_arg(c, how))
    return out


def test_checker_agrees_with_bfcl_on_perturbed_answers(reference_checker):
    rng = random.Random(0)
    agree = collections.Counter()
    for category in CALL_CATEGORIES:
        for entry in bfcl.load_category(category):
            calls = bc.decode(bc.canonical_call(entry["possible_answer"]))
            for v in _perturbations(calls, rng):
                ours = bc.check(entry["function"], v, entry["possible_answer"], category) is None
                theirs = _reference_valid(reference_checker, entry, v)
                assert ours == theirs, (entry["id"], v)
                agree[ours] += 1
    # Both verdicts occur often: the comparison is not all-pass or all-fail.
    assert agree[True] > 1000 and agree[False] > 5000, agree


def test_decoding_follows_bfcl_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    assert bc.decode("[f(a=1, b='x')]") == [{"f": {"a": 1, "b": "x"}}]
    assert bc.decode("```\nmath.hypot(x=3, y=-4)\n```") == [{"math.hypot": {"x": 3, "y": -4}}]
    assert bc.decode("[f(a=[1, 2], b={'k': (1, 2)}, c=None, d=x)]") == \
        [{"f": {"a": [1, 2], "b": {"k": (1, 2)}, "c": None, "d": "x"}}]
    assert bc.decode("[f(a=2 ** 10, b=1e3 / 4, c='a' + 'b')]") == [{"f": {"a": 1024, "b": 250.0, "c": "ab"}}]
    assert bc.decode("[f(a=g(b=1)), h(x=len(y))]") == [{"f": {"a": {"g": {"b": 1}}}}, {"h": {"x": "len(y)"}}]
    # BFCL eval()s arithmetic; here nothing the model wrote is executed.
    out = bc.decode(f"[f(a=__import__('os').system('touch {marker}'))]")
    assert not marker.exists() and "system" in out[0]["f"]["a"]
    for bad in ("To find it, call f", "[f(a=1), 3]", "f(a=x + 1)", "[f(a=10 ** 10 ** 10)]",
                "[f(a=lambda: 1)]", "[f(a=1/0)]", "[f(a={1, 2})]"):
        with pytest.raises(bc.DecodeError):
            bc.decode(bad)


def test_scores_per_category():
    simple = next(e for e in bfcl.load_category("simple_python") if e["id"] == "simple_python_0")
    item = {"functions": json.dumps(simple["function"]), "possible_answer": json.dumps(simple["possible_answer"]),
            "group": "simple_python"}
    right = "[calculate_triangle_area(base=10, height=5)]"
    assert bc.score_item(item, right) == {"accuracy": 1.0, "decoded": 1.0, "error": None}
    assert bc.score_item(item, right + "\nDone.")["error"] == "decoder_failed"
    assert bc.score_item(item, "[calculate_triangle_area(base=10, height=6)]")["error"] == "value_error:others"
    assert bc.score_item(item, "[]")["error"] == "wrong_count"
    irrelevant = {"functions": json.dumps(simple["function"]), "possible_answer": None, "group": "irrelevance"}
    assert bc.score_item(irrelevant, "None of the functions can compute this.")["accuracy"] == 1.0
    assert bc.score_item(irrelevant, "[]")["accuracy"] == 1.0  # an empty list is no call
    assert bc.score_item(irrelevant, right) == {"accuracy": 0.0, "decoded": 1.0, "error": "irrelevance:called"}


def test_items_prompt_and_clusters(tiny_tokenizer):
    render, fmt = bfcl.chat_renderer(tiny_tokenizer)
    first = bfcl.items(10, 0, render, fmt)
    assert bfcl.items(20, 0, render, fmt)[:10] == first  # prefix-stable
    assert [it["group"] for it in first] == bfcl.CATEGORIES * 2  # round-robin over categories
    it = first[0]
    entry = next(e for e in bfcl.load_category(it["group"]) if e["id"] == it["id"])
    from bfcl_eval.constants.default_prompts import OUTPUT_FORMAT_MAPPING, PROMPT_STYLE_TEMPLATES

    system = bfcl.system_prompt(bfcl.with_python_hint(entry["function"]))
    assert system.startswith(PROMPT_STYLE_TEMPLATES["classic"]["persona"])
    assert OUTPUT_FORMAT_MAPPING["python"] in system
    assert json.dumps(bfcl.with_python_hint(entry["function"]), indent=4) in system
    assert bfcl.PYTHON_HINT in system and bfcl.PYTHON_HINT not in json.dumps(entry["function"])
    assert it["prompt"] == tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *entry["question"][0]], tokenize=False, add_generation_prompt=True)
    assert json.loads(it["functions"]) == entry["function"] and fmt == "chat_template"
    # Items that share a function doc or a question share a cluster; the clusters cover all items.
    everything = [e for c in bfcl.CATEGORIES for e in bfcl.load_category(c)]
    cluster = bfcl.clusters(everything)
    by_doc = collections.defaultdict(set)
    for e in everything:
        for f in e["function"]:
            by_doc[json.dumps(f, sort_keys=True)].add(cluster[e["id"]])
    assert all(len(c) == 1 for c in by_doc.values())
    assert 100 < len(set(cluster.values())) < len(everything)


def test_bfcl_task_yaml_is_an_lm_eval_task(tmp_path, tiny_tokenizer):
    from lm_eval.tasks import TaskManager, get_task_dict

    from pipeline.quality.items import builtin_task_config

    render, fmt = bfcl.chat_renderer(tiny_tokenizer)
    data = tmp_path / "bfcl.jsonl"
    data.write_bytes(bfcl.to_jsonl(bfcl.items(5, 0, render, fmt)))
    cfg = builtin_task_config("bfcl", data, max_new_tokens=64)
    task = get_task_dict([cfg], TaskManager(include_defaults=False))[cfg["task"]]
    docs = list(task.test_docs())
    assert [d["group"] for d in docs] == bfcl.CATEGORIES
    assert task.config.generation_kwargs["max_gen_toks"] == 64
    for d in docs:
        # The items survive the round trip through datasets unchanged (docs are JSON strings).
        assert task.doc_to_text(d) == d["prompt"]
        # The target is the canonical answer (for irrelevance a sentence, no call): it scores 1.
        assert task.process_results(d, [d["target"]]) == {"accuracy": 1.0,
                                                           "decoded": float(d["group"] != "irrelevance")}

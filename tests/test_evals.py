"""The built-in slices: generators are deterministic and match the shipped data byte for byte, no
two items of a slice share a prompt (at gpu.yaml's 1000 items), the task YAMLs are lm-eval tasks
over that data, the metrics score known cases, and the quantization calibration text shares no
8-gram with any slice."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evals import generate as gen
from evals import metrics

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", list(gen.GENERATORS))
def test_shipped_data_is_the_generators_output(name):
    path = gen.DATA / f"{name}.jsonl"
    assert path.read_bytes() == gen.shipped_bytes(name), f"regenerate with: python -m evals.generate"


@pytest.mark.parametrize("name", list(gen.GENERATORS))
def test_items_are_prefix_stable_and_well_formed(name):
    small, large = gen.generate(name, 7), gen.generate(name, 14)
    assert large[:7] == small
    ids = [it["id"] for it in large]
    assert len(set(ids)) == len(ids)
    for it in large:
        assert it["slice"] == name and it["cluster"] and it["prompt"] and it["target"]
    assert len({it["cluster"] for it in large}) > 1


@pytest.mark.parametrize("name", list(gen.GENERATORS))
def test_no_two_items_share_a_prompt_at_gpu_size(name):
    """Greedy copies of one prompt score identically, so a repeated prompt is one measurement
    counted twice. Measured before the fix at 1000 items: 145 distinct tool_args prompts, 265
    calibration, 738 reasoning; now 1000 of 1000 everywhere. Clusters: each item its own, except
    a long_context haystack's items."""
    from pipeline.core.config import Config

    cfg = Config.model_validate(__import__("yaml").safe_load((REPO / "configs/gpu.yaml").read_text()))
    n = cfg.quality.items_per_slice
    params = {"lengths": cfg.quality.long_context_lengths} if name == "long_context" else {}
    items = gen.generate(name, n, **params)
    assert n == 1000 and len({it["prompt"] for it in items}) == n
    clusters = {it["cluster"] for it in items}
    assert len(clusters) == (n + 2) // 3 if name == "long_context" else len(clusters) == n


def test_language_question_is_never_one_of_its_shots():
    for it in gen.language(1000):  # was: 12 of the first 200 asked one of their own examples
        question = it["prompt"].rsplit("\nQ: ", 1)[1].removesuffix("\nA:")
        assert it["prompt"].count(f"Q: {question}\n") == 1, it["prompt"]


def test_slice_specific_fields():
    langs = {it["group"] for it in gen.language(16)}
    assert langs == {"en", "fr", "de", "es"}
    lc = gen.long_context(9, lengths=[256, 512, 1024])
    assert {it["group"] for it in lc} == {"256", "512", "1024"}
    assert {it["depth"] for it in lc} == set(gen.LONG_CONTEXT_DEPTHS)
    for it in lc:  # the planted fact is in the haystack, once
        assert it["prompt"].count(f"is {it['target']}.") == 1
        # longer nominal length -> longer text (the stage records real token counts)
    by_len = {it["length"]: len(it["prompt"]) for it in lc}
    assert by_len[256] < by_len[512] < by_len[1024]
    # A block's items share the whole haystack (only the question differs), and each item's
    # fact sits at its depth; the other facts in it are distractors with other keys and numbers.
    for block in range(3):
        items = lc[3 * block:3 * block + 3]
        hays = {it["prompt"].split("\n\nQuestion:")[0] for it in items}
        assert len(hays) == 1 and len({it["cluster"] for it in items}) == 1
        hay = hays.pop()
        assert hay.count("The secret number of the") == len(gen.LONG_CONTEXT_DEPTHS) + gen.DISTRACTORS
        where = [hay.index(f"is {it['target']}.") / len(hay) for it in items]
        assert where == sorted(where) and abs(where[0] - 0.1) < 0.1 and abs(where[2] - 0.9) < 0.1
    # Few-shot examples are fixed per kind (a shared prefix) and never the item's own question.
    rs = gen.reasoning(12)
    for a, b in zip(rs[:6], rs[6:]):
        shots = a["prompt"].rsplit("\nQ: ", 1)[0]
        assert b["prompt"].rsplit("\nQ: ", 1)[0] == shots
        assert a["prompt"].rsplit("\nQ: ", 1)[1] not in shots
    for it in gen.calibration(12):
        assert 0 <= it["label"] < len(it["choices"]) and it["target"] == it["choices"][it["label"]]
    for it in gen.tool_args(8):
        expected = json.loads(it["target"])
        assert expected == it["expected"] and metrics.conforms(expected, it["tool"])


def test_task_yamls_are_lm_eval_tasks():
    """Each YAML builds an lm-eval task over its shipped JSONL (local `datasets` json loader)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from pipeline.quality.items import builtin_task_config

    for name in gen.GENERATORS:
        cfg = builtin_task_config(name, gen.DATA / f"{name}.jsonl", max_new_tokens=16)
        task = get_task_dict([cfg], TaskManager(include_defaults=False))[cfg["task"]]
        docs = list(task.test_docs())
        assert len(docs) == gen.SHIPPED[name]
        assert task.doc_to_text(docs[0]) == docs[0]["prompt"]
        if name == "calibration":
            assert task.doc_to_choice(docs[0]) == docs[0]["choices"]
            assert task.doc_to_target(docs[0]) == docs[0]["label"]
        else:
            assert task.config.generation_kwargs["max_gen_toks"] <= 16


def test_answer_extraction():
    doc = {"answer_type": "number", "target": "5"}
    assert metrics.score_answer(doc, " 2 + 3 = 5\n\nQ: next")["exact_match"] == 1.0
    assert metrics.score_answer(doc, "He has 5 apples.")["exact_match"] == 1.0
    assert metrics.score_answer(doc, "\n 6\n5")["exact_match"] == 0.0  # only the first line counts
    assert metrics.score_answer(doc, "five")["extracted"] is None
    name = {"answer_type": "name", "target": "Tom", "candidates": ["Tom", "Anna", "Ben"]}
    assert metrics.score_answer(name, " Tom is the oldest, then Anna")["exact_match"] == 1.0
    assert metrics.score_answer(name, " Anna, not Tom")["exact_match"] == 0.0


def test_tool_call_scores_are_separate():
    tool = {"name": "set_alarm", "parameters": {"hour": {"type": "integer"},
                                                 "unit": {"type": "string", "enum": ["am", "pm"]}},
            "required": ["hour"]}
    doc = {"tool": tool, "expected": {"name": "set_alarm", "arguments": {"hour": 7}}}

    def score(text):
        return metrics.score_tool_call(doc, text)

    assert score(' {"name": "set_alarm", "arguments": {"hour": 7}} trailing') == \
        {"args_exact": 1.0, "schema_ok": 1.0, "valid_json": 1.0}
    assert score('{"name": "set_alarm", "arguments": {"hour": 8}}') == \
        {"args_exact": 0.0, "schema_ok": 1.0, "valid_json": 1.0}
    assert score('{"name": "set_alarm", "arguments": {"hour": "7"}}')["schema_ok"] == 0.0  # type
    assert score('{"name": "set_alarm", "arguments": {"hour": 7, "unit": "xm"}}')["schema_ok"] == 0.0
    assert score('{"name": "set_alarm", "arguments": {}}')["schema_ok"] == 0.0  # required
    assert score('{"name": "set_alarm", "arguments": {"hour": 7, "x": 1}}')["schema_ok"] == 0.0
    assert score('{"name": "set_alarm", "arguments": {"hour": 7') == \
        {"args_exact": 0.0, "schema_ok": 0.0, "valid_json": 0.0}
    assert metrics.parse_json_object('x {"a": "}{"} y') == {"a": "}{"}


def test_calibration_summaries_on_known_values():
    from pipeline.stats.scoring_rules import calibration_summary

    # Two items, both predicted with confidence 0.8, one right: ECE = |0.5 - 0.8| = 0.3.
    # Brier: (0.2^2 + 0.2^2) + (0.8^2 + 0.8^2) over 2 items = (0.08 + 1.28) / 2.
    summary = calibration_summary([[0.8, 0.2], [0.8, 0.2]], [0, 1])
    assert summary["ece"] == pytest.approx(0.3, abs=1e-12) and summary["brier"] == pytest.approx(0.68, abs=1e-12)
    assert not hasattr(metrics, "ece") and not hasattr(metrics, "brier")  # one implementation
    p = metrics.option_probs([-1.0, -1.0, -3.0])
    assert sum(p) == pytest.approx(1.0) and p[0] == pytest.approx(p[1])


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[k : k + n]) for k in range(len(words) - n + 1)}


def _slice_texts():
    """(slice, text) for every item the quality stage can score from shipped or installed data:
    the generated slices' prompts, every BFCL item (question, function docs, system prompt,
    answer) and every HumanEval problem (prompt, solution, tests)."""
    from evals import bfcl, humaneval

    for name in gen.GENERATORS:
        for line in (gen.DATA / f"{name}.jsonl").read_text().splitlines():
            yield name, json.loads(line)["prompt"]
    for item in bfcl.items(None):
        yield "bfcl", item["prompt"] + "\n" + item["target"]
    for item in humaneval.items(None):
        yield "code", "\n".join([item["prompt"], item["target"], item["test"]])


def test_calibration_text_does_not_overlap_slices():
    """Quantization must not calibrate on test items: no 8-word sequence is shared between the
    calibration text and any item of any slice."""
    path = REPO / "evals" / "data" / "calibration.txt"
    assert path.is_file(), "evals/data/calibration.txt ships with the project"
    calib = _ngrams(path.read_text())
    assert calib, "calibration text is empty"
    counted = {}
    for name, text in _slice_texts():
        shared = calib & _ngrams(text)
        assert not shared, f"{name}: calibration text shares {' '.join(next(iter(shared)))!r}"
        counted[name] = counted.get(name, 0) + 1
    assert counted["bfcl"] == 1240 and counted["code"] == 164


def test_more_items_than_distinct_questions_is_one_clear_error():
    """A slice's templates hold a finite number of distinct questions (language about 1260):
    asking for more is bad input, not a repeated prompt."""
    from pipeline.quality.items import slice_items
    from pipeline.core.stage import StageError

    with pytest.raises(StageError, match="items_per_slice 2000: language: .* ask for fewer items"):
        slice_items("language", 2000, [])

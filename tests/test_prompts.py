"""The built-in prompt set (evals/data/speculation_prompts.json, read by pipeline/speculation/prompts.py):
what artifacts and the acceptance slices rely on. No model: the open kinds are pinned by a hash taken
before the input-grounded kinds were added (their ids name artifacts), and every input-grounded
prompt carries its input.

What the grounded kinds are for (prompt lookup pays where the output copies the input) is measured,
not tested (docs/results/2026-12-02-prompt-kinds.md; the tool that measured it has been removed)."""
from __future__ import annotations

import ast
import hashlib
import json
import re

from pipeline.speculation.prompts import KINDS, PROMPTS

OPEN_KINDS = ("chat", "code", "long_context", "structured")
# sha256 of json.dumps([[kind, PROMPTS[kind]] for kind in OPEN_KINDS], ensure_ascii=False), computed on
# the set as it was before issue 28 added the grounded kinds (commit 0b5295f).
OPEN_KINDS_SHA256 = "d298613b9a54c927f9a0a95330d8e93214db7809c3c6547a3b02f36e2b1ab28c"
PROSE_KINDS = ("summarize", "extract", "doc_qa")
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _words(text: str) -> int:
    return len(text.split())


def test_kinds_open_first_then_grounded_and_every_kind_has_prompts():
    assert KINDS[:4] == OPEN_KINDS  # the old order: slices and artifacts list kinds in it
    assert KINDS[4:] == ("summarize", "extract", "code_edit", "doc_qa")
    assert set(PROMPTS) == set(KINDS)
    for kind in KINDS:
        assert len(PROMPTS[kind]) >= 6, kind
        assert all(isinstance(t, str) and t.strip() == t and t for t in PROMPTS[kind]), kind
    assert all(len(PROMPTS[kind]) == 8 for kind in KINDS[4:])


def test_open_kinds_unchanged():
    """Ids are f"{kind}-{i}" by position: an edit, insertion or reordering in the first four kinds
    would silently rename what every stored acceptance and latency artifact measured."""
    blob = json.dumps([[kind, PROMPTS[kind]] for kind in OPEN_KINDS], ensure_ascii=False)
    assert hashlib.sha256(blob.encode()).hexdigest() == OPEN_KINDS_SHA256
    assert PROMPTS["chat"][0] == "What are three simple ways to save energy at home?"  # a readable anchor


def test_no_duplicate_prompts():
    every = [t for kind in KINDS for t in PROMPTS[kind]]
    assert len(every) == len(set(every))
    # Nor one passage under two instructions within a grounded kind: a slice of 8 near-copies
    # would count one input eight times. (long_context reuses its two passages on purpose.)
    for kind in PROSE_KINDS:
        longest = [max(t.split("\n\n"), key=len) for t in PROMPTS[kind]]
        assert len(set(longest)) == len(longest), kind


def test_prose_grounded_prompts_carry_their_passage():
    """summarize / extract / doc_qa: a passage of roughly 80-250 words plus the instruction. The
    floor is what makes them input-grounded (an instruction alone is under 60 words)."""
    for kind in PROSE_KINDS:
        for i, text in enumerate(PROMPTS[kind]):
            assert 100 <= _words(text) <= 320, (kind, i, _words(text))
            assert "```" not in text, (kind, i)


def test_code_edit_prompts_carry_their_code():
    """code_edit: one fenced block of 10-30 lines besides the instruction; the Python parses (the
    edit asked for is to working code, or to a bug the parser cannot see)."""
    for i, text in enumerate(PROMPTS["code_edit"]):
        blocks = FENCE.findall(text)
        assert len(blocks) == 1, i
        lang, code = blocks[0]
        assert 10 <= len(code.rstrip("\n").splitlines()) <= 30, (i, len(code.splitlines()))
        instruction = FENCE.sub("", text)
        assert _words(instruction) >= 8, i
        if lang == "python":
            ast.parse(code)
    assert {lang for t in PROMPTS["code_edit"] for lang, _ in FENCE.findall(t)} >= {"python", "javascript"}

"""The compiled decode path records what really ran (pipeline/decode/compiled.py).

A counting backend wraps dynamo's eager backend: it counts the graphs dynamo hands it and every
run of a compiled graph, per shape (the session's `current` key), independently of the session's
own bookkeeping. The record must agree with it: a shape recorded "compiled" ran through a compiled
graph on every call, a shape recorded "eager" never did. Greedy output with compile on equals
eager greedy output exactly (float32, CPU). Each graph costs a few seconds of dynamo tracing on
CPU, so the model has 2 layers and the shapes are few.

    .venv/bin/python -m pytest -q tests/test_compiled.py
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

from draft_models.layerskip import truncate
from pipeline.decode.drafts import ModelDraft
from pipeline.decode.engine import generate
from pipeline.decode.compiled import CompileSession, step_shapes
from pipeline.latency.memory import cache_len
from tests.conftest import make_tiny_llama

NEW = 10


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return make_tiny_llama(tiny_tokenizer, layers=2, seed=3)


def _counting_backend(session_ref: list):
    """A dynamo backend that runs the graph eagerly and counts compiles and runs per shape."""
    compiles: Counter = Counter()
    runs: Counter = Counter()

    def backend(gm, example_inputs):
        compiles[session_ref[0].current] += 1

        def run(*args):
            runs[session_ref[0].current] += 1
            return gm.forward(*args)

        return run

    return backend, compiles, runs


def _ids(tok, text="the quick brown fox jumps over"):
    return torch.tensor([tok.encode(text)])


def test_compiled_greedy_equals_eager_and_the_record_is_the_truth(model, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    length = cache_len(ids.shape[1], NEW)
    draft = ModelDraft("layerskip:1", truncate(model, 1), model.config.vocab_size)
    plain = generate(model, ids, NEW, cache_len=length).tokens
    spec = generate(model, ids, NEW, draft=draft, k=2, cache_len=length).tokens
    assert spec == plain  # the eager reference itself is lossless

    ref: list = [None]
    backend, compiles, runs = _counting_backend(ref)
    expected = (step_shapes("target", 1, length, [1]) + step_shapes("target", 1, length, [2, 3], all_logits=True)
                + step_shapes("draft", 1, length, [1, 2]))
    graphs_before = counters["stats"]["unique_graphs"]
    with CompileSession(backend=backend) as session:
        ref[0] = session
        session.attach(model, "target")
        session.attach(draft.model, "draft")
        session.expect(expected)
        assert session.warm(model) == 3 and session.warm(draft.model, slot="draft") == 2
        assert sum(compiles.values()) == 5  # every expected shape compiled before any real run
        assert generate(model, ids, NEW, cache_len=length).tokens == plain
        assert generate(model, ids, NEW, draft=draft, k=2, cache_len=length).tokens == plain
        rec = session.record()
        graphs_made = counters["stats"]["unique_graphs"] - graphs_before
    assert rec["ran"] == "compiled" and rec["eager_shapes"] == 0
    assert rec["graphs_compiled"] == len(expected) == graphs_made == sum(compiles.values())
    assert rec["recompiles"] == 0
    for shape in rec["shapes"]:
        key = (shape["model"], shape["batch"], shape["width"], shape["cache_len"], shape["all_logits"])
        assert key in expected and shape["ran"] == "compiled"
        # Every call of a compiled shape ran the compiled graph, as the counting backend saw.
        assert shape["calls"] == shape["compiled_calls"] == runs[key] > 0, shape
        assert compiles[key] == shape["graphs"] == 1
    # The steps really ran: the plain decode took NEW - 1 compiled decode steps (+1 warm call).
    assert runs[("target", 1, 1, length, False)] >= NEW
    # Closing detaches the models: the next run is eager and nothing compiles.
    n = sum(runs.values())
    assert generate(model, ids, NEW, cache_len=length).tokens == plain
    assert sum(runs.values()) == n


def test_a_limit_hit_or_an_unplanned_shape_runs_eager_and_is_recorded_so(model, tiny_tokenizer):
    """Dynamo's own recompile limit is forced down to one graph: the second planned shape hits it
    (FailOnRecompileLimitHit, not a silent eager run) and falls back explicitly; a verify width
    nobody planned is not compiled. The counting backend confirms neither ran a compiled graph."""
    ids = _ids(tiny_tokenizer, "a cat sat on the mat")
    length = cache_len(ids.shape[1], NEW)
    plain = generate(model, ids, NEW, cache_len=length).tokens
    self_draft = ModelDraft("self", model, model.config.vocab_size)  # accepts every token: widths 1, k + 1
    ref: list = [None]
    backend, compiles, runs = _counting_backend(ref)
    planned = step_shapes("target", 1, length, [1]) + step_shapes("target", 1, length, [4], all_logits=True)
    saved = torch._dynamo.config.recompile_limit
    with CompileSession(backend=backend) as session:
        ref[0] = session
        session.attach(model, "target")
        session.expect(planned)
        torch._dynamo.config.recompile_limit = 1  # below the plan: dynamo must refuse, loudly
        assert generate(model, ids, NEW, draft=self_draft, k=3, cache_len=length).tokens == plain
        shapes = {(s["width"], s["all_logits"]): s for s in session.record()["shapes"]}
        record = session.record()
    assert torch._dynamo.config.recompile_limit == saved  # restored on close
    first, verify = shapes[(1, False)], shapes[(4, True)]
    assert first["ran"] == "compiled" and first["compiled_calls"] == first["calls"] == runs[("target", 1, 1, length,
                                                                                                  False)] > 0
    assert verify["ran"] == "eager" and "RecompileLimit" in verify["reason"] and verify["compiled_calls"] == 0
    assert runs[("target", 1, 4, length, True)] == 0
    # The round cut short near max_new_tokens verifies fewer than k + 1 tokens: not planned.
    unplanned = [s for (w, _), s in shapes.items() if w not in (1, 4)]
    assert unplanned and all(s["ran"] == "eager" and "not in the compile plan" in s["reason"] for s in unplanned)
    assert all(runs[(s["model"], 1, s["width"], length, s["all_logits"])] == 0 for s in unplanned)
    assert record["ran"].startswith("partly compiled") and record["graphs_compiled"] == 1
    assert record["compiled_shapes"] == 1 and record["eager_shapes"] == 1 + len(unplanned)

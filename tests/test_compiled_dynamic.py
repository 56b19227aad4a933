"""One compiled graph for every verify width (CompileSession(dynamic_width=True)).

The counting backend of tests/test_compiled.py counts the graphs dynamo hands the backend and the
runs of compiled graphs per shape. With dynamic widths the target's verify widths 2..k+1 share one
graph, traced once, and every call of every planned width runs it; greedy output equals eager
greedy output exactly (float32, CPU); the record says how many graphs were planned and made.

    .venv/bin/python -m pytest -q tests/test_compiled_dynamic.py
"""
from __future__ import annotations

import pytest

from pipeline.decode.compiled import CompileSession, graph_groups, step_shapes
from pipeline.decode.drafts import ModelDraft
from pipeline.decode.engine import generate
from pipeline.latency.memory import cache_len
from tests.conftest import make_tiny_llama
from tests.test_compiled import _counting_backend, _ids

NEW = 12


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return make_tiny_llama(tiny_tokenizer, layers=2, seed=5)


def test_graph_groups_count_one_graph_per_width_group():
    shapes = (step_shapes("target", 1, 64, [1]) + step_shapes("target", 1, 64, range(2, 10), all_logits=True)
              + step_shapes("draft", 1, 64, [1, 2]) + step_shapes("target", 4, 96, range(2, 10), all_logits=True))
    assert len(graph_groups(shapes, False)) == len(shapes) == 1 + 8 + 2 + 8
    groups = graph_groups(shapes, True)
    # decode step, verify group at B = 1, the draft's step and its catch-up width 2, verify group at B = 4
    assert len(groups) == 1 + 1 + 2 + 1
    assert sorted(len(g) for g in groups.values()) == [1, 1, 1, 8, 8]


def test_verify_widths_share_one_graph_and_greedy_output_is_unchanged(model, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    length = cache_len(ids.shape[1], NEW)
    k = 4
    self_draft = ModelDraft("self", model, model.config.vocab_size)  # accepts all: width k + 1 and shorter
    plain = generate(model, ids, NEW, cache_len=length).tokens
    ref: list = [None]
    backend, compiles, runs = _counting_backend(ref)
    verify = step_shapes("target", 1, length, range(2, k + 2), all_logits=True)
    # The self-draft is the target itself: its step (width 1) and its catch-up after a round it
    # won in full (width 2, last logits only: a static graph of its own) run on the target's label.
    expected = step_shapes("target", 1, length, [1, 2]) + verify
    with CompileSession(backend=backend, dynamic_width=True) as session:
        ref[0] = session
        session.attach(model, "target")
        session.expect(expected)
        assert session.max_graphs == 3
        assert session.new_graphs(verify) == 1 and session.new_graphs(expected) == 3  # before any compile
        assert session.warm(model) == len(expected)  # every width run before the timed runs
        # twice each: on CUDA the first call is the CUDA graph's warm-up, the second its recording
        assert all(r.calls == r.compiled_calls == 2 for r in session.shapes.values())
        assert session.new_graphs(expected) == 0  # every group made: planning charges no more compiles
        assert all(r.record_s > 0 for r in session.shapes.values())  # the second call, timed
        assert sum(compiles.values()) == 3  # decode step, catch-up, one verify graph for widths 2..k+1
        assert generate(model, ids, NEW, draft=self_draft, k=k, cache_len=length).tokens == plain
        assert generate(model, ids, NEW, cache_len=length).tokens == plain
        rec = session.record()
    assert sum(compiles.values()) == 3  # the runs compiled nothing more
    assert rec["dynamic"] == "width" and rec["planned_graphs"] == 3 and rec["planned_shapes"] == len(expected)
    assert rec["dynamic_graphs"] == 1 and rec["record_s"] > 0
    assert rec["graphs_compiled"] == 3 and rec["recompiles"] == 0 and rec["eager_shapes"] == 0
    shapes = {(s["width"], s["all_logits"]): s for s in rec["shapes"]}
    assert shapes[(1, False)]["dynamic_width"] is False and shapes[(1, False)]["graphs"] == 1
    verify_recs = [shapes[(w, True)] for w in range(2, k + 2)]
    assert all(s["dynamic_width"] and s["ran"] == "compiled" for s in verify_recs)
    assert sum(s["graphs"] for s in verify_recs) == 1  # made by the first width, reused by the rest
    # Every call of every width ran a compiled graph (the counting backend saw each run).
    assert sum(s["calls"] for s in verify_recs) == sum(runs[(s["model"], 1, s["width"], length, True)]
                                                      for s in verify_recs) > k
    assert runs[("target", 1, k + 1, length, True)] > 1  # the full-width verify ran in the rounds too


def test_static_widths_compile_a_graph_each(model, tiny_tokenizer):
    """dynamic_width=False (latency.compile_dynamic_width: false): a graph per planned width."""
    ids = _ids(tiny_tokenizer, "a cat sat on the mat")
    length = cache_len(ids.shape[1], NEW)
    ref: list = [None]
    backend, compiles, _ = _counting_backend(ref)
    expected = step_shapes("target", 1, length, [1]) + step_shapes("target", 1, length, [2, 3, 4], all_logits=True)
    with CompileSession(backend=backend, dynamic_width=False) as session:
        ref[0] = session
        session.attach(model, "target")
        session.expect(expected)
        session.warm(model)
        rec = session.record()
    assert sum(compiles.values()) == 4 == rec["graphs_compiled"] == rec["planned_graphs"]
    assert rec["dynamic"] is False and rec["dynamic_graphs"] == 0

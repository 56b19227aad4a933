"""The latency stage runs its memory plan and records what ran (pipeline/latency/memory.py).

A budget is chosen (with the planner's own arithmetic) so that, on the tiny model, one cell must
prefill in chunks and one cannot fit at all; the stage must drop that one with the plan's reason,
chunk the other, run the rest in the plan's order, and free every cache.

    .venv/bin/python -m pytest -q tests/test_latency_plan.py
"""
from __future__ import annotations

import json

import torch

from pipeline.core.config import Config
from pipeline.latency.memory import ModelShape, plan_grid
from pipeline.latency.roofline import model_bytes

CPU = torch.device("cpu")


def _lat(**kw):
    base = {"batch_sizes": [2, 1], "context_lengths": [400, 8], "new_tokens": 3, "warmup": 0, "repeats": 1}
    return Config.model_validate({"latency": {**base, **kw}}).latency


def _budget_that_chunks_one_and_drops_one(model, lat) -> int:
    """The smallest budget (1 KiB steps) at which (1, 400) fits only with a chunked prefill and
    (2, 400) does not fit at all, found with the planner itself."""
    weights = model_bytes(model)["all_weight_bytes"]
    shape = ModelShape.from_model(model, weights)
    for budget in range(256 << 10, 64 << 20, 1 << 10):
        plan = plan_grid(shape, lat.batch_sizes, lat.context_lengths, lat.new_tokens, budget, "cpu")
        cells = {(c.batch, c.context): c for c in plan.cells}
        if set(cells) == {(1, 8), (1, 400), (2, 8)} and cells[(1, 400)].prefill_chunk:
            return budget
    raise AssertionError("no budget chunks (1, 400) and drops (2, 400)")


def test_plain_grid_executes_the_memory_plan(tiny_model, monkeypatch):
    from pipeline.latency import grid as latency
    from pipeline.latency import memory as latency_plan
    from pipeline.decode.cache import CachedModel

    lat = _lat()
    budget = _budget_that_chunks_one_and_drops_one(tiny_model, lat)
    monkeypatch.setattr(latency_plan, "device_budget", lambda *a, **k: {"budget_bytes": budget, "source": "test"})
    CachedModel.release(tiny_model)
    sizes = []
    real = CachedModel.__init__

    def spy(self, model, batch, max_len, slot="target", exact=False):
        real(self, model, batch, max_len, slot=slot, exact=exact)
        sizes.append((batch, self.max_len, len(CachedModel._pool.get(self.model, {}))))

    monkeypatch.setattr(CachedModel, "__init__", spy)
    out = latency.plain_grid("tiny", tiny_model, lat, CPU, {"gbps": 10.0}, seed=0, confidence=0.95)
    cells = {(c["batch"], c["context"]): c for c in out["grid"]}
    assert cells[(2, 400)]["skipped"].startswith("memory plan: needs ")
    chunked = cells[(1, 400)]
    assert chunked["prefill_chunk"] and chunked["prefill_chunk"] < 400 and len(chunked["tpot_ms"]["samples"]) == 1
    assert cells[(1, 8)]["prefill_chunk"] is None and cells[(2, 8)]["cache_len"] == 64
    # The plan's order (batch, then context, ascending), each cell on a cache of exactly its length,
    # with no other pooled cache alive beside it.
    assert [(s["batch"], s["context"]) for s in out["memory_plan"]["steps"] if s["action"] == "run"] == \
        [(1, 8), (1, 400), (2, 8)]
    assert sizes == [(1, 64, 1), (1, 404, 1), (2, 64, 1)]  # (batch, cache length, caches pooled)
    assert CachedModel._pool.get(tiny_model, {}) == {}  # freed after the last cell
    assert out["memory_plan"]["dropped"][0]["batch"] == 2 and out["memory_plan"]["budget"]["budget_bytes"] == budget
    assert "compile" not in out
    assert out["kernels"]["library"] == "none (unquantized)"
    assert out["kernels"]["unquantized_linear_layers"] == 4 * 7 + 1  # the decoder layers' linears and the head
    assert out["device_name"]

"""The latency stage runs its memory plan and records what ran (pipeline/latency/plan.py).

A budget is chosen (with the planner's own arithmetic) so that, on the tiny model, one cell must
prefill in chunks and one cannot fit at all; the stage must drop that one with the plan's reason,
chunk the other, run the rest in the plan's order, and free every cache. With compile on (dynamo's
eager backend on CPU) the stage's meta must say compiled, and its record must match the graphs
dynamo made.

    .venv/bin/python -m pytest -q tests/test_latency_plan.py
"""
from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters

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
    from pipeline.latency import plan as latency_plan
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
    assert out["compile"] == {"requested": False, "ran": "eager", "reason": "off", "graphs_compiled": 0,
                              "recompiles": 0, "shapes": []}
    assert out["kernels"]["library"] == "none (unquantized)"
    assert out["kernels"]["unquantized_linear_layers"] == 4 * 7 + 1  # the decoder layers' linears and the head
    assert out["device_name"]


def _compiled_latency_run(tmp_path, tiny_model, tiny_tokenizer, drafts: list[str], k_max: int = 1):
    """The latency stage on a prepared tiny model, compiled with dynamo's eager backend on CPU: one
    plain cell, pairs at k = 1. Returns (meta, graphs dynamo made, run)."""
    from conftest import save_as_prepared
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    for stage, extra in (("variants", {"variants": {"bf16": {"scheme": "none", "dir": "variants/bf16"}}}),
                         ("drafts", {}), ("acceptance", {})):
        (run / stage).mkdir(parents=True, exist_ok=True)
        (run / stage / "meta.json").write_text(json.dumps({"stage": stage, "input_hash": stage, **extra}))
    cfg = Config.model_validate({
        "device": "cpu", "drafts": drafts,
        "quantize": {"reference": "bf16", "variants": {"bf16": {"scheme": "none"}}},
        "acceptance": {"k_max": k_max, "temperatures": [0.0], "prompts_per_kind": 1},
        "latency": {"k_max": k_max, "batch_sizes": [1], "context_lengths": [8], "new_tokens": 4, "warmup": 1, "repeats": 1,
                    "compile": True, "compile_backend": "eager", "screen": False},
    })
    before = counters["stats"]["unique_graphs"]
    meta = json.loads(run_stage(STAGES["latency"], run, cfg, {}, STAGES).read_text())
    return meta, counters["stats"]["unique_graphs"] - before, run


def test_stage_with_compile_records_what_compiled(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    """latency.compile with the eager backend on CPU: every planned step shape compiles before the
    timed runs, the record says so per shape, and its graph count is dynamo's own."""
    meta, made, run = _compiled_latency_run(tmp_path, tiny_model, tiny_tokenizer, ["layerskip:2"])
    assert meta["compile"] == "compiled"
    plain = meta["compile_record"]["plain"]["bf16"]
    pair = meta["compile_record"]["speculative"]["bf16__layerskip-2"]
    # Plain: the one cell's decode step. Pair: the target's step and verify width 2, the draft's
    # widths 1 and 2.
    assert plain["graphs_compiled"] == plain["planned_graphs"] == 1
    assert pair["graphs_compiled"] == pair["planned_graphs"] == 4
    assert made == 5 and plain["recompiles"] == pair["recompiles"] == 0
    for rec in (plain, pair):
        assert rec["ran"] == "compiled" and rec["backend"] == "eager"
        assert all(s["ran"] == "compiled" and s["calls"] == s["compiled_calls"] > 0 for s in rec["shapes"])
    assert {s["model"] for s in pair["shapes"]} == {"target", "draft layerskip:2"}
    doc = json.loads((run / "latency" / "bf16__layerskip-2.json").read_text())
    assert doc["compile"]["ran"] == "compiled" and doc["memory_plan"]["steps"][0]["cache_len"] == doc["cache_len"]
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False  # the session restored dynamo's settings


def test_verify_widths_up_to_k_max_cost_no_more_graphs(tmp_path, tiny_model, tiny_tokenizer):
    """k_max = 3: the target's verify widths 2, 3 and 4 share one graph (latency.compile_dynamic_width,
    the default), so dynamo makes as many graphs as at k_max = 1 (5), and the
    record plans one graph per width group while listing every width it ran compiled."""
    meta, made, _ = _compiled_latency_run(tmp_path, tiny_model, tiny_tokenizer, ["layerskip:2"], k_max=3)
    assert made == 1 + 4
    for phase in ("speculative",):
        rec = meta["compile_record"][phase]["bf16__layerskip-2"]
        assert rec["dynamic"] == "width" and rec["planned_graphs"] == rec["graphs_compiled"] == 4
        assert rec["planned_shapes"] == 6 and rec["recompiles"] == 0 and rec["eager_shapes"] == 0
        verify = [s for s in rec["shapes"] if s["model"] == "target" and s["all_logits"]]
        assert sorted(s["width"] for s in verify) == [2, 3, 4]
        assert all(s["dynamic_width"] and s["ran"] == "compiled" and s["calls"] == s["compiled_calls"] > 0
                   for s in verify)
        assert sum(s["graphs"] for s in verify) == 1


def test_compile_requested_on_cpu_without_a_backend_says_eager():
    from pipeline.latency.plan import compile_session

    session, record = compile_session(_lat(compile=True), CPU)  # compile_backend: auto
    assert session is None and record["ran"] == "eager" and record["requested"]
    assert "not run on CPU" in record["reason"]

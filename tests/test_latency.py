"""Latency: the timer on CPU, the roofline arithmetic, and the stage's figures on the tiny model.

No assertion here depends on how fast this machine is: timings are checked for structure (one
sample per repeat, nesting, medians inside their CIs), never against absolute durations.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipeline.core.config import Config
from pipeline.speculation.prompts import KINDS
from pipeline.latency.roofline import bytes_per_step, measure_bandwidth, model_bytes, roofline
from pipeline.decode.timing import Timer

CPU = torch.device("cpu")


def _work(n: int = 64) -> None:
    a = torch.randn(n, n)
    for _ in range(3):
        a = a @ a.T / n


def test_cpu_timer_nests_and_counts():
    t = Timer(CPU)
    for _ in range(3):
        with t.measure("round"):
            with t.measure("draft"):
                _work()
            with t.measure("verify"):
                _work()
    s = t.collect()
    assert {k: len(v) for k, v in s.items()} == {"round": 3, "draft": 3, "verify": 3}
    for r, d, v in zip(s["round"], s["draft"], s["verify"]):
        # Nested perf_counter intervals: the round contains both parts and so cannot be shorter.
        assert d > 0 and v > 0 and r >= d + v
    off = Timer(CPU, enabled=False)
    with off.measure("x"):
        pass
    assert off.collect() == {}


def test_model_bytes_and_roofline_arithmetic(tiny_model):
    mb = model_bytes(tiny_model)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in tiny_model.parameters()}
    buffers = sum(b.numel() * b.element_size() for b in tiny_model.buffers())
    assert mb["weight_bytes"] == sum(unique.values()) + buffers  # tied embedding counted once
    # 2 (K and V) * 4 layers * 2 kv heads * (64 / 4) head_dim * 4 bytes (float32).
    assert mb["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * 4
    step = bytes_per_step(1000, batch=4, context=10, kv_bytes_per_token=8)
    assert step == 1000 + 4 * 10 * 8
    r = roofline(2_000_000_000, seconds_per_step=0.5, device_gbps=8.0)
    assert r["achieved_gbps"] == pytest.approx(4.0) and r["roofline_fraction"] == pytest.approx(0.5)
    assert r["roofline_ms_per_step"] == pytest.approx(250.0)


def test_bandwidth_is_measured_and_described():
    bw = measure_bandwidth(CPU, size_bytes=8 << 20, repeats=2)
    assert bw["gbps"] > 0 and bw["gbps"] >= bw["gbps_median"]
    assert bw["bytes_per_copy"] == 2 * (8 << 20) and bw["copies"] == 2


def _lat(**kw):
    base = {"batch_sizes": [1, 2], "context_lengths": [8, 5000], "new_tokens": 3, "warmup": 0,
            "repeats": 2}
    return Config.model_validate({"latency": {**base, **kw}}).latency


def test_plain_grid_figures_on_the_tiny_model(tiny_model):
    from pipeline.latency.grid import plain_grid

    bw = {"gbps": 10.0}
    out = plain_grid("tiny", tiny_model, _lat(), CPU, bw, seed=0, confidence=0.95)
    assert out["bandwidth_gbps"] == 10.0 and out["weight_bytes"] > 0
    cells = {(c["batch"], c["context"]): c for c in out["grid"]}
    # The tiny Llama has 4096 positions: context 5000 is skipped with a reason, not measured.
    assert "skipped" in cells[(1, 5000)] and "skipped" in cells[(2, 5000)]
    for b in (1, 2):
        c = cells[(b, 8)]
        for key in ("ttft_ms", "tpot_ms"):
            s = c[key]
            assert len(s["samples"]) == 2 and all(x > 0 for x in s["samples"])
            assert s["ci"][0] <= s["median"] <= s["ci"][1]
        # Bytes per step: weights + B sequences' KV over every slot of the static cache, which
        # attention reads whole (at least context + new tokens + 1; the engine allocates >= 64).
        assert c["cache_positions"] >= 8 + 3 + 1
        assert c["bytes_per_step"] == int(out["weight_bytes"] + b * c["cache_positions"]
                                          * out["model_bytes"]["kv_bytes_per_token"])
        steps = c["inter_token_ms"]
        assert len(steps["samples"]) == 2 and all(len(r) == 2 for r in steps["samples"])  # repeats x (3 - 1)
        assert steps["p50"]["value"] <= steps["p90"]["value"] <= steps["p99"]["value"]
        for q in ("p50", "p90", "p99"):
            for key in ("inter_token_ms", "ttft_percentiles"):
                lo, hi = c[key][q]["ci"]
                assert lo <= c[key][q]["value"] <= hi
        assert c["achieved_gbps"] == pytest.approx(c["bytes_per_step"] / (c["tpot_ms"]["median"] / 1e3) / 1e9)
        assert c["roofline_fraction"] == pytest.approx(c["achieved_gbps"] / 10.0)
        assert c["peak_memory_bytes"] >= c["memory_before_bytes"] > 0


def test_speculative_pair_self_draft_accepts_everything(tiny_model, tiny_tokenizer):
    """The target drafting for itself accepts every token (greedy and sampled: q = p): with 7 new
    tokens (the first from prefill, then 6 from rounds) k = 1 emits 2 per round and k = 2 emits
    3; the round time by drafted count has a sample per repeat where rounds drafted that many."""
    from pipeline.decode.drafts import ModelDraft
    from pipeline.latency.speculative import speculative_pair

    acc = Config.model_validate({"acceptance": {"temperatures": [0.0, 0.7]}}).acceptance
    prompts = {"chat": [("chat-0", tiny_tokenizer.encode("the cat"))],
               "code": [("code-0", tiny_tokenizer.encode("def add(a, b):"))]}
    draft = ModelDraft("self:tiny", tiny_model, len(tiny_tokenizer))
    out = speculative_pair("tiny", "self:tiny", tiny_model, draft, prompts, _lat(new_tokens=7), acc, CPU, 0.95, 0,
                           [1, 2])
    assert set(out["by_temperature"]) == {"0.0", "0.7"} and out["primary_temperature"] == "0.0"
    assert out["prompts"] == {"chat": ["chat-0"], "code": ["code-0"]}
    for block in out["by_temperature"].values():
        rows = {r["k"]: r for r in block["rows"]}
        assert rows[1]["tokens_per_round"] == 2.0 and rows[2]["tokens_per_round"] == 3.0
        by_d = block["round_ms_by_drafted"]
        # k = 1: 3 rounds drafting 1; k = 2: 2 rounds drafting 2 (6 tokens = 3 + 3).
        assert by_d["1"]["rounds"] == 2 * 3 * 2 and by_d["2"]["rounds"] == 2 * 2 * 2 and by_d["0"]["rounds"] == 0
        assert all(x > 0 for x in by_d["1"]["samples"]) and by_d["0"]["samples"] == [None, None]
    rows = {r["k"]: r for r in out["rows"]}
    assert len(out["plain_ms_per_token"]["samples"]) == 2
    for r in rows.values():
        assert all(o >= 0 for o in r["overhead_ms"]["samples"])  # round contains draft + verify
        for key in ("draft_ms", "verify_ms", "round_ms", "ms_per_token", "speedup"):
            assert r[key]["ci"][0] <= r[key]["median"] <= r[key]["ci"][1]
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["ms_per_token"]["median"])
        # The paired speedup of each repeat is that repeat's plain over speculative ms/token.
        for sp, p, s in zip(r["speedup"]["samples"], out["plain_ms_per_token"]["samples"],
                            r["ms_per_token"]["samples"]):
            assert sp == pytest.approx(p / s)


def test_percentiles_and_ratio_intervals():
    from pipeline.latency.grid import percentiles_ci, ratio_of_medians

    steps = [[1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 50.0], [1.5, 2.5, 3.5, 4.5]]
    p = percentiles_ci(steps, 0.95, 0)
    pooled = np.array(steps).ravel()
    for q in (50, 90, 99):
        assert p[f"p{q}"]["value"] == pytest.approx(np.percentile(pooled, q))
        lo, hi = p[f"p{q}"]["ci"]
        assert lo <= p[f"p{q}"]["value"] <= hi
    assert p["p99"]["ci"][1] == pytest.approx(50.0, rel=0.05)  # the repeat with the stall drives p99
    r = ratio_of_medians([2.0, 2.2, 1.8, 2.1], [4.0, 4.4, 3.6, 4.0], 0.95, 0)
    assert r["value"] == pytest.approx(2.05 / 4.0) and r["ci"][0] < r["value"] < r["ci"][1]


def test_peak_memory_tracks_an_allocation(monkeypatch):
    # The process's real RSS need not grow for a new tensor (the allocator may reuse resident
    # memory freed by earlier tests), so the sampler is fed a known RSS: it must catch the
    # transient peak and keep it after the level falls back.
    from pipeline.latency.grid import PeakMemory

    level = {"rss": 1000}
    monkeypatch.setattr(PeakMemory, "_rss", staticmethod(lambda: level["rss"]))
    mem = PeakMemory(CPU)
    with mem.track():
        level["rss"] = 5000
        deadline = time.monotonic() + 10
        while mem.peak < 5000 and time.monotonic() < deadline:
            time.sleep(0.005)
        level["rss"] = 1000
    assert mem.kind.startswith("cpu_rss") and mem.before == 1000 and mem.peak == 5000


def _fake_stage(run, out, **extra):
    import json

    (run / out).mkdir(parents=True, exist_ok=True)
    (run / out / "meta.json").write_text(json.dumps({"stage": out, "input_hash": out, **extra}))


def test_stage_writes_grid_and_pairs_then_is_up_to_date(tmp_path, tiny_model, tiny_tokenizer):
    import json

    from conftest import save_as_prepared
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "copy")
    _fake_stage(run, "variants", variants={"bf16": {"scheme": "none", "dir": "variants/bf16"},
                                           "copy": {"scheme": "none", "dir": "variants/copy"}})
    _fake_stage(run, "drafts")
    _fake_stage(run, "acceptance")  # no pair JSON; screening off: this test reads the timed pairs
    cfg = Config.model_validate({
        "device": "cpu", "drafts": ["layerskip:2", "ngram"],
        "quantize": {"reference": "bf16", "variants": {"bf16": {"scheme": "none"}, "copy": {"scheme": "none"}}},
        "acceptance": {"targets": ["bf16"], "k_max": 2, "prompts_per_kind": 1, "temperatures": [0.0]},
        "latency": {"batch_sizes": [2], "context_lengths": [8], "new_tokens": 3, "warmup": 0, "repeats": 2,
                    "screen": False},
    })
    meta_path = run_stage(STAGES["latency"], run, cfg, {}, STAGES)
    meta = json.loads(meta_path.read_text())
    assert meta["bandwidth"]["gbps"] > 0 and "compile" not in meta
    grid = json.loads((run / "latency" / "bf16.json").read_text())
    assert grid["bandwidth_gbps"] == meta["bandwidth"]["gbps"]
    assert [(c["batch"], c["context"]) for c in grid["grid"]] == [(2, 8)]
    copy = json.loads((run / "latency" / "copy.json").read_text())["grid"][0]
    ratio = copy["tpot_ratio_vs_reference"]
    assert ratio["ci"][0] <= ratio["value"] <= ratio["ci"][1] and ratio["reference"] == "bf16"
    assert copy["roofline_tpot_ratio_vs_reference"] == pytest.approx(1.0)  # the same weights
    assert "tpot_ratio_vs_reference" not in grid["grid"][0]
    assert (run / "latency" / "tpot_ratio.png").read_bytes()[:4] == b"\x89PNG"
    for slug in ("layerskip-2", "ngram"):
        pair = json.loads((run / "latency" / f"bf16__{slug}.json").read_text())
        assert pair["variant"] == "bf16" and [r["k"] for r in pair["rows"]] == [1, 2]
        assert {"draft_ms", "verify_ms", "overhead_ms", "round_ms", "tokens_per_round", "ms_per_token",
                "tokens_per_s", "speedup"} <= set(pair["rows"][0])
        assert set(pair["prompts"]) == set(KINDS)
        assert set(pair["by_temperature"]["0.0"]["round_ms_by_drafted"]) == {"0", "1", "2"}
    assert not (run / "latency" / "batched").exists()  # speculation under batching is vLLM's to measure
    before = (run / "latency" / "bf16.json").read_text()
    run_stage(STAGES["latency"], run, cfg, {}, STAGES)  # unchanged inputs: nothing re-measured
    assert (run / "latency" / "bf16.json").read_text() == before

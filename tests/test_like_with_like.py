"""Like with like: ratios between cells that ran differently are flagged and kept out of every
recommendation (synthetic artifacts with known answers), and a dropped variant's memory is
handed back before the next one is planned (the latency and acceptance stages on tiny models with
the cyclic collector switched off, so only an explicit gc.collect() can free a model caught in a
reference cycle).

    .venv/bin/python -m pytest -q tests/test_like_with_like.py
"""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from pipeline.core.config import Config
from tests.conftest import make_tiny_llama

CPU = torch.device("cpu")


def _mode(steps: str, kernel: str | None = None) -> dict:
    from pipeline.latency.modes import label

    m = {"steps": steps, **({"kernel": kernel} if kernel else {})}
    return {**m, "label": label(m)}


# ---------------------------------------------------------------- 2(c): ratios, flags, recommendations


def test_b1_marginal_table_flags_a_mixed_mode_k_and_never_recommends_it():
    from tests.test_marginal import _acc, _expected, _timing
    from pipeline.serving.marginal import marginal_table

    e = _expected(0.8, 4)
    timing = _timing(4, lambda d: 10.0 + 4 * d, 10.0, lambda d: 4.0 * d)  # best k = 2 (closed form)
    same = {**timing, "plain_run_mode": _mode("compiled"),
            "rows": [{"k": k, "run_mode": _mode("compiled")} for k in range(1, 5)]}
    tab = marginal_table(_acc(e, 0.8), same)
    assert tab["recommended_k"] == 2 and all(r["like_with_like"] is True for r in tab["rows"])
    mixed = {**same, "rows": [{"k": k, "run_mode": _mode("eager" if k == 2 else "compiled")} for k in range(1, 5)]}
    tab = marginal_table(_acc(e, 0.8), mixed)
    rows = {r["k"]: r for r in tab["rows"]}
    assert rows[2]["like_with_like"] is False and rows[2]["modes"] == {"speculative": "eager", "plain": "compiled"}
    assert rows[3]["like_with_like"] is True
    assert tab["recommended_k"] == 3  # k = 2 is out; 3 is the fastest left (7.453 < 7.778 ms/token)
    # Artifacts without modes (made before they were recorded): unknown, not flagged.
    tab = marginal_table(_acc(e, 0.8), timing)
    assert tab["recommended_k"] == 2 and all(r["like_with_like"] is None for r in tab["rows"])


def test_tpot_ratio_vs_reference_flags_other_modes_and_fallback_kernels():
    from pipeline.latency.grid import add_reference_ratios
    from pipeline.latency.modes import kernel_fallback, run_mode

    def grid(name, modes):
        return {"variant": name, "grid": [{"batch": 1, "context": c, "tpot_ms": {"samples": [10.0, 11.0]},
                                           "bytes_per_step": 100, "run_mode": m} for c, m in zip((8, 64), modes)]}

    ref = grid("bf16", [_mode("compiled", "native"), _mode("compiled", "native")])
    var = grid("w4", [_mode("compiled", "native"), _mode("eager", "native")])
    assert add_reference_ratios(var, ref, 0.95, 0)
    same, other = (c["tpot_ratio_vs_reference"] for c in var["grid"])
    assert same["like_with_like"] is True and "modes" not in same
    assert other["like_with_like"] is False and other["modes"] == {"variant": "eager", "reference": "compiled"}
    # GPTQModel's pure-torch kernel is a fallback: a ratio against the reference says so.
    gptq = {"details": {"TorchFusedQuantLinear": {"library": "gptqmodel", "QUANT_TYPE": "torch_fused"}}}
    marlin = {"details": {"MarlinQuantLinear": {"library": "gptqmodel", "QUANT_TYPE": "marlin"}}}
    avx512 = {"details": {"TorchCpuAvx512Linear": {"library": "gptqmodel", "QUANT_TYPE": "torch_cpu_avx512"}}}
    assert kernel_fallback(gptq) == "TorchFusedQuantLinear" and kernel_fallback(marlin) is None
    assert kernel_fallback(avx512) is None  # GPTQModel's SIMD int4 kernel for bf16 on CPU
    var = grid("w4", [run_mode(gptq)] * 2)
    add_reference_ratios(var, ref, 0.95, 0)
    ratio = var["grid"][0]["tpot_ratio_vs_reference"]
    assert ratio["like_with_like"] is False and ratio["modes"]["variant"] == "eager + fallback kernel"


def test_reports_mark_a_flagged_ratio_with_a_footnote():
    from tests.test_marginal import _acc, _expected, _timing
    from pipeline.report.marginal import render_markdown
    from pipeline.report.format import MARK
    from pipeline.serving.marginal import RULE, marginal_table

    e = _expected(0.8, 4)
    timing = {**_timing(4, lambda d: 10.0 + 4 * d, 10.0, lambda d: 4.0 * d), "plain_run_mode": _mode("compiled"),
              "rows": [{"k": k, "run_mode": _mode("eager" if k == 2 else "compiled")} for k in range(1, 5)]}
    tab = marginal_table(_acc(e, 0.8), timing)
    report = {"variant": "bf16", "draft": "layerskip:4", "confidence": 0.95, "primary": {"slice": "all",
              "temperature": "0.0"}, "rule": RULE, **tab}
    md = render_markdown(report)
    flagged_line = next(line for line in md.splitlines() if line.startswith("| 2 "))
    assert MARK in flagged_line
    assert all(MARK not in line for line in md.splitlines() if line.startswith(("| 1 ", "| 3 ", "| 4 ")))
    assert f"{MARK} speedup compares two runs that did not run the same way" in md
    assert "k=2 (speculative eager, plain compiled)" in md
    tab = marginal_table(_acc(e, 0.8), {**timing, "rows": [{"k": k, "run_mode": _mode("compiled")}
                                                           for k in range(1, 5)]})
    assert MARK not in render_markdown({**report, **tab})


# ---------------------------------------------------------------- 5: memory between variants


class _Spy:
    def __init__(self):
        self.events: list = []
        self.refs: dict[str, weakref.ref] = {}

    def load(self, tok, name, layers=1):
        model = make_tiny_llama(tok, layers=layers, seed=len(self.refs))
        model.__dict__["_cycle"] = [model]  # a reference cycle, as hooks and wrappers make: `del` alone keeps it
        self.refs[name] = weakref.ref(model)
        return model

    def alive(self) -> list[str]:
        return sorted(n for n, r in self.refs.items() if r() is not None)


@pytest.fixture
def no_auto_gc():
    """Only an explicit gc.collect() frees a cycle while this is on (as when the collector's
    thresholds happen not to trigger between two variants)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _fake_stage_dirs(run, variants: list[str], drafts: list[str] = ()):
    for name in variants:
        (run / "variants" / name).mkdir(parents=True)
        (run / "variants" / name / "meta.json").write_text(json.dumps({"input_hash": name}))
    (run / "variants" / "meta.json").write_text(json.dumps({
        "stage": "variants", "input_hash": "v", "variants": {n: {"scheme": "none", "dir": f"variants/{n}"}
                                                             for n in variants}}))
    (run / "drafts").mkdir(parents=True)
    (run / "drafts" / "meta.json").write_text(json.dumps({"stage": "drafts", "input_hash": "d"}))
    for spec in drafts:
        (run / "drafts" / spec / "meta.json").parent.mkdir(parents=True)
        (run / "drafts" / spec / "meta.json").write_text(json.dumps({"input_hash": spec}))


def test_latency_stage_frees_each_variant_before_the_next_plan(tmp_path, tiny_tokenizer, monkeypatch, no_auto_gc):
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage
    from pipeline.latency import memory as latency_plan
    from pipeline.stages import latency as stage

    spy = _Spy()
    monkeypatch.setattr(stage, "load_variant", lambda d, device: (spy.load(tiny_tokenizer, d.name), tiny_tokenizer))
    monkeypatch.setattr(stage, "measure_bandwidth", lambda device: {"gbps": 10.0})
    budget = latency_plan.device_budget

    def plan_spy(device, **kw):
        spy.events.append(("plan", spy.alive()))
        return budget(device, **kw)

    collect = stage.collect
    monkeypatch.setattr(latency_plan, "device_budget", plan_spy)
    monkeypatch.setattr(stage, "collect", lambda device: (collect(device), spy.events.append(("free", spy.alive()))))
    run = tmp_path / "run"
    _fake_stage_dirs(run, ["a", "b"])
    (run / "acceptance").mkdir()
    (run / "acceptance" / "meta.json").write_text(json.dumps({"stage": "acceptance", "input_hash": "a"}))
    cfg = Config.model_validate({
        "device": "cpu", "drafts": [], "quantize": {"reference": "a", "variants": {"a": {"scheme": "none"},
                                                                                  "b": {"scheme": "none"}}},
        "latency": {"batch_sizes": [1], "context_lengths": [8], "new_tokens": 2, "warmup": 0, "repeats": 1}})
    run_stage(STAGES["latency"], run, cfg, {}, STAGES)
    # Variant a is planned with only itself alive, freed (and dead) before b is loaded and planned.
    assert spy.events == [("plan", ["a"]), ("free", []), ("plan", ["b"]), ("free", [])]


def test_acceptance_stage_frees_drafts_and_each_variant_before_the_next(tmp_path, tiny_tokenizer, monkeypatch,
                                                                         no_auto_gc):
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage
    from pipeline.decode.drafts import ModelDraft
    from pipeline.stages import acceptance as stage

    spy = _Spy()

    def load(d, device):
        spy.events.append(("load", d.name, spy.alive()))
        return spy.load(tiny_tokenizer, d.name), tiny_tokenizer

    def draft(spec, model, tok, run_dir, device):
        spy.events.append(("draft", spec, spy.alive()))
        d = ModelDraft(spec, spy.load(tok, f"{spec}@{len(spy.refs)}"), model.config.vocab_size)
        d.__dict__["_target"] = model  # a draft that holds its target (a layer-skip draft holds its layers)
        return d

    result = {"slices": {"all": {}}}
    monkeypatch.setattr(stage, "load_variant", load)
    monkeypatch.setattr(stage, "build_draft", draft)
    monkeypatch.setattr(stage, "generate_texts", lambda *a, **k: {})
    monkeypatch.setattr(stage, "measure_pair", lambda *a, **k: result)
    run = tmp_path / "run"
    _fake_stage_dirs(run, ["a", "b"], ["d1", "d2"])
    cfg = Config.model_validate({"device": "cpu", "drafts": ["d1", "d2"],
                                 "quantize": {"reference": "a", "variants": {"a": {"scheme": "none"},
                                                                             "b": {"scheme": "none"}}},
                                 "acceptance": {"targets": ["a", "b"]}})
    monkeypatch.setattr(stage, "draft_slug", lambda spec: spec)
    monkeypatch.setattr(stage, "engine_specs", lambda specs, *a, **k: list(specs))
    run_stage(STAGES["acceptance"], run, cfg, {}, STAGES)
    # Each draft is gone before the next is built; variant a (and its drafts) before b loads.
    assert spy.events == [("load", "a", []), ("draft", "d1", ["a"]), ("draft", "d2", ["a"]),
                          ("load", "b", []), ("draft", "d1", ["b"]), ("draft", "d2", ["b"])]

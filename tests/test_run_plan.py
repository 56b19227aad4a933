"""The run's budget plan (pipeline/tools/run_plan.py, pipeline/core/budget.py: allot, PLAN_FILE): which
devices get one, the model's shape from its config.json, the file a GPU run writes and the stages
read, and that it is the plan the estimate prints for the same config, shape and device."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.budget import PLAN_FILE, StageBudget
from pipeline.core.config import load_config
from pipeline.tools import estimate as est
from pipeline.tools.cost_devices import DEVICES
from pipeline.tools.cost_model import SHAPES
from pipeline.tools.run_plan import main, make_plan, model_shape, plan_text, profile_for, write_plan

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "configs/gpu.yaml"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("name, profile", [
    (H100, "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA L4", None), (None, None), ("", None)])
def test_profiles_by_cuda_device_name(name, profile):
    assert profile_for(name) == profile


def _model_dir(tmp_path: Path, config: dict, nested: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"model_type": "llava", "text_config": config} if nested else {"model_type": "llama", **config}
    (d / "config.json").write_text(json.dumps(doc))
    return tmp_path


def test_the_models_shape_from_its_config_json(tmp_path):
    shape = model_shape(_model_dir(tmp_path, SHAPES["8b"]) / "model")
    assert {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads")} == \
        {k: SHAPES["8b"][k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads")}
    nested = model_shape(_model_dir(tmp_path / "n", SHAPES["tiny"], nested=True) / "model")
    assert nested["hidden_size"] == SHAPES["tiny"]["hidden_size"]
    no_kv = {k: v for k, v in SHAPES["tiny"].items() if k != "num_key_value_heads"}
    assert model_shape(_model_dir(tmp_path / "m", no_kv) / "model")["num_key_value_heads"] == \
        SHAPES["tiny"]["num_attention_heads"]  # multi-head attention: as many KV heads as heads
    assert model_shape(_model_dir(tmp_path / "x", {"hidden_size": 8}) / "model") is None
    assert model_shape(tmp_path / "absent") is None


def test_a_gpu_run_writes_the_plan_the_estimate_prints_and_its_stages_read_it(tmp_path):
    """gpu.yaml, an 8B-shaped config.json, an H100: the floors are over the planning stages' time, so
    each stage gets its floor (acceptance less than its share, latency and quality more), the same
    seconds the estimate's cap column shows; acceptance, latency and quality read them."""
    cfg = load_config(GPU)
    run = _model_dir(tmp_path, SHAPES["8b"])
    line = write_plan(run, cfg, device_name=H100)
    plan = json.loads((run / PLAN_FILE).read_text())
    assert plan["device_profile"] == "h100" and plan["minutes"] == 120 and plan["floors_over_time"]
    doc = est.estimate(cfg, "8b", DEVICES["h100"])
    caps = {r["stage"]: r["cap_s"] for r in doc["stages"] if r["cap_s"] is not None}
    assert {n: e["seconds"] for n, e in plan["stages"].items()} == pytest.approx(caps, abs=0.2)
    for name, entry in plan["stages"].items():
        assert entry["seconds"] == pytest.approx(entry["floor_s"], abs=0.1)
        assert StageBudget(cfg, name, run_dir=run).seconds == entry["seconds"]
    assert plan["stages"]["acceptance"]["seconds"] < plan["stages"]["acceptance"]["share_s"]
    assert plan["stages"]["latency"]["seconds"] > plan["stages"]["latency"]["share_s"]
    assert "h100 profile" in line and "each stage gets its floor" in line and line == plan_text(plan)
    # The estimate's total: the fixed stages plus the floors, under the two-hour target (docs/results/2026-12-03-gpu-estimate.md).
    assert doc["planned"] and doc["total"]["budgeted_s"] <= 120 * 60


def test_a_budget_over_the_floors_is_shared_as_the_shares_say(tmp_path):
    cfg = load_config(GPU, {"budget": {"minutes": 600}})
    plan = make_plan(cfg, SHAPES["8b"], "h200")
    seconds = {n: e["seconds"] for n, e in plan["stages"].items()}
    assert not plan["floors_over_time"]
    planned = sum(share for n, share in cfg.budget.shares.items() if n != "vllm")  # the cost model has no vllm stage
    assert sum(seconds.values()) == pytest.approx(600 * 60 * planned, rel=1e-6)
    assert seconds == pytest.approx({n: e["share_s"] for n, e in plan["stages"].items()}, abs=0.1)


def test_no_plan_on_a_cpu_an_unknown_gpu_without_a_budget_or_rebalance(tmp_path):
    run = _model_dir(tmp_path, SHAPES["8b"])
    cfg = load_config(GPU, {"device": "cpu"})
    (run / PLAN_FILE).write_text("{}")  # a stale plan is removed
    assert "no cost-model plan (a CPU run" in write_plan(run, cfg)
    assert not (run / PLAN_FILE).exists()
    assert "no profile for NVIDIA L4" in write_plan(run, cfg, device_name="NVIDIA L4")
    off = load_config(GPU, {"budget": {"rebalance": False}})
    assert "rebalance is off" in write_plan(run, off, device_name=H100)
    assert write_plan(run, load_config(GPU, {"budget": {"minutes": None}}), device_name=H100) == \
        "no time budget: no plan"
    assert not (run / PLAN_FILE).exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "config.json" in write_plan(bare, load_config(GPU), device_name=H100)
    # The estimate does as the run does: no plan on a CPU profile.
    assert not est.estimate(load_config(REPO / "configs/default.yaml"), "smollm2-135m",
                            DEVICES["cpu-2core"])["planned"]


def test_the_command_make_prepare_runs(tmp_path, capsys):
    """The Makefile's prepare target runs it after the stage: on this CPU no plan, one line."""
    run = _model_dir(tmp_path, SHAPES["tiny"])
    (run / PLAN_FILE).write_text("{}")
    assert main(["--run", str(run), "--config", str(REPO / "configs/default.yaml")]) == 0
    assert not (run / PLAN_FILE).exists()
    assert "no cost-model plan (a CPU run" in capsys.readouterr().err
    assert main(["--run", str(run), "--config", str(tmp_path / "absent.yaml")]) == 2

"""The quality stage end to end on the tiny model (two variants: the reference and a noisy copy),
its summaries, the distribution metrics, and the offline skip of a named lm-eval task."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from pipeline.quality import distribution
from pipeline.core.config import load_config
from pipeline.core.stage import StageError

SLICES = ["reasoning", "calibration"]  # one generation slice, one log-likelihood slice


def _make_run(tmp_path, tiny_model_dir, noise: float = 0.5):
    """A run dir as quantize leaves it: variants/bf16 (copy of the reference) and variants/noisy
    (the same weights plus Gaussian noise), with the stage meta listing both."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    for name in ("bf16", "noisy"):
        d = run / "variants" / name
        shutil.copytree(tiny_model_dir, d)
        meta = json.loads((d / "meta.json").read_text())
        meta["scheme"] = "none"
        (d / "meta.json").write_text(json.dumps(meta))
    weights = run / "variants" / "noisy" / "model.safetensors"
    sd = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for k, w in sd.items():
        if w.dim() == 2:
            sd[k] = w + noise * w.std() * torch.randn(w.shape, generator=gen)
    save_file(sd, weights, metadata={"format": "pt"})
    variants = {n: {"scheme": "none", "dir": f"variants/{n}"} for n in ("bf16", "noisy")}
    (run / "variants" / "meta.json").write_text(
        json.dumps({"stage": "quantize", "input_hash": "test", "variants": variants}))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        "device: cpu\n"
        "quantize:\n  reference: bf16\n  variants:\n"
        "    bf16: {scheme: none, release: false}\n    noisy: {scheme: none}\n"
        f"quality:\n  slices: {json.dumps(SLICES)}\n  items_per_slice: 4\n  wave_items: 2\n  max_new_tokens: 4\n"
        "  batch_size: 4\n  distribution_docs: 3\n  distribution_tokens: 32\n")
    return run, load_config(cfg_path)


def test_stage_end_to_end_on_tiny_model(tmp_path, tiny_model_dir, capsys):
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    run, cfg = _make_run(tmp_path, tiny_model_dir)
    meta_path = run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    meta = json.loads(meta_path.read_text())
    assert meta["generation"] == {"greedy": True, "max_new_tokens": 4, "chat_template": False,
                                  "batch_size": 4, "evaluator": "prefix"}
    # The prefix evaluator's counters: the calibration options share their question.
    counters = meta["timing"]["bf16"]["counters"]
    assert 0 < counters["computed_tokens"] < counters["prompt_tokens"]
    assert meta["variants"] == ["bf16", "noisy"]
    q = run / "quality"
    for slice_name in SLICES:
        ref = [json.loads(line) for line in (q / "bf16" / f"{slice_name}.jsonl").read_text().splitlines()]
        var = [json.loads(line) for line in (q / "noisy" / f"{slice_name}.jsonl").read_text().splitlines()]
        # Scored in two waves of 2 (the noisy copy cannot settle on 2 items), in the data's
        # seeded order, the same for both models.
        order = [json.loads(line)["id"] for line in (q / "data" / f"{slice_name}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in ref] == [r["id"] for r in var] == order
        assert sorted(order) == [f"{slice_name}-{i:05d}" for i in range(4)]
        assert meta["sequential"][slice_name]["looks"] == [2, 4]
        for r in ref + var:
            assert {"id", "cluster", "slice", "group", "metric", "score", "scores", "prediction",
                    "target"} <= set(r)
            assert r["score"] in (0.0, 1.0)
    calib = [json.loads(line) for line in (q / "noisy" / "calibration.jsonl").read_text().splitlines()]
    for r in calib:
        assert sum(r["option_probs"]) == pytest.approx(1.0) and r["score"] == float(
            max(range(len(r["option_probs"])), key=r["option_probs"].__getitem__) == r["label"])

    ref_sum = json.loads((q / "bf16.json").read_text())
    var_sum = json.loads((q / "noisy.json").read_text())
    assert "distribution" not in ref_sum
    d = var_sum["distribution"]
    assert d["n_docs"] == 3 and d["kl_mean"] > 0 and 0 <= d["top1_agreement"] <= 1
    cal = var_sum["slices"]["calibration"]
    assert cal["n"] == 4 and cal["metric"] == "acc" and 0 <= cal["ece"] <= 1 and cal["brier"] >= 0
    assert set(var_sum["slices"]) == set(SLICES)

    # Interrupted after the first wave: the second look is scored alone, nothing else again.
    lines = (q / "noisy" / "reasoning.jsonl").read_text().splitlines(keepends=True)
    (q / "noisy" / "reasoning.jsonl").write_text("".join(lines[:2]))
    (q / "noisy" / "meta.json").unlink()
    capsys.readouterr()
    run_stage(STAGES["quality"], run, cfg, {}, STAGES, force=True)
    err = capsys.readouterr().err
    assert "bf16 up to date" in err and "noisy: 2 items" in err and "(reasoning 2->4)" in err, err
    assert (q / "noisy" / "reasoning.jsonl").read_text() == "".join(lines)

    # Unchanged inputs: the runner skips the stage; a deleted variant item is redone alone.
    capsys.readouterr()
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    assert "up to date" in capsys.readouterr().err
    shutil.rmtree(q / "noisy")
    run_stage(STAGES["quality"], run, cfg, {}, STAGES, force=True)
    err = capsys.readouterr().err
    assert "bf16 up to date" in err and "noisy: loading" in err
    assert (q / "noisy" / "reasoning.jsonl").is_file()

    # A gate setting changed: the items stand (nothing to score), the variant is reloaded only for
    # its drift (this raised a KeyError when no look scored anything).
    kept = (q / "noisy" / "reasoning.jsonl").read_text()
    cfg.gate.margin = 0.2
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    assert (q / "noisy" / "reasoning.jsonl").read_text() == kept
    assert json.loads((q / "noisy" / "distribution.json").read_text())["n_docs"] == 3


def test_named_task_without_data_is_skipped_with_one_line(capsys, monkeypatch):
    """Offline (no hub), gsm8k's data cannot load: it is skipped, one line says why."""
    from pipeline.quality.lm_tasks import resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    usable, skipped = resolve(["gsm8k", "no_such_task_xyz"])
    assert usable == []
    assert set(skipped) == {"gsm8k", "no_such_task_xyz"}
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "skipping lm-eval task" in ln]
    assert len(lines) == 2
    assert "'gsm8k'" in lines[0] and "not reachable" in lines[0]
    assert "not a task lm-eval knows" in lines[1]


def test_mismatched_item_ids_are_refused(tmp_path):
    from pipeline.quality.evaluate import write_summaries

    for name, ids in (("ref", ["a", "b"]), ("var", ["a", "c"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "s.jsonl").write_text("".join(json.dumps(
            {"id": i, "cluster": i, "group": None, "metric": "acc", "score": 1.0, "scores": {"acc": 1.0}}) + "\n"
            for i in ids))
    with pytest.raises(StageError, match="other 's' items"):
        write_summaries(tmp_path, ["ref", "var"], ["s"], 0.95)


def test_slice_summary_groups_and_clustered_ci():
    from pipeline.quality.evaluate import summarize_slice

    recs = [{"id": str(i), "cluster": f"c{i % 4}", "group": "en" if i % 2 else "fr",
             "metric": "exact_match", "score": float(i % 3 == 0), "scores": {"exact_match": 0.0}}
            for i in range(40)]
    s = summarize_slice(recs, 0.95)
    assert s["n"] == 40 and s["clusters"] == 4 and set(s["groups"]) == {"en", "fr"}
    assert s["ci"][0] < s["mean"] < s["ci"][1]
    assert s["groups"]["en"]["n"] == 20


def test_distribution_identical_models_have_zero_drift(tiny_model, tiny_tokenizer):
    ids, info = distribution.heldout_documents(tiny_tokenizer, n_docs=3, n_tokens=24)
    assert ids.shape == (3, 24) and len(info["modules"]) == 3
    per_doc = distribution.per_document(tiny_model, tiny_model, ids, torch.device("cpu"))
    s = distribution.summarize(per_doc)
    assert s["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert s["top1_agreement"] == 1.0 and s["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_distribution_reference_cache_gives_the_same_figures(tiny_model, tiny_tokenizer):
    # A second variant reuses the reference's log-probs instead of a reference forward; the
    # figures must be those of a fresh computation (the cache is exact, float32).
    ids, _ = distribution.heldout_documents(tiny_tokenizer, n_docs=5, n_tokens=16)
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cache: dict = {}
    first = distribution.per_document(tiny_model, other, ids, torch.device("cpu"), batch=2, cache=cache)
    assert sorted(cache) == [0, 2, 4]

    class NoForward(torch.nn.Module):  # a reference that must not be run again
        def forward(self, *a, **k):
            raise AssertionError("reference forward despite the cache")

    again = distribution.per_document(NoForward(), other, ids, torch.device("cpu"), batch=2, cache=cache)
    fresh = distribution.per_document(tiny_model, other, ids, torch.device("cpu"), batch=2)
    for key in fresh:
        assert again[key] == pytest.approx(fresh[key], rel=1e-6, abs=1e-9) == first[key]
    assert max(fresh["kl"]) > 0


def test_benchmarks_and_lm_eval_tasks_through_the_stage_and_gate(tmp_path, tiny_model_dir):
    """bfcl (two items per category), code (HumanEval in the sandbox) and a local lm-eval group
    run through the stage for both variants; the gate reads them like any slice: a bfcl row with
    one group per category, a row for the group task with its subtasks as groups."""
    from pipeline.__main__ import STAGES
    from pipeline.gate.decision import build_gate
    from pipeline.core.stage import run_stage
    from test_lm_tasks import _write_tasks

    (tmp_path / "tasks").mkdir()
    tasks = _write_tasks(tmp_path / "tasks")
    run, _ = _make_run(tmp_path, tiny_model_dir)
    cfg_path = tmp_path / "bench.yaml"
    cfg_path.write_text(
        "device: cpu\n"
        "quantize:\n  reference: bf16\n  variants:\n"
        "    bf16: {scheme: none, release: false}\n    noisy: {scheme: none}\n"
        "quality:\n  slices: [bfcl, code]\n"
        f"  tasks: [{json.dumps(str(tasks['toy_group']))}]\n"
        "  items_per_slice: 4\n  max_new_tokens: 8\n  batch_size: 8\n"
        "  per_slice: {bfcl: {items: 10, max_new_tokens: 8}, code: {items: 3, max_new_tokens: 8}}\n"
        "  sandbox: {seconds: 5, workers: 2}\n  distribution_docs: 2\n  distribution_tokens: 16\n")
    cfg = load_config(cfg_path)
    meta = json.loads(run_stage(STAGES["quality"], run, cfg, {}, STAGES).read_text())
    # The lm-eval group is planned like a slice: 4 of its documents in a seeded cluster order (4
    # stories, each 3 documents in both subtasks: one per cluster), one look (under wave_items).
    assert meta["items"] == {"bfcl": 10, "code": 3, "toy_group": 4} and meta["tasks"] == ["toy_group"]
    assert meta["sequential"]["toy_group"]["looks"] == [4]
    assert meta["sandbox"]["seconds"] == 5 and "network" in meta["sandbox"]
    assert meta["task_details"]["toy_group"]["subtasks"]["toy_mc_a"]["primary"] == "acc_norm,none"
    q = run / "quality"
    bfcl_recs = [json.loads(line) for line in (q / "noisy" / "bfcl.jsonl").read_text().splitlines()]
    # One look takes the same seeded cluster order as waves do: two items per category, shuffled.
    assert sorted(r["group"] for r in bfcl_recs) == sorted(["simple_python", "multiple", "parallel",
                                                            "parallel_multiple", "irrelevance"] * 2)
    assert all(r["metric"] == "accuracy" and set(r["scores"]) == {"accuracy", "decoded"} for r in bfcl_recs)
    code_recs = [json.loads(line) for line in (q / "bf16" / "code.jsonl").read_text().splitlines()]
    assert len(code_recs) == 3 and all(r["metric"] == "pass@1" and r["status"] for r in code_recs)
    summary = json.loads((q / "bf16.json").read_text())["slices"]
    assert set(summary["bfcl"]["groups"]) == set(r["group"] for r in bfcl_recs)
    assert set(summary["toy_group"]["groups"]) == {"toy_mc_a", "toy_mc_b"}
    gate = build_gate(run, cfg)
    cells = gate["variants"]["noisy"]["slices"]
    assert {"bfcl", "code", "toy_group"} <= set(cells)
    assert set(cells["bfcl"]["groups"]) == set(summary["bfcl"]["groups"]) and cells["bfcl"]["n"] == 10

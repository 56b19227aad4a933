"""lm-eval tasks (`quality.tasks`) scored in waves like the built-in slices (issue 27): local task
YAMLs over tiny JSON data and tiny random models built here. Shows: a task's documents in a seeded
cluster order planned into looks from counts; a task scored in two looks gives the lines the same
items give in one call (a group whose look holds documents of one subtask only included); an
identical copy settles at its first look and stops while a noisy one takes the next (the gate's
replay decides); through the stage, a budget stops a task after its first look, a re-run without
one continues from the lines kept, and a third run scores nothing."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.core.quality_config import QualityConfig
from pipeline.core.stage import StageContext
from pipeline.gate.decision import build_gate
from pipeline.quality import lm_tasks
from pipeline.quality.evaluate import evaluate
from pipeline.quality.items import task_looks
from pipeline.quality.waves import Waves, score_in_waves
from tests.test_lm_tasks import gsm8k_like_yaml, write_task_files
from tests.test_sequential_gate import _config

N_DOCS = 8


def _write_tasks(root: Path) -> dict[str, Path]:
    """A group of two multiple-choice subtasks over different documents, a multiple-choice task
    of 16 documents, and a generated task scored through two filters (like gsm8k)."""
    for name, n, word in (("odd", N_DOCS, "odd"), ("even", N_DOCS, "even"), ("many", 2 * N_DOCS, "small")):
        docs = [{"question": f"Is {i} {word}?", "choices": ["dog", "the"], "label": i % 2, "answer": f"{i} #### {i}"}
                for i in range(n)]
        (root / f"{name}.json").write_text("\n".join(json.dumps(d) for d in docs))
    mc = ("dataset_path: json\ndataset_kwargs: {{data_files: {data}}}\ntest_split: train\n"
          "output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\n"
          "doc_to_target: label\nmetric_list:\n  - {{metric: acc, aggregation: mean, higher_is_better: true}}\n")
    files = {
        "wv_odd": "task: wv_odd\n" + mc.format(data=root / "odd.json"),
        "wv_even": "task: wv_even\n" + mc.format(data=root / "even.json"),
        "wv_many": "task: wv_many\n" + mc.format(data=root / "many.json"),
        "wv_group": "group: wv_group\ntask: [wv_odd, wv_even]\n"
                    "aggregate_metric_list: [{metric: acc, weight_by_size: true}]\n",
        "wv_gen": gsm8k_like_yaml("task: wv_gen\n", root / "odd.json", max_gen_toks=3),
    }
    return write_task_files(root, files)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    return _write_tasks(tmp_path_factory.mktemp("wave_tasks"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _order(s: lm_tasks.NamedSlice) -> list[str]:
    """The slice's item ids in scoring order."""
    return [json.loads(line)["id"] for line in s.rows.splitlines()]


def _qcfg(**kw) -> QualityConfig:
    return QualityConfig(**{"batch_size": 8, "wave_items": 4, "max_items": None, "items_per_slice": 1000,
                            "per_slice": {}, **kw})


def _noisy(model, scale: float = 5.0):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return other


def _waves(out: Path, named: list, cfg_quality: QualityConfig, models: list[str]) -> Waves:
    """The stage's Waves over the named tasks alone (no built-in slice): each task's data file and
    plan as the stage writes them, every model opened empty."""
    plans, lines = {}, {}
    for s in named:
        plans[s.name] = task_looks(s, cfg_quality)
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "data" / f"{s.name}.jsonl").write_bytes(s.rows)
        lines[s.name] = s.rows.splitlines(keepends=True)
    waves = Waves(out, lines, plans, named, lambda files: {})
    ctx = StageContext(name="quality", run_dir=out.parent, out_dir=out, config=None, args={},
                       input_hash="test", upstream={}, code="test")
    for name in models:
        waves.open(ctx.item(name, {"name": name}), {"name": name})
    return waves


def _scorer(model, tokenizer, qcfg, calls: list):
    """What the stage's scorer does for an hf model (pipeline.quality.evaluate.evaluate), the
    documents each call asked for recorded."""
    def score(configs: dict, tasks: list):
        calls.append({s.name: {leaf.name: list(leaf.doc_ids) for leaf in s.leaves if leaf.doc_ids} for s in tasks})
        return evaluate(model, tokenizer, configs, tasks, qcfg, seed=0)
    return score


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_documents_are_ordered_once_and_planned_from_counts(task_files):
    qcfg = _qcfg(per_slice={"wv_many": {"items": 12}})
    (many, group), _ = lm_tasks.resolve([str(task_files["wv_many"]), str(task_files["wv_group"])], qcfg, seed=0)
    # wv_many: 12 of its 16 documents, the first of a seeded order (a fixed random subset).
    order = _order(many)
    assert many.n_max == 12 and len(set(order)) == 12 and order != sorted(order)
    assert sorted(many.leaves[0].doc_ids) == many.leaves[0].doc_ids
    assert {f"wv_many-{d:05d}" for d in many.leaves[0].doc_ids} == set(order)
    assert task_looks(many, qcfg) == {"looks": [4, 8, 12], "n_max": 12, "order": "seeded cluster order"}
    # The same order in another process (the seed and the task's name) and under another wave size.
    again, _ = lm_tasks.resolve([str(task_files["wv_many"])], _qcfg(per_slice={"wv_many": {"items": 12}},
                                                                      wave_items=5), seed=0)
    assert again[0].rows == many.rows
    assert task_looks(again[0], _qcfg(wave_items=5))["looks"] == [5, 10, 12]
    # A task's own wave_items (quality.per_slice) over the section's.
    assert task_looks(again[0], _qcfg(wave_items=5, per_slice={"wv_many": {"wave_items": 6}}))["looks"] == [6, 12]
    other, _ = lm_tasks.resolve([str(task_files["wv_many"])], qcfg, seed=1)
    assert _order(other[0]) != order
    # max_items caps an lm-eval task as it caps a slice; a group's subtasks share one order.
    capped, _ = lm_tasks.resolve([str(task_files["wv_group"])], _qcfg(max_items=6), seed=0)
    assert capped[0].n_max == 6 and _order(capped[0]) == _order(group)[:6]
    assert {json.loads(x)["group"] for x in group.rows.splitlines()} == {"wv_odd", "wv_even"}
    # Waves off (wave_items null): one look at n_max, the fixed-n gate.
    assert task_looks(group, _qcfg(wave_items=None))["looks"] == [16]


def test_a_task_scored_in_two_looks_equals_the_same_items_in_one_call(task_files, tiny_model, tiny_tokenizer,
                                                                       tmp_path):
    qcfg = _qcfg()
    named, skipped = lm_tasks.resolve([str(task_files["wv_group"]), str(task_files["wv_gen"])], qcfg, seed=0)
    assert not skipped
    out = tmp_path / "quality"
    waves = _waves(out, named, qcfg, ["bf16"])
    calls: list = []
    score = _scorer(tiny_model, tiny_tokenizer, qcfg, calls)
    waves.first_look("bf16", score)
    waves.cover("bf16", score, {"wv_group": 8, "wv_gen": 8})
    # Two calls, each asking lm-eval for exactly one look's documents of each task.
    assert len(calls) == 2
    for s in named:
        ids = _order(s)
        lines = _lines(out / "bf16" / f"{s.name}.jsonl")
        assert [r["id"] for r in lines] == ids[:8]  # the data file's order, a look at a time
        for k, call in enumerate(calls):
            asked = {f"{leaf}-{d:05d}" for leaf, docs in call[s.name].items() for d in docs}
            assert asked == set(ids[4 * k:4 * k + 4])
        # The same 8 items in one lm-eval call: the same records, line for line.
        one, _ = evaluate(tiny_model, tiny_tokenizer, {}, [lm_tasks.subset(s, ids[:8])], qcfg, seed=0)
        by_id = {r["id"]: r for r in one[s.name]}
        assert lines == [json.loads(json.dumps(by_id[i])) for i in ids[:8]]
    gen = _lines(out / "bf16" / "wv_gen.jsonl")
    assert set(gen[0]["scores"]) == {"exact_match,strict", "exact_match,flexible"}
    group = _lines(out / "bf16" / "wv_group.jsonl")
    assert {r["group"] for r in group} <= {"wv_odd", "wv_even"} and all(r["metric"] == "acc" for r in group)
    # A look whose documents are all in one subtask asks for that subtask alone (an empty samples
    # list would make lm-eval run every document of the other); its records keep their group.
    s = next(x for x in named if x.name == "wv_group")
    odd = [i for i in _order(s) if i.startswith("wv_odd")][:3]
    part = lm_tasks.subset(s, odd)
    assert [len(leaf.doc_ids) for leaf in part.leaves] == [3, 0]
    assert lm_tasks.samples_request([part]) == {"wv_odd": part.leaves[0].doc_ids}
    recs, _ = evaluate(tiny_model, tiny_tokenizer, {}, [part], qcfg, seed=0)
    assert sorted(r["id"] for r in recs["wv_group"]) == sorted(odd)
    assert {r["group"] for r in recs["wv_group"]} == {"wv_odd"}


def test_a_settled_task_stops_and_an_open_one_takes_the_next_look(task_files, tiny_model, tiny_tokenizer,
                                                                   tmp_path):
    """16 documents in looks of 8. With a wide margin (0.7: an identical copy's bound at 8 items and
    the first look's O'Brien-Fleming level is about -0.56) the copy passes at its first look and
    scores nothing more; the noisy copy's cell stays open and takes the second look; the reference
    scores what either needs; the gate replays the same looks."""
    qcfg = _qcfg(wave_items=8)
    cfg = _config(tmp_path, ["copy", "noisy"], "gate: {margin: 0.7}\n")
    (many,), _ = lm_tasks.resolve([str(task_files["wv_many"])], qcfg, seed=0)
    out = tmp_path / "run" / "quality"
    waves = _waves(out, [many], qcfg, ["bf16", "copy", "noisy"])
    calls: dict = {}
    ref_score = _scorer(tiny_model, tiny_tokenizer, qcfg, calls.setdefault("bf16", []))
    waves.first_look("bf16", ref_score)
    for name, model in (("copy", tiny_model), ("noisy", _noisy(tiny_model))):
        score_in_waves(waves, "bf16", name, ref_score, _scorer(model, tiny_tokenizer, qcfg, calls.setdefault(name, [])),
                       cfg)
        waves.finish(name, "prefix")
    waves.finish("bf16", "prefix")
    counts = {n: len(_lines(out / n / "wv_many.jsonl")) for n in ("bf16", "copy", "noisy")}
    assert counts == {"bf16": 16, "copy": 8, "noisy": 16}
    assert len(calls["copy"]) == 1 and len(calls["noisy"]) == 2 and len(calls["bf16"]) == 2
    (out / "meta.json").write_text(json.dumps({"slices": [], "tasks": ["wv_many"],
                                               "sequential": {"wv_many": task_looks(many, qcfg)}}))
    gate = build_gate(out.parent, cfg)
    cell = gate["variants"]["copy"]["slices"]["wv_many"]
    assert cell["status"] == "pass" and cell["stopped_on"] == "data" and cell["items_spent"] == 8
    assert cell["planned_looks"] == [8, 16] and [lk["n"] for lk in cell["looks"]] == [8]
    noisy = gate["variants"]["noisy"]["slices"]["wv_many"]
    assert [lk["n"] for lk in noisy["looks"]][-1] == 16
    assert gate["variants"]["copy"]["decision"] == "go"


def _stage_run(tmp_path: Path, tiny_model_dir: Path, task: Path) -> tuple[Path, object]:
    """A run dir as quantize leaves it (the reference and a noisy copy) and a config whose only
    quality slice is one lm-eval task in looks of 4."""
    from pipeline.core.config import load_config
    from tests.test_quality import _make_run

    run, _ = _make_run(tmp_path, tiny_model_dir)
    path = tmp_path / "tasks.yaml"
    path.write_text("device: cpu\nquantize:\n  reference: bf16\n  variants:\n"
                    "    bf16: {scheme: none, release: false}\n    noisy: {scheme: none}\n"
                    f"quality:\n  slices: []\n  tasks: [{json.dumps(str(task))}]\n  wave_items: 4\n"
                    "  batch_size: 8\n  distribution_docs: 2\n  distribution_tokens: 16\n")
    return run, load_config(path)


def test_the_stage_stops_a_task_on_the_budget_and_a_rerun_continues_from_the_lines_kept(
        task_files, tmp_path, tiny_model_dir, capsys):
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    run, cfg = _stage_run(tmp_path, tiny_model_dir, task_files["wv_gen"])
    cfg.budget.minutes = 0.001  # under a second: the reference's first look spends it
    meta = json.loads(run_stage(STAGES["quality"], run, cfg, {}, STAGES).read_text())
    q = run / "quality"
    assert meta["tasks"] == ["wv_gen"] and meta["sequential"]["wv_gen"]["looks"] == [4, 8]
    assert meta["items"] == {"wv_gen": 8}
    data = [json.loads(x)["id"] for x in (q / "data" / "wv_gen.jsonl").read_text().splitlines()]
    first = {n: (q / n / "wv_gen.jsonl").read_text() for n in ("bf16", "noisy")}
    assert [r["id"] for r in map(json.loads, first["noisy"].splitlines())] == data[:4]
    rec = meta["budget"]["variants"]["noisy"]
    assert rec["stopped"] and rec["slices"]["wv_gen"]["stopped_on"] == "budget"
    assert rec["slices"]["wv_gen"]["items"] == 4 and rec["slices"]["wv_gen"]["looks_skipped"] == 1
    gate = build_gate(run, cfg)
    cell = gate["variants"]["noisy"]["slices"]["wv_gen"]
    assert cell["stopped_on"] == "budget" and cell["items_left"] == 4
    assert "wv_gen" in meta["budget"]["pace_s_per_item"]["bf16"]
    capsys.readouterr()

    # No budget: the lines scored stand; each model scores only the look it lacks.
    cfg.budget.minutes = None
    meta = json.loads(run_stage(STAGES["quality"], run, cfg, {}, STAGES).read_text())
    err = capsys.readouterr().err
    assert "noisy: 4 items" in err and "wv_gen 4->8" in err, err
    for n in ("bf16", "noisy"):
        now = (q / n / "wv_gen.jsonl").read_text()
        assert now.startswith(first[n]) and [json.loads(x)["id"] for x in now.splitlines()] == data
    assert meta["budget"]["variants"]["noisy"]["stopped"] is False

    # The same settings again: nothing to score.
    kept = {n: (q / n / "wv_gen.jsonl").read_text() for n in ("bf16", "noisy")}
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    err = capsys.readouterr().err
    assert " items in " not in err, err
    assert {n: (q / n / "wv_gen.jsonl").read_text() for n in ("bf16", "noisy")} == kept
    shutil.rmtree(run)

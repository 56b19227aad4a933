"""`quality.tasks` on small local lm-eval task YAMLs over tiny JSON data, shaped like the tasks
people list: a group of subtasks (like mmlu), a task scored through two filters (like gsm8k's
strict-match / flexible-extract), a task whose own headline metric is acc_norm (like hellaswag),
documents that share a passage (like xnli's premise), a tag, and a task whose data is missing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.quality import lm_tasks
from pipeline.core.quality_config import QualityConfig

N_DOCS = 12


def _write_tasks(root):
    """Task YAMLs and their data under `root`; returns the YAML paths by name."""
    docs = [{"premise": f"Story number {i // 3}.", "question": f"Is {i} even?", "choices": ["yes", "no", "maybe"],
             "label": i % 3, "answer": f"{i} #### {i}"} for i in range(N_DOCS)]
    data = root / "docs.json"
    data.write_text("\n".join(json.dumps(d) for d in docs))
    mc = (f"dataset_path: json\ndataset_kwargs: {{data_files: {data}}}\ntest_split: train\n"
          "output_type: multiple_choice\ndoc_to_text: \"{{premise}} {{question}}\"\n"
          "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n"
          "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
          "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")
    files = {
        "toy_mc_a": f"task: toy_mc_a\n{mc}",
        "toy_mc_b": f"task: toy_mc_b\n{mc}",
        "toy_group": "group: toy_group\ntask: [toy_mc_a, toy_mc_b]\n"
                     "aggregate_metric_list: [{metric: acc, weight_by_size: true}]\n",
        "toy_filters": gsm8k_like_yaml("task: toy_filters\ntag: [toy_tag]\n", data, max_gen_toks=4),
        "toy_missing": ("task: toy_missing\ndataset_path: specq-test/no-such-dataset\ntest_split: test\n"
                        "output_type: multiple_choice\ndoc_to_text: x\ndoc_to_choice: [a]\ndoc_to_target: 0\n"),
    }
    return write_task_files(root, files)


def gsm8k_like_yaml(head: str, data: Path, max_gen_toks: int) -> str:
    """A generated task over a JSON file of {question, answer} scored through two filters, as
    gsm8k is ("strict": the number after ####, "flexible": the last number); `head`: its task line(s)."""
    return (head + f"dataset_path: json\ndataset_kwargs: {{data_files: {data}}}\ntest_split: train\n"
            "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_target: \"{{answer}}\"\n"
            f"generation_kwargs: {{until: [\"\\n\"], max_gen_toks: {max_gen_toks}, do_sample: false}}\n"
            "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n"
            "filter_list:\n"
            "  - name: strict\n    filter: [{function: regex, regex_pattern: \"#### (\\\\-?[0-9]+)\"},"
            " {function: take_first}]\n"
            "  - name: flexible\n    filter: [{function: regex, group_select: -1, "
            "regex_pattern: \"(-?[0-9]+)\"}, {function: take_first}]\n")


def write_task_files(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """Each task name's YAML text written to root/<name>.yaml; name -> path."""
    paths = {}
    for name, text in files.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(text)
    return paths


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    return _write_tasks(tmp_path_factory.mktemp("lm_tasks"))


def _qcfg(**kw) -> QualityConfig:
    return QualityConfig(**{"items_per_slice": 8, "batch_size": 8, **kw})


def test_structures_are_resolved_from_local_yamls(task_files, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    entries = [str(task_files[n]) for n in ("toy_group", "toy_filters", "toy_mc_a", "toy_missing")]
    qcfg = _qcfg(task_primary={"toy_filters": "exact_match,flexible"}, task_clusters={"toy_group": "doc_id"},
                 per_slice={"toy_mc_a": {"items": "all"}})
    named, skipped = lm_tasks.resolve(entries, qcfg, seed=0)
    by_name = {s.name: s for s in named}
    assert set(by_name) == {"toy_group", "toy_filters", "toy_mc_a"}
    # A task whose data cannot be loaded is skipped, one line saying so.
    assert list(skipped) == [str(task_files["toy_missing"])] and "not reachable" in skipped[entries[-1]]
    assert sum("skipping lm-eval task" in ln for ln in capsys.readouterr().err.splitlines()) == 1
    group = by_name["toy_group"]
    assert [leaf.name for leaf in group.leaves] == ["toy_mc_a", "toy_mc_b"]
    # 8 items of 12 clusters (a document and its twin in the other subtask, task_clusters doc_id):
    # fewer items than clusters, so one item per cluster (pipeline/quality/items.py: order_items).
    assert sum(len(leaf.doc_ids) for leaf in group.leaves) == group.n_max == 8
    assert len({d for leaf in group.leaves for d in leaf.doc_ids}) == 8
    assert all(leaf.metric == "acc_norm" for leaf in group.leaves)  # the task's own headline
    assert group.cluster_by == "doc_id"
    filt = by_name["toy_filters"].leaves[0]
    assert (filt.metric, filt.filter, filt.filters) == ("exact_match", "flexible", ["strict", "flexible"])
    mc = by_name["toy_mc_a"]
    assert mc.leaves[0].doc_ids == list(range(N_DOCS)) and mc.cluster_by == "premise"  # found in the docs
    # A tag is a name found in the local YAMLs' index (no lm-eval defaults needed): one slice.
    tag, _ = lm_tasks.resolve([str(task_files["toy_group"]), "toy_tag"], _qcfg())
    assert tag[1].name == "toy_tag" and [leaf.name for leaf in tag[1].leaves] == ["toy_filters"]
    assert tag[1].index == (False, (str(task_files["toy_group"].parent),))


def test_bad_primary_lists_what_exists(task_files):
    from pipeline.core.stage import StageError

    with pytest.raises(StageError, match=r"no filter 'loose' \(it has: strict, flexible\)"):
        lm_tasks.resolve([str(task_files["toy_filters"])], _qcfg(task_primary={"toy_filters": ",loose"}))
    with pytest.raises(StageError, match=r"no metric 'f1' \(it reports: acc, acc_norm\)"):
        lm_tasks.resolve([str(task_files["toy_mc_a"])], _qcfg(task_primary={"toy_mc_a": "f1"}))


def _sample(doc_id, filt, value, resp):
    return {"doc_id": doc_id, "filter": filt, "metrics": ["exact_match"], "exact_match": value,
            "filtered_resps": [resp], "target": "x", "doc": {"q": doc_id}}


def test_several_filters_give_one_record_per_document():
    """Two samples per document (one per filter) become one record: every filter is scored, the
    primary one is the record's score (lm-eval's logged samples, as simple_evaluate writes them)."""
    leaf = lm_tasks.Leaf("gsm_like", 3, "exact_match", "flexible", ["strict", "flexible"], [0, 1, 2])
    s = lm_tasks.NamedSlice("gsm_like", "gsm_like", [leaf], None)
    samples = {"gsm_like": [_sample(d, f, v, r) for d, f, v, r in [
        (0, "strict", 1.0, "4"), (0, "flexible", 1.0, "4"), (1, "strict", 0.0, "[invalid]"),
        (1, "flexible", 1.0, "7"), (2, "flexible", 0.0, "1"), (2, "strict", 0.0, "[invalid]")]]}
    recs = lm_tasks.records(s, samples)
    assert [r["id"] for r in recs] == ["gsm_like-00000", "gsm_like-00001", "gsm_like-00002"]
    assert [r["score"] for r in recs] == [1.0, 1.0, 0.0]
    assert recs[1]["scores"] == {"exact_match,strict": 0.0, "exact_match,flexible": 1.0}
    assert recs[1]["metric"] == "exact_match,flexible" and recs[1]["prediction"] == "7"
    assert recs[1]["predictions"] == {"strict": "[invalid]", "flexible": "7"}
    # A corpus-level metric (not a number per item) cannot be gated: said in one line.
    samples["gsm_like"][1]["exact_match"] = (1, 2)
    assert "not a per-item number" in lm_tasks.records(s, samples)


def test_tasks_run_through_the_quality_evaluator(task_files, tiny_model, tiny_tokenizer, monkeypatch):
    """The tiny model answers the group and the two-filter task in one lm-eval call (as the
    built-in slices are); each comes back as one slice with the structure above."""
    from pipeline.quality.evaluate import evaluate, summarize_slice

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    qcfg = _qcfg()
    named, skipped = lm_tasks.resolve([str(task_files["toy_group"]), str(task_files["toy_filters"])], qcfg)
    records, counters = evaluate(tiny_model, tiny_tokenizer, {}, named, qcfg, seed=0)
    assert not skipped and set(records) == {"toy_group", "toy_filters"}
    group = records["toy_group"]
    # 8 items asked of clusters of 6 (a story's 3 documents, the same in both subtasks: one
    # prompt, so one cluster): whole clusters while they fit, 6 items (waves.order_items).
    assert len(group) == 6 and len({r["id"] for r in group}) == 6
    assert {r["group"] for r in group} == {"toy_mc_a", "toy_mc_b"}
    assert all(r["metric"] == "acc_norm" and r["score"] == r["scores"]["acc_norm"] for r in group)
    assert set(group[0]["scores"]) == {"acc", "acc_norm"}
    # Documents of one subtask that share a premise (3k, 3k+1, 3k+2) share a cluster, others not.
    for a in group:
        for b in group:
            if a["group"] == b["group"]:
                same_story = int(a["id"][-5:]) // 3 == int(b["id"][-5:]) // 3
                assert (a["cluster"] == b["cluster"]) == same_story
    summary = summarize_slice(group, 0.95)
    assert set(summary["groups"]) == {"toy_mc_a", "toy_mc_b"} and summary["n"] == 6
    filt = records["toy_filters"]
    assert len(filt) == 6  # one record per document, not one per filter (two stories of 3)
    assert set(filt[0]["scores"]) == {"exact_match,strict", "exact_match,flexible"}
    assert all(r["metric"] == "exact_match,strict" for r in filt)  # the task's first filter
    assert counters["prompt_tokens"] > 0

"""pipeline.tools.bench_quality: arguments, the max_length rule, HFLM's probe memo, the request
clock, the score comparison and the ratio's orientation; and one whole run on a tiny random
Llama (both evaluators through lm-eval, scores compared). No timing is asserted."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.tools import bench_quality as bq


def test_parse_args_defaults_and_errors():
    a = bq.parse_args([])
    assert a.tasks == ["calibration", "tool_args"] and a.items == 16 and a.repeats == 3
    assert a.hflm_batch_size == "auto" and a.hflm_max_batch_size == 16 and a.max_length == "auto"
    a = bq.parse_args(["--items", "100", "--tasks", "reasoning, bfcl", "--max-length", "512"])
    assert a.hflm_max_batch_size == 64 and a.tasks == ["reasoning", "bfcl"] and a.max_length == 512
    assert bq.parse_args(["--hflm-max-batch-size", "8", "--hflm-batch-size", "4"]).hflm_max_batch_size == 8
    for bad in (["--tasks", "code"], ["--tasks", "nope"], ["--tasks", ","], ["--items", "0"],
                ["--repeats", "0"], ["--hflm-batch-size", "big"], ["--max-length", "x"],
                ["--hflm-max-batch-size", "0"], ["--batch-size", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            bq.parse_args(bad)


def test_max_length_rule(tiny_tokenizer):
    assert bq.auto_max_length([10, 120, 56]) == 128 and bq.auto_max_length([60]) == 128  # 8 to spare
    assert bq.auto_max_length([56]) == 64 and bq.auto_max_length([57]) == 128
    docs = [{"prompt": "the quick brown fox", "choices": ["dog", "lazy dog"]}]
    mc = bq.request_tokens(tiny_tokenizer, docs, {"output_type": "multiple_choice", "target_delimiter": " "})
    assert mc == [len(tiny_tokenizer.encode("the quick brown fox lazy dog")) + 1]
    gen = bq.request_tokens(tiny_tokenizer, docs, {"output_type": "generate_until",
                                                   "generation_kwargs": {"max_gen_toks": 40}})
    assert gen == [len(tiny_tokenizer.encode("the quick brown fox")) + 40]


class FakeLM:
    max_length = 300
    max_batch_size = 16

    def __init__(self):
        self.probed = []

    def _detect_batch_size(self, requests=None, pos=0):
        self.probed.append((None if requests is None else len(requests), pos))
        return 16

    def loglikelihood(self, requests):
        return [(0.0, True)] * len(requests)

    def loglikelihood_rolling(self, requests):
        return [0.0] * len(requests)

    def generate_until(self, requests):
        self._detect_batch_size()
        return ["x"] * len(requests)


def test_probe_memo_runs_each_probe_once():
    lm = FakeLM()
    memo = bq.ProbeMemo(lm)
    reqs = [(None, [1, 2, 3], [4]), (None, [1], [2])]
    assert lm._detect_batch_size(reqs, 0) == 16 and lm._detect_batch_size(reqs, 0) == 16
    assert lm._detect_batch_size() == 16 and lm._detect_batch_size() == 16
    assert lm.probed == [(2, 0), (None, 0)]  # the real probe ran once per distinct probe
    assert memo.reused == 2 and [p["probe_tokens"] for p in memo.probes] == [3, 300]
    assert memo.take_seconds() >= 0 and memo.take_seconds() == 0.0


def test_setup_seconds_reads_the_prefix_calibration():
    class LM:
        stats = {"calibration_seconds": 2.5}

    assert bq.setup_seconds(LM()) == 2.5 and bq.setup_seconds(object()) == 0.0
    LM.stats = {"prompt_tokens": 3}
    assert bq.setup_seconds(LM()) == 0.0


def test_request_clock_times_request_calls():
    lm = FakeLM()
    clock = bq.RequestClock(lm)
    assert lm.generate_until([1, 2, 3]) == ["x"] * 3
    lm.loglikelihood([1])
    assert [(n, k) for n, k, _ in clock.calls] == [("generate_until", 3), ("loglikelihood", 1)]
    assert clock.take() >= 0 and clock.take() == 0.0


def _res(score, pred, lls=None):
    return {"score": score, "scores": {"acc": score}, "prediction": pred, "lls": lls}


def test_compare_scores():
    a = {"i0": _res(1.0, "dog", [-1.0, -2.0]), "i1": _res(0.0, "cat", [-3.0, -1.0])}
    same = bq.compare_scores(a, {"i0": _res(1.0, "dog", [-1.0, -2.00001]), "i1": _res(0.0, "cat", [-3.0, -1.0])})
    assert same["identical_scores"] and same["scores_differ"] == 0 and same["predictions_differ"] == 0
    assert same["max_abs_logprob_diff"] == pytest.approx(1e-5)
    diff = bq.compare_scores(a, {"i0": _res(0.0, "cow", [-1.0, -2.0]), "i1": _res(0.0, "cat", [-3.0, -1.0])})
    assert not diff["identical_scores"] and diff["scores_differ"] == 1 and diff["differing_items"] == ["i0"]
    gen = bq.compare_scores({"g": _res(1.0, "a")}, {"g": _res(1.0, "b")})
    assert gen["identical_scores"] and gen["predictions_differ"] == 1 and gen["max_abs_logprob_diff"] is None
    with pytest.raises(ValueError):
        bq.compare_scores(a, {"i0": a["i0"]})


def test_task_row_ratio_is_hflm_over_prefix():
    row = bq.task_row("calibration", "loglikelihood", 10, {"prefix": [1.0, 2.0], "hflm": [3.0, 6.0]},
                      {"identical_scores": True}, 0.95)
    assert row["ratio"] == pytest.approx(3.0) and row["goal"] == bq.GOAL
    assert row["prefix_items_per_s"] == pytest.approx(10 / 1.5) and row["hflm_items_per_s"] == pytest.approx(10 / 4.5)


def test_main_on_a_tiny_model(tmp_path, tiny_model_dir, capsys):
    from conftest import REPO

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "model")
    rc = bq.main(["--run", str(run), "--config", str(REPO / "configs/smoke.yaml"), "--model", "tiny",
                  "--items", "3", "--repeats", "2", "--hflm-max-batch-size", "2"])
    doc = json.loads((run / "bench_quality.json").read_text())
    assert rc == 0 and doc["scores_identical"], [r["agreement"] for r in doc["rows"]]
    calib, tool = doc["rows"]
    assert (calib["task"], calib["kind"], tool["task"], tool["kind"]) == \
        ("calibration", "loglikelihood", "tool_args", "generate_until")
    assert calib["agreement"]["items"] == 3 and calib["agreement"]["max_abs_logprob_diff"] < 1e-3
    assert len(calib["ratios"]) == 2 and tool["agreement"]["max_abs_logprob_diff"] is None
    # each distinct probe ran once (the loglikelihood one, the generation one); later calls reused it
    assert len(doc["hflm"]["probes"]) == 2 and doc["hflm"]["probes_reused"] == 2
    assert all(p["batch_size"] <= 2 for p in doc["hflm"]["probes"])
    assert (run / "bench_quality" / "data" / "calibration.jsonl").read_text().count("\n") == 3
    assert calib["prefix_setup_s"] >= 0 and calib["hflm_probe_s"] > 0
    assert "calibration" in capsys.readouterr().out

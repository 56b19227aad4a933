"""pipeline.tools.bench and pipeline.tools.paired_ratio:
the logic around the timings (paired ratios and their intervals, the goal reading, token equality,
arguments), and both sides' greedy tokens on a tiny random Llama, both eager. No timing
is asserted."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from pipeline.tools import bench
from pipeline.tools.paired_ratio import (format_ci, goal_status, paired_ratios, ratio_summary, run_order,
                                         token_check)

# ---------------------------------------------------------------- paired ratios


def test_paired_ratios_are_baseline_over_candidate():
    assert paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        paired_ratios([], [])
    with pytest.raises(ValueError):
        paired_ratios([1.0, 0.0], [1.0, 1.0])


def test_ratio_summary_geometric_mean_and_t_interval_on_logs():
    base, cand = [2.0, 4.0, 3.0], [1.0, 1.0, 2.0]  # ratios 2, 4, 1.5
    s = ratio_summary(base, cand, goal=1.5, confidence=0.95)
    logs = np.log([2.0, 4.0, 1.5])
    assert s["ratios"] == [2.0, 4.0, 1.5]
    assert s["ratio"] == pytest.approx(math.exp(logs.mean()))
    from scipy import stats

    half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
    assert s["ci"] == pytest.approx([math.exp(logs.mean() - half), math.exp(logs.mean() + half)])
    assert s["median"] == 2.0 and s["range"] == [1.5, 4.0] and s["repeats"] == 3
    lo, hi = s["bootstrap_ci"]
    assert 1.5 <= lo <= s["ratio"] <= hi <= 4.0  # a mean of resampled repeats stays in their range
    assert "repeat" in s["unit"]
    assert s["goal_status"] == goal_status(s["ratio"], s["ci"], 1.5)


def test_ratio_summary_equal_ratios_and_one_repeat():
    s = ratio_summary([3.0, 6.0], [1.5, 3.0], goal=1.5)
    assert s["ratio"] == pytest.approx(2.0)
    assert s["ci"] == pytest.approx([2.0, 2.0]) and s["bootstrap_ci"] == pytest.approx([2.0, 2.0])
    assert s["goal_status"] == "met"
    one = ratio_summary([3.0], [1.0], goal=1.5)
    assert one["ci"] is None and one["bootstrap_ci"] is None
    assert one["goal_status"].startswith("met (one repeat")
    assert ratio_summary([1.0], [1.0], goal=1.5)["goal_status"].startswith("not met (one repeat")
    assert format_ci(None) == "[  n/a  ]" and format_ci([1.234, 2.0]) == "[1.23, 2.00]"


def test_goal_status_reads_the_interval():
    assert goal_status(1.6, [1.5, 1.7], 1.5) == "met"
    assert goal_status(1.3, [1.2, 1.49], 1.5) == "not met"
    assert goal_status(1.6, [1.4, 1.8], 1.5) == "inconclusive"
    assert goal_status(1.4, [1.3, 1.6], 1.5) == "inconclusive"


def test_run_order_alternates():
    assert run_order(0, ("engine", "transformers")) == ("engine", "transformers")
    assert run_order(1, ("engine", "transformers")) == ("transformers", "engine")
    assert run_order(2, ("a", "b")) == ("a", "b")


def test_token_check():
    assert token_check([1, 2, 3], [1, 2, 3]) == {"identical": True, "first_mismatch": None, "lengths": [3, 3]}
    assert token_check([1, 2, 3], [1, 5, 3])["first_mismatch"] == 1
    short = token_check([1, 2], [1, 2, 3])
    assert not short["identical"] and short["first_mismatch"] == 2


# ---------------------------------------------------------------- plans and arguments


def test_hf_generation_config(tiny_model):
    gc = bench.hf_generation_config(tiny_model, 7)
    assert gc.cache_implementation == "static" and gc.max_new_tokens == 7 and gc.eos_token_id is None
    assert not gc.do_sample and gc.disable_compile  # eager: transformers compiles a static-cache generate on CUDA
    assert gc is not tiny_model.generation_config and not tiny_model.generation_config.disable_compile


def test_parse_args_and_pick_draft():
    a = bench.parse_args([])
    assert (a.k, a.new_tokens, a.repeats, a.warmup, a.profile, a.threads) == (3, 32, 5, 0, True, None)
    assert bench.parse_args(["--threads", "1"]).threads == 1
    a = bench.parse_args(["--repeats", "2", "--no-profile", "--k", "4"])
    assert (a.repeats, a.profile, a.k) == (2, False, 4)
    for bad in (["--k", "0"], ["--new-tokens", "1"], ["--repeats", "0"], ["--confidence", "1.5"],
                ["--threads", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert bench.pick_draft(["ngram", "layerskip:6", "layerskip:4"]) == ("layerskip:6", 6)
    assert bench.pick_draft(["ngram"]) == ("layerskip:8", 8)
    with pytest.raises(SystemExit):
        bench.pick_draft(["layerskip:x"])


# ---------------------------------------------------------------- the two sides, tiny model


def test_forward_clock_counts_and_restores(tiny_model):
    ids = torch.tensor([[1, 2, 3]])
    with bench.forward_clock({"target": tiny_model}) as stats:
        with torch.inference_mode():
            tiny_model(ids)
            tiny_model(ids)
    assert stats["target"]["calls"] == 2 and stats["target"]["seconds"] > 0
    assert "forward" not in tiny_model.__dict__  # the class's forward is back


def test_both_sides_give_the_same_greedy_tokens(tiny_model, tiny_tokenizer):
    from torch._dynamo.utils import counters

    from draft_models.registry import build_draft
    from pipeline.decode.engine import generate

    device = torch.device("cpu")
    ids = torch.tensor([tiny_tokenizer.encode("the quick brown fox")])
    n, k = 10, 2
    graphs = int(counters["stats"]["unique_graphs"])
    gc = bench.hf_generation_config(tiny_model, n)
    rec = {}
    first = bench.clocked(lambda: bench.hf_generate(tiny_model, ids, gc, record=rec), {"target": tiny_model}, device)
    assert rec["cache"] == "StaticCache" and first["total_s"] > 0 and first["forwards"]["target"]["calls"] == n
    plain = generate(tiny_model, ids, n, cache_len=ids.shape[1] + n + 1).tokens
    assert token_check(plain, bench.hf_generate(tiny_model, ids, gc))["identical"]

    draft = build_draft("layerskip:2", tiny_model, tiny_tokenizer, None, device)
    assistant = bench.truncated_copy(tiny_model, 2, k)
    assert assistant.generation_config.num_assistant_tokens == k
    first = bench.clocked(lambda: bench.hf_generate(tiny_model, ids, gc, assistant, rec),
                          {"target": tiny_model, "assistant": assistant}, device)
    assert rec["cache"] == "StaticCache" and first["forwards"]["assistant"]["caches"] == ["DynamicCache"]
    spec = generate(tiny_model, ids, n, draft=draft, k=k, cache_len=ids.shape[1] + n + 1).tokens
    assert spec == plain
    assert token_check(spec, bench.hf_generate(tiny_model, ids, gc, assistant))["identical"]
    assert "forward" not in tiny_model.__dict__ and "forward" not in assistant.__dict__
    assert int(counters["stats"]["unique_graphs"]) == graphs  # both sides eager: dynamo made no graph


def test_main_writes_bench_json(tmp_path, tiny_model_dir, capsys):
    from conftest import REPO

    threads = torch.get_num_threads()
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "model")
    rc = bench.main(["--run", str(run), "--config", str(REPO / "configs/smoke.yaml"), "--model", "tiny",
                     "--drafts", "layerskip:2", "--k", "2", "--new-tokens", "4", "--repeats", "2", "--warmup", "0",
                     "--threads", "1"])
    assert rc == 0
    doc = json.loads((run / "bench.json").read_text())
    assert doc["threads"] == 1 and torch.get_num_threads() == threads  # set for the run, then restored
    plain, spec = doc["rows"]
    assert doc["tokens_identical"] and plain["identical_tokens"] and spec["identical_to_plain"]
    assert "disable_compile=True" in doc["baseline"]["plain"]
    assert len(plain["ratios"]) == 2 and plain["goal"] == 1.2 and spec["goal"] == 1.5
    assert plain["transformers"]["cache"] == "StaticCache" and spec["transformers"]["assistant_cache"] == "DynamicCache"
    assert set(plain["profile"]) == {"engine", "transformers"}
    assert "identical" in capsys.readouterr().out

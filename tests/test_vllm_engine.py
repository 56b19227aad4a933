"""Speculation measured in real vLLM (the .venv-vllm `make install` builds), CI-sized: the embedded
model as target, prompt lookup and the GPTQ self-draft at k = 1..2 (configs/vllm-smoke.yaml), the
engine's own counters against the per-request counts, the marginal report from vLLM's figures
beside specq's derivation, a stage interrupted mid-run, vLLM's prompt-lookup rule against specq's,
an EAGLE-3 head's plumbing on a tiny target, and the quality slices scored through vLLM (records
the shape hf writes; hf and vLLM agree on the same items up to near-ties). Skipped only where the vLLM environment is absent."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.__main__ import main
from pipeline.vllm.env import unavailable, vllm_python

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs/vllm-smoke.yaml")
WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"vLLM environment: {WHY}")

def _interruptible() -> None:
    """In the child: Ctrl-C as a terminal sends it, even when the tests run in the background (a
    shell starts background jobs with SIGINT ignored, and the child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)



@pytest.fixture(scope="module")
def served_run(embedded_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm") / "run"
    shutil.copytree(embedded_model_dir, run / "model")
    argv = ["--run", str(run), "--config", CONFIG, "--model", "smollm2-135m"]
    for stage in ("prepare", "quantize", "drafts", "acceptance", "vllm", "latency", "marginal"):
        assert main([stage, *argv]) == 0, stage
    return run


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_pairs_measured_in_vllm(served_run):
    meta = _json(served_run / "vllm" / "meta.json")
    assert meta["engine"] == "vllm" and meta["vllm"]["vllm"]
    assert set(meta["measured"]) == {"bf16__ngram", "bf16__self-w4a16-gptq"}
    assert "no layer-skip" in meta["skipped"]["bf16__layerskip-4"]
    plain = _json(served_run / "vllm" / "bf16.json")
    for name in meta["measured"]:
        doc = _json(served_run / "vllm" / f"{name}.json")
        assert sorted(doc["by_k"]) == ["1", "2"]
        for k, run in doc["by_k"].items():
            k = int(k)
            assert run["speculative_config"]["num_speculative_tokens"] == k
            block = run["summary"]["all"]["0.0"]
            assert len(block["per_position"]) == k and 1.0 <= block["expected_tokens_per_step"] <= k + 1
            lo, hi = block["expected_tokens_per_step_ci"]
            assert lo <= block["expected_tokens_per_step"] <= hi
            # The per-request counts add up to the engine's own /metrics counters over the same requests.
            recs = run["b1"]["0.0"]
            counters = run["counters"]["b1 T=0.0"]
            assert counters["num_drafts"] == sum(r["drafts"] for r in recs)
            assert counters["accepted_per_pos"][:k] == [sum(r["accepted_per_pos"][i] for r in recs) for i in range(k)]
            assert all(r["steps_from"] == "stream" for r in recs)
            # Greedy speculative output equals plain greedy output, up to bf16 near-ties.
            assert run["lossless"]["greedy"]["greedy_lossless"] is True, run["lossless"]["greedy"]
            lat = run["latency"]["0.0"]
            assert lat["tpot_ms"]["p50"] > 0 and lat["itl_ms"]["p99"] >= lat["itl_ms"]["p50"]
            assert run["closed_loop"]["2"]["0.0"]["output_tokens_per_s"] > 0
        assert "p_value" in doc["by_k"]["2"]["lossless"]["sampled"]
        rec = doc["recommendation"]
        assert rec["recommended_k"] in (0, 1, 2) and set(rec["recommended_k_by_batch"]) == {"1", "2"}
        if rec["speculative_config"]:
            assert rec["serve_command"].startswith("vllm serve ") and "--speculative-config" in rec["serve_command"]
            # The emitted config was handed to vLLM as written, and it started.
            assert doc["validation"]["configs"]["recommended"]["started"] is True
            assert doc["validation"]["configs"]["recommended"]["speculative_config"] == rec["speculative_config"]
            # Its own B = 1 speedup, measured again on that engine, beside the report's interval; a
            # schedule that drafts nothing at B = 1 (k = 0 there, k > 0 at B = 2) has none to check.
            if rec["recommended_k"] == 0:
                assert "b1_check" not in doc["validation"]
            else:
                check = doc["validation"]["b1_check"]
                assert check["k"] == rec["recommended_k"] and check["measured_speedup"] > 0
                assert check["within_report_ci"] == (check["report_ci"][0] <= check["measured_speedup"]
                                                     <= check["report_ci"][1])
        else:
            assert rec["serve_command"] == f"vllm serve {doc['target_dir']}"
    assert plain["measure"]["b1"]["0.0"] and plain["capacity_rps"] > 0


def test_marginal_reports_vllm_pairs_beside_the_derivation(served_run):
    meta = _json(served_run / "marginal" / "meta.json")
    assert meta["engine"] == {"bf16__ngram": "vllm", "bf16__self-w4a16-gptq": "vllm", "bf16__layerskip-4": "specq"}
    for name in ("bf16__ngram", "bf16__self-w4a16-gptq"):
        m = _json(served_run / "marginal" / f"{name}.json")
        assert m["engine"] == "vllm" and m["baseline_ms_per_token"] > 0 and m["recommended_k"] in (0, 1, 2)
        assert [r["k"] for r in m["rows"]] == [1, 2]
        for r in m["rows"]:
            assert {"tokens_per_round", "round_ms", "ms_per_token", "speedup", "marginal_ms_per_token"} <= set(r)
        derived = m["derived_vs_engine"]["0.0"]
        assert set(derived) == {"1", "2"}
        for c in derived.values():
            assert c["prompts"] == 8 and c["difference_ci"] is not None
        page = (served_run / "marginal" / f"{name}.md").read_text()
        assert "Derived (specq, teacher-forced) vs measured in vLLM" in page and "Lossless in vLLM" in page
    # The pairs vLLM measured are not timed again by specq's engine; layer-skip is.
    lat = _json(served_run / "latency" / "meta.json")
    assert "bf16__ngram" in lat["measured_in_vllm"]
    assert not (served_run / "latency" / "bf16__ngram.json").exists()
    assert (served_run / "latency" / "bf16__layerskip-4.json").exists()


def _engines_of(run: Path) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "api_server" in cmd and str(run) in cmd:
                out.append(int(proc.name))
    return out


def test_interrupted_stage_leaves_no_engine_and_no_half_artifact(served_run):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline", "vllm", "--run", str(served_run), "--config", CONFIG,
           "--drafts", "ngram:2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "engine up" in line:
            break
    assert _engines_of(served_run), "".join(seen)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    deadline = time.time() + 15
    while _engines_of(served_run) and time.time() < deadline:
        time.sleep(0.5)
    assert _engines_of(served_run) == []
    assert not (served_run / "vllm" / "bf16__ngram-2.json").exists()
    assert not (served_run / "vllm" / "meta.json").exists()  # the stage did not finish: it will re-run
    assert not list((served_run / "vllm").rglob("*.tmp"))


def test_a_budget_stops_the_stage_engine_by_engine_and_a_rerun_resumes(served_run, tmp_path):
    """With no time left the stage still runs its first engine (nothing measured yet to plan from),
    then skips what its measured engine cost does not fit, keeping each pair's k = 1; the skips are
    in meta.json and the pair files say which k they lack."""
    run = tmp_path / "run"
    shutil.copytree(served_run, run, ignore=shutil.ignore_patterns("logs"))
    for part in (run / "vllm" / "parts").glob("*.k2.json"):
        part.unlink()
    config = tmp_path / "budget.yaml"
    config.write_text(Path(CONFIG).read_text().replace("budget:\n  minutes: null", "budget:\n  minutes: 0.01"))
    argv = ["--run", str(run), "--config", str(config), "--model", "smollm2-135m"]
    assert main(["vllm", *argv]) == 0
    meta = _json(run / "vllm" / "meta.json")
    assert len(meta["engines"]) == 1 and meta["budget"]["seconds_from"] == "ledger"
    assert any("at k = 2" in s["what"] for s in meta["budget"]["skipped"]), meta["budget"]
    ks = {name: _json(run / "vllm" / f"{name}.json")["k_values"] for name in meta["measured"]}
    assert sorted(ks.values()) == [[1], [1, 2]], ks
    short = next(n for n, k in ks.items() if k == [1])
    doc = _json(run / "vllm" / f"{short}.json")
    assert doc["k_not_measured"] == [2] and doc.get("validation_skipped") in (None, "budget")
    assert doc["recommendation"]["recommended_k"] in (0, 1)


def test_quality_scored_through_vllm_agrees_with_hf(served_run, tmp_path):
    """quality.backend vllm on the embedded model and its GPTQ variant (both served here), then
    the reference scored by hf and by vLLM on the same items: the same record shape, every
    calibration choice the same, no generation that differs beyond a near-tie."""
    import yaml

    from pipeline.core.config import load_config
    from pipeline.tools.quality_equivalence import measure, render

    small = {"slices": ["reasoning", "calibration"], "items_per_slice": 6, "wave_items": 6, "max_new_tokens": 16,
             "batch_size": 6}
    cfg = yaml.safe_load(Path(CONFIG).read_text())
    cfg["quality"] = {**small, "backend": "vllm"}
    path = tmp_path / "quality-vllm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["quality", "--run", str(served_run), "--config", str(path)]) == 0
    meta = _json(served_run / "quality" / "meta.json")
    assert {n: b["backend"] for n, b in meta["backends"].items()} == {"bf16": "vllm", "w4a16-gptq": "vllm"}
    assert not list((served_run / "quality").glob("*/requests-*.db"))
    served = [json.loads(x) for x in (served_run / "quality" / "bf16" / "reasoning.jsonl").read_text().splitlines()]
    assert len(served) == 6

    report = measure(served_run, load_config(path), items=6)
    print(render(report))
    assert _json(served_run / "quality-equivalence" / "report.json") == report and report["same_prompts"]
    slices = report["slices"]
    assert slices["calibration"]["same_choice"] == 6, slices["calibration"]
    assert slices["reasoning"]["diverged"] == 0, slices["reasoning"]
    assert report["equivalent"]
    # The stage's vLLM records have the keys hf's records have.
    records = _json(served_run / "quality-equivalence" / "records.json")
    assert set(served[0]) == set(records["hf"]["reasoning"][0]) == set(records["vllm"]["reasoning"][0])


def test_specq_prompt_lookup_follows_vllms_rule(tmp_path):
    """vLLM's own proposer (run in its venv) and specq's NgramDraft on the same random sequences."""
    from pipeline.decode.drafts import NgramDraft

    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(2, 40))).tolist() for _ in range(300)]
    script = (
        "import json, sys, numpy as np\n"
        "from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f\n"
        "seqs = json.load(sys.stdin)\n"
        "print(json.dumps([f(np.array(s, dtype=np.int32), 1, 3, 4096, 4).tolist() for s in seqs]))\n")
    out = subprocess.run([str(vllm_python()), "-c", script], input=json.dumps(seqs), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    d = NgramDraft("ngram", max_n=3)
    ours = [d.lookup(np.array(s), 4).tolist() for s in seqs]
    assert ours == theirs


def _tiny_target_and_head(root: Path, tokenizer) -> tuple[Path, Path]:
    """A tiny random Llama (head_dim 64) and a random EAGLE-3 head in vLLM's LlamaForCausalLMEagle3
    layout (one midlayer reading [embedding, hidden], fc over 3 target layers' hidden states)."""
    import torch
    from safetensors.torch import save_file

    from conftest import make_tiny_llama

    target = root / "target"
    # 8 layers: the target's default auxiliary layers for EAGLE-3, (2, L // 2, L - 3), are three
    # distinct ones (with 4 they collapse to two, and fc's 3 x hidden input does not match).
    model = make_tiny_llama(tokenizer, layers=8, hidden=256)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    h, v, heads, kv, d = 256, len(tokenizer), 4, 2, 64
    head = root / "eagle3"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": 2 * h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "num_hidden_layers": 1, "vocab_size": v, "draft_vocab_size": v, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)
    weights = {"midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
               "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.o_proj.weight": w(h, heads * d),
               "midlayer.mlp.gate_proj.weight": w(2 * h, h), "midlayer.mlp.up_proj.weight": w(2 * h, h),
               "midlayer.mlp.down_proj.weight": w(h, 2 * h),
               "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               "fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(v, h)}
    save_file(weights, str(head / "model.safetensors"))
    return target, head


def test_eagle3_head_plumbing(tmp_path, tiny_tokenizer):
    from transformers import AutoConfig

    from draft_models import eagle3
    from pipeline.latency.served import Settings, serve
    from pipeline.vllm.client import complete
    from pipeline.vllm.spec_config import speculative_config

    target, head = _tiny_target_and_head(tmp_path, tiny_tokenizer)
    spec = f"eagle3:{head}"
    assert eagle3.check(spec, AutoConfig.from_pretrained(target))["runs_in"] == "vllm"
    config = speculative_config(spec, 2, None)
    assert config == {"method": "eagle3", "model": str(head.resolve()), "num_speculative_tokens": 2}
    s = Settings(platform="cpu", dtype="bfloat16", max_model_len=512, seed=0, enforce_eager=True, max_num_seqs=4,
                 max_new_tokens=12, temperatures=[0.0], kv_cache_gib=1)
    # The target directory is not a specq variant: serve() reads its quantization from config.json.
    (target / "meta.json").write_text(json.dumps({"scheme": "none"}))
    with serve(s, target, config, tmp_path / "eagle3.log", "eagle3") as srv:
        c = complete(srv.url, {"prompt": [1, 5, 9, 14, 22], "max_tokens": 12, "temperature": 0.0})
    assert sum(len(ids) for ids in c.step_ids) == 12
    assert c.spec is not None and c.spec["num_spec_steps"] >= 1 and c.spec["num_spec_tokens"] == 2

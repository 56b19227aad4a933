"""`quality.backend: vllm` (issue 25) without vLLM: vLLM is not installed on the machines these tests
run on, and never ran here. What is tested: the config keys and their one-line errors; the
refusal where vLLM is not importable (one stderr line, exit 2, no run folder); the lm-eval VLLM
arguments built from each kind of variant directory (pipeline/quality/vllm_backend.py:
vllm_args); the fallback decision (choose); that what scores a variant is in its lines' hash
(quality/waves.py: item_inputs); and the stage's wiring, with an lm-eval HFLM standing in for
the engine: the same records, and meta.json saying what scored each model.

    .venv/bin/python -m pytest -q tests/test_quality_vllm.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.__main__ import main
from pipeline.core.config import ConfigError, load_config
from pipeline.core.quality_config import VllmConfig
from pipeline.core.stage import StageContext, StageError
from pipeline.quality import vllm_backend
from pipeline.quality.vllm_backend import Choice, choose, vllm_args

REPO = Path(__file__).resolve().parent.parent


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines and lines[-1].startswith("specq: "), err[-3000:]
    assert sum(line.startswith("specq: ") for line in lines) == 1, lines
    return lines[-1]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("vllm, where", [
    ({"tensor_parallel_size": 0}, "quality.vllm.tensor_parallel_size"),
    ({"gpu_memory_utilization": 0}, "quality.vllm.gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "quality.vllm.gpu_memory_utilization"),
    ({"max_model_len": 0}, "quality.vllm.max_model_len"),
    ({"engine_args": {"quantization": "gptq"}}, "quality.vllm.engine_args"),
    ({"keep_reference": True}, "quality.vllm"),
    ({"fallback": "maybe"}, "quality.vllm.fallback"),
    ({"tensor_parallel": 2}, "quality.vllm.tensor_parallel"),
])
def test_bad_vllm_settings_are_one_line(tmp_path, capsys, vllm, where):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"quality": {"backend": "vllm", "vllm": vllm}}))
    with pytest.raises(ConfigError, match=f"'{where}'"):
        load_config(cfg)
    assert main(["config", "--config", str(cfg)]) == 2
    assert f"'{where}'" in _one_line(capsys)


def test_vllm_settings_defaults_and_good_values(tmp_path):
    cfg = load_config(REPO / "configs/default.yaml")
    assert cfg.quality.backend == "hf"
    assert cfg.quality.vllm == VllmConfig(tensor_parallel_size=1, gpu_memory_utilization=0.9, max_model_len=None,
                                          dtype="auto", fallback="hf", keep_reference=False, distribution=False)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"quality": {"backend": "vllm", "vllm": {
        "tensor_parallel_size": 4, "gpu_memory_utilization": 0.45, "keep_reference": True, "max_model_len": 32768,
        "dtype": "bfloat16", "engine_args": {"enforce_eager": True, "kv_cache_dtype": "fp8"}}}}))
    v = load_config(path).quality.vllm
    assert (v.tensor_parallel_size, v.gpu_memory_utilization, v.max_model_len) == (4, 0.45, 32768)
    assert v.engine_args == {"enforce_eager": True, "kv_cache_dtype": "fp8"}


# ---------------------------------------------------------------- the refusal where vLLM is missing


def test_backend_vllm_without_vllm_is_refused_before_any_work(tmp_path):
    """`prepare` (the first stage of make evaluate) refuses `backend: vllm` where the vLLM
    environment is missing (SPECQ_VLLM_PYTHON names no python): one stderr line, exit 2, no run folder. `config` still prints the config (the
    schema is the same on every machine; the GPU box that has vLLM reads the same file)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"quality": {"backend": "vllm", "vllm": {"tensor_parallel_size": 2}}}))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECQ_VLLM_PYTHON": str(tmp_path / "no-venv" / "python")}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--run", str(run), "--config", str(cfg),
                           "--model", str(tmp_path / "nope")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("specq: quality.backend vllm: the vLLM environment is not installed"), lines
    assert not run.exists()
    shown = subprocess.run([sys.executable, "-m", "pipeline", "config", "--config", str(cfg)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and json.loads(shown.stdout)["quality"]["vllm"]["tensor_parallel_size"] == 2


def test_quality_precheck_refusals(tmp_path, monkeypatch):
    from pipeline.stages.quality import precheck

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"quality": {"backend": "vllm", "slices": ["reasoning"]}}))
    monkeypatch.setenv("SPECQ_VLLM_PYTHON", str(tmp_path / "no-venv" / "python"))
    with pytest.raises(StageError, match="^quality.backend vllm: the vLLM environment is not installed"):
        precheck(load_config(cfg), {})
    precheck(load_config(cfg, {"quality": {"backend": "hf", "slices": ["reasoning"]}}), {})  # hf: nothing to check
    # Where vLLM is importable: drift thresholds need quality.vllm.distribution; fallback: stop
    # refuses a variant the config already shows vLLM cannot load.
    monkeypatch.setattr(vllm_backend, "unavailable", lambda: None)
    monkeypatch.setattr(vllm_backend, "platform", lambda: "cuda")
    precheck(load_config(cfg), {})
    with pytest.raises(StageError, match="gate.max_kl needs the distribution drift"):
        precheck(load_config(cfg, {"gate": {"max_kl": 0.1}}), {})
    precheck(load_config(cfg, {"gate": {"max_kl": 0.1}, "quality": {
        "backend": "vllm", "slices": ["reasoning"], "vllm": {"distribution": True}}}), {})
    stop = {"backend": "vllm", "slices": ["reasoning"], "vllm": {"fallback": "stop"}}
    with pytest.raises(StageError, match="vLLM cannot load variant 'w8a16': scheme torchao-int8wo"):
        precheck(load_config(cfg, {"quality": stop, "quantize": {"variants": {
            "bf16": {"scheme": "none", "release": False}, "w8a16": {"scheme": "torchao-int8wo", "bits": 8}}}}), {})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mystery-quant"}}))
    variants = {"ref": {"scheme": "none"}, "ck": {"scheme": "checkpoint", "path": str(ckpt)}}
    with pytest.raises(StageError, match="variant 'ck': quantization method 'mystery-quant' is not one vLLM reads"):
        precheck(load_config(cfg, {"quality": stop, "quantize": {"reference": "ref", "variants": variants}}), {})
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    precheck(load_config(cfg, {"quality": stop, "quantize": {"reference": "ref", "variants": variants}}), {})
    # vLLM's CPU build: bitsandbytes and fp8 are not run there, said before any work.
    monkeypatch.setattr(vllm_backend, "platform", lambda: "cpu")
    with pytest.raises(StageError, match="variant 'ck': vLLM's CPU backend does not run 'fp8'"):
        precheck(load_config(cfg, {"quality": stop, "quantize": {"reference": "ref", "variants": variants}}), {})
    nf4 = {"ref": {"scheme": "none"}, "nf4": {"scheme": "bnb-nf4"}}
    with pytest.raises(StageError, match="variant 'nf4': vLLM's CPU backend does not run 'bitsandbytes'"):
        precheck(load_config(cfg, {"quality": stop, "quantize": {"reference": "ref", "variants": nf4}}), {})


# ---------------------------------------------------------------- the argument builder


def _dir(root: Path, name: str, scheme: str, quantization: dict | None = None, weights: str = "model.safetensors",
         extra: dict | None = None) -> Path:
    """A variant directory as far as vllm_args reads it: meta.json, config.json, a weight file."""
    d = root / name
    d.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (d / "config.json").write_text(json.dumps(config))
    (d / "meta.json").write_text(json.dumps({"variant": name, "scheme": scheme, **(extra or {})}))
    (d / weights).write_bytes(b"\0" * 16)
    return d


BASE = {"dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "seed": 7, "batch_size": 32}


def test_vllm_args_for_each_kind_of_variant(tmp_path):
    v = VllmConfig()
    cases = {  # name: (scheme, quantization_config, what vLLM must be told beyond BASE)
        "ref": ("reference", None, {}),
        "bf16": ("none", None, {}),
        # GPTQModel's layout: vLLM reads it from config.json (and picks gptq_marlin itself).
        "w4": ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                        "checkpoint_format": "gptq"}, {}),
        "int8": ("bnb-int8", {"quant_method": "bitsandbytes", "load_in_8bit": True}, vllm_backend.BITSANDBYTES),
        "nf4": ("bnb-nf4", {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                vllm_backend.BITSANDBYTES),
        "ck-plain": ("checkpoint", None, {}),
        "ck-fp8": ("checkpoint", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}, {}),
        "ck-ct": ("checkpoint", {"quant_method": "compressed-tensors", "format": "pack-quantized"}, {}),
        "ck-awq": ("checkpoint", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, {}),
        # transformers writes no quant_method for an old bitsandbytes config; the flags say it.
        "ck-bnb-old": ("checkpoint", {"load_in_4bit": True}, vllm_backend.BITSANDBYTES),
    }
    for name, (scheme, q, told) in cases.items():
        d = _dir(tmp_path, name, scheme, q)
        args = vllm_args(d, json.loads((d / "meta.json").read_text()), v, seed=7)
        assert args == {"pretrained": str(d), "tokenizer": str(d), **BASE, **told}, name
    # An auto-gptq directory: its quantize_config.json, no quantization_config in config.json.
    d = _dir(tmp_path, "autogptq", "checkpoint")
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    assert vllm_args(d, {"scheme": "checkpoint"}, v, seed=7) == {"pretrained": str(d), "tokenizer": str(d), **BASE}
    # The config's settings, and engine_args passed as written.
    v2 = VllmConfig(tensor_parallel_size=8, gpu_memory_utilization=0.8, max_model_len=32768, dtype="float16",
                    engine_args={"enforce_eager": True, "max_num_seqs": 64})
    d = tmp_path / "nf4"
    assert vllm_args(d, {"scheme": "bnb-nf4"}, v2, seed=0) == {
        "pretrained": str(d), "tokenizer": str(d), "dtype": "float16", "tensor_parallel_size": 8,
        "gpu_memory_utilization": 0.8, "seed": 0, "batch_size": 32, "max_model_len": 32768,
        **vllm_backend.BITSANDBYTES, "enforce_eager": True, "max_num_seqs": 64}


def test_vllm_args_refuse_what_vllm_does_not_load(tmp_path):
    v = VllmConfig()
    torchao = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}}
    cases = {
        "w8a16": ("torchao-int8wo", torchao, "scheme torchao-int8wo"),
        "ck-torchao": ("checkpoint", torchao, "torchao tensors saved by transformers"),
        "ck-mystery": ("checkpoint", {"quant_method": "mystery-quant", "bits": 3},
                       "quantization method 'mystery-quant' is not one vLLM reads"),
        "ck-quanto": ("checkpoint", {"quant_method": "quanto", "weights": "int8"},
                      "quantization method 'quanto' is not one vLLM reads"),
    }
    for name, (scheme, q, why) in cases.items():
        d = _dir(tmp_path, name, scheme, q)
        got = vllm_args(d, json.loads((d / "meta.json").read_text()), v, seed=0)
        assert isinstance(got, str) and why in got and "\n" not in got, (name, got)
    d = _dir(tmp_path, "gguf", "checkpoint", weights="model-Q4_K_M.gguf")
    assert "GGUF" in vllm_args(d, {"scheme": "checkpoint"}, v, seed=0)
    # What vLLM lists is what it reads: with the installed vLLM's list, a method missing from it is refused.
    # vLLM's CPU build runs GPTQ and AWQ, not bitsandbytes or fp8.
    nf4 = _dir(tmp_path, "nf4-cpu", "bnb-nf4", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert "CPU backend does not run 'bitsandbytes'" in vllm_args(nf4, {"scheme": "bnb-nf4"}, v, 0, platform="cpu")
    gptq = _dir(tmp_path, "gptq-cpu", "gptq", {"quant_method": "gptq", "bits": 4, "group_size": 64})
    assert isinstance(vllm_args(gptq, {"scheme": "gptq"}, v, 0, platform="cpu"), dict)
    fp8 = _dir(tmp_path, "fp8", "checkpoint", {"quant_method": "fp8"})
    assert isinstance(vllm_args(fp8, {"scheme": "checkpoint"}, v, 0, supported=frozenset({"fp8"})), dict)
    assert "'fp8' is not one vLLM reads" in vllm_args(fp8, {"scheme": "checkpoint"}, v, 0,
                                                       supported=frozenset({"gptq"}))


def test_vllm_args_on_directories_the_quantizers_wrote(tmp_path, tiny_model_dir):
    """The bitsandbytes and torchao quantizers' own directories (tiny Llama, CPU): config.json as
    transformers writes it is read the way vllm_args expects."""
    from pipeline.variants.quantizers import Job, quantize_bnb_int8, quantize_bnb_nf4, quantize_torchao_int8wo

    job = Job(name="t", device=torch.device("cpu"), storage_dtype=torch.float32, compute_dtype=torch.float32,
              seed=0, log_dir=tmp_path / "logs")
    spec = type("Spec", (), {"bits": None, "group_size": None, "weight_noise": 0.0})()
    want = {"bnb-int8": (quantize_bnb_int8, vllm_backend.BITSANDBYTES),
            "bnb-nf4": (quantize_bnb_nf4, vllm_backend.BITSANDBYTES),
            "torchao-int8wo": (quantize_torchao_int8wo, None)}
    for scheme, (quantize, told) in want.items():
        out = tmp_path / scheme
        meta = {"scheme": scheme, **quantize(tiny_model_dir, out, spec, job)}
        (out / "meta.json").write_text(json.dumps(meta))
        got = vllm_args(out, meta, VllmConfig(), seed=0)
        if told is None:
            assert isinstance(got, str) and got.startswith("scheme torchao-int8wo"), got
            # Even were the scheme not named, its config.json says torchao, which vLLM is not given.
            assert vllm_args(out, {"scheme": "checkpoint"}, VllmConfig(), seed=0).startswith("torchao")
        else:
            assert got == {"pretrained": str(out), "tokenizer": str(out), **BASE, "seed": 0, **told}, scheme


# ---------------------------------------------------------------- the fallback decision


def _qcfg(tmp_path, **quality):
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump({"quality": quality}))
    return load_config(path).quality


def test_choose_falls_back_to_hf_or_stops(tmp_path):
    plain = _dir(tmp_path, "bf16", "none")
    torchao = _dir(tmp_path, "w8a16", "torchao-int8wo", {"quant_method": "torchao"})
    hf = _qcfg(tmp_path, backend="hf")
    assert choose(hf, plain, 0) == Choice("hf") and choose(hf, torchao, 0) == Choice("hf")
    assert Choice("hf").record("prefix") == {"backend": "hf", "evaluator": "prefix"}

    vq = _qcfg(tmp_path, backend="vllm", vllm={"tensor_parallel_size": 2})
    got = choose(vq, plain, 3)
    assert got.backend == "vllm" and got.why is None and got.quant_method is None
    assert got.kwargs == {"pretrained": str(plain), "tokenizer": str(plain), **BASE, "seed": 3,
                          "tensor_parallel_size": 2}
    rec = got.record("prefix")
    assert rec["backend"] == "vllm" and rec["evaluator"] == "vllm" and rec["vllm_args"] == got.kwargs
    assert "vllm_version" in rec
    # The hash of what scored it leaves the directory's path out (a moved run is not re-scored).
    assert got.scored_with()["args"] == {**BASE, "seed": 3, "tensor_parallel_size": 2}

    back = choose(vq, torchao, 3)
    assert back.backend == "hf" and back.kwargs is None and back.why.startswith("vLLM cannot load it: scheme torchao")
    rec = back.record("prefix")
    assert rec == {"backend": "hf", "evaluator": "prefix", "backend_reason": back.why}

    stop = _qcfg(tmp_path, backend="vllm", vllm={"fallback": "stop"})
    with pytest.raises(StageError, match="vLLM cannot load variant 'w8a16': scheme torchao-int8wo.*fallback: stop"):
        choose(stop, torchao, 0, name="w8a16")
    assert choose(stop, plain, 0).backend == "vllm"


def test_engines_hold_one_engine_at_a_time(monkeypatch):
    built, shut = [], []

    class Fake:
        def __init__(self, name, kwargs):
            self.kwargs = kwargs
            built.append(kwargs["pretrained"])

    monkeypatch.setattr(vllm_backend, "_shutdown", lambda lm: shut.append(lm.kwargs["pretrained"]))
    engines = vllm_backend.Engines(build=Fake)
    a, t = engines.get("ref", {"pretrained": "ref"})
    assert engines.get("ref", {"pretrained": "ref"}) == (a, 0.0) and t >= 0
    engines.get("v", {"pretrained": "v"})
    assert built == ["ref", "v"] and shut == ["ref"] and list(engines.loaded) == ["v"]
    # keep_reference: the reference's engine stays beside each variant's.
    kept = vllm_backend.Engines(keep="ref", build=Fake)
    kept.get("ref", {"pretrained": "ref"})
    kept.get("v", {"pretrained": "v"})
    kept.get("w", {"pretrained": "w"})
    assert list(kept.loaded) == ["ref", "w"] and shut == ["ref", "v"]
    kept.release()
    assert not kept.loaded and shut == ["ref", "v", "ref", "w"]


# ---------------------------------------------------------------- the backend is in the lines' hash


def test_item_hash_includes_the_backend(tmp_path):
    from pipeline.quality.waves import item_inputs
    from pipeline.core.stage import hash_obj

    run = tmp_path / "run"
    vdir = _dir(run / "variants", "bf16", "none")

    def hashes(quality: dict, backend: Choice) -> tuple[str, str]:
        cfg = load_config(REPO / "configs/default.yaml", {"quality": {**quality, "slices": ["reasoning"]}})
        ctx = StageContext(name="quality", run_dir=run, out_dir=run / "quality", config=cfg, args={},
                           input_hash="test", upstream={}, code="test")
        scored_with, inputs_of = item_inputs(ctx, vdir, vdir, {"reasoning": "x"}, [], backend.scored_with())
        return hash_obj(scored_with), hash_obj(inputs_of(False))

    hf = hashes({}, Choice("hf"))
    vq = {"backend": "vllm"}
    on_vllm = hashes(vq, choose(_qcfg(tmp_path, **vq), vdir, 0))
    fell_back = hashes(vq, Choice("hf", why="vLLM cannot load it: x"))
    assert len({hf[0], on_vllm[0], fell_back[0]}) == 3  # each backend's lines are its own
    assert len({hf[1], on_vllm[1], fell_back[1]}) == 3
    # With backend hf the vllm section changes nothing; with vllm, its scoring settings re-score and
    # the ones that change no line (keep_reference, distribution, fallback) re-open the item only.
    assert hashes({"vllm": {"tensor_parallel_size": 4}}, Choice("hf")) == hf
    tp4 = {"backend": "vllm", "vllm": {"tensor_parallel_size": 4}}
    assert hashes(tp4, choose(_qcfg(tmp_path, **tp4), vdir, 0))[0] != on_vllm[0]
    kept = {"backend": "vllm", "vllm": {"distribution": True}}
    got = hashes(kept, choose(_qcfg(tmp_path, **kept), vdir, 0))
    assert got[0] == on_vllm[0] and got[1] != on_vllm[1]


# ---------------------------------------------------------------- the stage, an HFLM standing in for vLLM


def test_stage_with_a_stand_in_engine_writes_the_same_records_and_what_ran(tmp_path, tiny_model_dir, monkeypatch):
    """The quality stage with backend vllm on a run of two variants: bf16 (vLLM can load it: its
    engine is lm-eval's HFLM here, built from the kwargs vllm_args made) and w8a16 (scheme
    torchao-int8wo in its meta.json, plain weights: vLLM cannot load it, so hf scores it). Both
    write the same records; meta.json says what scored each; no drift is measured."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    run = tmp_path / "run"
    for name, scheme in (("bf16", "none"), ("w8a16", "torchao-int8wo")):
        d = run / "variants" / name
        shutil.copytree(tiny_model_dir, d)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "scheme": scheme}))
    variants = {n: {"scheme": s, "dir": f"variants/{n}"} for n, s in (("bf16", "none"), ("w8a16", "torchao-int8wo"))}
    (run / "variants" / "meta.json").write_text(
        json.dumps({"stage": "quantize", "input_hash": "t", "variants": variants}))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        "device: cpu\nquantize:\n  reference: bf16\n  variants:\n"
        "    bf16: {scheme: none, release: false}\n    w8a16: {scheme: torchao-int8wo}\n"
        "quality:\n  slices: [reasoning, calibration]\n  items_per_slice: 4\n  wave_items: 2\n  max_new_tokens: 4\n"
        "  batch_size: 4\n  backend: vllm\n  vllm: {tensor_parallel_size: 2}\n")
    cfg = load_config(cfg_path)
    built = []

    def stand_in(name, kwargs, host):
        built.append(dict(kwargs))
        return HFLM(pretrained=kwargs["pretrained"], tokenizer=kwargs["tokenizer"], device="cpu", dtype="float32",
                    batch_size=4)

    monkeypatch.setattr(vllm_backend, "unavailable", lambda: None)
    monkeypatch.setattr(vllm_backend, "platform", lambda: "cuda")
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.0-stand-in")
    monkeypatch.setattr(vllm_backend, "serve", stand_in)
    meta = json.loads(run_stage(STAGES["quality"], run, cfg, {}, STAGES).read_text())

    ref_dir = str(run / "variants" / "bf16")
    assert built and all(k == {"pretrained": ref_dir, "tokenizer": ref_dir, **BASE, "seed": 0,
                                "tensor_parallel_size": 2} for k in built)
    q = run / "quality"
    ref_meta = json.loads((q / "bf16" / "meta.json").read_text())
    assert ref_meta["backend"] == "vllm" and ref_meta["evaluator"] == "vllm"
    assert ref_meta["vllm_version"] == "0.0-stand-in" and ref_meta["vllm_args"]["pretrained"] == ref_dir
    var_meta = json.loads((q / "w8a16" / "meta.json").read_text())
    assert var_meta["backend"] == "hf" and var_meta["evaluator"] == "prefix" and "vllm_version" not in var_meta
    assert var_meta["backend_reason"].startswith("vLLM cannot load it: scheme torchao-int8wo")
    assert meta["backends"] == {"bf16": {"backend": "vllm", "evaluator": "vllm", "vllm_version": "0.0-stand-in"},
                                "w8a16": {"backend": "hf", "evaluator": "prefix",
                                          "backend_reason": var_meta["backend_reason"]}}
    assert meta["generation"]["evaluator"] == "mixed (see backends)"
    assert "not measured" in meta["distribution_drift"] and not (q / "w8a16" / "distribution.json").exists()
    assert "distribution" not in json.loads((q / "w8a16.json").read_text())
    for s in ("reasoning", "calibration"):
        ref = [json.loads(x) for x in (q / "bf16" / f"{s}.jsonl").read_text().splitlines()]
        var = [json.loads(x) for x in (q / "w8a16" / f"{s}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in ref] == [r["id"] for r in var] and len(ref) == 4
        assert [set(r) for r in ref] == [set(r) for r in var]  # the same record shape from either backend


# ---------------------------------------------------------------- many GPUs: one engine per group


def test_device_groups_cut_the_gpus_in_order():
    from pipeline.quality.vllm_backend import device_groups, visible_gpus

    eight = [str(i) for i in range(8)]
    assert device_groups(eight, 2) == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert device_groups(eight, 3) == [("0", "1", "2"), ("3", "4", "5")]  # two GPUs left over
    assert device_groups(eight, 1) == [(d,) for d in eight]
    assert device_groups([], 1) == []  # no GPU: nothing side by side
    with pytest.raises(StageError, match="tensor_parallel_size 4 needs that many GPUs; this machine shows 2"):
        device_groups(["0", "1"], 4)
    assert visible_gpus(["3", 5]) == ["3", "5"]


def test_side_by_side_keeps_one_variant_per_group_and_the_order_of_names():
    """Eight variants on three fake groups, each taking a random time: no group ever holds two
    at once, three run at once, and the results come back in the order asked whatever the
    finishing order; an error stops what has not started and is raised once the rest finish."""
    import random
    import threading
    import time as _time

    from pipeline.quality.vllm_backend import side_by_side

    groups = [("0", "1"), ("2", "3"), ("4", "5")]
    busy, peak, lock, finished = set(), [0], threading.Lock(), []
    rng = random.Random(3)
    delays = {f"v{i}": rng.uniform(0.0, 0.05) for i in range(8)}

    def work(name, group):
        with lock:
            assert group not in busy
            busy.add(group)
            peak[0] = max(peak[0], len(busy))
        _time.sleep(delays[name])
        with lock:
            busy.discard(group)
            finished.append(name)
        return (name, len(group))

    names = list(delays)
    assert side_by_side(names, groups, work) == [(n, 2) for n in names]
    assert peak[0] == 3 and sorted(finished) == sorted(names)

    started = []

    def failing(name, group):
        started.append(name)
        if name == "v0":
            raise StageError("v0 broke")
        _time.sleep(0.02)
        return name

    with pytest.raises(StageError, match="v0 broke"):
        side_by_side(names, [("0",)], failing)
    assert started == ["v0"]


def _stand_in_run(tmp_path, tiny_model_dir, names: list[str], extra: str = "") -> tuple[Path, object]:
    """A run of plain copies of the tiny model (the first is the reference) and a config scoring
    it with backend vllm: two slices, 4 items in looks of 2."""
    run = tmp_path / "run"
    for name in names:
        shutil.copytree(tiny_model_dir, run / "variants" / name)
    variants = {n: {"scheme": "none", "dir": f"variants/{n}"} for n in names}
    (run / "variants" / "meta.json").write_text(json.dumps({"stage": "quantize", "input_hash": "t", "variants": variants}))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        "device: cpu\nbudget: {minutes: null}\nquantize:\n  reference: " + names[0] + "\n  variants:\n"
        + "".join(f"    {n}: {{scheme: none}}\n" for n in names)
        + "quality:\n  slices: [reasoning, calibration]\n  items_per_slice: 4\n  wave_items: 2\n  max_new_tokens: 4\n"
          "  batch_size: 4\n  backend: vllm\n" + extra)
    return run, load_config(cfg_path)


def _hflm(vdir: str):
    """lm-eval's HFLM on the variant as specq loads it (float32 on CPU): the engine's stand-in."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.variants.schemes import load_variant

    model, tok = load_variant(vdir, "cpu")
    return HFLM(pretrained=model, tokenizer=tok, batch_size=4)


def _lines(run: Path, names: list[str]) -> dict:
    return {(n, s): (run / "quality" / n / f"{s}.jsonl").read_text() for n in names for s in ("reasoning", "calibration")}


def test_stage_scores_variants_side_by_side_on_fake_gpus(tmp_path, tiny_model_dir, monkeypatch):
    """Four fake GPUs, tensor_parallel_size 2: the three variants are scored on two engines at
    once, each engine on one group of two GPUs, finishing in a scrambled order; every line is
    the one the one-GPU-group run writes."""
    import random
    import threading
    import time as _time

    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    names = ["ref", "a", "b", "c"]
    seen, lock = [], threading.Lock()
    rng = random.Random(0)

    def stand_in(name, kwargs, host):
        with lock:  # (transformers' loading is not thread-safe; a real engine is its own process)
            seen.append((name, host.devices))
            lm = _hflm(kwargs["pretrained"])
        slow = lm.generate_until

        def generate_until(requests, *a, **k):  # variants finish in an order of their own
            _time.sleep(rng.uniform(0.0, 0.3))
            return slow(requests, *a, **k)

        lm.generate_until = generate_until
        return lm

    monkeypatch.setattr(vllm_backend, "unavailable", lambda: None)
    monkeypatch.setattr(vllm_backend, "platform", lambda: "cuda")
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.0-stand-in")
    monkeypatch.setattr(vllm_backend, "serve", stand_in)
    run, cfg = _stand_in_run(tmp_path / "many", tiny_model_dir, names,
                             "  vllm: {tensor_parallel_size: 2, devices: ['0', '1', '2', '3']}\n")
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    groups = {devices for name, devices in seen if name != "ref"}
    assert sorted(n for n, _ in seen if n != "ref") == ["a", "b", "c"]
    assert groups <= {("0", "1"), ("2", "3")} and len(groups) == 2
    seen.clear()
    one, cfg1 = _stand_in_run(tmp_path / "one", tiny_model_dir, names,
                              "  vllm: {tensor_parallel_size: 2, devices: ['0', '1']}\n")
    run_stage(STAGES["quality"], one, cfg1, {}, STAGES)
    assert {d for _, d in seen} == {None}  # one group: the engines see every GPU, one at a time
    assert _lines(run, names) == _lines(one, names)


def test_an_engine_that_dies_mid_look_loses_no_answered_request(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The variant's engine answers some of its second look's requests, then dies: the stage
    fails in one line, the first look's lines and the answered requests (lm-eval's request
    cache) are kept; the next run asks only for the rest and writes what an unbroken run writes."""
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage

    names = ["ref", "v"]
    asked = {"v": 0}
    plan = {"die_after": 3}

    class Gone:
        log = tmp_path / "engine.log"

        def __init__(self):
            self.up = True

        def alive(self):
            return self.up

        def __exit__(self, *exc):
            self.up = False

    def stand_in(name, kwargs, host):
        lm = _hflm(kwargs["pretrained"])
        lm.server = Gone()
        for method in ("generate_until", "loglikelihood"):
            real = getattr(lm, method)

            def one_by_one(requests, *a, _real=real, **k):
                out = []
                for r in requests:
                    if name == "v":
                        if plan["die_after"] is not None and asked["v"] >= plan["die_after"]:
                            lm.server.up = False
                            raise ConnectionError("connection refused")
                        asked["v"] += 1
                    out += _real([r], *a, **k)
                return out

            setattr(lm, method, one_by_one)
        return lm

    Gone.log.write_text("RuntimeError: the engine core died\n")
    monkeypatch.setattr(vllm_backend, "unavailable", lambda: None)
    monkeypatch.setattr(vllm_backend, "platform", lambda: "cuda")
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.0-stand-in")
    monkeypatch.setattr(vllm_backend, "serve", stand_in)
    whole, cfg = _stand_in_run(tmp_path / "whole", tiny_model_dir, names)
    plan["die_after"] = None
    run_stage(STAGES["quality"], whole, cfg, {}, STAGES)
    per_run = asked["v"]

    run, cfg = _stand_in_run(tmp_path / "broken", tiny_model_dir, names)
    first_look = 2 * 2 + 2 * 4  # 2 reasoning generations + 2 calibration items of 4 options each
    plan["die_after"], asked["v"] = first_look + 3, 0
    with pytest.raises(StageError, match=r"^quality: v: its vLLM engine exited \(log .*engine.log: RuntimeError: "
                                         r"the engine core died\).*run again to resume"):
        run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    q = run / "quality" / "v"
    assert [len((q / f"{s}.jsonl").read_text().splitlines()) for s in ("reasoning", "calibration")] == [2, 2]
    assert list(q.glob("requests-*.db"))  # the answered requests of the broken look
    plan["die_after"], asked["v"] = None, 0
    run_stage(STAGES["quality"], run, cfg, {}, STAGES)
    assert asked["v"] == per_run - first_look - 3  # only what the dead engine had not answered
    assert _lines(run, names) == _lines(whole, names)
    assert not list((run / "quality").glob("*/requests-*.db"))  # gone once the lines are written

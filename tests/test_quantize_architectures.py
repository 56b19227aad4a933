"""The quantize and drafts stages on architectures other than Llama: GPT-2 (Conv1D layers under
transformer.h), Qwen2-MoE (fused experts), Gemma 2 (a cache the engine cannot roll back) and an
architecture GPTQModel has no definition for. Every refusal is one line, before any variant is
built.

    .venv/bin/python -m pytest -q tests/test_quantize_architectures.py
"""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import make_tiny_model, save_as_prepared
from pipeline.__main__ import main
from tests.test_quantize import make_run


def _prepared(tmp_path_factory, tokenizer, arch: str):
    return save_as_prepared(make_tiny_model(arch, tokenizer), tokenizer, tmp_path_factory.mktemp(arch) / "model")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_tokenizer):
    return _prepared(tmp_path_factory, tiny_tokenizer, "gpt2")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_gpt2_noise_gptq_and_progress(tmp_path, gpt2_dir, capsys):
    run, cfg = make_run(tmp_path, gpt2_dir, {"ref": {"scheme": "none", "release": False},
                                             "noisy": {"scheme": "none", "weight_noise": 0.5},
                                             "gptq": {"scheme": "gptq", "bits": 4, "group_size": 32}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    # GPTQ progress counts the model's 4 blocks (it said "layer 1/0" when it looked for `.layers.`).
    assert re.findall(r"GPTQ layer (\d+)/(\d+) done", err) == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")]
    ref = load_file(run / "variants/ref/model.safetensors")
    noisy = load_file(run / "variants/noisy/model.safetensors")
    conv = [n for n in ref if re.fullmatch(r"transformer\.h\.\d+\.(attn|mlp)\.c_\w+\.weight", n)]
    assert len(conv) == 16
    for name, t in ref.items():  # every Conv1D weight damaged, nothing else touched
        assert torch.equal(t, noisy[name]) != (name in conv), name
    meta = {v: json.loads((run / "variants" / v / "meta.json").read_text()) for v in ("ref", "noisy", "gptq")}
    assert meta["noisy"]["storage"] == "copy of the reference with noise on 16 decoder weight matrices"
    assert meta["noisy"]["perplexity"] != meta["ref"]["perplexity"]
    assert {m["architecture"] for m in meta.values()} == {"GPT2LMHeadModel"}
    assert meta["gptq"]["decoder_float_fraction"] == 0.0 and meta["noisy"]["decoder_float_fraction"] == 1.0
    assert meta["gptq"]["bytes_on_disk"] < meta["ref"]["bytes_on_disk"] / 2


@pytest.mark.parametrize("variant, message", [
    ({"scheme": "gptq", "bits": 4, "group_size": 48},
     "group_size 48 does not divide layer transformer.h.0.attn.c_attn (input width 64)"),
    ({"scheme": "torchao-int8wo"},
     "scheme torchao-int8wo quantizes linear layers only, and the decoder weights of GPT2LMHeadModel are conv1d; "
     "schemes that handle them: gptq, bnb-int8, bnb-nf4"),
])
def test_gpt2_refusals_come_before_any_variant(tmp_path, gpt2_dir, capsys, variant, message):
    run, cfg = make_run(tmp_path, gpt2_dir, {"ref": {"scheme": "none"}, "bad": variant})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 2
    line = _error_line(capsys)
    assert message in line, line
    assert not (run / "variants/ref").exists() and not (run / "variants/bad").exists()


def test_moe_gptq_then_nf4_in_one_process(tmp_path_factory, tiny_tokenizer, capsys):
    """GPTQModel swaps transformers' Qwen2-MoE block class process-wide while it loads; the
    bitsandbytes variant made after it in the same process must still build and load."""
    src = _prepared(tmp_path_factory, tiny_tokenizer, "qwen2_moe")
    root = tmp_path_factory.mktemp("moe-run")
    run, cfg = make_run(root, src, {"ref": {"scheme": "none", "release": False},
                                    "gptq": {"scheme": "gptq", "bits": 4, "group_size": 32},
                                    "nf4": {"scheme": "bnb-nf4"}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    meta = {v: json.loads((run / "variants" / v / "meta.json").read_text()) for v in ("gptq", "nf4")}
    # GPTQModel unfuses and quantizes the experts; only the router stays float (256 of ~59k).
    assert meta["gptq"]["decoder_float_fraction"] < 0.05
    # bitsandbytes replaces Linear modules only: the fused expert tensors stay float, and it says so.
    assert 0.3 < meta["nf4"]["decoder_float_fraction"] < 1.0
    assert "quantize nf4: " in err and "left in floating point by bitsandbytes" in err
    assert meta["nf4"]["perplexity"] > 0


def test_architecture_without_a_gptqmodel_definition_is_refused(tmp_path_factory, tiny_tokenizer, capsys):
    from transformers import OlmoConfig, OlmoForCausalLM

    cfg = OlmoConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=tiny_tokenizer.pad_token_id,
                     bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id)
    src = save_as_prepared(OlmoForCausalLM(cfg), tiny_tokenizer, tmp_path_factory.mktemp("olmo") / "model")
    run, config = make_run(tmp_path_factory.mktemp("olmo-run"), src,
                           {"ref": {"scheme": "none"}, "g": {"scheme": "gptq", "bits": 4, "group_size": 32}})
    assert main(["quantize", "--run", str(run), "--config", str(config)]) == 2
    line = _error_line(capsys)
    assert "GPTQModel" in line and "no definition for architecture OlmoForCausalLM (model_type olmo)" in line
    assert not (run / "variants/ref").exists()


def test_sliding_window_architecture_is_refused_by_drafts_up_front(tmp_path_factory, tiny_tokenizer, capsys):
    src = _prepared(tmp_path_factory, tiny_tokenizer, "gemma2")
    root = tmp_path_factory.mktemp("gemma-run")
    run, cfg = make_run(root, src, {"ref": {"scheme": "none"}})
    data = yaml.safe_load(cfg.read_text())
    data["drafts"] = ["ngram", "layerskip:1"]
    cfg.write_text(yaml.safe_dump(data))
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["drafts", "--run", str(run), "--config", str(cfg)]) == 2
    line = _error_line(capsys)
    assert line.startswith("specq: architecture Gemma2ForCausalLM: ") and "StaticSlidingWindowLayer" in line
    assert not list(run.glob("drafts/*/meta.json")) and not (run / "drafts/meta.json").exists()

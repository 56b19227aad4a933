"""Every stage from prepare to gate on tiny random Qwen2 and GPT-2 models given as local HF
directories, with a smoke-sized config written here. The Qwen2 run also gates a plain bf16
fine-tune made outside specq (`scheme: checkpoint`) like any other variant.

    .venv/bin/python -m pytest -q tests/test_e2e_architectures.py
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from conftest import CORPUS, make_tiny_model
from pipeline.__main__ import main

STAGES = ["prepare", "quantize", "drafts", "acceptance", "latency", "marginal", "quality", "gate"]


def smoke_config(calibration, variants: dict) -> dict:
    return {
        "seed": 0, "device": "cpu",
        "quantize": {"reference": "ref", "variants": variants, "sanity_tokens": 64,
                     "calibration": {"source": str(calibration), "n_samples": 4, "max_tokens": 64,
                                     "min_tokens": 128}},
        "drafts": ["ngram", "layerskip:1"],
        "acceptance": {"targets": ["ref"], "k_max": 2, "temperatures": [0.0, 0.7], "max_new_tokens": 8, "prompts_per_kind": 1,
                       "lossless_samples": 20},
        "latency": {"batch_sizes": [1], "context_lengths": [32], "new_tokens": 4, "warmup": 1, "repeats": 2,
                    "screen": False},  # timed whatever the machine's load (screening: test_latency_screen)
        "quality": {"slices": ["reasoning", "language", "long_context", "calibration", "tool_args", "bfcl"],
                    "items_per_slice": 3, "long_context_lengths": [256], "max_new_tokens": 8,
                    "distribution_docs": 2, "distribution_tokens": 32,
                    "per_slice": {"bfcl": {"items": 3, "max_new_tokens": 8}}},
    }


@pytest.mark.parametrize("arch, architecture", [("qwen2", "Qwen2ForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_every_stage_on_another_architecture(tmp_path, tiny_tokenizer, capsys, arch, architecture):
    model = make_tiny_model(arch, tiny_tokenizer)
    src = tmp_path / f"tiny-{arch}"
    model.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text((CORPUS + "\n") * 6)
    variants = {"ref": {"scheme": "none", "release": False},
                "w4": {"scheme": "gptq", "bits": 4, "group_size": 32},
                "nf4": {"scheme": "bnb-nf4"}}
    if arch == "qwen2":  # a fine-tune made elsewhere, gated like the quantized variants
        finetune = copy.deepcopy(model)
        with torch.no_grad():
            for p in finetune.parameters():
                p.add_(0.02 * torch.randn_like(p))
        finetune.to(torch.bfloat16).save_pretrained(tmp_path / "finetune")
        tiny_tokenizer.save_pretrained(tmp_path / "finetune")
        variants["finetune"] = {"scheme": "checkpoint", "path": str(tmp_path / "finetune")}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(smoke_config(calibration, variants)))
    run = tmp_path / "run"
    argv = ["--run", str(run), "--config", str(cfg), "--model", str(src)]
    for stage in STAGES:
        assert main([stage, *(["--stage-only"] if stage == "gate" else []), *argv]) == 0, stage
    capsys.readouterr()

    model_meta = json.loads((run / "model/meta.json").read_text())
    assert model_meta["architecture"] == architecture and model_meta["source"]["kind"] == "local"
    for name in variants:
        vmeta = json.loads((run / "variants" / name / "meta.json").read_text())
        assert vmeta["architecture"] == architecture, name
    assert json.loads((run / "variants/w4/meta.json").read_text())["decoder_float_fraction"] == 0.0
    for draft in ("ngram", "layerskip-1"):
        acc = json.loads((run / "acceptance" / f"ref__{draft}.json").read_text())
        greedy = acc["slices"]["all"]["0.0"]
        assert len(greedy["per_position"]) == 2
        for p in greedy["per_position"]:
            if p["n"]:
                assert 0.0 <= p["ci"][0] <= p["conditional"] <= p["ci"][1] <= 1.0
        assert acc["lossless"]["greedy_lossless"] is True, acc["lossless"]  # bf16 on a CPU with native bf16: near-ties allowed
        marginal = json.loads((run / "marginal" / f"ref__{draft}.json").read_text())
        assert marginal["recommended_k"] in (0, 1, 2)
        assert (run / "marginal" / f"ref__{draft}.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "latency" / "ref.json").is_file()

    gate = json.loads((run / "gate.json").read_text())
    gated = set(variants) - {"ref"}
    assert gated <= set(gate["variants"])
    slices = set(gate["variants"]["w4"]["slices"])
    for name in gated:
        v = gate["variants"][name]
        assert v["decision"] in ("go", "no-go", "inconclusive")
        assert set(v["slices"]) == slices, name  # every variant on the same slices
        for s in v["slices"].values():
            assert s["status"] in ("pass", "fail", "inconclusive") and s["n"] == 3
    assert main(["gate-check", *argv]) == {"go": 0, "no-go": 1, "inconclusive": 3}[gate["decision"]]

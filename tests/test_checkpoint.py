"""`scheme: checkpoint` with directories made outside specq: a plain bf16 fine-tune, a
bitsandbytes NF4 checkpoint saved by transformers, and the ways such a directory can be unusable,
each refused in quantize's fail-fast pass, before the reference variant is built.
(A GPTQ directory as a checkpoint: tests/test_quantize.py.)

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_tokenizer
from pipeline.__main__ import main
from pipeline.variants.schemes import load_variant
from tests.test_quantize import logits, make_run


def _digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finetune_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """A 'fine-tune' of the tiny Llama (every weight nudged), saved by transformers in bf16."""
    model = copy.deepcopy(tiny_model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("finetune") / "ft"
    model.to(torch.bfloat16).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_plain_finetune_loads_through_transformers_and_meta_says_what_it_is(tmp_path, tiny_model_dir,
                                                                            finetune_dir):
    from transformers import AutoModelForCausalLM

    before = _digest(finetune_dir)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none", "release": False},
                                                   "ft": {"scheme": "checkpoint", "path": str(finetune_dir)}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    meta = json.loads((run / "variants/ft/meta.json").read_text())
    found = meta["checkpoint"]
    assert found["architecture"] == "LlamaForCausalLM" and found["model_type"] == "llama"
    assert found["dtype"] == "bfloat16" and found["quant_method"] is None and found["quantization_config"] is None
    sizes = {f["name"]: f["bytes"] for f in found["files"]}
    assert sizes["model.safetensors"] == (finetune_dir / "model.safetensors").stat().st_size
    assert "tokenizer.json" in sizes and found["bytes"] == sum(sizes.values())
    assert meta["library"] == "transformers" and meta["bits"] is None and meta["decoder_float_fraction"] == 1.0
    # The variant is the fine-tune: the same logits as transformers' own load of the directory, in the
    # dtype the variant computes in (unquantized: bf16 on a CPU with native bf16, pipeline.core.device).
    variant, _ = load_variant(run / "variants/ft", device="cpu")
    direct = AutoModelForCausalLM.from_pretrained(finetune_dir, dtype=getattr(torch, meta["dtype_compute"])).eval()
    assert torch.equal(logits(variant), logits(direct))
    reference, _ = load_variant(run / "variants/ref", device="cpu")
    assert not torch.allclose(logits(variant), logits(reference), atol=1e-3)
    # Weights are shared by a hard link; the tokenizer the stage rewrites is a copy, so the
    # source directory is byte for byte what it was.
    assert (run / "variants/ft/model.safetensors").stat().st_ino == (finetune_dir / "model.safetensors").stat().st_ino
    assert (run / "variants/ft/tokenizer.json").stat().st_ino != (finetune_dir / "tokenizer.json").stat().st_ino
    assert _digest(finetune_dir) == before


def test_bitsandbytes_checkpoint_made_elsewhere(tmp_path, tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    ckpt = tmp_path / "nf4-elsewhere"
    quantized = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    quantized.save_pretrained(ckpt)
    tiny_tokenizer.save_pretrained(ckpt)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none", "release": False},
                                                   "nf4": {"scheme": "checkpoint", "path": str(ckpt)}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    meta = json.loads((run / "variants/nf4/meta.json").read_text())
    assert meta["checkpoint"]["quant_method"] == "bitsandbytes" and meta["quant_method"] == "bitsandbytes"
    assert meta["checkpoint"]["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert meta["decoder_float_fraction"] == 0.0
    # transformers' own load of the checkpoint, in the dtype the variant computes in (bf16 on a CPU
    # with native bf16, pipeline.core.device): its plain parameters (kept in the stored float32 by
    # transformers) cast to it and its NF4 layers dequantizing into it, as the bnb loader does.
    variant, _ = load_variant(run / "variants/nf4", device="cpu")
    dtype = getattr(torch, meta["dtype_compute"])
    direct = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    for m in direct.modules():
        for p in m.parameters(recurse=False):
            if type(p) is torch.nn.Parameter and p.is_floating_point():
                p.data = p.data.to(dtype)
        if type(m).__name__ == "Linear4bit":
            m.compute_dtype = dtype
    assert torch.allclose(logits(variant), logits(direct), atol=1e-5)


def _broken(kind: str, root: Path, finetune_dir: Path) -> Path:
    ckpt = root / f"ckpt-{kind}"
    shutil.copytree(finetune_dir, ckpt)
    if kind == "other tokenizer":
        from tokenizers import Tokenizer

        tok = make_tiny_tokenizer()
        raw = json.loads(tok.backend_tokenizer.to_str())
        raw["model"]["vocab"] = {t: (i + 1) % len(raw["model"]["vocab"]) for t, i in raw["model"]["vocab"].items()}
        tok._tokenizer = Tokenizer.from_str(json.dumps(raw))  # the same tokens, ids shifted by one
        (ckpt / "tokenizer.json").unlink()
        tok.save_pretrained(ckpt)
    elif kind == "no tokenizer":
        for p in ckpt.glob("tokenizer*"):
            p.unlink()
    elif kind == "truncated weights":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif kind == "unknown method":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mystery-quant", "bits": 3}
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif kind == "no config":
        (ckpt / "config.json").unlink()
    return ckpt


@pytest.mark.parametrize("kind, spec, message", [
    ("other tokenizer", {}, "has id"),
    ("no tokenizer", {}, "has no usable tokenizer"),
    ("truncated weights", {}, "model.safetensors is truncated or corrupt"),
    ("unknown method", {}, "is quantized with 'mystery-quant', which transformers"),
    ("no config", {}, "is not a model directory (no config.json)"),
    ("fine", {"bits": 4}, "config says bits 4, checkpoint"),
])
def test_unusable_checkpoints_are_refused_before_the_first_variant(tmp_path, tiny_model_dir, finetune_dir,
                                                                   capsys, kind, spec, message):
    ckpt = _broken(kind, tmp_path, finetune_dir)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none"},
                                                   "ck": {"scheme": "checkpoint", "path": str(ckpt), **spec}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith("specq: variant 'ck': ") and message in line, line
    assert not (run / "variants/ref").exists() and not (run / "variants/ck").exists()


def _write_fp8_checkpoint(model, tokenizer, path: Path, block: int = 128) -> dict:
    """The fine-grained FP8 layout transformers reads (`quant_method: fp8`): each decoder weight
    as float8_e4m3fn plus a `weight_scale_inv` per [block x block] tile, w = q * scale. Written
    here because transformers quantizes to FP8 only on a GPU; returns name -> w (dequantized)."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tensors, expected = {}, {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding
            continue
        if ".layers." not in name or w.dim() != 2:
            tensors[name] = w.contiguous()
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        scale = torch.empty(rows, cols)
        q = torch.empty_like(w)
        for r in range(rows):
            for c in range(cols):
                tile = (slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block))
                scale[r, c] = w[tile].abs().max() / 448.0  # 448 = largest float8_e4m3fn
                q[tile] = w[tile] / scale[r, c]
        tensors[name] = q.to(torch.float8_e4m3fn)
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        tile_scale = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
        expected[name] = tensors[name].float() * tile_scale
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return expected


def test_fp8_checkpoint_loads_through_transformers(tmp_path, tiny_model_dir, tiny_model, tiny_tokenizer):
    ckpt = tmp_path / "fp8"
    expected = _write_fp8_checkpoint(tiny_model, tiny_tokenizer, ckpt)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none", "release": False},
                                                   "fp8": {"scheme": "checkpoint", "path": str(ckpt)}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    meta = json.loads((run / "variants/fp8/meta.json").read_text())
    assert meta["checkpoint"]["quant_method"] == "fp8" and meta["checkpoint"]["quantization_config"]["weight_block_size"]
    variant, _ = load_variant(run / "variants/fp8", device="cpu")
    # Without a GPU transformers dequantizes FP8 at load: the weights are exactly q * scale, in the
    # variant's compute dtype (bf16 on a CPU with native bf16: q * scale rounded to it).
    params = dict(variant.named_parameters())
    for name, w in expected.items():
        assert torch.equal(params[name], w.to(params[name].dtype)), name
    assert meta["decoder_float_fraction"] == 1.0

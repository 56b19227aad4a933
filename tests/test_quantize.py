"""quantize stage on the tiny random Llama: every scheme's round trip through load_variant, the
group-size check, the calibration checks, and the no-partial-artifact rule.

    .venv/bin/python -m pytest -q tests/test_quantize.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import CORPUS
from pipeline.__main__ import main
from pipeline.core.device import cpu_bf16_native
from pipeline.variants.schemes import load_variant

META_KEYS = {"scheme", "bits", "group_size", "library", "library_version", "bytes_on_disk", "bytes_in_memory",
             "quantize_seconds", "calibration_sha256", "calibration_tokens", "perplexity",
             "reference_perplexity", "release", "dtype_compute", "device_fallback", "forward_seconds"}
VARIANTS = {
    "ref": {"scheme": "none", "release": False},
    "noisy": {"scheme": "none", "weight_noise": 0.5},
    "gptq": {"scheme": "gptq", "bits": 4, "group_size": 32},
    "int8": {"scheme": "bnb-int8", "bits": 8},
    "nf4": {"scheme": "bnb-nf4", "bits": 4},
    "w8a16": {"scheme": "torchao-int8wo", "bits": 8},
}
PROMPT = [[5, 20, 33, 40, 71, 100, 120, 7, 9, 60]]


def make_run(root: Path, model_dir: Path, variants: dict, calibration: Path | None = None,
             min_tokens: int = 256) -> tuple[Path, Path]:
    """A run dir whose model/ is the tiny prepared model, and a config naming `variants`."""
    run = root / "run"
    if not (run / "model").exists():
        shutil.copytree(model_dir, run / "model")
    if calibration is None:
        calibration = root / "calibration.txt"
        calibration.write_text((CORPUS + "\n") * 6)
    cfg = {"device": "cpu", "quantize": {
        "reference": "ref", "variants": variants, "sanity_tokens": 96,
        "calibration": {"source": str(calibration), "n_samples": 6, "max_tokens": 64, "min_tokens": min_tokens}}}
    cfg_path = root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    return run, cfg_path


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits[0].float()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("quant")
    run, cfg = make_run(root, tiny_model_dir, VARIANTS)
    cwd = os.getcwd()
    os.chdir(root)  # a relative --run, as `make` passes it (GPTQModel runs in another directory)
    try:
        assert main(["quantize", "--run", "run", "--config", "config.yaml"]) == 0
    finally:
        os.chdir(cwd)
    assert (run / "logs").is_dir() and not (root / "logs").exists()
    return root, run


def test_every_variant_has_meta_and_loads(quantized):
    _, run = quantized
    ref_model, _ = load_variant(run / "variants" / "ref")
    ref = logits(ref_model)
    ref_bytes = json.loads((run / "variants/ref/meta.json").read_text())["bytes_on_disk"]
    stage = json.loads((run / "variants/meta.json").read_text())
    assert set(stage["variants"]) == set(VARIANTS)
    for name, spec in VARIANTS.items():
        meta = json.loads((run / "variants" / name / "meta.json").read_text())
        assert META_KEYS <= set(meta), f"{name}: missing {META_KEYS - set(meta)}"
        # dtype auto: every variant computes in bf16 on a CPU with native bf16, else in float32.
        want = "bfloat16" if cpu_bf16_native() else "float32"
        assert meta["scheme"] == spec["scheme"] and meta["dtype_compute"] == want, (name, meta.get("dtype_reason"))
        model, tok = load_variant(run / "variants" / name)
        assert meta["bytes_in_memory"] > 0 and math_finite(meta["perplexity"])
        assert meta["forward_seconds"]["seconds"] > 0 and meta["forward_seconds"]["tokens"] > 1
        out = logits(model)
        corr = torch.corrcoef(torch.stack([out.flatten(), ref.flatten()]))[0, 1].item()
        if name == "ref":
            assert torch.equal(out, ref)
            assert meta["perplexity"] == meta["reference_perplexity"]
        elif name == "noisy":
            assert not torch.allclose(out, ref, atol=1e-3)
        else:
            # Quantized, not broken: close to the reference (4-bit on a random tiny model is coarse)
            # and smaller on disk than the float32 reference.
            assert corr > (0.95 if spec["bits"] == 8 else 0.8), f"{name}: correlation {corr:.3f}"
            assert meta["bytes_on_disk"] < ref_bytes, name
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=4, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
        assert generated.shape[1] == len(PROMPT[0]) + 4
    gptq = json.loads((run / "variants/gptq/meta.json").read_text())
    assert gptq["calibration_tokens"] == 6 * 64 and len(gptq["calibration_sha256"]) == 64
    assert gptq["calibration_requested"] == {"samples": 6, "tokens": 6 * 64}
    assert gptq["group_size"] == 32 and gptq["library"] == "gptqmodel"


def test_kernel_actually_used_is_recorded_per_variant(quantized):
    """pipeline.models.kernels reads the kernel off each loaded variant: GPTQModel's QuantLinear class,
    bitsandbytes' layer class with its compute dtype, torchao's weight tensor subclass."""
    from pipeline.models.kernels import device_name, quantized_kernels

    _, run = quantized
    decoder_linears = 4 * 7  # the tiny Llama: q, k, v, o, gate, up, down per layer
    found = {}
    for name in VARIANTS:
        model, _ = load_variant(run / "variants" / name)
        found[name] = quantized_kernels(model)
    for name in ("ref", "noisy"):
        assert found[name]["kernels"] == {} and found[name]["unquantized_linear_layers"] == decoder_linears + 1
    gptq = found["gptq"]
    assert gptq["library"] == "gptqmodel" and sum(gptq["kernels"].values()) == decoder_linears
    (kernel,) = gptq["kernels"]  # one kernel class for every layer, chosen by GPTQModel at load time
    info = gptq["details"][kernel]  # on CPU: TorchFusedLinear (float32) or TorchCpuAvx512Linear (bf16)
    assert info["module"].startswith("gptqmodel.nn_modules.qlinear.") and info["QUANT_TYPE"]
    assert info["bits"] == "4" and info["group_size"] == "32"
    assert found["int8"]["kernels"] == {"Linear8bitLt": decoder_linears}
    assert found["nf4"]["kernels"] == {"Linear4bit": decoder_linears}
    assert found["nf4"]["details"]["Linear4bit"]["compute_dtype"] == ("bfloat16" if cpu_bf16_native() else "float32")
    assert found["nf4"]["details"]["Linear4bit"]["quant_type"] == "nf4"
    torchao = found["w8a16"]
    assert torchao["library"] == "torchao" and sum(torchao["kernels"].values()) == decoder_linears
    assert all(d["module"].startswith("torchao.") for d in torchao["details"].values())
    assert device_name("cpu")


def math_finite(x) -> bool:
    return isinstance(x, float) and x == x and x not in (float("inf"), float("-inf"))


def test_rerun_resumes_adds_checkpoint_and_drops_stale(quantized, tiny_model_dir, capsys):
    """A changed config re-runs the stage: unchanged variants are reused, a removed one is deleted,
    and a GPTQ directory given as a checkpoint path becomes a variant that loads."""
    root, run = quantized
    before = (run / "variants/gptq/meta.json").stat().st_mtime_ns
    ckpt = root / "ckpt"
    shutil.copytree(run / "variants/gptq", ckpt)
    (ckpt / "meta.json").unlink()
    variants = {k: v for k, v in VARIANTS.items() if k != "noisy"}
    variants["ckpt"] = {"scheme": "checkpoint", "path": str(ckpt)}
    _, cfg = make_run(root, tiny_model_dir, variants, calibration=root / "calibration.txt")
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    assert (run / "variants/gptq/meta.json").stat().st_mtime_ns == before
    assert not (run / "variants/noisy").exists()
    meta = json.loads((run / "variants/ckpt/meta.json").read_text())
    assert meta["bits"] == 4 and meta["group_size"] == 32
    a, _ = load_variant(run / "variants/ckpt")
    b, _ = load_variant(run / "variants/gptq")
    assert torch.equal(logits(a), logits(b))


def test_group_size_that_does_not_divide_names_the_layer(tmp_path, tiny_model_dir, capsys):
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none"},
                                                   "g": {"scheme": "gptq", "bits": 4, "group_size": 48}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "group_size 48 does not divide layer model.layers.0." in err and "input width 64" in err
    assert not (run / "variants/g").exists() and not (run / "variants/ref").exists()


def test_calibration_shorter_than_asked_says_so(tmp_path, tiny_tokenizer, capsys):
    """A text with room for fewer windows than asked gives the windows it has (no repeats),
    with one line saying asked vs used."""
    from pipeline.core.config import CalibrationConfig
    from pipeline.variants.quantizers import load_calibration

    path = tmp_path / "calib.txt"
    path.write_text((CORPUS + "\n") * 3)
    available = len(tiny_tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    ccfg = CalibrationConfig(source=str(path), n_samples=128, max_tokens=64, min_tokens=64)
    calib = load_calibration(ccfg, tiny_tokenizer)
    assert len(calib.windows) == available // 64 < 128 and all(len(w) == 64 for w in calib.windows)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "fewer than the 128 x 64 asked" in ln]
    assert len(lines) == 1 and f"{available} tokens: {available // 64} windows" in lines[0]
    load_calibration(CalibrationConfig(source=str(path), n_samples=2, max_tokens=64, min_tokens=64), tiny_tokenizer)
    assert "asked" not in capsys.readouterr().err


@pytest.mark.parametrize("problem", ["missing", "short"])
def test_calibration_problems_are_one_line(tmp_path, tiny_model_dir, capsys, problem):
    calib = tmp_path / "calib.txt"
    if problem == "short":
        calib.write_text("too short")
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none"},
                                                   "g": {"scheme": "gptq", "bits": 4, "group_size": 32}},
                        calibration=calib)
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("calibration text missing" if problem == "missing" else "is too short") in err
    assert not (run / "variants/g").exists()


def test_unsupported_scheme_on_device_is_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from pipeline.variants import schemes as quantize_schemes

    cuda_only = dataclasses.replace(quantize_schemes.SCHEMES["bnb-int8"], devices=("cuda",))
    monkeypatch.setitem(quantize_schemes.SCHEMES, "bnb-int8", cuda_only)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none"}, "i8": {"scheme": "bnb-int8"}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "scheme bnb-int8 is not supported on device cpu" in err and "schemes that work on cpu:" in err
    assert not (run / "variants/i8").exists()


def test_crash_mid_quantization_leaves_no_variant_dir(tmp_path, tiny_model_dir, monkeypatch):
    from pipeline.variants import schemes as quantize_schemes

    def half_written(src, out, spec, job):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed mid-way")

    broken = dataclasses.replace(quantize_schemes.SCHEMES["bnb-nf4"], quantize=half_written)
    monkeypatch.setitem(quantize_schemes.SCHEMES, "bnb-nf4", broken)
    run, cfg = make_run(tmp_path, tiny_model_dir, {"ref": {"scheme": "none"}, "nf4": {"scheme": "bnb-nf4"}})
    with pytest.raises(RuntimeError, match="killed mid-way"):
        main(["quantize", "--run", str(run), "--config", str(cfg)])
    variants = run / "variants"
    assert (variants / "ref/meta.json").is_file()  # finished before the crash: kept
    assert not (variants / "nf4").exists() and not (variants / "nf4.tmp").exists()
    assert not (variants / "meta.json").exists()


def test_bytes_in_memory_counts_tied_weights_once(tiny_model):
    from pipeline.models.bytes import bytes_in_memory

    tensors = [*tiny_model.parameters(), *tiny_model.buffers()]  # buffers: rotary inv_freq
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()
    assert bytes_in_memory(tiny_model) == sum(unique.values())


def test_perplexity_matches_transformers_loss(tiny_model):
    import math

    from pipeline.variants.sanity import perplexity

    ids = list(range(3, 60))
    with torch.no_grad():
        loss = tiny_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert perplexity(tiny_model, ids, window=512) == pytest.approx(math.exp(loss), rel=1e-4)


def test_embedded_model_nf4_is_smaller_and_still_sensible(tmp_path, embedded_model_dir):
    """The real SmolLM2-135M through the stage (NF4 only: seconds, not GPTQ's minutes): the
    variant is under half the reference's weight bytes, its held-out perplexity stays within 1.5x
    of the reference's, and greedy text still answers the capital-of-France prompt."""
    run, cfg = make_run(tmp_path, embedded_model_dir, {"ref": {"scheme": "none", "release": False},
                                                       "nf4": {"scheme": "bnb-nf4", "bits": 4}})
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    ref = json.loads((run / "variants/ref/meta.json").read_text())
    nf4 = json.loads((run / "variants/nf4/meta.json").read_text())
    assert nf4["bytes_on_disk"] < 0.5 * ref["bytes_on_disk"]
    # nf4's reference perplexity is the reference at nf4's compute dtype; ref's own is at its own
    # (both bf16 on a CPU with native bf16, float32 elsewhere): equal when the dtypes are.
    if nf4["dtype_compute"] == ref["dtype_compute"]:
        assert nf4["reference_perplexity"] == ref["perplexity"]
    else:
        assert nf4["reference_perplexity"] == pytest.approx(ref["perplexity"], rel=0.02)
    assert ref["perplexity"] < nf4["perplexity"] < 1.5 * ref["perplexity"]
    assert "Paris" in ref["sample"] and "Paris" in nf4["sample"]


def test_config_schemes_are_the_registry():
    """The config cannot import the scheme registry (core sits below variants), so it names the
    schemes itself: this keeps the two lists one list."""
    from typing import get_args

    from pipeline.core.config import VariantConfig
    from pipeline.variants.schemes import SCHEMES

    assert set(get_args(VariantConfig.model_fields["scheme"].annotation)) == set(SCHEMES)

"""A variant's compute dtype when its config says auto (issue 25, point 4): bf16 wherever the device
computes it natively, float32 with the reason otherwise."""
import json
from types import SimpleNamespace

import torch

from pipeline.core import device as dev
from pipeline.stages.quantize import _compute_dtype
from pipeline.variants.schemes import SCHEMES

CPU = torch.device("cpu")


def test_unquantized_weights_compute_in_bf16_on_a_cpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: "avx512_bf16")
    dtype, why = dev.auto_dtype(CPU, quantized=False)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: None)
    dtype, why = dev.auto_dtype(CPU, quantized=False)
    assert dtype == torch.float32 and "emulated" in why


def test_quantized_variants_follow_the_cpu_and_everything_is_bf16_on_cuda(monkeypatch):
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: "amx_bf16")
    dtype, why = dev.auto_dtype(CPU, quantized=True)
    assert dtype == torch.bfloat16 and "amx_bf16" in why and "quantized" in why
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: None)
    assert dev.auto_dtype(CPU, quantized=True)[0] == torch.float32
    assert dev.auto_dtype(torch.device("cuda"), quantized=True)[0] == torch.bfloat16


def test_the_quantize_stage_picks_by_scheme_and_checkpoint_contents(monkeypatch, tmp_path):
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: "avx512_bf16")
    spec = lambda **kw: SimpleNamespace(**{"dtype": "auto", "scheme": "none", "path": None, **kw})  # noqa: E731
    assert _compute_dtype(spec(), SCHEMES["none"], CPU)[0] == torch.bfloat16
    assert _compute_dtype(spec(scheme="gptq"), SCHEMES["gptq"], CPU)[0] == torch.bfloat16
    assert _compute_dtype(spec(dtype="float32"), SCHEMES["none"], CPU) == (torch.float32, "set in the config")
    plain, quant = tmp_path / "plain", tmp_path / "quant"
    plain.mkdir(), quant.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (quant / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"bits": 4}}))
    assert _compute_dtype(spec(scheme="checkpoint", path=str(plain)), SCHEMES["checkpoint"], CPU)[0] == torch.bfloat16
    assert _compute_dtype(spec(scheme="checkpoint", path=str(quant)), SCHEMES["checkpoint"], CPU)[0] == torch.bfloat16
    monkeypatch.setattr(dev, "cpu_bf16_native", lambda: None)
    assert _compute_dtype(spec(scheme="gptq"), SCHEMES["gptq"], CPU)[0] == torch.float32


def test_this_machine_is_read_right():
    flags = open("/proc/cpuinfo").read()
    assert (dev.cpu_bf16_native() is not None) == any(f in flags.split() for f in ("avx512_bf16", "amx_bf16", "bf16"))

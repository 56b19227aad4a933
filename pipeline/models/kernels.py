"""What a loaded variant really computes with: the quantized linear kernels and the device.

    quantized_kernels(model)   # {"library": "gptqmodel", "kernels": {"TorchFusedLinear": 210}, ...}
    device_name(device)        # "NVIDIA H200" or the CPU model from /proc/cpuinfo

Read off the modules and weights as loaded (GPTQModel picks its kernel at load time), by the module
their classes come from; nothing here imports those libraries.
"""
from __future__ import annotations

import platform
from collections import Counter
from pathlib import Path

import torch

_QUANT_LIBRARIES = ("gptqmodel", "auto_gptq", "bitsandbytes", "torchao")


def _library(obj) -> str | None:
    mod = type(obj).__module__ or ""
    return next((lib for lib in _QUANT_LIBRARIES if mod == lib or mod.startswith(lib + ".")), None)


def _dtype_name(x) -> str | None:
    return str(x).removeprefix("torch.") if x is not None else None


def quantized_kernels(model) -> dict:
    """Count the model's linear layers by the class that runs them (module class for GPTQModel and
    bitsandbytes, weight tensor subclass for torchao) with what each kernel is configured with."""
    kernels: Counter = Counter()
    details: dict[str, dict] = {}
    plain = 0
    for _, module in model.named_modules():
        lib = _library(module)
        weight = getattr(module, "weight", None)
        if lib in ("gptqmodel", "auto_gptq", "bitsandbytes"):
            runner = module
        elif isinstance(module, torch.nn.Linear) and weight is not None:
            lib = _library(weight)
            if lib is None and type(weight) in (torch.Tensor, torch.nn.Parameter):
                plain += 1
                continue
            runner, lib = weight, lib or type(weight).__module__
        else:
            continue
        name = type(runner).__name__  # e.g. TorchFusedLinear, Linear4bit, AffineQuantizedTensor
        kernels[name] += 1
        info = details.setdefault(name, {"library": lib, "module": type(runner).__module__})
        if runner is weight:
            for attr in ("_layout", "layout", "block_size", "act_quant_kwargs"):
                value = getattr(weight, attr, None)
                if value is not None:
                    info.setdefault(attr.lstrip("_"), repr(value)[:200])
            inner = getattr(weight, "tensor_impl", None)
            if inner is not None:
                info.setdefault("tensor_impl", type(inner).__name__)
            info.setdefault("dtype", _dtype_name(getattr(weight, "dtype", None)))
        elif lib == "bitsandbytes":
            compute = getattr(module, "compute_dtype", None)
            state = getattr(weight, "quant_state", None)
            quant_type = getattr(state, "quant_type", None) or getattr(weight, "quant_type", None)
            info.setdefault("compute_dtype", _dtype_name(compute) if compute is not None else "input dtype")
            if quant_type:
                info.setdefault("quant_type", str(quant_type))
            if name == "Linear8bitLt":
                info.setdefault("outlier_threshold", getattr(getattr(module, "state", None), "threshold", None))
        else:
            for attr in ("bits", "group_size", "backend", "QUANT_TYPE"):
                value = getattr(module, attr, None)
                if value is not None and not callable(value):
                    info.setdefault(attr, str(getattr(value, "value", value)))
    libraries = sorted({d["library"] for d in details.values()})
    return {"library": ", ".join(libraries) or "none (unquantized)", "kernels": dict(kernels),
            "details": details, "unquantized_linear_layers": plain,
            "compute_dtype": _dtype_name(getattr(model, "dtype", None))}


def device_name(device: torch.device | str) -> str:
    """The accelerator's name, or the CPU model (from /proc/cpuinfo where there is one)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"

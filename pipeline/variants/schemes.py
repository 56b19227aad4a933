"""The one registry of quantization schemes, and the loader every later stage uses.

    SCHEMES["gptq"].quantize(src, out, spec, job)          # the quantize stage
    model, tokenizer = load_variant("runs/x/variants/w4a16-gptq", device="cpu")

Adding a scheme: a quantizer and a loader, one entry here, and its name in the config's `scheme`.
`load_variant` goes by meta.json's `scheme` (the prepared reference has none and loads like `none`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.core.device import resolve_device, resolve_dtype
from pipeline.core.stage import StageError
from pipeline.models.loading import check_weight_files, load_hf, load_tokenizer
from pipeline.variants.checkpoint import load_checkpoint, quantize_checkpoint
from pipeline.variants.quantizers import (load_bnb, load_gptq, load_torchao, quantize_bnb_int8, quantize_bnb_nf4,
                                          quantize_gptq, quantize_none, quantize_torchao_int8wo)


@dataclass(frozen=True)
class Scheme:
    quantize: Callable[..., dict]
    load: Callable[..., Any]
    library: str  # distribution name (for the version and the install hint)
    devices: tuple[str, ...]  # device types this machine's libraries can quantize and run it on
    calibrated: bool = False
    # Kinds of decoder weight matrix (pipeline.models.architecture) the library quantizes.
    quantizes: tuple[str, ...] = ()


SCHEMES: dict[str, Scheme] = {
    "none": Scheme(quantize_none, load_hf, "transformers", ("cpu", "cuda")),
    "gptq": Scheme(quantize_gptq, load_gptq, "gptqmodel", ("cpu", "cuda"), calibrated=True,
                   quantizes=("linear", "conv1d", "fused")),
    "bnb-int8": Scheme(quantize_bnb_int8, load_bnb, "bitsandbytes", ("cpu", "cuda"), quantizes=("linear", "conv1d")),
    "bnb-nf4": Scheme(quantize_bnb_nf4, load_bnb, "bitsandbytes", ("cpu", "cuda"), quantizes=("linear", "conv1d")),
    "torchao-int8wo": Scheme(quantize_torchao_int8wo, load_torchao, "torchao", ("cpu", "cuda"), quantizes=("linear",)),
    # A checkpoint made elsewhere (pipeline/variants/checkpoint.py).
    "checkpoint": Scheme(quantize_checkpoint, load_checkpoint, "transformers", ("cpu", "cuda")),
}


def load_variant(path: str | Path, device: str | torch.device = "auto", dtype: str | None = None):
    """Load a prepared model or a variant directory on `device`, in eval mode; `dtype` overrides the
    compute dtype its meta.json records."""
    path = Path(path)
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} has no meta.json: not a specq model or variant directory") from None
    except json.JSONDecodeError:
        raise StageError(f"corrupt artifact: {meta_path} is not valid JSON") from None
    scheme = meta.get("scheme", "reference")
    loader = load_hf if scheme == "reference" else SCHEMES[scheme].load if scheme in SCHEMES else None
    if loader is None:
        raise StageError(f"{path}: unknown scheme '{scheme}' (known: reference, {', '.join(sorted(SCHEMES))})")
    dev = resolve_device(device) if isinstance(device, str) else device
    dt = resolve_dtype(dtype or meta.get("dtype_compute", "auto"), dev)
    check_weight_files(path, "corrupt artifact")
    return loader(path, meta, dev, dt).eval(), load_tokenizer(path)

"""Device and dtype resolution, in one place so every stage agrees."""
from __future__ import annotations

import torch

from pipeline.core.stage import StageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise StageError("config says device: cuda, but no CUDA device is visible (use device: auto or cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU, where bf16 matmuls are emulated and slow and
    where greedy equality checks need float32 anyway."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]

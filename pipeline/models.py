"""One loader for every later stage: `load_variant(dir) -> (model, tokenizer)`.

The directory's meta.json says how it was made (`scheme`); nothing is inferred from its name.
Loaders are a plain dict scheme -> function; the quantize stage adds its schemes' loaders here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from pipeline.device import resolve_device, resolve_dtype
from pipeline.stage import StageError


def _load_hf(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)


# scheme -> loader(path, meta, device, dtype) -> model
LOADERS: dict[str, Callable] = {"none": _load_hf, "reference": _load_hf}


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_variant(path: str | Path, device: str | torch.device = "auto", dtype: str | None = None):
    """Load a prepared model or a variant directory on `device`, in eval mode.

    `dtype` overrides the compute dtype recorded in meta.json ("auto" = float32 on CPU, bf16 on CUDA).
    """
    path = Path(path)
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} has no meta.json: not a specq model or variant directory") from None
    except json.JSONDecodeError:
        raise StageError(f"corrupt artifact: {meta_path} is not valid JSON") from None
    scheme = meta.get("scheme", "reference")
    if scheme not in LOADERS:
        _register_quantized_loaders()
    if scheme not in LOADERS:
        raise StageError(f"{path}: unknown scheme '{scheme}' (known: {', '.join(sorted(LOADERS))})")
    dev = resolve_device(device) if isinstance(device, str) else device
    dt = resolve_dtype(dtype or meta.get("dtype_compute", "auto"), dev)
    model = LOADERS[scheme](path, meta, dev, dt)
    model.eval()
    return model, load_tokenizer(path)


def _register_quantized_loaders() -> None:
    """Quantized schemes' loaders live beside their quantizers and register on first use."""
    try:
        import pipeline.quantize_schemes  # noqa: F401  (fills LOADERS)
    except ImportError:
        pass


def model_facts(model) -> dict:
    cfg = model.config
    text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": text_cfg.num_hidden_layers,
        "hidden_size": text_cfg.hidden_size,
        "heads": text_cfg.num_attention_heads,
        "kv_heads": getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads,
        "vocab_size": text_cfg.vocab_size,
    }

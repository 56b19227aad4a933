"""`scheme: checkpoint`: a Hugging Face model directory made elsewhere, gated like any variant.

    quantize:
      variants:
        finetune: {scheme: checkpoint, path: /data/models/my-llama-finetune}   # plain bf16 / fp32
        awq:      {scheme: checkpoint, path: /data/models/my-llama-awq}        # pre-quantized

GPTQ and auto-gptq directories load through GPTQModel, the rest through transformers. Before the
first variant is built, `check_checkpoint` wants a causal LM, the reference's tokenizer, readable
weights, a method that loads here, and the config's `bits` / `group_size`. The variant directory
hard-links the weights (README, "Gating a checkpoint made elsewhere").
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.core.stage import StageError, library_version, read_json
from pipeline.models.loading import (SPECQ_FILES, check_weight_files, compare_tokenizers, link_or_copy_tree, load_hf,
                                     weight_bytes)
from pipeline.variants.quantizers import hf_from_pretrained, load_bnb, load_gptq


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict; anything else is one line naming the file."""
    data = read_json(path, "checkpoint file", made_by_specq=False)
    if not isinstance(data, dict):
        raise StageError(f"checkpoint: {path} is not a JSON object")
    return data


def quant_config(path: Path, config: dict | None = None) -> dict:
    """The checkpoint's quantization settings: config.json's quantization_config, else the
    auto-gptq layout's quantize_config.json / quant_config.json; {} for a plain checkpoint."""
    cfg = dict((config if config is not None else _read_json(path / "config.json")).get("quantization_config") or {})
    if not cfg:
        for name in ("quantize_config.json", "quant_config.json"):
            if (path / name).is_file():
                cfg = _read_json(path / name)
                cfg.setdefault("quant_method", "gptq")  # the auto-gptq layout names no method
                break
    return cfg


def quant_method(qcfg: dict) -> str | None:
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method") or qcfg.get("method") or "").lower()
    if not method and (qcfg.get("load_in_4bit") or qcfg.get("load_in_8bit")):
        method = "bitsandbytes"
    return method or "gptq"  # an auto-gptq quantize_config.json with neither key


def inspect_checkpoint(path: Path) -> dict:
    """What a checkpoint directory holds, as recorded in the variant's meta.json."""
    config = _read_json(path / "config.json")
    qcfg = quant_config(path, config)
    files = [{"name": str(p.relative_to(path)), "bytes": p.stat().st_size}
             for p in sorted(path.rglob("*")) if p.is_file() and p.name not in SPECQ_FILES]
    text = config.get("text_config") or {}
    return {
        "path": str(path.resolve()),
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "dtype": config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype"),
        "quant_method": quant_method(qcfg),
        "quantization_config": qcfg or None,
        "vocab_size": config.get("vocab_size") or text.get("vocab_size"),
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "weight_bytes": weight_bytes(path),
    }


def _check_loadable(label: str, path: Path, info: dict, device: torch.device) -> None:
    """transformers loads it as a causal LM, and knows a (non-GPTQ) quantization method and finds its
    environment usable: from_pretrained's checks before it reads weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"{label}: transformers cannot read {path / 'config.json'} "
                         f"({str(e).splitlines()[0][:160]})") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise StageError(f"{label}: {path} holds a {info['architecture'] or config.model_type}, which transformers "
                         "cannot load as a causal LM (AutoModelForCausalLM)")
    method = info["quant_method"]
    if method in (None, "gptq"):
        return
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AutoHfQuantizer

    qcfg = dict(info["quantization_config"])
    qcfg.setdefault("quant_method", method)
    # transformers files bitsandbytes under two keys, one per bit width.
    key = f"{method}_{'8bit' if qcfg.get('load_in_8bit') else '4bit'}" if method == "bitsandbytes" else method
    if key not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise StageError(f"{label}: {path} is quantized with '{method}', which transformers "
                         f"{library_version('transformers')} does not know")
    try:
        quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=True)
        quantizer.validate_environment(device_map={"": str(device)}, weights_only=True, dtype=None)
    except (ImportError, ValueError, RuntimeError, TypeError) as e:
        raise StageError(f"{label}: transformers cannot load the '{method}' checkpoint {path} here "
                         f"({str(e).splitlines()[0][:160]})") from None


def check_checkpoint(variant: str, spec, reference_tokenizer, device: torch.device) -> dict:
    """Every check on a `checkpoint` variant that needs no weights loaded; returns inspect_checkpoint's facts."""
    from transformers import AutoTokenizer

    label = f"variant '{variant}'"
    if not spec.path:
        raise StageError(f"{label}: scheme checkpoint needs `path` (a Hugging Face model directory)")
    path = Path(spec.path).expanduser()
    if not path.is_dir():
        raise StageError(f"{label}: checkpoint path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise StageError(f"{label}: checkpoint path {path} is not a model directory (no config.json)")
    info = inspect_checkpoint(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise StageError(f"{label}: checkpoint {path} has no usable tokenizer ({str(e).splitlines()[0][:120]}); "
                         "copy the reference's tokenizer files into it if it uses the same one") from None
    compare_tokenizers(f"{label}: checkpoint {path}", reference_tokenizer, tokenizer, "checkpoint", "reference")
    vocab = info["vocab_size"]
    if vocab is not None and vocab < len(reference_tokenizer):
        raise StageError(f"{label}: checkpoint {path} has {vocab} embedding rows, fewer than the "
                         f"{len(reference_tokenizer)} tokens of the reference's tokenizer")
    check_weight_files(path, label)
    qcfg = info["quantization_config"] or {}
    for key, want in (("bits", spec.bits), ("group_size", spec.group_size)):
        if want is not None and qcfg.get(key) != want:
            raise StageError(f"{label}: config says {key} {want}, checkpoint {path} has {qcfg.get(key)} "
                             f"(quantization: {info['quant_method'] or 'none'})")
    if info["quant_method"] == "gptq" and library_version("gptqmodel") is None:
        raise StageError(f"{label}: checkpoint {path} is GPTQ, which needs the Python package gptqmodel "
                         "(pip install gptqmodel)")
    _check_loadable(label, path, info, device)
    return info


def quantize_checkpoint(src: Path, out: Path, spec, job) -> dict:
    """Link the checkpoint into the variant directory (check_checkpoint has passed)."""
    path = Path(spec.path).expanduser()
    info = inspect_checkpoint(path)
    link_or_copy_tree(path, out)
    qcfg = info["quantization_config"] or {}
    method = info["quant_method"]
    library = "gptqmodel" if method == "gptq" else "transformers"
    return {"storage": f"hard links to the checkpoint {info['path']}", "library": library,
            "library_version": library_version(library), "checkpoint_path": info["path"],
            "checkpoint": info, "quant_method": method,
            "bits": qcfg.get("bits") or qcfg.get("w_bit"), "group_size": qcfg.get("group_size") or qcfg.get("q_group_size"),
            "desc_act": qcfg.get("desc_act"), "sym": qcfg.get("sym")}


def load_checkpoint(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    """GPTQ and bitsandbytes through their schemes' loaders; anything else through transformers."""
    method = meta["checkpoint"]["quant_method"]  # quantize_checkpoint's record
    if method == "gptq":
        return load_gptq(path, meta, device, dtype)
    if method == "bitsandbytes":
        return load_bnb(path, meta, device, dtype)
    if method is None:
        return load_hf(path, meta, device, dtype)
    return hf_from_pretrained(path, dtype, device)

"""One loader for every later stage: `load_variant(dir) -> (model, tokenizer)`.

The directory's meta.json says how it was made (`scheme`); nothing is inferred from its name.
Loaders are a plain dict scheme -> function; the quantize stage adds its schemes' loaders here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from pipeline.core.device import resolve_device, resolve_dtype
from pipeline.core.stage import StageError


def _load_hf(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)


# scheme -> loader(path, meta, device, dtype) -> model
LOADERS: dict[str, Callable] = {"none": _load_hf, "reference": _load_hf}


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


PROBE_TEXT = "Hello, world! def f(x): return {\"a\": [1, 2.5]}  Le café coûte 3€.\n\tÜber 東京"


def compare_tokenizers(label: str, reference, other, other_name: str = "other", reference_name: str = "reference"):
    """Refuse (one line starting with `label`, naming the first difference) unless `other` has
    the reference's vocabulary (token -> id for every entry), gives the same ids for a probe text
    and has the same EOS/BOS."""
    rv, ov = reference.get_vocab(), other.get_vocab()
    if len(rv) != len(ov):
        raise StageError(f"{label}: tokenizer vocab has {len(ov)} entries, the {reference_name}'s has {len(rv)}")
    for token, idx in sorted(rv.items(), key=lambda kv: kv[1]):
        if ov.get(token) != idx:
            raise StageError(f"{label}: token {token!r} has id {ov.get(token)} in the {other_name}'s tokenizer, "
                             f"{idx} in the {reference_name}'s")
    r_ids, o_ids = reference.encode(PROBE_TEXT), other.encode(PROBE_TEXT)
    if r_ids != o_ids:
        i = next((i for i, (a, b) in enumerate(zip(r_ids, o_ids)) if a != b), min(len(r_ids), len(o_ids)))
        raise StageError(f"{label}: probe text tokenizes differently at token {i} "
                         f"({other_name} {o_ids[i:i + 3]}, {reference_name} {r_ids[i:i + 3]})")
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(reference, name, None) != getattr(other, name, None):
            raise StageError(f"{label}: {name} is {getattr(other, name, None)} in the {other_name}'s "
                             f"tokenizer, {getattr(reference, name, None)} in the {reference_name}'s")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a model directory (config and tokenizer files excluded)."""
    return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def check_weight_files(path: str | Path, what: str) -> list[Path]:
    """Refuse a model directory whose weights cannot be read, with one line naming the file,
    before any loader is called: no weight files, a shard the index names but the directory
    lacks, or a safetensors file that is truncated or corrupt (safetensors checks that the
    header parses and that its offsets cover the file exactly; no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    files = weight_files(path)
    if not files:
        raise StageError(f"{what}: {path} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    for index in path.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (json.JSONDecodeError, AttributeError):
            raise StageError(f"{what}: {index} is not a valid weight index (not JSON with a weight_map)") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise StageError(f"{what}: {index.name} names {missing[0]}, which {path} does not have")
    for f in files:
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt"):
                    pass
            except (SafetensorError, OSError) as e:
                raise StageError(f"{what}: weight file {f} is truncated or corrupt "
                                 f"({str(e).splitlines()[0][:120]})") from None
    return files


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
    check_weight_files(path, "corrupt artifact")
    model = LOADERS[scheme](path, meta, dev, dt)
    model.eval()
    return model, load_tokenizer(path)


def _register_quantized_loaders() -> None:
    """Quantized schemes' loaders live beside their quantizers and register on first use."""
    try:
        import pipeline.variants.schemes  # noqa: F401  (fills LOADERS)
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

"""Loading plain Hugging Face models and tokenizers; a model directory's weight files: checked
before they load, hard-linked into a variant, counted on disk.

Variants load through pipeline.variants.schemes.load_variant, which calls `load_hf` for plain ones.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from pipeline.core.stage import StageError
from pipeline.models.architecture import architecture, text_config


def load_hf(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    """A plain Hugging Face directory (the reference, a `none` variant): transformers' own loader."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


PROBE_TEXT = "Hello, world! def f(x): return {\"a\": [1, 2.5]}  Le café coûte 3€.\n\tÜber 東京"


def compare_tokenizers(label: str, reference, other, other_name: str = "other", reference_name: str = "reference"):
    """Refuse (one line naming the first difference) unless `other` has the reference's vocabulary,
    ids for a probe text, and EOS/BOS."""
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


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files in a model directory (config/tokenizer files excluded)."""
    return sum(p.stat().st_size for p in weight_files(path))


# Files of a prepared model or variant that belong to specq, not to the HF checkpoint.
SPECQ_FILES = frozenset({"meta.json", "model_info.json"})


def link_or_copy_tree(src: Path, out: Path) -> None:
    """Hard-link every weight file of `src` into `out` (copy across file systems), copy the rest
    but SPECQ_FILES. Weight files are never written in place, so sharing inodes is safe; config and
    tokenizer files are (save_pretrained), and through a hard link would edit the source."""
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or rel.name in SPECQ_FILES:
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not p.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(p, dst)
            continue
        try:
            os.link(p, dst)
        except OSError:
            shutil.copy2(p, dst)


def check_weight_files(path: str | Path, what: str) -> list[Path]:
    """Refuse a model directory whose weights cannot be read, in one line naming the file: no weight
    files, a shard its index names but it lacks, a truncated or corrupt safetensors header."""
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


def model_facts(model) -> dict:
    text_cfg = text_config(model.config)
    return {
        "architecture": architecture(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": text_cfg.num_hidden_layers,
        "hidden_size": text_cfg.hidden_size,
        "heads": text_cfg.num_attention_heads,
        "kv_heads": getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads,
        "vocab_size": text_cfg.vocab_size,
    }

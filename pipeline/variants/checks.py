"""The quantize stage's fail-fast checks: everything that can refuse a variant before the first
(possibly long) quantization starts.

    facts = check_variant("w4a16-gptq", spec, src, reference_tokenizer, device)   # or StageError

The scheme runs on this device with its library installed; GPTQ knows the architecture and its group
size divides every input width; a quantizing scheme finds weights it quantizes; a `checkpoint`
directory passes check_checkpoint.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import torch

from pipeline.core.stage import StageError, library_version
from pipeline.models.architecture import WeightMatrix, architecture, meta_model, weight_matrices
from pipeline.variants.checkpoint import check_checkpoint
from pipeline.variants.schemes import SCHEMES


def reference_matrices(src: Path) -> list[WeightMatrix]:
    """The decoder weight matrices of the model in `src` (what GPTQ quantizes), on the meta device."""
    cfg = Path(src) / "config.json"
    return _matrices(str(Path(src).resolve()), cfg.stat().st_mtime_ns, cfg.stat().st_size)


@functools.lru_cache(maxsize=4)
def _matrices(src: str, mtime_ns: int, size: int) -> list[WeightMatrix]:
    from transformers import AutoConfig

    return weight_matrices(meta_model(AutoConfig.from_pretrained(src)))


def architecture_of(src: Path) -> str:
    from transformers import AutoConfig

    return architecture(AutoConfig.from_pretrained(src))


def check_supported(variant: str, scheme: str, device: torch.device) -> None:
    """One line naming the scheme, the device and what would work, before any time is spent."""
    s = SCHEMES[scheme]
    if device.type not in s.devices:
        here = [k for k, v in SCHEMES.items() if device.type in v.devices]
        raise StageError(f"variant '{variant}': scheme {scheme} is not supported on device {device.type} "
                         f"(it runs on {', '.join(s.devices)}); schemes that work on {device.type}: "
                         f"{', '.join(here)}")
    if library_version(s.library) is None:
        raise StageError(f"variant '{variant}': scheme {scheme} needs the Python package {s.library} "
                         f"(pip install {s.library})")


def check_group_size(src: Path, group_size: int | None, variant: str) -> None:
    """The group size must divide every quantized layer's input width; say which one it does not."""
    if group_size in (None, -1):  # -1: one group per output channel
        return
    if group_size <= 0:
        raise StageError(f"variant '{variant}': group_size must be positive or -1, not {group_size}")
    widths = {w.name.removesuffix(".weight"): w.input_width for w in reference_matrices(src)}
    if not widths:
        raise StageError(f"variant '{variant}': no decoder weight matrices found in {src} to check group_size against")
    for name, width in widths.items():
        if width % group_size:
            ok = [g for g in (32, 64, 128) if all(w % g == 0 for w in widths.values())]
            raise StageError(
                f"variant '{variant}': group_size {group_size} does not divide layer {name} "
                f"(input width {width}); group sizes that divide every layer: {ok or 'none of 32/64/128'}")


def check_gptq_architecture(src: Path, variant: str) -> None:
    """GPTQModel quantizes the architectures it has a definition for (a guessed layout fails midway)."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(src).model_type
    with contextlib.redirect_stdout(sys.stderr):  # GPTQModel prints a banner on import
        from gptqmodel.models.auto import SUPPORTED_MODELS
    if model_type.lower() not in SUPPORTED_MODELS:
        raise StageError(f"variant '{variant}': GPTQModel {library_version('gptqmodel')} has no definition for "
                         f"architecture {architecture_of(src)} (model_type {model_type}); use bnb-int8, bnb-nf4 "
                         "or torchao-int8wo, or a GPTQ checkpoint made elsewhere (scheme checkpoint)")


def check_coverage(src: Path, variant: str, scheme_name: str) -> None:
    """A quantizing scheme must find decoder weights of a kind its library quantizes (else it copies)."""
    scheme = SCHEMES[scheme_name]
    matrices = reference_matrices(src)
    if any(w.kind in scheme.quantizes for w in matrices):
        return
    kinds = sorted({w.kind for w in matrices} - {"other"})
    handle = [k for k, v in SCHEMES.items() if v.quantizes and set(kinds) <= set(v.quantizes)]
    raise StageError(f"variant '{variant}': scheme {scheme_name} quantizes {'/'.join(scheme.quantizes)} layers only, "
                     f"and the decoder weights of {architecture_of(src)} are {'/'.join(kinds) or 'not found'}; "
                     f"schemes that handle them: {', '.join(handle) or 'none'}")


def check_variant(variant: str, spec, src: Path, reference_tokenizer, device: torch.device) -> dict:
    """Every check on one variant that can fail before any is built; returns facts for meta.json."""
    check_supported(variant, spec.scheme, device)
    if spec.scheme == "checkpoint":
        return {"checkpoint": check_checkpoint(variant, spec, reference_tokenizer, device)}
    if spec.scheme == "gptq":
        check_gptq_architecture(src, variant)
        check_group_size(src, spec.group_size or 128, variant)
    if SCHEMES[spec.scheme].quantizes:
        check_coverage(src, variant, spec.scheme)
    return {}

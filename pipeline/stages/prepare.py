"""prepare: resolve MODEL to a plain HF directory at runs/<run>/model/.

    python -m pipeline prepare --model smollm2-135m --run runs/smollm2-135m
    make prepare MODEL=/path/to/hf-dir

MODEL is the alias `smollm2-135m`, a local HF directory, or a hub id (pipeline/models/source.py,
whose check_model refuses an unusable MODEL first); it is cast to `prepare.dtype` and saved as
safetensors with its tokenizer.
"""
from __future__ import annotations

from pipeline.core.device import DTYPES
from pipeline.core.stage import StageContext, atomic_dir, atomic_write_json, dir_bytes, progress, sha256_file
from pipeline.models.loading import model_facts
from pipeline.models.source import load_source


def run(ctx: StageContext) -> None:
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
             f"stored in {ctx.config.prepare.dtype} (each variant's compute dtype: quantize) -> {out}")

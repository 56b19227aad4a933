"""`self:<variant>`: a variant of the target (e.g. `self:w4a16-gptq`) drafting for it.

Loads runs/<run>/variants/<variant> through pipeline.variants.schemes.load_variant (its meta.json says the
scheme), on the target's device, and drafts with its own static cache.
"""
from __future__ import annotations

from pipeline.core.stage import StageError
from pipeline.decode.cache import hf_model
from pipeline.decode.drafts import ModelDraft
from pipeline.models.loading import compare_tokenizers
from pipeline.variants.schemes import load_variant


def variant_dir(spec, run_dir):
    _, _, name = spec.partition(":")
    if not name:
        raise StageError(f"draft {spec}: expected self:<variant>")
    if run_dir is None:
        raise StageError(f"draft {spec}: needs a run directory holding variants/{name}")
    path = run_dir / "variants" / name
    if not (path / "meta.json").is_file():
        have = sorted(p.name for p in (run_dir / "variants").glob("*") if (p / "meta.json").is_file()) \
            if (run_dir / "variants").is_dir() else []
        raise StageError(f"draft {spec}: no variant '{name}' in {run_dir / 'variants'} "
                         f"(have: {', '.join(have) or 'none'})")
    return path


def build(spec, target, tokenizer, run_dir, device):
    model, tok = load_variant(variant_dir(spec, run_dir), device=device)
    if tokenizer is not None:
        compare_tokenizers(f"draft {spec}", tokenizer, tok, "draft", "target")
    vocab = hf_model(target).get_output_embeddings().weight.shape[0]
    return ModelDraft(spec, model, vocab_size=vocab)

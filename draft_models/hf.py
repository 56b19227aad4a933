"""`hf:<id or path>`: an external (smaller) causal LM as the draft.

Its tokenizer must be the target's: the same vocabulary (token -> id for every entry), the same
ids for a probe text, the same EOS/BOS; otherwise the build stops with one line naming the first
difference. Logit widths may still differ (padded embedding rows): q is cut or padded to the
target's width, padded entries getting probability 0.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import StageError
from pipeline.decode.cache import hf_model
from pipeline.decode.drafts import ModelDraft
from pipeline.models.architecture import check_engine_cache
from pipeline.models.loading import check_weight_files, compare_tokenizers


def build(spec, target, tokenizer, run_dir, device):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer


    _, _, source = spec.partition(":")
    if not source:
        raise StageError(f"draft {spec}: expected hf:<hub id or local path>")
    if Path(source).expanduser().is_dir():
        check_weight_files(Path(source).expanduser(), f"draft {spec}")
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=next(hf_model(target).parameters()).dtype)
    except (OSError, ValueError, SafetensorError) as e:
        raise StageError(f"draft {spec}: cannot load '{source}' ({str(e).splitlines()[0][:160]})") from None
    if tokenizer is not None:
        compare_tokenizers(f"draft {spec}", tokenizer, tok, "draft", "target")
    check_engine_cache(model.config)
    model = model.to(device).eval()
    vocab = hf_model(target).get_output_embeddings().weight.shape[0]
    return ModelDraft(spec, model, vocab_size=vocab)

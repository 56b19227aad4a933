"""`ngram` / `ngram:<max_n>`: prompt lookup, a model-free draft (max_n defaults to 3).

The runtime class is pipeline.decode.drafts.NgramDraft (the lookup, one-hot q, the plain-step
fallback when nothing matches); this module only turns the spec string into one.
"""
from __future__ import annotations

from pipeline.core.stage import StageError
from pipeline.decode.drafts import NgramDraft


def build(spec, target, tokenizer, run_dir, device):
    _, _, arg = spec.partition(":")
    try:
        max_n = int(arg) if arg else 3
    except ValueError:
        max_n = 0
    if max_n < 1:
        raise StageError(f"draft {spec}: expected ngram or ngram:<max_n> with max_n >= 1")
    return NgramDraft(spec, max_n)

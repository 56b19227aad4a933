"""Draft models for speculative decoding: one module per kind, a plain dict kind -> builder.

    from draft_models.registry import build_draft, draft_slug
    draft = build_draft("layerskip:8", target, tokenizer, run_dir, device)   # -> engine Draft
    draft_slug("self:w4a16-gptq")                                             # "self-w4a16-gptq"

Modules: registry (BUILDERS: kind -> builder, spec parsing, build_draft), and one per kind:
ngram (prompt lookup), layerskip (the target's first n layers), selfdraft (a quantized variant of
the target), hf (any causal LM with the target's tokenizer). A draft's tokenizer must be the
target's (pipeline.models.loading.compare_tokenizers).

Spec strings: `ngram` (or `ngram:<max_n>`), `layerskip:<n>`, `self:<variant>`, `hf:<id or path>`.
Every builder returns a runtime draft from pipeline/decode/drafts.py (ModelDraft or NgramDraft),
which has the engine's Draft interface: prefill, propose (tokens + q), accept (roll back to the
kept prefix). This package only builds: it checks the spec and the tokenizer and loads weights.
"""

"""specq's decode core: the engine, sampling and the verify rule, timing, and runtime drafts.

    from pipeline.decode.engine import generate
    from pipeline.decode.drafts import NgramDraft
    res = generate(model, ids, 32, draft=NgramDraft("ngram"), k=4)

Each module is imported by its own name (this file re-exports nothing). The package imports
nothing else of specq: stages and draft_models/ import it, never the other way round.
"""

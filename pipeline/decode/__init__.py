"""specq's decode core: the engine, sampling and the verify rule, timing, and runtime drafts.

    from pipeline.decode.engine import generate
    from pipeline.decode.sampling import SamplingParams
    from pipeline.decode.drafts import ModelDraft, NgramDraft
    res = generate(model, ids, 32, draft=NgramDraft("ngram"), k=4, sampling=SamplingParams(0.7))

Modules, each imported by its own name (this file re-exports nothing):
    steps     prefill, decode_one_token, the EOS cut, GenerationResult: what both loops share
    engine    draft_k, verify, speculative_step, generate (plain at any B, speculative at B = 1)
    batched   speculative decoding at B > 1: the synchronised scheme, which generate dispatches to
    cache     CachedModel (a model and its static KV cache), and the table of compiled sessions
    compiled  CompileSession: compiled decode steps and the record of what really ran
    sampling  logits -> probabilities, the Leviathan/Chen rule
    drafts    the Draft protocol, ModelDraft, NgramDraft
    timing    Timer, synchronize, wall_clock
    errors    EngineError

The package imports nothing else of specq: stages, libraries and draft_models/ import it, never
the other way round (tests/test_imports.py).
"""

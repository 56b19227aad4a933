"""specq's decode core: the engine, sampling and the verify rule, timing, and runtime drafts.

    from pipeline.decode import generate, SamplingParams, ModelDraft, NgramDraft, Timer
    res = generate(model, ids, 32, draft=NgramDraft("ngram"), k=4, sampling=SamplingParams(0.7))

Modules: engine (prefill, decode_one_token, draft_k, verify, speculative_step, generate), batched
(speculative decoding at B > 1: the synchronised scheme, which generate dispatches to), cache
(CachedModel: a model and its static KV cache), sampling (logits -> probabilities, the
Leviathan/Chen rule), drafts (the Draft protocol, ModelDraft, NgramDraft), timing (Timer,
synchronize), errors (EngineError). The package imports nothing from the stages: stages and
draft_models/ import it, never the other way round.
"""
from pipeline.decode.cache import CachedModel, cache_kwarg, hf_model
from pipeline.decode.drafts import Draft, ModelDraft, NgramDraft
from pipeline.decode.engine import (GenerationResult, RoundRecord, decode_one_token, draft_k, generate, prefill,
                                    speculative_step, verify)
from pipeline.decode.errors import EngineError
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.timing import Timer, synchronize, wall_clock

__all__ = ["CachedModel", "cache_kwarg", "hf_model", "Draft", "ModelDraft", "NgramDraft", "GenerationResult",
           "RoundRecord", "decode_one_token", "draft_k", "generate", "prefill", "speculative_step", "verify",
           "EngineError", "SamplingParams", "Timer", "synchronize", "wall_clock"]

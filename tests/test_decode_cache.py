"""The static cache's memory rules: chunked prefill equals one-shot prefill, a cell asking for an
exact length never runs on a longer pooled cache, and release frees the pool.

Chunked vs one-shot: the same first token, last-position logits and cached K/V within float32
rounding (atol 1e-5 on values of order 1: the chunks' attention sums the same terms in another
order).

    .venv/bin/python -m pytest -q tests/test_decode_cache.py
"""
from __future__ import annotations

import pytest
import torch

from pipeline.decode.cache import CachedModel, EngineError
from pipeline.decode.engine import generate, prefill
from pipeline.decode.sampling import SamplingParams


def _prompt(vocab: int, t: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(7))


@torch.inference_mode()
def test_chunked_prefill_matches_one_shot(tiny_model):
    ids = _prompt(tiny_model.config.vocab_size, 23)
    whole = CachedModel(tiny_model, batch=2, max_len=40, slot="test-whole", exact=True)
    chunked = CachedModel(tiny_model, batch=2, max_len=40, slot="test-chunked", exact=True)
    logits_whole = whole.prefill(ids)  # [2, 1, V]
    logits_chunked = chunked.prefill(ids, chunk=5)  # chunks of 5, 5, 5, 5, 3 at their own positions
    assert chunked.length == whole.length == 23
    torch.testing.assert_close(logits_chunked, logits_whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(whole.cache.layers, chunked.cache.layers):
        torch.testing.assert_close(a.keys[:, :, :23], b.keys[:, :, :23], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values[:, :, :23], b.values[:, :, :23], atol=1e-5, rtol=1e-5)
    # The engine's prefill with a chunk: the same first token as the one-shot logits pick.
    chunked.rollback(0)
    first = prefill(chunked, ids, SamplingParams(), None, chunk=4)
    assert torch.equal(first, logits_whole[:, -1].argmax(-1))
    CachedModel.release(tiny_model, "test-whole")
    CachedModel.release(tiny_model, "test-chunked")


def test_generate_with_a_chunked_prefill_gives_the_same_tokens(tiny_model):
    ids = _prompt(tiny_model.config.vocab_size, 30, batch=1)
    assert generate(tiny_model, ids, 8, prefill_chunk=7).tokens == generate(tiny_model, ids, 8).tokens


def test_exact_cache_length_and_release(tiny_model):
    kv_per_position = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 kv heads, head_dim 16, float32
    big = CachedModel(tiny_model, batch=1, max_len=300, slot="test-pool")
    assert big.max_len == 300
    # Without `exact` a smaller request reuses the larger pooled cache (the acceptance stage's way).
    assert CachedModel(tiny_model, batch=1, max_len=100, slot="test-pool").cache is big.cache
    # A timed cell asks for its own length: the longer cache is dropped, one of exactly 100 made.
    small = CachedModel(tiny_model, batch=1, max_len=100, slot="test-pool", exact=True)
    assert small.max_len == 100 and small.cache is not big.cache
    assert CachedModel(tiny_model, batch=1, max_len=100, slot="test-pool", exact=True).cache is small.cache
    assert CachedModel.release(tiny_model, "test-pool") == 0  # never written: StaticCache allocates lazily
    small = CachedModel(tiny_model, batch=1, max_len=100, slot="test-pool", exact=True)
    small.prefill(torch.zeros(1, 3, dtype=torch.long))
    assert CachedModel.release(tiny_model, "test-pool") == 100 * kv_per_position
    assert CachedModel(tiny_model, batch=1, max_len=100, slot="test-pool").cache is not small.cache
    CachedModel.release(tiny_model, "test-pool")
    # generate(cache_len=...) uses exactly that length, and refuses one too short for the run.
    res = generate(tiny_model, torch.zeros(1, 5, dtype=torch.long), 4, cache_len=70)
    assert len(res.tokens) == 4
    assert CachedModel(tiny_model, batch=1, max_len=10).max_len == 70  # the pooled one, not a longer one
    with pytest.raises(EngineError, match="cache_len 9"):  # 5 + 4 + 1 positions do not fit in 9
        generate(tiny_model, torch.zeros(1, 5, dtype=torch.long), 4, cache_len=9)

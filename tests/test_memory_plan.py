"""The latency memory plan: arithmetic checked against real allocations on a tiny model, and
configs/gpu.yaml planned for an 8B shape against 80 GB and 40 GB without allocating anything."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.config import load_config
from pipeline.latency.memory import ModelShape, cache_len, meta_weight_bytes, plan_grid

REPO = Path(__file__).resolve().parent.parent


def llama_8b_config():
    """Llama-3.1-8B's shape (config values from its published config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       tie_word_embeddings=False)


def test_weight_and_cache_bytes_match_real_allocations(tiny_model):
    """Meta-device weight bytes equal the real model's; the plan's cache bytes equal what a
    transformers StaticCache of the engine's length really allocates (exact, tolerance 0)."""
    from transformers import StaticCache

    real = sum(p.numel() * p.element_size() for p in {id(p): p for p in tiny_model.parameters()}.values()) \
        + sum(b.numel() * b.element_size() for b in tiny_model.buffers())
    assert meta_weight_bytes(tiny_model.config, torch.float32) == real
    shape = ModelShape.from_model(tiny_model, real)
    batch, context, new = 3, 40, 8
    length = cache_len(context, new)
    cache = StaticCache(config=tiny_model.config, max_cache_len=length)
    ids = torch.randint(0, tiny_model.config.vocab_size, (batch, context))
    with torch.inference_mode():
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    plan = plan_grid(shape, [batch], [context], new, budget_bytes=1e12, device_type="cpu")
    assert plan.cells[0].cache_bytes == allocated


@pytest.fixture(scope="module")
def shape_8b():
    return ModelShape.from_config(llama_8b_config(), torch.bfloat16)


def test_8b_shape_arithmetic(shape_8b):
    assert shape_8b.kv_bytes_per_token == 128 * 1024  # 2 * 32 layers * 8 heads * 128 dims * 2 bytes
    assert 16.0e9 < shape_8b.weight_bytes < 16.1e9  # 8.03B parameters in bf16


def _gpu_plan(shape, card_bytes: float):
    lat = load_config(REPO / "configs/gpu.yaml").latency
    k_max = lat.k_max or load_config(REPO / "configs/gpu.yaml").acceptance.k_max
    reserve = max(1 << 30, 0.05 * card_bytes)
    return lat, plan_grid(shape, lat.batch_sizes, lat.context_lengths, lat.new_tokens,
                          budget_bytes=card_bytes - shape.weight_bytes - reserve, device_type="cuda",
                          verify_width=k_max + 1)


def test_gpu_yaml_on_80gb_keeps_every_cell_by_chunking_the_big_prefill(shape_8b):
    lat, plan = _gpu_plan(shape_8b, 80e9)
    cells = plan.cells
    assert not plan.dropped
    assert len(cells) == len(lat.batch_sizes) * len(lat.context_lengths)
    big = next(c for c in cells if c.batch == 32 and c.context == 8192)
    assert big.cache_bytes == pytest.approx(34.6e9, rel=0.01)  # the arithmetic
    assert big.prefill_chunk is not None and big.prefill_chunk < 8192
    # The one-shot prefill of 262k tokens would not fit beside that cache.
    assert big.peak_bytes <= plan.budget_bytes
    small = next(c for c in cells if c.batch == 1 and c.context == 128)
    assert small.prefill_chunk is None


def test_gpu_yaml_on_40gb_drops_what_cannot_fit_with_a_reason(shape_8b):
    _, plan = _gpu_plan(shape_8b, 40e9)
    dropped = {(d["batch"], d["context"]) for d in plan.dropped}
    assert (32, 8192) in dropped  # 34.6 GB of cache alone beside 16 GB of weights
    assert all("needs" in d["reason"] and d["needs_bytes"] > d["budget_bytes"] for d in plan.dropped)
    assert (1, 128) not in dropped


def test_order_one_live_cache_each_of_its_own_length(shape_8b):
    _, plan = _gpu_plan(shape_8b, 80e9)
    live = None
    seen = []
    for step in plan.steps:
        if step["action"] == "run":
            assert live is None, "a cache is still alive when the next cell runs"
            assert step["cache_len"] == cache_len(step["context"], 64)
            live = (step["batch"], step["cache_len"])
            seen.append((step["batch"], step["context"]))
        else:
            assert (step["batch"], step["cache_len"]) == live
            live = None
    assert live is None  # the last cache is freed too
    assert seen == sorted(seen)  # batch ascending, then context ascending

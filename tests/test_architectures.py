"""Architecture-neutral module handling (pipeline/models/architecture.py) on tiny random Llama, Qwen2,
GPT-2 (Conv1D layers under transformer.h), Qwen2-MoE (fused expert tensors) and Gemma 2
(sliding-window cache), each built inside the test.

    .venv/bin/python -m pytest -q tests/test_architectures.py
"""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import ARCHITECTURES, make_tiny_model
from pipeline.models.architecture import check_engine_cache, decoder_layers, float_matrix_fraction, weight_matrices
from pipeline.core.stage import StageError

# Where each family keeps its decoder blocks, written out here as the independent reference.
LAYER_PATH = {"llama": "model.layers", "qwen2": "model.layers", "gpt2": "transformer.h",
              "qwen2_moe": "model.layers", "gemma2": "model.layers"}
ENGINE_OK = ("llama", "qwen2", "gpt2", "qwen2_moe")


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    return {arch: make_tiny_model(arch, tiny_tokenizer) for arch in ARCHITECTURES}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_decoder_layers_and_weight_matrices(models, arch):
    model = models[arch]
    path, layers = decoder_layers(model)
    assert path == LAYER_PATH[arch] and layers is model.get_submodule(path) and len(layers) == 4
    matrices = weight_matrices(model)
    # Every >= 2-D parameter of the blocks, nothing outside them (embeddings, LM head).
    in_blocks = {n for n, p in model.named_parameters() if n.startswith(path + ".") and p.dim() >= 2}
    assert {w.name for w in matrices} == in_blocks
    kinds = {w.kind for w in matrices}
    assert kinds == {"llama": {"linear"}, "qwen2": {"linear"}, "gemma2": {"linear"}, "gpt2": {"conv1d"},
                     "qwen2_moe": {"linear", "fused", "other"}}[arch]
    # The input width is checked by multiplying: a wrong width (GPT-2's [in, out] read as
    # [out, in]) fails the matmul.
    for w in matrices:
        x = torch.randn(2, w.input_width)
        owner = model.get_submodule(w.name.rpartition(".")[0])
        with torch.no_grad():
            if w.kind in ("linear", "conv1d"):
                owner(x)
            else:
                torch.nn.functional.linear(x, w.param[0] if w.param.dim() == 3 else w.param)


def _old_llama_noise(model, relative_std: float, seed: int) -> int:
    """The implementation before issue 12 (nn.Linear under `.layers.` only): the reference the
    Llama result must still equal, so configs/damaged.yaml damages the same weights as before."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}.":
                noise = torch.randn(m.weight.shape, generator=gen, dtype=torch.float32)
                m.weight.add_((noise * (relative_std * m.weight.float().std())).to(m.weight.dtype))
                n += 1
    return n


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weight_noise_reaches_every_decoder_matrix(models, arch):
    from pipeline.variants.quantizers import add_weight_noise

    model = copy.deepcopy(models[arch])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    matrices = {w.name for w in weight_matrices(model)}
    changed = add_weight_noise(model, 0.5, seed=7)
    experts = sum(p.shape[0] for n, p in model.named_parameters() if n in matrices and p.dim() == 3)
    assert changed == len(matrices) - sum(1 for n in matrices if dict(model.named_parameters())[n].dim() == 3) + experts
    for name, p in model.named_parameters():
        delta = (p.detach() - before[name]).float()
        if name not in matrices:
            assert torch.equal(delta, torch.zeros_like(delta)), name  # embeddings, norms, biases
            continue
        for d, w in zip(delta if p.dim() == 3 else [delta], before[name] if p.dim() == 3 else [before[name]]):
            # std(noise) / std(w) = 0.5; the smallest matrix (a 4 x 64 router) has 256 entries,
            # so the sample std is within ~5% (1 s.e.); 20% is 4 s.e.
            assert d.std().item() / w.float().std().item() == pytest.approx(0.5, rel=0.2), name
    if arch == "llama":
        reference = copy.deepcopy(models[arch])
        assert _old_llama_noise(reference, 0.5, seed=7) == changed == 28
        for (n, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(a, b), n


def test_float_fraction_of_an_unquantized_model_is_one(models):
    for arch in ARCHITECTURES:
        total = sum(w.param.numel() for w in weight_matrices(models[arch]))
        assert float_matrix_fraction(models[arch], total) == 1.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_cache_check_names_the_architecture(models, arch):
    if arch in ENGINE_OK:
        check_engine_cache(models[arch])
        return
    with pytest.raises(StageError) as e:
        check_engine_cache(models[arch])
    msg = str(e.value)
    assert "Gemma2ForCausalLM" in msg and "StaticSlidingWindowLayer" in msg and "\n" not in msg


@pytest.mark.parametrize("arch", ENGINE_OK)
def test_layerskip_matches_a_hand_truncated_copy(models, tiny_tokenizer, arch):
    from draft_models.registry import build_draft

    model = models[arch]
    draft = build_draft("layerskip:2", model, tiny_tokenizer, None, "cpu")
    assert len(model.get_submodule(LAYER_PATH[arch])) == 4  # the target is untouched
    # Reference: a deep copy whose block list is cut at the known path.
    ref = copy.deepcopy(model)
    parent, _, attr = LAYER_PATH[arch].rpartition(".")
    setattr(ref.get_submodule(parent), attr, ref.get_submodule(LAYER_PATH[arch])[:2])
    ref.config.num_hidden_layers = 2
    ids = torch.tensor([tiny_tokenizer.encode("def add(a, b): return a + b")])
    with torch.no_grad():
        got, expected = draft.model(ids).logits, ref(ids).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("arch", ENGINE_OK)
def test_engine_greedy_speculation_reproduces_plain_greedy(models, tiny_tokenizer, arch):
    """The engine's contract on every architecture it accepts: greedy speculative decoding
    (float32) emits the target's own greedy tokens."""
    from draft_models.registry import build_draft
    from pipeline.decode.engine import generate

    model = models[arch]
    ids = torch.tensor([tiny_tokenizer.encode("the quick brown fox jumps over")])
    plain = generate(model, ids, 16).tokens
    res = generate(model, ids, 16, draft=build_draft("layerskip:1", model, tiny_tokenizer, None, "cpu"), k=3)
    assert res.tokens == plain
    assert sum(r.drafted for r in res.rounds) > 0
    # Sampling at T = 1 rejects drafts, so the cache is rolled back by position on this layout too.
    from pipeline.decode.sampling import SamplingParams

    draft = build_draft("layerskip:1", model, tiny_tokenizer, None, "cpu")
    g = torch.Generator().manual_seed(0)
    res = generate(model, ids, 24, draft=draft, k=3, sampling=SamplingParams(1.0), generator=g)
    assert len(res.tokens) == 24 and any(r.accepted < r.drafted for r in res.rounds)


@pytest.mark.parametrize("arch", ENGINE_OK)
def test_roofline_kv_bytes_match_the_allocated_cache(models, tiny_tokenizer, arch):
    """model_bytes' KV formula (2 * layers * kv_heads * head_dim * bytes) against the bytes
    transformers' StaticCache actually allocates per position."""
    from transformers import StaticCache

    from pipeline.latency.roofline import model_bytes

    model = models[arch]
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    facts = model_bytes(model)
    assert facts["kv_bytes_per_token"] == allocated / 32
    assert ("moe" in facts) == (arch == "qwen2_moe")  # all-expert weight bytes flagged as an upper bound

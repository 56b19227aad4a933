"""Byte counts (pipeline.models.bytes, and the roofline's model_bytes built on it) against counts
made independently of it, on a tiny tied random Llama: plain float32, torchao int8 weight-only,
bitsandbytes LLM.int8 and NF4. Every comparison is exact: bytes are integers and nothing here is
estimated. A few seconds in all."""
from __future__ import annotations

import warnings

import pytest
import torch

from pipeline.latency.memory import meta_weight_bytes
from pipeline.latency.roofline import model_bytes
from pipeline.models.bytes import bytes_in_memory, shares_data, unique_bytes

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 64, 128, 2, 256
LINEARS_PER_LAYER = 7  # q k v o gate up down; transformers' quantizers leave lm_head alone


def tiny_config(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama_bytes")
    LlamaForCausalLM(tiny_config()).eval().save_pretrained(path)
    return path


def load(path, **kw):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu", **kw)


def own_tensors(model):
    """Each parameter and buffer once by identity (a tied weight is one object), read from the
    modules' own dicts rather than through model.parameters()."""
    found = {}
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                found.setdefault(id(t), (m, t))
    return list(found.values())


def plain_bytes(t) -> int:
    return t.numel() * t.element_size()


def assert_counts(model, expected: int):
    """bytes_in_memory and model_bytes agree with `expected`; the embedding is tied, so the
    per-step figure is the whole."""
    mb = model_bytes(model)
    assert bytes_in_memory(model) == expected
    assert mb["all_weight_bytes"] == expected
    assert mb["weight_bytes"] == expected and mb["untied_input_embedding_bytes"] == 0


def test_float_model_counts_numel_times_element_size_with_tied_weights_once(tiny_dir):
    model = load(tiny_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = sum(plain_bytes(t) for _, t in own_tensors(model))
    assert_counts(model, expected)
    assert meta_weight_bytes(model.config, torch.float32) == expected


def test_untied_input_embedding_is_reported_apart():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config(tied=False))
    mb = model_bytes(model)
    expected = sum(plain_bytes(t) for _, t in own_tensors(model))
    assert mb["all_weight_bytes"] == expected == meta_weight_bytes(model.config, torch.float32)
    assert mb["untied_input_embedding_bytes"] == VOCAB * HIDDEN * 4
    assert mb["weight_bytes"] == expected - VOCAB * HIDDEN * 4


def test_meta_tensor_counts_what_it_would_hold():
    assert unique_bytes([torch.empty(3, 5, dtype=torch.bfloat16, device="meta")], meta=True) == 30


def torchao_int8_bytes(w) -> int:
    """What a torchao int8 weight-only weight holds, from its named parts: int8 data in the
    logical shape, one scale (and zero point, where the version keeps one) per output row."""
    assert w.qdata.dtype == torch.int8 and w.qdata.shape == w.shape
    parts = [w.qdata, w.scale] + ([w.zero_point] if getattr(w, "zero_point", None) is not None else [])
    assert all(p.shape[0] == w.shape[0] for p in parts[1:])
    return sum(plain_bytes(p) for p in parts)


def test_torchao_int8_weight_only_counts_inner_tensors(tiny_dir, tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    # The scheme's own route (quantize_torchao_int8wo, then load_torchao): quantize on load, save, reload.
    load(tiny_dir, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())).save_pretrained(
        tmp_path, safe_serialization=True)
    model = load(tmp_path)
    expected, quantized = 0, []
    for _, t in own_tensors(model):
        if hasattr(t, "qdata"):
            quantized.append(t)
            expected += torchao_int8_bytes(t)
        else:
            expected += plain_bytes(t)
    assert len(quantized) == LAYERS * LINEARS_PER_LAYER
    assert_counts(model, expected)
    # Every wrapper reports data_ptr() 0: two different weights must still not look tied.
    assert not shares_data(quantized[0], quantized[1])
    assert shares_data(model.lm_head.weight, model.model.embed_tokens.weight)


def bnb_model(tiny_dir, **config):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    try:
        return load(tiny_dir, quantization_config=BitsAndBytesConfig(**config))
    except (RuntimeError, NotImplementedError, ImportError, ValueError) as e:
        pytest.skip(f"bitsandbytes cannot quantize {config} on this machine's CPU: {e}")


def bnb_expected(model, linear_class: str, linear_bytes) -> int:
    """Bytes from the layout: `linear_bytes(out, in)` for each of bitsandbytes' layers, plain
    numel * element_size for everything else (embedding, norms, rotary buffers)."""
    total, quantized = 0, 0
    for m, t in own_tensors(model):
        if type(m).__name__ == linear_class and t is m.weight:
            quantized += 1
            total += linear_bytes(m.out_features, m.in_features)
        else:
            total += plain_bytes(t)
    assert quantized == LAYERS * LINEARS_PER_LAYER
    return total


def test_bnb_int8_counts_scb(tiny_dir):
    model = bnb_model(tiny_dir, load_in_8bit=True)
    # LLM.int8: one int8 per weight, one float32 scale (SCB) per output row.
    assert_counts(model, bnb_expected(model, "Linear8bitLt", lambda out, inp: out * inp + out * 4))


def test_bnb_nf4_counts_quant_state(tiny_dir):
    model = bnb_model(tiny_dir, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                      bnb_4bit_compute_dtype=torch.float32)
    # NF4: two weights per byte, one float32 absmax per block of 64, a 16-entry float32 code table
    # per layer (no double quantization by default).
    assert_counts(model, bnb_expected(model, "Linear4bit",
                                      lambda out, inp: out * inp // 2 + out * inp // 64 * 4 + 16 * 4))

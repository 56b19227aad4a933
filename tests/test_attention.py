"""Attention on the static cache reads each KV head once (pipeline/decode/attention.py), gives the
stock path's logits, and the roofline / memory plan count what each path moves.

The stock path is transformers' own "sdpa" on the same weights (CachedModel's switch patched out).
Outputs: the logits of a prefill, 4 decode steps, a rollback of 2 and a verify of width k + 1 = 4
agree within float32 rounding (atol 2e-5 on logits of order 10: SDPA sums the same terms over
other head layouts). Bytes: the measure is "K/V copy bytes", the bytes of every fresh (non-view)
tensor an aten op makes whose last two dims are [max_len, head_dim], i.e. a copy of keys or values
over the whole allocated cache (KVCopyBytes in pipeline/tools/attention_check.py, a
TorchDispatchMode that sees every aten op, a fused kernel's own internal repeat included; in-place
cache writes and views share an input's storage, SDPA's output and mask are not [max_len,
head_dim]). The stock path copies 2 * layers * B * heads * max_len * head_dim elements per verify
(repeat_kv; with one KV head its reshape is a stride-0 view and copies nothing); the GQA path
copies none. The layout ("gqa" or "packed") follows the kernel SDPA would pick on the device.

    .venv/bin/python -m pytest -q tests/test_attention.py
"""
from __future__ import annotations

import pytest
import torch

import pipeline.decode.cache as cache_module
from pipeline.decode.attention import (EAGER_REPEAT, GQA, GQA_PACKED, SDPA_REPEAT, attention_path, gqa_layout,
                                       use_gqa_attention)
from pipeline.decode.cache import CachedModel
from pipeline.latency.memory import ModelShape, forward_bytes, plan_grid
from pipeline.latency.roofline import bytes_per_step, kv_passes, step_kv_passes
from pipeline.tools.attention_check import KVCopyBytes, check

LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 4, 2, 64, 96
HEAD_DIM = HIDDEN // HEADS
MAX_LEN = 64  # the engine's smallest cache
ATOL = 2e-5


def tiny_gqa(kv_heads: int = KV_HEADS, attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # distributions far from uniform, as in conftest
    model.set_attn_implementation(attn)
    return model


def _stock(monkeypatch):
    """CachedModel without its switch: transformers' own attention, as before this change."""
    monkeypatch.setattr(cache_module, "use_gqa_attention", lambda model: attention_path(model))


def _run(model, batch: int = 2):
    """Prefill 9, 4 decode steps, roll back 2, verify 4: every logit, and the K/V copy bytes of
    the first decode step and of the verify."""
    ids = torch.randint(0, VOCAB, (batch, 14), generator=torch.Generator().manual_seed(5))
    cm = CachedModel(model, batch=batch, max_len=MAX_LEN, slot="test-attention", exact=True)
    out = [cm.forward(ids[:, :9], all_logits=True, prefill=True)]
    copies = {}
    for i in range(9, 13):
        with KVCopyBytes(cm.max_len, HEAD_DIM) as count:
            out.append(cm.forward(ids[:, i:i + 1], all_logits=True))
        copies.setdefault("decode", count.bytes)
    cm.rollback(cm.length - 2)
    with KVCopyBytes(cm.max_len, HEAD_DIM) as count:
        out.append(cm.forward(ids[:, 10:14], all_logits=True))  # a verify of width k + 1 = 4
    copies["verify"] = count.bytes
    CachedModel.release(model, "test-attention")
    return out, copies, cm.attention


def _repeated_bytes(batch: int = 2) -> int:
    """What repeat_kv writes per step: K and V of every layer at every query head, float32."""
    return 2 * LAYERS * batch * HEADS * MAX_LEN * HEAD_DIM * 4


@pytest.mark.parametrize("layout,path", [("gqa", GQA), ("packed", GQA_PACKED)])
@pytest.mark.parametrize("kv_heads", [1, 2])
@torch.inference_mode()
def test_gqa_path_gives_the_stock_logits_and_copies_no_kv(monkeypatch, layout, path, kv_heads):
    stock_model, model = tiny_gqa(kv_heads), tiny_gqa(kv_heads)
    with monkeypatch.context() as m:
        _stock(m)
        ref, ref_copies, ref_path = _run(stock_model)
    assert ref_path == SDPA_REPEAT
    # transformers' sdpa folds an eager single-token step (pack_gqa) but copies for the verify
    # (with one KV head repeat_kv's reshape is a stride-0 view: nothing to copy in eager).
    assert ref_copies == {"decode": 0, "verify": _repeated_bytes() if kv_heads > 1 else 0}
    switched = use_gqa_attention(model, layout=layout)  # the device's choice overridden
    out, copies, ran = _run(model)
    assert copies == {"decode": 0, "verify": 0}
    assert switched == ran == path
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_the_device_check_runs_on_cpu():
    """pipeline.tools.attention_check (the GPU run's script) on CPU: the kernel that ran, no copy
    on the GQA path, the stock verify's copies, and the same logits."""
    out = check("tiny", torch.device("cpu"), torch.float32, cache_len=128, batch=1)
    assert out["layout"] == "gqa" and set(out["paths"]) == {SDPA_REPEAT, GQA}
    ours, stock = out["paths"][GQA], out["paths"][SDPA_REPEAT]
    assert stock["verify"]["kv_copy_bytes"] == 2 * 2 * 1 * 8 * 128 * 16 * 4  # layers, K+V, B, heads, S, D, fp32
    for width in ("decode", "verify"):
        assert ours[width]["kv_copy_bytes"] == 0
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ours[width]["attention_ops"]
        assert ours[width]["max_abs_logit_diff_vs_stock"] < ATOL


@pytest.mark.parametrize("backend,layout", [("FLASH_ATTENTION", "gqa"), ("EFFICIENT_ATTENTION", "gqa"),
                                            ("CUDNN_ATTENTION", "gqa"), ("MATH", "packed"), ("ERROR", "packed")])
def test_layout_follows_the_kernel_sdpa_would_pick(monkeypatch, backend, layout):
    """On CUDA the layout is the kernel SDPA would pick for GQA with a mask (torch._fused_sdp_choice):
    a fused one takes enable_gqa, math falls back to packed rows. No GPU here: the probe's tensors
    are fake CUDA tensors and the choice is replaced, so what is checked is the question asked and
    the mapping of its answer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend

    asked = []

    def choice(q, k, v, mask, dropout_p, is_causal, *, scale=None, enable_gqa=False):
        asked.append((q.device.type, tuple(q.shape), tuple(k.shape), tuple(mask.shape), dropout_p, is_causal,
                      enable_gqa, q.dtype))
        return int(getattr(SDPBackend, backend))

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    with FakeTensorMode():
        assert gqa_layout(torch.device("cuda"), torch.bfloat16, head_dim=128, groups=4) == layout
    assert asked == [("cuda", (1, 8, 2, 128), (1, 2, 64, 128), (1, 1, 2, 64), 0.0, False, True, torch.bfloat16)]
    assert gqa_layout(torch.device("cpu"), torch.float32, 128, 4) == "gqa" and len(asked) == 1  # CPU: not asked


def test_which_models_switch(tiny_tokenizer):
    """Grouped sdpa / eager models switch; a model without grouped heads keeps its own path."""
    from tests.conftest import make_tiny_model

    eager = tiny_gqa(attn="eager")
    assert attention_path(eager) == EAGER_REPEAT
    assert CachedModel(eager, 1, MAX_LEN, slot="test-attention").attention == GQA  # CPU: the fused kernel takes it
    assert eager.config._attn_implementation == "specq_sdpa"
    mha = tiny_gqa(kv_heads=HEADS)
    assert CachedModel(mha, 1, MAX_LEN, slot="test-attention").attention == "sdpa"
    assert mha.config._attn_implementation == "sdpa"
    for arch, path in (("qwen2", GQA), ("qwen2_moe", GQA), ("gpt2", "sdpa")):
        model = make_tiny_model(arch, tiny_tokenizer, layers=1)
        assert CachedModel(model, 1, MAX_LEN, slot="test-attention").attention == path, arch
    # A layerskip draft made first holds its target's layers, which read the target's config.
    from draft_models.layerskip import truncate

    target = tiny_gqa()
    draft = truncate(target, 1)
    assert CachedModel(draft, 1, MAX_LEN, slot="test-attention").attention == GQA
    assert attention_path(target) == GQA and target.config._attn_implementation == "specq_sdpa"


# ---------------------------------------------------------------- what the roofline and the plan count


def test_roofline_counts_the_kv_bytes_each_path_moves():
    n_rep = 4  # Llama-3-8B: 32 heads, 8 KV heads
    assert kv_passes(GQA, 32, 8) == kv_passes(GQA_PACKED, 32, 8, width=5) == 1
    assert kv_passes(SDPA_REPEAT, 32, 8, width=1) == 1  # pack_gqa
    assert kv_passes(SDPA_REPEAT, 32, 8, width=5) == kv_passes(EAGER_REPEAT, 32, 8) == 1 + 2 * n_rep == 9
    assert kv_passes(SDPA_REPEAT, 8, 8, width=5) == kv_passes("flash_attention_2", 32, 8) == 1
    # The cell by hand: W = 16 GB, K = 128 KiB per token, B = 32, 8192 positions.
    w, k = 16_000_000_000, 128 * 1024
    once = bytes_per_step(w, 32, 8192, k)
    repeated = bytes_per_step(w, 32, 8192, k, kv_passes=9)
    assert once == w + 32 * 8192 * k and repeated == w + 9 * 32 * 8192 * k
    assert 6.0 < repeated / once < 7.0  # "about 6x the bytes the roofline counts"


@torch.inference_mode()
def test_step_kv_passes_reads_the_path_that_ran(monkeypatch):
    model = tiny_gqa(kv_heads=1)
    assert step_kv_passes(model, width=4) == 1 + 2 * HEADS  # stock sdpa, a verify
    assert step_kv_passes(model, width=1) == 1  # stock sdpa's single-token step folds the heads (pack_gqa)
    CachedModel(model, 1, MAX_LEN, slot="test-attention")  # the engine switches it
    assert step_kv_passes(model, width=4) == step_kv_passes(model, width=1) == 1


def _tiny_shape(**kw) -> ModelShape:
    base = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=16, vocab=96,
                weight_bytes=10_000, element_bytes=2)
    return ModelShape(**{**base, **kw})


def test_memory_plan_counts_repeated_kv_only_on_a_repeating_path():
    shape = _tiny_shape()
    # Hand count, B = 2, W = 4, S = 80: residual 2*8*64*2; attention 8*(128 + 32)*2 (+ repeated
    # 2*2*4*80*16*2); MLP 3*8*128*2; logits 2*4*96*(2 + 4).
    residual, attention, mlp, logits = 2048, 2560, 6144, 4608
    repeated = 2 * 2 * 4 * 80 * 16 * 2  # 40960: larger than the MLP
    assert forward_bytes(shape, 2, 4, 80, 4, False) == residual + mlp + logits
    assert forward_bytes(shape, 2, 4, 80, 4, False, repeated_kv=True) == residual + attention + repeated + logits
    # A cell of context 8 (cache 8 + 60 + 1 = 69): the repeated copies dominate its prefill.
    once = plan_grid(shape, [2], [8], 60, 1e12, "cuda", verify_width=4)
    rep = plan_grid(shape, [2], [8], 60, 1e12, "cuda", verify_width=4, attention_path=SDPA_REPEAT)
    assert once.cells[0].cache_len == 69
    assert once.cells[0].activation_bytes == int(1.2 * forward_bytes(shape, 2, 8, 69, 1, False)) == 21043
    assert rep.cells[0].activation_bytes == int(1.2 * forward_bytes(shape, 2, 8, 69, 1, False, True)) == 54835
    assert rep.to_json()["attention_path"] == SDPA_REPEAT and once.to_json()["attention_path"] == GQA
    assert plan_grid(_tiny_shape(kv_heads=4), [2], [70], 9, 1e12, "cuda", attention_path=SDPA_REPEAT).cells[0] \
        == plan_grid(_tiny_shape(kv_heads=4), [2], [70], 9, 1e12, "cuda").cells[0]  # no groups: nothing repeats

"""Which attention kernel a cached step runs, and how many bytes of K/V it copies, stock vs specq.

    PYTHONPATH=. python3 -m pipeline.tools.attention_check                 # CUDA if present, else CPU
    PYTHONPATH=. python3 -m pipeline.tools.attention_check --shape 8b --cache-len 8192 --batch 8

On one random GQA Llama (--shape tiny, or 8b: 2 layers of Llama-3-8B), for transformers' "sdpa"
and the engine's "specq_sdpa" (pipeline/decode/attention.py), it runs one decode step and one
verify (W = 5) on a static cache and prints one JSON object: the layout chosen for the device, and
per path and width the attention ops the profiler saw, the K/V copy bytes and the largest logit
difference from the stock path. It needs no model and no .venv, only torch and transformers.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import pipeline.decode.cache as cache_module
from pipeline.decode.attention import attention_path, gqa_layout
from pipeline.decode.cache import CachedModel

SHAPES = {"tiny": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       intermediate_size=256, vocab_size=512),
          "8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=14336, vocab_size=128256)}
KERNEL_WORDS = ("attention", "fmha", "flash", "cudnn", "sdp")


class KVCopyBytes(TorchDispatchMode):
    """Bytes of fresh tensors shaped [..., cache_len, head_dim] made by aten ops: copies of K or V
    over the allocated cache (a view or an in-place cache write shares an input's storage)."""

    def __init__(self, cache_len: int, head_dim: int):
        super().__init__()
        self.shape, self.bytes, self.ops = (cache_len, head_dim), 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == self.shape \
                    and t.untyped_storage().data_ptr() not in held:
                self.bytes += t.numel() * t.element_size()
                self.ops.add(str(func))
        return out


def _model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, max_position_embeddings=1 << 17, **SHAPES[shape])
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def _step(cm, tokens, head_dim: int, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, KVCopyBytes(cm.max_len, head_dim) as count:
        logits = cm.forward(tokens, all_logits=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    ops = sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in KERNEL_WORDS)})
    return {"logits": logits, "attention_ops": ops, "kv_copy_bytes": count.bytes, "copy_ops": sorted(count.ops)}


def check(shape: str, device: torch.device, dtype: torch.dtype, cache_len: int, batch: int) -> dict:
    head_dim = SHAPES[shape]["head_dim"]
    groups = SHAPES[shape]["num_attention_heads"] // SHAPES[shape]["num_key_value_heads"]
    out = {"device": str(device), "dtype": str(dtype), "shape": shape, "cache_len": cache_len, "batch": batch,
           "torch": torch.__version__, "layout": gqa_layout(device, dtype, head_dim, groups), "paths": {}}
    reference = {}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, 21), generator=gen).to(device)
    for stock in (True, False):
        model = _model(shape, device, dtype)
        saved = cache_module.use_gqa_attention
        if stock:  # CachedModel without its switch: transformers' own path
            cache_module.use_gqa_attention = lambda m: attention_path(m)
        try:
            with torch.inference_mode():
                cm = CachedModel(model, batch, cache_len, slot="attention-check", exact=True)
                cm.prefill(ids[:, :16])
                steps = {"decode": _step(cm, ids[:, 16:17], head_dim, device),
                         "verify": _step(cm, ids[:, 17:21], head_dim, device)}
        finally:
            cache_module.use_gqa_attention = saved
            CachedModel.release(model)
        path = attention_path(model)
        for name, step in steps.items():
            logits = step.pop("logits")
            if stock:
                reference[name] = logits
            step["max_abs_logit_diff_vs_stock"] = float((logits - reference[name]).abs().max())
        out["paths"][path] = steps
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU unless given")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--cache-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    print(json.dumps(check(args.shape, device, dtype, args.cache_len, args.batch), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Handing a dropped model's memory back before the next one is planned or loaded.

    from pipeline.decode.release import release_caches, collect
    release_caches(model, draft_model)     # their pooled static caches (pipeline/decode/cache.py)
    del model, draft, draft_model          # the caller drops every reference it holds
    collect(device)                        # gc.collect(), then torch.cuda.empty_cache() on CUDA

`del` alone frees a model only when nothing else refers to it and it sits in no reference cycle;
accelerate hooks, quantization wrappers and module back-references make cycles, which only the
cyclic collector frees, at a time of its choosing. And PyTorch's CUDA allocator keeps freed blocks
reserved for this process: torch.cuda.mem_get_info, which the latency memory plan reads
(pipeline/latency/memory.py device_budget), counts them as used until empty_cache hands them back.
So without both, the next variant's plan sees the last one's weights and caches as taken and drops
or chunks cells for nothing. The caller must delete its own references first: a function cannot.
"""
from __future__ import annotations

import gc

import torch

from pipeline.decode.cache import CachedModel


def release_caches(*models) -> int:
    """Drop every pooled static cache of these models (None and model-free drafts skipped);
    returns the bytes they held."""
    return sum(CachedModel.release(m) for m in models if m is not None)


def collect(device: torch.device | str | None = None) -> None:
    """Free what is unreachable now (cycles included) and, on CUDA, return the allocator's free
    blocks to the driver, so the next measurement of free memory sees them."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

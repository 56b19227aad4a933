"""Handing a dropped model's memory back before the next one is planned or loaded.

    from pipeline.decode.release import release_caches, collect
    release_caches(model, draft_model)     # their pooled static caches (pipeline/decode/cache.py)
    del model, draft, draft_model          # the caller drops every reference it holds
    collect(device)                        # gc.collect(), then torch.cuda.empty_cache() on CUDA

Hooks and wrappers put models in reference cycles that only gc.collect frees, and the CUDA
allocator keeps freed blocks counted as used (by the latency memory plan) until empty_cache; the
caller must delete its own references first.
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
    """gc.collect(), then on CUDA hand the allocator's free blocks back to the driver."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

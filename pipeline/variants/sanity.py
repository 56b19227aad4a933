"""The sanity perplexity every variant's meta.json records, on held-out text, beside the reference's.

    ids = sanity_ids(tokenizer, 512)
    ppl = perplexity(model, ids)

The held-out text: docstrings of some standard-library modules (on every machine, plain English
prose, unrelated to the calibration text and the eval slices).
"""
from __future__ import annotations

import importlib
import inspect
import math
import time

import torch

from pipeline.decode.timing import synchronize

SANITY_MODULES = ("argparse", "textwrap", "difflib", "heapq", "bisect", "functools", "contextlib",
                  "statistics", "fractions", "shutil", "tempfile", "zipfile", "csv", "string", "pathlib")


def sanity_text() -> str:
    """Module and public-function docstrings of SANITY_MODULES, in a fixed order."""
    parts = []
    for name in SANITY_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", [])):
            doc = inspect.getdoc(getattr(mod, attr, None))
            if doc and getattr(getattr(mod, attr), "__module__", None) == name:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def sanity_ids(tokenizer, n_tokens: int) -> list[int]:
    """The first n_tokens token ids of the held-out text."""
    return tokenizer(sanity_text(), add_special_tokens=False)["input_ids"][:n_tokens]


@torch.no_grad()
def perplexity(model, ids: list[int], window: int = 512) -> float:
    """exp(mean next-token NLL) over `ids`, in independent windows of `window` tokens."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[s:s + window + 1]], device=device)  # [1, <=window+1]
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits.float()  # [1, T, V]
        loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        nll, count = nll + loss.item(), count + chunk.shape[1] - 1
    return math.exp(nll / max(count, 1))


@torch.no_grad()
def timed_forward(model, ids: list[int], window: int = 512) -> dict:
    """Seconds of one forward over the first `window` held-out tokens (best of two, kernels warm): the
    quality stage's prior of a variant's pace (pipeline/quality/waves.py: pace_priors)."""
    device = next(model.parameters()).device
    chunk = torch.tensor([ids[:window]], device=device)
    best = math.inf
    for _ in range(2):
        synchronize(device)
        start = time.perf_counter()
        model(chunk)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return {"tokens": int(chunk.shape[1]), "seconds": round(best, 4)}


def sample_text(model, tokenizer, prompt: str = "The capital of France is", n: int = 12) -> str:
    """A short greedy continuation, recorded so a broken variant shows at a glance."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

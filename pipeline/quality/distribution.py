"""Distribution drift of a variant against the reference, on held-out text.

Per document (a fixed token window) the mean over positions of KL(reference || variant) in nats,
top-1 agreement and each model's next-token NLL; CIs are t intervals over documents (the
independent units), clipped to the metric's range; the perplexity ratio is exp of the mean
per-document NLL difference. The held-out text is the docstrings of Python standard-library
modules on this machine (one module, one document): prose never in the repository.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.core.stage import StageError, atomic_write_json
from pipeline.stats.intervals import mean_t_interval

# Modules whose docstrings are long prose; the order fixes which documents a run uses.
HELDOUT_MODULES = [
    "argparse", "logging", "collections", "subprocess", "unittest", "email.message", "decimal",
    "pathlib", "typing", "dataclasses", "json", "random", "datetime", "shutil", "tarfile",
    "zipfile", "sqlite3", "threading", "asyncio", "functools", "itertools", "statistics",
    "textwrap", "string", "re", "csv", "configparser", "heapq", "fractions", "inspect", "pickle",
    "http.client", "urllib.request", "socket", "selectors", "difflib", "pprint", "enum",
    "contextlib", "abc", "io", "os", "tempfile", "glob", "fnmatch", "calendar", "locale",
    "gettext", "codecs", "base64", "hashlib", "hmac", "secrets", "uuid", "queue", "sched",
]


def module_text(name: str) -> str:
    """The module's docstring followed by those of its public classes, functions and methods."""
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return ""
    parts = [mod]
    for obj in (getattr(mod, attr, None) for attr in sorted(dir(mod)) if not attr.startswith("_")):
        own = getattr(obj, "__module__", None) == mod.__name__
        if own and (inspect.isclass(obj) or inspect.isfunction(obj)):
            parts.append(obj)
            if inspect.isclass(obj):
                parts += [m for n, m in sorted(vars(obj).items()) if not n.startswith("_") and inspect.isfunction(m)]
    return "\n\n".join(d for d in map(inspect.getdoc, parts) if d)


def heldout_documents(tokenizer, n_docs: int, n_tokens: int) -> tuple[torch.Tensor, dict]:
    """`n_docs` windows of `n_tokens` token ids ([n_docs, n_tokens]), one per module, plus a
    description (module names, sha256 of the ids) for meta.json."""
    docs, used = [], []
    for name in HELDOUT_MODULES:
        ids = tokenizer(module_text(name), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            docs.append(ids[:n_tokens])
            used.append(name)
        if len(docs) == n_docs:
            break
    if len(docs) < n_docs:
        raise StageError(f"held-out text: only {len(docs)} standard-library modules have "
                         f"{n_tokens} tokens of docstrings (asked for {n_docs}); lower "
                         f"quality.distribution_tokens or distribution_docs")
    ids = torch.tensor(docs, dtype=torch.long)
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    return ids, {"source": "python stdlib docstrings", "modules": used, "tokens_sha256": digest}


# The reference's log-probabilities are kept on the host for the next variant up to this size.
REFERENCE_CACHE_BYTES = 2 << 30


@torch.no_grad()
def per_document(reference, variant, ids: torch.Tensor, device: torch.device, batch: int = 4,
                 cache: dict | None = None) -> dict:
    """Per-document means: kl, top1, nll_ref, nll_var (lists of length n_docs). `cache`: a dict
    the caller keeps across variants for the reference's log-probs (same ids each time)."""
    out = {"kl": [], "top1": [], "nll_ref": [], "nll_var": []}
    for start in range(0, ids.shape[0], batch):
        x = ids[start : start + batch].to(device)  # [b, T]
        if cache is not None and start in cache:
            logp_ref = cache[start].to(device)
        else:
            logp_ref = torch.log_softmax(reference(x).logits.float(), dim=-1)  # [b, T, V]
            if cache is not None and \
                    logp_ref.numel() * 4 * -(-ids.shape[0] // batch) <= REFERENCE_CACHE_BYTES:
                cache[start] = logp_ref.cpu()
        logp_var = torch.log_softmax(variant(x).logits.float(), dim=-1)
        kl = (logp_ref.exp() * (logp_ref - logp_var)).sum(-1)  # [b, T]
        agree = (logp_ref.argmax(-1) == logp_var.argmax(-1)).float()  # [b, T]
        nxt = x[:, 1:].unsqueeze(-1)  # the next token at positions 0..T-2
        nll_ref = -logp_ref[:, :-1].gather(-1, nxt).squeeze(-1)  # [b, T-1]
        nll_var = -logp_var[:, :-1].gather(-1, nxt).squeeze(-1)
        out["kl"] += kl.mean(1).tolist()
        out["top1"] += agree.mean(1).tolist()
        out["nll_ref"] += nll_ref.mean(1).tolist()
        out["nll_var"] += nll_var.mean(1).tolist()
    return out


# The range each per-document metric can take: its interval is clipped to it.
RANGES = {"kl": (0.0, math.inf), "top1": (0.0, 1.0)}
CI_METHOD = ("t interval over documents (mean, SE s/sqrt(n), t quantile on n - 1 df), intersected with the "
             "metric's range: top-1 agreement [0, 1], KL [0, inf); ppl_ratio: exp of the t interval of the "
             "mean per-document log-ratio (unbounded, so not clipped; exp keeps it > 0)")


def summarize(per_doc: dict, confidence: float = 0.95) -> dict:
    """The distribution metrics of one variant: per-document means averaged over documents, with
    t intervals over documents clipped to the metric's range (clipping drops only values the
    metric cannot take, so coverage is unchanged; `ci_method`). Under two documents: [None, None]."""
    kl, kl_ci = mean_t_interval(per_doc["kl"], confidence, RANGES["kl"])
    top1, top1_ci = mean_t_interval(per_doc["top1"], confidence, RANGES["top1"])
    diff = np.asarray(per_doc["nll_var"]) - np.asarray(per_doc["nll_ref"])
    d, d_ci = mean_t_interval(diff, confidence)
    return {
        "kl_mean": kl, "kl_ci": kl_ci,
        "top1_agreement": top1, "top1_ci": top1_ci,
        "ppl_ratio": math.exp(d), "ppl_ratio_ci": [None if c is None else math.exp(c) for c in d_ci],
        "ci_method": CI_METHOD,
        "ppl_reference": math.exp(float(np.mean(per_doc["nll_ref"]))),
        "ppl_variant": math.exp(float(np.mean(per_doc["nll_var"]))),
        "n_docs": len(per_doc["kl"]),
        "per_document": per_doc,
    }


def write_drift(path: Path, reference, variant, tokenizer, qcfg, device: torch.device, cache: dict) -> None:
    """The variant's drift against the reference, written to `path` (distribution.json). `cache`:
    a dict the caller keeps across variants (the held-out ids, the reference's log-probs)."""
    if "ids" not in cache:
        cache["ids"], cache["info"] = heldout_documents(tokenizer, qcfg.distribution_docs, qcfg.distribution_tokens)
    start = time.perf_counter()
    per_doc = per_document(reference, variant, cache["ids"], device, cache=cache.setdefault("logp", {}))
    atomic_write_json(path, {**summarize(per_doc), **cache["info"], "seconds": time.perf_counter() - start})

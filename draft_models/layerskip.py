"""`layerskip:<n>`: the target's first n decoder layers + its final norm + its LM head.

The draft shares the target's weight tensors (no copy): it is a shallow copy of the model object
whose layer list holds the first n layers and whose config says n layers, so transformers builds
a static cache of n layers for it (its own cache, rolled back like any draft's). The layers keep
their layer_idx 0..n-1, which index that cache.
"""
from __future__ import annotations

import copy

import torch

from pipeline.core.stage import StageError
from pipeline.decode.cache import hf_model
from pipeline.decode.drafts import ModelDraft
from pipeline.models.architecture import decoder_layers


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object with its own child table; parameters and children stay shared."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def truncate(model: torch.nn.Module, n: int) -> torch.nn.Module:
    model = hf_model(model)
    dotted, layers = decoder_layers(model)  # found from the model (pipeline.models.architecture), not by name
    path = tuple(dotted.split("."))
    total = len(layers)
    if not 1 <= n < total:
        raise StageError(f"layerskip:{n}: n must be between 1 and {total - 1} (the target has {total} layers)")
    cfg = copy.deepcopy(model.config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = n  # GPT-2's n_layer through the config's attribute map
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:n]
    root = _shallow(model)
    parent = root
    for attr in path[:-1]:
        child = _shallow(getattr(parent, attr))
        setattr(parent, attr, child)
        parent = child
    setattr(parent, path[-1], torch.nn.ModuleList(list(layers)[:n]))
    for m in (root, *(_get(root, path[: i + 1]) for i in range(len(path) - 1))):
        if hasattr(m, "config"):
            m.config = cfg
    return root


def _get(obj, path):
    for attr in path:
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def build(spec, target, tokenizer, run_dir, device):
    _, _, arg = spec.partition(":")
    try:
        n = int(arg)
    except ValueError:
        raise StageError(f"draft {spec}: expected layerskip:<n> with an integer n") from None
    model = truncate(target, n)
    return ModelDraft(spec, model, vocab_size=model.get_output_embeddings().weight.shape[0])

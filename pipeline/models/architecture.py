"""Architecture-neutral views of a causal LM, so no stage assumes Llama's module names.

    path, layers = decoder_layers(model)          # ("transformer.h", ModuleList) on GPT-2
    for w in weight_matrices(model): w.name, w.kind, w.input_width
    check_engine_cache(model.config)              # StageError if the engine cannot roll the cache back

The decoder layers are the ModuleList of the block class in `_no_split_modules` (else the largest
ModuleList of identical blocks); a weight matrix is a >= 2-D parameter inside them, of kind
    linear  torch.nn.Linear (and its quantized subclasses): [out, in]
    conv1d  transformers' Conv1D (GPT-2 family): stored transposed, [in, out]
    fused   routed experts as one [experts, out, in] parameter ([experts, in, out] if `is_transposed`)
    other   any other >= 2-D parameter (a MoE router's [experts, hidden] weight): input = last dim
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.core.stage import StageError


def architecture(model_or_config) -> str:
    """The name a user knows the model by: config.architectures[0], else the class name."""
    cfg = getattr(model_or_config, "config", model_or_config)
    names = getattr(cfg, "architectures", None) or []
    if names:
        return names[0]
    if hasattr(model_or_config, "config"):
        return type(model_or_config).__name__
    return getattr(cfg, "model_type", type(cfg).__name__)


def text_config(config):
    """The decoder's config (multimodal configs nest it; plain ones are their own)."""
    return getattr(config, "get_text_config", lambda: config)()


def context_length(model) -> int | None:
    """The model's positions (max_position_embeddings of its decoder config), None when unstated."""
    return getattr(text_config(model.config), "max_position_embeddings", None)


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(dotted path, the ModuleList of decoder blocks) of a transformers causal LM."""
    n_layers = getattr(text_config(model.config), "num_hidden_layers", None) if hasattr(model, "config") else None
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1]

    def size(item) -> int:
        return sum(p.numel() for p in item[1].parameters())

    for keep in (lambda n, m: type(m[0]).__name__ in no_split and len(m) == n_layers,
                 lambda n, m: len(m) == n_layers,
                 lambda n, m: True):
        found = [c for c in candidates if keep(*c)]
        if found:
            return max(found, key=size)
    raise StageError(f"architecture {architecture(model)}: no list of decoder blocks found "
                     "(no torch.nn.ModuleList of identical modules); specq cannot handle this model")


@dataclass
class WeightMatrix:
    name: str  # dotted parameter name, e.g. "transformer.h.0.attn.c_attn.weight"
    kind: str  # linear | conv1d | fused | other (see the module docstring)
    param: torch.nn.Parameter
    input_width: int  # the width of the vector each row (each expert's row) multiplies


def _is_conv1d(module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # a transformers without it has no GPT-2-style layers either
        return False
    return isinstance(module, Conv1D)


def weight_matrices(model) -> list[WeightMatrix]:
    """Every >= 2-D parameter inside the decoder blocks (not the embeddings or LM head), in module order."""
    path, layers = decoder_layers(model)
    out = []
    for mod_name, module in layers.named_modules(prefix=path):
        for p_name, p in module.named_parameters(recurse=False):
            if p.dim() < 2:
                continue
            if isinstance(module, torch.nn.Linear):
                kind, width = "linear", module.in_features
            elif _is_conv1d(module):
                kind, width = "conv1d", p.shape[0]
            elif p.dim() == 3:
                kind, width = "fused", p.shape[-2] if getattr(module, "is_transposed", False) else p.shape[-1]
            else:
                kind, width = "other", p.shape[-1]
            out.append(WeightMatrix(f"{mod_name}.{p_name}", kind, p, int(width)))
    return out


def meta_model(config):
    """The model a config describes, built on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def float_matrix_fraction(model, reference_params: int) -> float:
    """Share of the reference's decoder weight-matrix parameters that a loaded variant still holds as
    plain floating-point tensors (1.0 = nothing quantized; quantized ones are integer or subclasses)."""
    _, layers = decoder_layers(model)
    remaining = sum(p.numel() for p in layers.parameters()
                    if p.dim() >= 2 and p.is_floating_point() and type(p.data) is torch.Tensor)
    return remaining / reference_params if reference_params else 1.0


def check_engine_cache(model_or_config) -> None:
    """Refuse a model whose KV cache the decode engine cannot roll back by moving one position: only
    full-attention StaticLayers can (not sliding windows, linear attention or SSM layers)."""
    from transformers import StaticCache

    config = getattr(model_or_config, "config", model_or_config)
    try:
        cache = StaticCache(config=config, max_cache_len=8)
    except (ValueError, TypeError, AttributeError) as e:
        raise StageError(f"architecture {architecture(model_or_config)}: transformers' StaticCache cannot be built for it "
                         f"({str(e).splitlines()[0][:120]}); the decode engine needs one") from None
    kinds = sorted({type(layer).__name__ for layer in cache.layers} - {"StaticLayer"})
    if kinds:
        raise StageError(f"architecture {architecture(model_or_config)}: its KV cache has {', '.join(kinds)} layers, which the "
                         "decode engine (drafts, acceptance, latency) cannot roll back by position; it "
                         "supports full-attention caches only")

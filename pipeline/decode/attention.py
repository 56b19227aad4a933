"""Attention over the static cache that reads each KV head once (grouped-query models).

    from pipeline.decode.attention import attention_path, use_gqa_attention
    use_gqa_attention(model)     # CachedModel does this: sdpa / eager GQA models -> "specq_sdpa"
    attention_path(model)        # "sdpa-gqa", "sdpa-gqa-packed", "sdpa+repeat_kv", "eager+repeat_kv", "sdpa", ...

With a static cache's mask, transformers' own paths copy K and V heads / kv_heads times at every
step (`repeat_kv`). "specq_sdpa" calls SDPA on the KV heads as they are, in layout "gqa"
(`enable_gqa` with the mask) or "packed" (each KV head's query heads folded into the rows);
anything else goes to the stock function (docs/methods/gpu-box.md#the-gqa-attention-path).
"""
from __future__ import annotations

import weakref

import torch

NAME = "specq_sdpa"

# The strings attention_path returns (meta.json: what attention a step ran).
GQA = "sdpa-gqa"  # enable_gqa with the mask: each KV head read once
GQA_PACKED = "sdpa-gqa-packed"  # query heads folded into rows: each KV head read once
SDPA_REPEAT = "sdpa+repeat_kv"  # transformers' sdpa on a GQA model: verifies copy K/V
EAGER_REPEAT = "eager+repeat_kv"  # transformers' eager on a GQA model: every step copies K/V
READS_ONCE = (GQA, GQA_PACKED)

# hf model -> the layout its layers use ("gqa" | "packed"; each layer carries it as _MODE_ATTR).
_SWITCHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MODE_ATTR = "specq_gqa_layout"


def specq_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs):
    """query [B, H, W, D], key / value [B, Hkv, S, D], mask [B, 1, W, S] bool or float (or None)
    -> (output [B, W, H, Dv], None), transformers' attention-function contract."""
    groups = getattr(module, "num_key_value_groups", 1)
    unusual = (kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
               or kwargs.get("s_aux") is not None
               or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1)))
    if groups <= 1 or unusual:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    b, heads, w, _ = query.shape
    kv_heads = key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and w > 1 and causal:
        # A prefill from position 0 (transformers skipped the mask): sdpa's is_causal is aligned to
        # the top left, so the first W keys are the prompt's; the rest of the static cache is cut off.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key[:, :, :w], value[:, :, :w], dropout_p=dropout, scale=scaling, is_causal=True,
            enable_gqa=True)
    elif getattr(module, _MODE_ATTR, "gqa") == "gqa":
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    else:  # "packed": [B, H, W, D] -> [B, Hkv, n_rep * W, D], row r * W + w = head g * n_rep + r at w
        rows = groups * w
        q = query.reshape(b, kv_heads, rows, query.shape[-1])
        mask = attention_mask
        if mask is not None and w > 1:  # [B, 1, W, S] -> [B, 1, n_rep * W, S] (W = 1 broadcasts as it is)
            mask = mask[:, :, None].expand(mask.shape[0], 1, groups, w, mask.shape[-1]).reshape(
                mask.shape[0], 1, rows, mask.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
        out = out.reshape(b, heads, w, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make NAME known to transformers (idempotent): the attention function, and sdpa's mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, specq_sdpa_attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


def _gqa_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "num_key_value_groups", 1) > 1]


def use_gqa_attention(model, layout: str | None = None) -> str:
    """Switch a grouped-query model on "sdpa" or "eager" to NAME (once; `layout` "gqa" or "packed"
    overrides the device's choice, for tests). Returns attention_path(model)."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == NAME and model in _SWITCHED and (layout is None or layout == _SWITCHED[model]):
        return attention_path(model)  # every CachedModel asks: the second time costs nothing
    layers = _gqa_layers(model)
    if not layers or current not in ("sdpa", "eager", NAME):
        return attention_path(model)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = getattr(model, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    layout = layout or gqa_layout(device, dtype, _head_dim(model), layers[0].num_key_value_groups)
    register()
    if current != NAME:
        model.set_attn_implementation(NAME)
        if getattr(model.config, "_attn_implementation", None) != NAME:  # the class refused it (logged)
            return attention_path(model)
    # A layer-sharing draft (layerskip) holds its target's layers, which look up their own config's name.
    for cfg in {id(c): c for c in (getattr(layer, "config", None) for layer in layers) if c is not None}.values():
        if getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager"):
            cfg._attn_implementation = NAME
    for layer in layers:
        setattr(layer, _MODE_ATTR, layout)
    _SWITCHED[model] = layout
    return attention_path(model)


def gqa_layout(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int) -> str:
    """"gqa" where SDPA, asked for GQA with a mask on this device, picks a fused kernel
    (torch._fused_sdp_choice); "packed" where it would fall back to the math kernel."""
    if device.type != "cuda":
        return "gqa"  # CPU: the flash kernel for CPU takes both (see the module docstring)
    try:
        from torch.nn.attention import SDPBackend

        q = torch.zeros(1, 2 * groups, 2, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(1, 2, 64, head_dim, device=device, dtype=dtype)
        mask = torch.ones(1, 1, 2, 64, device=device, dtype=torch.bool)
        choice = torch._fused_sdp_choice(q, kv, kv, mask, 0.0, False, scale=None, enable_gqa=True)
    except Exception:  # noqa: BLE001 - a torch without the choice: the layout every kernel takes
        return "packed"
    fused = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    return "gqa" if choice in {int(b) for b in fused} else "packed"


def _head_dim(model) -> int:
    cfg = model.config
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def attention_path(model) -> str:
    """What attention a cached step of `model` runs: one of READS_ONCE, SDPA_REPEAT / EAGER_REPEAT
    (a grouped model whose steps copy K and V), or the implementation's own name."""
    layers = _gqa_layers(model)
    # A layer's forward looks up its own config's name (a layerskip draft holds its target's layers).
    config = getattr(layers[0], "config", None) if layers else None
    impl = getattr(config if config is not None else model.config, "_attn_implementation", None) or "unknown"
    if impl == NAME:
        return GQA if getattr(layers[0], _MODE_ATTR, "gqa") == "gqa" else GQA_PACKED
    if not layers:
        return impl
    return {"sdpa": SDPA_REPEAT, "eager": EAGER_REPEAT}.get(impl, impl)

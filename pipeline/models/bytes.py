"""The bytes a model's tensors hold, seen through quantized tensor types: the one count behind every byte figure.

    bytes_in_memory(model)                              # a loaded model: each storage once, meta skipped
    unique_bytes(model_tensors(meta_model), meta=True)  # a meta-device build: what it would hold

numel * element_size misses what torchao's subclasses and bitsandbytes' scales hold, so every tensor
is resolved to the plain tensors holding its data, each counted once by address (meta: by identity).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# Tensor attributes of a bitsandbytes QuantState; state2 (double quantization) is one itself.
_QUANT_STATE_TENSORS = ("absmax", "code", "offset")


def held_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding `t`'s data: a wrapper's inner tensors (recursively), else `t`
    itself and any bitsandbytes scales kept beside it."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):  # torchao
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from held_tensors(getattr(t, name))
        return
    yield t
    yield from _quant_state_tensors(getattr(t, "quant_state", None))  # Params4bit
    scb = getattr(t, "SCB", None)  # Int8Params: one scale per output row
    if isinstance(scb, torch.Tensor):
        yield scb


def _quant_state_tensors(state) -> Iterator[torch.Tensor]:
    while state is not None:
        for attr in _QUANT_STATE_TENSORS:
            v = getattr(state, attr, None)
            if isinstance(v, torch.Tensor):
                yield v
        state = getattr(state, "state2", None)  # the absmax of double quantization, quantized


def _key(t: torch.Tensor) -> tuple[str, int]:
    # Every meta tensor reports data_ptr() 0; identity is the only thing telling them apart.
    if t.device.type == "meta":
        return ("id", id(t))
    return ("ptr", t.data_ptr())


def unique_held(tensors: Iterable[torch.Tensor], meta: bool = False) -> list[torch.Tensor]:
    """The plain tensors holding the data of `tensors`, each address once. Meta tensors hold
    nothing and are left out unless `meta` (a meta-device build counted for what it would hold)."""
    found: dict[tuple[str, int], torch.Tensor] = {}  # values keep id() keys alive while we look
    for t in tensors:
        for h in held_tensors(t):
            if h.device.type == "meta" and not meta:
                continue
            found.setdefault(_key(h), h)
    return list(found.values())


def unique_bytes(tensors: Iterable[torch.Tensor], meta: bool = False) -> int:
    """Bytes held by `tensors`, each storage once (see unique_held for `meta`)."""
    return sum(h.numel() * h.element_size() for h in unique_held(tensors, meta=meta))


def shares_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold any of the same data (tied weights), by their held tensors."""
    keys_a = {_key(h) for h in unique_held([a], meta=True)}
    return any(_key(h) in keys_a for h in unique_held([b], meta=True))


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer (quantized layers keep packed weights and scales in either)."""
    return [*model.parameters(), *model.buffers()]


def bytes_in_memory(model: torch.nn.Module) -> int:
    """Bytes held by a loaded model's parameters and buffers, each storage once; meta tensors hold nothing."""
    return unique_bytes(model_tensors(model))

"""The latency stage's memory plan: which (batch, context) cells fit in the memory free now, in
which order they run, how the prompt is prefilled, and when each KV cache is freed. Arithmetic
only: nothing is allocated.

    from pipeline.latency.memory import ModelShape, plan_grid, plan_loaded
    plan, budget = plan_loaded(model, lat, device)                         # a variant's plain grid
    plan, budget = plan_loaded(model, lat, device, [prompt_len], drafts, k_max)  # a B = 1 pair
    plan = plan_grid(ModelShape.from_config(config, torch.bfloat16), [1, 8], [128, 2048], 64,
                     budget_bytes=80e9, device_type="cuda")                # on no device
    plan.steps     # ("run", cell) / ("free", cache) in order; plan.dropped: what cannot fit

Cells run in ascending order, each on a cache of exactly its length, prefilled in chunks where one
shot would not fit. Why, and the activation estimates: docs/methods/gpu-box.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from pipeline.core.device import host_memory
from pipeline.decode.attention import EAGER_REPEAT, GQA, SDPA_REPEAT, attention_path, use_gqa_attention
from pipeline.decode.cache import hf_model
from pipeline.models.bytes import bytes_in_memory, model_tensors, unique_bytes


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: int  # every parameter and buffer held in memory
    element_bytes: int  # activation / KV element size (the compute dtype's)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position of one sequence, over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, weight_bytes: int | None = None) -> "ModelShape":
        """From a transformers config; without `weight_bytes` they are counted on the meta device."""
        text = getattr(config, "get_text_config", lambda: config)()
        heads = text.num_attention_heads
        if weight_bytes is None:
            weight_bytes = meta_weight_bytes(config, dtype)
        intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) \
            or 4 * text.hidden_size
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=int(intermediate),
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   vocab=text.vocab_size, weight_bytes=int(weight_bytes),
                   element_bytes=torch.empty((), dtype=dtype).element_size())

    @classmethod
    def from_model(cls, model, weight_bytes: int) -> "ModelShape":
        dtype = getattr(model, "dtype", torch.float32)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            dtype = torch.float32
        return cls.from_config(model.config, dtype, weight_bytes=weight_bytes)


def meta_weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers in `dtype`, from a meta-device build."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return unique_bytes(model_tensors(model), meta=True)


def cache_len(context: int, new_tokens: int, extra: int = 1) -> int:
    """Positions the engine's static cache holds for a cell (its own rule: at least 64)."""
    return max(context + new_tokens + extra, 64)


def forward_bytes(shape: ModelShape, batch: int, tokens: int, attended: int, logits_rows: int,
                  materialised_scores: bool, repeated_kv: bool = False) -> int:
    """Peak activation bytes of one forward, its logits included (the module docstring has the terms)."""
    e = shape.element_bytes
    bt = batch * tokens
    residual = 2 * bt * shape.hidden * e
    attention = bt * (2 * shape.hidden + 2 * shape.kv_heads * shape.head_dim) * e
    if materialised_scores:
        attention += batch * shape.heads * tokens * attended * 4
    if repeated_kv:  # one layer's K and V copied to every query head over the attended length
        attention += 2 * batch * shape.heads * attended * shape.head_dim * e
    mlp = 3 * bt * shape.intermediate * e
    out = batch * logits_rows * shape.vocab * (e + 4)
    return residual + max(attention, mlp) + out


@dataclass
class CellPlan:
    batch: int
    context: int
    cache_len: int
    cache_bytes: int
    prefill_chunk: int | None  # None = the whole prompt in one forward
    activation_bytes: int  # the larger of the prefill (chunk) and a decode / verify step
    peak_bytes: int  # cache + activations (weights are outside the budget)


@dataclass
class MemoryPlan:
    budget_bytes: int
    steps: list[dict] = field(default_factory=list)  # {"action": "run" | "free", ...} in order
    dropped: list[dict] = field(default_factory=list)
    attention_path: str = GQA  # what the planned steps run (repeated K / V counted or not)

    @property
    def cells(self) -> list[CellPlan]:
        names = CellPlan.__dataclass_fields__  # a step may carry notes of its own (a draft's cache)
        return [CellPlan(**{k: v for k, v in s.items() if k in names}) for s in self.steps if s["action"] == "run"]

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "steps": self.steps, "dropped": self.dropped,
                "attention_path": self.attention_path,
                "order": "batch ascending, then context ascending; one cache alive at a time, "
                         "each of exactly its cell's length, freed before the next is allocated"}


def plan_grid(shape: ModelShape, batches: list[int], contexts: list[int], new_tokens: int,
              budget_bytes: float, device_type: str, verify_width: int = 1, slack: float = 1.2,
              min_chunk: int = 128, attention_path: str = GQA) -> MemoryPlan:
    """Plan every (batch, context) cell against `budget_bytes`, the memory left for caches and
    activations. verify_width: the widest forward a step makes (k + 1 for speculative rounds);
    prefill is halved down to min_chunk only where one shot does not fit; an attention_path that
    repeats K and V adds one layer's copies."""
    scores = device_type != "cuda"  # CPU SDPA with a mask materialises B x heads x T x S scores
    repeated = attention_path in (SDPA_REPEAT, EAGER_REPEAT) and shape.heads > shape.kv_heads
    plan = MemoryPlan(budget_bytes=int(budget_bytes), attention_path=attention_path)
    live: tuple[int, int] | None = None  # (batch, cache_len) of the one cache alive
    for batch in sorted(set(batches)):
        for context in sorted(set(contexts)):
            length = cache_len(context, new_tokens)
            cache = batch * length * shape.kv_bytes_per_token
            step = forward_bytes(shape, batch, verify_width, length, verify_width, scores, repeated)
            chunk, prefill = None, forward_bytes(shape, batch, context, length, 1, scores, repeated)
            while cache + slack * max(prefill, step) > budget_bytes and (chunk or context) > min_chunk:
                chunk = max(min_chunk, (chunk or context) // 2)
                prefill = forward_bytes(shape, batch, chunk, length, 1, scores, repeated)
            activation = int(slack * max(prefill, step))
            need = cache + activation
            if need > budget_bytes:
                plan.dropped.append({"batch": batch, "context": context, "cache_len": length,
                                     "needs_bytes": int(need), "budget_bytes": int(budget_bytes),
                                     "reason": f"needs {_size(need)} (cache {_size(cache)} + activations "
                                               f"{_size(activation)}) of {_size(budget_bytes)}"})
                continue
            if live is not None:
                plan.steps.append({"action": "free", "batch": live[0], "cache_len": live[1]})
            plan.steps.append({"action": "run", **asdict(CellPlan(
                batch=batch, context=context, cache_len=length, cache_bytes=int(cache),
                prefill_chunk=chunk, activation_bytes=activation, peak_bytes=int(need)))})
            live = (batch, length)
    if live is not None:
        plan.steps.append({"action": "free", "batch": live[0], "cache_len": live[1]})
    return plan


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def device_budget(device: torch.device, weights_loaded: bool, weight_bytes: int,
                  reserve_fraction: float = 0.05, reserve_min: int = 1 << 30) -> dict:
    """Memory the plan may use, measured now: CUDA's free memory or the host's available memory,
    less a reserve (allocator, context, workspaces) and the weights if not loaded yet."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        source = "torch.cuda.mem_get_info"
    else:
        free, total, source = host_memory()
    reserve = max(reserve_min, int(reserve_fraction * total))
    budget = free - reserve - (0 if weights_loaded else weight_bytes)
    return {"budget_bytes": int(max(budget, 0)), "free_bytes": int(free), "total_bytes": int(total),
            "reserve_bytes": reserve, "weights_counted": not weights_loaded, "source": source}


def plan_loaded(model, lat, device, contexts: list[int] | None = None, drafts: dict | None = None,
                k_max: int = 0) -> tuple[MemoryPlan, dict]:
    """The plan of a loaded model against the memory free now, and that budget: its plain grid
    (contexts: lat.context_lengths by default), or with `drafts` (spec -> draft, loaded beside it)
    the B = 1 speculative cell at contexts[0] with verify width k_max + 1, the largest draft cache
    (one alive at a time) set aside first."""
    use_gqa_attention(hf_model(model))  # the path its CachedModel will run anyway (idempotent)
    path = attention_path(hf_model(model))
    weights = bytes_in_memory(model)
    budget = device_budget(device, weights_loaded=True, weight_bytes=weights)
    shape = ModelShape.from_model(model, weights)
    if drafts is None:
        plan = plan_grid(shape, lat.batch_sizes, lat.context_lengths if contexts is None else contexts,
                         lat.new_tokens, budget["budget_bytes"], device.type, attention_path=path)
        return plan, budget
    kv = [0 if getattr(d, "model", None) is None else
          ModelShape.from_model(hf_model(d.model), 0).kv_bytes_per_token for d in drafts.values()]
    largest = max(kv, default=0) * cache_len(contexts[0], lat.new_tokens)
    plan = plan_grid(shape, [1], contexts, lat.new_tokens, budget["budget_bytes"] - largest, device.type,
                     verify_width=k_max + 1, attention_path=path)
    plan.budget_bytes = int(budget["budget_bytes"])
    for step in plan.steps:
        if step["action"] == "run":
            step["draft_cache_bytes"] = int(largest)
    return plan, budget

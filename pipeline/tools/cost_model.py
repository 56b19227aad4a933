"""The cost model under pipeline/tools/estimate.py (issue 27): seconds for one forward of a config's
variant or draft, for a model shape on a device, and the parts a stage's estimate is made of.

One forward of `rows` sequences, each adding `new` tokens after `context` cached ones, in `calls` calls:
    bytes = calls * W + rows * (context + new) * K * kv_passes   (roofline.bytes_per_step's W + B * K)
    flops = 2 * P * rows * new + 2 * layers * q_dim * rows * new * (2 * context + new)   (matmuls; causal attention)
    time  = slowdown[scheme] * (calls * layers * EAGER_LAYER_S + bytes / (bandwidth * BW_EFF)
                                + flops / (bf16 peak * FLOPS_EFF))
W: the variant's weights read per step (pipeline/latency/plan.py estimated_weight_bytes, less an untied
input embedding, which a step reads one row of), K: KV bytes per token per sequence, P: the parameters
a token's matmuls use. A decode step (new = 1) is the bytes term plus the host's launch overhead, which
is zero for the steps latency.compile replays as CUDA graphs; a prefill (context = 0) is the flops term.
The device constants are in pipeline/tools/cost_devices.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from pipeline.decode.attention import GQA
from pipeline.latency.memory import ModelShape
from pipeline.latency.plan import estimated_weight_bytes, linear_parameters
from pipeline.latency.roofline import bytes_per_step, kv_passes
from pipeline.speculation.workload import workload_prompts
from pipeline.tools.cost_devices import Device
from pipeline.tools.gpu_check_parts import SHAPES as GPU_CHECK_SHAPES

SHAPES = {  # transformers LlamaConfig fields
    # gpu_check's Llama-3-8B with Llama-3.1's context (gpu.yaml's 8192-token cells and 32k haystacks need it).
    "8b": dict(GPU_CHECK_SHAPES["8b"]["config"], max_position_embeddings=131072),
    # The embedded model (tests/test_foundation.py: 30 layers, hidden 576, 9 / 3 heads, vocabulary 49152).
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "tiny": GPU_CHECK_SHAPES["tiny"]["config"],
}

# ---------------------------------------------------------------- drafts and prompts

# Per-token acceptance rate a: E(k) = (1 - a^(k+1)) / (1 - a) tokens a round (Leviathan et al., 2023); a
# batch keeps its fewest accepted, so E_B(k) is E(k) at a^B (rows independent). ngram: prompt lookup's
# E(3) = 1.49 over the 62 built-in prompts (docs/results/2026-12-02-categories.md); the others are guesses.
ACCEPTANCE_RATE = {"ngram": 0.33, "layerskip": 0.30, "self": 0.85, "hf": 0.60}
NGRAM_PROPOSE_S = 2e-4  # host time of a prompt-lookup proposal (guess)
HF_DRAFT_FRACTION = 0.1  # an external draft's forward / the target's (its size is not known here; guess)
CHARS_PER_TOKEN = 4.65  # evals/generate.py: measured on English text with the SmolLM2 tokenizer
TEMPLATE_TOKENS = 30  # a chat template's system and role tokens around a user turn (guess)
SCREEN_PROBE_S = 10.0  # latency.screen's probe per pair and phase ("a few seconds")
# The screen reads acceptance's upper CI, not its mean: the estimate predicts a pair screened out only
# when its speedup bound stays below 1 with the rate per position raised by this much (a guess).
SCREEN_RATE_MARGIN = 0.1


class CharTokenizer:
    """Tokens = characters / CHARS_PER_TOKEN (+ TEMPLATE_TOKENS for a prompt): lets the workload's own
    draw (pipeline/speculation/workload.py) pick the prompts and their lengths without a model."""
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * (math.ceil(len(text) / CHARS_PER_TOKEN) + (TEMPLATE_TOKENS if add_special_tokens else 0))


def tokens_per_round(k: int, a: float, batch: int = 1) -> float:
    a = a ** batch
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


# ---------------------------------------------------------------- the cost of forwards


class Cost:
    """Forward times of one config's variants and drafts for one model shape on one device."""

    def __init__(self, cfg, shape_name, device: Device):
        """shape_name: a name in SHAPES, or a dict of LlamaConfig fields (a model's own shape)."""
        from transformers import LlamaConfig

        self.cfg, self.dev = cfg, device
        self.config = SHAPES[shape_name] if isinstance(shape_name, str) else dict(shape_name)
        self.base = ModelShape.from_config(LlamaConfig(**self.config), torch.bfloat16)  # meta device: no memory
        self.params = self.base.weight_bytes // 2
        self.embedding = 0 if self.config.get("tie_word_embeddings") else self.base.vocab * self.base.hidden
        self.context = self.config["max_position_embeddings"]

    def shape(self, variant: str) -> ModelShape:
        """The shape in the variant's compute dtype (auto: bf16 on CUDA, float32 on CPU)."""
        v = self.cfg.quantize.variants[variant]
        dtype = v.dtype if v.dtype != "auto" else ("bfloat16" if self.dev.cuda else "float32")
        e = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        return replace(self.base, weight_bytes=self.params * e, element_bytes=e)

    def held_bytes(self, variant: str) -> int:
        """The variant's weights in memory, plus the dequantized copy where kernels make one."""
        s = self.shape(variant)
        held = estimated_weight_bytes(s, self.cfg.quantize.variants[variant])
        if self.dev.dequantizes and held != s.weight_bytes:
            held += linear_parameters(s) * s.element_bytes
        return held

    def forward(self, variant: str, rows: float, new: float, context: float, calls: float = 1,
                eager: bool = True, fraction: float = 1.0) -> float:
        """Seconds for `calls` forwards that add `new` tokens to each of `rows` sequences after `context`
        cached positions (module docstring); `fraction` of the model (a layer-skip draft)."""
        s, d = self.shape(variant), self.dev
        weights = self.held_bytes(variant) - self.embedding * s.element_bytes
        moved = bytes_per_step(calls * weights, rows, context + new, s.kv_bytes_per_token,
                               kv_passes(GQA, s.heads, s.kv_heads))  # the engine's path reads each KV head once
        matmul = 2 * (self.params - self.embedding) * rows * new
        attention = 2 * s.layers * s.heads * s.head_dim * rows * new * (2 * context + new)
        overhead = calls * s.layers * d.eager_layer_s if eager else 0.0
        scheme = self.cfg.quantize.variants[variant].scheme
        return fraction * d.slowdown.get(scheme, 1.0) * (
            overhead + moved / (d.bandwidth * d.bw_eff) + (matmul + attention) / (d.flops * d.flops_eff))

    def decode_step(self, variant: str, batch: int = 1, context: float = 0, eager: bool = True) -> float:
        return self.forward(variant, batch, 1, context, eager=eager)

    def generate(self, variant: str, rows: int, prompt: float, new: int, eager: bool = True) -> float:
        """Prefill, then `new` decode steps (at the mean context: a step's cost is linear in it)."""
        return self.forward(variant, rows, prompt, 0) + new * self.decode_step(variant, rows, prompt + new / 2, eager)

    def draft(self, spec: str, target: str, rows: int, new: float, context: float, eager: bool = True) -> float:
        """A draft's forward of `new` tokens per row (a step: new = 1; its prefill: context = 0)."""
        kind, _, arg = spec.partition(":")
        if kind == "ngram":
            return NGRAM_PROPOSE_S
        if kind == "self" and arg in self.cfg.quantize.variants:
            return self.forward(arg, rows, new, context, eager=eager)
        fraction = HF_DRAFT_FRACTION
        if kind == "layerskip" and arg.isdigit():  # the first N layers, the final norm and the head
            per_layer, head = linear_parameters(self.base) / self.base.layers, self.base.vocab * self.base.hidden
            fraction = (min(int(arg), self.base.layers) * per_layer + head) / (self.base.layers * per_layer + head)
        return self.forward(target, rows, new, context, eager=eager, fraction=fraction)

    def speculate(self, target: str, spec: str, rows: int, prompt: float, new: int, k: int,
                  eager: bool = True) -> float:
        """Prefill (target and draft), then new / E_B(k) rounds of k draft steps and a verify of k + 1."""
        rounds = new / tokens_per_round(k, ACCEPTANCE_RATE.get(spec.split(":")[0], ACCEPTANCE_RATE["hf"]), rows)
        ctx = prompt + new / 2
        draft_prefill = 0.0 if spec.startswith("ngram") else self.draft(spec, target, rows, prompt, 0)
        return (self.forward(target, rows, prompt, 0) + draft_prefill
                + rounds * (self.forward(target, rows, k + 1, ctx, eager=eager)
                            + k * self.draft(spec, target, rows, 1, ctx, eager)))

    def screen_bound(self, target: str, spec: str, rows: int, context: float, ks) -> float:
        """The largest over k of the screen's upper speedup (pipeline/latency/screen.py) under this
        model: E(k) at the guessed rate + SCREEN_RATE_MARGIN, over the round's verify and k draft
        steps, against a plain step, all eager (the screen runs only where the steps do)."""
        return max(self.screen_bounds(target, spec, rows, context, ks).values())

    def screen_bounds(self, target: str, spec: str, rows: int, context: float, ks) -> dict[int, float]:
        """k -> the screen's upper speedup at k under this model (screen_bound is their largest)."""
        rate = min(1.0, ACCEPTANCE_RATE.get(spec.split(":")[0], ACCEPTANCE_RATE["hf"]) + SCREEN_RATE_MARGIN)
        plain = self.decode_step(target, rows, context)
        return {k: tokens_per_round(k, rate, rows) * plain
                / (self.forward(target, rows, k + 1, context) + k * self.draft(spec, target, rows, 1, context))
                for k in ks}

    def load(self, variant: str) -> float:
        return self.held_bytes(variant) / self.dev.disk


# ---------------------------------------------------------------- the stages


@dataclass
class Stage:
    name: str
    parts: list = field(default_factory=list)  # (what, seconds, part of the floor)
    notes: list = field(default_factory=list)

    def add(self, what: str, seconds: float, floor: bool = True) -> None:
        self.parts.append((what, float(seconds), floor))

    @property
    def seconds(self) -> float:
        return sum(s for _, s, _ in self.parts)

    @property
    def floor(self) -> float:
        return sum(s for _, s, f in self.parts if f)


def prompt_lengths(c: Cost, stage: str, per_kind: int | None = None) -> list[int]:
    prompts = workload_prompts(c.cfg, CharTokenizer(), stage, per_kind, context=c.context, quiet=True)
    return [len(ids) for rows in prompts.values() for _, ids in rows]

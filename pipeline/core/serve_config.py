"""The `vllm` and `serving` sections of the config schema (pipeline/core/config.py is the whole
schema and the one loader): the vLLM engine the speculation stage starts, its open-loop check, and
the SLO the open-loop check judges goodput by. Every default here is a
default of the one schema.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from pipeline.core.section import Section


class VllmOpenLoopConfig(Section):
    """The recommendation checked under open-loop load: Poisson arrivals at these shares of the
    plain engine's measured capacity (its closed-loop requests/s at the largest concurrency)."""
    # Offered loads, as shares of the plain engine's capacity: one open-loop run per load on the plain
    # engine and on each speculative config checked. Needs open_loop_check and a non-empty concurrency.
    loads: list[PositiveFloat] = Field(default_factory=lambda: [0.8])
    requests: PositiveInt = 16  # per load and engine


class VllmEngineConfig(Section):
    """Speculation measured in vLLM (pipeline/stages/vllm_engine.py), in the venv `make install`
    builds (.venv-vllm): one engine per (target, draft, k), started on 127.0.0.1 and always stopped."""
    # Target variants; null = every release variant (those vLLM cannot serve here are skipped with
    # one line; list the reference to measure it too).
    targets: list[str] | None = None
    # Draft lengths 1..k_max, one engine each (about half a minute to start on a 2-core CPU, seconds
    # of it on a GPU box); null = acceptance.k_max.
    k_max: PositiveInt | None = 2
    # Closed-loop concurrencies measured besides B = 1 (each k's own table, and the k recommended at
    # each concurrency).
    concurrency: list[PositiveInt] = Field(default_factory=lambda: [4])
    # Compute dtype; auto = bfloat16.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Context length in tokens each engine is built for (vLLM's --max-model-len); workload prompts
    # longer than it less the tokens generated and the verify width (k + 1) are skipped.
    max_model_len: PositiveInt = 2048
    # CUDA graphs off; null = on CPU (where vLLM compiles nothing useful for a small model) only.
    enforce_eager: bool | None = None
    kv_cache_gib: PositiveFloat = 2.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    # Share of each GPU's memory one engine takes (vLLM's --gpu-memory-utilization); not passed on CPU.
    gpu_memory_utilization: PositiveFloat = 0.9
    # GPUs each engine is split over (vLLM's --tensor-parallel-size); not passed on CPU.
    tensor_parallel_size: PositiveInt = 1
    # Seconds an engine may take to start serving (answer /health) before its start counts as
    # failed; the quality stage's vLLM engines use it too.
    startup_timeout_s: PositiveFloat = 600.0
    # Seconds one request to an engine may take before it fails (the HTTP timeout); the quality
    # stage's vLLM requests use it too.
    request_timeout_s: PositiveFloat = 600.0
    # Check the recommendation under open-loop load against no speculation and the best fixed k.
    open_loop_check: bool = True
    open_loop: VllmOpenLoopConfig = Field(default_factory=VllmOpenLoopConfig)
    # More api_server flags, as --<key> <value> (true: the bare flag).
    engine_args: dict[str, str | int | float | bool | None] = Field(default_factory=dict)

    @field_validator("concurrency")
    @classmethod
    def _conc(cls, v: list[int]) -> list[int]:
        if any(c < 2 for c in v):
            raise ValueError("concurrencies are >= 2 (B = 1 is always measured)")
        return v


class ServingConfig(Section):
    """The SLO the vllm stage's open-loop check judges goodput by: a request meets it when its TTFT
    and its TPOT are both within their limits; goodput = such requests per second."""
    slo_ttft_ms: PositiveFloat = 2000.0  # time to first token
    slo_tpot_ms: PositiveFloat = 100.0  # time per output token after the first

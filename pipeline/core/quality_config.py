"""The `quality` section of the config schema (pipeline/core/config.py is the whole schema and
the one loader): the slices and lm-eval tasks, their items and waves, generation, the sandbox for
code, and the vLLM backend's settings. Every default here is a default of the one schema.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, PositiveInt, field_validator, model_validator

from pipeline.core.section import Section


class SliceSettings(Section):
    # Items of this slice: a number, or "all" (bfcl, code and lm-eval tasks); null = items_per_slice.
    items: PositiveInt | Literal["all"] | None = None
    # Most tokens generated per item; null = quality.max_new_tokens. A slice's YAML caps it too.
    max_new_tokens: int | None = None
    # Items per look of this slice; null = quality.wave_items. For a slice much smaller than the
    # others' waves, which would otherwise be one fixed-n look.
    wave_items: PositiveInt | None = None


# Real benchmarks need longer answers than the synthetic slices' 32 tokens (64 hold 99% of BFCL's
# simple and multiple answers; HumanEval bodies take a few hundred). Merged under a config's own
# `per_slice` entries (a config names only what it changes).
PER_SLICE_DEFAULTS = {"bfcl": {"items": "all", "max_new_tokens": 64},
                      "code": {"items": 40, "max_new_tokens": 256}}


class SandboxConfig(Section):
    """Limits on the code slice's generated programs, each run in a separate sandboxed process
    (evals/sandbox.py)."""
    # Wall-clock seconds per program; its process group is killed at the limit.
    seconds: float = 10.0
    # Address space per program, in MiB (RLIMIT_AS).
    memory_mb: int = 1024
    # Programs run at once; 0 = as many as the machine has CPUs.
    workers: int = 0


# Engine arguments specq sets itself; quality.vllm.engine_args may not name them.
VLLM_OWN_ARGS = ("pretrained", "model", "tokenizer", "quantization", "load_format", "seed", "batch_size",
                 "dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_length")


class VllmConfig(Section):
    """quality.backend: vllm: a vLLM server (the vLLM venv `make install` builds) scores every
    variant vLLM can load, through lm-eval's local-completions client. Where the engine runs (CPU
    KV cache, eager mode, timeouts) comes from the top-level `vllm` section."""
    # GPUs each model is split over (vLLM's tensor parallelism).
    tensor_parallel_size: int = Field(1, ge=1)
    # Share of each GPU's memory one vLLM engine takes (weights, activations, KV cache).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Context length the engine is built for; null = the model's own. Longer prompts are cut from
    # the left, as with hf.
    max_model_len: int | None = Field(None, ge=1)
    # Compute dtype; "auto" = the one the hf backend computes the variant in.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # A variant vLLM cannot load: "hf" scores it with the hf backend (its quality meta.json says
    # why); "stop" refuses the run before any work.
    fallback: Literal["hf", "stop"] = "hf"
    # Keep the reference's engine loaded beside each variant's instead of reloading it for every
    # look; two engines then share each GPU (gpu_memory_utilization <= 0.5).
    keep_reference: bool = False
    # Measure the distribution drift (full logits, which vLLM does not return) through transformers
    # on `device` after the engines are released; false leaves it out (gate.max_kl and
    # min_top1_agreement are then refused).
    distribution: bool = False
    # The GPUs engines may use (CUDA_VISIBLE_DEVICES ids); null = every visible GPU. With more than
    # tensor_parallel_size of them and no time budget, variants are scored side by side.
    devices: list[str] | None = None
    # Prompts per completions request (vLLM batches them; also the engine's max_num_seqs, at least 8).
    batch_size: int = Field(32, ge=1)
    # More vLLM server flags, as --<key> <value> (true: the bare flag): enforce_eager,
    # kv_cache_dtype, pipeline_parallel_size, ...
    engine_args: dict[str, str | int | float | bool | None] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _engine_args(cls, v: dict) -> dict:
        own = sorted(set(v) & set(VLLM_OWN_ARGS))
        if own:
            raise ValueError(f"'{own[0]}' is set by specq (the variant's directory, the run's seed or a "
                             "key of quality.vllm itself), not through engine_args")
        return v

    @model_validator(mode="after")
    def _two_engines(self):
        if self.keep_reference and self.gpu_memory_utilization > 0.5:
            raise ValueError("keep_reference puts two engines on each GPU: gpu_memory_utilization must be "
                             f"<= 0.5, not {self.gpu_memory_utilization}")
        return self


class QualityConfig(Section):
    """The quality stage: the reference and every variant scored item by item on the built-in slices
    and lm-eval tasks, in waves the sequential gate stops early, and their distribution drift."""
    # Built-in slices to score: reasoning, language, long_context, calibration, tool_args (generated),
    # bfcl (BFCL v4, from the bfcl-eval package) and code (HumanEval, run in the sandbox). The
    # default is the four that score fastest on a CPU.
    slices: list[str] = Field(
        default_factory=lambda: ["reasoning", "language", "calibration", "tool_args"]
    )
    # lm-eval tasks, groups or tags by name (or a path to a task YAML), run where their data is
    # reachable, skipped with one line if not. A group or tag is one slice; its subtasks are groups.
    tasks: list[str] = Field(default_factory=list)
    # Headline score per task as "metric,filter" (e.g. gsm8k: "exact_match,strict-match"); either
    # part may be left out. Default: acc_norm where reported, else the first per-item metric; the
    # task's first filter.
    task_primary: dict[str, str] = Field(default_factory=dict)
    # Clusters per task: a document field whose equal values are one cluster (e.g. "premise"), or
    # "doc_id" for groups whose subtasks are the same documents translated. Default: the first
    # shared-passage field (context, passage, article, ...) that repeats.
    task_clusters: dict[str, str] = Field(default_factory=dict)
    # Per-slice item counts, generation caps and wave sizes.
    per_slice: dict[str, SliceSettings] = Field(
        default_factory=lambda: {k: SliceSettings(**v) for k, v in PER_SLICE_DEFAULTS.items()})
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    # Items of each generated slice (its pool), capped by max_items. CPU-sized: enough for a
    # byte-identical copy to pass every default slice in waves of 40.
    items_per_slice: int = 240
    # The most items any slice scores (the run's budget per slice; null = its whole pool).
    max_items: PositiveInt | None = 240
    # Items per look of the sequential gate: every slice is scored wave_items at a time in a fixed
    # seeded order, and after each wave every open (variant, slice) cell is tested; a cell that
    # passes or fails stops. null = one look at all items (the fixed-n gate).
    wave_items: PositiveInt | None = 40
    # Haystack lengths of the long_context slice, in tokens (approximate); each is a group.
    long_context_lengths: list[int] = Field(default_factory=lambda: [256, 512, 1024])
    # Most tokens generated per item of a built-in slice (greedy), unless per_slice sets its own.
    # lm-eval tasks keep their own generation settings.
    max_new_tokens: int = 32
    # Wrap the built-in slices' prompts in the chat template (they are few-shot completion
    # prompts, which the template hurts).
    chat_template: bool = False
    # "prefix" computes each shared prompt prefix once and decodes greedy generations in batches;
    # "hflm" is lm-eval's HFLM (the same scores, slower).
    evaluator: Literal["prefix", "hflm"] = "prefix"
    # What runs the models: "hf" (transformers on `device`, with `evaluator`) or "vllm" (every
    # variant vLLM can load; settings: `vllm`; the others as "hf").
    backend: Literal["hf", "vllm"] = "hf"
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    # Rows per forward pass (prefill and decode).
    batch_size: int = 40
    # Held-out documents of the distribution drift (KL, top-1 agreement, perplexity ratio): one per
    # Python standard-library module with enough docstring text.
    distribution_docs: int = 16
    # Tokens per held-out document of the distribution drift.
    distribution_tokens: int = 256

    @field_validator("per_slice", mode="before")
    @classmethod
    def _merge_per_slice(cls, v):
        if not isinstance(v, dict):
            return v
        merged = {k: dict(d) for k, d in PER_SLICE_DEFAULTS.items()}
        for name, entry in v.items():
            entry = entry.model_dump() if isinstance(entry, BaseModel) else entry
            merged[name] = {**merged.get(name, {}), **(entry or {})} if isinstance(entry, dict) else entry
        return merged

    def items_for(self, name: str) -> int | None:
        """Items of slice `name` (None = all it has)."""
        entry = self.per_slice.get(name)
        n = entry.items if entry and entry.items is not None else self.items_per_slice
        return None if n == "all" else n

    def wave_items_for(self, name: str) -> int | None:
        """Items per look of slice or task `name` (None = one look at all its items)."""
        entry = self.per_slice.get(name)
        return entry.wave_items if entry and entry.wave_items is not None else self.wave_items

    def max_new_tokens_for(self, name: str) -> int:
        entry = self.per_slice.get(name)
        return entry.max_new_tokens if entry and entry.max_new_tokens is not None else self.max_new_tokens

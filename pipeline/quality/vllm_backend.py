"""`quality.backend: vllm`: the quality slices scored through lm-eval's vLLM model, for models larger
than one GPU (tensor parallelism) or simply faster generation.

    from pipeline.quality import vllm_backend
    choice = vllm_backend.choose(cfg.quality, variant_dir, seed=cfg.seed)   # Choice("vllm", kwargs) or ("hf", why)
    engines = vllm_backend.Engines()
    lm, load_seconds = engines.get(name, choice.kwargs)     # lm_eval.models.vllm_causallms.VLLM(**kwargs)
    records, counters = evaluate(lm, lm.tokenizer, ...)     # pipeline/quality/evaluate.py, unchanged records

Only the lm-eval model differs from the hf backend: the same task configs, the same
simple_evaluate call, the same per-item records (pipeline/quality/evaluate.py), so the gate does
not care which backend scored a variant.

`vllm_args` (a pure function: no vLLM needed) turns a variant directory and its meta.json into
the keyword arguments of lm-eval's VLLM model: pretrained and tokenizer = the directory (its
tokenizer is the reference's: quantize wrote it there, or checked a checkpoint's against it),
dtype, tensor_parallel_size, gpu_memory_utilization, max_model_len, the run's seed, batch_size
"auto" (every request of a call handed to vLLM at once), and the quantization where vLLM must be
told. What vLLM reads comes from the directory's config.json `quantization_config` (or an
auto-gptq quantize_config.json), as pipeline/variants/checkpoint.py reads it:

    scheme / quant_method          vLLM
    none, reference, plain ckpt    plain weights
    gptq (GPTQModel), awq, fp8,    read from config.json by vLLM itself; `quantization` is left
    compressed-tensors, ...        unset so vLLM picks its fastest kernel (gptq -> gptq_marlin)
    bnb-int8, bnb-nf4,             quantization and load_format "bitsandbytes" (pre-quantized
    bitsandbytes checkpoints       bitsandbytes weights need vLLM's bitsandbytes loader)
    torchao-int8wo, torchao ckpt   not loaded: a one-line reason
    a method vLLM does not list    not loaded: a one-line reason
    GGUF weights only              not loaded: a one-line reason

A variant vLLM cannot load is scored with the hf backend (quality.vllm.fallback: hf, the default:
the gate compares per-item records, which have the same shape from either backend; its
quality/<variant>/meta.json says `backend: hf` and why), or the run is refused before any work
(fallback: stop). The choice is in what a variant's lines were scored with (stages/quality.py:
item_inputs), so a changed backend re-scores.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.stage import StageError, library_version, read_json
from pipeline.vllm.spec_config import BITSANDBYTES, SCHEME_NOT_READ, method_reason

def unavailable() -> str | None:
    """Why `backend: vllm` cannot run here (one line), or None where vLLM is importable."""
    if importlib.util.find_spec("vllm") is None:
        return ("quality.backend vllm: the Python package vllm is not installed here (install it on the GPU "
                "machine, e.g. pip install vllm, or use quality.backend: hf)")
    return None


def supported_methods() -> frozenset[str] | None:
    """The quantization methods the installed vLLM lists, or None where vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:  # an import error inside vLLM: fall back to the static list
        return None
    return frozenset(QUANTIZATION_METHODS)


def _quant_method(vdir: Path) -> str | None:
    from pipeline.variants.checkpoint import quant_config, quant_method

    return quant_method(quant_config(vdir))


def vllm_args(vdir: str | Path, meta: dict, vcfg, seed: int,
              supported: frozenset[str] | None = None) -> dict | str:
    """lm-eval VLLM keyword arguments for the variant directory `vdir` (meta = its meta.json), or
    a one-line reason vLLM cannot load it. `vcfg` is quality.vllm; `supported` the quantization
    methods vLLM lists (None: VLLM_METHODS)."""
    vdir = Path(vdir)
    scheme = meta.get("scheme", "reference")
    if scheme in SCHEME_NOT_READ:
        return SCHEME_NOT_READ[scheme]
    if not any(vdir.glob("*.safetensors")) and not any(vdir.glob("*.bin")) and any(vdir.glob("*.gguf")):
        return "its weights are GGUF only (vLLM loads a single .gguf file, not a directory of them)"
    method = _quant_method(vdir)
    why = method_reason(method, supported)
    if why:
        return why
    args = {"pretrained": str(vdir), "tokenizer": str(vdir), "dtype": vcfg.dtype,
            "tensor_parallel_size": vcfg.tensor_parallel_size,
            "gpu_memory_utilization": vcfg.gpu_memory_utilization,
            "seed": seed, "batch_size": "auto"}
    if vcfg.max_model_len is not None:
        args["max_model_len"] = vcfg.max_model_len
    if method == "bitsandbytes":
        args.update(BITSANDBYTES)
    return {**args, **vcfg.engine_args}


@dataclass(frozen=True)
class Choice:
    """What scores a variant: backend "vllm" with lm-eval VLLM kwargs, or "hf" (with why, when
    vLLM was asked for and cannot load it)."""
    backend: str
    kwargs: dict | None = None
    why: str | None = None
    quant_method: str | None = None
    vllm_version: str | None = None

    def scored_with(self) -> dict:
        """What goes into the hash of what the variant's lines were scored with: the backend, the
        arguments (not the directory's path: a moved run is not re-scored), the vLLM version."""
        args = {k: v for k, v in (self.kwargs or {}).items() if k not in ("pretrained", "tokenizer")}
        return {"backend": self.backend, "why": self.why, "args": args, "vllm_version": self.vllm_version}

    def record(self, evaluator: str) -> dict:
        """What ran, for the variant's quality meta.json."""
        if self.backend == "vllm":
            return {"backend": "vllm", "evaluator": "vllm", "vllm_version": self.vllm_version,
                    "vllm_args": self.kwargs, "quant_method": self.quant_method}
        return {"backend": "hf", "evaluator": evaluator, **({"backend_reason": self.why} if self.why else {})}


def choose(qcfg, vdir: str | Path, seed: int, supported: frozenset[str] | None = None,
           name: str | None = None) -> Choice:
    """The backend that scores the variant in `vdir` under quality config `qcfg`: hf when asked;
    vllm where vllm_args builds its arguments; else hf with the reason (fallback: hf) or a
    StageError (fallback: stop)."""
    if qcfg.backend == "hf":
        return Choice("hf")
    vdir = Path(vdir)
    meta = read_json(vdir / "meta.json", "variant meta.json")
    args = vllm_args(vdir, meta, qcfg.vllm, seed, supported)
    if isinstance(args, str):
        if qcfg.vllm.fallback == "stop":
            raise StageError(f"quality: vLLM cannot load variant '{name or vdir.name}': {args} "
                             "(quality.vllm.fallback: stop; fallback: hf scores it with transformers)")
        return Choice("hf", why=f"vLLM cannot load it: {args}")
    return Choice("vllm", kwargs=args, quant_method=_quant_method(vdir), vllm_version=library_version("vllm"))


def config_reason(spec) -> str | None:
    """Why vLLM cannot load the variant a config entry (quantize.variants.<name>) makes, as far as
    the config and a checkpoint's config.json tell before quantize has run; None when it may."""
    if spec.scheme in SCHEME_NOT_READ:
        return SCHEME_NOT_READ[spec.scheme]
    if spec.scheme == "checkpoint" and spec.path:
        path = Path(spec.path).expanduser()
        if (path / "config.json").is_file():
            try:
                return method_reason(_quant_method(path), supported_methods())
            except (StageError, OSError, json.JSONDecodeError):
                return None  # quantize's own checks say what is wrong with the directory
    return None


# ---------------------------------------------------------------- engines (need vLLM)


class Engines:
    """The vLLM engines loaded, at most one at a time: loading another releases the loaded one's
    GPU memory first (`keep`, when named, is the reference's engine, left loaded beside it:
    quality.vllm.keep_reference). An hf model is never loaded while an engine holds the GPUs
    (the stage calls release() first)."""

    def __init__(self, keep: str | None = None, build=None):
        self.keep = keep
        self.loaded: dict[str, object] = {}
        self._build = build or _build_vllm

    def get(self, name: str, kwargs: dict) -> tuple[object, float]:
        """(the lm-eval model of `name`, seconds spent loading it now: 0.0 when it was loaded)."""
        if name in self.loaded:
            return self.loaded[name], 0.0
        self.release(keep=self.keep)
        start = time.perf_counter()
        self.loaded[name] = self._build(kwargs)
        return self.loaded[name], time.perf_counter() - start

    def release(self, name: str | None = None, keep: str | None = None) -> None:
        """Shut down engine `name` (None: every engine but `keep`) and free its GPU memory."""
        for n in [name] if name is not None else [n for n in self.loaded if n != keep]:
            lm = self.loaded.pop(n, None)
            if lm is not None:
                _shutdown(lm)


def _build_vllm(kwargs: dict):
    from lm_eval.models.vllm_causallms import VLLM

    from pipeline.quality import lm_tasks

    with lm_tasks.quiet():
        return VLLM(**kwargs)


def _shutdown(lm) -> None:
    """Stop an lm-eval VLLM model's engine (and its tensor-parallel worker processes) and return
    the memory: vLLM frees it when the LLM object is collected; its engine core (a process of its
    own in vLLM's V1 engine) is shut down first where it exposes shutdown()."""
    llm = getattr(lm, "model", None)
    engine = getattr(llm, "llm_engine", None)
    for obj in (getattr(engine, "engine_core", None), engine):
        stop = getattr(obj, "shutdown", None)
        if callable(stop):
            try:
                stop()
            except Exception:
                pass
            break
    if llm is not None:
        try:
            del lm.model
        except AttributeError:
            pass
    del llm, engine
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:
        pass
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass

"""The quantizers and loaders of the built-in schemes: none, gptq, bnb-int8, bnb-nf4, torchao-int8wo,
and GPTQ's calibration windows (`quantize.calibration`; builtin = evals/data/calibration.txt).

A quantizer turns the reference HF directory `src` into a variant directory `out` and returns the
extra keys of its meta.json; a loader is `(path, meta, device, dtype) -> model`. The registry
(pipeline/variants/schemes.py) calls them by scheme; `checkpoint` variants reuse the loaders.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.core.stage import REPO, StageError, library_version, progress, sha256_file
from pipeline.models.architecture import architecture, text_config, weight_matrices
from pipeline.models.loading import link_or_copy_tree

# Calibration windows per GPTQ forward pass (4 was ~4x faster than 1 on CPU).
CALIBRATION_BATCH = 4


@dataclass
class Job:
    """What a quantizer needs besides src/out: device, dtypes, calibration, where logs go."""

    name: str
    device: torch.device
    storage_dtype: torch.dtype  # dtype of the unquantized parts on disk (the reference's)
    compute_dtype: torch.dtype
    seed: int
    log_dir: Path
    calibration: Callable[[], list[list[int]]] | None = None  # token-id windows, made on demand


BUILTIN_CALIBRATION = REPO / "evals" / "data" / "calibration.txt"


@dataclass
class Calibration:
    path: Path
    sha256: str
    windows: list[list[int]]  # token ids, one list per calibration sample
    tokens_available: int

    @property
    def tokens(self) -> int:
        return sum(len(w) for w in self.windows)


def load_calibration(ccfg, tokenizer) -> Calibration:
    """n_samples windows of max_tokens tokens, evenly spread over the calibration text (so every
    language and the code in it are represented); refuse a text shorter than min_tokens."""
    path = BUILTIN_CALIBRATION if ccfg.source == "builtin" else Path(ccfg.source).expanduser()
    if not path.is_file():
        raise StageError(f"calibration text missing: {path} (quantize.calibration.source is '{ccfg.source}')")
    ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < ccfg.min_tokens:
        raise StageError(f"calibration text {path} is too short: {len(ids)} tokens, fewer than "
                         f"quantize.calibration.min_tokens = {ccfg.min_tokens}")
    size = min(ccfg.max_tokens, len(ids))
    n = max(1, min(ccfg.n_samples, len(ids) // size))
    if n < ccfg.n_samples or size < ccfg.max_tokens:  # windows do not overlap: fewer than asked
        progress(f"quantize: calibration text {path.name} has {len(ids)} tokens: {n} windows of {size} "
                 f"tokens, fewer than the {ccfg.n_samples} x {ccfg.max_tokens} asked (quantize.calibration)")
    starts = [round(i * (len(ids) - size) / max(1, n - 1)) for i in range(n)]
    return Calibration(path, sha256_file(path), [ids[s:s + size] for s in starts], len(ids))


def add_weight_noise(model: torch.nn.Module, relative_std: float, seed: int) -> int:
    """Deliberate damage, seeded: w += relative_std * std(w) * N(0, 1) on every decoder weight
    matrix (each expert of a fused tensor on its own). Returns the number of matrices changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for matrix in weight_matrices(model):
            w = matrix.param
            for m in (w if w.dim() == 3 else [w]):  # each expert is a matrix of its own
                noise = torch.randn(m.shape, generator=gen, dtype=torch.float32)
                m.add_((noise * (relative_std * m.float().std())).to(m.dtype))
                changed += 1
    if not changed:
        raise StageError(f"weight_noise: no decoder weight matrices found in {architecture(model)}")
    return changed


@contextlib.contextmanager
def library_output_to(log_file: Path):
    """Send a library's chatter to a log file and run in its directory (GPTQModel writes `logs/` into
    its working directory). Yields the real stderr."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cwd, stderr = os.getcwd(), sys.stderr
    with open(log_file, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        os.chdir(log_file.parent)
        try:
            yield stderr  # where the caller's own progress lines still go
        finally:
            os.chdir(cwd)


def hf_from_pretrained(src: Path, dtype: torch.dtype, device: torch.device, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=str(device), **kw)


def quantize_none(src: Path, out: Path, spec, job: Job) -> dict:
    bits = torch.finfo(job.storage_dtype).bits
    if spec.weight_noise > 0:
        model = hf_from_pretrained(src, job.storage_dtype, torch.device("cpu"))
        seed = (job.seed * 1_000_003 + zlib.crc32(job.name.encode())) % (2**31)  # one per variant
        n = add_weight_noise(model, spec.weight_noise, seed)
        model.save_pretrained(out, safe_serialization=True)
        return {"storage": f"copy of the reference with noise on {n} decoder weight matrices", "bits": bits,
                "library": "transformers", "library_version": library_version("transformers")}
    link_or_copy_tree(src, out)
    return {"storage": "hard links to the reference's files", "library": "transformers", "bits": bits,
            "library_version": library_version("transformers")}


def quantize_gptq(src: Path, out: Path, spec, job: Job) -> dict:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoConfig

    src, out = Path(src).resolve(), Path(out).resolve()  # the library runs in the log directory
    bits, group_size = spec.bits or 4, spec.group_size or 128
    windows = job.calibration()
    calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in windows]
    n_layers = text_config(AutoConfig.from_pretrained(src)).num_hidden_layers
    start = time.perf_counter()
    err = sys.stderr

    def layer_done(layer_idx: int, submodule_finalized: bool) -> None:
        if submodule_finalized:
            print(f"[{time.strftime('%H:%M:%S')}] quantize {job.name}: GPTQ layer {layer_idx + 1}/{n_layers} "
                  f"done ({time.perf_counter() - start:.0f} s)", file=err, flush=True)

    log = job.log_dir.resolve() / f"quantize-{job.name}.log"
    progress(f"quantize {job.name}: GPTQ {bits}-bit g{group_size} on {job.device.type}, "
             f"{len(windows)} calibration windows; GPTQModel's log -> {log}")
    qdevice = "cuda:0" if job.device.type == "cuda" else "cpu"
    with library_output_to(log) as err, transformers_classes_kept(AutoConfig.from_pretrained(src)):
        qc = QuantizeConfig(bits=bits, group_size=group_size, desc_act=False, sym=True,
                            device=qdevice, offload_to_disk=False)
        # On CPU GPTQModel would pick bfloat16, which a CPU may only emulate (~4x slower per layer).
        gm = GPTQModel.load(str(src), qc, **({"dtype": torch.float32} if qdevice == "cpu" else {}))
        gm.layer_callback = layer_done
        gm.quantize(calibration, backend="torch" if qdevice == "cpu" else "auto",
                    batch_size=CALIBRATION_BATCH)
        # The unquantized parameters go to disk in the reference's dtype, not the float32 used for
        # quantizing; the GPTQ buffers stay as GPTQModel made them.
        for p in gm.model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(job.storage_dtype)
        gm.model.config.dtype = job.storage_dtype
        gm.save(str(out))
    return {"storage": "GPTQ packed weights (GPTQModel format, safetensors)", "library": "gptqmodel",
            "bits": bits, "group_size": group_size, "quantize_dtype": "float32" if qdevice == "cpu" else "auto",
            "calibration_batch": CALIBRATION_BATCH,
            "library_version": library_version("gptqmodel"), "desc_act": False, "sym": True,
            "quantize_log": str(log)}


def load_gptq(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    from gptqmodel import GPTQModel
    from transformers import AutoConfig

    # GPTQModel prints to stdout while loading; keep stdout for the stages' own output.
    with contextlib.redirect_stdout(sys.stderr), transformers_classes_kept(AutoConfig.from_pretrained(path)):
        gm = GPTQModel.load(str(path), device=str(device), dtype=dtype)
    return gm.model


@contextlib.contextmanager
def transformers_classes_kept(config):
    """Undo, on exit, GPTQModel's process-wide edits to transformers (a MoE model's block class and the
    checkpoint conversion mapping), which would make later plain loads build unfused experts."""
    import transformers.conversion_mapping as conversion
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    module = None
    try:
        module = sys.modules[AutoModelForCausalLM._model_mapping[type(config)].__module__]
    except (KeyError, AttributeError):
        pass
    saved_module = dict(vars(module)) if module is not None else {}
    saved = [(m, "get_checkpoint_conversion_mapping", getattr(m, "get_checkpoint_conversion_mapping", None))
             for m in (conversion, modeling_utils)]
    try:
        yield
    finally:
        for name, value in saved_module.items():
            if getattr(module, name, None) is not value:
                setattr(module, name, value)
        for m, name, value in saved:
            if value is not None:
                setattr(m, name, value)


def _quantize_bnb(src: Path, out: Path, job: Job, config, storage: str) -> dict:
    # Unquantized parts are stored in the reference's dtype: the size on disk is the scheme's cost.
    model = hf_from_pretrained(src, job.storage_dtype, job.device, quantization_config=config)
    model.save_pretrained(out, safe_serialization=True)
    return {"storage": storage, "library": "bitsandbytes", "library_version": library_version("bitsandbytes")}


def quantize_bnb_int8(src: Path, out: Path, spec, job: Job) -> dict:
    from transformers import BitsAndBytesConfig

    if spec.bits not in (None, 8):
        raise StageError(f"variant '{job.name}': scheme bnb-int8 is 8-bit, not {spec.bits}-bit")
    return {**_quantize_bnb(src, out, job, BitsAndBytesConfig(load_in_8bit=True),
                            "LLM.int8 weights serialized by save_pretrained"),
            "bits": 8, "group_size": None, "scales": "per output row",
            "matmul": "int8 with outlier columns in 16-bit; inputs cast to float16"}


def quantize_bnb_nf4(src: Path, out: Path, spec, job: Job) -> dict:
    from transformers import BitsAndBytesConfig

    if spec.bits not in (None, 4):
        raise StageError(f"variant '{job.name}': scheme bnb-nf4 is 4-bit, not {spec.bits}-bit")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_compute_dtype=job.compute_dtype)
    return {**_quantize_bnb(src, out, job, config, "NF4 weights + quant state serialized by save_pretrained"),
            "bits": 4, "group_size": 64, "scales": "one absmax per block of 64 weights"}


# bitsandbytes' block of output rows in its packed CPU NF4 layout (functional._convert_weight_packed_for_cpu).
_BNB_CPU_BLOCK_N = 32


_SEEN_MESSAGES: set[str] = set()


def _once_per_message(record: logging.LogRecord) -> bool:
    """A logging filter that lets each distinct message through once."""
    new = record.getMessage() not in _SEEN_MESSAGES
    _SEEN_MESSAGES.add(record.getMessage())
    return new


def load_bnb(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    import warnings

    # LLM.int8 on float32 inputs says on every matmul that it casts them to float16: keep it once.
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_once_per_message)  # added once
    model = hf_from_pretrained(path, dtype, device)
    # transformers keeps a pre-quantized bnb model's unquantized parts (embeddings, norms) in the
    # stored dtype and refuses model.to(dtype); cast those plain parameters one by one.
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if type(p) is torch.nn.Parameter and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        if type(m).__name__ == "Linear4bit":  # NF4 dequantizes into compute_dtype
            m.compute_dtype = dtype
            # bitsandbytes' avx512-bf16 CPU kernel asserts out_features % 32 == 0 on its first
            # forward; a narrower layer (Qwen2-MoE's shared_expert_gate) keeps the generic NF4 path.
            if getattr(m, "support_avx512bf16_for_cpu", False) and m.out_features % _BNB_CPU_BLOCK_N:
                m.support_avx512bf16_for_cpu = False
    return model


def quantize_torchao_int8wo(src: Path, out: Path, spec, job: Job) -> dict:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    if spec.bits not in (None, 8):
        raise StageError(f"variant '{job.name}': scheme torchao-int8wo is 8-bit, not {spec.bits}-bit")
    model = hf_from_pretrained(src, job.storage_dtype, job.device,
                                quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    model.save_pretrained(out, safe_serialization=True)
    return {"storage": "torchao int8 weight-only tensors (per-channel scales) serialized by save_pretrained",
            "library": "torchao", "library_version": library_version("torchao"), "bits": 8, "group_size": None,
            "scales": "per output channel"}


def load_torchao(path: Path, meta: dict, device: torch.device, dtype: torch.dtype):
    return hf_from_pretrained(path, dtype, device)

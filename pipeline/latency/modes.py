"""How a timed cell really ran, and whether two cells may be compared (like with like).

    from pipeline.latency.modes import calls_before, steps_ran, run_mode, compare, kernel_fallback
    before = calls_before(session)                      # None session: compile off
    res = generate(...)                                 # the cell's runs
    ran = steps_ran(session, before)                    # the step shapes those runs used, and how each ran
    mode = run_mode(ran, kernels=quantized_kernels(model), why_eager="off")
    compare(mode_a, mode_b, ("variant", "reference"))  # {"like_with_like": False, "modes": {...}} or True

A ratio whose sides ran differently (compiled over eager, a fallback kernel over a native one) is
flagged and left out of every recommendation. Fallback kernels: docs/methods/gpu-box.md.
"""
from __future__ import annotations

EAGER, COMPILED, MIXED = "eager", "compiled", "mixed"


def kernel_fallback(kernels: dict | None) -> str | None:
    """The fallback kernels a variant's quantized layers run (e.g. "TorchFusedQuantLinear"), or None."""
    found = []
    for name, info in ((kernels or {}).get("details") or {}).items():
        if info.get("library") in ("gptqmodel", "auto_gptq"):
            quant_type = str(info.get("QUANT_TYPE") or "").lower()
            if quant_type in ("torch", "torch_fused") or (not quant_type and name.lower().startswith("torch")):
                found.append(name)
    return ", ".join(sorted(found)) or None


def _key_name(key: tuple) -> str:
    label, batch, width, length, all_logits = key
    return f"{label} B={batch} w={width} L={length}{' all logits' if all_logits else ''}"


def calls_before(session) -> dict:
    """Calls per shape so far (empty without a session): what steps_ran subtracts."""
    return {} if session is None else {k: r.calls for k, r in session.shapes.items()}


def steps_ran(session, before: dict) -> dict[str, dict]:
    """The step shapes called since `before`: name -> {"ran": "compiled" | "eager", "reason"}."""
    if session is None:
        return {}
    return {_key_name(k): {"ran": r.ran, "reason": r.reason} for k, r in session.shapes.items()
            if r.calls > before.get(k, 0)}


def merge_ran(*parts: dict) -> dict:
    """Several runs' steps_ran in one (a shape keeps how it ran: a session decides it once)."""
    out: dict = {}
    for p in parts:
        for name, rec in (p or {}).items():
            if name in out and out[name]["ran"] != rec["ran"]:
                out[name] = {"ran": MIXED, "reason": rec.get("reason") or out[name].get("reason")}
            else:
                out.setdefault(name, rec)
    return out


def run_mode(ran: dict, kernels: dict | None = None, why_eager: str | None = None) -> dict:
    """A cell's mode from steps_ran (merged over its runs). No shape recorded means no session
    ran the steps: eager, for `why_eager` (compile off, or asked for where it cannot run)."""
    states = {r["ran"] for r in ran.values()}
    if not ran:
        steps = EAGER
    elif states == {COMPILED}:
        steps = COMPILED
    elif states == {EAGER}:
        steps = EAGER
    else:
        steps = MIXED
    mode: dict = {"steps": steps}
    if kernels is not None:
        fallback = kernel_fallback(kernels)
        mode["kernel"] = "fallback" if fallback else "native"
        if fallback:
            mode["fallback_kernels"] = fallback
    eager = [{"shape": name, "reason": r.get("reason")} for name, r in sorted(ran.items()) if r["ran"] != COMPILED]
    if not ran:
        eager = [{"shape": "every step", "reason": why_eager or "no compile session"}]
    if eager:
        mode["eager_steps"] = eager
    mode["label"] = label(mode)
    return mode


def label(mode: dict | None) -> str:
    """"compiled", "eager", "mixed", each with " + fallback kernel" where the variant runs one."""
    if not mode:
        return "unknown"
    return mode["steps"] + (" + fallback kernel" if mode.get("kernel") == "fallback" else "")


def same_way(a: dict | None, b: dict | None) -> bool | None:
    """True / False, or None when either side's mode was not recorded."""
    if not a or not b:
        return None
    if a["steps"] != b["steps"] or a["steps"] == MIXED:
        return False
    if "kernel" in a and "kernel" in b and a["kernel"] != b["kernel"]:
        return False
    return True


def compare(a: dict | None, b: dict | None, names: tuple[str, str]) -> dict:
    """The keys a ratio a / b gets: `like_with_like` and, when False, both sides' modes."""
    like = same_way(a, b)
    out: dict = {"like_with_like": like}
    if like is False:
        out["modes"] = {names[0]: label(a), names[1]: label(b)}
    return out


def comparable(row: dict) -> bool:
    """Whether a row's ratio may enter a recommendation (not flagged as mixed-mode)."""
    return row.get("like_with_like") is not False

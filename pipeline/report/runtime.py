"""The report's account of how latency was measured: device, the kernel each variant really ran,
and the memory plan.

    from pipeline.report.runtime import runtime_blocks
    blocks += runtime_blocks(run_dir)     # report blocks (pipeline/report/document.py)

Read from latency/<variant>.json and latency/<variant>__<draft>.json, which the latency stage
writes (pipeline/stages/latency.py).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.report.format import MISSING, json_files, nbytes


def kernel_text(kernels: dict | None) -> str:
    if not kernels:
        return "not recorded"
    if not kernels.get("kernels"):
        return f"unquantized ({kernels.get('compute_dtype') or MISSING})"
    parts = []
    for name, count in kernels["kernels"].items():
        info = kernels.get("details", {}).get(name, {})
        extra = ", ".join(f"{k} {info[k]}" for k in ("backend", "QUANT_TYPE", "compute_dtype", "quant_type", "tensor_impl")
                          if info.get(k))
        parts.append(f"{name} x{count}" + (f" ({extra})" if extra else ""))
    return f"{kernels.get('library')}: " + "; ".join(parts)


def runtime_blocks(run_dir: Path) -> list[tuple]:
    docs = json_files(run_dir / "latency", "*.json", "latency result")
    if not docs:
        return []
    rows, plan_rows = [], []
    for name, doc in docs.items():
        rows.append([name, str(doc.get("device_name") or doc.get("device") or MISSING), kernel_text(doc.get("kernels")),
                     "not timed (screened: does not pay)" if doc.get("screened") else "timed"])
        plan = doc.get("memory_plan")
        if plan:
            cells = [s for s in plan.get("steps", []) if s["action"] == "run"]
            order = ", ".join(f"B={c['batch']}x{c['context']}" + (f" (chunks of {c['prefill_chunk']})"
                                                                   if c.get("prefill_chunk") else "") for c in cells)
            dropped = "; ".join(f"B={d['batch']}x{d['context']}: {d['reason']}" for d in plan.get("dropped", []))
            plan_rows.append([name, nbytes(plan.get("budget_bytes"), "GB", 2), order or MISSING, dropped or "none"])
    out: list[tuple] = [("h3", "How latency was measured: device, kernels"),
                        ("p", "The kernel each variant ran is read off the loaded modules (GPTQModel's QuantLinear "
                              "class, bitsandbytes' layer class, torchao's weight subclass). specq's engine runs "
                              "every step eagerly; speculation as served is vLLM's measurement (the vllm stage)."),
                        ("table", ["result", "device", "quantized kernel", "timed"], rows, None)]
    if plan_rows:
        out += [("h3", "Memory plan"),
                ("p", "Planned before any cell ran, against the memory free once the weights were loaded: cells in "
                      "the order they ran (each on a cache of its own length, freed before the next), chunked "
                      "prefill where a one-shot prefill would not fit, and the cells dropped with the reason."),
                ("table", ["result", "budget", "cells, in order", "dropped"], plan_rows, None)]
    return out

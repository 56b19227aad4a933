"""The report's variants section: each variant's size, memory and perplexity, the plain-decode
latency grid; and how latency was measured (device, the kernel each variant ran, the memory plan).

    blocks += variant_blocks(run_dir, figures) + runtime_blocks(run_dir)

Reads variants/<variant>/meta.json, latency/*.json and latency/tpot_ratio.png.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import read_json
from pipeline.report.document import Block
from pipeline.report.format import MISSING, footnote, interval, json_files, median_ci, nbytes, number
from pipeline.report.format import mark as like_mark


def variant_blocks(run_dir: Path, figures: dict[str, bytes]) -> list[Block]:
    """One row per variant (scheme, size, memory, perplexity, calibration), then the plain-decode
    latency grid and the latency stage's TPOT-ratio figure (added to `figures`)."""
    out: list[Block] = [("h2", "Variants: size, memory, decode latency")]
    rows, why = [], []
    for vdir in sorted(p for p in (run_dir / "variants").glob("*") if (p / "meta.json").is_file()):
        m = read_json(vdir / "meta.json", "variant meta.json")
        calib = f"{str(m.get('calibration_sha256') or '-')[:12]} ({m.get('calibration_tokens') or '-'} tokens)"
        if m.get("dtype_reason"):
            why.append(f"{vdir.name}: {m['dtype_compute']}, {m['dtype_reason']}")
        rows.append([vdir.name, str(m.get("scheme")), str(m.get("bits") or "-"),
                     str(m.get("group_size") or "-"), str(m.get("library") or "-"),
                     str(m.get("dtype_compute") or "-"),
                     nbytes(m.get("bytes_on_disk")), nbytes(m.get("bytes_in_memory")),
                     f"{number(m.get('perplexity'), 2)} / {number(m.get('reference_perplexity'), 2)}",
                     number(m.get("quantize_seconds"), 1), calib, str(m.get("device_fallback") or "-")])
    if rows:
        out.append(("table", ["variant", "scheme", "bits", "group", "library", "computes in", "on disk",
                              "in memory", "ppl / ref ppl", "quantize s", "calibration sha256 (tokens)", "fallback"],
                    rows, None))
        if why:
            out.append(("p", "Compute dtype: " + "; ".join(why) + "."))
    else:
        out.append(("p", "No variants/<variant>/meta.json in this run."))
    lat = {n: d for n, d in json_files(run_dir / "latency", "*.json", "latency result").items()
           if "__" not in n}
    grid_rows = []
    for name, doc in lat.items():
        for cell in doc.get("grid", []):
            head = [name, str(cell.get("batch")), str(cell.get("context"))]
            if cell.get("skipped"):
                grid_rows.append([*head, f"skipped: {cell['skipped']}", "", "", "", "", "", ""])
                continue
            ratio = cell.get("tpot_ratio_vs_reference")
            p99 = (cell.get("inter_token_ms") or {}).get("p99")
            grid_rows.append([*head, median_ci(cell.get("tpot_ms"), 2), median_ci(cell.get("ttft_ms"), 2),
                              f"{number(p99['value'], 2)} {interval(p99['ci'], 2)}" if p99 else MISSING,
                              f"{number(ratio['value'], 2)} {interval(ratio['ci'], 2)} (roofline "
                              f"{number(cell.get('roofline_tpot_ratio_vs_reference'), 2)}){like_mark(ratio)}"
                              if ratio else MISSING,
                              nbytes(cell.get("peak_memory_bytes")), number(cell.get("achieved_gbps"), 1),
                              number(cell.get("roofline_fraction"), 2)])
    if grid_rows:
        bw = sorted(f"{n}: {number(d.get('bandwidth_gbps'), 1)} GB/s on {d.get('device')}" for n, d in lat.items())
        out += [("h3", "Plain decode latency grid (median [CI] over repeats)"),
                ("p", "Measured bandwidth: " + "; ".join(bw) + ". Roofline fraction = achieved bytes/s "
                      "over measured bandwidth for the bytes a decode step must read."),
                ("table", ["variant", "batch", "context", "TPOT ms", "TTFT ms", "p99 inter-token ms",
                           "TPOT / reference (roofline)", "peak memory", "achieved GB/s", "roofline fraction"],
                 grid_rows, None)]
        flagged = [{**c["tpot_ratio_vs_reference"], "cell": f"{n} B={c['batch']} context={c['context']}"}
                   for n, d in lat.items() for c in d.get("grid", []) if c.get("tpot_ratio_vs_reference")]
        note = footnote(flagged, "TPOT / reference", lambda r: r["cell"])
        if note:
            out.append(("p", note))
        ratio_png = run_dir / "latency" / "tpot_ratio.png"
        if ratio_png.is_file():
            figures["tpot-ratio.png"] = ratio_png.read_bytes()
            out.append(("img", "tpot-ratio.png", "speedup over the reference vs batch x context, with the "
                                                 "roofline's (W + BK) / (W_q + BK)"))
    else:
        out.append(("p", "No plain-decode latency grid in this run (latency/<variant>.json missing)."))
    return out


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

"""The report: the go/no-go table, the forest plot, speculation per pair, the variants, provenance.

    python -m pipeline report --run runs/smollm2-135m --config configs/default.yaml

Writes `report/report.md` (figures beside it as report/*.png) and `report/index.html`, which is
self-contained (figures embedded as base64, inline CSS) so it can be mailed or attached to a
release ticket. Both are rendered from one list of blocks, so they say the same thing. Inputs a
stage did not produce (no pairs, no latency grid) become a line saying so; a corrupt one is an error.
"""
from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

from pipeline.report.batching import batching_blocks
from pipeline.report.gate_table import cell_text
from pipeline.report.runtime import runtime_blocks
from pipeline.core.stage import StageError, atomic_write_bytes, atomic_write_text, library_versions, read_json

# A block is ("h2"|"h3"|"p"|"pre", text) | ("table", headers, rows, classes) |
# ("img", name, caption[, "wide"])
Block = tuple


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a CI box
    import matplotlib.pyplot as plt

    return plt


def _png(fig, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _f(x, digits: int = 3, signed: bool = False) -> str:
    if x is None:
        return "-"
    try:
        return f"{float(x):+.{digits}f}" if signed else f"{float(x):.{digits}f}"
    except (TypeError, ValueError):
        return str(x)


def _ci(ci, digits: int = 3) -> str:
    return f"[{_f(ci[0], digits)}, {_f(ci[1], digits)}]" if ci else ""


def _bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _median(d) -> str:
    """A {median, ci, samples} record as 'median [lo, hi]'."""
    if not isinstance(d, dict):
        return _f(d, 2)
    return f"{_f(d.get('median'), 2)} {_ci(d.get('ci'), 2)}"


def _json_files(folder: Path, pattern: str, what: str) -> dict[str, dict]:
    out = {}
    for path in sorted(folder.glob(pattern)):
        if path.name == "meta.json":
            continue
        doc = read_json(path, what)
        if not isinstance(doc, dict):
            raise StageError(f"corrupt {what}: {path} is not a JSON object")
        out[path.stem] = doc
    return out


# ---------------------------------------------------------------- figures


def forest_plot(gate: dict, dpi: int) -> bytes | None:
    rows = [(f"{v} / {k}", c) for v, e in gate["variants"].items() for k, c in e["slices"].items()]
    if not rows:
        return None
    plt = _plt()
    colour = {"pass": "#2e7d32", "fail": "#c62828", "inconclusive": "#ef8f00"}
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.2))
    for y, (label, c) in enumerate(reversed(rows)):
        lo, hi = c["ci"]
        ax.plot([lo, hi], [y, y], color=colour[c["status"]], lw=2)
        ax.plot(c["diff"], y, "o", color=colour[c["status"]], ms=5)
        ax.plot([-c["margin"]] * 2, [y - 0.4, y + 0.4], color="#c62828", lw=1.5)
    ax.axvline(0.0, color="grey", lw=0.8)
    margins = {c["margin"] for _, c in rows}
    if len(margins) == 1:
        ax.axvline(-margins.pop(), color="#c62828", ls="--", lw=1, label="-margin")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("paired difference, variant - reference (negative = worse); red tick = -margin")
    ax.set_title(f"Paired differences with multiplicity-adjusted CIs ({gate['multiplicity']})", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig, dpi)


def acceptance_plot(pair: str, acc: dict, dpi: int) -> bytes | None:
    pooled = (acc.get("slices") or {}).get("all") or {}
    if not pooled:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for temp, rec in sorted(pooled.items()):
        # A position no round reached (n = 0) has no conditional rate and no CI: not drawn.
        pos = [p for p in rec.get("per_position") or [] if p.get("conditional") is not None]
        if not pos:
            continue
        x = [p["position"] for p in pos]
        y = [p["conditional"] for p in pos]
        ci = [p.get("ci") or [p["conditional"]] * 2 for p in pos]
        err = [[max(0.0, yi - c[0]) for yi, c in zip(y, ci)], [max(0.0, c[1] - yi) for yi, c in zip(y, ci)]]
        line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"T={temp} conditional")
        prefix = [p for p in rec["per_position"] if p.get("prefix") is not None]
        ax.plot([p["position"] for p in prefix], [p["prefix"] for p in prefix], ls=":",
                color=line[0].get_color(), label=f"T={temp} prefix P(A1..Ai)")
        if all(p.get("expected_beta") is not None for p in pos):
            ax.plot(x, [p["expected_beta"] for p in pos], ls="--", color=line[0].get_color(), alpha=0.6,
                    label=f"T={temp} E[beta]")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_title(f"{pair}: per-position acceptance (all slices)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig, dpi)


def speed_plot(pair: str, marginal: dict | None, latency: dict | None, dpi: int) -> bytes | None:
    """ms/token vs k with CIs and the plain-decode line, from marginal (or else latency) JSON."""
    if marginal and marginal.get("rows"):
        rows = marginal["rows"]
        ks = [r["k"] for r in rows]
        med = [r["ms_per_token"] for r in rows]
        cis = [r.get("ms_per_token_ci") or [m, m] for r, m in zip(rows, med)]
        base = marginal["baseline_ms_per_token"]
    elif latency and latency.get("rows"):
        rows = latency["rows"]
        ks = [r["k"] for r in rows]
        med = [r["ms_per_token"]["median"] for r in rows]
        cis = [r["ms_per_token"].get("ci") or [m, m] for r, m in zip(rows, med)]
        base = latency["plain_ms_per_token"]["median"]
    else:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.errorbar(ks, med, yerr=[[max(0.0, m - c[0]) for m, c in zip(med, cis)],
                               [max(0.0, c[1] - m) for m, c in zip(med, cis)]],
                marker="o", capsize=3, label="speculative ms/token")
    ax.axhline(base, color="grey", ls="--", label="plain decode ms/token")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("ms / token")
    ax.set_title(f"{pair}: decode time per token vs k", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig, dpi)


# ---------------------------------------------------------------- sections


def gate_blocks(gate: dict) -> list[Block]:
    keys = []
    for v in gate["variants"].values():
        keys += [k for k in v["slices"] if k not in keys]
    rows, classes = [], []
    for name, v in gate["variants"].items():
        rows.append([name, "yes" if v["release"] else "no", v["decision"].upper(),
                     *[cell_text(v["slices"][k]) if k in v["slices"] else "-" for k in keys]])
        classes.append([None, None, v["decision"],
                        *[v["slices"][k]["status"] if k in v["slices"] else None for k in keys]])
    out: list[Block] = [
        ("h2", f"Decision: {gate['decision'].upper()}"),
        ("p", f"Reference `{gate['reference']}`; release variants: "
              f"{', '.join(gate['release_variants']) or 'none'}. {gate['method']}. Each cell: "
              "diff [CI] status; 'items to settle' is the n that would give 80% power to decide "
              "an inconclusive cell, assuming the observed difference and spread."),
        ("table", ["variant", "release", "decision", *keys], rows, classes),
    ]
    grows, gclasses = [], []
    for name, v in gate["variants"].items():
        for key, c in v["slices"].items():
            for g, gc in (c.get("groups") or {}).items():
                grows.append([name, f"{key}/{g}", cell_text(gc), str(gc["n"]),
                              "gated" if gc.get("gated") else "reported"])
                gclasses.append([None, None, gc["status"], None, None])
    if grows:
        out += [("h3", "Per group (sub-slices)"),
                ("p", "Groups are reported at the unadjusted level and are not gated unless "
                      "gate.gate_groups is set (few items each: low power, and a larger family)."),
                ("table", ["variant", "group", "diff [CI] status", "n", ""], grows, gclasses)]
    drows = []
    for name, v in gate["variants"].items():
        d = v.get("distribution") or {}
        if d.get("kl_mean") is not None:
            checks = "; ".join(f"{k}: {c['status']}" for k, c in d.get("checks", {}).items()) or "not gated"
            drows.append([name, f"{_f(d['kl_mean'], 4)} {_ci(d.get('kl_ci'), 4)}",
                          f"{_f(d.get('top1_agreement'))} {_ci(d.get('top1_ci'))}",
                          f"{_f(d.get('ppl_ratio'))} {_ci(d.get('ppl_ratio_ci'))}", str(d.get("n_docs")),
                          checks])
    if drows:
        out += [("h3", "Distribution vs the reference"),
                ("table", ["variant", "KL", "top-1 agreement", "perplexity ratio", "docs", "gated"],
                 drows, None)]
    return out


def speculation_blocks(run_dir: Path, gate: dict, figures: dict[str, bytes], dpi: int) -> list[Block]:
    acceptance = _json_files(run_dir / "acceptance", "*__*.json", "acceptance result")
    marginal = _json_files(run_dir / "marginal", "*__*.json", "marginal report")
    latency = _json_files(run_dir / "latency", "*__*.json", "latency result")
    lossless = (gate.get("speculation") or {}).get("pairs", {})
    pairs = sorted(set(acceptance) | set(marginal) | set(latency))
    out: list[Block] = [("h2", "Speculative decoding per (variant, draft) pair")]
    if not pairs:
        return out + [("p", "No acceptance, latency or marginal results for any pair in this run.")]
    rows, classes = [], []
    for pair in pairs:
        m, loss = marginal.get(pair), lossless.get(pair, {})
        rec = m.get("recommended_k") if m else None
        at = next((r for r in (m or {}).get("rows", []) if r["k"] == rec), None)
        rows.append([pair, loss.get("decision", "unchecked"), "-" if rec is None else str(rec),
                     f"{_f(at['speedup'], 2)}x {_ci(at.get('speedup_ci'), 2)}" if at else "-",
                     _f(at["ms_per_token"], 2) if at else "-", _f(at["tokens_per_round"], 2) if at else "-",
                     _f(m["baseline_ms_per_token"], 2) if m else "-"])
        classes.append([None, {"go": "pass", "no-go": "fail"}.get(loss.get("decision"), "inconclusive"),
                        None, None, None, None, None])
    out += [("p", "Lossless: greedy speculative output identical to the target's own, and the "
                  "sampling test (p adjusted across pairs); a pair that fails is no-go for "
                  "speculation whatever its speed. It does not change the variant's quality decision."),
            ("table", ["pair", "lossless", "recommended k", "speedup at k [CI]", "ms/token at k",
                       "E[tokens/round] at k", "plain ms/token"], rows, classes)]
    for pair in pairs:
        out.append(("h3", pair))
        if pair in acceptance:
            png = acceptance_plot(pair, acceptance[pair], dpi)
            if png:
                figures[f"acceptance-{pair}.png"] = png
                out.append(("img", f"acceptance-{pair}.png", "per-position acceptance with CIs"))
        theirs = run_dir / "marginal" / f"{pair}.png"
        png = theirs.read_bytes() if theirs.is_file() else speed_plot(pair, marginal.get(pair),
                                                                      latency.get(pair), dpi)
        if png:
            figures[f"speed-{pair}.png"] = png
            out.append(("img", f"speed-{pair}.png", "ms/token vs k with CIs (marginal report)"))
        else:
            out.append(("p", "No timing for this pair."))
    return out


def _optional_json(path: Path, what: str) -> dict:
    """{} when the file is absent (a stage that wrote nothing); StageError when it is corrupt."""
    return read_json(path, what) if path.is_file() else {}


def variant_blocks(run_dir: Path, figures: dict[str, bytes] | None = None) -> list[Block]:
    out: list[Block] = [("h2", "Variants: size, memory, decode latency")]
    rows = []
    for vdir in sorted(p for p in (run_dir / "variants").glob("*") if (p / "meta.json").is_file()):
        m = read_json(vdir / "meta.json", "variant meta.json")
        calib = f"{str(m.get('calibration_sha256') or '-')[:12]} ({m.get('calibration_tokens') or '-'} tokens)"
        rows.append([vdir.name, str(m.get("scheme")), str(m.get("bits") or "-"),
                     str(m.get("group_size") or "-"), str(m.get("library") or "-"),
                     _bytes(m.get("bytes_on_disk")), _bytes(m.get("bytes_in_memory")),
                     f"{_f(m.get('perplexity'), 2)} / {_f(m.get('reference_perplexity'), 2)}",
                     _f(m.get("quantize_seconds"), 1), calib, str(m.get("device_fallback") or "-")])
    if rows:
        out.append(("table", ["variant", "scheme", "bits", "group", "library", "on disk", "in memory",
                              "ppl / ref ppl", "quantize s", "calibration sha256 (tokens)", "fallback"],
                    rows, None))
    else:
        out.append(("p", "No variants/<variant>/meta.json in this run."))
    lat = {n: d for n, d in _json_files(run_dir / "latency", "*.json", "latency result").items()
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
            grid_rows.append([*head, _median(cell.get("tpot_ms")), _median(cell.get("ttft_ms")),
                              f"{_f(p99['value'], 2)} {_ci(p99['ci'], 2)}" if p99 else "-",
                              f"{_f(ratio['value'], 2)} {_ci(ratio['ci'], 2)} (roofline "
                              f"{_f(cell.get('roofline_tpot_ratio_vs_reference'), 2)})" if ratio else "-",
                              _bytes(cell.get("peak_memory_bytes")), _f(cell.get("achieved_gbps"), 1),
                              _f(cell.get("roofline_fraction"), 2)])
    if grid_rows:
        bw = sorted(f"{n}: {_f(d.get('bandwidth_gbps'), 1)} GB/s on {d.get('device')}" for n, d in lat.items())
        out += [("h3", "Plain decode latency grid (median [CI] over repeats)"),
                ("p", "Measured bandwidth: " + "; ".join(bw) + ". Roofline fraction = achieved bytes/s "
                      "over measured bandwidth for the bytes a decode step must read."),
                ("table", ["variant", "batch", "context", "TPOT ms", "TTFT ms", "p99 inter-token ms",
                           "TPOT / reference (roofline)", "peak memory", "achieved GB/s", "roofline fraction"],
                 grid_rows, None)]
        ratio_png = run_dir / "latency" / "tpot_ratio.png"
        if figures is not None and ratio_png.is_file():
            figures["tpot-ratio.png"] = ratio_png.read_bytes()
            out.append(("img", "tpot-ratio.png", "speedup over the reference vs batch x context, with the "
                                                 "roofline's (W + BK) / (W_q + BK)"))
    else:
        out.append(("p", "No plain-decode latency grid in this run (latency/<variant>.json missing)."))
    return out


def provenance_blocks(run_dir: Path, cfg, gate_meta: dict) -> list[Block]:
    model = _optional_json(run_dir / "model" / "meta.json", "model meta.json")
    libs = gate_meta.get("libraries") or library_versions()
    host = gate_meta.get("host") or {}
    arch = {k: model[k] for k in ("architecture", "layers", "hidden_size", "vocab_size", "parameters")
            if k in model}
    stages = []
    for stage in ("model", "variants", "drafts", "acceptance", "latency", "marginal", "quality", "gate"):
        m = _optional_json(run_dir / stage / "meta.json", f"{stage} meta.json")
        if m:
            stages.append([stage, m.get("started", "-"), _f(m.get("wall_s"), 1),
                           str(m.get("input_hash", ""))[:12]])
    facts = [["model", str(model.get("source") or model.get("model") or "-")],
             ["architecture", str(arch or "-")], ["run", str(run_dir)],
             ["report date", time.strftime("%Y-%m-%d %H:%M:%S %Z")], ["seed", str(cfg.seed)],
             ["device (config)", cfg.device],
             ["host", f"{host.get('platform', '-')}, {host.get('cpus', '-')} CPUs"]]
    return [
        ("h2", "Provenance"),
        ("table", ["", ""], facts, None),
        ("h3", "Stages"),
        ("table", ["stage", "started", "wall s", "input hash"], stages, None),
        ("h3", "Library versions"),
        ("table", ["library", "version"], [[k, str(v)] for k, v in libs.items()], None),
        ("h3", "Resolved config"),
        ("pre", json.dumps(cfg.model_dump(mode="json"), indent=1)),
    ]


# ---------------------------------------------------------------- rendering


def to_markdown(title: str, blocks: list[Block]) -> str:
    out = [f"# {title}", ""]
    for b in blocks:
        if b[0] in ("h2", "h3"):
            out += [("## " if b[0] == "h2" else "### ") + b[1], ""]
        elif b[0] == "p":
            out += [b[1], ""]
        elif b[0] == "pre":
            out += ["```json", b[1], "```", ""]
        elif b[0] == "img":
            out += [f"![{b[2]}]({b[1]})", ""]
        elif b[0] == "table":
            _, headers, rows, _ = b
            out += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows] + [""]
    return "\n".join(out)


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
.pass,.go{background:#c8e6c9}.fail,.no-go{background:#ffcdd2}.inconclusive{background:#ffe0b2}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
pre{background:#f7f7f7;padding:.6em;font-size:12px;max-height:30em;overflow:auto}
.banner{font-size:1.6em;padding:.3em .6em;display:inline-block}
figure{margin:0 1em 1em 0;display:inline-block;vertical-align:top;max-width:48%}
figure.wide{display:block;max-width:900px}figcaption{font-size:12px;color:#555}"""


def to_html(title: str, blocks: list[Block], figures: dict[str, bytes], decision: str) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{e(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
           f"<div class='banner {e(decision)}'>release decision: <b>{e(decision.upper())}</b></div>"]
    for b in blocks:
        if b[0] in ("h2", "h3", "p"):
            out.append(f"<{b[0]}>{e(b[1])}</{b[0]}>")
        elif b[0] == "pre":
            out.append(f"<details><summary>show</summary><pre>{e(b[1])}</pre></details>")
        elif b[0] == "img":
            data = base64.b64encode(figures[b[1]]).decode()
            wide = " class='wide'" if len(b) > 3 and b[3] == "wide" else ""
            out.append(f"<figure{wide}><img alt='{e(b[2])}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{e(b[2])}</figcaption></figure>")
        elif b[0] == "table":
            _, headers, rows, classes = b
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>")
            for i, r in enumerate(rows):
                cls = classes[i] if classes else [None] * len(r)
                out.append("<tr>" + "".join((f"<td class='{e(c)}'>" if c else "<td>") + e(v) + "</td>"
                                     for v, c in zip(r, cls)) + "</tr>")
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def run(ctx) -> None:
    run_dir, cfg = ctx.run_dir, ctx.config
    gate = read_json(run_dir / "gate.json", "gate result")
    if not isinstance(gate, dict) or "variants" not in gate:
        raise StageError(f"corrupt gate result: {run_dir / 'gate.json'} has no variants")
    gate_meta = _optional_json(run_dir / "gate" / "meta.json", "gate meta.json")
    dpi = cfg.report.dpi
    figures: dict[str, bytes] = {}
    blocks = gate_blocks(gate)
    forest = forest_plot(gate, dpi)
    if forest:
        figures["forest.png"] = forest
        blocks.insert(3, ("img", "forest.png", "paired differences (dots) with their CIs; red tick = -margin",
                          "wide"))
    blocks += speculation_blocks(run_dir, gate, figures, dpi)
    blocks += batching_blocks(run_dir, figures)  # pipeline/report/batching.py
    blocks += variant_blocks(run_dir, figures)
    blocks += runtime_blocks(run_dir)
    blocks += provenance_blocks(run_dir, cfg, gate_meta)
    title = f"{cfg.report.title}: {run_dir.name}"
    for name, png in figures.items():
        atomic_write_bytes(ctx.out_dir / name, png)
    atomic_write_text(ctx.out_dir / "report.md", to_markdown(title, blocks))
    atomic_write_text(ctx.out_dir / "index.html", to_html(title, blocks, figures, gate["decision"]))
    ctx.meta["figures"] = sorted(figures)
    ctx.meta["decision"] = gate["decision"]

"""The report's matplotlib setup (pyplot on the Agg backend, a figure as PNG bytes) and the
latency stage's figure. matplotlib is imported on first use.

    fig, ax = pyplot().subplots()
    data = png_bytes(fig, dpi=110)            # the figure is closed
"""
from __future__ import annotations

import io


def pyplot():
    """matplotlib.pyplot, with the Agg backend selected first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int, tight: bool = True) -> bytes:
    """The figure as PNG bytes at `dpi`, cropped to its contents when `tight`; closes the figure."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    pyplot().close(fig)
    return buf.getvalue()


def ci_errors(ys: list[float], cis: list) -> list[list[float]]:
    """matplotlib's yerr for points ys with intervals [lo, hi], clipped at 0 (matplotlib refuses negatives)."""
    return [[max(0.0, y - c[0]) for y, c in zip(ys, cis)], [max(0.0, c[1] - y) for y, c in zip(ys, cis)]]


def finish_axes(ax, xlabel: str, ylabel: str, title: str, integer_x: bool = True, legend: int = 7) -> None:
    """Labels, a small legend and a light grid: how every line plot of the report ends."""
    if integer_x:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend)
    ax.grid(alpha=0.3)


def tpot_ratio_plot(grids: dict[str, dict], reference: str) -> bytes | None:
    """Each variant's decode speedup over the reference (with CIs) against B x context, beside the
    roofline's (W + B K) / (W_q + B K); a point not like with like is crossed out."""
    series = {name: [c for c in g["grid"] if "tpot_ratio_vs_reference" in c] for name, g in grids.items()
              if name != reference}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for i, (name, cells) in enumerate(sorted(series.items())):
        cells = sorted(cells, key=lambda c: (c["batch"] * c["context"], c["batch"]))
        x = [c["batch"] * c["context"] for c in cells]
        r = [c["tpot_ratio_vs_reference"] for c in cells]
        y = [1 / v["value"] for v in r]
        err = ci_errors(y, [[1 / v["ci"][1], 1 / v["ci"][0]] for v in r])
        line = ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=f"{name} measured")
        ax.plot(x, [1 / c["roofline_tpot_ratio_vs_reference"] for c in cells], "s--", color=line[0].get_color(),
                alpha=0.6, label=f"{name} roofline (W + BK) / (W_q + BK)")
        flagged = [(xi, yi) for xi, yi, v in zip(x, y, r) if v.get("like_with_like") is False]
        if flagged:
            ax.plot(*zip(*flagged), "x", color="k", ms=10, label=f"{name}: not like with like (run modes differ)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    finish_axes(ax, "batch x context (tokens in the KV cache)", f"speedup over {reference} (TPOT ratio)",
                "Decode speedup of each variant over the reference", integer_x=False)
    fig.tight_layout()
    return png_bytes(fig, dpi=110, tight=False)

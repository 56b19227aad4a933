"""The latency stage's figure: each variant's decode speedup over the reference against B x context.
A point whose two cells did not run the same way (e.g. a fallback quantized kernel on one side;
`like_with_like` false, pipeline/latency/modes.py) is crossed out with an x."""
from __future__ import annotations

from pipeline.report.figures import png_bytes, pyplot


def tpot_ratio_plot(grids: dict[str, dict], reference: str) -> bytes | None:
    """Speedup over the reference (reference TPOT / variant TPOT, with CIs) against B x context,
    beside the roofline's (W + B K) / (W_q + B K): the W4 speedup should fall towards 1 as B K grows."""
    series = {name: [c for c in g["grid"] if "tpot_ratio_vs_reference" in c] for name, g in grids.items()
              if name != reference}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, cells) in enumerate(sorted(series.items())):
        cells = sorted(cells, key=lambda c: (c["batch"] * c["context"], c["batch"]))
        x = [c["batch"] * c["context"] for c in cells]
        r = [c["tpot_ratio_vs_reference"] for c in cells]
        y = [1 / v["value"] for v in r]
        err = [[yi - 1 / v["ci"][1] for yi, v in zip(y, r)], [1 / v["ci"][0] - yi for yi, v in zip(y, r)]]
        line = ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=f"{name} measured")
        ax.plot(x, [1 / c["roofline_tpot_ratio_vs_reference"] for c in cells], "s--", color=line[0].get_color(),
                alpha=0.6, label=f"{name} roofline (W + BK) / (W_q + BK)")
        flagged = [(xi, yi) for xi, yi, v in zip(x, y, r) if v.get("like_with_like") is False]
        if flagged:
            ax.plot(*zip(*flagged), "x", color="k", ms=10, label=f"{name}: not like with like (run modes differ)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("batch x context (tokens in the KV cache)")
    ax.set_ylabel(f"speedup over {reference} (TPOT ratio)")
    ax.set_title("Decode speedup of each variant over the reference", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return png_bytes(fig, dpi=110, tight=False)

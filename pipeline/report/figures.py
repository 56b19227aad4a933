"""The matplotlib setup every figure of the report package shares: pyplot on the Agg backend
(files only; no display on a CI box) and a figure as PNG bytes.

    from pipeline.report.figures import png_bytes, pyplot
    plt = pyplot()
    fig, ax = plt.subplots()
    ...
    data = png_bytes(fig, dpi=110)            # the figure is closed

matplotlib is imported on first use, so a module that draws can be imported without it.
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


def finish_axes(ax, xlabel: str, ylabel: str, title: str, integer_x: bool = True) -> None:
    """Labels, a small legend and a light grid: how every line plot of the report ends."""
    if integer_x:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

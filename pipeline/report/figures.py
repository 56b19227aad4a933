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

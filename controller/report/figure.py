"""The report's figures: made on matplotlib's Agg backend (no display), written as PNG.

Each plot module builds a ``Figure`` (what a test inspects: its labels' boxes) and turns it
into PNG bytes with :func:`to_png`, which also closes it."""

from __future__ import annotations

import io
from typing import Any


def new_figure(**kw: Any) -> tuple[Any, Any]:
    """``plt.subplots(**kw)`` on the Agg backend: ``(figure, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kw)


def to_png(fig: Any) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def declutter(fig: Any, texts: list[Any], keep: list[Any] | None = None) -> int:
    """Remove each of ``texts`` (point labels, in order of importance) whose box on the
    rendered figure overlaps one kept before it, any of ``keep`` (titles, other labels) or
    an axes' legend; returns how many were removed. Run after the layout is final."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    placed = [t.get_window_extent(r) for t in keep or []]
    placed += [ax.get_legend().get_window_extent(r) for ax in fig.axes if ax.get_legend()]
    removed = 0
    for t in texts:
        box = t.get_window_extent(r)
        if any(box.overlaps(p) for p in placed):
            t.remove()
            removed += 1
        else:
            placed.append(box)
    return removed

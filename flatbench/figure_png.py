"""The project's one PNG encoder and figure canvas, below both `measures` and `analysis`.

A report's plots (`analysis.plots`) and a measure's own density plot (`measures.density_plot`) render the
same way: a plain matplotlib `Figure` (no pyplot, so no global figure state on a headless node), drawn once
and written as a 256-colour PNG. It lives here, not in `analysis`, so that `measures` does not import from
its sibling layer.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image as PILImage

DPI = 110
PAGE_WIDTH = 10.0
"""Inches: 1,100 px at `DPI`, the HTML report's text width."""


def new_figure(width: float, height: float) -> Figure:
    """A constrained-layout figure at the report's DPI (so that drawing coordinates are PNG pixels)."""
    return Figure(figsize=(min(width, PAGE_WIDTH), height), dpi=DPI, layout="constrained")


def png_bytes(fig: Figure) -> bytes:
    """Render to PNG at `DPI` and free the figure's artists (the report can hold hundreds of plots)."""
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return encode(canvas, fig)


def encode(canvas: FigureCanvasAgg, fig: Figure) -> bytes:
    """The canvas as drawn, as a 256-colour PNG, then the figure cleared. Drawn once (`savefig` would lay out
    and draw the figure again, which doubled the report's time); 256 colours keep flat plot colours and
    antialiased text intact at a third of the bytes of RGB, so a report of 40 measures stays a few MB."""
    width, height = canvas.get_width_height()
    image = PILImage.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    image.convert("RGB").quantize(colors=256, method=PILImage.Quantize.FASTOCTREE,
                                  dither=PILImage.Dither.NONE).save(buf, format="png")
    fig.clear()
    return buf.getvalue()

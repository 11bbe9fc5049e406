"""The Hessian spectral density (`hessian_density`) as a PNG: the Gaussian-broadened density on its grid,
with the moments and the extreme eigenvalues written beside it.

    from flatbench.measures.density_plot import plot_density
    plot_density(entry, "density.png")   # entry: a measures.json entry, a `MeasureOutput`, or its info

The figure is a plain matplotlib `Figure` encoded by the report's `png_bytes` (no pyplot state). The density
is drawn on a logarithmic axis, as PyHessian's and Ghorbani et al.'s figures are: the bulk near
zero and the few outliers it is plotted for differ by orders of magnitude. `flatbench measure-model --plot`
calls it; the report can call it with an entry of a study's measures.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError


def _parts(entry: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """(info, values) of a hessian_density entry: a measures.json record (values, or for a not-converged
    entry info.values), a MeasureOutput, or the info dict alone."""
    if hasattr(entry, "info") and hasattr(entry, "values") and not isinstance(entry, dict):
        return dict(entry.info), dict(entry.values)
    if not isinstance(entry, dict):
        raise FlatbenchError(f"a hessian_density entry is a dict or a MeasureOutput, got {type(entry).__name__}")
    info = entry.get("info", entry)
    values = entry.get("values") or info.get("values") or {}
    return dict(info), dict(values)


def density_summary(entry: Any) -> list[str]:
    """The lines written beside the curve: the moments, the extreme eigenvalues, the negative mass, σ."""
    info, values = _parts(entry)
    moments = info.get("moments") or []
    lines = [f"m{i + 1} = {m:.4g}" for i, m in enumerate(moments[:4])]
    for key, label in (("lambda_min", "λmin"), ("lambda_max", "λmax"), ("negative_mass", "neg. mass")):
        value = next((v for k, v in values.items() if k.endswith("/" + key)), None)
        if value is not None:
            lines.append(f"{label} = {value:.4g}")
    if info.get("sigma") is not None:
        lines.append(f"σ = {info['sigma']:.3g}")
    if info.get("runs") is not None:
        lines.append(f"{info['runs']} runs × {info.get('iters')} steps")
    return lines


def plot_density(entry: Any, path: str | Path, *, title: str = "Hessian spectral density") -> Path:
    """Draw a hessian_density entry (its `grid` and `density`, see the module doc) into the PNG `path` and
    return the path; an entry without a density is one line (FlatbenchError)."""
    info, _ = _parts(entry)
    grid, density = info.get("grid"), info.get("density")
    if not grid or not density or len(grid) != len(density):
        raise FlatbenchError("this entry has no spectral density to plot (ask for the measure hessian_density)")
    from flatbench.figure_png import new_figure, png_bytes  # the project's one PNG encoder
    from flatbench.store import atomic_write_bytes

    floor = max(max(density) * 1e-8, 1e-300)
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    ax.semilogy(grid, [max(d, floor) for d in density], color="#1f4e79", lw=1.2)
    ax.set_ylim(bottom=floor)
    ax.set_xlabel("eigenvalue λ of the loss Hessian")
    ax.set_ylabel("density (log scale)")
    ax.set_title(title, fontsize=10)
    ax.text(0.98, 0.95, "\n".join(density_summary(entry)), transform=ax.transAxes, ha="right", va="top",
            fontsize=8, family="monospace", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "#bbb"})
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, png_bytes(fig))
    return out

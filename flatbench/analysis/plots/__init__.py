"""The report's figures, one module per figure family (matplotlib's object API on the Agg canvas):

    common.py    canvas, colours, markers, axis rules, model labels, point → pixel map for hover
    scatter.py   each measure against the gap (one, or a grid with a shared legend), against the ratio
    ranking.py   τ per measure with intervals and p; sign errors over environments
    matrices.py  agreement between measures and paired comparisons, grouped by family
    training.py  training curves through every evaluated epoch
    levels.py    τ against the train-loss level of the snapshots
    audit.py     the run audit's heatmap
"""

from flatbench.analysis.plots.audit import HEATMAP_FLOOR, audit_heatmap_figure
from flatbench.analysis.plots.common import (
    CMAP,
    DPI,
    MARKERS,
    PAGE_WIDTH,
    Drawn,
    gap_label,
    model_labels,
    png_bytes,
    tau_text,
    use_log,
)
from flatbench.analysis.plots.design import axis_figure
from flatbench.analysis.plots.levels import FINAL_LEVEL, tau_by_level_figure
from flatbench.analysis.plots.matrices import agreement_figure, comparison_figure
from flatbench.analysis.plots.ranking import ranking_figure, sign_error_figure
from flatbench.analysis.plots.scatter import measure_figure, scatter_grid, scatter_panel, vs_ratio_figure
from flatbench.analysis.plots.training import draw_training_curves, epoch_curves, history_curves, training_curves_figure

__all__ = ["CMAP", "DPI", "FINAL_LEVEL", "HEATMAP_FLOOR", "MARKERS", "PAGE_WIDTH", "Drawn", "agreement_figure",
           "audit_heatmap_figure", "axis_figure", "comparison_figure", "draw_training_curves", "epoch_curves", "gap_label", "history_curves",
           "measure_figure", "model_labels", "png_bytes", "ranking_figure", "scatter_grid", "scatter_panel",
           "sign_error_figure", "tau_by_level_figure", "tau_text", "training_curves_figure", "use_log",
           "vs_ratio_figure"]

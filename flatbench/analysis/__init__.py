"""Analysis of a finished study: the results table, correlation statistics, plots and the report.

The report stage reads only what training and measuring wrote (`run.json`, `measures.json`,
`study.yaml`), so it can be re-run alone, on another machine, or over several experiment folders at once.

    table.py     run folders → one pandas table (one row per run)
    stats.py     exclusions, Kendall/Spearman/Pearson with bootstrap CIs, granulated Kendall Ψ, CMI
    plots.py     matplotlib figures (Agg, no pyplot state), readable in black and white
    document.py  one document model rendered to report.md and a self-contained report.html
"""

from flatbench.analysis.stats import Analysis, analyze, correlations
from flatbench.analysis.table import build_table, headline_columns, load_records, measure_columns

__all__ = ["Analysis", "analyze", "build_table", "correlations", "headline_columns", "load_records",
           "measure_columns"]

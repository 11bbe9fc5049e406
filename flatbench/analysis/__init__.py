"""Analysis of a finished study: the results table, correlation statistics, plots and the report.

The report stage reads only what training and measuring wrote (`run.json`, `measures.json`,
`study.yaml`), so it can be re-run alone, on another machine, or over several experiment folders at once.

    table.py            run folders → records → one pandas table (one row per run), each snapshot level's
                        too, read once (`report_inputs`); `to_float`, the one number parser
    stats/              exclusions, τ/ρ/r with two-way cluster bootstrap CIs, the best group, Ψ, CMI, sign errors
    report.py           the report in one pass over its inputs: statistics once, then the files (tables,
                        figures), then the document section by section
    verdict.py          the verdict table's rows: τ, interval, p, best-group label, invariance, τ per model
    families.py         which family a measure is in (figure groups, filters)
    audit_digest.py     the rescaling audits found beside a study, as the report shows them
    figures.py          which figures are drawn, from what, into which file
    plots/              the matplotlib figures, one module per figure family
    sections.py         the document's first sections (summary, verdict, figures, audit) ...
    sections_detail.py  ... and its details (statistics, levels, endpoint, runs, time, config, the hover)
    document.py         one document model rendered to report.md and a self-contained report.html
    html_assets.py      the page's inline style and script (sorting, filters, hover)
    fmt.py              how numbers are written (one p-value format)
    compare.py          several studies side by side (`flatbench compare`)
    audit_tables.py, audit_plots.py   the audit command's tables and figure
"""

from flatbench.analysis.stats import Analysis, analyze
from flatbench.analysis.table import build_table, headline_columns, load_records, measure_columns

__all__ = ["Analysis", "analyze", "build_table", "headline_columns", "load_records", "measure_columns"]

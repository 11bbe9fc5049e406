"""How the report writes numbers: one home for the p-value format, intervals and durations, so that a
p-value reads the same in the tables, the figures, the terminal and the cross-study page.

p-values: three decimals from 0.01 on ("0.017"), two significant digits between 0.001 and 0.01
("0.0034"), "<0.001" below (a permutation or bootstrap p-value is not precise beyond that, and a row of
"1.2e-12" reads as more certainty than a 24-run study has).
"""

from __future__ import annotations

import math
from typing import Any

from flatbench.analysis.table import to_float

P_FLOOR = 0.001
"""Below this a p-value is written "<0.001"."""


def p_text(value: Any) -> str:
    """A p-value as the report writes it everywhere (see the module doc); "n/a" when there is none."""
    p = to_float(value)
    if not math.isfinite(p):
        return "n/a"
    if p >= 1.0:
        return "1"
    if p < P_FLOOR:
        return f"<{P_FLOOR:g}"
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def p_phrase(value: Any) -> str:
    """"p = 0.017" or "p < 0.001" (for figure titles and sentences)."""
    text = p_text(value)
    return f"p {text[0]} {text[1:]}" if text.startswith("<") else f"p = {text}"


def num(value: Any, digits: int = 2) -> str:
    """A number with fixed decimals, "n/a" when it is missing or not finite."""
    v = to_float(value)
    return f"{v:.{digits}f}" if math.isfinite(v) else "n/a"


def ci_text(row: Any, stat: str, digits: int = 2) -> str:
    """"0.85 [0.78, 0.93]": a statistic with its interval; the value alone where the row has no interval
    (below 10 runs), "n/a" where the statistic itself is missing."""
    value = to_float(row.get(stat) if hasattr(row, "get") else row[stat])
    if not math.isfinite(value):
        return "n/a"
    lo, hi = to_float(row.get(f"{stat}_lo")), to_float(row.get(f"{stat}_hi"))
    ci = f" [{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{value:.{digits}f}{ci}"


def seconds_text(value: Any) -> str:
    """A duration in the unit a person reads it in (s, min, h)."""
    v = to_float(value)
    if not math.isfinite(v):
        return "n/a"
    if v < 1:
        return f"{v:.2f} s"
    if v < 120:
        return f"{v:.1f} s"
    if v < 7200:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:.2f} h"


def is_true(value: Any) -> bool:
    """A flag as read from a frame or a CSV: True, "True", 1 (a NaN or an empty cell is False)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    try:
        return bool(value) and not (isinstance(value, float) and math.isnan(value))
    except (TypeError, ValueError):
        return False

"""`flatbench compare`: several experiment folders' reports side by side (`analysis.compare`), with the
registry's families for the measures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from flatbench.analysis.compare import ComparisonSummary, write_comparison
from flatbench.errors import FlatbenchError
from flatbench.measures.keys import parse_key
from flatbench.measures.registry import get_measure


def _specs(exp_dirs: list[Path]) -> dict[str, Any]:
    """The registry's spec of every measure in the studies' correlations (unregistered ones left out)."""
    names = set()
    for exp in exp_dirs:
        path = exp / "correlations.csv"
        if path.is_file():
            names |= {parse_key(str(m)).measure for m in pd.read_csv(path, usecols=["measure"])["measure"]}
    out = {}
    for name in names:
        try:
            out[name] = get_measure(name)
        except FlatbenchError:
            continue
    return out


def compare_studies(exp_dirs: list[Path], out_dir: Path) -> ComparisonSummary:
    """`flatbench compare`: the comparison page of the folders, with the registry's measure families."""
    if len(exp_dirs) < 1:
        raise FlatbenchError("compare needs at least one experiment folder")
    return write_comparison(exp_dirs, out_dir, measure_info=_specs(exp_dirs))

"""`flatbench compare`: several experiment folders' reports side by side (`analysis.compare`), with the
registry's families for the measures."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import pandas as pd

from flatbench.analysis.compare import ComparisonSummary, write_comparison
from flatbench.errors import FlatbenchError
from flatbench.measures.keys import parse_key
from flatbench.measures.registry import get_measure
from flatbench.store import file_problem


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


NUL = bytes(1)


def check_correlations(path: Path) -> None:
    """A study's correlations.csv as `flatbench report` writes it, or one line naming what is wrong: not a
    regular non-empty file, not UTF-8 text, no `measure` column, a row cut short or too long (a copy cut
    off mid-row), a τ that is not a number. A missing file is `analysis.compare`'s own case."""
    problem = file_problem(path)
    if problem is None and path.is_file():
        problem = _csv_problem(path.read_bytes())
    if problem:
        raise FlatbenchError(f"{path} is damaged ({problem}): run `flatbench report {path.parent}` again")


def _csv_problem(data: bytes) -> str | None:
    """What is wrong with the text of a correlations.csv (None when it reads as one)."""
    if NUL in data:
        return f"binary: a NUL byte at byte {data.index(NUL)}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text at byte {exc.start}"
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        return f"not CSV: {exc}"
    if not rows or "measure" not in rows[0]:
        return "no 'measure' column in its first line"
    if not text.endswith("\n"):
        return "its last line does not end with a newline: cut off"
    width = len(rows[0])
    ranges = [(i, name, _range(name)) for i, name in enumerate(rows[0]) if _range(name)]
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != width:
            return f"line {line} has {len(row)} fields, the header {width}: cut off or edited"
        for i, name, (low, high, what) in ranges:
            if not row[i]:
                continue
            value = _float(row[i])
            if value is None:
                return f"line {line}: {name} is {row[i][:20]!r}, not a number"
            if not math.isnan(value) and not low <= value <= high:
                return f"line {line}: {name} is {row[i][:20]}, not {what} in [{low:g}, {high:g}]"
    return None


def _range(column: str) -> tuple[float, float, str] | None:
    """The range of a correlations.csv column that has one: a rank or linear correlation (τ, ρ, r, ψ and
    their interval ends) in [-1, 1], a p-value in [0, 1]; None for the other columns."""
    base = column.removesuffix("_lo").removesuffix("_hi")
    if base in ("kendall_tau", "spearman_rho", "pearson_r", "psi") or column.startswith("psi_"):
        return -1.0, 1.0, "a correlation"
    if column == "kendall_p" or column.startswith("p_") or column.endswith(("_p", "_p_holm")):
        return 0.0, 1.0, "a p-value"
    return None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def compare_studies(exp_dirs: list[Path], out_dir: Path) -> ComparisonSummary:
    """`flatbench compare`: the comparison page of the folders, with the registry's measure families."""
    if len(exp_dirs) < 1:
        raise FlatbenchError("compare needs at least one experiment folder")
    for exp in exp_dirs:
        check_correlations(exp / "correlations.csv")
    return write_comparison(exp_dirs, out_dir, measure_info=_specs(exp_dirs))

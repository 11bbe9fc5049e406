"""`flatbench compare`: several experiment folders' reports side by side (`analysis.compare`), with the
registry's families for the measures."""

from __future__ import annotations

import csv
import io
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
    width, tau = len(rows[0]), rows[0].index("kendall_tau") if "kendall_tau" in rows[0] else None
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != width:
            return f"line {line} has {len(row)} fields, the header {width}: cut off or edited"
        if tau is not None and row[tau] and not _is_float(row[tau]):
            return f"line {line}: kendall_tau is {row[tau][:20]!r}, not a number"
    return None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def compare_studies(exp_dirs: list[Path], out_dir: Path) -> ComparisonSummary:
    """`flatbench compare`: the comparison page of the folders, with the registry's measure families."""
    if len(exp_dirs) < 1:
        raise FlatbenchError("compare needs at least one experiment folder")
    for exp in exp_dirs:
        check_correlations(exp / "correlations.csv")
    return write_comparison(exp_dirs, out_dir, measure_info=_specs(exp_dirs))

"""The study's design as the statistics see it: configurations (cells), data draws, and the axes.

* **Axes**: the study's sweep axes (`table.sweep_axes`: what run.json records as swept, plus `experiment`
  when pooled folders differ in a fixed field) that take more than one value among the runs used. A
  replicate field (`REPLICATE_AXES`: `seed`, `data.seed`) is never an axis.
  - **Data axes** (`is_data_axis`): `data.*` fields but `data.augment` (`data.random_label_ratio`,
    `data.n_train`, `data.n_test`, `data.dataset`, ...), and `experiment`. They change the data the model
    is trained or tested on, not how it is trained. `experiment` is one because folders pooled in one
    report are different studies, as a dataset is (a different dataset, model or budget, the fixed
    fields they differ in).
  - **Training axes**: every other axis (width, depth, learning rate, batch size, optimizer, weight
    decay, `data.augment`, ...). Jiang et al.'s Ψ averages over these only.
* **Cell** (configuration): the runs that share every axis value; they differ in replicate fields only.
* **Draw** (replicate unit): the run's effective `data.seed`, i.e. `data.seed` where the table has a
  value, else `seed`. Runs of one draw share their training subset, test subset, label corruption and
  initialization streams, across configurations: they are dependent, and a study of D draws holds D
  independent replicates, however many configurations it crosses them with.

Any number of levels per axis and of runs per cell (an unbalanced design is fine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

REPLICATE_AXES = ("seed", "data.seed")
"""Config fields that index replicates of one configuration, never an axis."""
TRAINING_DATA_FIELDS = ("data.augment",)
"""`data.*` fields that are training hyperparameters (how the model is trained), not data axes."""


def axis_text(value: Any) -> str:
    """Axis values as strings, so floats, strings and missing values group the same way everywhere."""
    if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return "None"
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return repr(float(value))  # 0 (from YAML) and 0.0 are the same axis value
    return str(value)


def axis_codes(frame: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    return pd.DataFrame({a: frame[a].map(axis_text).to_numpy() for a in axes}, index=frame.index)


def group_ids(codes: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """One integer per distinct combination of `columns` (all zeros without columns)."""
    if not columns or not len(codes):
        return np.zeros(len(codes), dtype=np.int64)
    return pd.MultiIndex.from_frame(codes[columns]).factorize()[0].astype(np.int64)


def is_data_axis(axis: str) -> bool:
    """Whether an axis changes the data (module doc), as opposed to a training hyperparameter."""
    return axis == "experiment" or (axis.startswith("data.") and axis not in TRAINING_DATA_FIELDS)


def draw_labels(frame: pd.DataFrame) -> tuple[np.ndarray, str | None]:
    """(the effective data draw of every run as a string, the column it came from).

    `data.seed` where the table has that column with a value, else `seed`; the column is "data.seed" when
    any run has one, "seed" when only seeds are known, None when neither is (every run one draw)."""
    n = len(frame)
    seed = frame["seed"].map(axis_text).to_numpy() if "seed" in frame.columns else np.full(n, "None", dtype=object)
    if "data.seed" in frame.columns:
        data_seed = frame["data.seed"].map(axis_text).to_numpy()
        given = data_seed != "None"
        if given.any():
            return np.where(given, data_seed, seed), "data.seed"
    return seed, ("seed" if "seed" in frame.columns else None)


@dataclass
class Design:
    axes: list[str]
    """Axes that vary among the runs (never a replicate field), training and data axes in sweep order."""
    draw_column: str | None
    """Where the draws come from: "data.seed" (where given, else `seed`), "seed", or None."""
    codes: pd.DataFrame
    """String codes of the axes, one row per run (index of the runs' frame)."""
    cells: np.ndarray
    """Cell (configuration) id per run: runs with equal ids share every axis value."""
    draws: np.ndarray
    """Draw id per run (0 .. D − 1): runs with equal ids share their data draw."""

    @property
    def n_cells(self) -> int:
        return int(self.cells.max()) + 1 if len(self.cells) else 0

    @property
    def n_draws(self) -> int:
        return int(self.draws.max()) + 1 if len(self.draws) else 0

    @property
    def training_axes(self) -> list[str]:
        return [a for a in self.axes if not is_data_axis(a)]

    @property
    def data_axes(self) -> list[str]:
        return [a for a in self.axes if is_data_axis(a)]

    @property
    def replicate(self) -> str | None:
        """The draw column when the draws vary among the runs, else None."""
        return self.draw_column if self.n_draws > 1 else None

    def subset(self, mask: np.ndarray) -> "Design":
        cells = pd.factorize(self.cells[mask])[0].astype(np.int64)
        draws = pd.factorize(self.draws[mask])[0].astype(np.int64)
        return Design(self.axes, self.draw_column, self.codes[mask], cells, draws)


def design_of(frame: pd.DataFrame, sweep: list[str]) -> Design:
    """The design of the runs in `frame` given the study's sweep axes (see the module doc)."""
    axes = [a for a in sweep if a in frame.columns and a not in REPLICATE_AXES
            and frame[a].map(axis_text).nunique() > 1]
    codes = axis_codes(frame, axes)
    labels, column = draw_labels(frame)
    draws = pd.factorize(labels)[0].astype(np.int64) if len(frame) else np.zeros(0, dtype=np.int64)
    return Design(axes, column, codes, group_ids(codes, axes), draws)

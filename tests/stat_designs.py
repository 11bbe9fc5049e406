"""Small designed studies for the statistics tests: crossed configurations × data draws as report tables."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd


def crossed(levels: dict[str, int], n_draws: int, seeds_per_draw: int = 1, drop: tuple[int, ...] = ()) -> pd.DataFrame:
    """One row per (configuration, draw, seed): the axes' level indices, `draw` and `seed` (integers); rows in
    `drop` (positions) left out, for unbalanced designs. With `seeds_per_draw` > 1 the draw is `data.seed`."""
    names = list(levels)
    rows = []
    for combo in itertools.product(*[range(k) for k in levels.values()]):
        for d in range(n_draws):
            for s in range(seeds_per_draw):
                rows.append((*combo, d, s))
    rows = [r for i, r in enumerate(rows) if i not in set(drop)]
    frame = pd.DataFrame(rows, columns=[*names, "draw", "init"])
    return frame


def as_table(design: pd.DataFrame, gap: np.ndarray, measures: dict[str, np.ndarray],
             seeds_per_draw: int = 1) -> pd.DataFrame:
    """A report table of these runs: finished, well trained, with the given gaps and measure values. The draw is
    `seed` (one seed per draw) or `data.seed` with `seed` the initialization (several seeds per draw)."""
    n = len(design)
    axes = [c for c in design.columns if c not in ("draw", "init")]
    data = {"run_id": [f"run{i}" for i in range(n)], "experiment": ["exp"] * n, "status": ["finished"] * n}
    if seeds_per_draw > 1:
        data["seed"] = design["init"].to_numpy()
        data["data.seed"] = design["draw"].to_numpy()
    else:
        data["seed"] = design["draw"].to_numpy()
    for a in axes:
        data[a] = design[a].to_numpy() * 1.0
    data.update({"train_acc": [1.0] * n, "train_loss": [0.01] * n, "test_acc": list(1.0 - np.asarray(gap)),
                 "test_loss": [1.0] * n, "gap_acc": list(gap), "gap_loss": [0.99] * n})
    data.update({k: np.asarray(v, dtype=float) for k, v in measures.items()})
    table = pd.DataFrame(data)
    table.attrs["measure_columns"] = list(measures)
    table.attrs["sweep_axes"] = [*axes, "seed"] + (["data.seed"] if seeds_per_draw > 1 else [])
    return table


def codes_of(design: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """The axes as the strings the statistics group by (`design.axis_text` of floats)."""
    return pd.DataFrame({a: [repr(float(v)) for v in design[a]] for a in axes})

"""How much of the gap is the data draw, and how much the configuration: gap ~ draw + cell.

Why. A study crosses data draws with configurations, and runs of one draw share a per-draw offset of the
gap (the training subset, the test subset, the labels, the initialization streams). A pooled τ then
rewards a measure for following that offset, which no measure of one network can know. The decomposition
says how large the offset is: it is the reason the headline τ is stratified by draw (`blocked`).

The model is the two-way ANOVA without interaction, gap_r = μ + a_draw(r) + b_cell(r) + ε_r, fitted by
least squares. Its fit is computed by backfitting (alternating draw and cell means of the residual until
they stop moving; one sweep in a balanced design), and its ranks from the connected components of the
bipartite cell-draw graph (rank [1, draws, cells] = C + D − k), so that the tests can check both against
numpy's lstsq on dummy matrices. Type-II sums of squares (each factor adjusted for the other):

    SS_cell = RSS(gap ~ draw) − RSS(full), df_cell = C − k,
    SS_draw = RSS(gap ~ cell) − RSS(full), df_draw = D − k,
    df_res = N − (C + D − k),  F = (SS/df) / (RSS(full)/df_res),
    share = SS / SS_total (the draw's "share of variance"),
    partial ω² = df (F − 1) / (df (F − 1) + N)   (the cell's, with draws as a block).

In a balanced design (every cell once in every draw) SS_draw = Σ_d n_d (ḡ_d − ḡ)². With one draw the draw
row is empty (df 0) and the cell row is the one-way ANOVA.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from scipy.stats import f as f_dist

VARIANCE_COLUMNS = ["effect", "df", "ss", "share", "F", "p", "partial_omega2"]
MAX_SWEEPS = 10_000
TOL = 1e-13


def _group_means(values: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(ids, weights=values, minlength=k) / np.maximum(np.bincount(ids, minlength=k), 1)


def additive_fit(gap: np.ndarray, draws: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """The least-squares fit of gap ~ draw + cell (one value per run), by backfitting."""
    g = np.asarray(gap, dtype=float)
    d, c = pd.factorize(draws)[0], pd.factorize(cells)[0]
    nd, nc = d.max() + 1, c.max() + 1
    a, b = np.zeros(nd), np.zeros(nc)
    mu = g.mean()
    scale = max(float(np.abs(g - mu).max()), 1e-300)
    for _ in range(MAX_SWEEPS):
        a_new = _group_means(g - mu - b[c], d, nd)
        b_new = _group_means(g - mu - a_new[d], c, nc)
        moved = max(np.abs(a_new - a).max(), np.abs(b_new - b).max())
        a, b = a_new, b_new
        if moved <= TOL * scale:
            break
    return mu + a[d] + b[c]


def _rss(gap: np.ndarray, fit: np.ndarray) -> float:
    return float(((gap - fit) ** 2).sum())


def _one_way(gap: np.ndarray, ids: np.ndarray) -> np.ndarray:
    ids = pd.factorize(ids)[0]
    return _group_means(gap, ids, ids.max() + 1)[ids]


def components(draws: np.ndarray, cells: np.ndarray) -> int:
    """Connected components of the bipartite graph linking each cell to the draws it was run in."""
    d, c = pd.factorize(draws)[0], pd.factorize(cells)[0]
    nd, nc = d.max() + 1, c.max() + 1
    graph = coo_matrix((np.ones(len(d)), (d, nd + c)), shape=(nd + nc, nd + nc))
    return int(connected_components(graph, directed=False)[0])


def variance_decomposition(gap: np.ndarray, draws: np.ndarray, cells: np.ndarray) -> pd.DataFrame:
    """Rows draw, cell, residual, total with `VARIANCE_COLUMNS` (module doc); empty below 3 runs."""
    g = np.asarray(gap, dtype=float)
    ok = np.isfinite(g)
    g, draws, cells = g[ok], np.asarray(draws)[ok], np.asarray(cells)[ok]
    n = len(g)
    if n < 3:
        return pd.DataFrame(columns=VARIANCE_COLUMNS)
    nd, nc = len(np.unique(draws)), len(np.unique(cells))
    k = components(draws, cells)
    rss_full = _rss(g, additive_fit(g, draws, cells))
    ss_total = float(((g - g.mean()) ** 2).sum())
    df_res = n - (nc + nd - k)
    ms_res = rss_full / df_res if df_res > 0 else math.nan
    rows = []
    for effect, df, ss in (("draw", nd - k, _rss(g, _one_way(g, cells)) - rss_full),
                           ("cell", nc - k, _rss(g, _one_way(g, draws)) - rss_full)):
        ss = max(ss, 0.0)
        F = (ss / df) / ms_res if df > 0 and ms_res > 0 else math.nan
        p = float(f_dist.sf(F, df, df_res)) if math.isfinite(F) else math.nan
        omega = df * (F - 1) / (df * (F - 1) + n) if math.isfinite(F) else math.nan
        rows.append({"effect": effect, "df": df, "ss": ss if df > 0 else 0.0,
                     "share": (ss / ss_total if ss_total > 0 else math.nan) if df > 0 else 0.0,
                     "F": F, "p": p, "partial_omega2": omega})
    rows.append({"effect": "residual", "df": df_res, "ss": rss_full,
                 "share": rss_full / ss_total if ss_total > 0 else math.nan, "F": math.nan, "p": math.nan,
                 "partial_omega2": math.nan})
    rows.append({"effect": "total", "df": n - 1, "ss": ss_total, "share": 1.0, "F": math.nan, "p": math.nan,
                 "partial_omega2": math.nan})
    return pd.DataFrame(rows, columns=VARIANCE_COLUMNS)

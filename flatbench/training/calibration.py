"""The temperature-calibrated cross-entropy of a trained classifier: a secondary generalization target.

Why. With the training loss pinned near a common endpoint, a run's test cross-entropy mostly measures how
confidently it is wrong on the misclassified test images, and that confidence is the logit scale, which the
weight norms set (issue 42's referee: the loss gap ranks norms almost mechanically). Dividing the logits by
the one temperature T that minimizes the test cross-entropy removes the scale and leaves what the network's
ranking of classes is worth. The calibrated gap is the loss gap of the calibrated network f/T:
test CE(f/T) − train CE(f/T).

How. The mean cross-entropy of logits·β (β = 1/T) is convex in β, and its derivative is the mean of
E_softmax(βz)[z] − z_y, increasing in β; the minimum is where it crosses zero, found by bisection on
[0, `BETA_MAX`] in float64. The test CE is cross-fitted so that it is an out-of-sample number even on a
small test set: β fitted on the even-indexed test images scores the odd ones and vice versa; the reported
temperature (and the train CE) use β fitted on the whole test set.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flatbench.config import RunConfig
from flatbench.data import load_dataset
from flatbench.locks import RunLock
from flatbench.models import load_model
from flatbench.store import MODEL_FILE, RUN_JSON, SNAPSHOT_JSON, atomic_write_json, load_run_info

BETA_MAX = 1e4
"""The largest inverse temperature searched: a test set every image of which the model classifies right has
its minimum at β → ∞ (CE → 0); it is capped here (T = 1e-4)."""


@torch.no_grad()
def logits_of(model: nn.Module, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The model's logits (eval mode) on `x`, in float64."""
    was_training = model.training
    model.eval()
    out = [model(x[i:i + batch_size]).double() for i in range(0, x.shape[0], batch_size)]
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


def mean_ce(logits: torch.Tensor, y: torch.Tensor, beta: float) -> float:
    """Mean cross-entropy of logits·β."""
    return float(F.cross_entropy(logits * beta, y, reduction="mean")) if len(y) else math.nan


def _slope(logits: torch.Tensor, y: torch.Tensor, beta: float) -> float:
    """d/dβ of the mean cross-entropy of logits·β: mean of E_p[z] − z_y with p = softmax(βz)."""
    return _derivatives(logits, y, beta)[0]


def _derivatives(logits: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[float, float]:
    """The first and second derivative in β of the mean cross-entropy of logits·β: mean(E_p[z] − z_y) and
    mean(Var_p[z]) with p = softmax(βz)."""
    p = torch.softmax(logits * beta, dim=1)
    mean = (p * logits).sum(dim=1)
    var = (p * (logits - mean[:, None]) ** 2).sum(dim=1)
    return float((mean - logits.gather(1, y[:, None])[:, 0]).mean()), float(var.mean())


def fit_beta(logits: torch.Tensor, y: torch.Tensor, iters: int = 200) -> float:
    """The inverse temperature β ≥ 0 minimizing the mean cross-entropy of logits·β: the zero of its
    increasing derivative, by Newton steps kept inside a shrinking bracket (a bisection step where Newton's
    would leave it); `BETA_MAX` when the derivative is still negative there."""
    if not len(y):
        return math.nan
    if _slope(logits, y, 0.0) >= 0:  # the logits rank the true class no better than the mean: T → ∞
        return 0.0
    if _slope(logits, y, BETA_MAX) <= 0:
        return BETA_MAX
    lo, hi, beta = 0.0, BETA_MAX, 1.0
    for _ in range(iters):
        slope, curvature = _derivatives(logits, y, beta)
        lo, hi = (beta, hi) if slope < 0 else (lo, beta)
        step = beta - slope / curvature if curvature > 0 else math.nan
        nxt = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(nxt - beta) <= 1e-13 * max(beta, 1e-300) or hi - lo <= 1e-13 * hi:
            return nxt
        beta = nxt
    return beta


def cross_fitted_ce(logits: torch.Tensor, y: torch.Tensor) -> float:
    """The calibrated test cross-entropy out of sample: each half's (even / odd indices) CE at the β fitted
    on the other half, weighted by the halves' sizes."""
    n = len(y)
    if n < 2:
        return math.nan
    even, odd = torch.arange(0, n, 2), torch.arange(1, n, 2)
    total = 0.0
    for fit, score in ((even, odd), (odd, even)):
        total += mean_ce(logits[score], y[score], fit_beta(logits[fit], y[fit])) * len(score)
    return total / n


@contextmanager
def _one_thread() -> Iterator[None]:
    """The fit's tensors are small (n × classes): on a busy machine torch's thread pool spinning for them
    made each of its ~30 passes 80 times slower (250 ms instead of 3 ms for 10,000 × 10 on 2 loaded cores),
    so the fit runs on one thread and the caller's setting is put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def calibration_record(model: nn.Module, ds: Any, batch_size: int) -> dict[str, float] | None:
    """run.json's `calibration`: the temperature fitted on the test set, the cross-fitted calibrated test CE,
    the train CE at that temperature and their difference (`gap_calibrated`); the temperature is None where
    the logits rank the true class no better than the mean (T → ∞). None for a regression dataset or a test
    set of fewer than 2 images (no cross-entropy to calibrate, or none to cross-fit)."""
    if getattr(ds.info, "regression", False) or ds.x_test.shape[0] < 2:
        return None
    test = logits_of(model, ds.x_test, batch_size)
    train = logits_of(model, ds.x_train, batch_size)
    y_test, y_train = ds.y_test.to(test.device), ds.y_train.to(train.device)
    with _one_thread():
        beta = fit_beta(test, y_test)
        test_ce, train_ce = cross_fitted_ce(test, y_test), mean_ce(train, y_train, beta)
    return {"temperature": (1.0 / beta) if beta > 0 else None, "test_loss_calibrated": test_ce,
            "train_loss_calibrated": train_ce, "gap_calibrated": test_ce - train_ce}


def needs_calibration(info: dict[str, Any]) -> bool:
    """Whether a finished run's run.json (or one of its snapshots) lacks the `calibration` record, as runs
    trained before flatbench recorded it do."""
    return "calibration" not in info or any("calibration" not in s for s in info.get("snapshots") or [])


def add_calibration(run_path: Path, cfg: RunConfig, device: torch.device, datasets: dict | None = None) -> bool:
    """Add `calibration` to a finished run's run.json and snapshot.json files from its model.pt files (each
    checked against its recorded sha256): what `flatbench train` does to a run trained before flatbench
    recorded it, instead of retraining it. `datasets`: the datasets already built, by data config and seed
    (the runs of one data draw share theirs). Returns whether anything was added."""
    run_path = Path(run_path)
    datasets = {} if datasets is None else datasets
    with RunLock(run_path):
        info = load_run_info(run_path)
        key = (repr(cfg.data), cfg.data_seed)
        if key not in datasets:
            datasets[key] = load_dataset(cfg.data, cfg.data_seed, device=device)
        ds = datasets[key]
        batch = cfg.train.eval_batch_size
        added = False
        if "calibration" not in info:
            record = calibration_record(load_model(run_path, device, info=info), ds, batch)
            if record is None:
                return False
            info["calibration"], added = record, True
        for snap in info.get("snapshots") or []:
            if "calibration" in snap:
                continue
            folder = run_path / str(snap["path"])
            model = load_model(run_path, device, model_file=folder / MODEL_FILE, sha256=snap.get("model_sha256"))
            snap["calibration"] = calibration_record(model, ds, batch)
            saved = {k: v for k, v in snap.items() if k != "path"}
            atomic_write_json(folder / SNAPSHOT_JSON, saved)
            added = True
        if added:
            atomic_write_json(run_path / RUN_JSON, info)
        return added

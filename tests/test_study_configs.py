"""The committed study configs parse, and the hyperparameter study is the design its header promises.

`configs/cpu/hyperparameters.yaml` exists so that a measure's τ can be judged beyond label noise (issue 18):
its per-axis ψ, CMI and sign errors need every pair of runs that differ in exactly one hyperparameter, so
the design must be a full product. These tests check that from the expanded runs themselves, not from the
YAML text, so a config edit that breaks the design fails here.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flatbench.config import dotted, load_study

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
HP = ROOT / "configs" / "cpu" / "hyperparameters.yaml"
HYPERPARAMETERS = {"model.widths", "train.lr", "train.batch_size", "train.weight_decay", "data.n_train",
                   "train.optimizer", "model.dropout"}
"""The fields issue 18 counts as hyperparameters (width, depth, lr, batch size, weight decay, optimizer,
training-set size); the random-label ratio and the seed are counted apart."""


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_committed_config_parses(path):
    study = load_study(path)
    assert study.runs, path


def _identity(run) -> dict:
    return dotted(run.to_dict())


def test_hyperparameter_study_is_a_full_product_of_at_least_five_axes_with_the_ratio_and_two_seeds():
    study = load_study(HP)
    axes = set(study.sweep_axes)
    hyper = axes & HYPERPARAMETERS
    assert len(hyper) >= 5, sorted(axes)
    assert "data.random_label_ratio" in axes and "seed" in axes
    runs = [run for _, run in study.runs]
    assert len(runs) >= 100
    ratios = {run.data.random_label_ratio for run in runs}
    assert 0.0 in ratios and len(ratios) >= 2
    assert len({run.seed for run in runs}) >= 2
    values = {a: {repr(_identity(r)[a]) for r in runs} for a in study.sweep_axes}
    assert len(runs) == len(list(itertools.product(*values.values())))  # no combination is missing
    # every run has, for every axis, a neighbour that differs in that axis alone
    by_key = {tuple(repr(_identity(r)[a]) for a in study.sweep_axes): r for r in runs}
    for key in by_key:
        for i, axis in enumerate(study.sweep_axes):
            others = [v for v in values[axis] if v != key[i]]
            assert any(key[:i] + (v,) + key[i + 1:] in by_key for v in others), (axis, key)


def test_hyperparameter_study_trains_every_run_to_one_loss_target():
    study = load_study(HP)
    targets = {run.train.target_train_loss for _, run in study.runs}
    assert len(targets) == 1 and None not in targets
    header = HP.read_text().split("\nname:")[0]
    assert "Run time" in header and "128 runs" in header


TRAINING_AXES = {"model.widths", "model.dropout", "model.batch_norm", "model.depth", "model.width", "train.lr",
                 "train.batch_size", "train.weight_decay", "train.optimizer", "train.momentum", "data.augment"}
"""Issue 27's training hyperparameters (width, depth, dropout, learning rate, batch size, weight decay,
optimizer, augmentation); the training-set size is a data axis and the seeds are replicates."""


@pytest.mark.parametrize("path", [ROOT / "configs" / "cpu" / "natural.yaml", ROOT / "configs" / "paper" / "natural.yaml"],
                         ids=["cpu", "paper"])
def test_natural_study_is_label_free_with_five_training_axes_and_five_crossed_replicates(path):
    """Ratio 0 only; at least 5 training axes, at least 3 of them at 3 levels or more, in a full product;
    at least 5 replicates whose data draws are crossed with the configurations (every configuration sees
    the same draws)."""
    study = load_study(path)
    runs = [run for _, run in study.runs]
    assert {run.data.random_label_ratio for run in runs} == {0.0}
    ids = [_identity(r) for r in runs]
    axes = [a for a in study.sweep_axes if a not in ("seed", "data.seed")]
    training = [a for a in axes if a in TRAINING_AXES]
    assert len(training) >= 5, axes
    levels = {a: {repr(i[a]) for i in ids} for a in axes}
    assert sum(len(levels[a]) >= 3 for a in training) >= 3, levels
    configs = {tuple(repr(i[a]) for a in axes) for i in ids}
    assert len(configs) == len(list(itertools.product(*levels.values())))
    draws = {}
    for run, i in zip(runs, ids):
        draws.setdefault(tuple(repr(i[a]) for a in axes), set()).add(run.data_seed)
    assert len(set(map(frozenset, draws.values()))) == 1 and len(next(iter(draws.values()))) >= 5
    targets = {run.train.target_train_loss for run in runs}
    assert len(targets) == 1 and None not in targets
    assert "Run time" in path.read_text().split("\nname:")[0]

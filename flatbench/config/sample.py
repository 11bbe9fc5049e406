"""Sampled hyperparameters: a study config's `sample` section, a Latin hypercube over config fields.

A grid spends its runs on a few levels per axis and its cells on combinations nobody asked for; a study of
how hyperparameters move the generalization gap wants many distinct configurations, each axis covered
evenly. A Latin hypercube of n points does that with n configurations: every axis's [0, 1) range is cut
into n strata, each stratum holds exactly one point, and the strata are permuted independently per axis.
Each point is mapped through its axis's distribution; the n configurations (the *cells*) are then crossed
with the study's seeds (the data draws) and its grid lists, exactly like a grid axis:

    sample:
      method: latin_hypercube      # the only method
      n: 24                        # configurations
      seed: 0                      # the design's seed (not a data draw; default 0)
      axes:
        train.lr: {log_uniform: [1.0e-4, 3.0e-3]}
        train.weight_decay: {log_uniform: [1.0e-6, 1.0e-3]}
        model.hidden_width: {log_uniform_int: [32, 512]}
        model.hidden_depth: {choice: [1, 2, 3]}
        model.batch_norm: {choice: [false, true]}

Each axis's permutation and in-stratum offsets come from a generator seeded by (design seed, axis name),
so adding an axis leaves the other axes' draws unchanged. Drawn numbers are rounded to 3 significant
digits so that they read well in run.json and tables; the run id is the hash of the resolved config, so
the same design gives the same ids on every machine. `model.hidden_width` and `model.hidden_depth` are
the MLP's hidden layers (`model.widths = [hidden_width] * hidden_depth`), as one number each can be
sampled where a list cannot.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch

from flatbench.errors import ConfigError, did_you_mean
from flatbench.seeding import make_generator

METHODS = ("latin_hypercube",)
"""Sampling methods of `sample.method`."""
DISTRIBUTIONS = ("uniform", "log_uniform", "uniform_int", "log_uniform_int", "choice")
"""`uniform` / `log_uniform`: a number in [lo, hi] (log: evenly in log space, lo > 0); `*_int`: an integer
in [lo, hi], both ends included; `choice`: one of a list, the n strata split evenly among the choices."""
SAMPLE_KEYS = ("method", "n", "seed", "axes")
HIDDEN_AXES = ("model.hidden_width", "model.hidden_depth")
"""Derived axes: the MLP's hidden width and depth, resolved into `model.widths`."""
MAX_N = 10_000
"""The most configurations a design may draw (a larger n is a typo: each is trained once per seed)."""
SIGNIFICANT_DIGITS = 3
NOT_SAMPLED = {"seed": "a seed is a replicate, not a hyperparameter: list the draws in `seed`",
               "data.seed": "a data draw is a replicate, not a hyperparameter: list the draws in `seed`"}


@dataclass(frozen=True)
class Axis:
    """One sampled axis: its config field (`section.key`, or a hidden-layer axis), distribution and
    arguments ((lo, hi) for a range, the choices for `choice`)."""

    name: str
    distribution: str
    args: tuple


@dataclass(frozen=True)
class SampleSpec:
    """A validated `sample` section."""

    method: str
    n: int
    seed: int
    axes: tuple[Axis, ...]


# ---------------------------------------------------------------- parsing


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return int(value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def parse_axis(name: str, spec: Any) -> Axis:
    """One `axes` entry: `{distribution: arguments}`, its range or choices checked."""
    where = f"sample.axes.{name}"
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"{where} must be one distribution, e.g. {{log_uniform: [1e-4, 1e-2]}} or "
                          f"{{choice: [a, b]}} (one of: {', '.join(DISTRIBUTIONS)}), got {spec!r}")
    (dist, args), = spec.items()
    if dist not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution '{dist}'{did_you_mean(str(dist), DISTRIBUTIONS)} "
                          f"(choose one of: {', '.join(DISTRIBUTIONS)})")
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}.{dist} must be a non-empty list, got {args!r}")
    if dist == "choice":
        if any(a == b and type(a) is type(b) for i, a in enumerate(args) for b in args[:i]):
            raise ConfigError(f"{where}.choice lists a value twice: {args!r}")
        return Axis(name, dist, tuple(args))
    if len(args) != 2:
        raise ConfigError(f"{where}.{dist} must be a range [lo, hi], got {args!r}")
    convert = _int if dist.endswith("_int") else _number
    lo, hi = convert(args[0], f"{where}.{dist}[0]"), convert(args[1], f"{where}.{dist}[1]")
    if not lo < hi:
        raise ConfigError(f"{where}.{dist}: the range [lo, hi] needs lo < hi, got [{lo}, {hi}]")
    if dist.startswith("log") and lo <= 0:
        raise ConfigError(f"{where}.{dist}: a log range needs lo > 0, got [{lo}, {hi}]")
    return Axis(name, dist, (lo, hi))


def parse_sample(value: Any) -> SampleSpec:
    """Validate a `sample` section's shape (the axes' fields are checked against the config by
    `check_axes`, which knows the sections)."""
    if not isinstance(value, dict):
        raise ConfigError(f"sample must be a mapping with keys {', '.join(SAMPLE_KEYS)}, got {value!r}")
    for key in value:
        if key not in SAMPLE_KEYS:
            raise ConfigError(f"unknown key 'sample.{key}'{did_you_mean(str(key), SAMPLE_KEYS)} (valid keys in "
                              f"'sample': {', '.join(SAMPLE_KEYS)})")
    method = value.get("method", "latin_hypercube")
    if method not in METHODS:
        raise ConfigError(f"sample.method: unknown method {method!r} (choose one of: {', '.join(METHODS)})")
    if "n" not in value:
        raise ConfigError("sample.n is missing: the number of configurations to draw (e.g. n: 24)")
    n = _int(value["n"], "sample.n")
    if not 1 <= n <= MAX_N:
        raise ConfigError(f"sample.n must be in [1, {MAX_N:,}], got {n}")
    seed = _int(value.get("seed", 0), "sample.seed")
    axes = value.get("axes")
    if not isinstance(axes, dict) or not axes:
        raise ConfigError("sample.axes must map at least one config field to a distribution, e.g. "
                          "{train.lr: {log_uniform: [1e-4, 1e-2]}}")
    return SampleSpec(method, n, seed, tuple(parse_axis(str(k), v) for k, v in axes.items()))


# ---------------------------------------------------------------- drawing


def strata(n: int, seed: int, axis: str) -> tuple[list[int], list[float]]:
    """The Latin hypercube's column for one axis: cell i's stratum (a permutation of 0..n-1) and its point
    in [0, 1) (uniform within the stratum), from a generator seeded by (design seed, axis name)."""
    gen = make_generator("sample", "latin_hypercube", seed, axis)
    perm = torch.randperm(n, generator=gen).tolist()
    offsets = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return perm, [(s + u) / n for s, u in zip(perm, offsets)]


def _round(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def map_point(axis: Axis, stratum: int, u: float, n: int) -> Any:
    """The value of one cell on one axis: the stratum picks a choice (the n strata split evenly among the
    choices), the point u in [0, 1) is mapped through a range's distribution."""
    if axis.distribution == "choice":
        return axis.args[stratum * len(axis.args) // n]
    lo, hi = axis.args
    if axis.distribution == "uniform":
        return min(max(_round(lo + u * (hi - lo)), lo), hi)
    if axis.distribution == "log_uniform":
        return min(max(_round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))), lo), hi)
    if axis.distribution == "uniform_int":
        return min(lo + math.floor(u * (hi - lo + 1)), hi)
    return min(math.floor(math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo)))), hi)  # log_uniform_int


def draw(spec: SampleSpec) -> list[dict[str, Any]]:
    """The n cells of the design: for each, {axis name: drawn value}, in cell order."""
    cells: list[dict[str, Any]] = [{} for _ in range(spec.n)]
    for axis in spec.axes:
        perm, points = strata(spec.n, spec.seed, axis.name)
        for cell, stratum, u in zip(cells, perm, points):
            cell[axis.name] = map_point(axis, stratum, u, spec.n)
    return cells


# ---------------------------------------------------------------- against the config


def resolve_hidden(cell: dict[str, Any], widths: Any) -> dict[str, Any]:
    """A cell's values as config fields: `model.hidden_width` / `model.hidden_depth` become `model.widths`
    (the one not sampled taken from the config's `model.widths`: its width or its number of layers)."""
    out = {k: v for k, v in cell.items() if k not in HIDDEN_AXES}
    if any(k in cell for k in HIDDEN_AXES):
        width = cell.get("model.hidden_width", widths[0] if widths else None)
        depth = cell.get("model.hidden_depth", len(widths))
        out["model.widths"] = [width] * depth
    return out


def check_axes(spec: SampleSpec, raw: dict, field_kinds: dict[str, Any], identity_free: frozenset) -> None:
    """Each axis names a field a run is made of, of a kind its distribution can give, and is not also given
    in its section (a grid list there would be a second, conflicting source of the same field).

    `field_kinds`: {"section.key": annotation} of data, model and train; `identity_free`: the fields that
    do not change a run's model (sampling them would draw nothing)."""
    names = [a.name for a in spec.axes]
    for axis in spec.axes:
        where = f"sample.axes.{axis.name}"
        if axis.name in NOT_SAMPLED:
            raise ConfigError(f"{where}: {NOT_SAMPLED[axis.name]}")
        if axis.name in HIDDEN_AXES:
            kind: Any = int
            _check_hidden(axis.name, raw, names)
        elif axis.name in field_kinds:
            kind = field_kinds[axis.name]
            if axis.name in identity_free:
                raise ConfigError(f"{where}: {axis.name} only says how a run is executed, not what it trains; "
                                  "it cannot be sampled")
        else:
            valid = [*field_kinds, *HIDDEN_AXES]
            raise ConfigError(f"{where}: unknown config field '{axis.name}'{did_you_mean(axis.name, valid)} "
                              "(an axis is a field of data, model or train, e.g. train.lr)")
        section, key = axis.name.split(".", 1)
        if key in (raw.get(section) or {}) and axis.name not in HIDDEN_AXES:
            raise ConfigError(f"{axis.name} is both sampled (sample.axes) and given in '{section}': give it in "
                              "one place")
        _check_kind(axis, kind, where)


def _check_hidden(name: str, raw: dict, names: list[str]) -> None:
    model = raw.get("model") or {}
    if model.get("name", "mlp") != "mlp":
        raise ConfigError(f"sample.axes.{name} is an MLP's hidden layers: model.name must be mlp, got "
                          f"{model.get('name')!r}")
    both = all(h in names for h in HIDDEN_AXES)
    widths = model.get("widths")
    if widths is not None and both:
        raise ConfigError("model.widths is both sampled (sample.axes.model.hidden_width and hidden_depth) and "
                          "given in 'model': give it in one place")
    if widths is not None and (not isinstance(widths, list) or not widths
                               or any(isinstance(w, list) for w in widths) or len(set(map(str, widths))) != 1):
        raise ConfigError(f"sample.axes.{name}: model.widths must then be one list of equal widths (it gives the "
                          f"layer {'count' if name.endswith('width') else 'width'} not sampled), got {widths!r}")


def _check_kind(axis: Axis, kind: Any, where: str) -> None:
    """Integers for int fields, numbers for float fields, `choice` for everything else (an optional field,
    `int | None`, by its type without the None)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]
    if axis.distribution == "choice":
        return
    if kind is int and not axis.distribution.endswith("_int"):
        raise ConfigError(f"{where} is an integer field: use uniform_int, log_uniform_int or choice, not "
                          f"{axis.distribution}")
    if kind not in (int, float):
        raise ConfigError(f"{where} is not a number: use {{choice: [...]}}, not {axis.distribution}")

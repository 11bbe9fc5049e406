"""The Python API: measure any `nn.Module` on data of one's own.

    import flatbench
    df = flatbench.measure(model, (x, y), ["hessian_trace", "normalized_sharpness", "path_norm"])

One row per result key (`measure`, `key`, `value`, `status`, `reason`, `seconds`): a measure that does not
apply to the model (path norm on a GELU network, the ψ measures on anything but a bias-free ReLU MLP, a
rescaling family's layers missing) gives one row with status `not_applicable` and the reason; an iterative
estimate stopped by its cap before its tolerance gives `not_converged` with the residual (its estimate in
`info["values"]`); a measure that fails gives status `error` and the message. Each entry's extra
information (method, iterations, standard errors) is in `df.attrs["info"][key]`, keyed by the entry's key
(`hessian_trace`, `hessian_trace@mse`). A measure defined with
a loss of its own (`normalized_sharpness`, `fisher_rao_norm`, the PAC-Bayes searches) asked for with another
loss says so in `reason`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import yaml
from torch import Tensor, nn

from flatbench import strict_yaml
from flatbench.config import DataConfig, MeasureConfig
from flatbench.config.parse import MAX_TIMEOUT_S
from flatbench.curvature import use_hvp_mode
from flatbench.data import check_dataset_name, load_dataset, measurement_subset
from flatbench.errors import FlatbenchError
from flatbench.losses import BUILTIN_LOSSES, CLASSIFICATION_LOSSES, get_loss
from flatbench.measures.arguments import check_options, copy_model, trial_forward
from flatbench.measures.context import MeasureContext
from flatbench.measures.in_place import InPlace, measurable_in_place
from flatbench.measures.isolation import ModelGuard
from flatbench.measures.keys import entry_keys
from flatbench.measures.registry import get_measure, load_plugins, resolve_names
from flatbench.measures.runner import check_settings, compute_entry
from flatbench.models import build_from_factory
from flatbench.store import atomic_write_json, atomic_write_text, torch_load

COLUMNS = ("measure", "key", "value", "status", "reason", "seconds")


def as_tensors(data: Any, n_examples: int | None, batch_fn: Callable[[Any], Any] | None = None,
               at_most: bool = False) -> tuple[Tensor, Tensor]:
    """(inputs, targets) from `data`: one batch (an (inputs, targets) pair of tensors, or a dict with
    `batch_fn`) or an iterable of batches (a DataLoader of (inputs, targets) tuples or [inputs, targets]
    lists, or of dicts with `batch_fn`), the first `n_examples` of them (more than the data holds is refused,
    unless `at_most`: a default, not the caller's number). Targets are class indices (n,) of
    an integer type, or floating-point regression targets (n,) or (n, k). What cannot be used is one line."""
    if n_examples is not None and (isinstance(n_examples, bool) or not isinstance(n_examples, int)
                                   or n_examples < 1):
        raise FlatbenchError(f"n_examples must be positive, got {n_examples}")
    if batch_fn is not None and not callable(batch_fn):
        raise FlatbenchError(f"batch_fn must be a function batch -> (inputs, targets), got {type(batch_fn).__name__}")
    one_batch = isinstance(data, Mapping) or (isinstance(data, (tuple, list)) and len(data) == 2
                                              and all(isinstance(t, Tensor) for t in data))
    if one_batch:
        x, y = _batch(data, batch_fn, None)
    elif isinstance(data, Iterable) and not isinstance(data, (Tensor, str, bytes)):
        xs: list[Tensor] = []
        ys: list[Tensor] = []
        count = 0
        for i, batch in enumerate(data, start=1):
            x, y = _batch(batch, batch_fn, i)
            if xs:
                _same_kind(i, "inputs", x, xs[0])
                _same_kind(i, "targets", y, ys[0])
            xs.append(x)
            ys.append(y)
            count += int(x.shape[0])
            if n_examples is not None and count >= n_examples:
                break
        if not xs:
            raise FlatbenchError("data: the DataLoader gave no batches")
        x, y = (torch.cat(xs), torch.cat(ys)) if len(xs) > 1 else (xs[0], ys[0])
    else:
        raise FlatbenchError(f"data must be an (inputs, targets) pair of tensors or a DataLoader, got "
                             f"{type(data).__name__}")
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise FlatbenchError(f"data: {x.shape[0]} inputs and {y.shape[0]} targets (need the same, at least one)")
    if n_examples is not None and x.shape[0] < n_examples and not at_most:  # refused, never silently capped (as in studies)
        raise FlatbenchError(f"n_examples={n_examples} is more than the {x.shape[0]} examples of the data")
    if n_examples is not None:
        x, y = x[:n_examples], y[:n_examples]
    if y.dtype.is_floating_point:
        if y.ndim not in (1, 2):
            raise FlatbenchError(f"data: floating-point targets are regression targets, of shape (n,) or (n, k); "
                                 f"got {tuple(y.shape)}")
        if not bool(torch.isfinite(y).all()):
            raise FlatbenchError("data: the regression targets hold NaN or infinite values")
        return x, y
    if y.dtype in (torch.bool, torch.complex64, torch.complex128) or y.ndim != 1:
        raise FlatbenchError(f"data: targets must be class indices (n,) of an integer type, or floating-point "
                             f"regression targets (n,) or (n, k); got {tuple(y.shape)} {y.dtype}")
    return x, y.long()


def _batch(batch: Any, batch_fn: Callable[[Any], Any] | None, index: int | None) -> tuple[Tensor, Tensor]:
    """One batch as (inputs, targets): through `batch_fn` when given, else an (inputs, targets) tuple or
    list (further items ignored); a dict without `batch_fn` is one line naming its keys."""
    where = "data" if index is None else f"data: batch {index}"
    if batch_fn is not None:
        try:
            batch = batch_fn(batch)
        except Exception as exc:  # noqa: BLE001 - the caller's function, reported in one line
            text = str(exc).strip().splitlines()
            raise FlatbenchError(f"{where}: batch_fn failed: {type(exc).__name__}: {text[0] if text else ''}"
                                 [:300]) from None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise FlatbenchError(f"{where}: batch_fn must return (inputs, targets), got {type(batch).__name__}"
                                 + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    elif isinstance(batch, Mapping):
        keys = [str(k) for k in batch]
        first = next((k for k in ("input_ids", "inputs", "x", "pixel_values") if k in keys), "input_ids")
        target = next((k for k in ("labels", "label", "targets", "target", "y") if k in keys), "labels")
        raise FlatbenchError(f"{where} is a dict (keys: {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}): "
                             f'pass batch_fn, a function batch -> (inputs, targets), e.g. '
                             f'batch_fn=lambda b: (b["{first}"], b["{target}"])')
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise FlatbenchError(f"{where}: a DataLoader must give (inputs, targets) batches, got "
                             f"{type(batch).__name__} (pass batch_fn, a function batch -> (inputs, targets))")
    x, y = batch[0], batch[1]
    for what, t in (("inputs", x), ("targets", y)):
        if not isinstance(t, Tensor):
            raise FlatbenchError(f"{where}: the {what} are a {type(t).__name__}, not a torch tensor")
        if t.ndim == 0:
            raise FlatbenchError(f"{where}: the {what} are a 0-d tensor; a batch holds n examples, shape (n, ...)")
    if x.shape[0] != y.shape[0]:
        raise FlatbenchError(f"{where}: {x.shape[0]} inputs and {y.shape[0]} targets (need the same)")
    return x, y


def _same_kind(index: int, what: str, t: Tensor, first: Tensor) -> None:
    """A later batch's inputs or targets must have the first batch's shape per example and dtype."""
    if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
        raise FlatbenchError(f"data: batch {index} has {what} of shape {tuple(t.shape[1:])} {t.dtype} per example, "
                             f"batch 1 {tuple(first.shape[1:])} {first.dtype}: every batch must hold examples of "
                             "one shape and dtype (pad or collate them to one, or use batch_fn)")


def measure(model: nn.Module, data: Any, measures: str | list[str] | tuple[str, ...] = "all", *,
            loss: str | Callable[..., Any] = "ce", n_examples: int | None = None, device: str | torch.device = "cpu",
            dtype: torch.dtype = torch.float64, settings: dict[str, dict[str, Any]] | None = None,
            plugins: list[str] | tuple[str, ...] | None = None, seed: int = 0, hvp_mode: str = "auto",
            chunk_size: int = 2000, max_memory_mb: int = 1024, timeout_s: float | None = 3600.0,
            batch_fn: Callable[[Any], Any] | None = None) -> Any:
    """Compute flatness measures on any `nn.Module` with data of one's own.

    Every argument is checked before any work; a bad one is a `FlatbenchError` (a `ValueError`) of one
    line. Your model is measured in eval mode with every parameter trainable, in `dtype` on `device`, and
    comes back in the mode, with the `requires_grad` flags, the gradients and the weights (bit for bit) it
    had.

    Args:
        model: an `nn.Module` mapping a batch of inputs to logits / outputs of shape (n, C).
        data: one batch, an `(inputs, targets)` pair of tensors, or an iterable of batches (a `DataLoader`
            of `(inputs, targets)` tuples or `[inputs, targets]` lists; every batch of one shape per example
            and dtype). Inputs: floating point (converted to `dtype`), or integer token ids, given to the
            model as they are (a model starting with `nn.Embedding`). Targets: class indices (n,) of an
            integer type, or floating-point regression targets (n,) or (n, k) (with `loss="mse"`; a
            classification measure, such as the PAC-Bayes searches or one defined with cross-entropy, is then
            `not_applicable`). A dict batch needs `batch_fn`.
        measures: measure names, `"all"`, or a comma-separated string (`flatbench list-measures`).
        loss: the loss of the loss-based measures: `"ce"`, `"normalized_ce"`, `"mse"` (mean squared error:
            on one-hot targets for class indices, on the targets themselves for floating-point ones),
            `"file.py:function"`, or a function `(logits, targets) -> per-example losses` of shape (n,).
        n_examples: measure on the first n examples of `data` (default: all).
        device: `"cpu"`, `"cuda"` or `"cuda:N"`.
        dtype: `torch.float64` or `torch.float32`, the dtype the model is measured in.
        settings: per-measure settings, `{measure: {setting: value}}`, as `measure.settings` in a study
            config (`flatbench describe MEASURE` lists them).
        plugins: measure plugin files or modules to load first.
        seed: seeds every measure's random draws.
        hvp_mode: how Hessian-vector products are computed: `"auto"`, `"rev_fwd"`, `"fwd_rev"` or
            `"double_backward"`.
        chunk_size: examples per forward/backward chunk.
        max_memory_mb: the memory budget of the measures that size their work by it.
        timeout_s: seconds one measure may take (None: no limit; the limit needs the main thread).
        batch_fn: a function `batch -> (inputs, targets)` applied to every batch (and to `data` itself when
            it is one batch), e.g. `lambda b: (b["input_ids"], b["labels"])` for a HuggingFace-style loader
            of dicts.

    Returns:
        A pandas DataFrame, one row per result key, with the columns `measure`, `key`, `value`, `status`
            (`ok`, `not_applicable`, `not_converged`, `non_finite`, `error`), `reason` and `seconds`;
            `df.attrs["info"][key]` holds what each entry reports besides its values (method, iterations,
            residuals, standard errors), keyed by the entry's key (e.g. `hessian_trace@mse`).
    """
    return records_to_frame(measure_records(
        model, data, measures, loss=loss, n_examples=n_examples, device=device, dtype=dtype, settings=settings,
        plugins=plugins, seed=seed, hvp_mode=hvp_mode, chunk_size=chunk_size, max_memory_mb=max_memory_mb,
        timeout_s=timeout_s, batch_fn=batch_fn))


def measure_records(model: nn.Module, data: Any, measures: str | list[str] | tuple[str, ...] = "all", *,
                    loss: str | Callable[..., Any] = "ce", n_examples: int | None = None,
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64,
                    settings: dict[str, dict[str, Any]] | None = None, plugins: list[str] | tuple[str, ...] | None = None,
                    seed: int = 0, hvp_mode: str = "auto", chunk_size: int = 2000, max_memory_mb: int = 1024,
                    timeout_s: float | None = 3600.0, batch_fn: Callable[[Any], Any] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """`measure`'s computation, returning its records instead of a DataFrame: a dict entry key → record,
    each record as a study's measures.json holds it (`measure`, `status`, `values` or `reason` / `error`,
    `info`, `settings`, `seconds`); `records_to_frame` makes `measure`'s DataFrame of them. The arguments
    are `measure`'s.

    Your model is left in the mode, with the `requires_grad` flags, the gradients and the tensors it came
    with: when only flatbench's code runs (built-in measures and loss) and it already is in `dtype` on
    `device`, it is measured in place and put back (`in_place.InPlace`; each measure runs under
    `isolation.guarded_call`); otherwise a copy of it is measured (`arguments.copy_model`) and your model is
    guarded against a plugin or loss that holds a reference to it (`_CallerState`).
    """
    if not isinstance(model, nn.Module):
        raise FlatbenchError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise FlatbenchError(f"timeout_s must be in (0, {MAX_TIMEOUT_S}] seconds or None, got {timeout_s!r}")
    load_plugins(_names_of("plugins", plugins, "plugin files or modules", empty_ok=True))
    names = resolve_names(_names_of("measures", measures, "measure names or 'all'"))
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise FlatbenchError(f"model: {meta} is on the meta device (no values): load the weights first "
                             "(model.to_empty(device=...) and load_state_dict)")
    if not names:
        raise FlatbenchError("no measures given")
    state = None if _only_flatbench_code(names, loss) else _CallerState(model)
    try:
        return _measure(model, data, names, in_place_allowed=state is None, loss=loss, n_examples=n_examples,
                        device=device, dtype=dtype, settings=settings, seed=seed, hvp_mode=hvp_mode,
                        chunk_size=chunk_size, max_memory_mb=max_memory_mb, timeout_s=timeout_s,
                        batch_fn=batch_fn)
    finally:
        if state is not None:
            state.restore(model)


def _names_of(what: str, given: Any, kind: str, empty_ok: bool = False) -> list[str]:
    """A string (one name: a plugin file `file.py`, or comma-separated measure names) or a list or tuple
    of strings, as a list; anything else (None, a number, a dict) is one line."""
    if given is None and empty_ok:
        return []
    if isinstance(given, (str, Path)):
        return [str(given)]
    if isinstance(given, (list, tuple)) and all(isinstance(g, (str, Path)) for g in given):
        return [str(g) for g in given]
    raise FlatbenchError(f"{what} must be a string or a list of strings ({kind}), got {type(given).__name__}"
                         f"{' ' + repr(given)[:60] if not isinstance(given, (list, tuple)) else ' holding ' + ', '.join(sorted({type(g).__name__ for g in given}))}")


def _only_flatbench_code(names: list[str], loss: Any) -> bool:
    """Whether only flatbench's own code sees the model: built-in measures and a built-in loss. Each measure
    runs under `isolation.guarded_call`, which puts back any tensor, mode or flag a measure changed, so the
    caller's model needs no guard of its own (`_CallerState`: a clone of every tensor) and can even be measured
    in place (`in_place.InPlace`); a plugin measure or a loss of the caller's, which may hold a reference to the
    caller's model and change it outside that guard, gets the copy and the guard."""
    return isinstance(loss, str) and loss in BUILTIN_LOSSES and all(get_measure(n).origin == "builtin" for n in names)


class _CallerState:
    """The caller's model as it came (`isolation.ModelGuard`: a copy of its tensors, its modules' modes, its
    requires_grad flags). The measures see a copy of the model (`arguments.copy_model`), so nothing here is
    expected to change; this puts back whatever did (a plugin holding a reference to the caller's model)."""

    def __init__(self, model: nn.Module):
        self.guard = ModelGuard(model)

    def restore(self, model: nn.Module) -> None:
        if self.guard.change(model):
            self.guard.restore(model)


def _measure(model: nn.Module, data: Any, names: list[str], *, in_place_allowed: bool, loss: Any,
             n_examples: int | None, device: Any, dtype: torch.dtype, settings: dict | None, seed: int, hvp_mode: str,
             chunk_size: int, max_memory_mb: int, timeout_s: float | None,
             batch_fn: Callable[[Any], Any] | None) -> dict[str, dict[str, Any]]:
    """`measure_records` of the measures `names`, the arguments checked first: on the caller's model itself
    where `in_place.measurable_in_place` allows it, else on a copy."""
    if not isinstance(settings or {}, dict):
        raise FlatbenchError(f"settings must be a dict of measure -> {{setting: value}}, got {settings!r:.60}")
    settings = {k: dict(v) if isinstance(v, dict) else v for k, v in (settings or {}).items()}
    check_settings(names, MeasureConfig(settings=settings))
    device = check_options(device=device, dtype=dtype, hvp_mode=hvp_mode, chunk_size=chunk_size,
                           max_memory_mb=max_memory_mb, seed=seed)
    loss_fn = get_loss(loss)
    x, y = as_tensors(data, n_examples, batch_fn)
    if y.dtype.is_floating_point and isinstance(loss, str) and loss in CLASSIFICATION_LOSSES:
        raise FlatbenchError(f"data: the targets are floating point {tuple(y.shape)}, regression targets, and the "
                             f"loss {loss} needs class indices: use the loss mse (loss='mse', measure-model "
                             "--loss mse), or give integer class indices")
    x = x.to(device=device, dtype=dtype if x.dtype.is_floating_point else x.dtype)  # token ids stay integers
    y = y.to(device=device, dtype=dtype if y.dtype.is_floating_point else y.dtype)
    plan = dict(names=names, settings=settings, loss=loss, loss_fn=loss_fn, hvp_mode=hvp_mode, seed=seed,
                chunk_size=chunk_size, max_memory_mb=max_memory_mb, timeout_s=timeout_s)
    if in_place_allowed and measurable_in_place(model, device, dtype, hvp_mode):
        with InPlace(model):
            return _measure_net(model, x, y, **plan)
    return _measure_net(copy_model(model).to(device=device, dtype=dtype), x, y, **plan)


def _measure_net(net: nn.Module, x: Tensor, y: Tensor, *, names: list[str], settings: dict[str, Any], loss: Any,
                 loss_fn: Any, hvp_mode: str, seed: int, chunk_size: int, max_memory_mb: int,
                 timeout_s: float | None) -> dict[str, dict[str, Any]]:
    """The records of `names` on `net` (on the device and in the dtype of `x`), put in eval mode with every
    parameter trainable."""
    net.eval()
    for p in net.parameters():
        if not p.requires_grad:
            p.requires_grad_(True)
    if hvp_mode != "auto":
        use_hvp_mode(net, hvp_mode)
    num_classes = trial_forward(net, x, y, loss_fn)
    ctx = _context(net, x, y, loss, loss_fn, num_classes, seed=seed, chunk_size=chunk_size,
                   max_memory_mb=max_memory_mb)
    return compute_records(ctx, names, settings, timeout_s)


def _context(net: nn.Module, x: Tensor, y: Tensor, loss: Any, loss_fn: Any, num_classes: int, **kwargs: Any) -> Any:
    """A MeasureContext for an ad-hoc model, with `loss` (a name or a function: `loss_fn`) as its loss."""
    loss_name = loss if isinstance(loss, str) else loss_fn.name
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=num_classes, run_id="api", loss_name=loss_name,
                         **kwargs)
    ctx.cache[("loss", loss_name, ctx.normalized_ce_tau)] = loss_fn
    return ctx


def compute_records(ctx: Any, names: list[str], settings: dict[str, dict[str, Any]],
                    timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
    """measures.json entries (key → record, as the study's measure stage writes them) of `names` on `ctx`,
    each measure isolated from the others (`runner.compute_entry`)."""
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        spec = get_measure(name)
        for entry_loss, key in entry_keys(name, spec, (ctx.loss_name,)):
            records[key] = {"measure": name, **compute_entry(ctx, spec, spec.settings(settings), entry_loss,
                                                                 timeout_s)}
    return records


def records_to_frame(records: dict[str, dict[str, Any]]) -> Any:
    """One row per result key (see the module docstring); each entry's info in `df.attrs["info"]`."""
    rows: list[tuple[str, str, float, str, str, float]] = []
    info: dict[str, Any] = {}
    for key, record in records.items():
        status, seconds, name = record["status"], float(record["seconds"]), record["measure"]
        if "info" in record:
            info[key] = record["info"]
        if status == "ok":
            reason = str(record.get("reason") or "")
            rows.extend((name, value_key, float(value), status, reason, seconds)
                        for value_key, value in record["values"].items())
        else:
            rows.append((name, key, math.nan, status, str(record.get("reason") or record.get("error") or ""),
                         seconds))
    df = _frame(rows)
    df.attrs["info"] = info
    return df


_TEXT = pd.Series(["x"]).dtype
"""The dtype pandas gives a column of Python strings (`str` from pandas 3 on, `object` before)."""


@functools.cache
def _column_index() -> Any:
    """The frame's column labels, made once (an Index is immutable, so frames can share it; making one of
    strings costs about 35 µs, a quarter of the frame)."""
    return pd.Index(list(COLUMNS))


def _frame(rows: list[tuple[str, str, float, str, str, float]]) -> Any:
    """`pd.DataFrame(rows, columns=COLUMNS)`, built from its six typed columns: the same frame (dtypes
    included, tests/test_api.py checks it) in a third of the time, which matters beside a measure of a few
    milliseconds (issue 29: the API within 1.2× of the kernel). Pandas versions without the column
    constructor get the general one."""
    columns = list(zip(*rows)) if rows else [()] * len(COLUMNS)
    try:
        arrays = [pd.array(list(col), dtype=_TEXT) if kind is str else np.array(col, dtype=float)
                  for col, kind in zip(columns, (str, str, float, str, str, float))]
        return pd.DataFrame._from_arrays(arrays, columns=_column_index(), index=pd.RangeIndex(len(rows)),
                                         verify_integrity=False)
    except (AttributeError, TypeError, ValueError):  # another pandas: its public constructor
        return pd.DataFrame(rows, columns=list(COLUMNS))


MEASUREMENT_OPTIONS = ("hvp_mode", "dtype", "loss", "seed", "n_examples", "device", "checkpoint")
"""`measure-model`'s options that hold for every measure (`--hvp-mode`, `--dtype`, ...): `--set` takes the
settings of one measure (MEASURE.KEY=VALUE) only, and `--set hvp_mode=...` is refused in one line naming
the option to use instead."""


def settings_from_overrides(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """`measure.settings` from `MEASURE.KEY=VALUE` items (`measure-model --set`; the value parsed as YAML, as
    a study override's): a malformed item is one line (the names and values are checked by `measure`)."""
    settings: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, text = item.partition("=")
        name, dot, setting = key.strip().rpartition(".")
        if eq and not dot and setting in MEASUREMENT_OPTIONS:
            raise FlatbenchError(f"--set '{item}': {setting} is not a measure setting but an option of the whole "
                                 f"measurement: give it as --{setting.replace('_', '-')} {text.strip() or 'VALUE'}")
        if not eq or not dot or not name or not setting:
            raise FlatbenchError(f"--set '{item}' is not of the form MEASURE.KEY=VALUE (e.g. "
                                 "hessian_max_eig.iters=200)")
        try:
            value = strict_yaml.load(text) if text.strip() else None
        except (yaml.YAMLError, RecursionError):
            raise FlatbenchError(f"--set '{item}': the value is not valid YAML") from None
        settings.setdefault(name, {})[setting] = value
    return settings


def factory_model(factory: str, data: str, *, checkpoint: str | None = None, n_examples: int | None = None,
                  seed: int = 0, default_n: int | None = None) -> tuple[nn.Module, Tensor, Tensor]:
    """(model, inputs, targets) of a model of one's own: `factory` (file.py:function, pkg.module:function)
    built for the dataset `data` (a built-in name or an .npz file) with the torch RNG seeded by `seed`,
    `checkpoint` loaded (a state dict, or a dict with one under `state_dict` or `model`), and `n_examples`
    training examples (a seeded random subset; for None, `default_n` of them or all of fewer, all for no
    `default_n`; a number given above the data is refused). What `measure-model`, `verify` and `check-measure --factory` measure."""
    check_dataset_name(data)
    ds = load_dataset(DataConfig(dataset=data), seed)
    if n_examples is None and default_n is not None:
        n_examples = min(default_n, ds.n_train)
    if n_examples is not None and n_examples > ds.n_train:  # refused, never silently capped (as in studies)
        raise FlatbenchError(f"n_examples={n_examples} is more than the {ds.n_train} training examples of {data}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_from_factory(factory, ds.input_shape, ds.num_classes)
    if checkpoint is not None:
        blob = torch_load(Path(checkpoint), map_location="cpu")
        state = blob.get("state_dict", blob.get("model", blob)) if isinstance(blob, dict) else blob
        if isinstance(state, nn.Module):
            state = state.state_dict()
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as exc:
            raise FlatbenchError(f"checkpoint {checkpoint} does not fit the model of {factory} "
                                 f"({str(exc).splitlines()[0]})") from None
    x, y = measurement_subset(ds, n_examples, seed)
    return model, x, y


def factory_case(factory: str, data: str, *, checkpoint: str | None = None, n_examples: int | None = None,
                 default_n: int | None = None) -> Any:
    """A model of one's own as a case of the invariance contract (`check-measure --factory`): `factory_model`'s
    model in float64 and eval mode on its examples (`contract.own_case`), its classes counted by a trial
    forward pass."""
    from flatbench.measures.contract import own_case  # lazy: the contract builds its catalogue on demand

    model, x, y = factory_model(factory, data, checkpoint=checkpoint, n_examples=n_examples, default_n=default_n)
    case = own_case(f"own:{factory}", model, x, y, 0)
    return own_case(case.name, case.model, case.inputs, case.targets,
                    trial_forward(case.model, case.inputs, case.targets, get_loss("ce")))



def _check_plot_path(plot: str | os.PathLike) -> None:
    """Refuse a `--plot` path the PNG cannot be written to before anything is computed (after, the measures'
    minutes would be lost to a folder or a link in the way)."""
    path = Path(plot)
    if not str(plot).lower().endswith(".png"):
        raise FlatbenchError(f"--plot must name a .png file, got {str(plot)!r}")
    if path.is_dir():
        raise FlatbenchError(f"--plot {str(plot)!r} is a folder: name a .png file to write (e.g. "
                             f"{str(path / 'spectrum.png')!r})")
    if path.is_symlink():
        raise FlatbenchError(f"--plot {str(plot)!r} is a link: flatbench writes its own file there, remove the link")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FlatbenchError(f"--plot {str(plot)!r}: {str(parent)!r} is a file, not a folder")
            break

def measure_model(factory: str, data: str, *, checkpoint: str | None = None, n_examples: int | None = None,
                  measures: list[str] | None = None, out: str | None = None, device: str = "cpu",
                  dtype: str = "float64", plugins: list[str] | tuple[str, ...] = (), seed: int = 0,
                  settings: dict[str, dict[str, Any]] | None = None, loss: str = "ce",
                  plot: str | None = None, hvp_mode: str = "auto") -> tuple[Any, Any]:
    """`flatbench measure-model`: build the model of `factory` (file.py:function, pkg.module:function) for
    the dataset `data` (a built-in name or an .npz file: integer token inputs stay integers, floating-point
    targets are regression targets for `loss="mse"`, the factory then gets their width as `num_classes`),
    load `checkpoint` (a state dict, or a dict with one under `state_dict` or `model`), measure it on
    `n_examples` training examples (a seeded random subset; default all) with `loss`, `settings` and
    `hvp_mode`, write measures.json and table.csv into `out`, and with `plot` the hessian_density spectrum
    into that PNG (its path in `df.attrs["plot"]`). Returns (the DataFrame of `measure`, the output folder
    as a Path or None)."""
    check_dataset_name(data)
    if plot is not None:
        _check_plot_path(plot)
    if dtype not in ("float64", "float32"):
        raise FlatbenchError(f"--dtype must be float64 or float32, got {dtype!r}")
    model, x, y = factory_model(factory, data, checkpoint=checkpoint, n_examples=n_examples, seed=seed)
    records = measure_records(model, (x, y), measures or ["all"], device=device, loss=loss,
                              dtype=torch.float64 if dtype == "float64" else torch.float32, settings=settings,
                              plugins=plugins, seed=seed, hvp_mode=hvp_mode)
    df = records_to_frame(records)
    if plot is not None:
        from flatbench.measures.density_plot import plot_density

        entry = next((r for r in records.values() if r["measure"] == "hessian_density"), None)
        if entry is not None and entry["status"] in ("ok", "not_converged"):
            df.attrs["plot"] = str(plot_density(entry, plot, title=f"{factory} on {data}"))
    out_dir = Path(out) if out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        context = {"model": factory, "checkpoint": checkpoint, "data": data, "n_examples": int(x.shape[0]),
                   "dtype": dtype, "seed": seed, "hvp_mode": hvp_mode}
        atomic_write_json(out_dir / "measures.json", {k: {**r, "context": context} for k, r in records.items()})
        atomic_write_text(out_dir / "table.csv", df.to_csv(index=False))
    return df, out_dir

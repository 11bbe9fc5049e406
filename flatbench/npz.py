"""Datasets of one's own: the .npz reader (`data.dataset: path/to/data.npz`, `measure-model --data`).

The file holds `x_train`, `y_train`, `x_test`, `y_test`. The inputs are read by their dtype (`npz_inputs`):
uint8 arrays are images, scaled to float32 in [0, 1]; any other integer type is token ids, kept as int64
for a model that starts with `nn.Embedding` (store uint8 token ids as a wider integer type); bool and
floating point become float32. The targets are integer class labels 0..C-1 (N,), or floating-point
regression targets (N,) or (N, k) (`npz_targets`), which only `measure-model` and `flatbench.measure`
take (with the loss mse). Anything else is one line (`DataError`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flatbench.errors import DataError

NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def npz_inputs(x: np.ndarray, where: str) -> np.ndarray:
    """An .npz dataset's inputs as flatbench uses them, by their dtype: uint8 are images, scaled to float32
    in [0, 1]; any other integer type (int8..int64, uint16..uint64) are token ids, kept as int64 for a model
    that starts with an `nn.Embedding` (store token ids in uint8 as a wider integer type); bool and floating
    point become float32 (finite values only). One line for what cannot be used."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    if np.issubdtype(x.dtype, np.integer):
        if x.size and x.dtype == np.uint64 and int(x.max()) > np.iinfo(np.int64).max:
            raise DataError(f"{where} holds token ids above {np.iinfo(np.int64).max} (int64)")
        return x.astype(np.int64)
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype == np.bool_):
        raise DataError(f"{where} must hold numbers (integers or floating point), got {x.dtype}")
    xf = x.astype(np.float32)
    if not np.isfinite(xf).all():
        raise DataError(f"{where} holds NaN or infinite values")
    return xf


def npz_targets(y: np.ndarray, n: int, where: str) -> np.ndarray:
    """An .npz dataset's targets: integer class labels 0..C-1 of shape (N,), or floating-point regression
    targets of shape (N,) or (N, k) (finite), kept as float32."""
    if np.issubdtype(y.dtype, np.floating):
        if y.ndim not in (1, 2) or len(y) != n or (y.ndim == 2 and y.shape[1] == 0):
            raise DataError(f"{where} {tuple(y.shape)}: regression targets must be (N,) or (N, k), one row per input")
        if not np.isfinite(y).all():
            raise DataError(f"{where} holds NaN or infinite targets")
        return y.astype(np.float32)
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{where} {tuple(y.shape)} must be (N,) labels, one per input")
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and int(y.min()) < 0):
        raise DataError(f"{where} must hold integer labels 0..C-1 (or floating-point regression targets), got "
                        f"{y.dtype}{' with negative labels' if np.issubdtype(y.dtype, np.integer) else ''}")
    return y.astype(np.int64)


def read_npz(path: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An .npz dataset: inputs of any shape (N, ...) as `npz_inputs` reads them (uint8 images scaled to
    [0, 1], other integers kept as int64 token ids, the rest float32), and integer labels 0..C-1 or
    floating-point regression targets (N,) / (N, k), as CPU tensors (x_train, y_train, x_test, y_test).
    Missing arrays, mismatched lengths or bad labels are one line."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in NPZ_ARRAYS if k not in z.files]
            if missing:
                raise DataError(f"dataset file {path} lacks the array(s) {', '.join(missing)} (it has: "
                                f"{', '.join(z.files) or 'none'}); it needs {', '.join(NPZ_ARRAYS)}")
            arrays = {k: z[k] for k in NPZ_ARRAYS}
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - not an npz, damaged, pickled objects
        raise DataError(f"dataset file {path} cannot be read as .npz ({type(exc).__name__}: {exc})") from None
    out = {}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 2 or y.ndim < 1 or len(x) != len(y):
            raise DataError(f"dataset file {path}: x_{split} {tuple(x.shape)} and y_{split} {tuple(y.shape)} must "
                            "be (N, ...) inputs and (N,) labels")
        xs = npz_inputs(x, f"dataset file {path}: x_{split}")
        ys = npz_targets(y, len(x), f"dataset file {path}: y_{split}")
        out[split] = (torch.from_numpy(np.ascontiguousarray(xs)), torch.from_numpy(np.ascontiguousarray(ys)))
    (x_train, y_train), (x_test, y_test) = out["train"], out["test"]
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"dataset file {path}: x_train and x_test inputs differ in shape "
                        f"({tuple(x_train.shape[1:])} and {tuple(x_test.shape[1:])})")
    if x_train.dtype != x_test.dtype:
        raise DataError(f"dataset file {path}: x_train ({arrays['x_train'].dtype}) and x_test "
                        f"({arrays['x_test'].dtype}) are read differently (uint8: images scaled to [0, 1]; other "
                        "integers: token ids; floating point: as given); store both in one kind")
    if y_train.dtype != y_test.dtype or y_train.shape[1:] != y_test.shape[1:]:
        raise DataError(f"dataset file {path}: y_train {arrays['y_train'].dtype} {tuple(y_train.shape[1:])} and "
                        f"y_test {arrays['y_test'].dtype} {tuple(y_test.shape[1:])} differ: both class labels "
                        "(integers) or both regression targets (floating point) of one width")
    return x_train, y_train, x_test, y_test

"""Datasets as whole tensors on the device: file readers, seeded subsets, random labels, batching.

Small models train fastest when the whole (sub)set sits on the device and batches are index slices, so a
`Dataset` holds normalized float32 tensors, not a DataLoader. The raw files are read by flatbench itself
(IDX for MNIST/Fashion-MNIST, the python batches for CIFAR-10) so that the official files, torchvision's
download folders and the offline copies in `shared/data` are all read the same way; torchvision is used
only to download, and only when `data.download` is true.

Every random choice (subset, labels, batch order, crops, measurement subset) comes from a generator
seeded by `flatbench.seeding.derive_seed` with a stable name, so a run is reproducible anywhere.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import math
import os
import pickle
import socket
import tarfile
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flatbench.config import DataConfig
from flatbench.errors import DataError
from flatbench.npz import read_npz
from flatbench.seeding import make_generator

log = logging.getLogger(__name__)

LABEL_SCHEMES = ("uniform", "shuffle", "wrong")
"""Random-label schemes; `uniform` is the default (DESIGN.md, "Random labels")."""

DOWNLOAD_TIMEOUT_S = 10.0
"""Socket timeout while torchvision downloads: an offline machine must fail fast, not hang."""

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's `dataset-fashion-mnist` package puts the IDX files."""


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a dataset: what the model sees and how inputs are normalized."""

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    regression: bool = False
    """An .npz dataset whose targets are floating point (N,) or (N, k): regression targets, `num_classes` is
    then the number of outputs k (1 for (N,)); only `measure-model` and `flatbench.measure` take it (with
    loss mse), a study trains classifiers."""


_MNIST_MEAN, _MNIST_STD = (0.1307,), (0.3081,)

DATASETS: dict[str, DatasetInfo] = {
    "mnist_mini": DatasetInfo("mnist_mini", 10, (1, 28, 28), _MNIST_MEAN, _MNIST_STD),
    "mnist": DatasetInfo("mnist", 10, (1, 28, 28), _MNIST_MEAN, _MNIST_STD),
    "fashion_mnist": DatasetInfo("fashion_mnist", 10, (1, 28, 28), (0.2860,), (0.3530,)),
    "cifar10": DatasetInfo("cifar10", 10, (3, 32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


@dataclass
class Dataset:
    """A dataset ready for training: normalized N×C×H×W float32 inputs and long labels on one device.

    `y_train` holds the labels the model is trained on (corrupted by `random_labels`); `y_train_clean`
    the true ones, so that accuracies on both, and on the corrupted subset alone, can be reported.
    """

    name: str
    info: DatasetInfo
    x_train: Tensor
    y_train: Tensor
    y_train_clean: Tensor
    x_test: Tensor
    y_test: Tensor
    corrupted_mask: Tensor
    label_info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return self.info.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.info.input_shape

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])

    @property
    def device(self) -> torch.device:
        return self.x_train.device

    def augment_params(self) -> dict[str, Any]:
        """Keyword arguments for `augment_batch` that suit this dataset (`pad`, `flip`)."""
        return augment_params(self.info)

    def to(self, device: str | torch.device) -> Dataset:
        """The same dataset with every tensor on `device`."""
        return replace(self, x_train=self.x_train.to(device), y_train=self.y_train.to(device),
                       y_train_clean=self.y_train_clean.to(device), x_test=self.x_test.to(device),
                       y_test=self.y_test.to(device), corrupted_mask=self.corrupted_mask.to(device))


@dataclass(frozen=True)
class RawData:
    """The full dataset as read from disk, on the CPU: uint8 N×C×H×W images and int64 labels; an .npz
    file's as `npz.read_npz` reads them (float32 or int64 token inputs; int64 labels or float32 regression
    targets)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


_RAW_CACHE: dict[tuple[str, str], RawData] = {}
"""Raw arrays per (dataset, root), so a sweep in one process reads each dataset once."""


class _Missing(Exception):
    """The files of a dataset are not where we looked (carries the places looked in)."""

    def __init__(self, looked_in: list[Path]):
        super().__init__(", ".join(str(p) for p in looked_in))
        self.looked_in = looked_in


# ---------------------------------------------------------------- locations


def dataset_root(cfg_root: str | None) -> Path:
    """The data folder: `data.root` if given, else $FLATBENCH_DATA, else ~/.cache/flatbench."""
    if cfg_root:
        return Path(cfg_root).expanduser()
    env = os.environ.get("FLATBENCH_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "flatbench"


def _idx_dirs(name: str, root: Path) -> list[Path]:
    if name == "mnist":
        return [root / "MNIST" / "raw"]
    return [root / "FashionMNIST" / "raw", DEBIAN_FASHION_MNIST]


_FIX_HINT = {
    "mnist": "a folder holding MNIST/raw/ (the four IDX files, .gz or not)",
    "fashion_mnist": "a folder holding FashionMNIST/raw/ (the four IDX files, .gz or not)",
    "cifar10": "a folder holding cifar-10-batches-py/ or cifar-10-python.tar.gz",
}


# ---------------------------------------------------------------- readers

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not, into a numpy array of its stored shape."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number); replace it with the official file")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    if len(data) < header + math.prod(dims) * dtype.itemsize:
        raise DataError(f"{path} is truncated (shape {dims} needs more bytes); "
                        "replace it with the official file")
    arr = np.frombuffer(data, dtype=dtype, count=math.prod(dims), offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))  # a native-order, writable copy (frombuffer is read-only)


def _find_idx(dirs: list[Path], stem: str) -> Path | None:
    """The first of `dir/stem` or `dir/stem.gz` that exists (decompressed files win, they read faster)."""
    for d in dirs:
        for candidate in (d / stem, d / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_mnist_like(name: str, root: Path) -> RawData:
    dirs = _idx_dirs(name, root)
    stems = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
    paths = {key: _find_idx(dirs, stem) for key, stem in stems.items()}
    if any(p is None for p in paths.values()):
        raise _Missing(dirs)
    arrays = {key: read_idx(p) for key, p in paths.items()}  # type: ignore[arg-type]
    return _to_raw(name, arrays["x_train"][:, None], arrays["y_train"],
                   arrays["x_test"][:, None], arrays["y_test"])


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR-10 batches that builds numpy arrays and nothing else (no code execution)."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch")


def _parse_cifar_batch(blob: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        batch = _BatchUnpickler(io.BytesIO(blob), encoding="latin1").load()
        data = batch.get("data", batch.get(b"data"))
        labels = batch.get("labels", batch.get(b"labels"))
        x = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(labels, dtype=np.int64)
    except Exception as exc:  # any malformed batch is the same problem to the user
        raise DataError(f"cannot read the CIFAR-10 batch {where}: {type(exc).__name__}: {exc}") from None
    return x, y


_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


def _read_cifar10(root: Path) -> RawData:
    folder, archive = root / "cifar-10-batches-py", root / "cifar-10-python.tar.gz"
    wanted = (*_CIFAR_TRAIN, "test_batch")
    blobs: dict[str, bytes] = {}
    if all((folder / n).is_file() for n in wanted):
        blobs = {n: (folder / n).read_bytes() for n in wanted}
        source = folder
    elif archive.is_file():
        source = archive
        try:
            with tarfile.open(archive, "r:*") as tar:
                for member in tar:  # one pass over the stream: reads members, extracts nothing to disk
                    base = member.name.rsplit("/", 1)[-1]
                    if member.isfile() and base in wanted and base not in blobs:
                        blobs[base] = tar.extractfile(member).read()  # type: ignore[union-attr]
        except (OSError, EOFError, tarfile.TarError) as exc:
            raise DataError(f"cannot read {archive}: {exc}; delete it or replace it with the official "
                            "cifar-10-python.tar.gz") from None
        missing = [n for n in wanted if n not in blobs]
        if missing:
            raise DataError(f"{archive} lacks {', '.join(missing)}; replace it with the official archive")
    else:
        raise _Missing([folder, archive])
    train = [_parse_cifar_batch(blobs[n], f"{source}/{n}") for n in _CIFAR_TRAIN]
    x_test, y_test = _parse_cifar_batch(blobs["test_batch"], f"{source}/test_batch")
    return _to_raw("cifar10", np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]),
                   x_test, y_test)


def mnist_mini_path() -> Path:
    """The packaged 7,000-example MNIST subset (see flatbench/assets/README.md)."""
    return Path(str(resources.files("flatbench") / "assets" / "mnist_mini.npz"))


def _read_mnist_mini() -> RawData:
    path = mnist_mini_path()
    if not path.is_file():
        raise DataError(f"mnist_mini: the packaged file {path} is missing; reinstall flatbench")
    with np.load(path) as z:
        return _to_raw("mnist_mini", z["x_train"][:, None], z["y_train"], z["x_test"][:, None], z["y_test"])


def _to_raw(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
            y_test: np.ndarray) -> RawData:
    """Check shapes and label ranges, then wrap as CPU tensors."""
    info = DATASETS[name]
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if tuple(x.shape[1:]) != info.input_shape or len(x) != len(y) or x.dtype != np.uint8:
            raise DataError(f"{name}: the {split} files hold {len(x)} images of shape {tuple(x.shape[1:])} "
                            f"({x.dtype}) and {len(y)} labels; expected uint8 images of shape "
                            f"{info.input_shape}, one label each; replace them with the official files")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= info.num_classes):
            raise DataError(f"{name}: {split} labels outside 0..{info.num_classes - 1}; "
                            "replace the files with the official ones")
    return RawData(torch.from_numpy(np.ascontiguousarray(x_train)),
                   torch.from_numpy(y_train.astype(np.int64)),
                   torch.from_numpy(np.ascontiguousarray(x_test)),
                   torch.from_numpy(y_test.astype(np.int64)))


def is_npz_dataset(name: str) -> bool:
    """A dataset of one's own: a path to an .npz file (x_train, y_train, x_test, y_test)."""
    return isinstance(name, str) and name.endswith(".npz")


def check_dataset_name(name: str) -> None:
    """A built-in dataset or an .npz file; one line otherwise (the file's content is checked on reading)."""
    if is_npz_dataset(name):
        if not Path(name).expanduser().is_file():
            raise DataError(f"dataset file {name} does not exist (data.dataset: a path to an .npz file with "
                            "x_train, y_train, x_test, y_test, relative to where flatbench runs)")
        return
    if name not in DATASETS:
        close = get_close_matches(name, list(DATASETS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise DataError(f"unknown dataset '{name}'{hint} (available: {', '.join(sorted(DATASETS))}, or a "
                        "path to an .npz file)")


def dataset_info(name: str, raw: RawData | None = None) -> DatasetInfo:
    """A dataset's static facts; for an .npz file from its arrays (C = the largest label + 1, or for
    regression targets (N,) / (N, k) the number of outputs 1 / k; no standardization: its inputs are used as
    given)."""
    if not is_npz_dataset(name):
        return DATASETS[name]
    raw = raw if raw is not None else load_raw(name)
    if raw.y_train.is_floating_point():
        outputs = int(raw.y_train.shape[1]) if raw.y_train.ndim == 2 else 1
        return DatasetInfo(name, outputs, tuple(int(d) for d in raw.x_train.shape[1:]), (), (), regression=True)
    num_classes = max(int(raw.y_train.max()) if len(raw.y_train) else 0,
                      int(raw.y_test.max()) if len(raw.y_test) else 0) + 1
    return DatasetInfo(name, max(2, num_classes), tuple(int(d) for d in raw.x_train.shape[1:]), (), ())


def _read_raw(name: str, root: Path) -> RawData:
    if is_npz_dataset(name):
        return RawData(*read_npz(Path(name).expanduser()))
    if name == "mnist_mini":
        return _read_mnist_mini()
    if name == "cifar10":
        return _read_cifar10(root)
    return _read_mnist_like(name, root)


def _download(name: str, root: Path) -> str | None:
    """Download with torchvision into its standard layout under `root`; the error text, or None if done."""
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    chatter = io.StringIO()  # torchvision prints each mirror it tries; the user gets our one line instead
    try:
        from torchvision import datasets as tvd  # lazy: torchvision is heavy, needed only to download

        cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[name]
        log.info("downloading %s into %s", name, root)
        with contextlib.redirect_stdout(chatter):
            cls(str(root), train=True, download=True)
    except Exception as exc:  # network, permissions, checksum: all reported as one line
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    finally:
        socket.setdefaulttimeout(old_timeout)
    return None


def load_raw(name: str, root: str | Path | None = None, download: bool = False) -> RawData:
    """The full dataset as uint8/int64 CPU tensors (an .npz file's as `npz.read_npz` reads it), read once per
    (name, root) in this process."""
    check_dataset_name(name)
    root_path = Path(root).expanduser() if root is not None else dataset_root(None)
    key = (name, "<package>" if name == "mnist_mini" else str(root_path.resolve()))
    if is_npz_dataset(name):
        path = Path(name).expanduser().resolve()
        key = (str(path), f"{path.stat().st_mtime_ns}:{path.stat().st_size}")
    if key in _RAW_CACHE:
        return _RAW_CACHE[key]
    try:
        raw = _read_raw(name, root_path)
    except _Missing as missing:
        looked = ", ".join(str(p) for p in missing.looked_in)
        fix = (f"set FLATBENCH_DATA or data.root to {_FIX_HINT[name]}, "
               "or set data.download: true on a machine with network access")
        if not download:
            raise DataError(f"dataset '{name}' not found (looked in {looked}); {fix}") from None
        error = _download(name, root_path)
        if error is not None:
            raise DataError(f"dataset '{name}' not found (looked in {looked}) and the download into "
                            f"{root_path} failed ({error}); set FLATBENCH_DATA or data.root to "
                            f"{_FIX_HINT[name]}, or retry with network access") from None
        try:
            raw = _read_raw(name, root_path)
        except _Missing:
            raise DataError(f"dataset '{name}': torchvision reported a download into {root_path} but the "
                            f"files are not in {looked}; {fix}") from None
    _RAW_CACHE[key] = raw
    return raw


# ---------------------------------------------------------------- subsets and labels


def balanced_subset(labels: Tensor, n: int | None, num_classes: int, generator: torch.Generator) -> Tensor:
    """Sorted indices of a seeded class-balanced subset of size n (all indices if n is None or ≥ N).

    Each class gets n // C examples; the n % C left over go to classes in a seeded order. A class with
    too few examples gives its share to the others, so the subset always has exactly n examples.
    """
    total = int(labels.numel())
    if n is None or n >= total:
        return torch.arange(total)
    if n <= 0:
        raise ValueError(f"subset size must be positive, got {n}")
    labels = labels.cpu()
    counts = torch.bincount(labels, minlength=num_classes).tolist()
    order = torch.randperm(num_classes, generator=generator).tolist()
    quota = [0] * num_classes
    remaining = n
    while remaining > 0:
        open_classes = [c for c in order if quota[c] < counts[c]]
        share, extra = divmod(remaining, len(open_classes))
        for i, c in enumerate(open_classes):
            take = min(counts[c] - quota[c], share + (1 if i < extra else 0))
            quota[c] += take
            remaining -= take
    perm = torch.randperm(total, generator=generator)
    by_class = perm[torch.sort(labels[perm], stable=True).indices]  # each class's indices, in random order
    starts = [0, *np.cumsum(counts)[:-1].tolist()]
    chosen = torch.cat([by_class[s:s + q] for s, q in zip(starts, quota)])
    return torch.sort(chosen).values


def random_labels(y: Tensor, ratio: float, num_classes: int, seed: int,
                  scheme: str = "uniform") -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Corrupt exactly round(ratio·n) labels; returns (labels, corrupted_mask, info).

    The corrupted subset is the first round(ratio·n) entries of a permutation seeded by
    ("labels", seed, scheme, n), so subsets are nested across ratios. Schemes:
      - uniform (default): a label drawn uniformly from all C classes (may equal the true one); the draws
        are tied to permutation positions, so nested subsets also share their drawn labels;
      - wrong: uniform over the C − 1 other classes (every corrupted label changes);
      - shuffle: the subset's labels permuted among themselves (keeps the label histogram).
    `round` is Python's (halves to even), as in `info["n_corrupted"]`.
    """
    if scheme not in LABEL_SCHEMES:
        raise ValueError(f"unknown random-label scheme '{scheme}' "
                         f"(choose one of: {', '.join(LABEL_SCHEMES)})")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"random-label ratio must be in [0, 1], got {ratio}")
    if scheme == "wrong" and num_classes < 2:
        raise ValueError("the 'wrong' scheme needs at least 2 classes")
    clean = y.detach().to("cpu", torch.long).reshape(-1)
    n = int(clean.numel())
    if n and (int(clean.min()) < 0 or int(clean.max()) >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    k = int(round(ratio * n))
    gen = make_generator("labels", seed, scheme, n)
    chosen = torch.randperm(n, generator=gen)[:k]
    new = clean.clone()
    if scheme == "uniform":
        new[chosen] = torch.randint(num_classes, (n,), generator=gen)[:k]
    elif scheme == "wrong":
        offsets = torch.randint(1, num_classes, (n,), generator=gen)[:k]
        new[chosen] = (clean[chosen] + offsets) % num_classes
    else:
        new[chosen] = clean[chosen][torch.randperm(k, generator=gen)]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[chosen] = True
    info = {"scheme": scheme, "ratio": float(ratio), "n_corrupted": k,
            "n_changed": int((new != clean).sum()), "seed": seed}
    return new.to(y.device), mask.to(y.device), info


def _normalize(x: Tensor, info: DatasetInfo, device: str | torch.device) -> Tensor:
    """uint8 → float32 in [0, 1] → per-channel standardized, computed on the device (4× less copying); an
    .npz dataset's inputs as they are (float32, or int64 token ids kept as integers)."""
    if not info.mean:
        return x.to(device).clone() if not x.is_floating_point() else x.to(device).to(torch.float32).clone()
    x = x.to(device).to(torch.float32).div_(255.0)
    mean = torch.tensor(info.mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return x.sub_(mean).div_(std)


def load_dataset(cfg: DataConfig, seed: int, device: str | torch.device = "cpu") -> Dataset:
    """Read (once per process), subset, normalize and label-corrupt a dataset, on `device`."""
    raw = load_raw(cfg.dataset, dataset_root(cfg.root), cfg.download)
    info = dataset_info(cfg.dataset, raw)
    if info.regression:
        return _regression_dataset(cfg, raw, info, seed, device)
    C = info.num_classes
    train_idx = balanced_subset(raw.y_train, cfg.n_train, C,
                                make_generator("subset", cfg.dataset, "train", cfg.n_train, seed))
    test_idx = balanced_subset(raw.y_test, cfg.n_test, C,
                               make_generator("subset", cfg.dataset, "test", cfg.n_test, seed))
    y_clean = raw.y_train[train_idx]
    y_train, mask, label_info = random_labels(y_clean, cfg.random_label_ratio, C, seed,
                                              cfg.random_label_scheme)
    return Dataset(name=cfg.dataset, info=info,
                   x_train=_normalize(raw.x_train[train_idx], info, device),
                   y_train=y_train.to(device), y_train_clean=y_clean.to(device),
                   x_test=_normalize(raw.x_test[test_idx], info, device),
                   y_test=raw.y_test[test_idx].to(device),
                   corrupted_mask=mask.to(device), label_info=label_info)


def _regression_dataset(cfg: DataConfig, raw: RawData, info: DatasetInfo, seed: int,
                        device: str | torch.device) -> Dataset:
    """`load_dataset` of floating-point (regression) targets: seeded subsets (no classes to balance) and no
    random labels (a ratio above 0 is one line)."""
    if cfg.random_label_ratio:
        raise DataError(f"data.random_label_ratio={cfg.random_label_ratio}: {cfg.dataset} has floating-point "
                        "(regression) targets, and random labels need class labels")

    def subset(n_total: int, n: int | None, split: str, size: int | None) -> Tensor:
        if n is None or n >= n_total:
            return torch.arange(n_total)
        gen = make_generator("subset", cfg.dataset, split, size, seed)
        return torch.sort(torch.randperm(n_total, generator=gen)[:n]).values

    train_idx = subset(len(raw.y_train), cfg.n_train, "train", cfg.n_train)
    test_idx = subset(len(raw.y_test), cfg.n_test, "test", cfg.n_test)
    y_train = raw.y_train[train_idx].to(device)
    return Dataset(name=cfg.dataset, info=info, x_train=_normalize(raw.x_train[train_idx], info, device),
                   y_train=y_train, y_train_clean=y_train.clone(),
                   x_test=_normalize(raw.x_test[test_idx], info, device), y_test=raw.y_test[test_idx].to(device),
                   corrupted_mask=torch.zeros(len(train_idx), dtype=torch.bool, device=device),
                   label_info={"scheme": cfg.random_label_scheme, "ratio": 0.0, "n_corrupted": 0, "n_changed": 0,
                               "seed": seed})


def measurement_subset(ds: Dataset, n: int | None, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded subset of the training inputs with the labels trained on (all if n is None or ≥ N)."""
    if n is None or n >= ds.n_train:
        return ds.x_train, ds.y_train
    if n <= 0:
        raise ValueError(f"measurement subset size must be positive, got {n}")
    gen = make_generator("measure_subset", ds.name, n, seed)
    idx = torch.sort(torch.randperm(ds.n_train, generator=gen)[:n]).values.to(ds.x_train.device)
    return ds.x_train[idx], ds.y_train[idx]


# ---------------------------------------------------------------- augmentation


def augment_params(info: DatasetInfo) -> dict[str, Any]:
    """Standard augmentation for a dataset: pad 4 for 32×32 and 2 for 28×28; flips for CIFAR-10 only.

    Digits are not mirror-symmetric, so flipping would change what MNIST images mean.
    """
    if len(info.input_shape) != 3:
        return {"pad": 0, "flip": False}
    size = info.input_shape[-1]
    pad = 4 if size == 32 else 2 if size == 28 else max(1, size // 8)
    return {"pad": pad, "flip": info.name == "cifar10"}

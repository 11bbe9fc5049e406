"""flatbench.data: random labels, subsets, readers, batching, augmentation, and the full datasets.

Full-data tests (`@pytest.mark.full_data`) read MNIST from $FLATBENCH_DATA (else ../shared/data next to
the project) and CIFAR-10 from $FLATBENCH_CIFAR10_ROOT (a folder holding cifar-10-batches-py/, e.g. made by
`python ../shared/data/prepare_cifar10.py DIR`). They skip with the reason when the data is absent, and
fail instead when the environment variable CI is set, so CI never passes without having read the data.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch

from flatbench import data as D
from flatbench.training.batches import augment_batch, epoch_batches
from flatbench.config import DataConfig
from flatbench.errors import DataError
from flatbench.seeding import make_generator

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


# ---------------------------------------------------------------- full-data helpers


def data_unavailable(reason: str) -> NoReturn:
    """Skip with `reason`, or fail when $CI is set (CI must never pass without the data)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so full-data tests must run)")
    pytest.skip(reason)


def full_data_raw(name: str, env_var: str, fallback: Path | None = None) -> D.RawData:
    """The raw dataset from the folder named by `env_var` (or `fallback`), else skip/fail."""
    value = os.environ.get(env_var)
    root = Path(value) if value else fallback
    if root is None:
        data_unavailable(f"{name}: set {env_var} to the data folder to run this test")
    try:
        return D.load_raw(name, root, download=False)
    except DataError as exc:
        data_unavailable(f"{name} not readable from {root} ({env_var}={value!r}): {exc}")


def mnist_full() -> D.RawData:
    """Full MNIST (called in the test body, so that a CI failure is a FAILED test, not a setup error)."""
    return full_data_raw("mnist", "FLATBENCH_DATA", SHARED_DATA if (SHARED_DATA / "MNIST").is_dir() else None)


def cifar_full() -> D.RawData:
    return full_data_raw("cifar10", "FLATBENCH_CIFAR10_ROOT")


# ---------------------------------------------------------------- random labels


def _labels(n: int, C: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(C, (n,), generator=make_generator("test-labels", n, seed))


@pytest.mark.parametrize("scheme", D.LABEL_SCHEMES)
@pytest.mark.parametrize("n", [1000, 999, 7])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 0.3, 1.0])
def test_random_labels_exact_count(scheme: str, n: int, ratio: float) -> None:
    y = _labels(n)
    new, mask, info = D.random_labels(y, ratio, 10, seed=3, scheme=scheme)
    k = round(ratio * n)
    assert int(mask.sum()) == k == info["n_corrupted"]
    assert mask.dtype == torch.bool and new.dtype == torch.long and new.shape == y.shape
    assert torch.equal(new[~mask], y[~mask])
    assert info["n_changed"] == int((new != y).sum())
    assert info == {"scheme": scheme, "ratio": ratio, "n_corrupted": k, "n_changed": info["n_changed"],
                    "seed": 3}
    assert 0 <= int(new.min()) and int(new.max()) < 10


@pytest.mark.parametrize("scheme", D.LABEL_SCHEMES)
def test_random_labels_deterministic_and_seeded(scheme: str) -> None:
    y = _labels(2000)
    a = D.random_labels(y, 0.4, 10, seed=1, scheme=scheme)
    b = D.random_labels(y.clone(), 0.4, 10, seed=1, scheme=scheme)
    c = D.random_labels(y, 0.4, 10, seed=2, scheme=scheme)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert not torch.equal(a[1], c[1])


@pytest.mark.parametrize("scheme", D.LABEL_SCHEMES)
def test_random_label_subsets_nested_across_ratios(scheme: str) -> None:
    y = _labels(1000)
    masks = [D.random_labels(y, r, 10, seed=5, scheme=scheme)[1] for r in (0.1, 0.25, 0.5, 0.9, 1.0)]
    for small, big in zip(masks, masks[1:]):
        assert bool((small <= big).all()), "a smaller ratio's subset must lie inside a larger ratio's"


def test_uniform_labels_nested_values_and_spread() -> None:
    y = _labels(10000)
    quarter, m25, _ = D.random_labels(y, 0.25, 10, seed=0)
    half, m50, info = D.random_labels(y, 0.5, 10, seed=0)
    assert torch.equal(quarter[m25], half[m25]), "nested subsets share their drawn labels"
    counts = torch.bincount(half[m50], minlength=10).float()
    assert counts.min() > 0.8 * 500 and counts.max() < 1.2 * 500  # 5000 draws over 10 classes
    assert 0.85 * 5000 < info["n_changed"] < 0.95 * 5000  # a draw keeps the true label 1 time in 10


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_uniform_scheme_redraws_every_chosen_label(ratio: float) -> None:
    """With C = 10⁶ classes a uniform redraw keeps the true label with probability 10⁻⁶, so every one of the
    k chosen labels must differ: a chosen position left un-redrawn (while the count still says k) shows
    as n_changed < k."""
    C, n = 10**6, 2000
    y = torch.randint(C, (n,), generator=make_generator("test-labels-large-C", n))
    new, mask, info = D.random_labels(y, ratio, C, seed=11)
    k = round(ratio * n)
    assert info["n_corrupted"] == int(mask.sum()) == k
    assert bool((new[mask] != y[mask]).all()), "a chosen label was not redrawn"
    assert info["n_changed"] == int((new != y).sum()) == k
    assert torch.equal(new[~mask], y[~mask])


@pytest.mark.parametrize("scheme", D.LABEL_SCHEMES)
def test_random_labels_match_the_documented_generator(scheme: str) -> None:
    """An explicit re-implementation: the first k of a permutation from the generator seeded by
    ("labels", seed, scheme, n); uniform draws and wrong-label offsets tied to permutation positions (n
    drawn, the first k used), shuffle a permutation of the subset's labels."""
    C, n, ratio, seed = 10, 500, 0.4, 7
    y = _labels(n, C)
    k = round(ratio * n)
    gen = make_generator("labels", seed, scheme, n)
    chosen = torch.randperm(n, generator=gen)[:k]
    expected = y.clone()
    if scheme == "uniform":
        expected[chosen] = torch.randint(C, (n,), generator=gen)[:k]
    elif scheme == "wrong":
        expected[chosen] = (y[chosen] + torch.randint(1, C, (n,), generator=gen)[:k]) % C
    else:
        expected[chosen] = y[chosen][torch.randperm(k, generator=gen)]
    new, mask, info = D.random_labels(y, ratio, C, seed=seed, scheme=scheme)
    assert torch.equal(new, expected)
    assert torch.equal(torch.nonzero(mask).flatten(), torch.sort(chosen).values)
    assert info["n_changed"] == int((expected != y).sum())


def test_wrong_scheme_always_changes() -> None:
    y = _labels(3000)
    new, mask, info = D.random_labels(y, 0.6, 10, seed=0, scheme="wrong")
    assert bool((new[mask] != y[mask]).all())
    assert info["n_changed"] == info["n_corrupted"] == 1800
    spread = torch.bincount((new[mask] - y[mask]) % 10, minlength=10)
    assert spread[0] == 0 and bool((spread[1:] > 0).all())


def test_shuffle_scheme_keeps_subset_histogram() -> None:
    y = _labels(3000)
    new, mask, _ = D.random_labels(y, 0.5, 10, seed=0, scheme="shuffle")
    assert torch.equal(torch.bincount(new[mask], minlength=10), torch.bincount(y[mask], minlength=10))
    assert torch.equal(torch.bincount(new, minlength=10), torch.bincount(y, minlength=10))
    assert not torch.equal(new, y)


def test_random_labels_rejects_bad_input() -> None:
    y = _labels(10)
    with pytest.raises(ValueError, match="ratio"):
        D.random_labels(y, 1.5, 10, seed=0)
    with pytest.raises(ValueError, match="scheme"):
        D.random_labels(y, 0.5, 10, seed=0, scheme="flip")
    with pytest.raises(ValueError, match="0..4"):
        D.random_labels(y, 0.5, 5, seed=0)


# ---------------------------------------------------------------- mnist_mini and load_dataset


def test_mnist_mini_loads() -> None:
    ds = D.load_dataset(DataConfig(dataset="mnist_mini"), seed=0)
    assert (ds.n_train, ds.n_test, ds.num_classes, ds.input_shape) == (6000, 1000, 10, (1, 28, 28))
    assert ds.x_train.shape == (6000, 1, 28, 28) and ds.x_train.dtype == torch.float32
    assert ds.x_test.shape == (1000, 1, 28, 28) and ds.y_test.dtype == torch.long
    assert torch.bincount(ds.y_train, minlength=10).tolist() == [600] * 10
    assert torch.bincount(ds.y_test, minlength=10).tolist() == [100] * 10
    assert abs(float(ds.x_train.mean())) < 0.1 and abs(float(ds.x_train.std()) - 1) < 0.1  # normalized
    assert ds.label_info["n_corrupted"] == 0 and not bool(ds.corrupted_mask.any())
    assert ds.augment_params() == {"pad": 2, "flip": False}
    assert D.mnist_mini_path().stat().st_size <= 2 * 1024 * 1024


def test_load_dataset_corrupts_train_only() -> None:
    clean = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=1000, n_test=500), seed=4)
    noisy = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=1000, n_test=500,
                                      random_label_ratio=0.3, random_label_scheme="wrong"), seed=4)
    assert torch.equal(clean.x_train, noisy.x_train) and torch.equal(clean.y_train, noisy.y_train_clean)
    assert torch.equal(clean.x_test, noisy.x_test) and torch.equal(clean.y_test, noisy.y_test)
    assert int(noisy.corrupted_mask.sum()) == 300 == noisy.label_info["n_changed"]
    assert torch.equal(noisy.y_train != noisy.y_train_clean, noisy.corrupted_mask)
    assert noisy.label_info["scheme"] == "wrong" and noisy.label_info["seed"] == 4


def test_raw_arrays_are_cached() -> None:
    assert D.load_raw("mnist_mini") is D.load_raw("mnist_mini")


@pytest.mark.parametrize("n", [1000, 1005, 10])
def test_balanced_subset_exact_counts(n: int) -> None:
    n_test = min(n, 995)  # mnist_mini has 1000 test images
    ds = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=n, n_test=n_test), seed=0)
    for y, size in ((ds.y_train, n), (ds.y_test, n_test)):
        counts = torch.bincount(y, minlength=10)
        assert int(counts.sum()) == size
        assert int(counts.max()) - int(counts.min()) <= 1 and int(counts.min()) == size // 10


def test_balanced_subset_seeded_and_handles_small_classes() -> None:
    labels = torch.tensor([0] * 5 + [1] * 50 + [2] * 50)
    idx = D.balanced_subset(labels, 60, 3, make_generator("t", 0))
    assert len(idx) == len(set(idx.tolist())) == 60
    assert sorted(torch.bincount(labels[idx], minlength=3).tolist()) == [5, 27, 28]
    same = D.balanced_subset(labels, 60, 3, make_generator("t", 0))
    other = D.balanced_subset(labels, 60, 3, make_generator("t", 1))
    assert torch.equal(idx, same) and not torch.equal(idx, other)
    assert torch.equal(D.balanced_subset(labels, None, 3, make_generator("t", 0)), torch.arange(105))
    a = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=200), seed=0).x_train
    b = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=200), seed=1).x_train
    assert not torch.equal(a, b)


def test_measurement_subset() -> None:
    ds = D.load_dataset(DataConfig(dataset="mnist_mini", n_train=500, random_label_ratio=0.5), seed=0)
    x, y = D.measurement_subset(ds, None, seed=0)
    assert x is ds.x_train and y is ds.y_train
    x, y = D.measurement_subset(ds, 100, seed=0)
    x2, y2 = D.measurement_subset(ds, 100, seed=0)
    assert x.shape == (100, 1, 28, 28) and torch.equal(x, x2) and torch.equal(y, y2)
    rows = (ds.x_train.flatten(1)[None] == x.flatten(1)[:, None]).all(-1).float().argmax(1)
    assert torch.equal(ds.y_train[rows], y), "the labels are the trained-on (corrupted) ones"


# ---------------------------------------------------------------- batching and augmentation


@pytest.mark.parametrize("n,bs", [(1000, 128), (256, 128), (5, 10)])
def test_epoch_batches_cover_each_index_once(n: int, bs: int) -> None:
    batches = epoch_batches(n, bs, make_generator("b", 0))
    assert torch.equal(torch.sort(torch.cat(batches)).values, torch.arange(n))
    assert [len(b) for b in batches[:-1]] == [bs] * (len(batches) - 1) and 0 < len(batches[-1]) <= bs
    again = epoch_batches(n, bs, make_generator("b", 0))
    assert all(torch.equal(a, b) for a, b in zip(batches, again))


def _crops(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Every crop of the reflection-padded image x (C×H×W): (offsets, C, H, W)."""
    p = torch.nn.functional.pad(x[None], (pad,) * 4, mode="reflect")[0]
    H, W = x.shape[1:]
    return torch.stack([p[:, i:i + H, j:j + W] for i in range(2 * pad + 1) for j in range(2 * pad + 1)])


@pytest.mark.parametrize("flip", [False, True])
def test_augment_batch_crops_and_flips(flip: bool) -> None:
    x = torch.randn(8, 3, 32, 32, generator=make_generator("x"))
    out = augment_batch(x, make_generator("aug", 0), flip=flip, pad=4)
    again = augment_batch(x, make_generator("aug", 0), flip=flip, pad=4)
    assert out.shape == x.shape and torch.equal(out, again)
    assert not torch.equal(out, augment_batch(x, make_generator("aug", 1), flip=flip, pad=4))
    n_flipped = 0
    for b in range(len(x)):
        plain = (_crops(x[b], 4) == out[b]).flatten(1).all(1).any()
        mirrored = (_crops(x[b].flip(-1), 4) == out[b]).flatten(1).all(1).any()
        assert bool(plain or mirrored)
        n_flipped += int(bool(mirrored and not plain))
    assert (n_flipped > 0) == flip


def test_augment_params() -> None:
    assert D.augment_params(D.DATASETS["cifar10"]) == {"pad": 4, "flip": True}
    assert D.augment_params(D.DATASETS["fashion_mnist"]) == {"pad": 2, "flip": False}


# ---------------------------------------------------------------- readers on small synthetic files


def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    blob = bytes([0, 0, 0x08, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(blob))
    else:
        path.write_bytes(blob)


def _fake_idx_root(root: Path, folder: str, gz: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (30, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": np.arange(30, dtype=np.uint8) % 10,
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": np.arange(20, dtype=np.uint8) % 10}
    for stem, arr in arrays.items():
        _write_idx(root / folder / "raw" / stem, arr, gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_idx_reader(tmp_path: Path, gz: bool, name: str, folder: str) -> None:
    arrays = _fake_idx_root(tmp_path, folder, gz)
    raw = D.load_raw(name, tmp_path)
    assert raw.x_train.shape == (30, 1, 28, 28) and raw.x_test.shape == (20, 1, 28, 28)
    assert np.array_equal(raw.x_train[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert raw.y_test.dtype == torch.int64 and raw.y_test.tolist() == list(range(10)) * 2
    ds = D.load_dataset(DataConfig(dataset=name, root=str(tmp_path), download=False, n_train=10), seed=0)
    assert ds.n_train == 10 and ds.n_test == 20


def test_idx_reader_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "x-idx3-ubyte"
    bad.write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(DataError, match="not an IDX file"):
        D.read_idx(bad)
    _write_idx(tmp_path / "short", np.zeros((3, 4), np.uint8), gz=False)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated"):
        D.read_idx(tmp_path / "short")


def _cifar_batches() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    blobs = {}
    for i, name in enumerate([*(f"data_batch_{j}" for j in range(1, 6)), "test_batch"]):
        batch = {"batch_label": name, "labels": [int(v) for v in rng.integers(0, 10, 4)],
                 "data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "filenames": [f"{i}.png"] * 4}
        blobs[name] = pickle.dumps(batch, protocol=2 if i % 2 else 4)
    return blobs


@pytest.mark.parametrize("layout", ["folder", "archive"])
def test_cifar_reader(tmp_path: Path, layout: str) -> None:
    blobs = _cifar_batches()
    if layout == "folder":
        (tmp_path / "cifar-10-batches-py").mkdir()
        for name, blob in blobs.items():
            (tmp_path / "cifar-10-batches-py" / name).write_bytes(blob)
    else:
        with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
            for name, blob in blobs.items():
                member = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
                member.size = len(blob)
                tar.addfile(member, io.BytesIO(blob))
    raw = D.load_raw("cifar10", tmp_path)
    assert raw.x_train.shape == (20, 3, 32, 32) and raw.x_test.shape == (4, 3, 32, 32)
    first = pickle.loads(blobs["data_batch_1"])
    assert np.array_equal(raw.x_train[:4].numpy().reshape(4, -1), first["data"])
    assert raw.y_train[:4].tolist() == first["labels"]
    if layout == "archive":
        assert not (tmp_path / "cifar-10-batches-py").exists(), "members are read, not extracted"


def test_cifar_reader_refuses_code_in_pickles(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name, blob in _cifar_batches().items():
        (folder / name).write_bytes(blob)
    (folder / "test_batch").write_bytes(pickle.dumps({"data": os.getcwd, "labels": []}))
    with pytest.raises(DataError, match="unexpected object"):
        D.load_raw("cifar10", tmp_path)


# ---------------------------------------------------------------- missing data


@pytest.mark.parametrize("name,where", [("mnist", "MNIST/raw"), ("fashion_mnist", "FashionMNIST/raw"),
                                        ("cifar10", "cifar-10-batches-py")])
def test_missing_dataset_offline_is_one_clear_line(tmp_path: Path, name: str, where: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian's dataset-fashion-mnist package may be installed on this machine: make it absent here
    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian-package")
    with pytest.raises(DataError) as err:
        D.load_dataset(DataConfig(dataset=name, root=str(tmp_path), download=False), seed=0)
    message = str(err.value)
    assert "\n" not in message and f"'{name}'" in message
    assert str(tmp_path / where) in message and "FLATBENCH_DATA" in message and "download" in message


def test_failed_download_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import urllib.error

    import torchvision.datasets

    def offline(*args: object, **kwargs: object) -> None:
        print("Downloading https://example.invalid/train-images-idx3-ubyte.gz")
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://x, got:\n"
                           + str(urllib.error.URLError("Name or service not known")))

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    before = socket.getdefaulttimeout()
    with pytest.raises(DataError) as err:
        D.load_dataset(DataConfig(dataset="mnist", root=str(tmp_path), download=True), seed=0)
    message = str(err.value)
    assert "\n" not in message and "'mnist'" in message and "download" in message
    assert "Name or service not known" in message and str(tmp_path) in message
    assert socket.getdefaulttimeout() == before


def test_dataset_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLATBENCH_DATA", str(tmp_path))
    assert D.dataset_root("/somewhere") == Path("/somewhere")
    assert D.dataset_root(None) == tmp_path
    monkeypatch.delenv("FLATBENCH_DATA")
    assert D.dataset_root(None) == Path.home() / ".cache" / "flatbench"


def test_unknown_dataset() -> None:
    with pytest.raises(DataError, match="available"):
        D.load_raw("imagenet")


# ---------------------------------------------------------------- full datasets


@pytest.mark.full_data
def test_full_mnist() -> None:
    raw = mnist_full()
    assert raw.x_train.shape == (60000, 1, 28, 28) and raw.x_test.shape == (10000, 1, 28, 28)
    assert raw.x_train.dtype == torch.uint8
    assert torch.bincount(raw.y_train, minlength=10).tolist() == MNIST_TRAIN_COUNTS
    assert int(torch.bincount(raw.y_test, minlength=10).sum()) == 10000
    mean = float(raw.x_train.float().mean() / 255)
    assert abs(mean - D.DATASETS["mnist"].mean[0]) < 1e-3


@pytest.mark.full_data
def test_full_mnist_subset_and_labels() -> None:
    raw = mnist_full()
    root = os.environ.get("FLATBENCH_DATA") or str(SHARED_DATA)
    ds = D.load_dataset(DataConfig(dataset="mnist", root=root, download=False, n_train=5000,
                                   random_label_ratio=0.2), seed=0)
    assert ds.n_train == 5000 and ds.n_test == 10000
    assert torch.bincount(ds.y_train_clean, minlength=10).tolist() == [500] * 10
    assert ds.label_info["n_corrupted"] == 1000
    assert torch.equal(ds.y_test, raw.y_test), "n_test=None keeps the whole test set, in order"


@pytest.mark.full_data
def test_full_cifar10() -> None:
    raw = cifar_full()
    assert raw.x_train.shape == (50000, 3, 32, 32) and raw.x_test.shape == (10000, 3, 32, 32)
    assert torch.bincount(raw.y_train, minlength=10).tolist() == [5000] * 10
    assert torch.bincount(raw.y_test, minlength=10).tolist() == [1000] * 10
    means = (raw.x_train[:5000].float() / 255).mean(dim=(0, 2, 3))
    assert torch.allclose(means, torch.tensor(D.DATASETS["cifar10"].mean), atol=0.06)


def test_data_seed_decouples_the_draw_from_the_run_seed() -> None:
    """`data.seed` fixes the training subset, test subset and random labels; the run's seed then changes only
    the initialization and batch order. Without it the draw follows the run's seed (ids unchanged)."""
    from flatbench.config import RunConfig
    from flatbench.seeding import batch_generator, init_seed

    base = DataConfig(dataset="mnist_mini", n_train=200, n_test=100, random_label_ratio=0.5)
    runs = {(s, d): RunConfig(seed=s, data=DataConfig(**{**base.__dict__, "seed": d})) for s in (0, 1) for d in (0, 1)}
    loaded = {k: D.load_dataset(cfg.data, cfg.data_seed) for k, cfg in runs.items()}

    def same_draw(a: D.Dataset, b: D.Dataset) -> bool:
        return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("x_train", "y_train", "x_test", "y_test"))

    assert same_draw(loaded[0, 0], loaded[1, 0]) and same_draw(loaded[0, 1], loaded[1, 1])
    assert not torch.equal(loaded[0, 0].x_train, loaded[0, 1].x_train)
    assert not torch.equal(loaded[0, 0].y_train, loaded[0, 1].y_train)
    assert init_seed(runs[0, 0]) == init_seed(runs[0, 1]) != init_seed(runs[1, 0])
    assert torch.equal(torch.randperm(50, generator=batch_generator(runs[0, 0], 0)),
                       torch.randperm(50, generator=batch_generator(runs[0, 1], 0)))
    # the default: the draw is the run's seed, and the run id is the one it had before data.seed existed
    plain = RunConfig(seed=1, data=base)
    assert plain.data_seed == 1 and "data.seed" not in plain.identity()
    assert same_draw(D.load_dataset(plain.data, plain.data_seed), loaded[1, 1])
    assert runs[0, 1].run_id() != runs[0, 0].run_id() and "data.seed" in runs[0, 1].identity()

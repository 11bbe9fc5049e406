"""Build flatbench/assets/mnist_mini.npz: a fixed class-balanced subset of the real MNIST.

    python scripts/build_mnist_mini.py [--src /work/shared/data/MNIST] [--out flatbench/assets/mnist_mini.npz]

6,000 training images (600 per class) and 1,000 test images (100 per class), chosen with a fixed seed so
that the package ships a dataset that trains in seconds on a CPU (quickstart, tests) without any download.
Images are stored as uint8 28×28, labels as uint8, with np.savez_compressed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from flatbench.data import balanced_subset, read_idx
from flatbench.seeding import make_generator

N_TRAIN, N_TEST = 6000, 1000
SEED = 0
MAX_BYTES = 2 * 1024 * 1024
PROJECT = Path(__file__).resolve().parents[1]


def _find(src: Path, stem: str) -> Path:
    """`stem` or `stem.gz` in src/raw or src itself (torchvision's layout, or a flat folder)."""
    for folder in (src / "raw", src):
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    raise SystemExit(f"{stem}[.gz] not found in {src}/raw or {src}")


def build(src: Path, out: Path) -> dict[str, np.ndarray]:
    """Select the subsets and write them to `out`; returns the arrays written."""
    arrays: dict[str, np.ndarray] = {}
    for split, prefix, n in (("train", "train", N_TRAIN), ("test", "t10k", N_TEST)):
        x = read_idx(_find(src, f"{prefix}-images-idx3-ubyte"))
        y = read_idx(_find(src, f"{prefix}-labels-idx1-ubyte"))
        idx = balanced_subset(torch.from_numpy(y.astype(np.int64)), n, 10,
                              make_generator("mnist_mini", split, SEED)).numpy()
        arrays[f"x_{split}"] = np.ascontiguousarray(x[idx], dtype=np.uint8)
        arrays[f"y_{split}"] = np.ascontiguousarray(y[idx], dtype=np.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:  # a file object: savez would otherwise append .npz to odd names
        np.savez_compressed(f, **arrays)
    size = out.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{out} is {size} bytes, over the {MAX_BYTES}-byte budget")
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=PROJECT.parent / "shared" / "data" / "MNIST",
                        help="MNIST folder (with raw/ holding the four IDX files, .gz or not); "
                        "default ../shared/data/MNIST next to the project")
    parser.add_argument("--out", type=Path, default=PROJECT / "flatbench" / "assets" / "mnist_mini.npz")
    args = parser.parse_args()
    arrays = build(args.src, args.out)
    counts = {k: np.bincount(v, minlength=10).tolist() for k, v in arrays.items() if k.startswith("y_")}
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): "
          + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()) + f"; class counts {counts}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Training throughput (samples per second): the usual DataLoader loop against flatbench.

    python scripts/bench_train.py                       # CPU, and CUDA when available
    python scripts/bench_train.py --steps 20 --models mlp,lenet --devices cpu
    python scripts/bench_train.py --models mlp --mlp-widths 64,64 --devices cpu   # the hyperparameter study's MLP

For each model and device it times the same number of optimizer steps (Adam, batch 128) of
  - baseline: a plain PyTorch loop over torchvision's dataset and DataLoader (per-sample transforms,
    `shuffle=True`, `--workers` worker processes, `loss.item()` each step for the running loss), the
    loop most research code has;
  - flatbench sequential: `flatbench.training.train_epoch` (the dataset normalized once and resident on
    the device, batches are index slices, no per-step host sync);
  - flatbench vectorized G: `flatbench.training.VectorizedGroup`, G runs (different label ratios)
    trained at once; its samples/s counts the examples of all G runs.
Models: the MLP (784-512-512-10, or the hidden widths `--mlp-widths` gives) and LeNet-5 on MNIST, WRN-16-4 on CIFAR-10 with crop+flip augmentation
(sequential only: it has batch norm). An untimed warm-up pass of the same length comes first; then
`--repeats` timed passes, of which the fastest is reported (shared machines are noisy).

Data: MNIST from $FLATBENCH_DATA/MNIST/raw (or --data): torchvision's MNIST class needs decompressed
files, so the .gz files are decompressed into a temporary folder for the baseline. CIFAR-10 from
--cifar-root (default $FLATBENCH_CIFAR10_ROOT, else the data root): torchvision's CIFAR10 class checks
the official md5 sums and rejects a prepared copy, so the baseline uses a Dataset that does what
CIFAR10.__getitem__ does (a PIL image, then RandomCrop(32, 4), RandomHorizontalFlip, ToTensor,
Normalize) over the arrays flatbench reads. The output says which was used.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flatbench.config import DataConfig, ModelConfig, RunConfig, TrainConfig  # noqa: E402
from flatbench.data import DATASETS, dataset_root, load_dataset, load_raw  # noqa: E402
from flatbench.models import build_model  # noqa: E402
from flatbench.training import (StopFlag, VectorizedGroup, init_model, make_optimizer, new_member,  # noqa: E402
                                train_epoch, training_forward)

MODELS = {
    "mlp": ("mnist", ModelConfig(name="mlp", widths=(512, 512))),
    "lenet": ("mnist", ModelConfig(name="lenet")),
    "wrn": ("cifar10", ModelConfig(name="wrn", depth=16, width=4)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- baseline


class CifarLikeTorchvision(torch.utils.data.Dataset):
    """What torchvision.datasets.CIFAR10 does per sample, over arrays read by flatbench."""

    def __init__(self, x_uint8: torch.Tensor, y: torch.Tensor, transform):
        self.data = x_uint8.permute(0, 2, 3, 1).contiguous().numpy()  # HWC, as CIFAR10 stores it
        self.targets = y.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def baseline_dataset(dataset: str, mnist_raw: Path, cifar_root: Path, tmp: Path):
    from torchvision import datasets, transforms

    info = DATASETS[dataset]
    if dataset == "mnist":
        raw = tmp / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for f in mnist_raw.iterdir():
            if f.name.endswith(".gz"):
                with gzip.open(f, "rb") as src, open(raw / f.name[:-3], "wb") as dst:
                    shutil.copyfileobj(src, dst)
            elif not (raw / f.name).exists() and f.is_file():
                shutil.copy(f, raw / f.name)
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(info.mean, info.std)])
        return datasets.MNIST(str(tmp), train=True, download=False, transform=tf), \
            "torchvision.datasets.MNIST (decompressed copy)"
    raw = load_raw("cifar10", cifar_root)
    tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(info.mean, info.std)])
    return CifarLikeTorchvision(raw.x_train, raw.y_train, tf), \
        "CIFAR10-like Dataset (PIL + transforms) over flatbench's arrays: torchvision's CIFAR10 rejects the prepared copy"


def best_rate(samples: int, repeats: int, once, device: torch.device) -> float:
    """Samples per second of the fastest of `repeats` timed calls of once(i)."""
    best = 0.0
    for i in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        once(i)
        sync(device)
        best = max(best, samples / (time.perf_counter() - t0))
    return best


def bench_baseline(model_cfg: ModelConfig, dataset: str, device: torch.device, steps: int, bs: int,
                   workers: int, ds, repeats: int) -> float:
    info = DATASETS[dataset]
    torch.manual_seed(0)
    model = build_model(model_cfg, info.input_shape, info.num_classes).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers,
                                         pin_memory=device.type == "cuda", drop_last=True,
                                         persistent_workers=workers > 0)
    model.train()

    def run(n: int) -> None:
        running = 0.0
        done = 0
        while done < n:
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                running += loss.item()
                done += 1
                if done == n:
                    break

    run(steps)  # warm-up (worker start, allocator, kernels)
    return best_rate(steps * bs, repeats, lambda i: run(steps), device)


# ---------------------------------------------------------------- flatbench


def _run_cfg(model_cfg: ModelConfig, dataset: str, n: int, bs: int, ratio: float, args, vectorize="off") -> RunConfig:
    return RunConfig(seed=0, data=DataConfig(dataset=dataset, n_train=n, n_test=100, random_label_ratio=ratio,
                                             augment=dataset == "cifar10", download=False,
                                             root=str(args.cifar_root) if dataset == "cifar10" else None),
                     model=model_cfg,
                     train=TrainConfig(batch_size=bs, epochs=2, vectorize=vectorize, precision=args.precision,
                                       compile=args.compile))


def bench_sequential(model_cfg: ModelConfig, dataset: str, device: torch.device, steps: int, bs: int,
                     args) -> float:
    cfg = _run_cfg(model_cfg, dataset, steps * bs, bs, 0.5, args)
    ds = load_dataset(cfg.data, cfg.seed, device=device)
    model = init_model("bench", cfg, ds.input_shape, ds.num_classes, device)
    opt = make_optimizer(model, cfg)
    forward = training_forward(model, cfg, device)
    with StopFlag() as stop:
        train_epoch(model, opt, ds, cfg, "bench", 0, stop, forward)  # warm-up
        return best_rate(ds.n_train, args.repeats,
                         lambda i: train_epoch(model, opt, ds, cfg, "bench", 1 + i, stop, forward), device)


def bench_vectorized(model_cfg: ModelConfig, dataset: str, device: torch.device, steps: int, bs: int,
                     group: int, args) -> float:
    members = []
    for g in range(group):
        cfg = _run_cfg(model_cfg, dataset, steps * bs, bs, g / max(group - 1, 1), args, vectorize=group)
        members.append(new_member(f"bench-{g}", cfg, load_dataset(cfg.data, cfg.seed, device=device), device))
    vg = VectorizedGroup(members, device)
    vg.train_epoch(0)  # warm-up
    return best_rate(group * vg.n_train, args.repeats, lambda i: vg.train_epoch(1 + i), device)


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=None, help="comma-separated: cpu,cuda (default: cpu, plus cuda if available)")
    ap.add_argument("--models", default="mlp,lenet,wrn", help="comma-separated subset of mlp,lenet,wrn")
    ap.add_argument("--steps", type=int, default=100, help="timed optimizer steps for mlp and lenet")
    ap.add_argument("--wrn-steps", type=int, default=3, help="timed optimizer steps for wrn on the CPU")
    ap.add_argument("--wrn-steps-cuda", type=int, default=40, help="timed optimizer steps for wrn on CUDA")
    ap.add_argument("--mlp-widths", default="512,512", help="hidden widths of the MLP, comma-separated")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per measurement (the fastest counts)")
    ap.add_argument("--groups", default="8,16", help="vectorized group sizes")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes of the baseline")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="flatbench train.precision")
    ap.add_argument("--compile", action="store_true", help="flatbench train.compile")
    ap.add_argument("--data", default=None, help="data root holding MNIST/raw (default $FLATBENCH_DATA)")
    ap.add_argument("--cifar-root", default=None,
                    help="folder with cifar-10-batches-py (default $FLATBENCH_CIFAR10_ROOT, else the data root)")
    args = ap.parse_args()

    if args.data:
        os.environ["FLATBENCH_DATA"] = args.data
    root = dataset_root(None)
    args.cifar_root = Path(args.cifar_root or os.environ.get("FLATBENCH_CIFAR10_ROOT") or root)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    models = [m for m in args.models.split(",") if m]
    mlp_widths = tuple(int(w) for w in args.mlp_widths.split(",") if w)
    MODELS["mlp"] = ("mnist", ModelConfig(name="mlp", widths=mlp_widths))
    groups = [int(g) for g in args.groups.split(",") if g]
    bs = args.batch_size
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, batch {bs}, Adam, "
          f"flatbench precision {args.precision}{', compiled' if args.compile else ''}; best of {args.repeats}; "
          f"baseline DataLoader with {args.workers} workers")
    if "cuda" in devices:
        print(f"CUDA device: {torch.cuda.get_device_name(0)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_sets: dict[str, tuple] = {}
        for dev_name in devices:
            device = torch.device(dev_name)
            for name in models:
                dataset, model_cfg = MODELS[name]
                if name == "wrn":
                    steps = args.wrn_steps_cuda if device.type == "cuda" else args.wrn_steps
                else:
                    steps = args.steps
                if dataset not in base_sets:
                    base_sets[dataset] = baseline_dataset(dataset, root / "MNIST" / "raw", args.cifar_root,
                                                          Path(tmp))
                    print(f"baseline data for {dataset}: {base_sets[dataset][1]}")
                base = bench_baseline(model_cfg, dataset, device, steps, bs, args.workers, base_sets[dataset][0],
                                      args.repeats)
                rows.append((name, dev_name, "baseline: torchvision + DataLoader", base, base))
                print(f"  {name:5} {dev_name:4} baseline      {base:10.0f} samples/s", flush=True)
                seq = bench_sequential(model_cfg, dataset, device, steps, bs, args)
                rows.append((name, dev_name, "flatbench sequential", seq, base))
                print(f"  {name:5} {dev_name:4} sequential    {seq:10.0f} samples/s  ({seq / base:.1f}x)", flush=True)
                if name == "wrn":
                    continue
                for g in groups:
                    try:
                        vec = bench_vectorized(model_cfg, dataset, device, steps, bs, g, args)
                    except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of memory)
                        print(f"  {name:5} {dev_name:4} vectorized {g:2d} failed: {type(exc).__name__}: {exc}")
                        continue
                    rows.append((name, dev_name, f"flatbench vectorized, group of {g}", vec, base))
                    print(f"  {name:5} {dev_name:4} vectorized {g:2d} {vec:10.0f} samples/s  ({vec / base:.1f}x)",
                          flush=True)
    print()
    print("| model | device | method | samples/s | vs baseline |")
    print("| --- | --- | --- | ---: | ---: |")
    for name, dev, method, rate, base in rows:
        label = {"mlp": f"MLP {'-'.join(map(str, mlp_widths))}, MNIST", "lenet": "LeNet-5, MNIST",
                 "wrn": "WRN-16-4, CIFAR-10"}[name]
        print(f"| {label} | {dev} | {method} | {rate:,.0f} | {rate / base:.1f}× |")


if __name__ == "__main__":
    main()

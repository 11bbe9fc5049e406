"""Seconds per measure: every registered measure on MNIST, for the MLP 784-512-512-10 and LeNet-5.

    python scripts/bench_measures.py                    # 10,000 training examples (the full benchmark)
    python scripts/bench_measures.py --n 2000           # a quick run
    python scripts/bench_measures.py --measures eps_sharpness,relative_flatness --models mlp

Each model is briefly trained (`--train-steps` Adam steps, batch 128, lr 1e-3, float32) so that the
measures see a model off its initialization, then converted to the measure dtype and put in eval mode.
Every measure runs with its registry defaults on the whole measurement set (the first `--n` training
examples of a seeded class-balanced subset) with loss `ce`. By default each measure gets a fresh cache,
so its time includes the shared quantities it needs (e.g. the Hessian diagonal); with `--shared-cache`
the measures share one cache in registry order, as in a real `flatbench measure` run. The table gives
seconds and the value (or the status: not applicable / error) per model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.config import DataConfig, ModelConfig  # noqa: E402
from flatbench.data import load_dataset  # noqa: E402
from flatbench.measures import all_measures  # noqa: E402
from flatbench.measures.context import MeasureContext  # noqa: E402
from flatbench.measures.runner import compute_entry  # noqa: E402
from flatbench.models import build_model  # noqa: E402

MODELS = {"mlp": ModelConfig(name="mlp", widths=(512, 512)), "lenet": ModelConfig(name="lenet")}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10_000, help="training examples (= the measurement set)")
    p.add_argument("--models", default="mlp,lenet", help="comma-separated: mlp, lenet")
    p.add_argument("--measures", default="all", help="comma-separated registry names, or all")
    p.add_argument("--root", default="/work/shared/data", help="dataset root (MNIST idx files)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--train-steps", type=int, default=200, help="Adam steps before measuring (0: untrained)")
    p.add_argument("--chunk-size", type=int, default=2000)
    p.add_argument("--max-memory-mb", type=int, default=1024)
    p.add_argument("--shared-cache", action="store_true", help="share one cache between the measures")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def brief_training(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int) -> None:
    if steps <= 0:
        return
    gen = torch.Generator(device=x.device).manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=gen, device=x.device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    registry = all_measures()
    names = (list(registry) if args.measures == "all"
             else [n.strip() for n in args.measures.split(",") if n.strip()])
    unknown = [n for n in names if n not in registry]
    if unknown:
        sys.exit(f"unknown measure(s): {', '.join(unknown)}")
    data_cfg = DataConfig(dataset="mnist", root=args.root, n_train=args.n, n_test=1000, download=False)
    ds = load_dataset(data_cfg, seed=args.seed, device=device)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"device {device}, dtype {args.dtype}, n = {ds.n_train}, train steps {args.train_steps}, "
          f"{'shared' if args.shared_cache else 'fresh'} cache per measure", flush=True)

    results: dict[str, dict[str, dict]] = {name: {} for name in names}
    for model_name in models:
        cfg = MODELS[model_name]
        torch.manual_seed(args.seed)
        model = build_model(cfg, ds.input_shape, ds.num_classes).to(device)
        brief_training(model, ds.x_train, ds.y_train, args.train_steps, args.seed)
        model = model.to(dtype).eval()
        with torch.no_grad():
            acc = float((model(ds.x_train[:2000].to(dtype)).argmax(1) == ds.y_train[:2000]).double().mean())
        params = sum(p.numel() for p in model.parameters())
        print(f"\n{model_name}: {params:,} parameters, training accuracy {acc:.3f}", flush=True)
        base = MeasureContext(model=model, inputs=ds.x_train.to(dtype), targets=ds.y_train,
                              num_classes=ds.num_classes, run_id=f"bench-{model_name}", seed=args.seed,
                              chunk_size=args.chunk_size, max_memory_mb=args.max_memory_mb, model_config=cfg)
        for name in names:
            spec = registry[name]
            ctx = base if args.shared_cache else dataclasses.replace(base, cache={})
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            record = compute_entry(ctx, spec, dict(spec.defaults), None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            record["wall"] = time.perf_counter() - start
            results[name][model_name] = record
            shown = _shown(name, record)
            print(f"  {name:32s} {record['wall']:9.2f} s  {shown}", flush=True)

    print("\n| measure | cost | " + " | ".join(f"{m} s | {m} value" for m in models) + " |")
    print("| --- | --- | " + " | ".join("---: | ---" for _ in models) + " |")
    for name in names:
        cells = []
        for m in models:
            record = results[name].get(m)
            cells += [f"{record['wall']:.2f}", _shown(name, record)] if record else ["", ""]
        print(f"| `{name}` | {registry[name].cost} | " + " | ".join(cells) + " |")


def _shown(name: str, record: dict) -> str:
    if record["status"] == "ok":
        value = record["values"].get(name)
        if value is None:  # a measure whose headline key differs: show its first value
            value = next(iter(record["values"].values()), float("nan"))
        return f"{value:.4g}"
    text = record.get("reason") or record.get("error") or ""
    return f"{record['status']}: {text[:60]}"


if __name__ == "__main__":
    main()

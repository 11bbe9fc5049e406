"""The API's overhead: `flatbench.measure(model, data, ["hessian_trace"])` against the internal paths it
calls, on issue 29's case: a ReLU MLP 784-128-128-10, 256 images, float32, CPU.

* kernel: the exact Hessian diagonal (`HessianOperator.diagonal`), summed, on a model prepared once;
* stage: what `flatbench measure` runs per entry, `runner.compute_entry` (the measure, isolated by
  `isolation.guarded_call`) on a freshly prepared copy of the model (the stage loads each model afresh);
* API: `flatbench.measure`, which checks its arguments, measures the caller's model (in place here: built-in
  code only, already float32 on the CPU; `measures/in_place.py`) and builds the DataFrame;
* API+read: the same and the caller's `df.loc[df["key"] == "hessian_trace", "value"]`, pandas' cost of
  reading one value out of the DataFrame.

The three are timed interleaved (one of each per round, so that the load of a shared machine hits them
alike); the table gives the minimum and the median over `--repeats` rounds and the ratios.

    PYTHONPATH=. python scripts/api_overhead.py [--repeats 30] [--threads 1] [--n 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
from torch import nn


def case(seed: int = 0, n: int = 256) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    return model, torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))


def kernel(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The internal path: the exact diagonal of the model as the measure stage holds it (float32, eval)."""
    from flatbench.curvature import HessianOperator
    from flatbench.losses import get_loss

    diag = HessianOperator(model, x, y, get_loss("ce")).diagonal().diag
    return float(sum(float(d.double().sum()) for d in diag.values()))


def api(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    """`flatbench.measure` itself: the DataFrame it returns (reading the trace out of it, `value_of`, is the
    caller's pandas and is not timed: `df.loc[df.key == ..., "value"]` alone costs about 0.8 ms)."""
    import flatbench

    return flatbench.measure(model, (x, y), ["hessian_trace"], dtype=torch.float32)


def value_of(df: Any) -> float:
    return float(df.loc[df["key"] == "hessian_trace", "value"].iloc[0])


def stage(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The measure stage's path for one entry: a fresh float32 eval copy, a context, `compute_entry`."""
    from flatbench.measures.arguments import copy_model
    from flatbench.measures.context import MeasureContext
    from flatbench.measures.registry import get_measure
    from flatbench.measures.runner import compute_entry

    net = copy_model(model).to(torch.float32).eval()
    for p in net.parameters():
        p.requires_grad_(True)
    spec = get_measure("hessian_trace")
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=10)
    return float(compute_entry(ctx, spec, spec.settings({}), None)["values"]["hessian_trace"])


def interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float, float]]:
    """name -> (minimum s, median s, value) over `repeats` rounds of one call each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    values: dict[str, float] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            values[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {k: (min(v), statistics.median(v), values[k]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=256, help="images (issue 29's case: 256)")
    parser.add_argument("--profile", action="store_true", help="cProfile the API path (top 25 by cumulative time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, x, y = case(n=args.n)
    net = model.eval()
    for p in net.parameters():
        p.requires_grad_(True)
    fns = {"kernel": lambda: kernel(net, x, y), "stage": lambda: stage(model, x, y), "API": lambda: api(model, x, y),
           "API+read": lambda: value_of(api(model, x, y))}
    for fn in fns.values():  # warm-up: imports, the registry, first-call costs
        fn()
    out = interleaved(fns, args.repeats)
    print(f"MLP 784-128-128-10, {args.n} images, float32, {args.threads} thread(s), {args.repeats} interleaved rounds")
    print(f"  {'path':8s} {'min ms':>8s} {'median ms':>10s}  trace")
    for name, (low, med, value) in out.items():
        value = value_of(value) if name == "API" else value
        print(f"  {name:8s} {low * 1e3:8.1f} {med * 1e3:10.1f}  {value:.6g}")
    for path, ref in (("API", "kernel"), ("API", "stage"), ("API+read", "kernel")):
        print(f"  {path} / {ref}: {out[path][0] / out[ref][0]:.2f}x (min), {out[path][1] / out[ref][1]:.2f}x (median)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        api(model, x, y)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()

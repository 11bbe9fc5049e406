"""Speed of the curvature engine (`flatbench.curvature`) in full-data gradient-equivalents.

    python scripts/bench_curvature.py                      # MNIST, 10,000 examples, float32 (the benchmark)
    python scripts/bench_curvature.py --n 2000 --skip hutchinson,lanczos    # a quick run
    python scripts/bench_curvature.py --threads 1 --dtype float64

    # the exact diagonal against BackPACK (pip install -e .[bench]) on 2,000 MNIST inputs, with the FLOP
    # floor; --reference-engine times another copy of curvature.py in the same run (e.g. the last commit's)
    git show HEAD:flatbench/curvature.py > /tmp/curvature_head.py
    python scripts/bench_curvature.py --n 2000 --models mlp,lenet --only diagonal \
        --reference-engine /tmp/curvature_head.py [--dtype float64] [--dataset mnist_mini]

The unit is the time of one gradient of the mean loss over the whole measurement set (forward and
backward in chunks of `--chunk-size`, as every full-data pass of the engine does). Every timing is the
minimum over `--repeats` runs (the fairest statistic on a shared machine), except the long Hutchinson and
Lanczos runs, which are timed once. Models: the MLP 784-512-512-10 and LeNet-5 of `flatbench.models`,
briefly trained (`--train-steps` Adam steps) so that the softmax is off its initialization, in eval mode;
loss `ce`; a 784-20-20-10 MLP for the naive per-parameter diagonal (one double-backward Hessian-vector
product per parameter, timed on `--naive-params` evenly spaced parameters and extrapolated to all of them).

BackPACK's `DiagGGNExact` (the field's library for this diagonal; for these piecewise-linear nets the
GGN diagonal is the Hessian diagonal) runs on a deep copy of the model extended by `backpack.extend`, with
`CrossEntropyLoss(reduction="mean")` on the same chunks (each chunk's diagonal weighted by its share), and
is checked against flatbench's exact diagonal in the same run. The FLOP floor of the exact diagonal is
counted from the layer shapes (multiply-adds × 2 of the matmuls and convolutions: the forward, the K = C − 1
factor backprops down to the first layer's output, and the per-example products: one weight-sized product
per Linear for all factors, K per-example weight gradients per Conv2d), divided by the gradient's count
(forward, weight gradients, input gradients above the first layer); what the code executes is counted by
`torch.utils.flop_counter.FlopCounterMode`.

Peak memory of the exact diagonal is measured in a child process (fresh allocator, glibc's mmap
threshold fixed so freed blocks go back to the system): the growth of the peak resident set size over the
resident size just before the call (/proc/self/clear_refs resets the peak).

Extending: a function decorated with `@bench("name", models=(...))` takes the `Setup` of one model and
returns `Row`s; it can reuse what earlier benches left in `setup.cache` (e.g. `setup.cache["diagonal"]`,
the exact `DiagonalResult`) and `setup.unit` (seconds per gradient). Benches run in definition order.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.config import DataConfig, ModelConfig  # noqa: E402
from flatbench.curvature import HessianOperator, hessian_diagonal, hvp  # noqa: E402
from flatbench.losses import LogitLoss, get_loss  # noqa: E402

MODELS = {"mlp": ModelConfig(name="mlp", widths=(512, 512)), "lenet": ModelConfig(name="lenet"),
          "mlp20": ModelConfig(name="mlp", widths=(20, 20))}
LABELS = {"mlp": "MLP 784-512-512-10", "lenet": "LeNet-5", "mlp20": "MLP 784-20-20-10"}


# ---------------------------------------------------------------- framework


@dataclass
class Setup:
    """One model with its measurement set and the gradient unit; `cache` is shared between benches."""

    key: str
    model: nn.Module
    x: Tensor
    y: Tensor
    loss: LogitLoss
    args: argparse.Namespace
    unit: float = float("nan")
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


@dataclass
class Row:
    model: str
    item: str
    seconds: float | None
    grad_equiv: float | None
    note: str = ""


BenchFn = Callable[[Setup], list[Row]]
BENCHES: list[tuple[str, tuple[str, ...], BenchFn]] = []


def bench(name: str, models: tuple[str, ...] = ("mlp", "lenet")) -> Callable[[BenchFn], BenchFn]:
    """Register a benchmark section for the given model keys (run in definition order)."""
    def decorate(fn: BenchFn) -> BenchFn:
        BENCHES.append((name, models, fn))
        return fn
    return decorate


CLOCK: Callable[[], float] = time.perf_counter
"""Wall-clock by default; `--clock process` uses this process's CPU time (with --threads 1, a measure of
the work done that other jobs on a shared machine disturb much less)."""


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any]:
    """(minimum seconds over `repeats` calls, the last result)."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        start = CLOCK()
        out = fn()
        best = min(best, CLOCK() - start)
    return best, out


def row(setup: Setup, item: str, seconds: float | None, note: str = "") -> Row:
    equiv = None if seconds is None else seconds / setup.unit
    return Row(LABELS[setup.key], item, seconds, equiv, note)


def full_gradient(setup: Setup) -> None:
    """The unit: ∇L over the whole set, chunked like the engine's passes."""
    model, n, cs = setup.model, setup.x.shape[0], setup.args.chunk_size
    model.zero_grad(set_to_none=True)
    for i in range(0, n, cs):
        xb, yb = setup.x[i:i + cs], setup.y[i:i + cs]
        (setup.loss(model(xb), yb) * (xb.shape[0] / n)).backward()


def double_backward_hvp(setup: Setup, v: list[Tensor]) -> list[Tensor]:
    """PyHessian's Hessian-vector product (the baseline): backward with create_graph, then
    autograd.grad of the gradient with grad_outputs=v, per chunk."""
    model, n, cs = setup.model, setup.x.shape[0], setup.args.chunk_size
    params = list(model.parameters())
    out = [torch.zeros_like(p) for p in params]
    for i in range(0, n, cs):
        xb, yb = setup.x[i:i + cs], setup.y[i:i + cs]
        grads = torch.autograd.grad(setup.loss(model(xb), yb) * (xb.shape[0] / n), params, create_graph=True)
        for o, h in zip(out, torch.autograd.grad(grads, params, grad_outputs=v)):
            o += h
    return out


# ---------------------------------------------------------------- benches


@bench("gradient", models=("mlp", "lenet", "mlp20"))
def bench_gradient(setup: Setup) -> list[Row]:
    full_gradient(setup)  # warm-up
    setup.unit, _ = timed(lambda: full_gradient(setup), setup.args.repeats)
    return [row(setup, "full-data gradient (the unit)", setup.unit, f"{setup.params:,} parameters")]


@bench("exact_diagonal", models=("mlp", "lenet", "mlp20"))
def bench_exact_diagonal(setup: Setup) -> list[Row]:
    a = setup.args
    seconds, result = timed(lambda: hessian_diagonal(setup.model, setup.x, setup.y, setup.loss,
                                                     max_memory_mb=a.max_memory_mb, chunk_size=a.chunk_size),
                            a.repeats)
    setup.cache["diagonal"] = result
    setup.cache["diagonal_seconds"] = seconds
    target = "; target ≤ 15" if setup.key == "mlp" else ""
    return [row(setup, "exact Hessian diagonal (+ trace)", seconds,
                f"method={result.method}, Tr H={result.trace():.6g}{target}")]


def _flat_diag(diag: dict[str, Tensor], model: nn.Module) -> Tensor:
    return torch.cat([diag[k].reshape(-1).double() for k, _ in model.named_parameters()])


def _differences(ours: Tensor, ref: Tensor) -> str:
    """Max |Δ| over max |ref|, and max per-element |Δ| / max(|ref_k|, 1e-6·max |ref|)."""
    scale = float(ref.abs().max())
    delta = (ours - ref).abs()
    per_element = float((delta / ref.abs().clamp_min(1e-6 * scale)).max())
    return f"max |Δ|/max|diag| {float(delta.max()) / scale:.1e}, per element {per_element:.1e}"


def _load_engine(path: str) -> Any:
    """Another copy of flatbench/curvature.py (e.g. `git show HEAD:flatbench/curvature.py > FILE`)."""
    name = "flatbench._reference_curvature"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--reference-engine: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@bench("reference_engine", models=("mlp", "lenet", "mlp20"))
def bench_reference_engine(setup: Setup) -> list[Row]:
    """The exact diagonal of another copy of curvature.py (`--reference-engine`), in the same run."""
    a = setup.args
    if not a.reference_engine:
        return []
    engine = _load_engine(a.reference_engine)

    def run() -> Any:
        return engine.hessian_diagonal(setup.model, setup.x, setup.y, setup.loss,
                                       max_memory_mb=a.max_memory_mb, chunk_size=a.chunk_size)

    run()  # warm-up
    seconds, result = timed(run, a.repeats)
    ours = _flat_diag(setup.cache["diagonal"].diag, setup.model)
    return [row(setup, f"exact diagonal, {Path(a.reference_engine).name}", seconds,
                f"current engine {seconds / setup.cache['diagonal_seconds']:.2f}x its speed; "
                f"{_differences(ours, _flat_diag(result.diag, setup.model))}")]


@bench("backpack", models=("mlp", "lenet"))
def bench_backpack(setup: Setup) -> list[Row]:
    """BackPACK's DiagGGNExact on the same inputs and chunks, and its agreement with the exact diagonal."""
    item = "BackPACK DiagGGNExact"
    try:
        from backpack import backpack, extend
        from backpack.extensions import DiagGGNExact
    except ImportError:
        return [row(setup, item, None, "not installed (pip install -e .[bench])")]
    model = extend(copy.deepcopy(setup.model))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="mean"))
    params = list(model.named_parameters())
    n, cs = setup.x.shape[0], setup.args.chunk_size

    def run() -> dict[str, Tensor]:
        out = {name: torch.zeros_like(p) for name, p in params}
        for i in range(0, n, cs):
            xb, yb = setup.x[i:i + cs], setup.y[i:i + cs]
            model.zero_grad(set_to_none=True)
            with backpack(DiagGGNExact()):
                lossfunc(model(xb), yb).backward()
            for name, p in params:
                out[name] += p.diag_ggn_exact * (xb.shape[0] / n)  # type: ignore[attr-defined]
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Full backward hook is firing when gradients are computed ..."
        run()  # warm-up
        seconds, out = timed(run, setup.args.repeats)
    ours = _flat_diag(setup.cache["diagonal"].diag, setup.model)
    theirs = _flat_diag(out, model)
    ours_s = setup.cache["diagonal_seconds"]
    setup.cache["backpack_seconds"] = seconds
    return [row(setup, item, seconds, f"flatbench's exact diagonal is {seconds / ours_s:.2f}x its speed; "
                f"{_differences(ours, theirs)}")]


def analytic_flops(model: nn.Module, x: Tensor, num_factors: int) -> dict[str, float]:
    """FLOPs (2 × multiply-adds of matmuls and convolutions) over the whole set, from the layer shapes."""
    layers: list[tuple[int, bool, bool]] = []  # (MACs per example, input requires grad, per-example product)

    def hook(m: nn.Module, args: tuple, out: Tensor) -> None:
        a = args[0]
        if isinstance(m, nn.Linear):
            layers.append((out[0].numel() * m.in_features, a.requires_grad, a.dim() > 2))
        elif isinstance(m, nn.Conv2d):
            macs = out[0].numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            layers.append((macs, a.requires_grad, True))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.Conv2d))]
    try:
        with torch.enable_grad():
            model(x[:1])
    finally:
        for h in handles:
            h.remove()
    n = 2 * int(x.shape[0])
    forward = n * sum(m for m, _, _ in layers)
    input_grads = n * sum(m for m, needed, _ in layers if needed)
    products = n * sum(num_factors * m if per_example else m for m, _, per_example in layers)
    return {"forward": forward, "backprops": num_factors * input_grads, "products": products,
            "diagonal": forward + num_factors * input_grads + products,
            "gradient": 2 * forward + input_grads}


def executed_flops(fn: Callable[[], Any]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


@bench("flop_floor", models=("mlp", "lenet", "mlp20"))
def bench_flop_floor(setup: Setup) -> list[Row]:
    a = setup.args
    num_factors = int(setup.model(setup.x[:1]).shape[-1]) - 1
    f = analytic_flops(setup.model, setup.x, num_factors)
    floor = f["diagonal"] / f["gradient"]
    ran = executed_flops(lambda: hessian_diagonal(setup.model, setup.x, setup.y, setup.loss,
                                                  max_memory_mb=a.max_memory_mb, chunk_size=a.chunk_size))
    grad_ran = executed_flops(lambda: full_gradient(setup))
    g = {k: v / 1e9 for k, v in f.items()}
    rows = [row(setup, "exact diagonal FLOP floor", floor * setup.unit,
                f"{g['diagonal']:.2f} GFLOP = forward {g['forward']:.2f} + {num_factors} factor backprops "
                f"{g['backprops']:.2f} + products {g['products']:.2f}, over the gradient's "
                f"{g['gradient']:.2f}; the code executes {ran / 1e9:.2f} (gradient {grad_ran / 1e9:.2f}); seconds at the "
                f"gradient's FLOP rate")]
    seconds = setup.cache.get("diagonal_seconds")
    if seconds:
        rows.append(row(setup, "exact diagonal FLOP rate", None,
                        f"{ran / seconds / 1e9:.0f} GFLOP/s, the gradient "
                        f"{grad_ran / setup.unit / 1e9:.0f} GFLOP/s"))
    return rows


@bench("hvp")
def bench_hvp(setup: Setup) -> list[Row]:
    a = setup.args
    gen = torch.Generator().manual_seed(0)
    params = dict(setup.model.named_parameters())
    v = {k: torch.randn(p.shape, generator=gen).to(p) for k, p in params.items()}
    times: dict[str, float] = {}
    results: dict[str, list[Tensor]] = {}
    for mode in ("rev_fwd", "fwd_rev"):
        hvp(setup.model, setup.x[:a.chunk_size], setup.y[:a.chunk_size], setup.loss, v,
            chunk_size=a.chunk_size, mode=mode)  # warm-up
        times[mode], out = timed(lambda: hvp(setup.model, setup.x, setup.y, setup.loss, v,
                                             chunk_size=a.chunk_size, mode=mode), a.repeats)
        results[mode] = list(out.values())
    times["db"], results["db"] = timed(lambda: double_backward_hvp(setup, list(v.values())), a.repeats)
    ref = torch.cat([t.reshape(-1) for t in results["db"]]).double()
    err = {m: float((torch.cat([t.reshape(-1) for t in r]).double() - ref).norm() / ref.norm())
           for m, r in results.items()}
    def note(mode: str) -> str:
        return f"{times['db'] / times[mode]:.2f}x the speed of double backward; rel diff {err[mode]:.1e}"

    return [row(setup, "HVP, torch.func grad(jvp) [default]", times["rev_fwd"], note("rev_fwd")),
            row(setup, "HVP, torch.func jvp(grad)", times["fwd_rev"], note("fwd_rev")),
            row(setup, "HVP, double backward (PyHessian)", times["db"], "baseline")]


@bench("naive_diagonal", models=("mlp20",))
def bench_naive_diagonal(setup: Setup) -> list[Row]:
    """One double-backward HVP with a basis vector e_k per parameter: the forward and the first backward
    (with create_graph) are shared, each column costs one backward through the double graph."""
    a = setup.args
    model, n, cs = setup.model, setup.x.shape[0], a.chunk_size
    params = list(model.parameters())
    total = setup.params
    picks = torch.linspace(0, total - 1, min(a.naive_params, total)).long().tolist()

    def naive() -> list[float]:
        values = [0.0] * len(picks)
        for i in range(0, n, cs):
            xb, yb = setup.x[i:i + cs], setup.y[i:i + cs]
            chunk_loss = setup.loss(model(xb), yb) * (xb.shape[0] / n)
            grads = torch.autograd.grad(chunk_loss, params, create_graph=True)
            flat = torch.cat([g.reshape(-1) for g in grads])
            for j, k in enumerate(picks):
                col = torch.autograd.grad(flat[k], params, retain_graph=True, allow_unused=True,
                                          materialize_grads=True)
                values[j] += float(torch.cat([c.reshape(-1) for c in col])[k])
        return values

    seconds, values = timed(naive, 1)
    extrapolated = seconds * total / len(picks)
    ours = torch.cat([d.reshape(-1) for d in setup.cache["diagonal"].diag.values()])
    picked = ours[picks]
    rel = float((torch.tensor(values, dtype=torch.float64) - picked).abs().max() / picked.abs().max())
    ours_s = setup.cache["diagonal_seconds"]
    return [row(setup, f"naive per-parameter diagonal ({len(picks)} of {total:,} params)", seconds,
                f"agrees with exact to {rel:.1e}"),
            row(setup, "naive per-parameter diagonal, extrapolated", extrapolated,
                f"{extrapolated / ours_s:,.0f}x slower than exact ({ours_s:.3f} s)")]


@bench("hutchinson")
def bench_hutchinson(setup: Setup) -> list[Row]:
    a = setup.args
    exact = setup.cache["diagonal"].trace()
    rows = []
    for probes in (10, 100):
        gen = torch.Generator().manual_seed(1)
        hessian = HessianOperator(setup.model, setup.x, setup.y, setup.loss, chunk_size=a.chunk_size)
        seconds, out = timed(lambda: hessian.trace(probes=probes, generator=gen), 1)
        rows.append(row(setup, f"Hutchinson trace, {probes} probes", seconds,
                        f"rel error {abs(out['mean'] - exact) / abs(exact):.2%} "
                        f"(stderr {out['stderr'] / abs(exact):.2%})"))
    return rows


@bench("lanczos")
def bench_lanczos(setup: Setup) -> list[Row]:
    a = setup.args
    gen = torch.Generator().manual_seed(2)
    hessian = HessianOperator(setup.model, setup.x, setup.y, setup.loss, chunk_size=a.chunk_size)
    seconds, out = timed(lambda: hessian.top_eigenvalues(k=1, iters=a.lanczos_iters, tol=a.lanczos_tol,
                                                         generator=gen), 1)
    return [row(setup, f"Lanczos λ_max (tol {a.lanczos_tol:g})", seconds,
                f"λ_max={out['eigenvalues'][0]:.6g}, {out['iterations']} iterations, "
                f"residual {out['residuals'][0]:.1e}")]


@bench("memory", models=("lenet", "mlp"))
def bench_memory(setup: Setup) -> list[Row]:
    a = setup.args
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.pt"
        torch.save({"key": setup.key, "state": setup.model.state_dict(), "x": setup.x, "y": setup.y,
                    "chunk_size": a.chunk_size, "max_memory_mb": a.max_memory_mb}, path)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
               "OMP_NUM_THREADS": str(torch.get_num_threads())}
        proc = subprocess.run([sys.executable, __file__, "--memory-child", str(path)], env=env,
                              capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return [row(setup, "exact diagonal peak memory", None, f"child failed: {proc.stderr.strip()[-200:]}")]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return [row(setup, "exact diagonal peak memory", None,
                f"+{res['delta_mb']:.0f} MB over {res['base_mb']:.0f} MB resident ({res['how']}); "
                f"budget {a.max_memory_mb} MB")]


# ---------------------------------------------------------------- solvers of the three papers' measures
# (flatbench.measures.builtin.normalized / minimum_sharpness): the cost on top of the exact diagonal they reuse.


@bench("paper_solvers", models=("mlp", "lenet"))
def bench_paper_solvers(setup: Setup) -> list[Row]:
    from flatbench.measures.layers import weight_layers
    from flatbench.measures.builtin.minimum_sharpness import solve_minimum_sharpness
    from flatbench.measures.builtin.normalized import reduce_layer, solve_normalized_sharpness

    a = setup.args
    diag = setup.cache.get("diagonal")
    if diag is None:
        diag = hessian_diagonal(setup.model, setup.x, setup.y, setup.loss, max_memory_mb=a.max_memory_mb,
                                chunk_size=a.chunk_size)
    layers = weight_layers(setup.model, setup.x[:1])
    problems = [reduce_layer(diag.diag[f"{l.name}.weight"].clamp_min(0), l.module.weight) for l in layers]

    def normalized() -> list[Any]:
        return [solve_normalized_sharpness(h, q) for h, q in problems]

    ns_seconds, results = timed(normalized, a.repeats)
    shapes = ", ".join("×".join(str(d) for d in h.shape) for h, _ in problems)
    rows = [row(setup, "normalized sharpness solver, all layers", ns_seconds,
                f"NS={sum(r.value for r in results):.6g}; layers {shapes}; iterations "
                f"{max(r.iterations for r in results)} max; final rel change "
                f"{max(r.rel_change for r in results):.0e}; dead units "
                f"{sum(r.dead_rows + r.dead_cols for r in results)}")]
    tw = [float(diag.diag[f"{l.name}.weight"].sum()) for l in layers]
    tb = [float(diag.diag[f"{l.name}.bias"].sum()) if f"{l.name}.bias" in diag.diag else 0.0 for l in layers]
    ms_seconds, ms = timed(lambda: solve_minimum_sharpness(tw, tb), a.repeats)
    rows.append(row(setup, "minimum sharpness solver (Newton in log α)", ms_seconds,
                    f"MinSharp={ms.value:.6g} (Tr H={sum(tw) + sum(tb):.6g}); {ms.iterations} Newton steps, "
                    f"decrement {ms.decrement:.0e}"))
    diag_seconds = setup.cache.get("diagonal_seconds")
    if diag_seconds is not None:
        rows.append(row(setup, "normalized sharpness total (diagonal + solver)", diag_seconds + ns_seconds,
                        f"the solver is {ns_seconds / diag_seconds:.1%} of the diagonal"))
    return rows


# ---------------------------------------------------------------- memory child


def _rss_mb(field_name: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def memory_child(path: str) -> None:
    import gc
    import resource

    from flatbench.models import build_model

    blob = torch.load(path, weights_only=False)
    model = build_model(MODELS[blob["key"]], (1, 28, 28), 10)
    model.load_state_dict(blob["state"])
    model = model.to(blob["x"].dtype).eval()
    x, y, loss = blob["x"], blob["y"], get_loss("ce")
    hessian_diagonal(model, x[:8], y[:8], loss)  # import and first-call costs outside the measurement
    gc.collect()
    base = _rss_mb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        how = "VmHWM after clear_refs"
        before_peak = None
    except OSError:
        how = "ru_maxrss, an upper bound"
        before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hessian_diagonal(model, x, y, loss, max_memory_mb=blob["max_memory_mb"], chunk_size=blob["chunk_size"])
    if before_peak is None:
        peak = _rss_mb("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"base_mb": base, "peak_mb": peak, "delta_mb": peak - base, "how": how}))


# ---------------------------------------------------------------- main


def brief_training(model: nn.Module, x: Tensor, y: Tensor, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    model.eval()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10_000, help="training examples (= the measurement set)")
    p.add_argument("--models", default="mlp,lenet,mlp20", help="comma-separated: mlp, lenet, mlp20")
    p.add_argument("--skip", default="", help="comma-separated bench names to skip: "
                   + ", ".join(name for name, _, _ in BENCHES))
    p.add_argument("--only", default="", help="comma-separated bench names to run (the others are skipped); "
                   "'diagonal' stands for gradient,exact_diagonal,reference_engine,backpack,flop_floor")
    p.add_argument("--dataset", default="mnist", choices=("mnist", "mnist_mini"),
                   help="mnist (idx files under --root) or the packaged 6,000-example subset mnist_mini")
    p.add_argument("--root", default=os.environ.get("FLATBENCH_DATA", "/work/shared/data"),
                   help="dataset root (MNIST idx files); default $FLATBENCH_DATA")
    p.add_argument("--reference-engine", default="", metavar="PATH",
                   help="another copy of flatbench/curvature.py, its exact diagonal timed in the same run")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=3, help="timings are the minimum over this many runs")
    p.add_argument("--clock", default="wall", choices=("wall", "process"),
                   help="wall: elapsed time; process: CPU time of this process (use with --threads 1)")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--chunk-size", type=int, default=2000)
    p.add_argument("--max-memory-mb", type=int, default=1024)
    p.add_argument("--naive-params", type=int, default=200, help="parameters timed for the naive diagonal")
    p.add_argument("--lanczos-iters", type=int, default=60)
    p.add_argument("--lanczos-tol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    return p.parse_args()


def print_table(rows: list[Row]) -> None:
    headers = ("model", "quantity", "seconds", "grad-equiv", "note")
    cells = [(r.model, r.item, "" if r.seconds is None else f"{r.seconds:.3f}",
              "" if r.grad_equiv is None else f"{r.grad_equiv:.2f}", r.note) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(c, widths)) + " |")


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "process":
        global CLOCK
        CLOCK = time.process_time
    from flatbench.data import load_dataset
    from flatbench.models import build_model

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    data_cfg = DataConfig(dataset=args.dataset, root=args.root, n_train=args.n, n_test=1000, download=False)
    ds = load_dataset(data_cfg, seed=args.seed)
    x, y = ds.x_train, ds.y_train
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if "diagonal" in only:
        only |= {"gradient", "exact_diagonal", "reference_engine", "backpack", "flop_floor"}
    if only:
        skip |= {name for name, _, _ in BENCHES if name not in only}
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    print(f"# bench_curvature: {args.dataset}, n={x.shape[0]:,}, dtype={args.dtype}, "
          f"chunk={args.chunk_size}, "
          f"max_memory_mb={args.max_memory_mb}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"cpu, load average {os.getloadavg()[0]:.1f}; times ({args.clock} clock): min of {args.repeats} "
          f"(Hutchinson, Lanczos, naive: one run)", flush=True)
    rows: list[Row] = []
    for key in keys:
        torch.manual_seed(args.seed)
        model = build_model(MODELS[key], (1, 28, 28), 10)
        brief_training(model, x, y, args.train_steps, args.seed)
        setup = Setup(key, model.to(dtype).eval(), x.to(dtype), y, get_loss("ce"), args)
        for name, models, fn in BENCHES:
            if key in models and name not in skip:
                start = time.perf_counter()
                new = fn(setup)
                rows.extend(new)
                print(f"#   {LABELS[key]}: {name} done in {time.perf_counter() - start:.1f} s", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    print()
    print_table(rows)


if __name__ == "__main__":
    main()

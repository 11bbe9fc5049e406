"""flatbench beside BackPACK, curvlinops and PyHessian, in one process: the Hessian trace, the top eigenvalue
and the spectral density of the cross-entropy loss, on a ReLU MLP, a Tanh MLP, torchvision's ResNet-18
(32×32 inputs, a few images), a small ViT (patch embedding, MultiheadAttention, LayerNorm, GELU) and a
pre-LayerNorm transformer on integer tokens.

Every library gets the same model (float32, eval mode), the same data and, for the iterative methods, the
same budget of Hessian-vector products (`--hvps`: Hutch++ / Hutchinson probes for the trace, Lanczos steps
for the eigenvalue and the density). flatbench's trace is exact where it can be (a piecewise-linear network,
a smooth Sequential chain), else Hutch++ within the budget; BackPACK's is its exact `DiagHessian` summed
(Sequential models with supported layers only); curvlinops' is `hutchpp_trace` (its budget rounded to a multiple of 3, as it requires); PyHessian's is its
Hutchinson `trace`. The top eigenvalue is flatbench's Lanczos, curvlinops' operator with scipy's `eigsh`,
PyHessian's power iteration; the density is flatbench's `hessian_density`, curvlinops'
`lanczos_approximate_spectrum` (its first moment is printed: the mean eigenvalue) and PyHessian's `density`.

The `ratio` column is each library's time over flatbench's on the same row (the baseline, measured in this
process right before; flatbench's estimates that its budget stopped before their tolerance are marked
"(not converged)", their status; every library is warmed up first on a tiny MLP, so no import or first-call cost is
timed); `value` is the quantity itself (the density's is the mean eigenvalue Tr H / d, or
for PyHessian the mean of its quadrature nodes weighted). A library that is not installed is printed as
"not installed"; one that cannot handle a model, with the first words of its error. Every library runs with
attention in its plain (math) form, as flatbench does by itself: the fused attention kernels have no double
backward.

    PYTHONPATH=. python scripts/bench_api.py [--hvps 20] [--threads 1] [--models relu_mlp,...,transformer]

The `exact` rows are the dense Hessian's values in float64 (reverse over reverse), for the models of at
most 3,000 parameters: the pre-LayerNorm transformer on integer tokens (`TinyTransformer`, issue 41's case,
where reverse-over-forward Hessian-vector products are wrong in torch 2.14.1) among them.

The peers are optional (`pip install flatbench[bench]`); nothing in flatbench needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import flatbench

PEERS = {"backpack": "backpack", "curvlinops": "curvlinops", "pyhessian": "pyhessian"}


class TinyViT(nn.Module):
    """Patch embedding with a learned positional embedding, one pre-norm transformer block
    (nn.MultiheadAttention, a GELU MLP), mean pooling."""

    def __init__(self, dim: int = 16, classes: int = 10, patches: int = 16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.pos = nn.Parameter(0.02 * torch.randn(1, patches, dim))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        h = self.norm1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.norm2(t))
        return self.head(t.mean(dim=1))


class TinyTransformer(nn.Module):
    """The issue-41 case: integer tokens, an embedding with learned positions, one pre-LayerNorm block
    (nn.MultiheadAttention, a GELU MLP), a final LayerNorm, mean pooling: small enough (930 parameters) for the
    dense Hessian, so the `exact` rows say which library is right."""

    def __init__(self, vocab: int = 20, dim: int = 8, tokens: int = 8, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(1, tokens, dim))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.embed(tokens) + self.pos
        h = self.norm1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.norm2(t))
        return self.head(self.norm3(t).mean(dim=1))


def exact_runs(hvps: int) -> dict[str, Callable]:
    """The dense Hessian in float64 (reverse over reverse, `flatbench.verification.reference_hessian`):
    the true trace, top eigenvalue and mean eigenvalue, for models small enough (`EXACT_MAX_PARAMS`)."""
    def dense(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from flatbench.losses import get_loss
        from flatbench.verification import reference_hessian

        if sum(p.numel() for p in m.parameters()) > EXACT_MAX_PARAMS:
            raise RuntimeError(f"more than {EXACT_MAX_PARAMS} parameters")
        net = m.double()
        return reference_hessian(net, x.double() if x.is_floating_point() else x, y, get_loss("ce"))

    return {"trace": lambda m, x, y: float(torch.trace(dense(m, x, y))),
            "top eigenvalue": lambda m, x, y: float(torch.linalg.eigvalsh(dense(m, x, y))[-1]),
            "density": lambda m, x, y: float(torch.trace(dense(m, x, y))) / sum(p.numel() for p in m.parameters())}


EXACT_MAX_PARAMS = 3000


def make(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, inputs, targets) of a benchmark case, seeded."""
    torch.manual_seed(0)
    if name in ("relu_mlp", "tanh_mlp"):
        act = nn.ReLU if name == "relu_mlp" else nn.Tanh
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), act(), nn.Linear(128, 128), act(),
                              nn.Linear(128, 10))
        x = torch.rand(256, 1, 28, 28)
    elif name == "resnet18":
        from torchvision.models import resnet18

        model, x = resnet18(num_classes=10), torch.randn(4, 3, 32, 32)
    elif name == "vit":
        model, x = TinyViT(), torch.randn(16, 3, 32, 32)
    elif name == "transformer":
        model, x = TinyTransformer(), torch.randint(0, 20, (64, 8))
    else:
        raise SystemExit(f"unknown model {name!r} (relu_mlp, tanh_mlp, resnet18, vit, transformer)")
    y = torch.arange(x.shape[0]) % 10
    return model.float().eval(), x, y


def _flatbench_value(df: Any, measure: str) -> float | tuple[float, str]:
    row = df[df["key"] == measure].iloc[0]
    if row["status"] == "ok":
        return float(row["value"])
    info = df.attrs["info"].get(measure, {})
    if "values" in info:  # not_converged: the estimate it stopped at, marked as such
        return float(info["values"][measure]), "not converged"
    raise RuntimeError(f"{row['status']}: {row['reason']}")


def flatbench_runs(hvps: int) -> dict[str, Callable]:
    def trace(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        df = flatbench.measure(m, (x, y), ["hessian_trace"], dtype=torch.float32,
                               settings={"hessian_trace": {"max_hvps": hvps, "sketch": max(1, hvps // 4)}})
        return _flatbench_value(df, "hessian_trace")

    def eig(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        df = flatbench.measure(m, (x, y), ["hessian_max_eig"], dtype=torch.float32,
                               settings={"hessian_max_eig": {"iters": hvps, "tol": 1e-3}})
        return _flatbench_value(df, "hessian_max_eig")

    def density(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        df = flatbench.measure(m, (x, y), ["hessian_density"], dtype=torch.float32,
                               settings={"hessian_density": {"runs": 1, "iters": hvps}})
        return _flatbench_value(df, "hessian_density")

    return {"trace": trace, "top eigenvalue": eig, "density": density}


def backpack_runs(hvps: int) -> dict[str, Callable]:
    def trace(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        from backpack import backpack, extend
        from backpack.extensions import DiagHessian

        if not isinstance(m, nn.Sequential):
            raise RuntimeError("DiagHessian needs an nn.Sequential of supported layers")
        model, lossfunc = extend(m), extend(nn.CrossEntropyLoss())
        loss = lossfunc(model(x), y)
        with backpack(DiagHessian()):
            loss.backward()
        return float(sum(float(p.diag_h.sum()) for p in model.parameters()))

    return {"trace": trace}


def curvlinops_runs(hvps: int) -> dict[str, Callable]:
    def operator(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        from curvlinops import HessianLinearOperator

        params = [p for p in m.parameters() if p.requires_grad]
        return HessianLinearOperator(m, nn.CrossEntropyLoss(), params, [(x, y)], check_deterministic=False)

    def trace(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        from curvlinops import hutchpp_trace

        return float(hutchpp_trace(operator(m, x, y), num_matvecs=3 * max(1, round(hvps / 3))))  # a multiple of 3

    def eig(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        from scipy.sparse.linalg import eigsh

        op = operator(m, x, y).to_scipy()
        return float(eigsh(op, k=1, which="LA", maxiter=hvps, tol=1e-3, ncv=min(hvps, op.shape[0] - 1),
                           return_eigenvectors=False)[0])

    def density(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        from curvlinops import lanczos_approximate_spectrum

        grid, dens = lanczos_approximate_spectrum(operator(m, x, y), ncv=hvps, num_points=200, num_repeats=1)
        grid, dens = torch.as_tensor(grid, dtype=torch.float64), torch.as_tensor(dens, dtype=torch.float64)
        return float(torch.trapezoid(grid * dens, grid) / torch.trapezoid(dens, grid))

    return {"trace": trace, "top eigenvalue": eig, "density": density}


def pyhessian_runs(hvps: int) -> dict[str, Callable]:
    def make_h(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        from pyhessian import hessian

        return hessian(m, nn.CrossEntropyLoss(), data=(x, y), cuda=False)

    def trace(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        values = make_h(m, x, y).trace(maxIter=hvps, tol=1e-3)
        return float(sum(values) / len(values))

    def eig(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(make_h(m, x, y).eigenvalues(maxIter=hvps, tol=1e-3, top_n=1)[0][0])

    def density(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        nodes, weights = make_h(m, x, y).density(iter=hvps, n_v=1)
        return float(sum(n * w for n, w in zip(nodes[0], weights[0])))

    return {"trace": trace, "top eigenvalue": eig, "density": density}


RUNNERS = {"flatbench": flatbench_runs, "backpack": backpack_runs, "curvlinops": curvlinops_runs,
           "pyhessian": pyhessian_runs, "exact": exact_runs}


def timed(fn: Callable, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, float, str]:
    """(value, seconds, problem) of one library's computation on a fresh copy of the model (the value may
    be (value, note): flatbench's estimate that stopped at the budget before its tolerance)."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = copy.deepcopy(model)
    start = time.perf_counter()
    try:
        with sdpa_kernel(SDPBackend.MATH):  # attention in its plain form: the fused kernels lack double backward
            value = fn(m, x, y)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot handle a model is reported, not fatal
        text = str(exc).strip().splitlines()
        return None, time.perf_counter() - start, f"error: {type(exc).__name__}: {text[0][:60] if text else ''}"
    return value, time.perf_counter() - start, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hvps", type=int, default=20, help="HVP budget of the iterative methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="relu_mlp,tanh_mlp,resnet18,vit,transformer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# bench_api: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s), float32, HVP budget {args.hvps}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    installed = {lib: lib in ("flatbench", "exact") or importlib.util.find_spec(PEERS[lib]) is not None for lib in RUNNERS}
    torch.manual_seed(0)  # warm-up: each library's imports and first-call costs, on a tiny MLP, untimed
    tiny = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.ReLU(), nn.Linear(4, 3))
    for lib in RUNNERS:
        for fn in (RUNNERS[lib](3) if installed[lib] else {}).values():
            timed(fn, tiny, torch.randn(6, 12), torch.arange(6) % 3)
    print(f"| model | quantity | library | value | seconds | ratio to flatbench |")
    print(f"|---|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        model, x, y = make(name.strip())
        runs = {lib: RUNNERS[lib](args.hvps) if installed[lib] else {} for lib in RUNNERS}
        for quantity in ("trace", "top eigenvalue", "density"):
            base = None
            for lib in RUNNERS:
                label = f"| {name} ({sum(p.numel() for p in model.parameters())} params, {x.shape[0]} images) " \
                        f"| {quantity} | {lib} |"
                if not installed[lib]:
                    print(f"{label} not installed | | |")
                    continue
                if quantity not in runs[lib]:
                    print(f"{label} not offered | | |")
                    continue
                value, seconds, problem = timed(runs[lib][quantity], model, x, y)
                if lib == "flatbench":
                    base = seconds
                if problem:
                    print(f"{label} {problem} | {seconds:.2f} | |")
                    continue
                ratio = f"{seconds / base:.2f}" if base else ""
                value, note = value if isinstance(value, tuple) else (value, "")
                shown = (f"{value:.6g}" if value is not None and math.isfinite(value) else str(value)) \
                    + (f" ({note})" if note else "")
                print(f"{label} {shown} | {seconds:.2f} | {ratio} |")


if __name__ == "__main__":
    main()

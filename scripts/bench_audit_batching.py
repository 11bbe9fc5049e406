"""Would batching the audit's rescaled copies make it cheaper? (issue 28's "batch the rescaled copies")

The population audit measures k transformed copies of every run (3 draws x 2 factor ranges = 6), and each
copy costs what measuring it costs: the measures are made of forward passes (Monte-Carlo and PAC-Bayes),
gradients (the sharpness searches) and Hessian-vector products (Lanczos, traces). This times those three
primitives on the committed studies' models for k copies of one model, in the same process:

* baseline: one call per copy, one after another (what the audit does);
* batched: one `torch.func.vmap` call over the k copies' stacked parameters.

The models are built untrained (a primitive's cost does not depend on the weights' values), at the studies'
measurement size (500 examples, float32, one thread per worker as in the studies' 2 workers on 2 cores):
one model of each architecture the six studies audit. Prints the minimum over `--repeats` rounds,
batched / baseline (below 1: batching is cheaper) and the largest relative difference of their results.

    PYTHONPATH=. python scripts/bench_audit_batching.py [--copies 6] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch.func import functional_call, grad, jvp, vmap


def cases() -> list[tuple[str, torch.nn.Module, tuple[int, ...]]]:
    """One model of each architecture the committed studies audit (configs/cpu/*.yaml), untrained."""
    from flatbench.config.schema import ModelConfig
    from flatbench.models import build_model

    torch.manual_seed(0)
    mnist, cifar = (1, 28, 28), (3, 32, 32)
    specs = [
        ("MLP 128-128 (natural)", ModelConfig(name="mlp", widths=(128, 128)), mnist),
        ("MLP 64-64 (hyperparameters)", ModelConfig(name="mlp", widths=(64, 64)), mnist),
        ("MLP 256-256 (hyperparameters)", ModelConfig(name="mlp", widths=(256, 256)), mnist),
        ("MLP 512-512 (tsuzuku_mnist)", ModelConfig(name="mlp", widths=(512, 512)), mnist),
        ("LeNet (tsuzuku_mnist)", ModelConfig(name="lenet"), mnist),
        ("MLP 512-128-512 (ibayashi_mnist)", ModelConfig(name="mlp", widths=(512, 128, 512)), mnist),
        ("MLP 256-256, no bias (yi_mnist)", ModelConfig(name="mlp", widths=(256, 256), bias=False), mnist),
        ("LeNet, CIFAR-10 (tsuzuku_cifar10)", ModelConfig(name="lenet"), cifar),
    ]
    return [(label, build_model(cfg, shape, 10), shape) for label, cfg, shape in specs]


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(minimum seconds over `repeats` calls after one untimed warm-up call, the last call's result)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def largest_difference(one_by_one: list[Any], batched: Any) -> float:
    """The largest difference between the two ways' results relative to the largest entry of its tensor:
    the batched call computes the same quantities (to float32 rounding), or its time would mean nothing."""
    worst = 0.0
    for k, seq in enumerate(one_by_one):
        pairs = [(seq, batched[k])] if torch.is_tensor(seq) else [(seq[key], batched[key][k]) for key in seq]
        for a, b in pairs:
            worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=500, help="examples per evaluation (the studies' n_examples)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.copies} copies, {args.n} examples, float32, {torch.get_num_threads()} thread(s); "
          "seconds are the minimum of the rounds")
    print(f"{'model':36s} {'primitive':9s} {'one by one':>11s} {'batched':>9s} {'ratio':>6s} {'rel. diff':>9s}")
    for label, model, shape in cases():
        model.eval()
        x, y = torch.randn(args.n, *shape), torch.randint(0, 10, (args.n,))
        buffers = dict(model.named_buffers())
        base = {k: v.detach() for k, v in model.named_parameters()}
        copies = [{k: v * (0.5 + torch.rand_like(v)) for k, v in base.items()} for _ in range(args.copies)]
        tangents = [{k: torch.randn_like(v) for k, v in base.items()} for _ in range(args.copies)]
        stacked = {k: torch.stack([c[k] for c in copies]) for k in base}
        stacked_t = {k: torch.stack([t[k] for t in tangents]) for k in base}

        def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

        def hvp(params: dict[str, torch.Tensor], v: dict[str, torch.Tensor]) -> Any:
            return jvp(grad(loss), (params,), (v,))[1]

        primitives = {
            "forward": (lambda: [loss(c) for c in copies], lambda: vmap(loss)(stacked)),
            "gradient": (lambda: [grad(loss)(c) for c in copies], lambda: vmap(grad(loss))(stacked)),
            "HVP": (lambda: [hvp(c, t) for c, t in zip(copies, tangents)], lambda: vmap(hvp)(stacked, stacked_t)),
        }
        for name, (one_by_one, batched) in primitives.items():
            with torch.no_grad() if name == "forward" else torch.enable_grad():
                t_seq, seq_out = best_of(one_by_one, args.repeats)
                t_bat, bat_out = best_of(batched, args.repeats)
                gap = largest_difference(seq_out, bat_out)
            print(f"{label:36s} {name:9s} {t_seq:10.4f}s {t_bat:8.4f}s {t_bat / t_seq:6.2f} {gap:9.1e}")


if __name__ == "__main__":
    main()

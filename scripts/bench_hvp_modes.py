"""Which Hessian-vector-product mode `auto` should be, and what checking a torch.func mode costs.

    PYTHONPATH=. python -W ignore scripts/bench_hvp_modes.py                 # every model, float32, 1 thread
    PYTHONPATH=. python -W ignore scripts/bench_hvp_modes.py --models mlp,transformer --repeats 7

For each model of a catalogue of modern layers at a realistic size (plain ReLU nets, normalization layers,
attention, embeddings, residual blocks), in one process: the time of one full-data HVP in each of the three
modes (double backward, reverse-over-forward, forward-over-reverse), each the minimum over `--repeats`
interleaved rounds, as a ratio to double backward (the baseline, computed in the same round); each mode's
relative difference from double backward on the same vector (wrong formulas show as differences far above
float rounding); and the cost of the check `curvature.check_mode` (one product in each of double backward
and the mode, on one chunk, once per model and loss) in units of one double-backward HVP.

`auto` is double backward (`curvature.modes.AUTO_MODE`) because the torch.func modes were not faster where
it mattered (the table in docs/performance.md) and are wrong on some layers; the check makes a torch.func
mode asked for by hand safe, at the cost printed here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.curvature import check_mode  # noqa: E402
from flatbench.curvature.hvp import product_in_mode  # noqa: E402 - the product in exactly one mode, no check
from flatbench.losses import get_loss  # noqa: E402

MODES = ("double_backward", "rev_fwd", "fwd_rev")


class Block(nn.Module):
    """A transformer block: pre-LN (x + attn(LN(x)), x + mlp(LN(x))) or post-LN (LN(x + attn(x)), ...)."""

    def __init__(self, d: int, heads: int, pre: bool, norm: Callable[[int], nn.Module] = nn.LayerNorm):
        super().__init__()
        self.pre = pre
        self.norm1, self.norm2 = norm(d), norm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre:
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, x, x, need_weights=False)[0])
        return self.norm2(x + self.mlp(x))


class Transformer(nn.Module):
    """Token embedding + learned positions, `layers` blocks, a final norm, mean pooling, a linear head."""

    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, layers: int = 2, tokens: int = 32,
                 classes: int = 10, pre: bool = True, norm: Callable[[int], nn.Module] = nn.LayerNorm):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, d))
        self.blocks = nn.Sequential(*[Block(d, heads, pre, norm) for _ in range(layers)])
        self.norm = norm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.pos)).mean(1))


class ResidualCNN(nn.Module):
    """conv → norm → act, two residual blocks, pooling, a head: the norm layer and activation chosen."""

    def __init__(self, norm: Callable[[int], nn.Module], act: Callable[[], nn.Module] = nn.ReLU, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), norm(width), act())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), norm(width), act(),
                                                  nn.Conv2d(width, width, 3, padding=1), norm(width))
                                    for _ in range(2))
        self.act = act()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = self.act(h + block(h))
        return self.head(h)


def _bn_eval(model: nn.Module) -> nn.Module:
    """BatchNorm with non-trivial running statistics (one pass in train mode), then eval."""
    model.train()
    with torch.no_grad():
        model(torch.randn(64, 3, 32, 32))
    return model


def catalogue(name: str) -> tuple[nn.Module, torch.Tensor]:
    """(model in eval mode, its inputs) of one benchmark model."""
    images = torch.randn(32, 3, 32, 32)
    tokens = torch.randint(0, 100, (64, 32))
    builders: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
        "mlp": lambda: (nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                      nn.Linear(128, 10)), torch.randn(256, 1, 28, 28)),
        "lenet": lambda: (nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 120), nn.ReLU(),
                                        nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)),
                          torch.randn(256, 1, 28, 28)),
        "layernorm_mlp": lambda: (nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256),
                                                nn.LayerNorm(256), nn.SiLU(), nn.Linear(256, 10)),
                                  torch.randn(512, 64)),
        "rmsnorm_mlp": lambda: (nn.Sequential(nn.Linear(64, 256), nn.RMSNorm(256), nn.SiLU(), nn.Linear(256, 256),
                                              nn.RMSNorm(256), nn.Softplus(), nn.Linear(256, 10)),
                                torch.randn(512, 64)),
        "transformer_pre_ln": lambda: (Transformer(pre=True), tokens),
        "transformer_post_ln": lambda: (Transformer(pre=False), tokens),
        "transformer_rmsnorm": lambda: (Transformer(pre=True, norm=nn.RMSNorm), tokens),
        "cnn_batchnorm_eval": lambda: (_bn_eval(ResidualCNN(nn.BatchNorm2d)), images),
        "cnn_groupnorm": lambda: (ResidualCNN(lambda c: nn.GroupNorm(4, c), nn.SiLU), images),
        "cnn_instancenorm": lambda: (ResidualCNN(lambda c: nn.InstanceNorm2d(c, affine=True)), images),
    }
    if name not in builders:
        raise SystemExit(f"unknown model {name!r} (choose from {', '.join(builders)})")
    model, x = builders[name]()
    return model.eval(), x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,lenet,layernorm_mlp,rmsnorm_mlp,transformer_pre_ln,"
                        "transformer_post_ln,transformer_rmsnorm,cnn_batchnorm_eval,cnn_groupnorm,cnn_instancenorm")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--chunk-size", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loss = get_loss("ce")
    print(f"torch {torch.__version__}, {args.dtype}, {args.threads} thread(s), min of {args.repeats} interleaved "
          f"rounds; chunk {args.chunk_size}; HVP seconds, ratio to double backward, relative difference from it")
    print("| model | params | n | double backward | rev_fwd | fwd_rev | rev_fwd rel. diff. | fwd_rev rel. diff. "
          "| check (rev_fwd, fwd_rev) in HVPs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, x = catalogue(name)
        model = model.to(dtype)
        x = x.to(dtype) if x.is_floating_point() else x
        y = torch.randint(0, 10, (x.shape[0],))
        size = sum(p.numel() for p in model.parameters())
        v = torch.randn(size, dtype=dtype)
        best = {m: float("inf") for m in MODES}
        out: dict[str, torch.Tensor | str] = {}
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            for _ in range(args.repeats):
                for mode in MODES:
                    if isinstance(out.get(mode), str):
                        continue
                    start = time.perf_counter()
                    try:
                        out[mode] = product_in_mode(model, x, y, loss, v, args.chunk_size, mode)
                    except (NotImplementedError, RuntimeError) as exc:
                        out[mode] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:60]
                        continue
                    best[mode] = min(best[mode], time.perf_counter() - start)
            checks = []
            for mode in ("rev_fwd", "fwd_rev"):
                start = time.perf_counter()
                check_mode(model, x, y, loss, mode, args.chunk_size)
                checks.append((time.perf_counter() - start) / best["double_backward"])
        ref = out["double_backward"]
        cells = []
        for mode in ("rev_fwd", "fwd_rev"):
            got = out[mode]
            cells.append("fails" if isinstance(got, str) else f"{best[mode]:.4f} ({best[mode] / best['double_backward']:.2f}×)")
        diffs = []
        for mode in ("rev_fwd", "fwd_rev"):
            got = out[mode]
            diffs.append("–" if isinstance(got, str) else f"{float((got - ref).norm() / ref.norm()):.1e}")
        print(f"| {name} | {size:,} | {x.shape[0]} | {best['double_backward']:.4f} | {cells[0]} | {cells[1]} | "
              f"{diffs[0]} | {diffs[1]} | {checks[0]:.2f}, {checks[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

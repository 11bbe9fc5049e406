"""Group measures: the exact Hessian diagonal of several MLPs of one architecture in one computation.

A sweep trains many runs of one model (ratios × seeds). For a plain MLP (Flatten, then Linear layers
separated by ReLU, no BatchNorm) the exact diagonal of the Gauss-Newton-equals-Hessian sum
(piecewise linear logits) is, per Linear layer with input a_n and, for logit-Hessian factor c of example
n, output gradient g_nc:

    diag H_W = (1/n) Σ_n Σ_c λ_nc (g_nc ⊙ g_nc) (a_n ⊙ a_n)ᵀ,   diag H_b = (1/n) Σ_n Σ_c λ_nc g_nc ⊙ g_nc

`group_hessian_diagonals` evaluates this for G models at once: their weights are stacked into
(G, out, in) tensors, the forward pass is one batched matmul per layer, and the backward pass is written
out by hand for all G models and all K = C − 1 factors together (g_{l−1} = (g_l W_l) ⊙ 1[z_{l−1} > 0]),
so each per-layer sum above is one batched matmul. Each model gets its own targets (the labels it was
trained on); the inputs are either shared (n, ...) — runs with the same seed share their measurement
subset, see `flatbench.data.measurement_subset` — or per model (G, n, ...).

The result equals `flatbench.curvature.hessian_diagonal(..., method="exact")` of each model (a test
checks it to 1e-10 in float64). Whether it is faster than G sequential calls is measured by
`scripts/bench_group_measures.py`. On a 2-core CPU, float64, n = 2000, it is not: 0.5–0.6× for
784-512-512-10 (the quickstart's MLP) and 0.95× for 784-128-128-10, because the per-model matmuls already
keep the cores busy and the batched matmuls and element-wise products over G·K gradients are no
cheaper. So the measure stage (`measure_study`) computes runs one by one and does not use this function;
it is a library function for settings where batching pays (e.g. small models on a GPU), to be measured
there with the same script before any wiring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flatbench.curvature.diagonal import DiagonalResult, logit_factors


def mlp_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers of a plain MLP (an nn.Sequential of [Flatten], Linear, (ReLU, Linear)*), in order.

    Raises ValueError for anything else (BatchNorm, other activations, convolutions, in-place ReLU is
    fine since only its position matters here).
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"group diagonal needs an nn.Sequential MLP, got {type(model).__name__}")
    mods = list(model)
    if mods and isinstance(mods[0], nn.Flatten):
        mods = mods[1:]
    linears: list[nn.Linear] = []
    for i, m in enumerate(mods):
        want = nn.Linear if i % 2 == 0 else nn.ReLU
        if type(m) is not want:
            raise ValueError(f"group diagonal needs Linear and ReLU layers alternating, found "
                             f"{type(m).__name__} at position {i}")
        if isinstance(m, nn.Linear):
            linears.append(m)
    if not linears or len(mods) % 2 == 0:
        raise ValueError("group diagonal needs an MLP that ends with a Linear layer")
    return linears


def _signature(linears: list[nn.Linear]) -> list[tuple[int, int, bool]]:
    return [(m.in_features, m.out_features, m.bias is not None) for m in linears]


def group_hessian_diagonals(models: Sequence[nn.Module], inputs: Tensor, targets: Tensor, loss: Any, *,
                            per_model_inputs: bool = False, max_memory_mb: int = 1024,
                            chunk_size: int = 2000) -> list[DiagonalResult]:
    """Exact diag H of the mean loss for each of G MLPs of identical architecture, computed together.

    `inputs`: (n, ...) shared by all models, or with `per_model_inputs` (G, n, ...), one set per model
    (runs of different seeds measure different subsets); `targets`: (G, n), each
    model's labels (they enter through the loss's logit Hessian; for `ce` they do not matter). `loss` is
    a `flatbench.losses.LogitLoss`. Computation is in the dtype of the inputs (the models' parameters
    are read in that dtype). Returns one `DiagonalResult` per model, keyed by `model.named_parameters()`
    like `hessian_diagonal`'s.
    """
    models = list(models)
    if not models:
        return []
    layers = [mlp_linears(m) for m in models]
    sig = _signature(layers[0])
    x, n = _checked_inputs(layers, sig, inputs, targets, per_model_inputs)
    g_count, dtype, device = len(models), inputs.dtype, inputs.device
    with torch.no_grad():
        stack = _Stack.of(layers, sig, dtype)
        diag_w = [torch.zeros(g_count, o, i, dtype=torch.float64, device=device) for i, o, _ in sig]
        diag_b = [torch.zeros(g_count, o, dtype=torch.float64, device=device) if has else None
                  for _, o, has in sig]
        # per example: activations and masks of every layer for every model, and K output gradients at
        # the widest layer (twice, old and new), all in `dtype`
        widest = max(max(i, o) for i, o, _ in sig)
        factors = max(1, sig[-1][1])
        per_ex = g_count * (3 * sum(o for _, o, _ in sig) + sig[0][0] + 3 * factors * widest) * x.element_size()
        step = max(1, min(int(chunk_size), int(max_memory_mb) * 2 ** 20 // max(1, per_ex)))
        for s in range(0, n, step):
            xs = x[s:s + step] if x.dim() == 2 else x[:, s:s + step]
            _accumulate_chunk(stack, xs, targets[:, s:s + step], loss, diag_w, diag_b)
    return [_result(model, layers[gi], [d[gi] for d in diag_w], [None if d is None else d[gi] for d in diag_b], n)
            for gi, model in enumerate(models)]


def _checked_inputs(layers: list[list[nn.Linear]], sig: list[tuple[int, int, bool]], inputs: Tensor,
                    targets: Tensor, per_model_inputs: bool) -> tuple[Tensor, int]:
    """The inputs as (n, in) or (G, n, in) rows and n, after checking that the models share one
    architecture and that inputs and targets have the shapes the docstring of the caller states."""
    for i, ls in enumerate(layers[1:], 1):
        if _signature(ls) != sig:
            raise ValueError(f"group diagonal needs identical architectures: model {i} differs from model 0")
    g_count = len(layers)
    if per_model_inputs and int(inputs.shape[0]) != g_count:
        raise ValueError(f"per-model inputs must have shape (G, n, ...) with G = {g_count}, "
                         f"got {tuple(inputs.shape)}")
    n = int(inputs.shape[1] if per_model_inputs else inputs.shape[0])
    x = inputs.reshape(g_count, n, -1) if per_model_inputs else inputs.reshape(n, -1)
    if x.shape[-1] != sig[0][0]:
        raise ValueError(f"inputs have {x.shape[-1]} features, the first Linear expects {sig[0][0]}")
    if tuple(targets.shape) != (g_count, n):
        raise ValueError(f"targets must have shape (G, n) = ({g_count}, {n}), got {tuple(targets.shape)}")
    return x, n


class _Stack:
    """The G models' weights stacked per layer: w_t (G, in, out) for the forward pass, w (G, out, in) for
    the backward pass, b (G, 1, out) or None."""

    def __init__(self, w_t: list[Tensor], w: list[Tensor], b: list[Tensor | None], g_count: int):
        self.w_t, self.w, self.b, self.g_count = w_t, w, b, g_count

    @classmethod
    def of(cls, layers: list[list[nn.Linear]], sig: list[tuple[int, int, bool]], dtype: torch.dtype) -> "_Stack":
        w_t = [torch.stack([ls[l].weight.detach().to(dtype) for ls in layers]).transpose(1, 2).contiguous()
               for l in range(len(sig))]
        b = [torch.stack([ls[l].bias.detach().to(dtype) for ls in layers])[:, None, :] if sig[l][2] else None
             for l in range(len(sig))]
        return cls(w_t, [t.transpose(1, 2).contiguous() for t in w_t], b, len(layers))


def _accumulate_chunk(stack: _Stack, xs: Tensor, targets: Tensor, loss: Any, diag_w: list[Tensor],
                      diag_b: list[Tensor | None]) -> None:
    """Add one chunk's Σ_n Σ_c λ_nc (g_nc a_nᵀ)² to every model's weight (and bias) diagonal: the forward
    pass keeps each layer's input and ReLU mask, the logit factors start the backward pass."""
    g_count, depth = stack.g_count, len(stack.w_t)
    m = int(xs.shape[-2])
    acts: list[Tensor] = []  # input of each Linear, (G, m, in)
    masks: list[Tensor] = []  # ReLU derivative at each hidden layer, (G, m, out)
    a = xs
    for l in range(depth):
        acts.append(a if a.dim() == 3 else a.expand(g_count, m, -1))
        z = torch.matmul(a, stack.w_t[l])  # shared (m, in) @ (G, in, out) broadcasts to (G, m, out)
        if stack.b[l] is not None:
            z = z + stack.b[l]
        if l < depth - 1:
            masks.append(z > 0)
            a = z * masks[-1]
        else:
            a = z
    num_classes = a.shape[-1]  # a: the logits, (G, m, C)
    lam, vecs = logit_factors(loss, a.reshape(g_count * m, num_classes), targets.reshape(g_count * m))
    k = lam.shape[-1]
    # output gradients of the K factors, (G, K, m, C), and their signs/scales (G, K, m, 1)
    g = vecs.to(xs.dtype).reshape(g_count, m, num_classes, k).permute(0, 3, 1, 2)
    lam_k = lam.to(xs.dtype).reshape(g_count, m, k).permute(0, 2, 1)[..., None]
    for l in range(depth - 1, -1, -1):
        sq = (lam_k * g * g).sum(1)  # (G, m, out): Σ_c λ_c g_c²
        diag_w[l] += torch.bmm(sq.transpose(1, 2), acts[l] * acts[l]).to(torch.float64)
        if diag_b[l] is not None:
            diag_b[l] += sq.sum(1).to(torch.float64)
        if l > 0:
            gk = torch.matmul(g.reshape(g_count, k * m, -1), stack.w[l]).reshape(g_count, k, m, -1)
            g = gk * masks[l - 1][:, None]


def _result(model: nn.Module, linears: list[nn.Linear], diag_w: list[Tensor], diag_b: list[Tensor | None],
            n: int) -> DiagonalResult:
    """One model's DiagonalResult, keyed by its own parameter names."""
    ids = {id(p): name for name, p in model.named_parameters()}
    diag: dict[str, Tensor] = {}
    for l, lin in enumerate(linears):
        diag[ids[id(lin.weight)]] = diag_w[l] / n
        if lin.bias is not None:
            diag[ids[id(lin.bias)]] = diag_b[l] / n
    return DiagonalResult(diag=diag, method="exact", n=n,
                          reason="piecewise linear in every single parameter (grouped MLP)")

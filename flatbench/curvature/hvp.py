"""Hessian-vector products (torch.func, reverse-over-forward, over the whole measurement set in chunks)
and Hutchinson's estimators of the trace and the diagonal (Rademacher probes, Welford statistics)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import grad, jvp

from flatbench.curvature.common import (_buffers, _chunks, _flatten, _loss_fn, _params, _rademacher,
                                        _unflatten, _Welford)

HVP_MODES = ("rev_fwd", "fwd_rev", "double_backward")
"""Ways to compute a Hessian-vector product (`hvp`'s mode): reverse-over-forward (default), forward-over-
reverse, double backward."""
DEFAULT_HUTCHINSON_PROBES = 100
"""Probes of the Hutchinson fallback diagonal (and of `hutchinson_trace` when neither probes nor rtol)."""



def hvp(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
        chunk_size: int = 2000, mode: str = "rev_fwd") -> dict[str, Tensor] | Tensor:
    """H v for H the Hessian of the mean loss over (inputs, targets), with torch.func, in chunks.

    `vec` is a dict of tensors keyed like `model.named_parameters()` or one flat vector in that order;
    the result has the same structure (and the parameters' dtype). Chunks are weighted by their share of
    the examples, so the result is the full-set Hessian's product whatever the chunking.

    `mode`: 'rev_fwd' (default) is `grad` of the directional derivative `jvp(L)[v]` (reverse-over-forward),
    'fwd_rev' is `jvp(grad(L))` (forward-over-reverse), 'double_backward' is PyHessian's
    `autograd.grad(⟨∇L, v⟩)`. All three compute the same product; on CPU the reverse-over-forward form
    measured fastest of the torch.func ones (scripts/bench_curvature.py prints all three), so it is the
    default. A model with a module in train mode (BatchNorm updating running statistics mutates buffers,
    which torch.func transforms refuse) always uses double backward, on cloned buffers so the model's
    statistics are left as they were.
    """
    if mode not in HVP_MODES:
        raise ValueError(f"mode must be one of {HVP_MODES}, got {mode!r}")
    params = _params(model)
    flat_input = isinstance(vec, Tensor)
    v = _unflatten(vec, params) if flat_input else {k: vec[k].to(params[k].dtype) for k in params}
    buffers = _buffers(model)
    n = int(inputs.shape[0])
    out = {k: torch.zeros_like(p) for k, p in params.items()}
    if any(m.training for m in model.modules()):
        mode = "double_backward"
    with torch.enable_grad():
        for x, y in _chunks(inputs, targets, chunk_size):
            fn = _loss_fn(model, buffers, x, y, loss, x.shape[0] / n)
            if mode == "rev_fwd":
                hv = grad(lambda p: jvp(fn, (p,), (v,))[1])(params)
            elif mode == "fwd_rev":
                hv = jvp(grad(fn), (params,), (v,))[1]
            else:
                leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
                grads = torch.autograd.grad(fn(leaves), list(leaves.values()), create_graph=True,
                                            allow_unused=True, materialize_grads=True)
                dot = sum((g * v[k]).sum() for g, k in zip(grads, leaves))
                hv = dict(zip(leaves, torch.autograd.grad(dot, list(leaves.values()), allow_unused=True,
                                                          materialize_grads=True)))
            for k in out:
                out[k] += hv[k]
    if flat_input:
        return _flatten(out, list(params)).to(vec.dtype)
    return out


# ---------------------------------------------------------------- Hutchinson



def hutchinson_trace(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, *,
                     generator: torch.Generator, probes: int | None = None, rtol: float | None = None,
                     max_probes: int = 1000, min_probes: int = 10, chunk_size: int = 2000) -> dict[str, Any]:
    """Tr H ≈ mean of zᵀHz over Rademacher probes z, with its standard error.

    With `probes` a fixed count is drawn; otherwise, with `rtol`, probes are drawn until the standard
    error is at most rtol·|mean| (at least `min_probes`, at most `max_probes`); with neither,
    `DEFAULT_HUTCHINSON_PROBES`. Deterministic given the generator's state.
    """
    params = _params(model)
    if probes is None and rtol is None:
        probes = DEFAULT_HUTCHINSON_PROBES
    limit = probes if probes is not None else max_probes
    acc = _Welford()
    while acc.count < limit:
        z = _rademacher(params, generator)
        hz = hvp(model, inputs, targets, loss, z, chunk_size=chunk_size)
        acc.add(float(sum((z[k].double() * hz[k].double()).sum() for k in params)))
        if probes is None and acc.count >= max(2, min_probes) and acc.stderr() <= rtol * abs(acc.mean):
            break
    return {"mean": float(acc.mean), "stderr": float(acc.stderr()), "probes": acc.count}

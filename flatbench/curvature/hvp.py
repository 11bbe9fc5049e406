"""Hessian-vector products (torch.func, reverse-over-forward, over the whole measurement set in chunks):
the primitive `HessianOperator` applies (`H @ v`), with the modes and the double-backward fallback."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, jvp

from flatbench.curvature.common import (
    detached_buffers,
    chunks,
    flatten,
    loss_fn,
    detached_params,
    unflatten,
)

HVP_MODES = ("auto", "rev_fwd", "fwd_rev", "double_backward")
"""Ways to compute a Hessian-vector product (`hvp`'s mode): auto (reverse-over-forward, falling back to
double backward where an operator has no forward-mode derivative), reverse-over-forward, forward-over-
reverse, double backward."""
_MODE_OF: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""The HVP mode chosen for a model (`use_hvp_mode`), and the fallback `auto` found for it."""


def use_hvp_mode(model: nn.Module, mode: str) -> None:
    """Make every HVP of `model` (Hutchinson, Lanczos, the measures) use `mode` (one of HVP_MODES)."""
    if mode not in HVP_MODES:
        raise ValueError(f"hvp mode must be one of {', '.join(HVP_MODES)}, got {mode!r}")
    _MODE_OF[model] = mode


def hvp_mode_of(model: nn.Module) -> str:
    """The mode `hvp` uses for `model` by default: its `use_hvp_mode`, else auto."""
    return _MODE_OF.get(model, "auto")


def forward_ad_missing(exc: BaseException) -> bool:
    """Whether an error says an operator has no forward-mode (JVP) derivative (e.g. the fused attention
    kernel `aten::_native_multi_head_attention`), so that double backward can be used instead."""
    text = str(exc).lower()
    return isinstance(exc, (NotImplementedError, RuntimeError)) and (
        "forward ad" in text or "forward-mode" in text or "jvp" in text or "forward mode" in text)



def hvp(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
        chunk_size: int = 2000, mode: str | None = None) -> dict[str, Tensor] | Tensor:
    """H v for H the Hessian of the mean loss over (inputs, targets), with torch.func, in chunks.

    `vec` is a dict of tensors keyed like `model.named_parameters()` or one flat vector in that order;
    the result has the same structure (and the parameters' dtype). Chunks are weighted by their share of
    the examples, so the result is the full-set Hessian's product whatever the chunking.

    `mode`: None is the model's mode (`use_hvp_mode`, default 'auto': 'rev_fwd', and 'double_backward'
    from the first operator without a forward-mode derivative on, remembered for the model); 'rev_fwd' is `grad` of the directional derivative `jvp(L)[v]` (reverse-over-forward),
    'fwd_rev' is `jvp(grad(L))` (forward-over-reverse), 'double_backward' is PyHessian's
    `autograd.grad(⟨∇L, v⟩)`. All three compute the same product; on CPU the reverse-over-forward form
    measured fastest of the torch.func ones (scripts/bench_curvature.py prints all three), so it is the
    default. A model with a module in train mode (BatchNorm updating running statistics mutates buffers,
    which torch.func transforms refuse) always uses double backward, on cloned buffers so the model's
    statistics are left as they were.
    """
    with math_attention():
        return _hvp(model, inputs, targets, loss, vec, chunk_size, hvp_mode_of(model) if mode is None else mode)


def math_attention() -> Any:
    """A context in which scaled-dot-product attention uses its plain (math) implementation, which has
    every second-order and forward-mode derivative (the fused CPU/GPU kernels have neither)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # lazy: older torch lacks it (except below)

        return sdpa_kernel([SDPBackend.MATH])
    except ImportError:  # older torch: no fused kernels to avoid
        return contextlib.nullcontext()


def _hvp(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
         chunk_size: int, mode: str) -> dict[str, Tensor] | Tensor:
    if mode not in HVP_MODES:
        raise ValueError(f"mode must be one of {HVP_MODES}, got {mode!r}")
    if mode == "auto":
        try:
            return _hvp(model, inputs, targets, loss, vec, chunk_size, "rev_fwd")
        except (NotImplementedError, RuntimeError) as exc:
            if not forward_ad_missing(exc):
                raise
            _MODE_OF[model] = "double_backward"
            mode = "double_backward"
    params = detached_params(model)
    flat_input = isinstance(vec, Tensor)
    v = unflatten(vec, params) if flat_input else {k: vec[k].to(params[k].dtype) for k in params}
    buffers = detached_buffers(model)
    n = int(inputs.shape[0])
    out = {k: torch.zeros_like(p) for k, p in params.items()}
    if any(m.training for m in model.modules()):
        mode = "double_backward"
    with torch.enable_grad():
        for x, y in chunks(inputs, targets, chunk_size):
            fn = loss_fn(model, buffers, x, y, loss, x.shape[0] / n)
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
        return flatten(out, list(params)).to(vec.dtype)
    return out


DENSE_BLOCK = 64
"""Basis vectors per batched second backward pass of `dense_diagonal` (memory: that many gradients)."""


def dense_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable,
                   chunk_size: int = 2000) -> dict[str, Tensor]:
    """diag H exactly for any model, row by row: per chunk, the gradient g with its graph once, then
    H_ii = ∂g_i/∂θ_i from backward passes through g for blocks of unit vectors at a time (one forward and
    one first backward per chunk instead of one per HVP; a batched pass, falling back to one pass per
    vector where an operator has no batching rule). Cost ≈ size second-order backward passes; float64."""
    params = detached_params(model)
    buffers = detached_buffers(model)
    size = sum(p.numel() for p in params.values())
    n = int(inputs.shape[0])
    diag = torch.zeros(size, dtype=torch.float64, device=next(iter(params.values())).device)
    with math_attention(), torch.enable_grad():
        for x, y in chunks(inputs, targets, chunk_size):
            leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
            fn = loss_fn(model, buffers, x, y, loss, x.shape[0] / n)
            grads = torch.autograd.grad(fn(leaves), list(leaves.values()), create_graph=True, allow_unused=True,
                                        materialize_grads=True)
            g = flatten(dict(zip(leaves, grads)), list(leaves))
            if g.requires_grad:
                diag += _rows_diagonal(g, list(leaves.values()))
    return unflatten(diag, params, torch.float64)


def _rows_diagonal(g: Tensor, leaves: list[Tensor]) -> Tensor:
    """(∂g_i/∂θ_i)_i for a flat gradient g of the leaves, in blocks of `DENSE_BLOCK` unit vectors."""
    size = g.numel()
    out = torch.zeros(size, dtype=torch.float64, device=g.device)
    batched = True
    for start in range(0, size, DENSE_BLOCK):
        idx = torch.arange(start, min(size, start + DENSE_BLOCK), device=g.device)
        eye = torch.zeros(idx.numel(), size, dtype=g.dtype, device=g.device)
        eye[torch.arange(idx.numel()), idx] = 1.0
        if batched:
            try:
                rows = torch.autograd.grad(g, leaves, grad_outputs=eye, is_grads_batched=True, retain_graph=True,
                                           allow_unused=True, materialize_grads=True)
                out[idx] = torch.cat([r.reshape(idx.numel(), -1) for r in rows], 1).gather(1, idx[:, None])[:, 0]
                continue
            except RuntimeError:  # an operator without a batching rule: one vector at a time from here on
                batched = False
        for j, i in enumerate(idx.tolist()):
            row = torch.autograd.grad(g, leaves, grad_outputs=eye[j], retain_graph=True, allow_unused=True,
                                      materialize_grads=True)
            out[i] = torch.cat([r.reshape(-1) for r in row])[i]
    return out

"""Hessian-vector products over the whole measurement set in chunks: the primitive `HessianOperator`
applies (`H @ v`), in the mode `curvature.modes` decides (double backward by default; a torch.func mode only
after it agreed with double backward on the model), and the dense diagonal of a small model."""

from __future__ import annotations

import contextlib
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
    require_graph,
    unflatten,
)
from flatbench.curvature.modes import (
    AUTO_MODE,
    CHECKED_MODES,
    HVP_MODES,
    REFERENCE_MODE,
    ModeCheck,
    checked_mode,
    compare_products,
    forward_ad_missing,
    hvp_mode_of,
    loss_identity,
    missing_forward_ad,
    note_product,
)

CHECK_SEED = 20260
"""Seed of the random vector a torch.func mode is checked on (`check_mode`)."""


def hvp(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
        chunk_size: int = 2000, mode: str | None = None) -> dict[str, Tensor] | Tensor:
    """H v for H the Hessian of the mean loss over (inputs, targets), in chunks.

    `vec` is a dict of tensors keyed like `model.named_parameters()` or one flat vector in that order;
    the result has the same structure (and the parameters' dtype). Chunks are weighted by their share of
    the examples, so the result is the full-set Hessian's product whatever the chunking.

    `mode`: None is the model's mode (`use_hvp_mode`, default 'auto' = `modes.AUTO_MODE`, double backward);
    'double_backward' is PyHessian's `autograd.grad(⟨∇L, v⟩)`, 'rev_fwd' is `grad` of the directional
    derivative `jvp(L)[v]` (reverse-over-forward), 'fwd_rev' is `jvp(grad(L))` (forward-over-reverse). The two
    torch.func modes are used only after their first product on this model and loss agreed with double
    backward (`check_mode`; in torch 2.14.1 reverse-over-forward is wrong through LayerNorm and InstanceNorm);
    where one did not, double backward is used and the active `modes.HvpLog` says why. A model with a module in
    train mode (BatchNorm updating running statistics mutates buffers, which torch.func transforms refuse)
    always uses double backward, on cloned buffers so the model's statistics are left as they were.
    """
    asked = hvp_mode_of(model) if mode is None else mode
    if asked not in HVP_MODES:
        raise ValueError(f"mode must be one of {HVP_MODES}, got {asked!r}")
    with math_attention():
        used, check, reason = resolve_mode(model, inputs, targets, loss, asked, chunk_size)
        note_product(asked, used, check, reason)
        return product_in_mode(model, inputs, targets, loss, vec, chunk_size, used)


def resolve_mode(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, asked: str,
                 chunk_size: int) -> tuple[str, ModeCheck | None, str]:
    """(the mode a product is computed in, the check that decided it or None, why another mode than asked is
    used where no check says it): auto is `AUTO_MODE`; a model in train mode uses double backward; a
    torch.func mode is used only where its check passed."""
    mode = AUTO_MODE if asked == "auto" else asked
    if any(m.training for m in model.modules()):
        why = "" if mode == REFERENCE_MODE else "a module is in train mode (torch.func refuses buffer updates)"
        return REFERENCE_MODE, None, why
    if mode not in CHECKED_MODES:
        return mode, None, ""
    key = (loss_identity(loss), tuple(inputs.shape[1:]), inputs.dtype, str(inputs.device))
    check = checked_mode(model, key, mode, lambda: check_mode(model, inputs, targets, loss, mode, chunk_size))
    return (mode if check.passed else REFERENCE_MODE), check, ""


def check_mode(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, mode: str,
               chunk_size: int) -> ModeCheck:
    """`mode`'s product against double backward's on the first chunk and a seeded Gaussian vector: passed
    where they agree to `modes.check_tolerance` of the parameters' dtype; failed (with the reason) where they
    differ or where `mode` needs a forward-mode derivative an operator lacks. Costs one product in each mode
    on one chunk, once per model, loss and input shape."""
    params = detached_params(model)
    first = next(iter(params.values()))
    gen = torch.Generator(device="cpu").manual_seed(CHECK_SEED)
    size = sum(p.numel() for p in params.values())
    v = torch.randn(size, generator=gen, dtype=torch.float64).to(device=first.device, dtype=first.dtype)
    x, y = inputs[:chunk_size], targets[:chunk_size]
    reference = product_in_mode(model, x, y, loss, v, chunk_size, REFERENCE_MODE)
    try:
        got = product_in_mode(model, x, y, loss, v, chunk_size, mode)
    except (NotImplementedError, RuntimeError) as exc:
        if not forward_ad_missing(exc):
            raise
        return missing_forward_ad(mode, first.dtype, exc)
    return compare_products(mode, got, reference)


def math_attention() -> Any:
    """A context in which scaled-dot-product attention uses its plain (math) implementation, which has
    every second-order and forward-mode derivative (the fused CPU/GPU kernels have neither)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # lazy: older torch lacks it (except below)

        return sdpa_kernel([SDPBackend.MATH])
    except ImportError:  # older torch: no fused kernels to avoid
        return contextlib.nullcontext()


def product_in_mode(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
         chunk_size: int, mode: str) -> dict[str, Tensor] | Tensor:
    """The product in exactly `mode` (no check, no fallback)."""
    params = detached_params(model)
    flat_input = isinstance(vec, Tensor)
    v = unflatten(vec, params) if flat_input else {k: vec[k].to(params[k].dtype) for k in params}
    buffers = detached_buffers(model)
    n = int(inputs.shape[0])
    out = {k: torch.zeros_like(p) for k, p in params.items()}
    if any(m.training for m in model.modules()):
        mode = REFERENCE_MODE
    with torch.enable_grad():
        for x, y in chunks(inputs, targets, chunk_size):
            fn = loss_fn(model, buffers, x, y, loss, x.shape[0] / n)
            if mode == "rev_fwd":
                hv = grad(lambda p: jvp(fn, (p,), (v,))[1])(params)
            elif mode == "fwd_rev":
                hv = jvp(grad(fn), (params,), (v,))[1]
            else:
                leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
                grads = torch.autograd.grad(require_graph(fn(leaves)), list(leaves.values()), create_graph=True,
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
            grads = torch.autograd.grad(require_graph(fn(leaves)), list(leaves.values()), create_graph=True,
                                        allow_unused=True, materialize_grads=True)
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

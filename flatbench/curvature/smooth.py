"""The exact Hessian diagonal of Sequential chains with smooth elementwise activations (Tanh, GELU, ...).

`curvature.diagonal` is exact only where the logits are piecewise linear in every single parameter, so
that H = GGN. With a smooth activation a = σ(z) the Hessian of a per-example loss ℓ with respect to z is

    ∇²_z ℓ = diag(σ'(z)) ∇²_a ℓ diag(σ'(z)) + diag(σ''(z) ⊙ ∂ℓ/∂a)

and the second term (the "residual") is what the GGN leaves out. For a chain x → Linear → σ → Linear →
… → logits, each example's Hessian with respect to any hidden quantity is kept as a signed sum of rank-one
factors, ∇²_h ℓ_n = Σ_k s_nk u_nk u_nkᵀ (n × d × K). It starts from the logit Hessian's factors
(`logit_factors`, C − 1 for ce) and is carried backwards exactly:

- through a Linear z_out = W a + b the factors map u ↦ Wᵀ u (no residual: linear in a);
- through σ they map u ↦ σ'(z) ⊙ u, and the residual diag(r), r = σ''(z) ⊙ ∂ℓ_n/∂a, joins as d new
  factors √|r_j| e_j with signs sign(r_j) (only the columns where r is nonzero for some example; a ReLU's
  σ'' is zero, so ReLU layers add none);
- through BatchNorm1d with running statistics (per-feature affine) u ↦ γ/√(var + ε) ⊙ u.

Since a Linear's output is linear in its weights, ∂²ℓ_n/∂W_ij² = [∇²_z ℓ_n]_ii a_nj² exactly, so each
layer only needs the diagonal Σ_k s_k u_k² of its output's Hessian: diag H_W = (1/n) Σ_n dₙ ⊗ aₙ², one
matmul per layer. This is the recursion of BackPACK's `DiagHessian` (Dangel et al. 2020), written here
for flatbench's factors and chunking. The per-example gradient ∂ℓ_n/∂a is carried backwards alongside
(g ↦ g W through a Linear, g ↦ σ'(z) ⊙ g through σ); σ' and σ'' come from autograd on the activation
alone (elementwise, so the gradient of Σ σ(z) is σ'(z)), so any elementwise activation in
`SMOOTH_ACTIVATIONS` is exact to float rounding.

Cost: the factor matrices grow by the width of every smooth layer above, so one example needs
d × (C + Σ widths) numbers per layer; the examples are processed in chunks that fit `max_memory_mb`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flatbench.curvature.diagonal import DiagonalResult, NotExact, logit_factors

SMOOTH_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.Softplus, nn.ELU, nn.CELU, nn.SELU, nn.Mish, nn.Softsign,
    nn.LogSigmoid, nn.Tanhshrink)
"""Elementwise activations with a second derivative: their residual term σ''(z)·∂ℓ/∂a is included."""

PIECEWISE_ACTIVATIONS: tuple[type[nn.Module], ...] = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh)
"""Elementwise piecewise-linear activations (σ'' = 0 almost everywhere): they may be mixed in."""

_PASS_THROUGH: tuple[type[nn.Module], ...] = (nn.Identity, nn.Flatten, nn.Dropout)
SMOOTH_REASON = "a Sequential chain with smooth elementwise activations (Hessian diagonal with σ'' terms)"


@dataclass
class _Step:
    """One leaf of the chain in a forward pass: the module and its input."""

    module: nn.Module
    inp: Tensor


def _leaves(module: nn.Module) -> list[nn.Module]:
    """The leaves of nested plain nn.Sequential containers, in forward order (NotExact otherwise)."""
    if isinstance(module, nn.Sequential):
        if type(module).forward is not nn.Sequential.forward:
            raise NotExact(f"{type(module).__name__} overrides nn.Sequential's forward")
        if list(module.named_parameters(recurse=False)):
            raise NotExact(f"{type(module).__name__} holds parameters of its own")
        return [leaf for child in module for leaf in _leaves(child)]
    return [module]


def _check_leaf(m: nn.Module) -> str | None:
    """Why the leaf `m` is outside the chains handled here, or None."""
    kinds = (nn.Linear, nn.BatchNorm1d) + SMOOTH_ACTIVATIONS + PIECEWISE_ACTIVATIONS + _PASS_THROUGH
    base = next((b for b in kinds if isinstance(m, b)), None)
    if base is None:
        return f"'{type(m).__name__}' is not a Linear, BatchNorm1d or elementwise activation"
    if type(m).forward is not base.forward:
        return f"'{type(m).__name__}' overrides the forward of {base.__name__}"
    if isinstance(m, nn.Dropout) and m.training and m.p > 0:
        return f"'{type(m).__name__}' is active (train mode)"
    if isinstance(m, nn.BatchNorm1d) and (m.training or m.running_var is None):
        return "BatchNorm1d uses batch statistics (train mode or no running statistics)"
    return None


def smooth_chain(model: nn.Module) -> tuple[list[nn.Module] | None, str]:
    """(the chain's leaves, reason) when `model` is a Sequential chain of Linear, BatchNorm1d (running
    statistics), elementwise activations, Flatten, Identity and inactive Dropout that owns all its
    parameters once; else (None, why not)."""
    try:
        leaves = _leaves(model)
    except NotExact as exc:
        return None, f"not a Sequential chain: {exc}"
    seen: set[int] = set()
    for m in leaves:
        why = _check_leaf(m)
        if why is not None:
            return None, f"not a Sequential chain of Linear layers and elementwise activations: {why}"
        if id(m) in seen and next(m.parameters(), None) is not None:  # an activation may be reused
            return None, f"'{type(m).__name__}' appears twice in the chain (weight sharing)"
        seen.add(id(m))
    if not any(isinstance(m, nn.Linear) for m in leaves):
        return None, "the chain has no Linear layer"
    return leaves, SMOOTH_REASON


def _derivatives(act: nn.Module, z: Tensor) -> tuple[Tensor, Tensor]:
    """(σ'(z), σ''(z)) of an elementwise activation, by autograd on the activation alone: since σ acts
    elementwise, ∂(Σ σ(z))/∂z = σ'(z) and ∂(Σ σ'(z))/∂z = σ''(z)."""
    with torch.enable_grad():
        zz = z.detach().requires_grad_(True)
        (d1,) = torch.autograd.grad(act(zz.clone()).sum(), zz, create_graph=True)  # clone: inplace=True acts
        if not d1.requires_grad:  # piecewise linear: σ' does not depend on z
            return d1.detach(), torch.zeros_like(d1)
        (d2,) = torch.autograd.grad(d1.sum(), zz, allow_unused=True, materialize_grads=True)
    return d1.detach(), d2.detach()


def _add(diag: dict[str, Tensor], names: dict[int, str], param: Tensor | None, value: Tensor) -> None:
    if param is not None:
        diag[names[id(param)]] += value.reshape(param.shape).to(torch.float64)


class _Backward:
    """The backward recursion of one chunk: each example's Hessian at the current point as signed factors
    (u (n, d, K), s (n, K)) plus a pending diagonal r (n, d), and its gradient g (n, d), carried from the
    logits to the first parametrized layer.

    The residual of an activation is diagonal and stays so through BatchNorm and further activations, so
    it is kept as r until a Linear maps it: only there does it become factors, Wᵀ diag(√|r|), built from W
    directly (n × in × out) rather than by multiplying W with an (n × out × out) diagonal block."""

    def __init__(self, u: Tensor, s: Tensor, g: Tensor, diag: dict[str, Tensor], names: dict[int, str]):
        self.u, self.s, self.g, self.diag, self.names = u, s, g, diag, names
        self.r: Tensor | None = None

    def out_diag(self) -> Tensor:
        """diag ∇²ℓ_n at the current point, (n, d): Σ_k s_k u_k² + r."""
        d = torch.einsum("ndk,nk->nd", self.u * self.u, self.s)
        return d if self.r is None else d + self.r

    def linear(self, m: nn.Linear, a: Tensor, last: bool) -> None:
        d = self.out_diag()
        _add(self.diag, self.names, m.weight, d.t() @ (a * a))
        _add(self.diag, self.names, m.bias, d.sum(0))
        if last:
            return
        w = m.weight.detach()
        self.u = torch.einsum("nok,oi->nik", self.u, w)
        self.g = self.g @ w
        if self.r is not None:
            cols = (self.r != 0).any(0).nonzero().flatten()
            r = self.r[:, cols]
            self.u = torch.cat([self.u, w[cols].t()[None] * r.abs().sqrt()[:, None, :]], dim=2)
            self.s = torch.cat([self.s, torch.where(r < 0, -1.0, 1.0).to(self.s.dtype)], dim=1)
            self.r = None

    def _scale(self, scale: Tensor) -> None:
        """Through an elementwise map with derivative `scale` ((d,) or (n, d)): u, g and r follow."""
        self.u = self.u * scale.unsqueeze(-1)
        self.g = self.g * scale
        if self.r is not None:
            self.r = self.r * scale * scale

    def batch_norm(self, m: nn.BatchNorm1d, a: Tensor, last: bool) -> None:
        inv = torch.rsqrt(m.running_var + m.eps)
        xhat = (a - m.running_mean) * inv
        d = self.out_diag()
        _add(self.diag, self.names, m.weight, (d * xhat * xhat).sum(0))
        _add(self.diag, self.names, m.bias, d.sum(0))
        if not last:
            self._scale(inv * (m.weight.detach() if m.weight is not None else 1.0))

    def activation(self, m: nn.Module, z: Tensor) -> None:
        d1, d2 = _derivatives(m, z)
        r = d2 * self.g  # the residual, with g = ∂ℓ/∂a before it is carried through σ
        self._scale(d1)
        if bool((r != 0).any()):
            self.r = r if self.r is None else self.r + r


def _chunk(leaves: list[nn.Module], x: Tensor, y: Tensor, loss: Any, diag: dict[str, Tensor],
           names: dict[int, str]) -> None:
    """Add Σ_{n in chunk} diag ∇²_θ ℓ_n to `diag` (not yet divided by n)."""
    steps: list[_Step] = []
    h = x.detach()
    first = next(i for i, m in enumerate(leaves) if isinstance(m, (nn.Linear, nn.BatchNorm1d)))
    with torch.no_grad():
        for i, m in enumerate(leaves):
            if i >= first and h.dim() != 2:
                raise NotExact(f"{type(m).__name__} gets a {h.dim()}-D input; the chain needs (n, features)")
            steps.append(_Step(m, h))
            h = m(h.clone() if getattr(m, "inplace", False) else h)  # keep the recorded input intact
    if h.dim() != 2:
        raise NotExact(f"the model output has shape {tuple(h.shape)}, expected (n, C) logits")
    lam, vecs = logit_factors(loss, h.detach(), y)
    with torch.enable_grad():
        f = h.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(loss.per_example(f, y).sum(), f)
    back = _Backward(vecs.to(h.dtype), lam.to(h.dtype), g.detach(), diag, names)
    for i in range(len(steps) - 1, first - 1, -1):
        m, a = steps[i].module, steps[i].inp
        if isinstance(m, nn.Linear):
            back.linear(m, a, last=i == first)
        elif isinstance(m, nn.BatchNorm1d):
            back.batch_norm(m, a, last=i == first)
        elif not isinstance(m, _PASS_THROUGH):
            back.activation(m, a)


def _examples_per_chunk(leaves: list[nn.Module], num_classes: int, chunk_size: int, budget_bytes: int,
                        itemsize: int) -> int:
    """Examples per chunk so that the factor matrices, (n, width, K) with K growing by the width of
    each activation above, stay within the budget (a few copies are alive at once)."""
    widths = [m.out_features for m in leaves if isinstance(m, nn.Linear)]
    k = num_classes + sum(widths)
    per_example = 4 * max(widths + [num_classes]) * k * itemsize
    return max(1, min(int(chunk_size), budget_bytes // max(1, per_example)))


def smooth_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Any, *, max_memory_mb: int,
                    chunk_size: int) -> DiagonalResult:
    """diag H of the mean loss for a chain accepted by `smooth_chain` (NotExact otherwise), exact: the
    GGN part and the activations' second-derivative terms (see the module doc)."""
    leaves, reason = smooth_chain(model)
    if leaves is None:
        raise NotExact(reason)
    names = {id(p): k for k, p in model.named_parameters()}
    diag = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in model.named_parameters()}
    n = int(inputs.shape[0])
    linears = [m for m in leaves if isinstance(m, nn.Linear)]
    step = _examples_per_chunk(leaves, linears[-1].out_features, chunk_size, int(max_memory_mb) * 2 ** 20,
                               inputs.element_size())
    for i in range(0, n, step):
        _chunk(leaves, inputs[i:i + step], targets[i:i + step], loss, diag, names)
    return DiagonalResult(diag={k: v / n for k, v in diag.items()}, method="exact", reason=reason, n=n)

"""The Fisher-Rao norm (Liang, Poggio, Rakhlin, Stokes 2017).

    ‖θ‖²_fr = E_n [ ⟨θ, ∇_θ ℓ(f(x_n; θ), y_n)⟩² ]

over the measurement set, with θ **all parameters** (Linear / Conv2d weights and biases, BatchNorm's
affine weight and bias; BatchNorm running statistics are buffers and stay fixed, eval mode).
By the chain rule ⟨θ, ∇_θ ℓ_n⟩ = ⟨∇_f ℓ_n, J_n θ⟩, and J_n θ (the directional derivative of the logits
along θ) comes from one forward-mode JVP per chunk, so no per-example gradient is ever formed.

For a bias-free ReLU network with L+1 weight layers the logits are positively homogeneous of degree L+1
in θ, so J_n θ = (L+1) f_n and, for cross-entropy, ‖θ‖²_fr = (L+1)² E[(⟨p_n, f_n⟩ − f_{n,y_n})²].

Invariance. ⟨θ, ∇_θ ℓ(θ)⟩ = d/dt ℓ(tθ) at t = 1. A layer-, node- or BN-wise rescaling is a fixed linear
map T of the parameters (with, for BN, a fixed change of the running statistics) that leaves the network
function unchanged for *every* θ, so ℓ(t·Tθ) = ℓ(tθ) for all t and the derivative at t = 1 is the same:
the norm is exactly invariant to these families, with or without biases (the bias of a rescaled unit is
scaled with it). The logit-scale family changes the cross-entropy, so it changes this norm (for
`normalized_ce`, which is blind to logit scale, it would not).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, jvp

from flatbench.curvature import ModeCheck, forward_ad_missing, math_attention
from flatbench.curvature.common import require_graph
from flatbench.curvature.modes import checked_mode, compare_products, missing_forward_ad
from flatbench.measures.builtin import JIANG
from flatbench.measures.plugin import MeasureContext, MeasureOutput, register_measure


def directional_logit_derivative(model: torch.nn.Module, x: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, ModeCheck]:
    """(f(x; θ), J θ, the check of the forward mode): the logits and their derivative along θ itself, by one
    forward-mode JVP where that mode agreed, on the model's first call, with two reverse passes (the JVP as
    the derivative of the VJP `uᵀJ θ` with respect to u: `curvature.modes`, no derivative mode unchecked);
    by the two reverse passes where it did not or where an operator has no forward-mode derivative (fused
    attention)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    with math_attention():
        key = (("fisher_rao", "directional"), tuple(x.shape[1:]), x.dtype, str(x.device))
        check = checked_mode(model, key, "jvp", lambda: _check_forward(model, x, params))
        if check.passed:
            return (*jvp(lambda p: functional_call(model, p, (x,)), (params,), (params,)), check)
        return (*_reverse_directional(model, x, params), check)


def _check_forward(model: torch.nn.Module, x: torch.Tensor, params: dict[str, torch.Tensor]) -> ModeCheck:
    """The forward-mode J θ on these inputs against the two reverse passes'."""
    _, reference = _reverse_directional(model, x, params)
    try:
        _, got = jvp(lambda p: functional_call(model, p, (x,)), (params,), (params,))
    except (NotImplementedError, RuntimeError) as exc:
        if not forward_ad_missing(exc):
            raise
        return missing_forward_ad("jvp", reference.dtype, exc)
    return compare_products("jvp", got.reshape(-1), reference.reshape(-1))


def _reverse_directional(model: torch.nn.Module, x: torch.Tensor, params: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(f(x; θ), J θ) by two reverse passes: J θ = ∂/∂u (uᵀJ θ) at any u."""
    with torch.enable_grad():
        leaves = {k: p.clone().requires_grad_(True) for k, p in params.items()}
        out = require_graph(functional_call(model, leaves, (x,)))
        u = torch.zeros_like(out, requires_grad=True)
        grads = torch.autograd.grad(out, list(leaves.values()), u, create_graph=True, allow_unused=True,
                                    materialize_grads=True)
        dot = sum((g * params[k]).sum() for g, k in zip(grads, leaves))
        (along,) = torch.autograd.grad(dot, u)
    return out.detach(), along.detach()


@register_measure(
    "fisher_rao_norm", family="norm",
    papers=("Liang, Poggio, Rakhlin, Stokes. Fisher-Rao metric, geometry, and complexity of "
            "neural networks. AISTATS 2019", JIANG),
    description="Liang et al. 2017: E_n[⟨θ, ∇_θ ℓ(f_n, y_n)⟩²] over all parameters (one JVP along θ "
                "per chunk)",
    invariant_to=("layer", "node", "bn"), cost="gradient", fixed_loss="ce")
def fisher_rao_norm(ctx: MeasureContext) -> MeasureOutput:
    """The squared Fisher-Rao norm E_n[⟨θ, ∇_θ ℓ_n⟩²] (not its square root, unlike some ports).

    Always with cross-entropy: for a loss that is invariant to scaling the logits (`normalized_ce`)
    and a positively homogeneous network, ⟨θ, ∇_θ ℓ⟩ is identically 0, so the norm would be rounding noise.
    """
    total, check = 0.0, None
    for x, y in ctx.chunks():
        with torch.no_grad():
            logits, along, check = directional_logit_derivative(ctx.model, x)
        f = logits.detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(ctx.loss.per_example(f, y).sum(), f)  # row n: ∇_f ℓ_n
        total += float(((g * along).sum(dim=1) ** 2).sum())
    info: dict = {"method": "jvp_along_theta" if check is None or check.passed else "reverse_along_theta"}
    if check is not None:
        info["check"] = check.as_info()
        if not check.passed:
            info["fallback"] = check.reason.replace("double backward", "two reverse passes")
    return MeasureOutput({"fisher_rao_norm": total / ctx.n}, info)

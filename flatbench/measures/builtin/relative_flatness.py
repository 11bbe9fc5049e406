"""Relative flatness (Petzka, Kamp, Adilova, Sminchisescu, Boley 2021) of the feature → logit layer.

For the last Linear layer f = Wφ + b (W ∈ R^{C×m}, PyTorch out × in, φ ∈ R^m its input: the features),
with w_s ∈ R^m the s-th **row** of W (the weights into output neuron s) and H_{s,s'} = ∂²L_S/∂w_s∂w_s' the
m×m block of the loss Hessian with respect to W (Petzka et al. Def. 3, and their code, which sums
⟨W[i,:], W[j,:]⟩ · Tr H[i,:; j,:] over output neurons i, j):

    κ^φ_Tr(W) = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'}

For the last layer this Hessian block is exact in closed form: f_n is linear in W, so
∂²L_S/∂W_{sj}∂W_{s'k} = (1/n) Σ_n G_n[s,s'] φ_nj φ_nk with G_n = ∇²_f ℓ(f_n, y_n) (the loss's logit
Hessian), hence Tr H_{s,s'} = (1/n) Σ_n G_n[s,s'] ‖φ_n‖² and

    κ = (1/n) Σ_n ‖φ_n‖² ⟨W Wᵀ, G_n⟩_F

one forward pass, no Hessian-vector products. Only W enters (not the bias), as in the paper.

*Parameters.* The curvature is that of the last layer's weights W alone, by definition (Petzka et al. measure
one layer, the one whose inputs are the features); no parameter is left out of the value, though: every
other parameter (the bias, every earlier layer, normalization layers, an embedding) enters through the
features φ and the logits (G_n), so `info` names the layer (`layer`) and has no `left_out`.

Invariances. `layer`: rescaling the layer that produces φ by α (and W by 1/α) scales ‖φ‖² by α² and W Wᵀ
by 1/α²; rescalings between earlier layers change neither φ nor W. So κ is exactly layer-invariant.
Petzka's neuron-wise invariance concerns the *output* neurons of the feature layer (w_s → λ_s w_s, with
the next layer's inputs ÷ λ_s); for the logit layer those are the logits, which no function-preserving
rescaling of a cross-entropy network can scale. Rescaling the *feature* units (φ_j → c_j φ_j,
W[:, j] → W[:, j] / c_j, the contract's `node` family) changes κ in general (‖φ‖² and ⟨w_s, w_s'⟩ weigh
the units differently), so `relative_flatness` does not declare `node`.

`relative_flatness_normalized` first brings every feature unit to a canonical scale, as Petzka et al.'s
experiment code does before computing the measure (they divide each unit by its standard deviation):
φ̃_j = φ_j / r_j and W̃[:, j] = W[:, j] r_j with r_j = sqrt(mean_n φ_nj²) the unit's root mean square
over the measurement set (flatbench uses the RMS rather than the standard deviation so that a unit that
is constant but not zero keeps its weight; a unit that is zero on the whole set gets r_j = 0, i.e. its
column of W̃ is 0, which is what its contribution to the function is). Positive rescaling of a feature
unit multiplies r_j by the same factor, so the normalized network, and κ̃, is exactly invariant to
`node` and `layer` rescaling.

`bn`: rescaling a weight layer that is followed by BatchNorm (running statistics adjusted) changes
neither φ nor W, so both measures are BN-invariant. BatchNorm is in eval mode (running statistics);
nothing is perturbed, the measure only reads W and φ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure

PETZKA = "Petzka, Kamp, Adilova, Sminchisescu, Boley. Relative flatness and generalization. NeurIPS 2021"
"""The paper behind this module's measures."""


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The last nn.Linear in `model.modules()` order (the feature → logit layer), not counting an
    nn.MultiheadAttention's `out_proj` (a Linear the attention uses without calling it)."""
    inside = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    if not found:
        raise NotApplicable("the model has no nn.Linear layer (relative flatness needs a feature → logit "
                            "layer)")
    return found[-1]


def features_and_logits(model: nn.Module, layer: nn.Linear, x: Tensor) -> tuple[Tensor, Tensor]:
    """(φ, logits) for a chunk: φ is the input of `layer`, captured with a forward hook."""
    captured: dict[str, Tensor] = {}

    def hook(_module: nn.Module, args: tuple, out: Tensor) -> None:
        captured["phi"], captured["out"] = args[0], out

    handle = layer.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        handle.remove()
    if "phi" not in captured:
        raise NotApplicable("the last Linear layer is not called in the forward pass")
    phi, out = captured["phi"], captured["out"]
    if phi.dim() != 2 or out.shape != logits.shape or not torch.equal(out, logits):
        raise NotApplicable("the last Linear layer's output is not the model's logits "
                            "(relative flatness needs the logits to be linear in that layer's weights)")
    return phi, logits


def _kappa(ctx: MeasureContext, normalize: bool) -> tuple[float, dict[str, Any]]:
    name, layer = last_linear(ctx.model)
    weight = layer.weight.detach()
    rms = None
    dead = 0
    if normalize:
        sq = torch.zeros(weight.shape[1], dtype=weight.dtype, device=weight.device)
        for x, _ in ctx.chunks():
            phi, _ = features_and_logits(ctx.model, layer, x)
            sq += phi.pow(2).sum(dim=0)
        rms = (sq / ctx.n).sqrt()
        dead = int((rms == 0).sum())
        weight = weight * rms
    gram = weight @ weight.t()  # ⟨w_s, w_s'⟩
    total = 0.0
    for x, y in ctx.chunks():
        phi, logits = features_and_logits(ctx.model, layer, x)
        if rms is not None:
            safe = torch.where(rms > 0, rms, torch.ones_like(rms))
            phi = torch.where(rms > 0, phi / safe, torch.zeros_like(phi))
        g = ctx.loss.logit_hessian(logits, y)  # (n, C, C)
        total += float((phi.pow(2).sum(dim=1) * (g * gram).sum(dim=(1, 2))).sum())
    info: dict[str, Any] = {"method": "closed_form_last_layer", "layer": name,
                            "features": int(weight.shape[1]), "outputs": int(weight.shape[0])}
    if normalize:
        info["dead_features"] = dead
    return total / ctx.n, info


@register_measure(
    "relative_flatness", family="rescaled curvature", papers=(PETZKA,),
    description="Petzka et al. 2021: Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'} for the feature→logit layer "
                "(rows w_s, exact)",
    invariant_to=("layer", "bn"), cost="cheap", uses_loss=True)
def relative_flatness(ctx: MeasureContext) -> MeasureOutput:
    """κ^φ_Tr of the last Linear layer, exact closed form (see the module docstring)."""
    value, info = _kappa(ctx, normalize=False)
    return MeasureOutput({"relative_flatness": value}, info)


@register_measure(
    "relative_flatness_normalized", family="rescaled curvature", papers=(PETZKA,),
    description="relative flatness after normalizing each feature unit to unit RMS (as Petzka et al.'s "
                "experiments do), node-invariant",
    invariant_to=("layer", "node", "bn"), cost="cheap", uses_loss=True)
def relative_flatness_normalized(ctx: MeasureContext) -> MeasureOutput:
    """κ^φ_Tr on the feature-normalized network φ̃_j = φ_j / r_j, W̃[:, j] = W[:, j] r_j (r_j the RMS)."""
    value, info = _kappa(ctx, normalize=True)
    return MeasureOutput({"relative_flatness_normalized": value}, info)

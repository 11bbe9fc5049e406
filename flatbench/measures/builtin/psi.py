"""Yi et al.'s PSI-flatness: curvature with respect to the basis-path values of a bias-free ReLU MLP.

**Basis paths** (G-SGD, Meng et al. 2019). For an MLP with d inputs, L weight layers (PyTorch out × in),
C outputs and hidden layers of equal width h, the *skeleton* weights are `(i, i mod d)` in the first
layer, the diagonal `(i, i)` in the hidden-to-hidden layers and `(j mod C, j)` in the last layer. They
form h chains: input `c mod d` → hidden unit c of every layer → output `c mod C`. The basis paths are
the paths containing at most one non-skeleton weight: the h chains, and for every non-skeleton weight
e = W_l[i, j] the path that reaches its input j along chain j (from the input j itself in the first
layer) and continues from its output i along chain i (to the output i itself in the last layer). That
is m − H paths (m weights, H = (L − 1)·h hidden units), the dimension of the space of path values.

A path's value is the product of its weights; the values v are invariant to every node-wise (hence
layer-wise) rescaling. Given the signs of the skeleton weights outside the last layer (which no positive
rescaling changes), v determines the network up to such rescalings: `rebuild` sets those skeleton weights
to ±1, the last layer's skeleton weights to the chain values (times the sign of the rest of the chain),
and every non-skeleton weight to its basis value divided by the product of the other weights of its
path. (This is MEASURES.md's normalization with the free layer s = the last layer.)

**psi_flatness** = Tr ∇²_v L_S(θ(v)), the Hessian trace with respect to the basis-path values. It is
computed exactly in two parts:

- a non-skeleton value v_e enters θ(v) through its own weight only, linearly: θ_e = v_e / π_e with π_e
  the product of the other weights on its path. Hence ∂²L/∂v_e² = H_ee / π_e², with H_ee the exact
  Hessian diagonal of the loss in θ (shared with the other measures);
- a chain value v_c enters the last-layer skeleton weight (× t_c / v_c) and every non-skeleton weight
  whose path continues along chain c (÷ t_c / v_c): ∂²L/∂v_c² is the second derivative of the loss along
  that curve, computed by forward-over-forward automatic differentiation, `chain_batch` chains at a
  time (h such derivatives, each about four forward passes over the measurement set).

The map v → θ is not linear in the chain values, so away from a critical point of the loss the
second part includes the gradient term Σ_k ∂L/∂θ_k · ∂²θ_k/∂v_c², which can dominate and be negative
(an untrained network can have a large negative psi_flatness). Both parts are exactly what autograd
through the full map v → θ gives (tests check this against
`torch.autograd.functional.hessian` on a small net). The digest of the paper does not say which
functional of the basis-path Hessian it uses; flatbench reports the trace (the top eigenvalue is not
computed).

**psi_path_ratio** = max|v| / min|v| over the basis paths: the quantity in Yi et al.'s generalization
bound (`psi_path_ratio/log10` is its base-10 logarithm, `/max` and `/min` the extremes).

Both apply to bias-free ReLU MLPs (Linear layers separated by ReLU only, no BatchNorm, equal hidden
widths: G-SGD's skeleton is defined for that case). Any other model is reported as not applicable with
the reason. A skeleton weight that is exactly 0 leaves the basis-path coordinates undefined (also
reported as not applicable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import jvp, vmap

from flatbench.measures import shared
from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure
from flatbench.measures.registry import setting_range

YI = "Yi, Meng, Chen, Ma, Liu. Positively scale-invariant flatness of ReLU neural networks. 2019"
"""The paper behind this module's measures."""


# ---------------------------------------------------------------- structure


def mlp_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linear layers of a bias-free ReLU MLP with equal hidden widths, or NotApplicable(reason)."""
    if not isinstance(model, nn.Sequential):
        raise NotApplicable(f"defined for bias-free ReLU MLPs; {type(model).__name__} is not a plain "
                            "Sequential MLP")
    layers: list[tuple[str, nn.Linear]] = []
    expect_relu = False
    for name, module in model.named_children():
        kind = type(module).__name__
        if isinstance(module, nn.Linear):
            if module.bias is not None:
                raise NotApplicable(f"defined for bias-free ReLU MLPs; layer '{name}' has a bias (a bias "
                                    "adds paths that start at a hidden unit, outside G-SGD's basis)")
            if layers and not expect_relu:
                raise NotApplicable(f"layer '{name}' follows a Linear layer without a ReLU in between")
            layers.append((name, module))
            expect_relu = False
        elif isinstance(module, nn.ReLU):
            if not layers or expect_relu:
                raise NotApplicable(f"'{name}' (ReLU) is not between two Linear layers")
            expect_relu = True
        elif isinstance(module, nn.Flatten):
            if layers:
                raise NotApplicable(f"'{name}' (Flatten) after the first Linear layer")
        elif isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and not module.training):
            continue
        else:
            raise NotApplicable(f"defined for bias-free ReLU MLPs (Linear and ReLU only); '{name}' is a "
                                f"{kind}")
    if expect_relu:
        raise NotApplicable("the network ends with a ReLU, not with a Linear layer")
    if len(layers) < 2:
        raise NotApplicable("needs at least one hidden layer (a linear model has no rescaling symmetry)")
    widths = {layer.out_features for _, layer in layers[:-1]}
    if len(widths) > 1:
        got = [layer.out_features for _, layer in layers[:-1]]
        raise NotApplicable(f"G-SGD's skeleton needs equal hidden widths, got {got}")
    return layers


def skeleton(shapes: list[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """Per layer, (rows, cols) of the skeleton weights indexed by chain c = 0..h−1."""
    h = shapes[0][0]
    chains = torch.arange(h)
    out = []
    for l, (rows_n, cols_n) in enumerate(shapes):
        if l == 0:
            out.append((chains, chains % cols_n))
        elif l == len(shapes) - 1:
            out.append((chains % rows_n, chains))
        else:
            out.append((chains, chains))
    return out


def _skeleton_masks(shapes: list[tuple[int, int]], skel: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    masks = []
    for (r, c), shape in zip(skel, shapes):
        m = torch.zeros(shape, dtype=torch.bool)
        m[r, c] = True
        masks.append(m)
    return masks


def _path_multipliers(weights: list[Tensor], skel: list[tuple[Tensor, Tensor]]
                      ) -> tuple[Tensor, list[Tensor]]:
    """Chain values and, per layer, π[i, j]: the product of the other weights on the basis path of (i, j).

    Differentiable in the weights (used by `rebuild` and by the tests through autograd).
    """
    L = len(weights)
    sk = [w[r, c] for w, (r, c) in zip(weights, skel)]            # skeleton weight of chain c in layer l
    ones = torch.ones_like(sk[0])
    prefix = [sk[0]]
    for l in range(1, L):
        prefix.append(prefix[-1] * sk[l])
    suffix = [ones] * L
    suffix[L - 1] = sk[L - 1]
    for l in range(L - 2, -1, -1):
        suffix[l] = sk[l] * suffix[l + 1]
    multipliers = []
    for l, w in enumerate(weights):
        up = torch.ones(w.shape[1], dtype=w.dtype, device=w.device) if l == 0 else prefix[l - 1]
        down = torch.ones(w.shape[0], dtype=w.dtype, device=w.device) if l == L - 1 else suffix[l + 1]
        multipliers.append(down[:, None] * up[None, :])
    return prefix[L - 1], multipliers


@dataclass
class BasisPaths:
    """The basis-path coordinates of a bias-free ReLU MLP (see the module docstring)."""

    names: list[str]
    shapes: list[tuple[int, int]]
    skeleton: list[tuple[Tensor, Tensor]]
    masks: list[Tensor]
    """Skeleton positions per layer (True = skeleton)."""
    chain_values: Tensor
    """Values of the h all-skeleton paths."""
    values: list[Tensor]
    """Per layer, the basis value of each non-skeleton weight (entries at skeleton positions are 0)."""
    multipliers: list[Tensor]
    """Per layer, π: the product of the other weights on each entry's basis path."""
    signs: list[Tensor]
    """Signs of the skeleton weights of layers 0..L−2 (invariant to positive rescalings)."""

    @property
    def count(self) -> int:
        return int(self.chain_values.numel()) + sum(int((~m).sum()) for m in self.masks)

    def flat(self) -> Tensor:
        """All m − H basis-path values: the chains, then each layer's non-skeleton values."""
        return torch.cat([self.chain_values] + [v[~m] for v, m in zip(self.values, self.masks)])


def basis_paths(model: nn.Module) -> BasisPaths:
    layers = mlp_layers(model)
    weights = [layer.weight.detach().to(torch.float64) for _, layer in layers]
    shapes = [tuple(w.shape) for w in weights]
    skel = skeleton(shapes)
    masks = _skeleton_masks(shapes, skel)
    for (name, _), w, (r, c) in zip(layers, weights, skel):
        if bool((w[r, c] == 0).any()):
            raise NotApplicable(f"a skeleton weight of layer '{name}' is exactly 0: the basis-path "
                                "coordinates are undefined")
    chain, mult = _path_multipliers(weights, skel)
    values = [torch.where(m.to(w.device), torch.zeros_like(w), w * p)
              for w, p, m in zip(weights, mult, masks)]
    signs = [torch.sign(w[r, c]) for w, (r, c) in zip(weights[:-1], skel[:-1])]
    return BasisPaths([n for n, _ in layers], shapes, skel, masks, chain, values, mult, signs)


def rebuild(chain_values: Tensor, values: list[Tensor], signs: list[Tensor], shapes: list[tuple[int, int]]
            ) -> list[Tensor]:
    """The weights of the normalized network with the given basis-path values (differentiable in them).

    Skeleton weights of layers 0..L−2 are the given signs (±1), the last layer's skeleton weight of
    chain c is v_c times the product of those signs, and every non-skeleton weight is its value divided
    by the product of the other (already normalized) weights on its path.
    """
    skel = skeleton(shapes)
    masks = _skeleton_masks(shapes, skel)
    L = len(shapes)
    chain_sign = torch.ones_like(chain_values)
    for s in signs:
        chain_sign = chain_sign * s
    sk = [*signs, chain_values * chain_sign]
    # the skeleton alone determines every π (non-skeleton weights are never on another one's path)
    skel_weights = []
    for l, shape in enumerate(shapes):
        w = torch.zeros(shape, dtype=chain_values.dtype, device=chain_values.device)
        w = w.index_put((skel[l][0].to(w.device), skel[l][1].to(w.device)), sk[l])
        skel_weights.append(w)
    _, mult = _path_multipliers(skel_weights, skel)
    out = []
    for l in range(L):
        m = masks[l].to(chain_values.device)
        safe = torch.where(m, torch.ones_like(mult[l]), mult[l])
        out.append(torch.where(m, skel_weights[l], values[l] / safe))
    return out


# ---------------------------------------------------------------- the measures


def _chain_curvature(ctx: MeasureContext, names: list[str], paths: BasisPaths, batch: int) -> Tensor:
    """∂²L/∂v_c² for every chain c: the second derivative of the loss along the curve t_c ↦ θ(t).

    Moving v_c to t_c, with r_c = t_c / v_c, multiplies chain c's last-layer skeleton weight (k_c, c) by r_c
    and divides every non-skeleton weight of row c in layers 0..L−2 (those whose path continues along chain
    c) by r_c: every other basis-path value is unchanged. The result is the diagonal of the Hessian of the
    loss in the chain values, the other basis-path values held fixed.

    It is computed in closed form by propagating the first and second derivatives of every layer's
    pre-activation along the curve (second-order forward mode, written out for Linear + ReLU): with
    P_l the non-skeleton part of W_l (skeleton entries zeroed) and a_l the layer's input, in r at r = 1

        hidden l:  ż_l = −e_c (P_l a_l)_c + W_l ȧ_l,
                   z̈_l = 2 e_c (P_l a_l)_c − 2 e_c (P_l ȧ_l)_c + W_l ä_l,   ȧ_{l+1} = 1[z_l > 0] ż_l (ä alike),
        last L−1:  ż = e_k W[k, c] (a)_c + W ȧ,   z̈ = 2 e_k W[k, c] (ȧ)_c + W ä,

    then d²L/dr² = E[żᵀ ∇²ℓ ż + ∇ℓ · z̈] on the logits and d²L/dt_c² = d²L/dr² / v_c² (dr/dt = 1/v_c).
    The tangents of the first layer are zero but at unit c, so its products are per unit, and the dense
    tangents start after it: about n·h² operations per hidden layer after the first (n·h³ beyond the second)
    where forward-over-forward through the whole network cost ~4 forward passes per chain. The tests check
    it against autograd through θ(t) and against the full Hessian over the basis paths.
    """
    weights = [dict(ctx.model.named_parameters())[f"{n}.weight"].detach() for n in names]
    L = len(weights)
    h = int(paths.chain_values.numel())
    dtype, device = ctx.dtype, ctx.device
    v = paths.chain_values.to(device, torch.float64)
    nonskel = [(~paths.masks[l]).to(device, dtype) for l in range(L - 1)]
    P = [w * m for w, m in zip(weights, nonskel)]                       # non-skeleton parts, layers 0..L−2
    last_k, last_c = (t.to(device) for t in paths.skeleton[L - 1])
    w_last_skel = weights[-1][last_k, last_c]                           # (h,): W[k_c, c]
    loss = ctx.loss
    chains = torch.arange(h, device=device)
    total = torch.zeros(h, dtype=torch.float64, device=device)
    for x, y in ctx.chunks():
        a = x.reshape(x.shape[0], -1)
        weight = x.shape[0] / ctx.n
        # base pass: every layer's input a_l, pre-activation z_l and (P_l a_l)
        acts, pres, us = [a], [], []
        for l in range(L - 1):
            z = a @ weights[l].t()
            pres.append(z)
            us.append(a @ P[l].t())
            a = torch.relu(z)
            acts.append(a)
        logits = a @ weights[-1].t()
        for start in range(0, h, batch):
            block = chains[start:start + batch]                          # the chains c of this block
            total[block] += _chain_block(block, acts, pres, us, logits, weights, P, last_k, w_last_skel,
                                         loss, y, weight).to(torch.float64)
    return total / v.pow(2)


def _chain_block(block: Tensor, acts: list[Tensor], pres: list[Tensor], us: list[Tensor], logits: Tensor,
                 weights: list[Tensor], P: list[Tensor], last_k: Tensor, w_last_skel: Tensor, loss,
                 y: Tensor, weight: float) -> Tensor:
    """d²L/dr_c² (the chunk's share) for the chains in `block`: the recursion of `_chain_curvature`."""
    L = len(weights)
    b = int(block.numel())
    # layer 0: its tangents are zero but at unit c of each chain: ż = −u_c, z̈ = 2 u_c (then the ReLU)
    u0 = us[0][:, block]                                                 # (n, b)
    mask0 = (pres[0][:, block] > 0).to(u0.dtype)
    s_dot, s_ddot = -mask0 * u0, 2 * mask0 * u0                          # ȧ_1, ä_1 at unit c only
    if L == 2:
        a_dot = a_ddot = None
    else:
        # layer 1: W_1 times a one-hot tangent is column c of W_1 scaled, plus the e_c terms
        w1c = weights[1].t()[block]                                      # (b, h): W_1[:, c]
        z_dot = s_dot[:, :, None] * w1c[None]                            # (n, b, h)
        z_ddot = s_ddot[:, :, None] * w1c[None]
        diag_p1 = P[1][block, block]                                     # P_1[c, c] (0: skeleton)
        idx = torch.arange(b, device=block.device)
        z_dot[:, idx, block] -= us[1][:, block]
        z_ddot[:, idx, block] += 2 * us[1][:, block] - 2 * diag_p1 * s_dot
        mask = (pres[1] > 0).to(z_dot.dtype)[:, None, :]
        a_dot, a_ddot = mask * z_dot, mask * z_ddot
        for l in range(2, L - 1):                                        # deeper hidden layers: dense tangents
            z_dot = a_dot @ weights[l].t()
            z_ddot = a_ddot @ weights[l].t()
            pa = torch.einsum("nbi,bi->nb", a_dot, P[l][block])          # (P_l ȧ_l)_c
            z_dot[:, idx, block] -= us[l][:, block]
            z_ddot[:, idx, block] += 2 * us[l][:, block] - 2 * pa
            mask = (pres[l] > 0).to(z_dot.dtype)[:, None, :]
            a_dot, a_ddot = mask * z_dot, mask * z_ddot
    # the last layer: W ȧ plus the skeleton weight (k_c, c) of chain c moved by r
    w_last = weights[-1]
    k = last_k[block]
    skel_w = w_last_skel[block]                                          # (b,)
    a_in = acts[-1][:, block]                                            # a_{L−1}[c]
    if a_dot is None:                                                    # one hidden layer: one-hot tangents
        lin_dot = s_dot[:, :, None] * w_last.t()[block][None]            # (n, b, C)
        lin_ddot = s_ddot[:, :, None] * w_last.t()[block][None]
        at_c_dot = s_dot
    else:
        lin_dot = a_dot @ w_last.t()
        lin_ddot = a_ddot @ w_last.t()
        at_c_dot = a_dot[:, torch.arange(b, device=block.device), block]
    idx = torch.arange(b, device=block.device)
    lin_dot[:, idx, k] += skel_w * a_in
    lin_ddot[:, idx, k] += 2 * skel_w * at_c_dot

    def along(dz: Tensor, ddz: Tensor) -> Tensor:
        """φ''(0) for φ(s) = L(logits + s·ż + s²/2·z̈) (the chunk's mean loss times its weight)."""
        def phi(s: Tensor) -> Tensor:
            return loss(logits + s * dz + 0.5 * s * s * ddz, y) * weight

        def dphi(s: Tensor) -> Tensor:
            return jvp(phi, (s,), (torch.ones_like(s),))[1]
        return jvp(dphi, (torch.zeros((), dtype=logits.dtype, device=logits.device),),
                   (torch.ones((), dtype=logits.dtype, device=logits.device),))[1]

    return vmap(along, in_dims=(1, 1))(lin_dot, lin_ddot)


@register_measure(
    "psi_flatness", family="rescaled curvature", papers=(YI,),
    description="Yi et al. 2019: Tr of the Hessian with respect to the basis-path values "
                "(bias-free ReLU MLPs)",
    invariant_to=("layer", "node"), cost="hessian", uses_loss=True, defaults={"chain_batch": 16},
    settings_help={"chain_batch": "basis-path chains differentiated at once (memory against speed; the value "
                                  "does not depend on it); integer ≥ 1"},
    check=lambda s: setting_range("psi_flatness", s, {"chain_batch": ("min", 1)}))
def psi_flatness(ctx: MeasureContext) -> MeasureOutput:
    paths = basis_paths(ctx.model)
    result = shared.hessian_diagonal(ctx)
    nonskel = 0.0
    per_layer: dict[str, float] = {}
    for l, name in enumerate(paths.names):
        h_diag = result.diag[f"{name}.weight"].detach().to("cpu", torch.float64)
        m = ~paths.masks[l]
        per_layer[name] = float((h_diag[m] / paths.multipliers[l].cpu()[m].pow(2)).sum())
        nonskel += per_layer[name]
    chains = _chain_curvature(ctx, paths.names, paths, int(ctx.settings.get("chain_batch", 16)))
    chain_total = float(chains.sum())
    values = {"psi_flatness": nonskel + chain_total, "psi_flatness/chains": chain_total}
    values.update({f"psi_flatness/{n}": v for n, v in per_layer.items()})
    return MeasureOutput(values, {"loss": ctx.loss_name, "diagonal_method": result.method,
                                  "basis_paths": paths.count, "chains": int(paths.chain_values.numel())})


@register_measure(
    "psi_path_ratio", family="rescaled curvature", papers=(YI,),
    description="Yi et al. 2019: max|v| / min|v| over the basis-path values (bias-free ReLU MLPs)",
    invariant_to=("layer", "node", "logit_scale"), cost="cheap")
def psi_path_ratio(ctx: MeasureContext) -> MeasureOutput:
    paths = basis_paths(ctx.model)
    mags = paths.flat().abs()
    hi, lo = float(mags.max()), float(mags.min())
    ratio = hi / lo if lo > 0 else float("inf")
    log_ratio = math.log10(ratio) if lo > 0 else float("inf")
    return MeasureOutput({"psi_path_ratio": ratio, "psi_path_ratio/log10": log_ratio,
                          "psi_path_ratio/max": hi, "psi_path_ratio/min": lo},
                         {"basis_paths": paths.count, "zero_paths": int((mags == 0).sum())})

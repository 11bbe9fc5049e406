"""Norm-based baselines: Frobenius (sum and product), spectral (product), path norm.

These are the classic scale-dependent complexity measures (Jiang et al. 2020's "norm" family). None
declares an invariance except the path norm, and the invariance test matrix shows each undeclared family
changing them. The two product forms (`frobenius_norm_product`, `spectral_norm`, logs of Π_l ‖W_l‖²) are
nevertheless unchanged by a `layer` rescaling of a net **without BatchNorm**: it multiplies one weight
layer by α and the next by 1/α (and scales biases, which they ignore), so the product stays. They do not
declare `layer`, because a declaration holds for every architecture: with BatchNorm the `layer` family
puts α into the BatchNorm's affine parameters, which these norms do not see, and 1/α into the next weight
layer, so the product moves (as it does under `bn`, `node` and `logit_scale` everywhere). The test suite
checks both halves (tests/measures/test_invariance.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from flatbench.measures import shared
from flatbench.measures.builtin import JIANG
from flatbench.measures.plugin import MeasureContext, MeasureOutput, register_measure
from flatbench.measures.registry import setting_range


def _matrices(ctx: MeasureContext):
    return shared.matrices(ctx)


def _left_out(ctx: MeasureContext) -> dict:
    return {"left_out": shared.left_out(ctx)}


@register_measure("frobenius_norm", description="Σ_l ‖W_l‖_F² over the weight matrices (Linear, Conv, Embedding, "
                  "attention projections); what it leaves out in info.left_out", cost="cheap",
                  family="norm", papers=(JIANG,))
def frobenius_norm(ctx: MeasureContext) -> MeasureOutput:
    """Σ_l ‖W_l‖_F² over every weight matrix (`flatbench.measures.layers.weight_matrices`): the weights of the
    Linear, Conv1d/2d/3d, ConvTranspose and Embedding layers the forward pass calls, and of an
    nn.MultiheadAttention its query, key, value and output projections (the sum over its stacked
    `in_proj_weight` is the same whether counted as one matrix or three). Biases and normalization layers'
    affine parameters are left out (Jiang et al. 2020 define the norm over the layers' weight matrices),
    and so is any other parameter (a raw positional embedding, recurrent weights, a layer the forward pass
    does not call): all are named in `info["left_out"]` by group (`biases`, `normalization`, `other`). A
    parameter shared by several layers counts once."""
    per_layer = {f"frobenius_norm/{m.name}": float(m.weight.double().pow(2).sum()) for m in _matrices(ctx)}
    return MeasureOutput({"frobenius_norm": sum(per_layer.values()), **per_layer}, _left_out(ctx))


@register_measure("frobenius_norm_product", description="log Π_l ‖W_l‖_F² (the product form, as a log) over the "
                  "weight matrices of frobenius_norm", cost="cheap", family="norm", papers=(JIANG,))
def frobenius_norm_product(ctx: MeasureContext) -> MeasureOutput:
    """Σ_l log ‖W_l‖_F² over the weight matrices of `frobenius_norm` (an attention's query, key and value
    projections are three factors, as three separate maps of their inputs; what is left out is named in
    `info["left_out"]`). Unchanged by `layer` rescaling on nets without BatchNorm only (see the module
    docstring), hence no declared invariance."""
    logs = [math.log(float(m.weight.double().pow(2).sum())) for m in _matrices(ctx)]
    return MeasureOutput({"frobenius_norm_product": sum(logs)}, _left_out(ctx))


def _conv_operator(conv: nn.Module, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ↦ the convolution of x by `w` without bias (the layer's linear map, padding mode included)."""
    if isinstance(conv, nn.modules.conv._ConvTransposeNd):
        fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[w.dim() - 2]
        return lambda x: fn(x, w, None, conv.stride, conv.padding, conv.output_padding, conv.groups, conv.dilation)
    return lambda x: conv._conv_forward(x, w, None)


def _operator_norm(matrix, iters: int, tol: float, gen: torch.Generator) -> tuple[float, int]:
    """Largest singular value of the matrix's linear map (a convolution: the whole convolution operator)."""
    w = matrix.weight
    if not matrix.is_conv:
        return float(torch.linalg.matrix_norm(w.double(), ord=2)), 0
    op = _conv_operator(matrix.module, w)
    x = torch.randn((1, *matrix.input_shape), generator=gen, device=w.device, dtype=w.dtype)
    x = x / x.norm()
    sigma_sq = 0.0
    for it in range(1, iters + 1):
        x.requires_grad_(True)
        y = op(x)
        (grad,) = torch.autograd.grad(0.5 * y.pow(2).sum(), x)  # = Cᵀ C x
        new = float((x.detach() * grad).sum())
        x = (grad / grad.norm()).detach()
        if sigma_sq and abs(new - sigma_sq) <= tol * abs(new):
            return math.sqrt(max(new, 0.0)), it
        sigma_sq = new
    return math.sqrt(max(sigma_sq, 0.0)), iters


@register_measure("spectral_norm", description="log Π_l ‖W_l‖_2² over the weight matrices of frobenius_norm (conv "
                  "layers: power iteration on the convolution operator)", cost="cheap", family="norm",
                  papers=("Bartlett, Foster, Telgarsky. Spectrally-normalized margin bounds for neural networks. "
                          "NeurIPS 2017", JIANG),
                  defaults={"iters": 500, "tol": 1e-7},
                  settings_help={"iters": "power-iteration steps at most per conv layer (other matrices: exact "
                                          "SVD); integer ≥ 1",
                                 "tol": "power iteration stops when ‖W‖₂² changes by at most tol (relative); > 0"},
                  check=lambda s: setting_range("spectral_norm", s, {"iters": ("min", 1), "tol": ("gt", 0)}))
def spectral_norm(ctx: MeasureContext) -> MeasureOutput:
    """Σ_l log ‖W_l‖_2² over the weight matrices of `frobenius_norm`: Linear and Embedding weights and an
    attention's projections by an exact SVD (the query, key and value projections each its own matrix, as
    three separate maps of their inputs, rather than the stacked `in_proj_weight`, whose norm is that of x ↦
    (W_q x, W_k x, W_v x) and would tie the three together); a convolution's (Conv1d/2d/3d, ConvTranspose)
    norm is that of the whole convolution operator on the layer's input shape, by power iteration from a
    seeded start, so a scaled layer gives the scaled norm to rounding. What is left out (biases,
    normalization layers, other parameters) is named in `info["left_out"]`. Unchanged by `layer` rescaling
    on nets without BatchNorm only (see the module docstring), hence no declared invariance."""
    gen = ctx.generator()
    values, iters = {}, {}
    for matrix in _matrices(ctx):
        sigma, it = _operator_norm(matrix, ctx.settings["iters"], ctx.settings["tol"], gen)
        values[f"spectral_norm/{matrix.name}"] = sigma ** 2
        iters[matrix.name] = it
    total = sum(math.log(v) for v in values.values())
    return MeasureOutput({"spectral_norm": total, **values}, {"power_iterations": iters, **_left_out(ctx)})


def _squared_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers for the squared-weights network of the path norm.

    BatchNorm in eval mode is the per-channel affine map `a·x + b` with `a = γ/√(var+ε)`,
    `b = β − a·μ`; its squared counterpart is `a²·x + b²`, expressed through the module's own
    parameters by setting the running mean to 0 and the variance to 1 − ε.
    """
    state = {n: p.detach().pow(2) for n, p in model.named_parameters()}
    state.update({n: b for n, b in model.named_buffers()})
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            prefix = f"{name}." if name else ""
            scale = torch.rsqrt(module.running_var + module.eps)
            gamma = module.weight if module.weight is not None else torch.ones_like(scale)
            beta = module.bias if module.bias is not None else torch.zeros_like(scale)
            a = gamma.detach() * scale
            b = beta.detach() - a * module.running_mean
            if module.weight is not None:
                state[f"{prefix}weight"] = a.pow(2)
            if module.bias is not None:
                state[f"{prefix}bias"] = b.pow(2)
            state[f"{prefix}running_mean"] = torch.zeros_like(module.running_mean)
            state[f"{prefix}running_var"] = torch.full_like(module.running_var, 1.0 - module.eps)
    return state


class _SquaredConstants(TorchDispatchMode):
    """In the squared-weights network, a multiplication, division or addition by a constant c (a number, or a
    one-element tensor not computed from the parameters: what `traced_ops` calls a constant) uses c²: a
    constant scale is a path weight like any weight, squared (× c is × c², so × (−1) leaves the path norm as
    it is rather than making it negative), and a constant added is a bias, squared like the biases."""

    def __init__(self, parameters: list[torch.Tensor]):
        super().__init__()
        self.dependent = {id(t): t for t in parameters}
        """The tensors computed from a parameter, by id (held, so that no id is reused during the pass)."""

    def _depends(self, value: object) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) in self.dependent
        return isinstance(value, (list, tuple)) and any(self._depends(v) for v in value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _CONSTANT_OPS and len(args) > 1:
            c = args[1]
            if isinstance(c, (int, float)) or (isinstance(c, torch.Tensor) and c.numel() == 1
                                               and not self._depends(c)):
                args = (args[0], c * c, *args[2:])
        out = func(*args, **kwargs)
        if self._depends(args) or self._depends(list(kwargs.values())):
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.dependent[id(t)] = t
        return out


_CONSTANT_OPS = frozenset({"mul", "mul_", "div", "div_", "add", "add_"})


@register_measure("path_norm", description="Σ_paths Π_e w_e²: the squared-weights network on an all-ones "
                  "input (biases squared too)", cost="cheap", invariant_to=("layer", "node", "bn"), family="norm",
                  papers=("Neyshabur, Tomioka, Srebro. Norm-based capacity control in neural networks. COLT 2015",
                          JIANG))
def path_norm(ctx: MeasureContext) -> MeasureOutput:
    """Invariant to layer- and node-wise rescaling of ReLU nets: every path crosses a rescaled unit
    once on its way in (× c²) and once on its way out (÷ c²); a path starting at a bias starts with
    that unit's scaled bias. BatchNorm folds into a per-channel affine map that absorbs a rescaling of
    the layer before it. Not applicable to a network with other operations (GELU, LayerNorm, attention):
    its squared-weights network is not a sum over paths then."""
    shared.require_relu_network(ctx, "path_norm")
    ones = torch.ones((1, *ctx.inputs.shape[1:]), device=ctx.device, dtype=ctx.dtype)
    state = _squared_params(ctx.model)
    parameters = [state[n] for n, _ in ctx.model.named_parameters()]
    with torch.no_grad(), _SquaredConstants(parameters):
        out = functional_call(ctx.model, state, (ones,))
    value = float(out.sum())
    return MeasureOutput({"path_norm": value, "path_norm/log": math.log(value) if value > 0 else float("nan")})

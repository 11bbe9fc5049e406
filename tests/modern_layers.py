"""A catalogue of modern layers: tiny float64 models, each with its data and loss, small enough for a dense
Hessian by reverse over reverse (tests/curvature/test_modern_layers.py checks every curvature measure on
every case against it).

    from modern_layers import MODERN_LAYERS, layer_case, reference_hessian

    c = layer_case("pre_ln_transformer")   # LayerCase(name, model, inputs, targets, loss, exact_path, ...)
    h = reference_hessian(c)                # ∇²_θ of the mean loss, (d, d), reverse over reverse

Every case is untrained (seeded: the same weights at every call, a fresh module each time, so a test may
change it), in eval mode, with 6 examples, 3 classes and 48-209 parameters. The cases, one per layer
family flatbench's curvature engine treats differently or that a derivative mode may get wrong:

- `pre_ln_transformer`  — integer tokens → Embedding + a positional parameter the model holds itself →
  pre-LN block (LayerNorm → nn.MultiheadAttention → residual; LayerNorm → Linear-GELU-Linear → residual)
  → mean over tokens → Linear head;
- `post_ln_transformer` — nn.TransformerEncoderLayer (post-LN, GELU feed-forward, no dropout) on float
  token features → mean → head;
- `rms_norm`            — Linear → nn.RMSNorm → SiLU → Linear;
- `group_norm`          — Conv2d → GroupNorm(2 groups) → GELU → global average pooling → Linear;
- `instance_norm_1d`    — Conv1d → InstanceNorm1d(affine) → Softplus → Flatten → Linear;
- `instance_norm_2d`    — Conv2d → InstanceNorm2d(affine) → SiLU → global average pooling → Linear;
- `batch_norm_2d`       — Conv2d → BatchNorm2d in eval mode (random running statistics, affine) → SiLU →
  pooling → Linear;
- `batch_norm_1d_chain` — Linear → BatchNorm1d (eval, random running statistics) → GELU → Linear: a
  Sequential chain, so the smooth-chain exact diagonal applies (`curvature/smooth.py`);
- `mha_fused`           — nn.MultiheadAttention as it comes (packed in-projection, 2 heads) → mean → head.
  In eval mode where it sees no parameter that requires a gradient (under no_grad, and inside the jvp of
  reverse-over-forward) it takes the fused `_native_multi_head_attention` fast path, which has no
  forward-mode derivative (nn.TransformerEncoderLayer likewise `_transformer_encoder_layer_fwd`); with
  autograd it runs F.scaled_dot_product_attention, in its math form under `math_attention()`;
- `attention_math`      — a pre-LN attention block written out: an input Linear, LayerNorm, explicit q/k/v
  Linear projections, softmax(q kᵀ/√d) v, an output Linear, a residual addition (LayerNorm where no fused
  attention kernel stops reverse-over-forward);
- `embedding`           — integer tokens → Embedding → Flatten → Linear → Softplus → Linear;
- `residual_relu`       — a residual block written as a plain nn.Module, x + W₂ ReLU(W₁ x), → ReLU → head,
  with a focal loss of its own (a callable): the piecewise-linear exact diagonal applies
  (`curvature/diagonal.py`, the forward is traced);
- `sum_normalized_relu` — ReLU features divided by 1 + their sum, h / (1 + Σ_j h_j), in a plain module's
  forward (a hand-written normalization): only ReLU, sums, an addition and a division by a per-example
  number, yet not piecewise linear in the parameters;
- `smooth_mlp_focal`    — Sequential Linear-SiLU-Linear-GELU-Linear-Softplus-Linear with the focal loss:
  smooth chain with a loss whose logit Hessian comes from torch.func;
- `relu_mlp_smoothed`   — Sequential Linear-ReLU-Linear-ReLU-Linear with a label-smoothed cross-entropy
  named as `file.py:function` (this file): the case where minimum sharpness applies.

`exact_path` says which exact diagonal `HessianOperator.diagonal()` takes ("piecewise", "smooth" or
"dense": one second-order backward pass per parameter). The reference is `reference_hessian`:
`torch.autograd.functional.hessian` (reverse over reverse, not vectorized: no vmap, so it shares no batching
rule with the code under test) of the mean loss over the flat parameter vector, under `math_attention()`.
Unlike tests/cases.py's `dense_hessian` it does not use `torch.func.hessian` (forward over reverse, one of
the derivative modes under test).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian
from torch.func import functional_call

from flatbench.curvature import math_attention
from cases import eval_bn

CLASSES = 3
"""Classes of every case (the logits)."""

MODERN_LAYERS = ("pre_ln_transformer", "post_ln_transformer", "rms_norm", "group_norm", "instance_norm_1d",
                 "instance_norm_2d", "batch_norm_2d", "batch_norm_1d_chain", "mha_fused", "attention_math",
                 "embedding", "residual_relu", "sum_normalized_relu", "smooth_mlp_focal", "relu_mlp_smoothed")


# ---------------------------------------------------------------- losses of one's own


def focal_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Focal loss (Lin et al. 2017), γ = 2, per example: −(1 − p_y)² log p_y (its logit Hessian is not
    positive semi-definite everywhere)."""
    logp = F.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return -(1 - logp.exp()) ** 2 * logp


def label_smoothed_ce(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy with label smoothing 0.1, per example."""
    return F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="none")


LABEL_SMOOTHED_SPEC = f"{Path(__file__).resolve()}:label_smoothed_ce"
"""The label-smoothed loss as a user names it: `file.py:function`."""


# ---------------------------------------------------------------- the models


class PreLNTransformer(nn.Module):
    """Tokens → embedding + positions → pre-LN attention and GELU feed-forward blocks → mean → head."""

    def __init__(self, vocab: int = 6, tokens: int = 4, d: int = 4, heads: int = 2, hidden: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.5 * torch.randn(tokens, d))
        self.ln1 = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens) + self.pos
        a = self.ln1(h)
        h = h + self.att(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(1))


class PostLNTransformer(nn.Module):
    """nn.TransformerEncoderLayer (post-LN) → mean over tokens → head."""

    def __init__(self, d: int = 4, heads: int = 2, hidden: int = 6) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(d, heads, dim_feedforward=hidden, dropout=0.0,
                                                activation="gelu", batch_first=True, norm_first=False)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x).mean(1))


class FusedAttention(nn.Module):
    """nn.MultiheadAttention as it comes (packed in-projection) → mean → head."""

    def __init__(self, d: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.att(x, x, x, need_weights=False)[0].mean(1))


class MathAttention(nn.Module):
    """A pre-LN attention block written out on h = W x: h + o(softmax(q kᵀ / √d) v) with q, k, v Linear
    projections of LayerNorm(h) (one head); mean → head. LayerNorm without nn.MultiheadAttention, whose fused
    kernel stops reverse-over-forward, and on an input that depends on the parameters: in torch 2.14.1
    reverse-over-forward is wrong through LayerNorm only then (relative error 0.2-0.6 on a Linear → LayerNorm
    → Tanh net, 2e-16 with the LayerNorm on the data itself)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp, self.ln = nn.Linear(d, d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        a = self.ln(h)
        scores = self.q(a) @ self.k(a).transpose(-2, -1) / math.sqrt(x.shape[-1])
        return self.head((h + self.o(torch.softmax(scores, dim=-1) @ self.v(a))).mean(1))


class ResidualBlock(nn.Module):
    """x + W₂ ReLU(W₁ x) → ReLU → head: a residual block written as a plain module (not registered as a
    piecewise-linear container; its traced forward qualifies it)."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(x + self.fc2(torch.relu(self.fc1(x)))))


class SumNormalized(nn.Module):
    """Linear → ReLU → h / (1 + Σ_j h_j) → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(5, 6), nn.Linear(6, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc(x))
        return self.head(h / (1 + h.sum(-1, keepdim=True)))


# ---------------------------------------------------------------- the catalogue


@dataclass
class LayerCase:
    """One catalogue entry: a float64 model in eval mode, its data and its loss."""

    name: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor
    loss: str | Callable[[Tensor, Tensor], Tensor]
    """What `flatbench.measure(..., loss=)` gets: 'ce', a function (logits, targets) -> per-example losses,
    or a `file.py:function` spec."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """The same loss per example, as the reference computes it."""
    exact_path: str
    """Which exact diagonal applies: 'piecewise' (curvature/diagonal.py), 'smooth' (curvature/smooth.py) or
    'dense' (one second-order backward pass per parameter)."""

    @property
    def size(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def param_slices(self) -> dict[str, slice]:
        """Each parameter's slice of the flat vector (`named_parameters` order)."""
        out, start = {}, 0
        for name, p in self.model.named_parameters():
            out[name] = slice(start, start + p.numel())
            start += p.numel()
        return out


def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits, targets, reduction="none")


def _perturb_norm_affine(model: nn.Module, gen: torch.Generator) -> None:
    """Norm layers' affine parameters away from (1, 0), so their gradients are not at a special point."""
    kinds = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm)
    for m in model.modules():
        if isinstance(m, kinds):
            for p in m.parameters():
                p.data.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def layer_case(name: str, n: int = 6) -> LayerCase:
    """The catalogue case `name` (`MODERN_LAYERS`), freshly built and seeded (see the module doc)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    tokens = False
    loss: str | Callable = "ce"
    loss_fn: Callable = _ce
    path = "dense"
    if name == "pre_ln_transformer":
        model, shape, tokens = PreLNTransformer(), (4,), True
    elif name == "post_ln_transformer":
        model, shape = PostLNTransformer(), (3, 4)
    elif name == "rms_norm":
        model, shape = nn.Sequential(nn.Linear(5, 6), nn.RMSNorm(6), nn.SiLU(), nn.Linear(6, CLASSES)), (5,)
    elif name == "group_norm":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES))
        shape = (2, 4, 4)
    elif name == "instance_norm_1d":
        model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.InstanceNorm1d(3, affine=True), nn.Softplus(),
                              nn.Flatten(), nn.Linear(12, CLASSES))
        shape = (2, 4)
    elif name == "instance_norm_2d":
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.SiLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, CLASSES))
        shape = (1, 5, 5)
    elif name == "batch_norm_2d":
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.SiLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, CLASSES))
        shape = (2, 4, 4)
    elif name == "batch_norm_1d_chain":
        model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.GELU(), nn.Linear(6, CLASSES))
        shape, path = (5,), "smooth"
    elif name == "mha_fused":
        model, shape = FusedAttention(), (3, 4)
    elif name == "attention_math":
        model, shape = MathAttention(), (3, 4)
    elif name == "embedding":
        model = nn.Sequential(nn.Embedding(6, 3), nn.Flatten(), nn.Linear(12, 5), nn.Softplus(),
                              nn.Linear(5, CLASSES))
        shape, tokens = (4,), True
    elif name == "residual_relu":
        model, shape, path = ResidualBlock(), (5,), "piecewise"
        loss = loss_fn = focal_loss
    elif name == "sum_normalized_relu":
        model, shape = SumNormalized(), (5,)
    elif name == "smooth_mlp_focal":
        model = nn.Sequential(nn.Linear(5, 6), nn.SiLU(), nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 5),
                              nn.Softplus(), nn.Linear(5, CLASSES))
        shape, path = (5,), "smooth"
        loss = loss_fn = focal_loss
    elif name == "relu_mlp_smoothed":
        model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, CLASSES))
        shape, path = (5,), "piecewise"
        loss, loss_fn = LABEL_SMOOTHED_SPEC, label_smoothed_ce
    else:
        raise KeyError(f"no case {name!r} (choose one of {', '.join(MODERN_LAYERS)})")
    model = model.double().eval()
    with torch.no_grad():
        eval_bn(model, gen)
        _perturb_norm_affine(model, gen)
    if tokens:
        x = torch.randint(0, model.emb.num_embeddings if hasattr(model, "emb") else model[0].num_embeddings,
                          (n, *shape), generator=gen)
    else:
        x = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    return LayerCase(name, model, x, y, loss, loss_fn, path)


def reference_hessian(case: LayerCase) -> Tensor:
    """∇²_θ (1/n) Σ ℓ(f(x_n; θ), y_n) over the flat parameter vector (`named_parameters` order), by
    `torch.autograd.functional.hessian`: reverse over reverse, one backward pass per row (no vmap), under
    `math_attention()` (the fused attention kernels have no double backward). Float64."""
    model = case.model
    params = {k: p.detach() for k, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    slices = case.param_slices()

    def mean_loss(flat: Tensor) -> Tensor:
        d = {k: flat[slices[k]].view_as(p) for k, p in params.items()}
        return case.loss_fn(functional_call(model, (d, buffers), (case.inputs,)), case.targets).mean()

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    with math_attention():
        h = hessian(mean_loss, flat)
    return 0.5 * (h + h.t())

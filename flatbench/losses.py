"""Losses on the logits, with their per-example Hessian with respect to the logits.

`ce` is softmax cross-entropy; its logit Hessian has the closed form `diag(p) − ppᵀ` (independent of the
label). `normalized_ce` is flatbench's choice of Tsuzuku et al.'s normalized-softmax surrogate:

    ℓ(f, y) = CE(τ · (f − mean(f)) / ‖f − mean(f)‖₂, y)

It is unchanged by adding a constant to all logits of an example or by scaling them by c > 0, so it does
not see a rescaling of the last layer that changes no prediction. Its logit Hessian comes from
`torch.func` (it is not positive semi-definite in general).

`mse` is the mean squared error between the model's outputs and the targets, per example the mean over
the output dimensions; which targets, the targets' dtype says:

* integer class indices y (n,): one-hot targets, `ℓ(f, y) = (1/C) Σ_c (f_c − [c = y])²` (as
  `F.mse_loss(f, one_hot(y))` averages);
* floating-point regression targets t (n, k), or (n,) for a model with one output: `ℓ(f, t) =
  (1/k) Σ_j (f_j − t_j)²`.

Either way its logit Hessian is `(2/C) I` (C = k outputs). `ce` and `normalized_ce` are classification
losses (`CLASSIFICATION_LOSSES`): they take class indices only, and refuse floating-point targets (which
`F.cross_entropy` would read as class probabilities). A loss of one's own is named `file.py:function` or
`pkg.module:function`: a function `(logits (n, C), targets) -> (n,)` of per-example losses; its logit
Hessian comes from `torch.func`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import hessian, vmap

from flatbench.errors import FlatbenchError
from flatbench.userspec import current_sha256, is_factory_spec, load_object, spec_file

_NORM_EPS = 1e-12

CLASSIFICATION_LOSSES = ("ce", "normalized_ce")
"""The built-in losses defined on class indices only (`mse` also takes floating-point regression targets)."""


@dataclass(frozen=True)
class LogitLoss:
    """A loss ℓ(f, y) on one example's logits f ∈ R^C."""

    name: str
    tau: float = 1.0
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    """A loss of one's own: per-example losses of (logits, targets)."""

    def per_example(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """ℓ(f_n, y_n) for every row, shape (n,)."""
        if self.name in CLASSIFICATION_LOSSES and targets.is_floating_point():
            raise ValueError(f"loss {self.name} needs class-index targets, got floating-point (regression) targets "
                             f"{tuple(targets.shape)}: use mse")
        if self.name == "ce":
            return F.cross_entropy(logits, targets, reduction="none")
        if self.name == "mse":
            if targets.is_floating_point():  # regression: (n, k), or (n,) for one output
                return (logits - targets.reshape(logits.shape).to(logits.dtype)).pow(2).mean(dim=-1)
            onehot = F.one_hot(targets, logits.shape[-1]).to(logits.dtype)
            return (logits - onehot).pow(2).mean(dim=-1)
        if self.fn is not None:
            out = self.fn(logits, targets)
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape[:1]:
                scalar = isinstance(out, torch.Tensor) and out.ndim == 0
                raise FlatbenchError(f"loss '{self.name}' must return one loss per example (shape "
                                     f"{tuple(logits.shape[:1])}), got "
                                     + ("a scalar: compute it with reduction='none'" if scalar
                                        else str(getattr(out, 'shape', type(out).__name__))))
            return out
        centered = logits - logits.mean(dim=-1, keepdim=True)
        norm = centered.norm(dim=-1, keepdim=True).clamp_min(_NORM_EPS)
        return F.cross_entropy(self.tau * centered / norm, targets, reduction="none")

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the rows."""
        return self.per_example(logits, targets).mean()

    def logit_hessian(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """∇²_f ℓ(f_n, y_n) for every row, shape (n, C, C)."""
        if self.name == "ce":
            p = torch.softmax(logits, dim=-1)
            return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
        if self.name == "mse":
            c = logits.shape[-1]
            eye = torch.eye(c, dtype=logits.dtype, device=logits.device) * (2.0 / c)
            return eye.expand(logits.shape[0], c, c).clone()

        def single(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.per_example(f.unsqueeze(0), y.unsqueeze(0))[0]

        return vmap(hessian(single))(logits, targets)


BUILTIN_LOSSES = ("ce", "normalized_ce", "mse")


def loss_source(name: str | None) -> dict[str, str] | None:
    """What a result computed with a loss of one's own (`file.py:function`, `pkg.module:function`) records
    of it: the file its code lies in, with the function (`source`), and that file's sha256 now, so that an
    edited loss file makes its results stale (`measures.stale`, `runner.todo_entries`); None for a built-in
    loss (or a function given directly, which no stored result is kept for)."""
    if not isinstance(name, str) or name in BUILTIN_LOSSES or not is_factory_spec(name):
        return None
    path = spec_file(name)
    sha = current_sha256(path) if path is not None else None
    return {"source": f"{path or name.rpartition(':')[0]}:{name.rpartition(':')[2]}", "sha256": sha or "unknown"}


def check_loss_name(name: str) -> None:
    """A built-in loss or a loadable `file.py:function` / `pkg.module:function`; one line otherwise."""
    get_loss(name)


def get_loss(name: str | Callable[..., Any], tau: float = 1.0) -> LogitLoss:
    """A loss by name (ce, normalized_ce, mse), by `file.py:function` / `pkg.module:function`, or a
    function `(logits, targets) -> per-example losses` itself."""
    if callable(name) and not isinstance(name, str):
        return LogitLoss(name=getattr(name, "__name__", "custom"), tau=float(tau), fn=name)
    if is_factory_spec(name):
        return LogitLoss(name=name, tau=float(tau), fn=load_object(name, "loss"))
    if name not in BUILTIN_LOSSES:
        raise FlatbenchError(f"unknown loss '{name}' (choose from: {', '.join(BUILTIN_LOSSES)}, or a function "
                             "file.py:function / pkg.module:function)")
    return LogitLoss(name=name, tau=float(tau))

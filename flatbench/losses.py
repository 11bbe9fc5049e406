"""Losses on the logits, with their per-example Hessian with respect to the logits.

`ce` is softmax cross-entropy; its logit Hessian has the closed form `diag(p) − ppᵀ` (independent of the
label). `normalized_ce` is flatbench's choice of Tsuzuku et al.'s normalized-softmax surrogate:

    ℓ(f, y) = CE(τ · (f − mean(f)) / ‖f − mean(f)‖₂, y)

It is unchanged by adding a constant to all logits of an example or by scaling them by c > 0, so it does
not see a rescaling of the last layer that changes no prediction. Its logit Hessian comes from
`torch.func` (it is not positive semi-definite in general).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import hessian, vmap

from flatbench.errors import FlatbenchError

_NORM_EPS = 1e-12


@dataclass(frozen=True)
class LogitLoss:
    """A loss ℓ(f, y) on one example's logits f ∈ R^C."""

    name: str
    tau: float = 1.0

    def per_example(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """ℓ(f_n, y_n) for every row, shape (n,)."""
        if self.name == "ce":
            return F.cross_entropy(logits, targets, reduction="none")
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

        def single(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.per_example(f.unsqueeze(0), y.unsqueeze(0))[0]

        return vmap(hessian(single))(logits, targets)

    def logit_hessian_factors(self, logits: torch.Tensor, targets: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A signed factorization ∇²_f ℓ = Σ_c λ_c u_c u_cᵀ per row: (λ (n, C), U (n, C, C)), U[:, :, c] = u_c.

        For `ce` this uses the eigendecomposition too: it is exact and keeps C factors per example.
        """
        hess = self.logit_hessian(logits, targets)
        hess = 0.5 * (hess + hess.transpose(-1, -2))
        evals, evecs = torch.linalg.eigh(hess)
        return evals, evecs


def get_loss(name: str, tau: float = 1.0) -> LogitLoss:
    if name not in ("ce", "normalized_ce"):
        raise FlatbenchError(f"unknown loss '{name}' (choose from: ce, normalized_ce)")
    return LogitLoss(name=name, tau=float(tau))

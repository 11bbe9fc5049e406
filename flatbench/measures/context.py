"""`MeasureContext`: what a measure function sees, with lazily cached shared quantities.

One context per (model, loss). Shared quantities (the exact Hessian diagonal, per-layer traces) are
computed once through `ctx.cached(key, fn)` and reused by every measure that needs them; the cache is
shared between the contexts of one model, so keys that depend on the loss must include it. Random draws
that do not depend on the model's values are kept in `ctx.draws`, which every context of one run shares
(its rescaled copies included: their cache is fresh, their draws are the run's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from flatbench.curvature import HessianOperator
from flatbench.losses import CLASSIFICATION_LOSSES, get_loss
from flatbench.measures.registry import NotApplicable
from flatbench.seeding import probe_generator


@dataclass
class MeasureContext:
    """What a measure function sees (`ctx`): the model, the measurement set, the loss, the settings, seeded
    generators and a cache shared by every measure of the model. Read `ctx.model`, `ctx.inputs`,
    `ctx.targets`, `ctx.loss`, `ctx.hessian`, `ctx.settings`; draw random numbers from `ctx.generator(tag)`."""

    model: nn.Module
    """The trained model in eval mode, in the measure dtype, on the device."""
    inputs: torch.Tensor
    """The measurement set: training inputs (normalized), shape (n, ...); floating point in the measure
    dtype, or integer token ids as they came."""
    targets: torch.Tensor
    """The labels the model was trained on (the corrupted ones), class indices of shape (n,); or, given to
    `flatbench.measure` / `measure-model`, floating-point regression targets (n,) or (n, k) in the measure
    dtype (`regression`)."""
    num_classes: int
    """The model's number of outputs (classes; for regression targets (n, k), k)."""
    run_id: str = "run"
    seed: int = 0
    """The seed every random draw derives from (`generator`)."""
    loss_name: str = "ce"
    """The loss of this computation: ce, normalized_ce, mse or a loss of one's own (`loss` is the function)."""
    normalized_ce_tau: float = 1.0
    chunk_size: int = 2000
    """Examples per forward/backward chunk (`chunks`)."""
    max_memory_mb: int = 1024
    settings: dict[str, Any] = field(default_factory=dict)
    """The measure's settings: its registered defaults with the user's `measure.settings` / `settings=`."""
    model_config: Any = None
    """The run's ModelConfig (None for ad-hoc models in tests)."""
    measure_name: str = ""
    cache: dict[Any, Any] = field(default_factory=dict)
    draws: dict[Any, Any] = field(default_factory=dict)
    """Random numbers that depend only on the run's seed, the measure, its tag and the parameters' shapes,
    never on the parameters' values (`measures.shared.normal_draws`, the PAC-Bayes noise): shared by every
    context of one run, the dtype twins and the audit's rescaled copies included (`dataclasses.replace`
    keeps the dict), so a rescaled copy gets the very numbers it would draw alone without drawing them."""

    @property
    def device(self) -> torch.device:
        """Where the measurement set and the model are."""
        return self.inputs.device

    @property
    def dtype(self) -> torch.dtype:
        """The measure dtype: the inputs', or for integer inputs (token ids) the model's floating-point
        parameters' (float64 for a model without any)."""
        if self.inputs.is_floating_point():
            return self.inputs.dtype
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float64)

    @property
    def regression(self) -> bool:
        """Whether the targets are floating-point regression targets rather than class indices: then only
        `mse` and a loss of one's own apply, not `ce` / `normalized_ce`, and there is no accuracy."""
        return self.targets.is_floating_point()

    @property
    def n(self) -> int:
        """The number of examples of the measurement set."""
        return int(self.inputs.shape[0])

    @property
    def loss(self) -> Any:
        """The loss on the logits selected for this context: `ctx.loss(logits, targets)` is the mean over the
        rows, `ctx.loss.per_example(logits, targets)` the losses of each (shape (n,))."""
        self.check_loss(self.loss_name)
        return self.cached(("loss", self.loss_name, self.normalized_ce_tau),
                           lambda: get_loss(self.loss_name, tau=self.normalized_ce_tau))

    def check_loss(self, loss_name: str) -> None:
        """NotApplicable where a classification loss (`ce`, `normalized_ce`) meets regression targets: every
        measure computed with it (its own fixed loss included) says so instead of failing."""
        if self.regression and loss_name in CLASSIFICATION_LOSSES:
            raise NotApplicable(f"the loss {loss_name} needs class-index targets; these are floating-point "
                                f"regression targets {tuple(self.targets.shape)}, for which only mse (or a loss "
                                "of one's own) is defined")

    @property
    def hessian(self) -> HessianOperator:
        """H of this context's loss on its measurement set: what every curvature measure asks
        (`ctx.hessian @ v`, `.trace(...)`, `.diagonal(...)`, `.top_eigenvalues(...)`)."""
        return self.hessian_of(self.loss_name)

    def hessian_of(self, loss_name: str) -> HessianOperator:
        """H of the loss `loss_name` (with this context's normalized-CE temperature) on the measurement set."""
        self.check_loss(loss_name)
        loss = self.loss if loss_name == self.loss_name else get_loss(loss_name, tau=self.normalized_ce_tau)
        return HessianOperator(self.model, self.inputs, self.targets, loss, chunk_size=self.chunk_size)

    def generator(self, tag: str = "") -> torch.Generator:
        """A fresh generator for this measure, seeded from (seed, measure name, tag): not from the run id,
        so runs that differ only in their labels get the same probes."""
        return probe_generator(self.seed, self.measure_name, tag, device=self.device)

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()`, computed once per key and kept in a cache every measure of the model shares (a key
        that depends on the loss must include it)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def chunks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The measurement set as (inputs, targets) chunks of at most `chunk_size` examples."""
        return [(self.inputs[i:i + self.chunk_size], self.targets[i:i + self.chunk_size])
                for i in range(0, self.n, self.chunk_size)]

    def for_measure(self, name: str, settings: dict[str, Any], loss_name: str | None = None
                    ) -> MeasureContext:
        """A context for one measure and loss, sharing this one's data and cache."""
        return replace(self, measure_name=name, settings=settings,
                       loss_name=loss_name or self.loss_name, cache=self.cache)

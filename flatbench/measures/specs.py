"""What the registry holds: one `MeasureSpec` per registered measure, and the store of them.

The store only keeps specs: `flatbench.measures.plugins` loads the built-in measures and the plugins,
checks every registration and hands the checked specs here (`store`); `flatbench.measures.registry` reads
them (`all_measures`, `get_measure`, `resolve_names`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COST_CLASSES = ("cheap", "gradient", "hessian", "search")
COST_MEANING = {
    "cheap": "from the weights alone or one forward pass; no gradients",
    "gradient": "gradients or forward-mode products over the measurement set",
    "hessian": "the Hessian diagonal or Hessian-vector products over the measurement set",
    "search": "an iterative search or sampling over perturbed weights (many loss evaluations)"}
"""What each cost class means (`flatbench describe` prints it)."""
PRECISIONS = ("float64", "float32")
"""What a measure needs (`precision`): float64, or float32 for an estimate whose own error (Monte-Carlo,
a search, an iterative eigen-solver) is far above float32 rounding."""


@dataclass(frozen=True)
class MeasureSpec:
    name: str
    fn: Callable[..., Any]
    description: str
    invariant_to: frozenset[str]
    cost: str
    defaults: dict[str, Any]
    uses_loss: bool
    """Computed once per configured loss (`measure.losses`); non-ce results get an `@loss` suffix."""
    stochastic: bool
    """Monte-Carlo estimate: invariance is checked within its reported standard error."""
    larger_is_sharper: bool
    """Direction: True when a larger value means a sharper / worse-generalizing model."""
    exact: bool
    """An exact (deterministic, non-iterative-approximate) quantity; its invariances are tested to 1e-10 (closed
    forms) or 1e-9 (exact solvers) relative in float64 (tests/measures/test_invariance.py)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named presets of settings: `name:variant` is this measure with those settings (see module doc)."""
    base: str = ""
    """For a variant, the name of the measure it is a preset of (its result keys are renamed from it)."""
    preset: dict[str, Any] = field(default_factory=dict)
    """For a variant, the settings it fixes (they win over `measure.settings` of the base measure)."""
    origin: str = "builtin"
    """Where the measure comes from: "builtin", or the plugin (file or module) that registered it."""
    family: str = ""
    """The family the report groups the measure with (norm, curvature, rescaled curvature, sharpness,
    PAC-Bayes, or one's own); "" for the built-in measures, whose module decides. A plugin measure that
    names none is in the family named after its plugin (the file's or module's name)."""
    origin_sha256: str | None = None
    """A plugin measure: the sha256 of its plugin's source, recorded with every result (a changed plugin
    recomputes its entries); None for the built-in measures."""
    in_all: bool = True
    """Whether `all` includes the measure (False: asked for by name only)."""
    settings_help: dict[str, str] = field(default_factory=dict)
    """Per setting: its meaning and valid range (`flatbench describe` prints it; a setting without an entry
    is listed with its default only)."""
    precision: str = "float64"
    """The precision the measure needs. Under `measure.dtype: auto` (the default) an exact quantity or solver
    is computed in float64 and a measure registered with `precision="float32"` (Monte-Carlo estimates,
    searches, the Lanczos eigenvalue baseline: their own error is far above float32 rounding) in float32,
    which is 2-4x faster on a CPU; `measure.dtype: float64` or `float32` puts every measure in that dtype."""
    fixed_loss: str = ""
    """A measure that is not computed per configured loss but uses one loss of its own (`ce` for
    `normalized_sharpness` and `fisher_rao_norm`): asked for with another loss, its entry says so in `reason`."""
    check: Callable[[dict[str, Any]], None] | None = None
    """Checks the values of the measure's settings (raises `FlatbenchError` with one line) before any work."""
    added_settings: frozenset[str] = frozenset()
    """Settings added after results were stored whose default keeps the earlier computation (e.g. `rtol` = 0,
    no early stopping): a stored entry without one of them counts as computed at its default, so adding the
    setting does not make earlier results stale."""

    def settings(self, user: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The settings a computation uses: defaults, then the user's `measure.settings`, then the preset."""
        return {**self.defaults, **(user or {}).get(self.base_name, {}), **self.preset}

    @property
    def base_name(self) -> str:
        return self.base or self.name


REGISTERED: dict[str, MeasureSpec] = {}
"""Name → spec of every registered measure, checked before it is stored here; read it as it is (no loading:
`registry.all_measures` loads first)."""


def store(specs: dict[str, MeasureSpec]) -> None:
    """Keep checked specs (`flatbench.measures.plugins` checks them first)."""
    REGISTERED.update(specs)


def forget(origin: str) -> None:
    """Drop the measures of one plugin (an edited file's earlier version)."""
    for name in [n for n, s in REGISTERED.items() if s.origin == origin]:
        del REGISTERED[name]

"""Which family a measure belongs to, for grouping the report's figures and filtering its verdict table.

A registered measure may name its family (`spec.family`); otherwise the module that defines it decides,
through `MODULE_FAMILIES`: the report groups measures by what they compute (weight norms, the Hessian's
curvature, curvature rescaled to be invariant to reparametrizations, loss under weight perturbations,
PAC-Bayes noise), which is how the three papers and Jiang et al. compare them. A measure from a module
that is not listed (a user's plugin) is in the family named after its module; an unregistered one is in
"other".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flatbench.measures.keys import parse_key

MODULE_FAMILIES = {
    "norms": "norm", "fisher_rao": "norm",
    "hessian": "curvature",
    "normalized": "rescaled curvature", "minimum_sharpness": "rescaled curvature", "psi": "rescaled curvature",
    "rangamani": "rescaled curvature", "relative_flatness": "rescaled curvature",
    "sharpness": "sharpness",
    "pacbayes": "PAC-Bayes",
}
FAMILY_ORDER = ("norm", "curvature", "rescaled curvature", "sharpness", "PAC-Bayes")
OTHER = "other"


def spec_of(key: str, measure_info: Mapping[str, Any] | None) -> Any:
    """The registry's spec of a result key's measure (None when it is not registered)."""
    return (measure_info or {}).get(parse_key(key).measure)


def family_of(key: str, measure_info: Mapping[str, Any] | None) -> str:
    """The family of a result key (see the module doc)."""
    spec = spec_of(key, measure_info)
    if spec is None:
        return OTHER
    named = getattr(spec, "family", None)
    if named:
        return str(named)
    module = str(getattr(getattr(spec, "fn", None), "__module__", "") or "").rsplit(".", 1)[-1]
    return MODULE_FAMILIES.get(module, module or OTHER)


def family_rank(family: str) -> tuple[int, str]:
    """Sort key: the known families in `FAMILY_ORDER`, then the others by name, "other" last."""
    if family in FAMILY_ORDER:
        return FAMILY_ORDER.index(family), ""
    return len(FAMILY_ORDER) + (family == OTHER), family


def by_family(keys: list[str], families: Mapping[str, str]) -> list[str]:
    """The keys grouped by family (in `family_rank` order), keeping their order within a family."""
    return sorted(keys, key=lambda k: family_rank(families.get(k, OTHER)))

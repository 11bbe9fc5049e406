"""Which family a measure belongs to, for grouping the report's figures and filtering its verdict table.

A measure's family is given at its registration and kept on its spec (`spec.family`; a plugin measure that
names none is in the family named after its plugin); the specs reach the report from the study stage
(`measure_info`), so this floor reads no measure module. The report groups measures by what they compute
(weight norms, the Hessian's curvature, curvature rescaled to be invariant to reparametrizations, loss under
weight perturbations, PAC-Bayes noise), which is how the three papers and Jiang et al. compare them; an
unregistered measure is in "other".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flatbench.measures.keys import parse_key

FAMILY_ORDER = ("norm", "curvature", "rescaled curvature", "sharpness", "PAC-Bayes")
OTHER = "other"


def spec_of(key: str, measure_info: Mapping[str, Any] | None) -> Any:
    """The registry's spec of a result key's measure (None when it is not registered)."""
    return (measure_info or {}).get(parse_key(key).measure)


def family_of(key: str, measure_info: Mapping[str, Any] | None) -> str:
    """The family of a result key (see the module doc)."""
    return str(getattr(spec_of(key, measure_info), "family", "") or OTHER)


def family_rank(family: str) -> tuple[int, str]:
    """Sort key: the known families in `FAMILY_ORDER`, then the others by name, "other" last."""
    if family in FAMILY_ORDER:
        return FAMILY_ORDER.index(family), ""
    return len(FAMILY_ORDER) + (family == OTHER), family


def by_family(keys: list[str], families: Mapping[str, str]) -> list[str]:
    """The keys grouped by family (in `family_rank` order), keeping their order within a family."""
    return sorted(keys, key=lambda k: family_rank(families.get(k, OTHER)))

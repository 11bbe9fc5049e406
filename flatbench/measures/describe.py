"""`flatbench describe MEASURE`: everything a user needs to run one measure, generated from the registry.

The settings of a measure were findable only in its source and the tests (issue 29). This page is written
from the `MeasureSpec` alone (description, docstring, invariances, cost, defaults, `settings_help`,
variants), so a plugin's measure is described as fully as its registration says, with no extra step.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from flatbench.measures.registry import COST_MEANING, MeasureSpec, get_measure
from flatbench.rescale import FAMILIES

FAMILY_MEANING = {
    "layer": "a layer's weights and bias × α, the next weight layer ÷ α",
    "node": "a hidden unit's incoming weights and bias × c, its outgoing weights ÷ c",
    "bn": "a weight layer followed by BatchNorm scaled by c (BatchNorm's statistics adjusted)",
    "logit_scale": "the last layer × c (changes the loss, not the predictions)"}
"""One line per rescaling family (`flatbench.rescale`), for the invariance section."""


def config_value(value: Any) -> str:
    """A default as it is written in a config (YAML/JSON flow style)."""
    return json.dumps(value) if isinstance(value, str) else repr(value) if not isinstance(value, bool) \
        else str(value).lower()


def definition_lines(spec: MeasureSpec) -> list[str]:
    """The description and the function's docstring (its definition and how its settings act)."""
    doc = inspect.cleandoc(spec.fn.__doc__ or "").splitlines()
    if doc and doc[0].strip() == spec.description:  # the description defaulted to the first line
        doc = doc[1:]
    while doc and not doc[0].strip():
        doc = doc[1:]
    return [spec.description] + ([""] + doc if doc else [])


def invariance_lines(spec: MeasureSpec) -> list[str]:
    """Declared families with their meaning, or the statement that there are none."""
    if not spec.invariant_to:
        return ["none declared (scale-dependent: some function-preserving rescaling changes it)"]
    out = [f"{fam}: {FAMILY_MEANING.get(fam, '')}" for fam in FAMILIES if fam in spec.invariant_to]
    return out + [f"checked by `flatbench check-measure {spec.base_name}`"]


def fact_lines(spec: MeasureSpec) -> list[str]:
    """Cost, loss, precision, kind of result, direction and origin."""
    kind = "stochastic (Monte-Carlo; standard error in info)" if spec.stochastic else \
        "exact (closed form or exact solver)" if spec.exact else "deterministic approximation (iterative)"
    return [f"cost: {spec.cost} ({COST_MEANING.get(spec.cost, '')})",
            "loss: computed once per `measure.losses` entry (ce, normalized_ce, mse, one's own)" if spec.uses_loss
            else "loss: fixed by the measure (ignores `measure.losses`)",
            f"precision: {spec.precision} under `measure.dtype: auto`",
            f"result: {kind}; larger means {'sharper' if spec.larger_is_sharper else 'flatter'}",
            f"origin: {'built-in' if spec.origin == 'builtin' else spec.origin}"]


def setting_lines(spec: MeasureSpec) -> list[str]:
    """Every setting: name, default, and its meaning and valid range where the registry knows them."""
    if not spec.defaults:
        return ["none"]
    width = max(len(k) for k in spec.defaults)
    out = []
    for key, default in spec.defaults.items():
        fixed = f" (fixed to {config_value(spec.preset[key])} by this variant)" if key in spec.preset else ""
        help_text = spec.settings_help.get(key, "")
        out.append(f"{key.ljust(width)}  default {config_value(default)}{fixed}" + (f": {help_text}" if help_text else ""))
    return out


def example_lines(spec: MeasureSpec) -> list[str]:
    """How to ask for it, with one setting changed from its default: in a study config, on the command
    line, from Python (any setting listed above is given the same way; the rest keep their defaults)."""
    name, base = spec.name, spec.base_name
    free = [(k, v) for k, v in spec.defaults.items() if k not in spec.preset]
    lines = ["study config:", "  measure:", f"    measures: [{name}]"]
    if not free:
        return lines + ["command line:", f"  flatbench measure EXPERIMENT 'measure.measures=[{name}]'", "Python:",
                        f"  flatbench.measure(model, (x, y), [{json.dumps(name)}])"]
    key, value = free[0]
    flow = f"{{{base}: {{{key}: {config_value(value)}}}}}"
    py = f"{{{json.dumps(base)}: {{{json.dumps(key)}: {value!r}}}}}"
    return lines + [f"    settings: {flow}", "command line:",
                    f"  flatbench measure EXPERIMENT 'measure.measures=[{name}]' 'measure.settings={flow}'",
                    "Python:", f"  flatbench.measure(model, (x, y), [{json.dumps(name)}], settings={py})"]


def describe_measure(name: str) -> str:
    """The `flatbench describe` page of the measure (or variant `name:variant`) `name`; an unknown name
    is the registry's one-line error."""
    spec = get_measure(name)
    sections = [("", definition_lines(spec)), ("Invariant to", invariance_lines(spec)), ("Facts", fact_lines(spec)),
                ("Settings (measure.settings." + spec.base_name + ")", setting_lines(spec))]
    if spec.variants:
        sections.append(("Variants", [f"{spec.name}:{v}: " + ", ".join(f"{k}={config_value(x)}" for k, x in preset.items())
                                      for v, preset in spec.variants.items()]))
    sections.append(("Example", example_lines(spec)))
    out = [spec.name]
    for title, lines in sections:
        out += ([title] if title else []) + ["  " + line if line else "" for line in lines] + [""]
    return "\n".join(out).rstrip() + "\n"

"""The documentation site's page of one measure, in Markdown, generated from its registry entry.

The measure reference (docs/measures/) must not drift from the code, and a plugin's measure must be
documented as fully as a built-in one without extra work (issue 31). So a page is written from the
`MeasureSpec` alone, by the same pieces as `flatbench describe` (`flatbench.measures.describe`): the
definition (description and docstring), the invariances, the facts (cost, loss, precision, kind), every
setting with its default and its meaning and valid range, the variants, an example, and the papers (given
at the measure's registration).

`docs/hooks.py` calls `measure_page` for every registered measure when the site is built, and
`flatbench describe NAME --markdown` prints the same page (for a plugin: with `--plugin`).
"""

from __future__ import annotations

from flatbench.measures.describe import config_value, definition_lines, example_lines, fact_lines, invariance_lines
from flatbench.measures.registry import MeasureSpec, get_measure

def _settings_table(spec: MeasureSpec) -> list[str]:
    """Every setting as a Markdown table row: name, default, meaning and valid range."""
    if not spec.defaults:
        return ["None."]
    rows = ["| setting | default | meaning and valid range |", "| --- | --- | --- |"]
    for key, default in spec.defaults.items():
        fixed = f" (fixed to `{config_value(spec.preset[key])}` by this variant)" if key in spec.preset else ""
        meaning = spec.settings_help.get(key, "").replace("|", "\\|") or "(no description registered)"
        rows.append(f"| `{key}` | `{config_value(default)}`{fixed} | {meaning} |")
    return rows


def _papers(spec: MeasureSpec) -> list[str]:
    """The papers the measure was registered with; a plugin's page says where it was registered too."""
    papers = [f"- {paper}" for paper in spec.papers]
    if spec.origin != "builtin":
        return [*papers, *([""] if papers else []), f"Registered by the plugin `{spec.origin}`."]
    return papers or ["flatbench's own baseline."]


def measure_page(name: str) -> str:
    """The Markdown page of measure `name` (a variant `name:variant` too): one section per part of
    `flatbench describe`, with the settings as a table and the papers."""
    spec = get_measure(name)
    definition = definition_lines(spec)
    out = [f"# `{spec.name}`", "", definition[0], ""]
    if len(definition) > 2:  # the docstring: Markdown already (backticks for names, indented blocks for code)
        out += [*definition[2:], ""]
    out += ["## Invariant to", "", *[f"- {line}" for line in invariance_lines(spec)], ""]
    out += ["## Facts", "", *[f"- {line}" for line in fact_lines(spec)], ""]
    out += [f"## Settings (`measure.settings.{spec.base_name}`)", "", *_settings_table(spec), ""]
    if spec.variants:
        out += ["## Variants", ""]
        out += [f"- `{spec.name}:{v}`: " + ", ".join(f"`{k}={config_value(x)}`" for k, x in preset.items())
                for v, preset in spec.variants.items()]
        out.append("")
    out += ["## Example", "", "```text", *example_lines(spec), "```", "", "## Papers", "", *_papers(spec), ""]
    return "\n".join(out)

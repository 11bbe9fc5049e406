"""Print the README's generated tables: the config reference and the measure list (from the registry).

    python scripts/readme_tables.py config      # every config key, type, default, meaning
    python scripts/readme_tables.py measures    # every measure: invariances, cost, description

The config table is read from the config dataclasses themselves (each field's annotation, default and the
docstring under it), so the README cannot drift from the code (tests/test_config.py checks every key is
there).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.config import SECTIONS, field_types, to_plain, type_name  # noqa: E402


def config_reference() -> str:
    """Markdown table of every config key, its type, default and meaning."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines.append("| `name` | str | config file name | experiment folder name under `out` |")
    lines.append("| `out` | str | `results` | results root (the CLI's `--out` wins) |")
    lines.append("| `seed` | int | 0 | the run's seed; every random stream is derived from it and the fields that "
                 "shape the stream (labels, init, batches, probes) |")
    for section, cls in SECTIONS.items():
        body = ast.parse(inspect.getsource(cls)).body[0].body
        docs: dict[str, str] = {}
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and i + 1 < len(body):
                nxt = body[i + 1]
                if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                    docs[node.target.id] = " ".join(str(nxt.value.value).split())  # one table row
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{section}.{f.name}` | {type_name(types[f.name])} | "
                         f"`{json.dumps(to_plain(default))}` | {docs.get(f.name, '').replace(' | ', ' / ')} |")
    return "\n".join(lines)


def measures_table() -> str:
    from flatbench.measures import all_measures

    lines = ["| measure | invariant to | cost | loss | kind | dtype (auto) | description |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, spec in all_measures().items():
        inv = ", ".join(sorted(spec.invariant_to)) or "none"
        kind = "stochastic" if spec.stochastic else ("exact" if spec.exact else "iterative")
        loss = "per `measure.losses`" if spec.uses_loss else "fixed"
        desc = spec.description.replace("|", "\\|")
        if spec.variants:
            desc += " Variants: " + ", ".join(f"`{name}:{v}`" for v in spec.variants) + "."
        lines.append(f"| `{name}` | {inv} | {spec.cost} | {loss} | {kind} | {spec.precision} | {desc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "measures"
    print(config_reference() if what == "config" else measures_table())

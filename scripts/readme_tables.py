"""Print the README's generated tables: the config reference and the measure list (from the registry).

    python scripts/readme_tables.py config      # every config key, type, default, meaning
    python scripts/readme_tables.py measures    # every measure: invariances, cost, description
"""

from __future__ import annotations

import sys

from flatbench.config import config_reference
from flatbench.measures import all_measures


def measures_table() -> str:
    lines = ["| measure | invariant to | cost | loss | kind | description |", "| --- | --- | --- | --- | --- | --- |"]
    for name, spec in all_measures().items():
        inv = ", ".join(sorted(spec.invariant_to)) or "none"
        kind = "stochastic" if spec.stochastic else ("exact" if spec.exact else "iterative")
        loss = "per `measure.losses`" if spec.uses_loss else "fixed"
        desc = spec.description.replace("|", "\\|")
        lines.append(f"| `{name}` | {inv} | {spec.cost} | {loss} | {kind} | {desc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "measures"
    print(config_reference() if what == "config" else measures_table())

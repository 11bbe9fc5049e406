"""Redraw every committed audit figure (`audit_correlations.png`) from its `audit_correlations.csv` with
the current figure code, without re-running the audit (which needs the weights and hours of CPU).

    python scripts/redraw_audit_figures.py [EXPERIMENT_DIR ...]   (default: every study under results/cpu/)

The figures drawn by older versions showed a measure without a transformed value as a bar at τ = 0; the
current figure writes "n/a" with the audit's status there. The CSV files are not changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flatbench import store
from flatbench.analysis.audit_plots import audit_correlations_figure


def main() -> int:
    exps = [Path(a) for a in sys.argv[1:]] or sorted(p for p in (ROOT / "results" / "cpu").iterdir() if p.is_dir())
    for exp in exps:
        for csv in sorted([*exp.glob("audit_correlations.csv"), *exp.glob("*/audit_correlations.csv")]):
            corr = pd.read_csv(csv)
            family = ", ".join(sorted(set(corr["family"].astype(str))))
            store.atomic_write_bytes(csv.with_suffix(".png"), audit_correlations_figure(corr, "acc", family))
            print(f"{csv.with_suffix('.png')}: {len(corr)} rows, family {family}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How large are a study's logits at the end of training, and does that scale track the gap?

    python scripts/logit_scale.py results/cpu/tsuzuku_cifar10     # needs the runs' model.pt files

For every run: the median over the training set (the labels it was trained on) of the centered logit
norm ‖f − mean(f)‖ and of the margin (true-class logit minus the largest other one), then Kendall's τ of
each with the accuracy gap. docs/results/ uses it to show that runs stopped at the same train loss
still differ systematically in their logit scale, which every curvature measure of the plain
cross-entropy sees and the `normalized_ce` versions do not. The committed results/cpu/ folders hold no
weights: re-run the study first (scripts/run_cpu_studies.sh).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from scipy.stats import kendalltau

from flatbench.config import run_config_from_dict
from flatbench.data import load_dataset
from flatbench.models import load_model


def logit_scale(run: Path) -> tuple[float, float, float]:
    """(gap, median centered logit norm, median margin) of one finished run."""
    info = json.loads((run / "run.json").read_text())
    cfg = run_config_from_dict(info["config"])
    ds = load_dataset(cfg.data, cfg.seed)
    model = load_model(run).double()
    with torch.no_grad():
        z = model(ds.x_train.double())
    z = z - z.mean(1, keepdim=True)
    true = z.gather(1, ds.y_train[:, None]).squeeze(1)
    others = z.scatter(1, ds.y_train[:, None], float("-inf")).max(1).values
    return float(info["gap_acc"]), z.norm(dim=1).median().item(), (true - others).median().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", type=Path)
    exp = p.parse_args().experiment
    rows = [logit_scale(run) for run in sorted((exp / "runs").iterdir()) if (run / "model.pt").is_file()]
    if len(rows) < 3:
        raise SystemExit(f"error: {exp} has {len(rows)} runs with model.pt; re-run the study to get its weights")
    gaps = [r[0] for r in rows]
    for name, i in (("median centered logit norm", 1), ("median margin", 2)):
        values = [r[i] for r in rows]
        print(f"{exp.name}: {name}: {min(values):.3g} to {max(values):.3g}, "
              f"Kendall tau with the gap {kendalltau(gaps, values).statistic:+.2f} ({len(rows)} runs)")


if __name__ == "__main__":
    main()

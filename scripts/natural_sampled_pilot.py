"""The pilot behind configs/cpu/natural_sampled.yaml: in a Latin-hypercube design of training
hyperparameters crossed with data draws, how much of the accuracy gap lies between the configurations
once the draws are blocked, and what does a run cost?

    python scripts/natural_sampled_pilot.py --dataset fashion_mnist --cells 8 --draws 4 --out /tmp/nsp

One flatbench study (its `sample` section: `--cells` configurations of lr, weight decay, hidden width,
hidden depth, BatchNorm and batch size; seeds 0..draws-1, each its own data draw of `--n-train` training
images, the full 10,000-image test set), trained by flatbench's own train stage to train cross-entropy
0.01 within 5% (`train.endpoint_tolerance`). For the accuracy gap and the loss gap it prints the two-way
ANOVA without interaction, gap ~ draw + cell (one run per draw and cell):

    share of the draws   SS_draw / SS_total
    partial ω²(effect)   df·(MS_effect − MS_error) / (df·MS_effect + (N − df)·MS_error)

flatbench.analysis has no such decomposition (its statistics are rank correlations), so it is computed
here with numpy (`decompose`). A cell with a run that missed the endpoint is left out whole (the
two-way table must be complete), and said so. Then the wall time per run and the cost of a study of
`--plan CELLSxDRAWS` runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flatbench.analysis.stats.anova import variance_decomposition  # noqa: E402
from flatbench.config.parse import load_study, load_yaml, parse_study  # noqa: E402
from flatbench.store import read_json  # noqa: E402
from flatbench.study.train import train_study  # noqa: E402

AXES = load_yaml(ROOT / "configs" / "cpu" / "natural_sampled.yaml")["sample"]["axes"]
"""The sampled axes: the study's own (configs/cpu/natural_sampled.yaml), read, so the pilot cannot drift from
the design it pilots."""


def study_config(dataset: str, n_train: int, cells: int, draws: int, epochs: int, design_seed: int) -> dict:
    """The pilot's study: the natural_sampled study's settings at `cells` configurations and `draws` draws."""
    return {"name": f"pilot_{dataset}", "seed": list(range(draws)),
            "data": {"dataset": dataset, "n_train": n_train, "random_label_ratio": 0.0},
            "model": {"name": "mlp"},
            "train": {"optimizer": "adam", "epochs": epochs, "target_train_loss": 0.01, "endpoint_tolerance": 0.05,
                      "eval_every": 1, "test_every": 10, "checkpoint_every": 10, "vectorize": "off", "workers": 2},
            "sample": {"method": "latin_hypercube", "n": cells, "seed": design_seed, "axes": AXES}}


def decompose(gap: np.ndarray) -> dict[str, float]:
    """Two-way ANOVA without interaction of a complete draws × cells table (one value each), by the report's
    own `variance_decomposition` (variance.csv): the shares of the sum of squares, the partial ω² of the
    cells and of the draws, the cells' F and the residual standard deviation."""
    d, c = gap.shape
    draws, cells = np.repeat(np.arange(d), c), np.tile(np.arange(c), d)
    rows = variance_decomposition(gap.ravel(), draws, cells).set_index("effect")
    residual = rows.loc["residual"]
    return {"draw_share": rows.loc["draw", "share"], "cell_share": rows.loc["cell", "share"],
            "error_share": residual["share"], "omega2_cell": rows.loc["cell", "partial_omega2"],
            "omega2_draw": rows.loc["draw", "partial_omega2"], "F_cell": rows.loc["cell", "F"],
            "residual_sd": float(np.sqrt(residual["ss"] / residual["df"]))}


def leave_one_cell_out(gap: np.ndarray) -> tuple[float, int]:
    """The smallest partial ω² of the cells with one cell left out, and that cell's column: whether the
    cells' share rests on a single configuration."""
    values = [decompose(np.delete(gap, j, axis=1))["omega2_cell"] for j in range(gap.shape[1])]
    return min(values), int(np.argmin(values))


def gap_table(infos: list[dict], key: str) -> tuple[np.ndarray, list[int], list[int]]:
    """draws × cells table of one gap over the cells whose every run reached the endpoint."""
    draws = sorted({i["config"]["seed"] for i in infos})
    cells = sorted({i["config"]["sample_cell"] for i in infos})
    by = {(i["config"]["seed"], i["config"]["sample_cell"]): i for i in infos}
    complete = [c for c in cells if all(by.get((d, c), {}).get("reached_target") for d in draws)]
    table = np.array([[by[(d, c)][key] for c in complete] for d in draws], dtype=float)
    return table, complete, [c for c in cells if c not in complete]


def report(infos: list[dict]) -> None:
    """Per cell: its values and mean gaps; then the decomposition of each gap."""
    for cell in sorted({i["config"]["sample_cell"] for i in infos}):
        runs = [i for i in infos if i["config"]["sample_cell"] == cell]
        cfg = runs[0]["config"]
        print(f"  cell {cell}: lr {cfg['train']['lr']:.3g}, wd {cfg['train']['weight_decay']:.3g}, widths "
              f"{cfg['model']['widths']}, bn {cfg['model']['batch_norm']}, batch {cfg['train']['batch_size']}: "
              f"gap acc {np.mean([r['gap_acc'] for r in runs]):.4f} "
              f"(sd {np.std([r['gap_acc'] for r in runs], ddof=1):.4f}), "
              f"loss {np.mean([r['gap_loss'] for r in runs]):.3f}, epochs "
              f"{min(r['epochs'] for r in runs)}-{max(r['epochs'] for r in runs)}, "
              f"{np.mean([r['seconds'] for r in runs]):.1f} s per run, "
              f"{sum(bool(r.get('reached_target')) for r in runs)}/{len(runs)} at the endpoint")
    for key in ("gap_acc", "gap_loss"):
        table, complete, dropped = gap_table(infos, key)
        if table.shape[1] < 2 or table.shape[0] < 2:
            print(f"{key}: fewer than 2 complete cells or draws, no decomposition")
            continue
        r = decompose(table)
        low, without = leave_one_cell_out(table) if table.shape[1] > 2 else (float("nan"), -1)
        print(f"{key} ~ draw + cell ({table.shape[0]} draws x {len(complete)} cells"
              + (f"; cells {dropped} left out: a run missed the endpoint" if dropped else "") + "): "
              f"draw share {r['draw_share']:.3f}, cell share {r['cell_share']:.3f}, residual share "
              f"{r['error_share']:.3f}; partial omega^2 cells {r['omega2_cell']:.3f}, draws {r['omega2_draw']:.3f}; "
              f"(at least {low:.3f} with one cell left out: {complete[without] if without >= 0 else '-'}); "
              f"F(cells) {r['F_cell']:.1f}; residual sd {r['residual_sd']:.4f}; range of the gap "
              f"{table.min():.4f} .. {table.max():.4f}, of the cell means {table.mean(axis=0).min():.4f} .. "
              f"{table.mean(axis=0).max():.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--cells", type=int, default=8)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--design-seed", type=int, default=0)
    ap.add_argument("--plan", default="24x10", help="CELLSxDRAWS of the study whose cost is extrapolated")
    ap.add_argument("--out", default="/tmp/natural_sampled_pilot")
    ap.add_argument("--config", default=None, help="a sampled study config to decompose instead of the pilot's "
                    "(e.g. configs/cpu/natural_sampled.yaml with --out results/cpu: its finished runs are read, "
                    "the others trained)")
    args = ap.parse_args()
    if args.config:
        study = load_study(args.config, out=args.out)
        args.cells, args.draws = len({r.sample_cell for _, r in study.runs}), len({r.seed for _, r in study.runs})
    else:
        study = parse_study(study_config(args.dataset, args.n_train, args.cells, args.draws, args.epochs,
                                         args.design_seed), out=args.out)
    first = study.runs[0][1]
    print(f"{study.name}: {len(study.runs)} runs ({args.cells} cells x {args.draws} draws), {first.data.dataset}, "
          f"n_train {first.data.n_train}, test set {first.data.n_test or 'full'}, endpoint train CE "
          f"{first.train.target_train_loss} (tolerance {first.train.endpoint_tolerance}), at most "
          f"{first.train.epochs} epochs", flush=True)
    t0 = time.perf_counter()
    train_study(study, torch.device("cpu"), quiet=True)
    wall = time.perf_counter() - t0
    infos = [read_json(study.exp_dir / "runs" / rid / "run.json") for rid in study.run_ids()]
    report(infos)
    cells, draws = (int(x) for x in args.plan.split("x"))
    per_run = wall / len(infos)
    cpu = sum(i["seconds"] for i in infos)
    print(f"wall {wall:.0f} s for {len(infos)} runs (2 worker processes): {per_run:.1f} s of wall per run, "
          f"{cpu / len(infos):.1f} s of training per run (sum of run seconds {cpu:.0f} s)")
    print(f"extrapolated: {cells * draws} runs ({args.plan}) train in about {per_run * cells * draws / 60:.0f} min "
          "of wall at this machine's load")


if __name__ == "__main__":
    main()

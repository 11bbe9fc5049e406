"""The pilot behind configs/cpu/natural.yaml: which training hyperparameters move the generalization gap
beyond replicate noise, at random-label ratio 0?

    python scripts/natural_pilot.py --dataset fashion_mnist --replicates 3 --out /tmp/pilot

A one-factor-at-a-time design around a centre configuration: for every candidate axis, each of its levels
with every other axis at the centre, `--replicates` independent replicates each (replicate k: run seed k,
data draw k). Every run is trained by flatbench's own train stage (the study's training settings: Adam, train
loss target, 2 worker processes). For each axis, for the accuracy gap and the loss gap, it prints the mean
gap per level, the replicate
standard deviation within levels (pooled), the one-way F test of "the levels differ" with the draw as a
block, and the spread of the level means in units of the replicate noise of one run.

From the per-axis effects it also predicts, for the full product of the chosen levels under an additive
model, the share of the gap's variance between configurations net of replicate noise:
    share = V_cells / (V_cells + σ²),   V_cells = Σ_axis Var(level means) − (noise in the level means)
which is what the natural study must bring above one half (issue 27).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flatbench.config.parse import parse_study  # noqa: E402
from flatbench.store import read_json  # noqa: E402
from flatbench.study.train import train_study  # noqa: E402

CENTRE = {"model.widths": [128, 128], "train.lr": 0.001, "train.batch_size": 64,
          "train.weight_decay": 0.0, "data.augment": False, "model.dropout": 0.0, "model.batch_norm": False,
          "model.bias": True}
CANDIDATES = {
    "depth": ("model.widths", [[128], [128, 128], [128, 128, 128]]),
    "width": ("model.widths", [[32, 32], [128, 128], [512, 512]]),
    "lr": ("train.lr", [0.0003, 0.001, 0.003]),
    "batch_size": ("train.batch_size", [16, 64, 256]),
    "batch_size_wide": ("train.batch_size", [8, 64, 512]),
    "weight_decay": ("train.weight_decay", [0.0, 0.0005]),
    "weight_decay_large": ("train.weight_decay", [0.0, 0.005]),
    "dropout": ("model.dropout", [0.0, 0.3, 0.6]),
    "augment": ("data.augment", [False, True]),
    "sgd_lr": ("train.lr", [0.01, 0.03, 0.1]),
    "momentum": ("train.momentum", [0.0, 0.9]),
    "batch_norm": ("model.batch_norm", [False, True]),
    "bias": ("model.bias", [True, False]),
}
"""Candidate axes (name: the config field and its levels); `--axes` picks some, in this order."""


def base_config(dataset: str, n_train: int, replicates: int, target: float, epochs: int) -> dict:
    """The settings every pilot run shares (those of the natural study)."""
    return {"seed": list(range(replicates)),
            "data": {"dataset": dataset, "n_train": n_train, "random_label_ratio": 0.0},
            "model": {"name": "mlp"},
            "train": {"optimizer": "adam", "epochs": epochs, "target_train_loss": target, "eval_every": 1,
                      "vectorize": "off", "workers": 2}}


def with_values(raw: dict, values: dict) -> dict:
    out = copy.deepcopy(raw)
    for key, value in values.items():
        section, field = key.split(".")
        out[section][field] = value
    return out


def train_point(raw: dict, out: Path, name: str) -> list[dict]:
    """Train one configuration's replicates (a study of its own) and return their run.json contents; a run
    finished earlier under `out` (by another point's study with the same run) is read, not trained again."""
    study = parse_study({**raw, "name": name}, out=str(out))
    found = {}
    for rid in study.run_ids():
        done = [p for p in out.glob(f"*/runs/{rid}/run.json") if read_json(p).get("status") == "finished"]
        if done:
            found[rid] = read_json(done[0])
    if len(found) < len(study.runs):
        train_study(study, torch.device("cpu"), quiet=True)
        found = {rid: read_json(out / name / "runs" / rid / "run.json") for rid in study.run_ids()}
    return [found[rid] for rid in study.run_ids()]


def axis_summary(axis: str, gaps: dict[str, np.ndarray]) -> dict:
    """Level means, pooled replicate SD, F test with the draw as a block, spread in noise units."""
    levels = list(gaps)
    matrix = np.stack([gaps[lv] for lv in levels])  # levels × replicates (the same draws in every level)
    level_means = matrix.mean(axis=1)
    resid = matrix - level_means[:, None] - matrix.mean(axis=0)[None, :] + matrix.mean()
    k, r = matrix.shape
    df_err = (k - 1) * (r - 1)
    ms_err = float((resid ** 2).sum() / df_err) if df_err else float("nan")
    ms_lev = float(r * ((level_means - matrix.mean()) ** 2).sum() / (k - 1))
    f = ms_lev / ms_err if ms_err > 0 else float("inf")
    p = float(stats.f.sf(f, k - 1, df_err)) if df_err else float("nan")
    sd = float(np.sqrt(matrix.var(axis=1, ddof=1).mean()))
    return {"axis": axis, "levels": levels, "means": level_means.tolist(), "replicate_sd": sd,
            "block_residual_sd": float(np.sqrt(ms_err)), "F": f, "p": p,
            "range_in_sd": float((level_means.max() - level_means.min()) / sd) if sd > 0 else float("inf"),
            "var_level_means": float(level_means.var(ddof=0)), "r": r}


def predicted_share(summaries: list[dict]) -> tuple[float, float, float]:
    """(V_cells, σ², share) for the full product under an additive model, net of replicate noise."""
    sigma2 = float(np.mean([s["replicate_sd"] ** 2 for s in summaries]))
    v_cells = sum(max(0.0, s["var_level_means"] - sigma2 / s["r"] * (1 - 1 / len(s["levels"])))
                  for s in summaries)
    return v_cells, sigma2, v_cells / (v_cells + sigma2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--replicates", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.01, help="train-loss target (Jiang et al.: 0.01)")
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--out", default="/tmp/natural_pilot")
    ap.add_argument("--json", default=None, help="also write the summaries to this file")
    ap.add_argument("--centre", default="{}", help="JSON: centre values to change, e.g. "
                    '\'{"train.optimizer": "sgd", "train.lr": 0.03}\'')
    ap.add_argument("--axes", default="depth,lr,batch_size,weight_decay,augment",
                    help=f"comma-separated candidate axes, of: {', '.join(CANDIDATES)}")
    args = ap.parse_args()
    out = Path(args.out)
    raw = base_config(args.dataset, args.n_train, args.replicates, args.target, args.epochs)
    centre = {**CENTRE, **json.loads(args.centre)}
    t0 = time.perf_counter()
    cache: dict[str, list[dict]] = {}
    print(f"dataset {args.dataset}, n_train {args.n_train}, {args.replicates} replicates, target loss "
          f"{args.target}; centre {json.dumps(centre)}")
    summaries: dict[str, list[dict]] = {"gap_acc": [], "gap_loss": []}
    for name in args.axes.split(","):
        axis, levels = CANDIDATES[name]
        gaps: dict[str, dict[str, np.ndarray]] = {"gap_acc": {}, "gap_loss": {}}
        for level in levels:
            point = {**centre, axis: level}
            key = json.dumps(point, sort_keys=True)
            if key not in cache:
                name_hash = hashlib.sha256(key.encode()).hexdigest()[:8]  # a point's folder: reused on re-runs
                infos = train_point(with_values(raw, point), out, f"p{name_hash}")
                cache[key] = infos
                missed = sum(1 for i in infos if not i.get("reached_target"))
                epochs = [i["epochs"] for i in infos]
                print(f"  {key}: gap acc {np.mean([i['gap_acc'] for i in infos]):.4f}, loss "
                      f"{np.mean([i['gap_loss'] for i in infos]):.4f}, epochs {min(epochs)}-{max(epochs)}, "
                      f"{np.mean([i['seconds'] for i in infos]):.1f} s per run"
                      + (f", {missed} missed the target" if missed else ""), flush=True)
            for gap in gaps:
                gaps[gap][json.dumps(level)] = np.array([i[gap] for i in cache[key]])
        for gap, by_level in gaps.items():
            s = axis_summary(f"{axis} ({name})", by_level)
            summaries[gap].append(s)
            means = ", ".join(f"{lv} {m:.4f}" for lv, m in zip(s["levels"], s["means"]))
            print(f"{gap} {s['axis']}: {means}; replicate sd {s['replicate_sd']:.4f}; range "
                  f"{s['range_in_sd']:.1f} sd; F {s['F']:.1f}, p {s['p']:.2g}", flush=True)
    for gap, rows in summaries.items():
        v, sigma2, share = predicted_share(rows)
        print(f"{gap}: predicted for the full product of these axes (additive): between-configuration "
              f"variance {v:.3g}, replicate variance {sigma2:.3g}, share net of noise {share:.2f}")
    print(f"{len(cache)} configurations x {args.replicates} replicates in {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()

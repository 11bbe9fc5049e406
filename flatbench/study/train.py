"""The train stage: every unfinished run of a study (or of a shard of it), one by one or in vectorized
groups, after checking everything that can be checked first."""

from __future__ import annotations

from pathlib import Path

import torch

from flatbench.config import Study
from flatbench.errors import FlatbenchError
from flatbench.store import RUN_JSON, RunLocked, is_finished, run_dir
from flatbench.study.spec import (Echo, check_data, check_output_dir, check_study, save_study, shard_runs,
                                  show_progress)


def train_study(study: Study, device: torch.device, *, shard: tuple[int, int] | None = None,
                quiet: bool = False, echo: Echo = print, run_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Train every unfinished run of the (shard of the) study; returns run ids by outcome.

    Runs that `train.vectorize` groups (see `flatbench.vectorized`) train at once, the others one after
    another; both write the same files. `run_ids` restricts the study to those runs (cluster tasks).
    Before anything is written: the names, the datasets, the output folder and every existing run folder
    (its stored config must be the run's, its model.pt the one it wrote) are checked.
    """
    from flatbench.train import Preempted, check_run_dir, train_run
    from flatbench.vectorized import plan_groups, train_group

    check_study(study)
    outcome: dict[str, list[str]] = {"trained": [], "skipped": [], "locked": [], "failed": []}
    runs = shard_runs(study, shard)
    if run_ids is not None:
        wanted = set(run_ids)
        runs = [(rid, cfg) for rid, cfg in runs if rid in wanted]
    pending = []
    for rid, cfg in runs:
        if check_run_dir(run_dir(study.exp_dir, rid), rid, cfg) == "finished":
            outcome["skipped"].append(rid)
        else:
            pending.append((rid, cfg))
    check_data(study, pending)
    check_output_dir(study.exp_dir, "experiment folder")
    save_study(study)
    done = len(outcome["skipped"])
    progress = show_progress(quiet)
    for group in plan_groups(pending, device):
        ids = [rid for rid, _ in group]
        if not quiet:
            what = f"training {ids[0]}" if len(ids) == 1 else f"training {len(ids)} runs at once: {', '.join(ids)}"
            echo(f"[{done + 1}/{len(runs)}] {what}" if len(ids) == 1 else
                 f"[{done + 1}-{done + len(ids)}/{len(runs)}] {what}")
        done += len(ids)
        try:
            if len(group) == 1:
                rid, cfg = group[0]
                train_run(rid, cfg, run_dir(study.exp_dir, rid), device, sweep_axes=study.sweep_axes,
                          progress=progress, echo=echo)
                outcome["trained"].append(rid)
            else:
                result = train_group(group, study.exp_dir, device, sweep_axes=study.sweep_axes,
                                     progress=progress, echo=echo)
                for key, values in result.items():
                    outcome[key].extend(values)
        except RunLocked as exc:
            echo(f"skipping {ids[0]}: {exc}")
            outcome["locked"].append(ids[0])
        except (FlatbenchError, Preempted, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the sweep
            for rid in ids:
                path = run_dir(study.exp_dir, rid)
                if not is_finished(path):
                    _mark_failed(path, exc)
                    echo(f"run {rid} failed: {type(exc).__name__}: {exc}")
                    outcome["failed"].append(rid)
    return outcome


def _mark_failed(path: Path, exc: BaseException) -> None:
    from flatbench.store import atomic_write_json, read_json

    info = read_json(path / RUN_JSON) if (path / RUN_JSON).is_file() else {"run_id": path.name}
    info.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    atomic_write_json(path / RUN_JSON, info)

"""Training runs: the public interface of flatbench's training machinery.

One run trains in `loop.train_run`; a group of small runs that differ only in seed and labels trains at
once in `vectorized.train_group`. Both are seeded, resumable from atomic per-epoch checkpoints, stop at
the run's endpoint (`endpoint`), write the same run folder (`run_folder`), and stop on Slurm's and
submitit's signals (`signals`). The study stage (`flatbench.study.train`) and the cluster path use only
the names exported here.

Modules: `setup` (device, seeded model, optimizer, schedule), `endpoint` (evaluation and targets),
`run_folder` (checkpoints, snapshots, run.json and their checks), `calibration` (the temperature-calibrated
cross-entropy, a secondary target), `signals`, `loop`, `vectorized`,
`outcome` (the typed result of a train stage).
"""

from flatbench.training.calibration import add_calibration, calibration_record, needs_calibration
from flatbench.training.endpoint import TrainingDiverged, evaluate, reached_endpoint, target_met
from flatbench.training.loop import train_epoch, train_run
from flatbench.training.outcome import TrainOutcome, WorkerReport
from flatbench.training.run_folder import check_run_dir, list_snapshots, write_checkpoint
from flatbench.training.setup import init_model, make_optimizer, resolve_device, training_forward
from flatbench.training.signals import STOP_SIGNALS, Preempted, StopFlag, hold_stop_signals
from flatbench.training.vectorized import (AUTO_GROUP_SIZE, VectorizedGroup, group_key, group_size, new_member,
                                           plan_groups, train_group, vectorizable)

__all__ = ["AUTO_GROUP_SIZE", "STOP_SIGNALS", "Preempted", "StopFlag", "TrainOutcome", "TrainingDiverged",
           "VectorizedGroup", "WorkerReport", "add_calibration", "calibration_record", "check_run_dir", "evaluate",
           "group_key", "group_size", "hold_stop_signals", "init_model", "list_snapshots", "make_optimizer",
           "needs_calibration", "new_member", "plan_groups", "reached_endpoint", "resolve_device", "target_met",
           "train_epoch", "train_group", "train_run", "training_forward", "vectorizable", "write_checkpoint"]

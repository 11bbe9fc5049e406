#!/usr/bin/env bash
# A hand-written Slurm job array for a flatbench study: task I of N trains the I-th of N disjoint slices
# of the sweep (`flatbench train CONFIG --shard I/N`). Submit it with N tasks:
#
#     sbatch --array=0-7 scripts/slurm_array.sh configs/study.yaml [KEY=VALUE ...] [--out DIR]
#
# (--array=0-(N-1); add e.g. --partition=gpu --gpus-per-task=1 --time=120 on the command line, which
# wins over the #SBATCH lines below). `flatbench train CONFIG --executor slurm` does the same through
# submitit without this file; `flatbench status EXPERIMENT_DIR` shows progress either way.
#
# Preemption and time limits: Slurm sends SIGUSR1 two minutes before the limit (--signal below); this
# script forwards it (and SIGTERM) to flatbench, which stops after the current batch with every run's
# last epoch checkpoint on disk and exits with 143; the script then requeues its own array task, which
# resumes those runs. Two tasks never train one run at once (per-run lock files).
#
# Environment: run sbatch from the folder the config's paths are relative to, with flatbench's Python
# environment active (Slurm passes PATH and FLATBENCH_DATA on), or set FLATBENCH to the command to run.
#
#SBATCH --job-name=flatbench
#SBATCH --output=slurm-%A_%a.out
#SBATCH --time=120
#SBATCH --ntasks=1
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append

set -u
if [ -z "${SLURM_ARRAY_TASK_ID:-}" ] || [ -z "${SLURM_ARRAY_TASK_COUNT:-}" ]; then
  echo "submit with sbatch --array=0-(N-1) $0 CONFIG [KEY=VALUE ...]" >&2
  exit 2
fi
if [ $# -lt 1 ]; then
  echo "usage: sbatch --array=0-(N-1) $0 CONFIG [KEY=VALUE ...] [--out DIR]" >&2
  exit 2
fi
FLATBENCH=${FLATBENCH:-flatbench}

# shellcheck disable=SC2086  # FLATBENCH may be a command with arguments, e.g. "python -m flatbench"
$FLATBENCH train "$@" --shard "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" --quiet &
child=$!
trap 'kill -USR1 "$child" 2>/dev/null' USR1
trap 'kill -TERM "$child" 2>/dev/null' TERM
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do  # `wait` returns early when a trapped signal arrives
  status=0
  wait "$child" || status=$?
done

if [ "$status" -eq 143 ]; then
  echo "flatbench stopped after a checkpoint; requeueing array task ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
  scontrol requeue "${SLURM_JOB_ID}"
fi
exit "$status"

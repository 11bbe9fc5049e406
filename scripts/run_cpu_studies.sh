#!/usr/bin/env bash
# Run the CPU-scale reproductions (configs/cpu/*.yaml) one after another, each with its report and its
# population audit, recording every command's wall time in results/cpu/<study>/walltime.txt.
#
#   FLATBENCH_DATA=DIR scripts/run_cpu_studies.sh [study ...]      (default: all four)
#
# DIR holds MNIST/raw/ (../shared/data has it) and cifar-10-batches-py/ (offline:
# `python ../shared/data/prepare_cifar10.py DIR`). The studies run one at a time so that each one's wall
# time is its own; a study already finished is skipped (flatbench resumes), so the script can be re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(tsuzuku_mnist ibayashi_mnist yi_mnist tsuzuku_cifar10)
for s in "${studies[@]}"; do
  mkdir -p "results/cpu/$s"
  log="results/cpu/$s/walltime.txt"
  : > "$log"
  run() {  # run a command, append "seconds  command" to the study's walltime.txt
    local t0=$SECONDS
    "$@"
    echo "$((SECONDS - t0)) s  $*" >> "$log"
  }
  run flatbench run "configs/cpu/$s.yaml" --out results/cpu --quiet > "results/cpu/$s/run.log" 2>&1
  run flatbench audit "results/cpu/$s" --population --family node > "results/cpu/$s/audit.log" 2>&1
  if [ "$s" = ibayashi_mnist ]; then  # minimum sharpness declares layer-wise invariance only
    run flatbench audit "results/cpu/$s" --population --family layer --out "results/cpu/$s/audit_layer" \
      > "results/cpu/$s/audit_layer.log" 2>&1
  fi
  cat "$log"
done

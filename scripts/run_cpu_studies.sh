#!/usr/bin/env bash
# Run the CPU-scale studies (configs/cpu/*.yaml: the natural-generalization study, the hyperparameter study
# and the four random-label reproductions) one after another: each trained, measured, audited (its population audit: 3 random
# node-wise rescalings of every run in each of two factor ranges, [1/2, 2] and [1/100, 100]; Ibayashi et
# al.'s study also layer-wise) and then reported, so that the report shows the audit (the stages of
# `flatbench run` + `flatbench audit`, each its own command so that each has its wall time), recording every
# command's wall time in results/cpu/<study>/walltime.txt, then the cross-study comparison, and printing
# the total.
#
#   FLATBENCH_DATA=DIR scripts/run_cpu_studies.sh [--out ROOT] [study ...]     (default: all six, ROOT
#                                                                               results/cpu)
#
# DIR holds MNIST/raw/ (../shared/data has it) and cifar-10-batches-py/ (offline:
# `python ../shared/data/prepare_cifar10.py DIR`); the natural study reads Fashion-MNIST from
# DIR/FashionMNIST/raw/ or from Debian's `dataset-fashion-mnist` package (/usr/share/datasets/fashion-mnist).
# The natural study's report correlates with the loss gap (its config says why); its runs are also reported
# against the accuracy gap into results/cpu/natural/gap_acc/. The studies run one at a time so that each one's wall
# time is its own; inside a study, training, measuring and the audit each use 2 worker processes
# (train.workers, measure.workers in the configs). A study already finished is skipped (flatbench resumes),
# so the script can be re-run, and an audit reuses the runs an earlier or interrupted audit with the same
# settings finished. A committed study has no weights: run it into an empty ROOT to reproduce it (its runs
# are trained again; measures computed on other weights are recomputed, never reused).
#
# What the audits cover (issue 28; docs/guide/audit.md, docs/results/index.md): every measure of the study,
# for each of its losses, the searches, Monte-Carlo estimates, Lanczos eigenvalues and `:published` solvers
# included, node-wise; Ibayashi et al.'s study also layer-wise, for the measures that declare layer-wise
# invariance (`flatbench audit --declared`: the claims that audit tests; the node-wise audit shows every
# measure under the larger family, since a layer rescaling is a node rescaling with one factor per layer). The PAC-Bayes
# searches stop drawing at each σ once the mean drop's standard error is 5% of it (the configs'
# measure.settings, rtol 0.05), in the measure stage and the audit alike. A copy costs what measuring it
# costs (nothing a measure computes from the parameters can be shared between copies; the run's random
# draws are), so a study's audit is about 6 x its measure stage. AUDIT_MEASURES=a,b,... audits only those
# measures (e.g. the exact ones: frobenius_norm,frobenius_norm_product,spectral_norm,path_norm,
# fisher_rao_norm,hessian_trace,matrix_normalized_sharpness,normalized_sharpness,normalized_sharpness_nce,
# minimum_sharpness,relative_flatness,relative_flatness_normalized,psi_flatness,psi_path_ratio).
set -euo pipefail
cd "$(dirname "$0")/.."
root=results/cpu
if [ "${1:-}" = "--out" ]; then root=$2; shift 2; fi
studies=("$@")
[ ${#studies[@]} -eq 0 ] && studies=(natural natural_sampled_mnist natural_sampled hyperparameters tsuzuku_mnist \
                                     ibayashi_mnist yi_mnist tsuzuku_cifar10)
audited=()  # every measure of the study, unless AUDIT_MEASURES names some
[ -n "${AUDIT_MEASURES:-}" ] && audited=(--measures "$AUDIT_MEASURES")
start=$SECONDS
for s in "${studies[@]}"; do
  dir="$root/$s"
  mkdir -p "$dir"
  log="$dir/walltime.txt"
  : > "$log"
  run() {  # run a command, append "seconds  command" to the study's walltime.txt
    local t0=$SECONDS
    "$@"
    echo "$((SECONDS - t0)) s  $*" >> "$log"
  }
  run flatbench train "configs/cpu/$s.yaml" --out "$root" --quiet > "$dir/run.log" 2>&1
  run flatbench measure "configs/cpu/$s.yaml" --out "$root" --quiet >> "$dir/run.log" 2>&1
  run flatbench audit "$dir" --population --family node ${audited[@]+"${audited[@]}"} > "$dir/audit.log" 2>&1
  if [ "$s" = ibayashi_mnist ]; then  # the layer-wise symmetry minimum sharpness is defined over: the measures
                                      # that declare it
    run flatbench audit "$dir" --population --family layer --declared ${audited[@]+"${audited[@]}"} --out "$dir/audit_layer" \
      > "$dir/audit_layer.log" 2>&1
  fi
  run flatbench report "$dir" --quiet >> "$dir/run.log" 2>&1
  if [ "$s" = natural ]; then  # the same runs against the accuracy gap (the loss gap is the headline)
    run flatbench report "$dir" --gap acc --out "$dir/gap_acc" --quiet >> "$dir/run.log" 2>&1
  fi
  if [[ "$s" = natural_sampled* ]]; then  # the accuracy gap is the headline; the loss gap and the
                                         # temperature-calibrated loss gap the secondary targets
    run flatbench report "$dir" --gap loss --out "$dir/gap_loss" --quiet >> "$dir/run.log" 2>&1
    run flatbench report "$dir" --gap calibrated --out "$dir/gap_calibrated" --quiet >> "$dir/run.log" 2>&1
  fi
  study_total=0
  while read -r secs _; do study_total=$((study_total + secs)); done < "$log"
  echo "$study_total s  total of $s" >> "$log"
  cat "$log"
done
t0=$SECONDS
flatbench compare "$root"/natural "$root"/hyperparameters "$root"/tsuzuku_mnist "$root"/tsuzuku_cifar10 "$root"/ibayashi_mnist \
  "$root"/yi_mnist --out "$root/comparison" > /dev/null 2>&1 || echo "compare skipped (not all six studies are in $root)"
echo "$((SECONDS - t0)) s  flatbench compare (the six studies) -> $root/comparison"
total=$((SECONDS - start))
echo "total: ${total} s ($((total / 60)) min $((total % 60)) s) for ${studies[*]}"

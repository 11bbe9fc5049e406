#!/usr/bin/env bash
# One-shot GPU checks (for a lent GPU machine): the quickstart study end to end on CUDA, then every
# measure's seconds on CUDA for the benchmark MLP and LeNet. Usage: scripts/gpu_checks.sh DATA_ROOT OUT_DIR
set -u
DATA=${1:?data root holding MNIST/raw}; OUT=${2:?output folder}
export PYTHONPATH=$(pwd) MPLBACKEND=Agg
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
timeout 150 python3 -m flatbench run configs/quickstart.yaml --device cuda --out "$OUT/qs" --quiet 2>&1 | grep -v "^  "
echo "quickstart on cuda: $(( $(date +%s) - start )) s"
tail -25 "$OUT/qs/quickstart/report.md" > /dev/null 2>&1
timeout 170 python3 scripts/bench_measures.py --device cuda --n 10000 --root "$DATA" --models mlp,lenet --dtype float64 2>&1 | tail -60

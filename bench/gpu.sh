#!/usr/bin/env bash
# The GPU device check, as one bounded run (docs/BENCHMARKS.md records its figures).
# Today: the eager engine's decode step on the GPU against the calibrated roofline
# (bench/engine.py), the baseline the GPU decode path of issue 21 is measured against.
# Needs python3 with a CUDA torch, numpy and scipy; writes its logs to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/gpu.txt"
for model in small tiny; do
  timeout 200 "$PY" bench/engine.py --device cuda --model "$model" --plan quick \
    --batches 1,2,4,8,16,32,64,128,256 2>&1 | tee "$OUT/engine_${model}_eager.txt"
done

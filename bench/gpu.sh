#!/usr/bin/env bash
# The GPU device check, as one bounded run (docs/BENCHMARKS.md records its figures).
# The decode step on the GPU against the calibrated peak bandwidth (bench/engine.py), for
# the built-in small model and an 8B shape (random weights drawn in place), by path:
# the engine's eager full-row path (the baseline), the device path without CUDA graphs,
# with them, and with them overlapped (serving/engine/device_decode.py); then the
# GPU-marked tests (graphs replay what eager runs; one host sync a step).
# Needs python3 with a CUDA torch, numpy, scipy, safetensors (pytest for the tests);
# writes its logs to $OUT (or ./gpu-out).
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
timeout 240 "$PY" bench/engine.py --device cuda --model small --plan quick --context 512 \
  --paths engine,window,graphs,overlap --batches 1,2,4,8,16,32,64,128,256 --passes 2 --reps 10 \
  --budget-s 0.5 2>&1 | tee "$OUT/engine_small.txt"
timeout 300 "$PY" bench/engine.py --device cuda --model 8b --plan quick --context 1024 \
  --paths engine,window,graphs,overlap --batches 1,2,4,8,16,32,64,128,256 --passes 2 --reps 5 \
  --budget-s 0.5 2>&1 | tee "$OUT/engine_8b.txt"
timeout 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/serving 2>&1 | tee "$OUT/pytest_gpu.txt"

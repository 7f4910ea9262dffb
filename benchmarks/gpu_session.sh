#!/usr/bin/env bash
# One device session: environment facts, the GPU test suite, then the benchmarks.
# Usage (repository root, on a GPU machine):  bash benchmarks/gpu_session.sh [pytest args]
# Logs go to $OUT (or ./gpu-logs).
set -u
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
[ -d .git ] || [ -n "${DRVSOFTMAX_COMMIT:-}" ] || echo "note: no .git here; set DRVSOFTMAX_COMMIT to record the commit"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DRVSOFTMAX_CACHE_DIR=${DRVSOFTMAX_CACHE_DIR:-/tmp/drvsoftmax-cache}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"; python3 -m drvsoftmax info; } 2>&1 | tee "$OUT/env.log"
python3 -m pytest -q -ra -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 40
for b in benchmarks/bench_softmax*.py; do
  [ -f "$b" ] && timeout 400 python3 "$b" --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" | tail -n 60
done

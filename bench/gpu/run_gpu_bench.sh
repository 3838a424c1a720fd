#!/usr/bin/env bash
# One command on a GPU machine (CUDA driver, PyTorch; no LLVM/MLIR needed):
# uses the steps and runtime that bench/gpu/prepare_carry.sh put in .carry/.
# 1. zopt-gpu-check on every layout (GPU vs CPU step), 2. the Python parity
# matrix on the GPU and offloaded (from the carried step cache), 3. the
# benchmark.
# Writes the markdown table to ${OUT:-.}/gpu_bench.md.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
carry="${CARRY:-$root/.carry}"
export ZOPT_RUNTIME_LIB="$carry/lib/libzopt_runtime.so"
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
rc=0
# layout:extra options (the same runs as test/Integration/CUDA/*.test)
for run in "f32:" "f32_clip:" "f32_clip:--steps=4 --inf-at=2" "bf16_master_clip:" "bf16:" \
           "f16_loss_scale:--steps=4 --inf-at=2" "f16_loss_scale:--steps=6 --inf-at=4 --graph" \
           "bf16_offload:--steps=4 --inf-at=2" "bf16_sr:--steps=3"; do
  l="${run%%:*}"; extra="${run#*:}"
  echo "== zopt-gpu-check $l $extra"
  "$carry/bin/zopt-gpu-check" "$carry/steps/$l.gpu.so" "$carry/steps/$l.cpu.so" $extra | tail -4 || rc=1
done
echo "== pytest python/tests/test_cuda.py (parity matrix on the GPU and offloaded)"
ZOPT_TEST_STEP_CACHE="$carry/stepcache" PYTHONPATH="$root/python" \
  python3 -m pytest -q -p no:cacheprovider "$root/python/tests/test_cuda.py" 2>&1 | tail -15 || rc=1
PYTHONPATH="$root/python" python3 "$root/bench/gpu/gpu_bench.py" --steps "$carry/steps" \
  --out "${OUT:-.}/gpu_bench.md" "$@" || rc=1
exit $rc

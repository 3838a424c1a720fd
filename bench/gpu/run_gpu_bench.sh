#!/usr/bin/env bash
# One command on a GPU machine (CUDA driver, PyTorch; no LLVM/MLIR needed):
# uses the steps and runtime that bench/gpu/prepare_carry.sh put in .carry/.
# 1. zopt-gpu-check on every layout (GPU vs CPU step; also f32 gradients
#    of bf16/f16 params, DeepSpeed's default bf16 layout), including the
#    checks of issue 11 that need a device: a CUDA graph replayed on another
#    stream than the capture's with an lr schedule set between replays
#    (items 1, 2), the chunked work list bit-identical across chunkings and
#    with many small tensors (item 5), misaligned views bit-identical to
#    aligned tensors (item 6); 2. the Python parity matrix on the GPU and
#    offloaded (from the carried step cache); 3. the benchmark (incl. 1,000
#    and 10,000 tensors vs one tensor of the same total).
# Prints the device, the driver and the toolkit the steps were built with;
# writes the markdown table to ${OUT:-.}/gpu_bench.md.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
carry="${CARRY:-$root/.carry}"
export ZOPT_RUNTIME_LIB="$carry/lib/libzopt_runtime.so"
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c 'import ctypes; v = ctypes.c_int(); ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)); print("CUDA driver API version %d.%d (%d)" % (v.value // 1000, v.value % 1000 // 10, v.value))' || true
echo "steps built by: $(cat "$carry/toolkit.txt" 2>/dev/null | tr '\n' ' ')"
rc=0
# layout:extra options (the runs of test/Integration/CUDA/*.test)
for run in "f32:" "f32_clip:" "f32_clip:--steps=4 --inf-at=2" "bf16_master_clip:" "bf16:" \
           "f16_loss_scale:--steps=4 --inf-at=2" "f16_loss_scale:--steps=6 --inf-at=4 --graph --lr-schedule" \
           "f32_clip:--steps=5 --inf-at=3 --graph --lr-schedule" \
           "bf16_master_clip:--steps=3 --misaligned" "bf16_sr:--steps=3 --chunk=256" "bf16_sr:--steps=2 --misaligned" \
           "f32_clip:--steps=2 --tensors=3000 --numel=100" "f32_clip:--steps=2 --tensors=20 --numel=200003 --chunk=64" \
           "bf16_offload:--steps=4 --inf-at=2" "bf16_sr:--steps=3" \
           "bf16_f32grad:--steps=4 --inf-at=2" "bf16_f32grad:--steps=3 --misaligned" \
           "bf16_f32grad:--steps=5 --inf-at=3 --graph --lr-schedule" "bf16_f32grad_sr:--steps=3" \
           "bf16_f32grad_sr:--steps=3 --chunk=256" "bf16_f32grad_sr:--steps=2 --misaligned" \
           "f16_f32grad_loss_scale:--steps=4 --inf-at=2" \
           "f16_f32grad_loss_scale:--steps=6 --inf-at=4 --graph --lr-schedule" \
           "bf16_f32grad_offload:--steps=4 --inf-at=2"; do
  l="${run%%:*}"; extra="${run#*:}"
  echo "== zopt-gpu-check $l $extra"
  timeout 900 "$carry/bin/zopt-gpu-check" "$carry/steps/$l.gpu.so" "$carry/steps/$l.cpu.so" $extra > /tmp/gpu-check.out 2>&1
  r=$?
  grep -E "^INFO device|^FAIL" /tmp/gpu-check.out | head -20
  tail -1 /tmp/gpu-check.out
  [ $r -eq 0 ] || rc=1
done
echo "== pytest python/tests/test_cuda.py (parity matrix on the GPU and offloaded)"
ZOPT_TEST_STEP_CACHE="$carry/stepcache" PYTHONPATH="$root/python" \
  python3 -m pytest -q -p no:cacheprovider "$root/python/tests/test_cuda.py" 2>&1 | tail -15 || rc=1
PYTHONPATH="$root/python" python3 "$root/bench/gpu/gpu_bench.py" --steps "$carry/steps" \
  --toolkit "$carry/toolkit.txt" --out "${OUT:-.}/gpu_bench.md" "$@" || rc=1
exit $rc

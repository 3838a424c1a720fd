#!/usr/bin/env bash
# The serial and the pipelined offloaded step (docs/benchmarks/offload.md): the offload layouts
# (examples/adamw_bf16_offload_6b.mlir, DeepSpeed #8010's 6-byte cell,
# examples/adamw_zero_offload.mlir, the classic 12-byte ZeRO-Offload, and
# examples/adamw_bf16_offload_4b.mlir, issue 19's 4-byte cell with q8 moments),
# each against the same description compiled all-CPU, in the same run
# (zopt-bench-offload). Without a CUDA driver the offloaded step runs on the
# stand-in driver (device memory is host memory, copies are memcpys).
# Usage: bench/run_offload_bench.sh [BUILD_DIR=build] [PARAMS=67108864] [STEPS=5]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${1:-$ROOT/build}; N=${2:-67108864}; K=${3:-5}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
grep -m1 'model name' /proc/cpuinfo; echo "date: $(date -u +%F)  nproc: $(nproc)"
if [[ -z "${ZOPT_CUDA_DRIVER:-}" ]] && ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  export ZOPT_CUDA_DRIVER="$B/lib/libzopt-fake-cuda.so"
fi
for f in adamw_bf16_offload_6b adamw_zero_offload adamw_bf16_offload_4b; do
  "$B/bin/zopt-compile" "$ROOT/examples/$f.mlir" -o "$T/$f.so"
  # The CPU-only peer: the same description on the CPU (the 6-byte cell's
  # bf16 master would duplicate the bf16 param there: bench/adamw_bf16_6b_cpu.mlir
  # updates the param in place).
  # The same for the 4-byte cell (bench/adamw_bf16_4b_cpu.mlir; its
  # stochastically rounded master differs from an in-place param by design,
  # so its params are not compared).
  if [ "$f" = adamw_bf16_offload_6b ]; then
    cp "$ROOT/bench/adamw_bf16_6b_cpu.mlir" "$T/$f.cpu.mlir"
  elif [ "$f" = adamw_bf16_offload_4b ]; then
    cp "$ROOT/bench/adamw_bf16_4b_cpu.mlir" "$T/$f.cpu.mlir"
  else
    sed -e 's/ on gpu/ on cpu/g' -e 's/, gpu_arch = "sm_90"//' "$ROOT/examples/$f.mlir" > "$T/$f.cpu.mlir"
  fi
  "$B/bin/zopt-compile" "$T/$f.cpu.mlir" -o "$T/$f.cpu.so"
  "$B/bin/zopt-bench-offload" "$T/$f.so" "$T/$f.cpu.so" --params "$N" --steps "$K"
  # The pipelined step (bucket readiness, speculation) against the serial
  # one behind a simulated backward as long as a serial step and before a
  # simulated forward of half that, 16 buckets, in the default mode and in
  # per-bucket mode (the step's tail behind the forward).
  "$B/bin/zopt-bench-offload-pipeline" "$T/$f.so" --params "$N" --steps "$K" --bucket $(( (N + 15) / 16 ))
done

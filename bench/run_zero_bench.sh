#!/usr/bin/env bash
# ZeRO across CPU ranks (docs/benchmarks/zero.md):
#   1. zopt-bench-zero under mpirun at W = 1, 2, 4: per rank the state
#      bytes/param, the step time by op, the bytes the collectives send
#      against (W-1)/W x N, and raw MPI moving the same bytes in the same run;
#   2. zopt's ZeRO-2 AdamW against torch's ZeroRedundancyOptimizer (+ DDP's
#      bucketed all_reduce), both over one gloo process group, same sizes;
#   3. (run before 2) streamed gradients exchanged in the background against
#      on the backward thread (--overlap).
# Usage: bench/run_zero_bench.sh [BUILD_DIR=build] [PARAMS=67108864] [STEPS=3]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${1:-$ROOT/build}; N=${2:-67108864}; K=${3:-3}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
grep -m1 'model name' /proc/cpuinfo; echo "date: $(date -u +%F)  nproc: $(nproc)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe --mca btl self,vader)
for f in adamw_bf16_zero2 adamw_f32; do
  if [ "$f" = adamw_f32 ]; then  # fp32, ZeRO-2, no clipping
    sed -e 's/zopt.step @adamw_f32 attributes {zero_stage = 0/zopt.step @adamw_f32 attributes {zero_stage = 2/' \
      "$ROOT/examples/adamw_f32.mlir" > "$T/$f.mlir"
  else
    cp "$ROOT/examples/$f.mlir" "$T/$f.mlir"
  fi
  "$B/bin/zopt-compile" "$T/$f.mlir" -o "$T/$f.so"
  for w in 1 2 4; do
    "${MPIRUN[@]}" -np "$w" "$B/bin/zopt-bench-zero" "$T/$f.so" --params "$N" --steps "$K"
  done
done
# 3. streamed gradients with a simulated backward (the CPU free, as under a
#    GPU's): the exchange on the backward thread against the runtime's own
#    thread (zopt_optimizer_reduce_bucket_async), W = 2, 10 and 40 ms per bucket.
for ms in 10 40; do
  "${MPIRUN[@]}" -np 2 "$B/bin/zopt-bench-zero" "$T/adamw_bf16_zero2.so" --params "$N" --steps "$K" --overlap "$ms" \
    | sed -n '/^streamed gradients/,$p'
done
ZOPT_BUILD_DIR="$B" /usr/bin/python3 "$ROOT/bench/zero_torch_bench.py" --world 1 2 4 --params "$N" --steps "$K"

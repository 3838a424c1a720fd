#!/usr/bin/env bash
# Usage: bench/run_cpu_bench.sh [BUILD_DIR=build] [RUNS=3]
# Compiles the benchmark layouts, runs zopt-bench-cpu RUNS times per layout
# (64Mi params, 2 threads, 15 interleaved repetitions each) and times zopt-compile on
# every example (median of 3). Needs zopt-compile and zopt-bench-cpu built.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${1:-$ROOT/build}; RUNS=${2:-3}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
ZC=$B/bin/zopt-compile; ZB=$B/bin/zopt-bench-cpu
grep -m1 'model name' /proc/cpuinfo; echo "date: $(date -u +%F)  nproc: $(nproc)"
$ZC "$ROOT/examples/adamw_f32.mlir" -o "$T/f32.so"
$ZC "$ROOT/bench/adamw_bf16_master_noclip.mlir" -o "$T/bf16_master.so"
$ZC "$ROOT/examples/adamw_bf16_zero2.mlir" -o "$T/bf16.so"
for l in f32 bf16_master bf16; do
  # auto = the variant the runtime picks (avx512bf16 for the bf16 layouts on
  # CPUs with AVX512_BF16); the others for comparison.
  isas="auto avx2"
  [ "$l" != f32 ] && isas="auto avx512 avx2"
  for isa in $isas; do
    for r in $(seq "$RUNS"); do "$ZB" "$T/$l.so" --isa=$isa | grep RESULT; done
  done
done
echo "zopt-compile wall time (median of 3, seconds):"
for f in "$ROOT"/examples/*.mlir "$ROOT"/bench/*.mlir; do
  ts=()
  for r in 1 2 3; do
    s=$(date +%s%N); $ZC "$f" -o "$T/c.so"; e=$(date +%s%N); ts+=("$(( (e - s) / 1000000 ))")
  done
  m=$(printf '%s\n' "${ts[@]}" | sort -n | sed -n 2p)
  printf '  %-32s %d.%03d\n' "$(basename "$f")" $((m / 1000)) $((m % 1000))
done

#!/usr/bin/env bash
# The main job: set up, build, compile an example step (AdamW, bf16 params and
# grads with an f32 master and moments, clip 1.0) into step.so and run it
# through the runtime: per-step time, throughput against the in-place stream
# roofline measured in the same run, bytes per parameter on each placement.
# Usage: scripts/main.sh [example.mlir] [zopt-run options]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
bash "$root/scripts/build.sh" >/dev/null
example="${1:-$root/examples/adamw_bf16_master.mlir}"
shift || true
name="$(basename "$example" .mlir)"
mkdir -p "$build/main"
echo "== zopt-compile $example -o $build/main/$name.so"
"$build/bin/zopt-compile" "$example" -o "$build/main/$name.so" --timing 2>&1 | grep -E "Total|LLVM IR|machine code|link" || true
# An offloaded step (params and grads `on gpu`) needs a CUDA driver; on a
# machine without one, run it on the stand-in driver the tests use
# (test/Integration/GPUHost: device memory is host memory).
fake="$build/lib/libzopt-fake-cuda.so"
if [[ -z "${ZOPT_CUDA_DRIVER:-}" ]] && grep -q ' on gpu' "$example" && [[ -f "$fake" ]] &&
   ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  echo "== no CUDA driver on this machine: GPU memory is the stand-in driver's ($fake)"
  export ZOPT_CUDA_DRIVER="$fake"
fi
echo "== zopt-run $build/main/$name.so $*"
"$build/bin/zopt-run" "$build/main/$name.so" "$@"
# An offloaded step (params and grads on the GPU, every optimizer state on
# the CPU) also runs pipelined behind a simulated backward (docs/GPU.md
# "Bucket readiness and speculation"): each step's overlapped and exposed
# time and outcome, against the serial step in the same run. One rank only
# (the benchmark takes --params/--tensors/--steps/--threads).
if [[ -n "${ZOPT_CUDA_DRIVER:-}" ]] || /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  if grep -q ' on gpu' "$example" && ! grep -Eq '^[^/]*zopt\.state (master|exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer)[^/]* on gpu' "$example" &&
     [[ " $* " != *" --ranks "* && " $* " != *" --mpi "* && " $* " != *" --timeout "* ]]; then
    args=("$@")
    [[ " $* " == *" --params "* ]] || args+=(--params 16777216)
    [[ " $* " == *" --steps "* ]] || args+=(--steps 3)
    echo
    echo "== zopt-bench-offload-pipeline $build/main/$name.so ${args[*]}"
    "$build/bin/zopt-bench-offload-pipeline" "$build/main/$name.so" "${args[@]}"
  fi
fi

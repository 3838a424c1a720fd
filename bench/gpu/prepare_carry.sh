#!/usr/bin/env bash
# Compiles the GPU benchmark/test steps HERE (needs LLVM/MLIR + the CUDA
# toolkit) into .carry/ (git-ignored) together with the runtime library and
# the test binaries, so that a GPU machine without LLVM/MLIR can run
#   device run --carry .carry  "bash bench/gpu/run_gpu_bench.sh"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/.carry"
cuda="${CUDA_HOME:-/usr/local/cuda}"
ninja -C "$build" -j2 zopt-compile zopt_runtime zopt-gpu-check
rm -rf "$out" && mkdir -p "$out/steps" "$out/lib" "$out/bin"
cp -a "$build"/lib/libzopt_runtime.so* "$out/lib/"
cp "$build/bin/zopt-gpu-check" "$out/bin/"
# The toolkit the steps are built with (the GPU machine's driver must be at
# least as new: the runtime checks it, the benchmark reports both).
"$cuda/bin/ptxas" --version | tail -2 > "$out/toolkit.txt"
compile() {  # name src : GPU step and its CPU twin
  "$build/bin/zopt-compile" "$2" --gpu=sm_80,sm_90 --cuda-path="$cuda" -o "$out/steps/$1.gpu.so"
  sed -e 's/ on gpu/ on cpu/g' -e 's/, gpu_arch = "sm_90"//' -e 's/ attributes {gpu_arch = "sm_90"}//' "$2" > "$out/steps/$1.cpu.mlir"
  "$build/bin/zopt-compile" "$out/steps/$1.cpu.mlir" -o "$out/steps/$1.cpu.so"
}
in="$root/test/Integration/CUDA/Inputs"
compile f32 "$in/adamw_f32_gpu.mlir"
compile f32_clip "$in/adamw_f32_clip_gpu.mlir"
compile bf16_master_clip "$root/examples/adamw_bf16_gpu.mlir"
compile bf16 "$in/adamw_bf16_gpu.mlir"
compile f16_loss_scale "$in/adam_f16_loss_scale_gpu.mlir"
compile bf16_offload "$root/test/Integration/GPUHost/Inputs/adamw_bf16_offload.mlir"
compile bf16_sr "$root/test/zopt-compile/Inputs/stochastic-gpu.mlir"
# DeepSpeed's default bf16 layout: f32 gradients of the 16-bit params.
host="$root/test/Integration/GPUHost/Inputs"
compile bf16_f32grad "$host/adamw_bf16_f32grad_gpu.mlir"
compile bf16_f32grad_sr "$host/adamw_bf16_f32grad_sr_gpu.mlir"
compile f16_f32grad_loss_scale "$host/adam_f16_f32grad_ls_gpu.mlir"
compile bf16_f32grad_offload "$host/adamw_bf16_f32grad_offload.mlir"
# The Python GPU/offload parity matrix (python/tests/test_cuda.py), for a
# machine without zopt-compile: its steps, keyed as ZOPT_TEST_STEP_CACHE.
ZOPT_COMPILE="$build/bin/zopt-compile" ZOPT_RUNTIME_LIB="$build/lib/libzopt_runtime.so" \
  PYTHONPATH="$root/python:$root/python/tests" /usr/bin/python3 "$root/python/tests/test_cuda.py" "$out/stepcache"
du -sh "$out"

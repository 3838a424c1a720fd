#!/usr/bin/env bash
# The sanitizer stage of the test command (scripts/test.sh runs it after the
# regular suite; docs/TESTING.md):
#   1. AddressSanitizer + UndefinedBehaviorSanitizer build of the whole
#      project (compiler, runtime, tools, tests) in $ASAN_BUILD_DIR
#      (default build-asan/): lit + the runtime's ctest, and the Python suite
#      through the sanitized runtime (the ASan runtime preloaded into the
#      uninstrumented interpreter);
#   2. ThreadSanitizer build of the runtime alone in $TSAN_BUILD_DIR
#      (default build-tsan/): the concurrency stress tests (optimizers on
#      their own threads; one optimizer shared by threads), the communicator
#      tests and ZeRO across loopback ranks (threads) on steps compiled by
#      the regular build.
# Any sanitizer report fails the stage. Incremental like build.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
asan="${ASAN_BUILD_DIR:-$root/build-asan}"
tsan="${TSAN_BUILD_DIR:-$root/build-tsan}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
start=$(date +%s)

# ---- 1. ASan + UBSan ---------------------------------------------------------
# -fno-sanitize=function: the runtime calls functions it resolves with dlsym
# (libcuda, libnccl, the MPI plugin, step.so kernels) through its own
# declarations of their C types, as it must.
san="-fsanitize=address,undefined -fno-sanitize=function -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
if [ ! -f "$asan/build.ninja" ]; then
  # LLVM_USE_SANITIZER keeps LLVM's CMake from linking shared libraries with
  # -z defs (the sanitizer runtimes resolve at load time).
  cmake -G Ninja -S "$root" -B "$asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-22 -DCMAKE_CXX_COMPILER=clang++-22 -DLLVM_USE_LINKER=lld "${launcher[@]}" \
    "-DCMAKE_C_FLAGS=$san" "-DCMAKE_CXX_FLAGS=$san" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
    "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
    "-DLLVM_USE_SANITIZER=Address;Undefined" -DZOPT_BUILD_FAST_EXT=OFF >/dev/null
fi
# allow_user_poisoning=0: LLVM's allocators poison their slabs from the
# instrumented inline code of our tools while the uninstrumented libMLIR
# allocates from the same slabs (false use-after-poison reports); heap
# errors of every malloc'd block are still caught. Set before the build,
# which runs the instrumented zopt-compile on the examples (a fresh-clone
# CI run failed there with such a report, in the zprog verifier), and for
# every process after it.
export ASAN_OPTIONS="detect_leaks=1:allow_user_poisoning=0:halt_on_error=1"
ninja -C "$asan"
echo "== sanitize: ASan+UBSan build done in $(( $(date +%s) - start )) s"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Open MPI's own allocations outlive MPI_Finalize (and its components are
# unloaded, so they cannot be suppressed by name): no leak detection in the
# MPI processes (test/lit.cfg.py does the same for %mpirun).
# (zopt.install builds an uninstrumented outside project against the
# runtime: it runs in the regular suite only.)
(cd "$asan" && ctest --output-on-failure -E 'comm_mpi|zopt.install')
(cd "$asan" && ASAN_OPTIONS="detect_leaks=0:allow_user_poisoning=0:halt_on_error=1" ctest --output-on-failure -R comm_mpi)
echo "== sanitize: ASan+UBSan ctest (lit + runtime) passed at $(( $(date +%s) - start )) s"
# Python: an uninstrumented interpreter with the ASan runtime preloaded;
# leak detection off (the interpreter's own allocations at exit).
asan_rt="$(clang-22 -print-file-name=libclang_rt.asan-x86_64.so)"
ZOPT_BUILD_DIR="$asan" ZOPT_RUNTIME_LIB="$asan/lib/libzopt_runtime.so" PYTHONPATH="$root/python" \
  LD_PRELOAD="$asan_rt" ASAN_OPTIONS="detect_leaks=0:allow_user_poisoning=0:halt_on_error=1" \
  /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/python/tests"
echo "== sanitize: ASan+UBSan pytest passed at $(( $(date +%s) - start )) s"

# ---- 2. TSan (the runtime alone) ----------------------------------------------
if [ ! -f "$tsan/build.ninja" ]; then
  cmake -G Ninja -S "$root/runtime" -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-22 -DCMAKE_CXX_COMPILER=clang++-22 "${launcher[@]}" \
    "-DCMAKE_C_FLAGS=-fsanitize=thread" "-DCMAKE_CXX_FLAGS=-fsanitize=thread" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread" \
    -DZOPT_RUNTIME_BUILD_BENCH=OFF "-DZOPT_TEST_STEP_DIR=$build/examples" >/dev/null
fi
ninja -C "$tsan"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
"$tsan/bin/zopt_test_concurrency" "$build/examples"
"$tsan/bin/zopt_test_shared_optimizer" "$build/examples"
"$tsan/bin/zopt_test_pool"
"$tsan/bin/zopt_test_comm"
steps="$root/test/Integration/ZeRO/Inputs"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$build/bin/zopt-compile" "$steps/adamw_bf16_master_z2.mlir" -o "$tmp/z2.so"
"$build/bin/zopt-compile" "$steps/adamw_f32_z3.mlir" -o "$tmp/z3.so"
"$tsan/bin/zopt-zero-check" "$tmp/z2.so" --world=3 --threads=2 --steps=2 --mask | tail -1
"$tsan/bin/zopt-zero-check" "$tmp/z3.so" --world=4 --steps=2 --delay | tail -1
"$tsan/bin/zopt-zero-check" "$tmp/z2.so" --world=3 --mismatch=hyper | tail -1
# the background reductions (runtime/src/pipeline): a thread per optimizer
"$tsan/bin/zopt-zero-check" "$tmp/z2.so" --world=3 --threads=2 --steps=2 --async --delay | tail -1
"$tsan/bin/zopt-zero-check" "$tmp/z3.so" --world=3 --async-misorder --bucket=40000 | tail -1
"$tsan/bin/zopt-zero-check" "$tmp/z3.so" --world=1 --async-free --bucket=40000 | tail -1
# tensors added after finalize, the state exported and imported (issue 17)
"$tsan/bin/zopt-state-check" "$tmp/z2.so" "$tmp/z3.so" --world=3 | tail -1
echo "== sanitize: TSan passed; sanitizer stage done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Fills .carry/ (git-ignored) HERE, where LLVM/MLIR and the CUDA toolkit are,
# with everything bench/gpu/run_gpu_bench.sh needs on a GPU machine that has
# neither (nor a network): then, on the device tool,
#   carry: [".carry"]   command: "bash bench/gpu/run_gpu_bench.sh"
#
#   lib/       libzopt_runtime.so (+ the stand-in driver libzopt-fake-cuda.so,
#              which test_gpu_binding.py's and test_gpu_frozen.py's subprocess
#              tests load)
#   bin/       zopt-gpu-check, zopt-nccl-check, zopt-linked-gpu-check,
#              zopt-bench-offload, zopt-bench-offload-pipeline
#   steps/     <layout>.gpu.so + its CPU twin <layout>.cpu.so (gpu-check, the
#              benchmark), nccl_zero2.gpu.so (the NCCL stage),
#              linked_bf16_offload.so (zopt-linked-gpu-check's offloaded part)
#   stepcache/ every zopt.compile() of python/tests, recorded
#              (python/tests/zopt_stepcache.py): the suite runs here once
#              with ZOPT_TEST_STEP_CACHE, then test_cuda.py's GPU steps
#   repo/      python/zopt, python/tests, examples, bench/gpu: the code the
#              stages run (a copy: nothing is read from the work tree there)
#   MANIFEST.txt, toolkit.txt, elf.txt (what every ELF file needs)
#
# Checks, failing here rather than there: every ELF file's libraries resolve
# (ldd) and none is LLVM/MLIR or found through a path into this machine's
# build tree (RPATH/RUNPATH); the carried Python package imports and steps
# with nothing loaded from the work tree; the whole carry stays under
# ZOPT_CARRY_MAX_MB (56: the device takes 64 MiB with the work tree).
#
# ZOPT_CARRY_SUITE=0 skips the recording run of the suite (minutes here):
# the GPU machine's torch-2 stage then skips what is not in the cache.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/.carry"
cuda="${CUDA_HOME:-/usr/local/cuda}"
py=/usr/bin/python3
t0=$(date +%s)
log() { echo "== prepare_carry [$(( $(date +%s) - t0 )) s] $*"; }

ninja -C "$build" -j2 zopt-compile zopt_runtime zopt-gpu-check zopt-nccl-check zopt-linked-gpu-check zopt-fake-cuda \
  zopt-bench-offload zopt-bench-offload-pipeline
rm -rf "$out" && mkdir -p "$out/steps" "$out/lib" "$out/bin" "$out/stepcache" "$out/repo/python" "$out/repo/bench"
cp -a "$build"/lib/libzopt_runtime.so* "$build/lib/libzopt-fake-cuda.so" "$out/lib/"
cp "$build/bin/zopt-gpu-check" "$build/bin/zopt-nccl-check" "$build/bin/zopt-linked-gpu-check" "$build/bin/zopt-bench-offload" \
   "$build/bin/zopt-bench-offload-pipeline" "$out/bin/"
# The toolkit the steps are built with (the GPU machine's driver must be at
# least as new: the runtime checks it, the stages report both).
"$cuda/bin/ptxas" --version | tail -2 > "$out/toolkit.txt"

log "the code: python/zopt, python/tests, examples, bench/gpu"
copy() {  # tracked and untracked files under $1 (no build outputs, no caches)
  (cd "$root" && git ls-files -co --exclude-standard -- "$1" | grep -v '__pycache__' |
     tar -cf - -T -) | tar -xf - -C "$out/repo"
}
copy python/zopt
copy python/tests
copy examples
copy bench/gpu
copy bench/adamw_bf16_6b_cpu.mlir  # the 6-byte cell's all-CPU twin (test_gpu_grads.py)
cp "$root/python/README.md" "$out/repo/python/" 2>/dev/null || true
cp "$root/python/build_fast.py" "$out/repo/python/"  # zopt._fast for the machine's Python and torch

log "steps for zopt-gpu-check, the benchmark and the NCCL stage"
compile() {  # name src : GPU step and its CPU twin
  "$build/bin/zopt-compile" "$2" --gpu=sm_80,sm_90 --cuda-path="$cuda" -o "$out/steps/$1.gpu.so"
  sed -e 's/ on gpu/ on cpu/g' -e 's/, gpu_arch = "sm_90"//' -e 's/ attributes {gpu_arch = "sm_90"}//' "$2" > "$out/steps/$1.cpu.mlir"
  "$build/bin/zopt-compile" "$out/steps/$1.cpu.mlir" -o "$out/steps/$1.cpu.so"
  rm "$out/steps/$1.cpu.mlir"
}
in="$root/test/Integration/CUDA/Inputs"
host="$root/test/Integration/GPUHost/Inputs"
compile f32 "$in/adamw_f32_gpu.mlir"
compile f32_clip "$in/adamw_f32_clip_gpu.mlir"
compile bf16_master_clip "$root/examples/adamw_bf16_gpu.mlir"
compile bf16 "$in/adamw_bf16_gpu.mlir"
compile f16_loss_scale "$in/adam_f16_loss_scale_gpu.mlir"
compile bf16_offload "$host/adamw_bf16_offload.mlir"
# zopt-linked-gpu-check (stage 1): bf16_master_clip.{gpu,cpu}.so are its GPU
# part and twin; the offloaded partner as test/Integration/Backend/
# linked-gpu.test builds it (no --gpu).
"$build/bin/zopt-compile" "$host/adamw_bf16_offload.mlir" -o "$out/steps/linked_bf16_offload.so"
compile bf16_sr "$root/test/zopt-compile/Inputs/stochastic-gpu.mlir"
# DeepSpeed's default bf16 layout: f32 gradients of the 16-bit params.
compile bf16_f32grad "$host/adamw_bf16_f32grad_gpu.mlir"
compile bf16_f32grad_sr "$host/adamw_bf16_f32grad_sr_gpu.mlir"
compile f16_f32grad_loss_scale "$host/adam_f16_f32grad_ls_gpu.mlir"
# Remainder masters and Kahan-compensated params (NUMERICS §9, §11): never
# run on a device yet. Kahan unclipped, as test/Integration/CUDA's test.
compile remainder "$host/adamw_bf16_remainder_gpu.mlir"
sed -e '/clip_by_global_norm/d' -e 's/%gc, %m, %v\(.*\) : bf16, f32, f32, f32/%g, %m, %v\1 : bf16, bf16, f32, f32/' \
  "$host/adamw_bf16_kahan_gpu.mlir" > "$out/steps/kahan_src.mlir"
compile kahan "$out/steps/kahan_src.mlir"
rm "$out/steps/kahan_src.mlir"
# q8 moments with a remainder master (NUMERICS §10, docs/GPU.md "q8 moments
# on the GPU"): clipped, and unclipped (the clip coefficient's rounding out
# of the bit-for-bit comparison).
compile q8 "$host/adamw_bf16_q8_gpu.mlir"
sed -e '/clip_by_global_norm/d' -e 's/\(zopt.ema\(_sq\)\? %[mv]\), %gc, \(%b[12]\) : f32, f32/\1, %g, \3 : f32, bf16/' \
  "$host/adamw_bf16_q8_gpu.mlir" > "$out/steps/q8_noclip_src.mlir"
compile q8_noclip "$out/steps/q8_noclip_src.mlir"
rm "$out/steps/q8_noclip_src.mlir"
# The offload benchmarks (serial and pipelined, issue 18): the two offload
# layouts and their all-CPU twins (bench/run_offload_bench.sh).
"$build/bin/zopt-compile" "$root/examples/adamw_bf16_offload_6b.mlir" -o "$out/steps/offload_6b.so"
"$build/bin/zopt-compile" "$root/bench/adamw_bf16_6b_cpu.mlir" -o "$out/steps/offload_6b.cpu.so"
"$build/bin/zopt-compile" "$root/examples/adamw_zero_offload.mlir" -o "$out/steps/zero_offload.so"
sed -e 's/ on gpu/ on cpu/g' -e 's/, gpu_arch = "sm_90"//' "$root/examples/adamw_zero_offload.mlir" > "$out/steps/zero_offload.cpu.mlir"
"$build/bin/zopt-compile" "$out/steps/zero_offload.cpu.mlir" -o "$out/steps/zero_offload.cpu.so"
rm "$out/steps/zero_offload.cpu.mlir"
compile bf16_f32grad_offload "$host/adamw_bf16_f32grad_offload.mlir"
# A ZeRO-2 GPU step for zopt-nccl-check (world size 1 with the communicator).
sed -e 's/zero_stage = 0/zero_stage = 2/' "$root/examples/adamw_bf16_gpu.mlir" > "$out/steps/nccl_zero2.mlir"
"$build/bin/zopt-compile" "$out/steps/nccl_zero2.mlir" --gpu=sm_80,sm_90 --cuda-path="$cuda" -o "$out/steps/nccl_zero2.gpu.so"
rm "$out/steps/nccl_zero2.mlir"

# The Python suite's steps, recorded from the carried copy of the code (so
# that the run also proves the copy complete): the compiler is this
# machine's, the runtime the carried one.
export ZOPT_TEST_STEP_CACHE="$out/stepcache"
export ZOPT_COMPILE="$build/bin/zopt-compile"
export ZOPT_RUNTIME_LIB="$out/lib/libzopt_runtime.so"
export CUDA_HOME="$cuda"
# zopt.steps' own disk cache, fresh: a step built there earlier would never
# reach zopt.compile, so it would not be recorded.
export ZOPT_CACHE_DIR="$(mktemp -d /tmp/zopt-carry-cache.XXXXXX)"
trap 'rm -rf "$ZOPT_CACHE_DIR"' EXIT
site="$out/repo/python:$out/repo/python/tests/stepcache_site"
if [ "${ZOPT_CARRY_SUITE:-1}" != 0 ]; then
  log "recording the steps of python/tests (the suite, once; minutes)"
  rec=/tmp/zopt-carry-record.$$.log
  set +e
  (cd "$out/repo" && PYTHONPATH="$site" "$py" -m pytest -q -p no:cacheprovider -rfE \
     python/tests > "$rec" 2>&1)
  rc=$?
  set -e
  grep -E '^(FAILED|ERROR) |step cache|passed|failed' "$rec" | tail -15
  if [ $rc -ne 0 ] && [ "${ZOPT_CARRY_ALLOW_FAILURES:-0}" != 1 ]; then
    echo "prepare_carry: tests failed in the recording run ($rec; ZOPT_CARRY_ALLOW_FAILURES=1 goes on)" >&2
    exit 1
  fi
  rm -f "$rec"
fi
log "recording test_cuda.py's GPU and offload steps"
(cd "$out/repo/python/tests" && PYTHONPATH="$site:$out/repo/python/tests" "$py" test_cuda.py "$out/stepcache")

log "checks: ELF dependencies, the Python package alone, size"
(
  echo "# ldd / readelf -d of every ELF file in the carry (prepare_carry.sh)"
  bad=0
  while IFS= read -r f; do
    file -b "$f" | grep -q '^ELF' || continue
    rel="${f#$out/}"
    need=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    paths=$(readelf -d "$f" | sed -n 's/.*(R\(UN\)\?PATH).*\[\(.*\)\]/\2/p' | tr '\n' ' ')
    echo "$rel: NEEDED $need${paths:+ RPATH $paths}"
    if ldd "$f" 2>&1 | grep -q 'not found'; then echo "  MISSING: $(ldd "$f" | grep 'not found' | tr '\n' ' ')"; bad=1; fi
    if echo "$need" | grep -qiE 'llvm|mlir'; then echo "  NEEDS LLVM/MLIR"; bad=1; fi
    case "$paths" in *"$root"*|*"$build"*) echo "  RPATH INTO THE BUILD TREE"; bad=1 ;; esac
  done < <(find "$out" -type f \( -name '*.so' -o -name '*.so.*' -o -path "$out/bin/*" \) | sort)
  echo "# newest symbol versions needed (the GPU machine's glibc / libstdc++ must have them):"
  find "$out" -type f \( -name '*.so' -o -name '*.so.*' -o -path "$out/bin/*" \) -exec objdump -T {} + 2>/dev/null |
    grep -oE '(GLIBC|GLIBCXX|CXXABI)_[0-9.]+' | sort -u -t_ -k1,1 -k2,2V | awk -F_ '{v[$1]=$0} END {for (k in v) print v[k]}'
  exit $bad
) > "$out/elf.txt" || { cat "$out/elf.txt"; echo "prepare_carry: an ELF file in the carry would not load there" >&2; exit 1; }
tail -4 "$out/elf.txt"
# The carried package on its own: no PYTHONPATH entry, module or mapped
# library from the work tree or the build (only .carry itself).
(cd / && env -u ZOPT_COMPILE -u ZOPT_TEST_STEP_CACHE -u ZOPT_BUILD_DIR PATH=/usr/bin:/bin \
   PYTHONPATH="$out/repo/python" ZOPT_RUNTIME_LIB="$out/lib/libzopt_runtime.so" "$py" - "$root" "$out" <<'EOF'
import os, sys
import numpy as np
root, carry = sys.argv[1], sys.argv[2]
import zopt
assert zopt.find_compiler() is None, f"the carried package finds a compiler: {zopt.find_compiler()}"
step = zopt.Step(os.path.join(carry, "steps", "f32.cpu.so"))
p = np.ones(10, np.float32); g = np.full(10, 0.5, np.float32)
o = zopt.Optimizer(step, [(p, g)], lr=0.1)
o.step()
assert (p < 1).all()
inside = lambda f: f and os.path.abspath(f).startswith(root + os.sep) and not os.path.abspath(f).startswith(carry + os.sep)
mods = [m.__file__ for m in list(sys.modules.values()) if inside(getattr(m, "__file__", None))]
maps = {l.split()[-1] for l in open("/proc/self/maps") if len(l.split()) >= 6}
libs = [f for f in maps if inside(f)]
assert not mods and not libs, f"loaded from the work tree: {mods + libs}"
print(f"the carried package alone: zopt from {os.path.dirname(zopt.__file__)}, runtime {zopt.find_runtime_library()}")
EOF
)
{
  echo "zopt carry for bench/gpu/run_gpu_bench.sh"
  echo "commit $(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- . ':!.carry' || echo ' (+ uncommitted changes)')"
  echo "built $(date -u +%FT%TZ) on $(uname -sr), $(ldd --version | head -1)"
  echo "toolkit $(tail -1 "$out/toolkit.txt")"
  echo "recorded steps: $(ls "$out/stepcache" | grep -c '\.json$') (suite run: ${ZOPT_CARRY_SUITE:-1})"
  (cd "$out" && find . -type f | sort | xargs du -k | awk '{s+=$1} END {print "files: " NR ", " s " KiB"}')
} > "$out/MANIFEST.txt"
cat "$out/MANIFEST.txt"
kib=$(du -sk "$out" | cut -f1)
max=$(( ${ZOPT_CARRY_MAX_MB:-56} * 1024 ))
if [ "$kib" -gt "$max" ]; then
  echo "prepare_carry: .carry is $kib KiB, over $max KiB" >&2
  exit 1
fi
log "done: .carry is $(du -sh "$out" | cut -f1)"

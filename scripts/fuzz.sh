#!/usr/bin/env bash
# A bounded, fixed-seed fuzz run of the description fuzz targets (parse +
# verify + every phase up to LLVM IR, under AddressSanitizer and
# LeakSanitizer; tools/zopt-fuzz-description):
#
#   scripts/fuzz.sh [seconds]        (default 120, split between the targets)
#
#   zopt-fuzz-description  mutates description text, seeded from examples/,
#                          bench/ and the test inputs (split at `// -----`
#                          and `//---`), with a zopt dictionary;
#   zopt-fuzz-step         generates descriptions from the input bytes
#                          (most of them verify: it reaches the passes);
#   zopt-fuzz-checkpoint   mutates checkpoint files loaded into an optimizer
#                          (a refused load must leave it bit-identical).
#
# Builds the targets in their own build directory (FUZZ_BUILD_DIR, default
# build-fuzz/: -DZOPT_ENABLE_FUZZER=ON instruments the compiler libraries),
# runs each with -seed=1 on a fresh corpus and exits non-zero on any crash,
# ASan report, leak or per-input timeout. A failing input is left in
# $FUZZ_BUILD_DIR/fuzz-artifacts/; add it to test/zopt-compile/fuzz/ as a
# regression test once fixed (for zopt-fuzz-step, ZOPT_FUZZ_PRINT=1 prints
# the description an input generates). FUZZ_TARGETS picks targets, FUZZ_FLAGS
# adds libFuzzer flags, ZOPT_FUZZ_STRICT=1 also fails on a verified
# description that a later phase refuses.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
secs="${1:-120}"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
start=$(date +%s)

bash "$root/scripts/setup-deps.sh"
# (setup-deps.sh installs libclang-rt-22-dev: libFuzzer and the sanitizer runtimes.)

if [ ! -f "$build/build.ninja" ]; then
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER=clang-22 -DCMAKE_CXX_COMPILER=clang++-22 \
    -DLLVM_USE_LINKER=lld -DZOPT_ENABLE_FUZZER=ON -DZOPT_BUILD_FAST_EXT=OFF "${launcher[@]}" >/dev/null
fi
targets=(${FUZZ_TARGETS:-zopt-fuzz-description zopt-fuzz-step zopt-fuzz-checkpoint})
extra=()
case " ${targets[*]} " in *" zopt-fuzz-checkpoint "*) extra=(zopt-compile) ;; esac
ninja -C "$build" -j2 "${targets[@]}" "${extra[@]}"
built=$(date +%s)
echo "== fuzz: ${targets[*]} built in $(( built - start )) s"

work="$(mktemp -d "${TMPDIR:-/tmp}/zopt-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/seeds" "$build/fuzz-artifacts"
/usr/bin/python3 - "$root" "$work/seeds" <<'PY'
import glob, hashlib, os, re, sys
root, out = sys.argv[1], sys.argv[2]
files = []
for pat in ("examples/*.mlir", "bench/*.mlir", "test/**/*.mlir",
            "test/zopt-compile/*.test", "test/zopt-compile/fuzz/*"):
    files += glob.glob(os.path.join(root, pat), recursive=True)
n = 0
for f in sorted(set(files)):
    text = open(f, errors="replace").read()
    for chunk in re.split(r"^// -----$|^//--- .*$", text, flags=re.M):
        chunk = chunk.strip("\n")
        if "zopt." not in chunk or len(chunk) > 4096:
            continue
        data = (chunk + "\n").encode()
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as o:
            o.write(data)
        n += 1
print(f"fuzz: {n} seed inputs from {len(files)} files")
PY

# Leaks are checked at the end of each input (LeakSanitizer). User
# poisoning is off: MLIR/LLVM are not instrumented, and LLVM's allocator
# poisoning across that boundary gives false reports (FuzzRunner.h).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allow_user_poisoning=0:symbolize=1}"
each=$(( secs / ${#targets[@]} ))
[ "$each" -ge 1 ] || each=1
failed=()
for t in "${targets[@]}"; do
  args=(-max_len=4096)
  corpus=("$work/corpus-$t")
  mkdir -p "$work/corpus-$t"
  if [ "$t" = zopt-fuzz-description ]; then
    args+=(-dict="$root/tools/zopt-fuzz-description/zopt.dict")
    corpus+=("$work/seeds")
  elif [ "$t" = zopt-fuzz-checkpoint ]; then
    # Checkpoints of a bf16-master AdamW step (runtime/test/fuzz_checkpoint.cpp);
    # the seeds are the optimizer's own saves.
    "$build/bin/zopt-compile" "$root/examples/adamw_bf16_master.mlir" -o "$work/ck-step.so"
    export ZOPT_FUZZ_STEP="$work/ck-step.so"
    mkdir -p "$work/ck-seeds"
    ZOPT_FUZZ_SEEDS="$work/ck-seeds" "$build/bin/$t"
    args=(-max_len=65536)
    corpus+=("$work/ck-seeds")
  else
    args=(-max_len=512 -len_control=0)
  fi
  echo "== fuzz: $t for $each s"
  set +e
  # shellcheck disable=SC2086
  "$build/bin/$t" -seed=1 -max_total_time="$each" -timeout=30 \
    -rss_limit_mb=4096 -print_final_stats=1 "${args[@]}" \
    -artifact_prefix="$build/fuzz-artifacts/$t-" ${FUZZ_FLAGS:-} "${corpus[@]}"
  rc=$?
  set -e
  [ $rc -eq 0 ] || failed+=("$t (exit $rc)")
done
end=$(date +%s)
echo "== fuzz: ran ${secs} s of fuzzing; $(( end - start )) s in all, build included"
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}; the inputs are in $build/fuzz-artifacts/" >&2
  exit 1
fi
echo "fuzz: no crash, leak or timeout"

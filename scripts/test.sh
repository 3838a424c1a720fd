#!/usr/bin/env bash
# Sets up, builds and runs every test: lit (dialects, passes, zopt-compile,
# executable kernel checks, ZeRO across ranks), the runtime's ctest suite,
# the Python suite, then the sanitizer stage (ASan+UBSan, TSan). Exits
# non-zero if anything fails. docs/TESTING.md lists the stages.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
start=$(date +%s)
bash "$root/scripts/build.sh"
echo "== build done in $(( $(date +%s) - start )) s"
echo "== ctest (lit + runtime)"
(cd "$build" && ctest --output-on-failure)
echo "== pytest (python/tests)"
ZOPT_BUILD_DIR="$build" PYTHONPATH="$root/python" \
  /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/python/tests"
# The suite above steps through the extension zopt._fast where it was built;
# the tests of the per-step path again on the binding's pure-Python pass
# (test_grad_memory.py and test_scan.py run both in the suite already).
echo "== pytest, pure-Python per-step pass (ZOPT_NO_EXTENSION=1)"
ZOPT_NO_EXTENSION=1 ZOPT_BUILD_DIR="$build" PYTHONPATH="$root/python" \
  /usr/bin/python3 -m pytest -q -p no:cacheprovider \
  "$root"/python/tests/test_{torch_optim,api,state,mixed,main_grad,gpu_binding,gpu_frozen,lifecycle_fuzz}.py
echo "== regular suite passed in $(( $(date +%s) - start )) s"
# The sanitizer stage (docs/TESTING.md): ASan+UBSan of everything, TSan of
# the runtime. ZOPT_QUICK=1 skips it (and the fuzzing) for a local run; CI
# runs everything.
if [ "${ZOPT_QUICK:-0}" != 1 ]; then
  echo "== sanitizers (scripts/sanitize.sh)"
  BUILD_DIR="$build" bash "$root/scripts/sanitize.sh"
  # A bounded fixed-seed fuzzing run of the three libFuzzer targets
  # (descriptions, generated steps, checkpoint loading) under ASan.
  echo "== fuzzing (scripts/fuzz.sh ${ZOPT_FUZZ_SECONDS:-150})"
  bash "$root/scripts/fuzz.sh" "${ZOPT_FUZZ_SECONDS:-150}"
fi
echo "== all tests passed in $(( $(date +%s) - start )) s"

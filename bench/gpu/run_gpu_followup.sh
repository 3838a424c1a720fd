#!/usr/bin/env bash
# A second, short GPU-window command after run_gpu_bench.sh: reruns the
# tests that failed there with full tracebacks, the stages its time box cut,
# and the many-tensor probe. Same carry, same environment as run_gpu_bench.sh.
#   ZOPT_FAILED="file::test ..." bash bench/gpu/run_gpu_followup.sh
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
carry="${CARRY:-$root/.carry}"; repo="$carry/repo"; PY="${PYTHON:-python3}"
OUT="${OUT:-$root/gpu-out}"; mkdir -p "$OUT"
scratch="$(mktemp -d /tmp/zopt-gpu.XXXXXX)"; trap 'rm -rf "$scratch"' EXIT
export ZOPT_RUNTIME_LIB="$carry/lib/libzopt_runtime.so" ZOPT_TEST_STEP_CACHE="$carry/stepcache"
export ZOPT_CACHE_DIR="$scratch/zopt-cache" PYTHONPATH="$repo/python:$repo/python/tests/stepcache_site"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1; unset ZOPT_COMPILE
cd "$repo"
po="-p no:cacheprovider -rfEs"
echo "== A failures" ; timeout -k 5 100 "$PY" -m pytest $po --tb=long -q --timeout=60 ${ZOPT_FAILED:-} > "$OUT/a-failures.log" 2>&1; echo "A rc $?"
echo "== B streaming" ; timeout -k 5 110 "$PY" -m pytest $po -v --tb=short --timeout=90 --timeout-method=thread python/tests/test_grad_streaming.py > "$OUT/b-streaming.log" 2>&1; echo "B rc $?"
echo "== C probe" ; timeout -k 5 100 "$PY" bench/gpu/probe_tensors.py "$carry/steps/f32.gpu.so" 1 10000 > "$OUT/c-probe.log" 2>&1; echo "C rc $?"
echo "== D rest" ; timeout -k 5 ${REST_BOX:-130} "$PY" -m pytest $po -v --tb=short --timeout=60 ${ZOPT_REST:-} > "$OUT/d-rest.log" 2>&1; echo "D rc $?"
for f in "$OUT"/*.log; do echo "== $f"; tail -n 3 "$f"; done

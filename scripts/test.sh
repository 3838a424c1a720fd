#!/usr/bin/env bash
# Sets up, builds and runs every test: lit (dialects, passes, zopt-compile,
# executable kernel checks), the runtime's ctest suite and the Python
# parity tests. Exits non-zero if anything fails.
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
echo "== all tests passed in $(( $(date +%s) - start )) s"

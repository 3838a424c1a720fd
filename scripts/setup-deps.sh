#!/usr/bin/env bash
# Installs every Debian 12 package zopt needs to build, test and run its
# examples. Idempotent: does nothing when all packages are present.
# Must run as root (or with sudo available) on a fresh machine.
set -euo pipefail
PKGS=(
  cmake ninja-build ccache
  clang-22 lld-22 llvm-22-dev llvm-22-tools libmlir-22-dev mlir-22-tools
  libclang-rt-22-dev  # the sanitizer stage and libFuzzer (scripts/sanitize.sh, fuzz.sh)
  python3-numpy python3-pytest python3-torch
  libtorch-dev pybind11-dev  # torch's C++ headers: the binding's extension zopt._fast
  python3-matplotlib  # examples/log_metrics.py's plot (tested)
  libopenmpi-dev openmpi-bin
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

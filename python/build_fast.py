#!/usr/bin/env python3
"""Builds zopt._fast (zopt/_fast.cpp) against the torch this Python imports,
into OUT as ``_fast<EXT_SUFFIX>`` with ``_fast.json`` (the interpreter, the
torch version and C++ ABI it was built for, the interface number:
zopt/_ext.py loads it only where they match).

    build_fast.py --out DIR [--cxx COMPILER] [--stamp FILE] [--strict]

Never fails the build (unless --strict): when torch, its headers or the
compiler are missing, or the compile fails, it prints why, removes any
older build from OUT and exits 0, and the binding runs its pure-Python
path. Called by CMake (python/CMakeLists.txt: only when the source, this
script or torch's version file changed) and by python/setup.py (pip).
"""
import argparse
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "zopt", "_fast.cpp")
INTERFACE = 2  # zopt/_fast.cpp's kInterface


def _remove_old(out):
    for f in os.listdir(out):
        if f.startswith("_fast") and f.endswith((".so", ".json", ".tmp")):
            os.remove(os.path.join(out, f))


def command(out, cxx):
    """(compiler command, .so path, metadata) for this Python and torch;
    raises with the reason where it cannot be built."""
    try:
        import torch
        with contextlib.redirect_stderr(io.StringIO()):  # "No CUDA runtime is found"
            from torch.utils import cpp_extension
    except Exception as e:
        raise RuntimeError(f"torch does not import ({type(e).__name__}: {e})")
    incs = cpp_extension.include_paths()
    hdr = "torch/csrc/autograd/python_variable.h"
    if not any(os.path.isfile(os.path.join(d, hdr)) for d in incs):
        raise RuntimeError(f"torch {torch.__version__} has no C++ headers ({hdr} not under "
                           f"{incs[0]}; Debian: apt-get install libtorch-dev pybind11-dev)")
    abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    so = os.path.join(out, "_fast" + suffix)
    pyinc = sysconfig.get_paths()["include"]
    cmd = shlex.split(cxx) + [
        "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}",
        f'-DZOPT_TORCH_VERSION="{torch.__version__}"',
        "-isystem", pyinc] + [a for d in incs for a in ("-isystem", d)] + [
        SOURCE, "-o", so + ".tmp"] + [
        f"-L{d}" for d in cpp_extension.library_paths()] + [
        "-ltorch_python", "-ltorch_cpu", "-lc10"]
    meta = {"torch": torch.__version__, "cxx11_abi": abi,
            "python": sys.implementation.cache_tag, "interface": INTERFACE}
    return cmd, so, meta


def build(out, cxx=None, strict=False, quiet=False):
    """Builds into ``out``; returns the .so path or None (and why)."""
    os.makedirs(out, exist_ok=True)
    cxx = cxx or os.environ.get("CXX") or "c++"
    try:
        cmd, so, meta = command(out, cxx)
    except RuntimeError as e:
        return _failed(out, str(e), strict)
    t0 = time.time()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return _failed(out, f"{cmd[0]}: {e}", strict)
    if r.returncode != 0:
        tail = "\n".join(r.stdout.strip().splitlines()[-15:])
        return _failed(out, f"the compile failed:\n{' '.join(cmd)}\n{tail}", strict)
    os.replace(so + ".tmp", so)
    with open(os.path.join(out, "_fast.json"), "w") as f:
        json.dump(meta, f)
        f.write("\n")
    if not quiet:
        print(f"zopt._fast: built {so} for torch {meta['torch']} in {time.time() - t0:.0f} s")
    return so


def _failed(out, why, strict):
    _remove_old(out)
    msg = f"zopt._fast not built: {why}\n  (the binding runs its pure-Python per-step path)"
    if strict:
        sys.exit(msg)
    print(msg)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cxx")
    ap.add_argument("--stamp", help="touched when done (built or not)")
    ap.add_argument("--strict", action="store_true", help="fail when it cannot be built")
    a = ap.parse_args()
    try:
        build(a.out, a.cxx, a.strict)
    except Exception as e:  # never the build's failure
        _failed(a.out, f"{type(e).__name__}: {e}", a.strict)
    if a.stamp:
        with open(a.stamp, "w") as f:
            f.write("done\n")


if __name__ == "__main__":
    main()

"""Driving zopt-compile from Python."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

from ._lib import REPO_ROOT, Status, ZoptError


def find_compiler():
    """Path of zopt-compile: $ZOPT_COMPILE, build/bin/zopt-compile, or PATH."""
    env = os.environ.get("ZOPT_COMPILE")
    if env:
        return env if os.path.exists(env) else None
    cand = os.path.join(REPO_ROOT, "build", "bin", "zopt-compile")
    if os.path.exists(cand):
        return cand
    return shutil.which("zopt-compile")


def _is_text(src):
    return "zopt.step" in src or "\n" in src


def compile(src, out_path=None, extra_args=(), timeout=600):
    """Compiles a step description into a step.so and returns its path.

    ``src`` is MLIR text or the path of a ``.mlir`` file. Without ``out_path``
    the step.so goes to a fresh temporary directory. Raises ZoptError (code
    INVALID_ARGUMENT) with the compiler's diagnostics on failure.
    """
    exe = find_compiler()
    if exe is None:
        raise ZoptError(Status.IO, "zopt-compile not found: set ZOPT_COMPILE or "
                        f"build it at {os.path.join(REPO_ROOT, 'build', 'bin')}")
    src = os.fspath(src)
    tmpdir = None
    if _is_text(src):
        tmpdir = tempfile.mkdtemp(prefix="zopt-")
        h = hashlib.sha256(src.encode()).hexdigest()[:16]
        in_path = os.path.join(tmpdir, f"step-{h}.mlir")
        with open(in_path, "w") as f:
            f.write(src)
    else:
        in_path = src
        if not os.path.exists(in_path):
            raise ZoptError(Status.IO, f"no such description file: {in_path}")
    if out_path is None:
        if tmpdir is None:
            tmpdir = tempfile.mkdtemp(prefix="zopt-")
        out_path = os.path.join(
            tmpdir, os.path.splitext(os.path.basename(in_path))[0] + ".so")
    out_path = os.fspath(out_path)
    cmd = [exe, in_path, "-o", out_path, *extra_args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ZoptError(Status.INTERNAL, f"zopt-compile timed out: {' '.join(cmd)}")
    if r.returncode != 0 or not os.path.exists(out_path):
        diag = (r.stderr or "") + (r.stdout or "")
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"zopt-compile failed (exit {r.returncode}) on "
                        f"{in_path}:\n{diag.strip()}")
    return out_path

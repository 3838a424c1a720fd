"""Driving zopt-compile from Python."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ._lib import REPO_ROOT, Status, ZoptError
from ._warnings import warn_user

#: How diagnostics name a description given as text (line:col are those of
#: the text itself; zopt-compile reads it from stdin, no file is written).
SOURCE_NAME = "description"


class CompileWarning(UserWarning):
    """A warning of zopt-compile about a description that still compiled
    (a value that reaches no stored value, an unused hyperparameter)."""


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

    ``src`` is MLIR text or the path of a ``.mlir`` file. Text is passed to
    zopt-compile on stdin, so diagnostics point into it as
    ``description:LINE:COL`` with the offending line and a caret. Without
    ``out_path`` the step.so goes to a fresh temporary directory, which the
    caller owns; on failure nothing is left behind. Raises ZoptError (code
    INVALID_ARGUMENT) with the compiler's diagnostics on failure; the
    compiler's warnings are issued as CompileWarning.
    """
    exe = find_compiler()
    if exe is None:
        raise ZoptError(Status.IO, "zopt-compile not found: set ZOPT_COMPILE or "
                        f"build it at {os.path.join(REPO_ROOT, 'build', 'bin')}")
    src = os.fspath(src)
    text = _is_text(src)
    if text:
        in_arg, stdin, what = "-", src, "the description text"
        name = "step"
    else:
        if not os.path.exists(src):
            raise ZoptError(Status.IO, f"no such description file: {src}")
        in_arg, stdin, what = src, None, src
        name = os.path.splitext(os.path.basename(src))[0]
    tmpdir = None
    if out_path is None:
        tmpdir = tempfile.mkdtemp(prefix="zopt-")
        out_path = os.path.join(tmpdir, name + ".so")
    out_path = os.fspath(out_path)
    cmd = [exe, in_arg, "-o", out_path, *extra_args]
    if text:
        cmd.append(f"--source-name={SOURCE_NAME}")
    ok = False
    try:
        try:
            r = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ZoptError(Status.INTERNAL,
                            f"zopt-compile timed out after {timeout} s on {what}")
        diag = ((r.stderr or "") + (r.stdout or "")).strip()
        if r.returncode != 0 or not os.path.exists(out_path):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"zopt-compile failed (exit {r.returncode}) on "
                            f"{what}:\n{diag}")
        if "warning:" in diag:
            warn_user(f"zopt-compile on {what}:\n{diag}", CompileWarning)
        ok = True
        return out_path
    finally:
        if not ok and tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)

"""Where an installed zopt package finds the runtime library and the compiler.

The bindings look for libzopt_runtime.so and zopt-compile in this order:

  1. ``$ZOPT_RUNTIME_LIB`` / ``$ZOPT_COMPILE`` (a path to the file);
  2. ``$ZOPT_PREFIX``: an install prefix (``cmake --install build --prefix
     P``), i.e. ``P/lib/libzopt_runtime.so`` and ``P/bin/zopt-compile``;
  3. the build tree of the repository the package sits in
     (``<repo>/build/**/libzopt_runtime.so``, ``<repo>/build/bin``), as in a
     checkout;
  4. the install prefix the package itself was installed into by
     ``cmake --install`` (``P/lib/zopt/python/zopt``; the install writes
     ``zopt/INSTALL_PREFIX``, the relative way back to P);
  5. the prefix of a ``zopt-compile`` (or ``zopt-run``) on ``PATH``
     (``<bin>/../lib/libzopt_runtime.so``): a ``pip install ./python``
     package next to an installed zopt on the PATH;
  6. ``PATH`` for zopt-compile.

Steps 2, 4 and 5 work by setting ``ZOPT_RUNTIME_LIB`` / ``ZOPT_COMPILE`` for
this process (and so for its children) when ``import zopt`` runs and they
are unset, so steps 1 and 3 (``zopt._lib``, ``zopt.compiler``) stay as they
were. :func:`installation` reports what was found.
"""
from __future__ import annotations

import os
import shutil

from . import _ext, _lib, compiler as _compiler

_RUNTIME = "libzopt_runtime.so"
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_found = {}


def _prefix_has_runtime(p):
    return os.path.isfile(os.path.join(p, "lib", _RUNTIME))


def package_prefix():
    """The install prefix this package was installed into by cmake --install,
    or None. That install writes ``zopt/INSTALL_PREFIX``: the relative way
    from the package to the prefix (``../../../..`` for lib/zopt/python/zopt)."""
    try:
        with open(os.path.join(_PKG_DIR, "INSTALL_PREFIX")) as f:
            rel = f.read().strip()
    except OSError:
        return None
    p = os.path.normpath(os.path.join(_PKG_DIR, rel))
    return p if _prefix_has_runtime(p) else None


def path_prefix():
    """The prefix of a zopt-compile or zopt-run on PATH, or None."""
    for tool in ("zopt-compile", "zopt-run"):
        exe = shutil.which(tool)
        if exe:
            p = os.path.dirname(os.path.dirname(os.path.realpath(exe)))
            if _prefix_has_runtime(p):
                return p
    return None


def _configure():
    env = os.environ
    explicit = env.get("ZOPT_PREFIX")
    candidates = []
    if explicit:
        candidates.append(("ZOPT_PREFIX", os.path.abspath(explicit)))
    if "ZOPT_RUNTIME_LIB" not in env:
        build_lib = None if explicit else _lib.find_runtime_library()
        if build_lib is None:
            if not explicit:
                for how, fn in (("package", package_prefix), ("PATH", path_prefix)):
                    p = fn()
                    if p:
                        candidates.append((how, p))
                        break
            for how, p in candidates:
                lib = os.path.join(p, "lib", _RUNTIME)
                # An explicit ZOPT_PREFIX is used even when it lacks the
                # library: loading then fails naming the path, rather than
                # silently taking another one.
                if os.path.isfile(lib) or how == "ZOPT_PREFIX":
                    env["ZOPT_RUNTIME_LIB"] = lib
                    _found["runtime"] = (how, lib)
                    break
    if "ZOPT_COMPILE" not in env:
        build_cc = None if explicit else _compiler.find_compiler()
        if build_cc is None:
            if not explicit and not candidates:
                p = package_prefix()
                if p:
                    candidates.append(("package", p))
            for how, p in candidates:
                exe = os.path.join(p, "bin", "zopt-compile")
                if os.path.isfile(exe) and os.access(exe, os.X_OK):
                    env["ZOPT_COMPILE"] = exe
                    _found["compiler"] = (how, exe)
                    break


def installation():
    """{"runtime": path or None, "compiler": path or None, "how": {...},
    "extension": {"path": zopt._fast or None, "why": why not}}: what the
    bindings will use, and which search step found it."""
    try:
        rt = _lib.find_runtime_library()
    except Exception:  # ZOPT_RUNTIME_LIB names a missing file
        rt = None
    return {"runtime": rt, "compiler": _compiler.find_compiler(),
            "how": {k: v[0] for k, v in _found.items()}, "extension": _ext.info()}


_configure()

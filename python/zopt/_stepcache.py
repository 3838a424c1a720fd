"""Compiled steps on disk and in this process: ``zopt.steps.compile_text``
(description text -> step.so through the cache) and ``load_text`` (-> the
loaded :class:`zopt.Step`, once per process and step.so).

The cache (:func:`cache_dir`) keys a step.so by the sha256 of its text and
the compiler's identity; files appear by rename and a lock file per
description makes concurrent processes compile it once. Without a
compiler (a GPU machine given precompiled steps), any cached build of the
text is taken. Compiling itself is ``compiler.py``'s (``zopt.compile``,
looked up at each call so that the tests can stand in for it).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading

from . import compiler as _compiler
from ._step import Step


def cache_dir():
    """Where compiled steps are kept: ``$ZOPT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/zopt``, else ``~/.cache/zopt``.

    Layout: ``<dir>/steps/<sha256 of the text>.mlir`` (the description) and
    ``<sha256>.<compiler id>.so`` (the step.so; the compiler id, a hash of the
    zopt-compile binary's path, size and mtime, keeps a rebuilt compiler from
    loading stale kernels). Files appear atomically (written under a
    temporary name, then renamed), and a lock file per description makes
    concurrent processes compile it once. Deleting the directory is safe.
    """
    d = os.environ.get("ZOPT_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
            os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "zopt")
    return d


def _compiler_id(exe):
    st = os.stat(exe)
    key = f"{os.path.realpath(exe)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _atomic_write(path, data):
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _FileLock:
    def __init__(self, path):
        self.path = path
        self.f = None

    def __enter__(self):
        self.f = open(self.path, "a")
        try:
            import fcntl
            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover (not POSIX: rename stays atomic)
            pass
        return self

    def __exit__(self, *exc):
        try:
            import fcntl
            fcntl.flock(self.f.fileno(), fcntl.LOCK_UN)
        except ImportError:  # pragma: no cover
            pass
        self.f.close()


_loaded = {}
_loaded_lock = threading.Lock()


def compile_text(text):
    """Compiles description text through the cache; returns the step.so path."""
    _compile, find_compiler = _compiler.compile, _compiler.find_compiler
    h = hashlib.sha256(text.encode()).hexdigest()
    d = os.path.join(cache_dir(), "steps")
    os.makedirs(d, exist_ok=True)
    exe = find_compiler()
    if exe is None:
        # No compiler here (a GPU machine given precompiled steps): any
        # cached build of this description.
        hits = sorted((f for f in os.listdir(d)
                       if f.startswith(h + ".") and f.endswith(".so")),
                      key=lambda f: -os.path.getmtime(os.path.join(d, f)))
        if hits:
            return os.path.join(d, hits[0])
        # zopt.compile raises the not-found error, unless it has another
        # source of steps (a test's step cache): its step.so is then kept
        # here like a compiled one (under the id "precompiled").
        so = os.path.join(d, f"{h}.precompiled.so")
        with _FileLock(os.path.join(d, f"{h}.lock")):
            if not os.path.exists(so):
                fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".so")
                os.close(fd)
                try:
                    _compile(text, out_path=tmp)
                    mlir = os.path.join(d, f"{h}.mlir")
                    if not os.path.exists(mlir):
                        _atomic_write(mlir, text)
                    os.replace(tmp, so)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        return so
    so = os.path.join(d, f"{h}.{_compiler_id(exe)}.so")
    if os.path.exists(so):
        return so
    mlir = os.path.join(d, f"{h}.mlir")
    with _FileLock(os.path.join(d, f"{h}.lock")):
        if os.path.exists(so):      # another process compiled it meanwhile
            return so
        if not os.path.exists(mlir):
            _atomic_write(mlir, text)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".so")
        os.close(fd)
        try:
            _compile(mlir, out_path=tmp)
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return so


def load_text(text):
    """The loaded zopt.Step of description text (compiled through the cache;
    loaded once per process)."""
    so = compile_text(text)
    with _loaded_lock:
        st = _loaded.get(so)
        if st is None:
            st = Step(so)
            _loaded[so] = st
        return st

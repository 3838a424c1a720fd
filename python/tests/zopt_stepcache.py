"""A recording cache around zopt.compile() for machines without zopt-compile.

``install(root)`` replaces ``zopt.compile`` (and ``zopt.compiler.compile``,
which ``zopt.steps`` and the DeepSpeed importer call) by a wrapper keyed by
the sha256 of the description (the text, or the file's contents) and the
extra arguments:

* where zopt-compile exists, every call compiles as before and its outcome
  is RECORDED in ``root``: ``<key>.so`` and ``<key>.json`` (the compiler's
  warning, or the ZoptError it raised, with the source's name replaced by a
  placeholder). A key already recorded is replayed instead (a persistent
  cache; record into a fresh folder after the compiler changed);
* where it does not (a GPU machine: bench/gpu/prepare_carry.sh runs the
  suite here with ZOPT_TEST_STEP_CACHE and carries the folder), the recorded
  outcome is REPLAYED: the step.so copied to where zopt.compile would have
  written it (a fresh temporary directory the caller owns, or out_path), the
  warning issued again, the error raised again with this call's source
  name. A description that was never recorded skips the test with
  "not in the step cache".

conftest.py installs it when ZOPT_TEST_STEP_CACHE is set; CI never sets it.
stepcache_site/sitecustomize.py (on PYTHONPATH) installs it in every Python
process, so the examples the tests start as subprocesses replay too.
"""
import hashlib
import json
import os
import shutil
import tempfile
import warnings

SKIP_REASON = "not in the step cache"
_WHAT = "\x00WHAT\x00"
_SRC = "\x00SRC\x00"
_orig = None      # the real zopt.compiler.compile
_compiler = None  # the zopt.compiler module
stats = {"recorded": 0, "replayed": 0, "missing": 0, "root": None}


def _key(content, extra_args):
    """sha256 of the description and the arguments, less --cuda-path=
    (where the toolkit is differs between machines; a replayed step is the
    recording machine's build either way)."""
    h = hashlib.sha256()
    h.update(content.encode())
    for a in extra_args:
        if not str(a).startswith("--cuda-path="):
            h.update(b"\0" + str(a).encode())
    return h.hexdigest()[:32]


def _atomic_copy(src, dst):
    d = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _atomic_json(obj, dst):
    d = os.path.dirname(dst)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, dst)


def _skip(msg):
    import pytest
    pytest.skip(msg)


def make(root, compiler_module=None):
    """The wrapper around zopt.compile for the cache in ``root`` (not
    installed: install() does that)."""
    from zopt._lib import Status, ZoptError
    if compiler_module is None:
        import zopt.compiler as compiler_module
    _compiler = compiler_module
    _orig_compile = _orig or compiler_module.compile
    os.makedirs(root, exist_ok=True)
    stats["root"] = root

    def compile(src, out_path=None, extra_args=(), timeout=600):  # noqa: A001
        src = os.fspath(src)
        extra_args = tuple(extra_args)
        if _compiler._is_text(src):
            content, what, name, path = src, "the description text", "step", None
        else:
            if not os.path.exists(src):
                raise ZoptError(Status.IO, f"no such description file: {src}")
            with open(src) as f:
                content = f.read()
            what, path = src, src
            name = os.path.splitext(os.path.basename(src))[0]
        # Text and file differ in their diagnostics (which name the source):
        # keyed apart, but a success recorded for one replays for the other.
        key = _key(("file:" if path else "text:") + content, extra_args)
        meta, so = os.path.join(root, key + ".json"), os.path.join(root, key + ".so")
        if not os.path.exists(meta):
            alt = _key(("text:" if path else "file:") + content, extra_args)
            ameta = os.path.join(root, alt + ".json")
            if os.path.exists(ameta):
                with open(ameta) as f:
                    if json.load(f)["ok"]:
                        meta, so = ameta, os.path.join(root, alt + ".so")
        if not os.path.exists(meta):
            if _compiler.find_compiler() is None:
                stats["missing"] += 1
                first = next((l.strip() for l in content.splitlines() if "zopt.step" in l), "")
                _skip(f"{SKIP_REASON} {root} (no zopt-compile here): {first[:80]} [{key}]")
            return _record(src, out_path, extra_args, timeout, what, path, meta, so)
        with open(meta) as f:
            rec = json.load(f)
        stats["replayed"] += 1

        def fill(s):
            return s.replace(_WHAT, what).replace(_SRC, path or "description")
        if not rec["ok"]:
            raise ZoptError(rec["code"], fill(rec["message"]))
        tmpdir = None
        if out_path is None:
            tmpdir = tempfile.mkdtemp(prefix="zopt-")
            out_path = os.path.join(tmpdir, name + ".so")
        out_path = os.fspath(out_path)
        try:
            shutil.copyfile(so, out_path)
            os.chmod(out_path, 0o755)
        except BaseException:
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        if rec.get("warning"):
            warnings.warn(fill(rec["warning"]), _compiler.CompileWarning, stacklevel=2)
        return out_path

    def _record(src, out_path, extra_args, timeout, what, path, meta, so):
        def blank(s):
            s = s.replace(what, _WHAT)
            return s.replace(path, _SRC) if path else s
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            try:
                out = _orig_compile(src, out_path=out_path, extra_args=extra_args, timeout=timeout)
            except ZoptError as e:
                if e.code != Status.IO:  # a missing compiler or file is no outcome
                    _atomic_json({"ok": False, "code": int(e.code), "message": blank(e.message)}, meta)
                    stats["recorded"] += 1
                raise
        warning = None
        for w in ws:
            if issubclass(w.category, _compiler.CompileWarning):
                warning = str(w.message)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        _atomic_copy(out, so)
        _atomic_json({"ok": True, "warning": blank(warning) if warning else None}, meta)
        stats["recorded"] += 1
        return out

    compile.__doc__ = _orig_compile.__doc__
    compile.zopt_stepcache_root = root
    return compile


def install_into(compiler_module, root):
    """Wraps compiler_module.compile (zopt.compiler, possibly still being
    imported: zopt/__init__ then binds the wrapper as zopt.compile)."""
    global _orig, _compiler
    _compiler = compiler_module
    cur = compiler_module.compile
    if getattr(cur, "zopt_stepcache_root", None) == root:
        return cur
    if _orig is None:
        _orig = cur
    fn = make(root, compiler_module)
    compiler_module.compile = fn
    return fn


def install(root):
    """Routes zopt.compile through the cache in ``root``; returns the wrapper."""
    import zopt
    import zopt.compiler
    fn = install_into(zopt.compiler, root)
    zopt.compile = fn
    return fn


def original():
    """The real zopt.compile (the wrapped one)."""
    import zopt
    return _orig or zopt.compile


def needs_compiler():
    """Skips the calling test where there is no zopt-compile binary (it runs
    the binary itself, which the step cache cannot replay)."""
    import zopt
    if zopt.find_compiler() is None and os.environ.get("ZOPT_TEST_STEP_CACHE"):
        _skip(f"{SKIP_REASON}: the test runs the zopt-compile binary itself")

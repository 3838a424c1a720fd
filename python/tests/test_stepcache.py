"""The recording step cache of ZOPT_TEST_STEP_CACHE (zopt_stepcache.py),
which lets the suite run on a GPU machine without zopt-compile: what is
recorded where the compiler is comes back, the same, where it is not."""
import os
import warnings

import pytest

import zopt
import zopt_stepcache
from test_compiler import DEAD, GOOD, TYPO
from zopt.compiler import CompileWarning


def _outcome(fn, src, out):
    """(the step.so's bytes or the error's code and message, the warnings)"""
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        try:
            path = fn(src, out_path=out)
            got = open(path, "rb").read()
        except zopt.ZoptError as e:
            got = (e.code, e.message)
    return got, [str(w.message) for w in ws if issubclass(w.category, CompileWarning)]


def test_recorded_where_the_compiler_is_replayed_where_it_is_not(zopt_bins, tmp_path, monkeypatch):
    if zopt.find_compiler() is None:
        pytest.skip(f"{zopt_stepcache.SKIP_REASON}: needs zopt-compile to record")
    cache = tmp_path / "cache"
    rec = zopt_stepcache.make(str(cache))
    typo_file = tmp_path / "typo.mlir"
    typo_file.write_text(TYPO)
    srcs = [GOOD, DEAD, TYPO, str(typo_file)]
    recorded = [_outcome(rec, s, str(tmp_path / f"r{i}.so")) for i, s in enumerate(srcs)]
    assert isinstance(recorded[0][0], bytes) and recorded[1][1] and recorded[2][0][0] == zopt.Status.INVALID_ARGUMENT
    assert f"{typo_file}:11:19: error:" in recorded[3][0][1]
    # no compiler now (a GPU machine): the same outcomes, from the cache
    monkeypatch.setenv("ZOPT_COMPILE", str(tmp_path / "no-such-compiler"))
    assert zopt.find_compiler() is None
    rep = zopt_stepcache.make(str(cache))
    moved = tmp_path / "elsewhere.mlir"  # the same file under another name: named so
    moved.write_text(TYPO)
    replayed = [_outcome(rep, s, str(tmp_path / f"p{i}.so")) for i, s in enumerate(srcs)]
    assert replayed == recorded
    err = _outcome(rep, str(moved), str(tmp_path / "m.so"))[0][1]
    assert err == recorded[3][0][1].replace(str(typo_file), str(moved))
    # without out_path: a fresh directory of the caller's, as zopt.compile
    p = rep(GOOD)
    assert open(p, "rb").read() == recorded[0][0]
    os.unlink(p)
    os.rmdir(os.path.dirname(p))
    # never recorded: the test skips, naming the cache
    with pytest.raises(pytest.skip.Exception, match="not in the step cache"):
        rep(GOOD.replace("@sgd", "@sgd2"))

"""zopt.compile(): diagnostics that point into the user's text, warnings,
and no temporary files left behind."""
import os
import tempfile

import pytest

import zopt
from zopt.compiler import CompileWarning

GOOD = """zopt.step @sgd {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}
"""

# Line 11, column 19 of this text: the brief's misspelled attribute.
TYPO = """
zopt.step @adamw {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %b1 {decoupled_wd} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
"""

DEAD = GOOD.replace("  %lr = zopt.hyper lr\n",
                    "  %lr = zopt.hyper lr\n  %wd = zopt.hyper weight_decay\n")


@pytest.fixture
def private_tmp(zopt_bins, tmp_path, monkeypatch):
    """An empty directory that is the temporary directory of this process
    and of zopt-compile (TMPDIR), to see what a compile leaves behind."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d)
                  for r, _, fs in os.walk(d) for f in fs)


def test_error_points_into_the_text(private_tmp):
    with pytest.raises(zopt.ZoptError) as e:
        zopt.compile(TYPO)
    msg = e.value.message
    assert "zopt-compile failed" in msg and "the description text" in msg
    lines = msg.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith("description:11:19: error:"))
    assert "unknown attribute 'decoupled_wd'; did you mean 'decoupled'?" in lines[i]
    # the offending line of the user's text, then a caret under column 19
    assert lines[i + 1] == TYPO.splitlines()[10]
    assert lines[i + 2] == " " * 18 + "^"
    # no temporary file name, no generic-form dump of the op
    assert str(private_tmp) not in msg and ".mlir" not in msg
    assert "see current operation" not in msg


def test_no_temporary_files_left(private_tmp):
    with pytest.raises(zopt.ZoptError):
        zopt.compile(TYPO)
    assert _files(private_tmp) == []
    so = zopt.compile(GOOD)
    # the step.so is the result (its directory belongs to the caller); the
    # description text and the compiler's object file are gone
    assert _files(private_tmp) == [os.path.relpath(so, private_tmp)]
    assert so.endswith(".so") and os.path.getsize(so) > 0


def test_no_temporary_files_with_out_path(private_tmp, tmp_path):
    out = tmp_path / "sgd.so"
    assert zopt.compile(GOOD, out_path=out) == str(out)
    with pytest.raises(zopt.ZoptError):
        zopt.compile(TYPO, out_path=tmp_path / "typo.so")
    assert _files(private_tmp) == []
    assert not (tmp_path / "typo.so").exists()


def test_warnings_are_python_warnings(private_tmp, tmp_path):
    with pytest.warns(CompileWarning, match=r"description:5:9: warning: "
                      r"hyperparameter 'weight_decay' never reaches a stored value"):
        zopt.compile(DEAD, out_path=tmp_path / "dead.so")


def test_file_errors_name_the_file(private_tmp, tmp_path):
    path = tmp_path / "typo.mlir"
    path.write_text(TYPO)
    with pytest.raises(zopt.ZoptError) as e:
        zopt.compile(str(path))
    assert f"{path}:11:19: error:" in e.value.message
    assert _files(private_tmp) == []

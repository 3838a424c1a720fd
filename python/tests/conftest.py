"""Shared fixtures. The zopt binaries (zopt-compile, libzopt_runtime.so) are
REQUIRED: tests that need them FAIL (never skip) when they are missing, since
CI builds them before running this suite. Locate them with ZOPT_COMPILE /
ZOPT_RUNTIME_LIB, or build them under <repo>/build.

ZOPT_TEST_STEP_CACHE=DIR routes every zopt.compile() through a recording
cache in DIR (zopt_stepcache.py): where zopt-compile exists each outcome is
recorded, where it does not (a GPU machine: bench/gpu/prepare_carry.sh runs
the suite here to fill DIR) it is replayed, and a description never
recorded skips its test ("not in the step cache")."""
import hashlib
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import zopt  # noqa: E402
from zopt.describe import describe  # noqa: E402

if os.environ.get("ZOPT_TEST_STEP_CACHE"):
    import zopt_stepcache  # noqa: E402
    zopt_stepcache.install(os.environ["ZOPT_TEST_STEP_CACHE"])

_MISSING = None


def _binaries_problem():
    global _MISSING
    if _MISSING is None:
        probs = []
        if zopt.find_compiler() is None:
            probs.append("zopt-compile not found (ZOPT_COMPILE or "
                         f"{os.path.join(zopt._lib.REPO_ROOT, 'build/bin/zopt-compile')})")
        try:
            lib = zopt.find_runtime_library()
        except zopt.ZoptError as e:
            lib, probs = None, probs + [str(e)]
        if lib is None and not any("ZOPT_RUNTIME_LIB" in p for p in probs):
            probs.append("libzopt_runtime.so not found (ZOPT_RUNTIME_LIB or "
                         f"{os.path.join(zopt._lib.REPO_ROOT, 'build/**/libzopt_runtime.so')})")
        _MISSING = "; ".join(probs)
    return _MISSING


class StepCache:
    """Compiles each distinct description once per session (keyed by the
    sha256 of its text) and loads each step.so once."""

    def __init__(self, root):
        self.root = root
        self.steps = {}
        self.compiles = 0
        self.compile_seconds = 0.0

    def text(self, text):
        h = hashlib.sha256(text.encode()).hexdigest()[:20]
        if h not in self.steps:
            import time
            out = os.path.join(self.root, f"{h}.so")
            if not os.path.exists(out):
                t0 = time.perf_counter()  # zopt.compile may replay (ZOPT_TEST_STEP_CACHE)
                zopt.compile(text, out_path=out)
                self.compile_seconds += time.perf_counter() - t0
                self.compiles += 1
            self.steps[h] = zopt.Step(out)
        return self.steps[h]

    def __call__(self, **kw):
        return self.text(describe(**kw))


_CACHE = None


@pytest.fixture(scope="session")
def zopt_bins():
    prob = _binaries_problem()
    if prob and os.environ.get("ZOPT_TEST_STEP_CACHE") and zopt.find_compiler() is None \
            and "zopt-compile" in prob and ";" not in prob:
        prob = None  # precompiled steps only: the runtime library is there
    if prob:
        pytest.fail("zopt binaries are missing - build them before running the "
                    f"Python tests (CI builds them first): {prob}", pytrace=False)
    return True


@pytest.fixture(scope="session")
def steps(zopt_bins, tmp_path_factory):
    global _CACHE
    _CACHE = StepCache(str(tmp_path_factory.mktemp("zopt-steps")))
    return _CACHE


@pytest.fixture
def compiler_binary(zopt_bins, monkeypatch):
    """zopt-compile's path, for tests that run the binary itself (or count
    its runs): skipped where only the step cache is (ZOPT_TEST_STEP_CACHE
    without a compiler); where it records, zopt.compile is the real one for
    the test."""
    if os.environ.get("ZOPT_TEST_STEP_CACHE"):
        zopt_stepcache.needs_compiler()
        monkeypatch.setattr(zopt.compiler, "compile", zopt_stepcache.original())
        monkeypatch.setattr(zopt, "compile", zopt_stepcache.original())
    return zopt.find_compiler()


@pytest.fixture
def gpu_env(monkeypatch):
    """torch.cuda faked and the runtime recorded, for the binding's GPU path
    without a GPU (gpu_fakes.make_gpu_env: test_gpu_binding.py,
    test_gpu_frozen.py)."""
    import gpu_fakes
    return gpu_fakes.make_gpu_env(monkeypatch)


@pytest.fixture(params=["python", "extension"])
def scan_impl(request, monkeypatch):
    """The test runs on each implementation of the per-step pass over the
    params (zopt._scan.Scan, and zopt._fast.Scan where the extension is
    loaded: skipped where it is not, e.g. with ZOPT_NO_EXTENSION=1 or
    under another torch than it was built for; test_scan.py checks that it
    loads where it was built)."""
    if request.param == "extension":
        if zopt._ext.fast is None:
            pytest.skip(f"zopt._fast not loaded: {zopt._ext.why}")
        cls = zopt._ext.fast.Scan
    else:
        cls = zopt._scan.Scan
    monkeypatch.setattr(zopt._ext, "scan_class", lambda params: cls)
    return cls


def pytest_terminal_summary(terminalreporter):
    if _CACHE is not None:
        terminalreporter.write_line(
            f"zopt: {_CACHE.compiles} step(s) compiled in "
            f"{_CACHE.compile_seconds:.1f} s")
    if os.environ.get("ZOPT_TEST_STEP_CACHE"):
        st = zopt_stepcache.stats
        terminalreporter.write_line(
            f"zopt step cache {st['root']}: {st['recorded']} recorded, "
            f"{st['replayed']} replayed, {st['missing']} not in the cache")

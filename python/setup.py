"""`pip install ./python`: the zopt package (pyproject.toml), and beside it
zopt._fast, the binding's per-step pass in C++, built against the torch of
the installing environment by build_fast.py where it can be (torch with
its C++ headers importable: `pip install --no-build-isolation ./python`);
where it cannot, the install goes on without it, saying why, and the
binding runs its pure-Python path. ZOPT_NO_EXTENSION=1 skips it."""
import os
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_fast  # noqa: E402


class BuildPy(build_py):
    def run(self):
        super().run()
        if os.environ.get("ZOPT_NO_EXTENSION", "") in ("", "0"):
            build_fast.build(os.path.join(self.build_lib, "zopt"))


class MaybeBinary(Distribution):
    def has_ext_modules(self):  # a platform wheel: it may hold zopt/_fast*.so
        return True


setup(cmdclass={"build_py": BuildPy}, distclass=MaybeBinary)

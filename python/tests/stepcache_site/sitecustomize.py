"""Put this folder on PYTHONPATH with ZOPT_TEST_STEP_CACHE set (as
bench/gpu/prepare_carry.sh and run_gpu_bench.sh do) and every Python process
routes zopt.compile through the recording step cache (../zopt_stepcache.py)
as soon as it imports zopt: also the examples the tests start as
subprocesses, on a machine without zopt-compile. Nothing is imported until
the process imports zopt itself."""
import os
import sys

if os.environ.get("ZOPT_TEST_STEP_CACHE"):
    import importlib.abc
    import importlib.machinery

    _TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    class _ZoptCompilerHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "zopt.compiler":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if _TESTS not in sys.path:
                    sys.path.append(_TESTS)
                import zopt_stepcache
                zopt_stepcache.install_into(module, os.environ["ZOPT_TEST_STEP_CACHE"])
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _ZoptCompilerHook())

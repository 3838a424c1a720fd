"""Part of the zopt.install test: imports zopt from an installed location and
checks that it uses the installed runtime and compiler (found the way
``argv[2]`` says), builds a step with zopt.steps and imports a DeepSpeed
config, and runs one step.

    check_python.py <prefix> package|ZOPT_PREFIX|PATH
"""
import os
import sys

import numpy as np

prefix, how = os.path.realpath(sys.argv[1]), sys.argv[2]
import zopt  # noqa: E402

where = os.path.realpath(os.path.dirname(zopt.__file__))
source = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
assert not where.startswith(source), f"zopt imported from the source tree: {where}"
for oracle in ("reference", "interp"):  # test oracles: beside the tests, not shipped
    assert not os.path.exists(os.path.join(where, oracle + ".py")), f"{where} ships {oracle}.py"
inst = zopt.installation()
print(f"zopt from {where}: {inst}")
rt, cc = inst["runtime"], inst["compiler"]
assert rt and os.path.realpath(rt) == os.path.join(prefix, "lib", "libzopt_runtime.so"), rt
assert cc and os.path.realpath(cc) == os.path.join(prefix, "bin", "zopt-compile"), cc
want_how = {"package": "package", "ZOPT_PREFIX": "ZOPT_PREFIX", "PATH": "PATH"}[how]
assert inst["how"].get("runtime") == want_how, inst
# The extension zopt._fast, where one is used, is the installed one (next to
# the package), never the build tree's.
ext = inst["extension"]["path"]
assert ext is None or os.path.realpath(ext).startswith(where + os.sep), inst["extension"]

step = zopt.steps.sgd(momentum=0.9, lr=0.5)
p = np.arange(8, dtype=np.float32)
g = np.ones(8, dtype=np.float32)
opt = zopt.Optimizer(step, [(p, g)])
opt.step()
assert np.allclose(p, np.arange(8) - 0.5), p
text, defaults = zopt.deepspeed.from_config(
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
     "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, device="cpu")
assert zopt.steps.load_text(text).name.startswith("adamw_bf16")
print(f"check_python ({how}): ok")

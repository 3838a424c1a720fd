"""zopt: Python bindings (ctypes) of the zopt optimizer-step runtime.

    import zopt
    so = zopt.compile(open("examples/adamw_f32.mlir").read())
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=1e-3,
                         weight_decay=0.01)
    loss.backward(); opt.step()       # opt.last_grad_norm, opt.last_skipped

    step = zopt.steps.adamw(param="bf16", master="f32", clip=1.0)  # one line
"""
from . import bf16
from ._lib import (DType, HyperKind, Isa, Placement, StateKind, Status,
                   ZoptError, ZoptTypeError, ZoptValueError, find_runtime_library)
from .compiler import compile, find_compiler
from ._install import installation  # also: finds an installed runtime (see _install)
from .optimizer import Optimizer
from ._step import Step
from . import steps
from .zero3 import zero3_hooks


def __getattr__(name):  # zopt.deepspeed loads on first use (python3 -m zopt.deepspeed)
    if name == "deepspeed":
        import importlib
        return importlib.import_module(".deepspeed", __name__)
    raise AttributeError(f"module 'zopt' has no attribute {name!r}")

__all__ = ["bf16", "compile", "find_compiler", "find_runtime_library",
           "DType", "HyperKind", "Isa", "Placement", "StateKind", "Status",
           "Step", "Optimizer", "ZoptError", "ZoptTypeError", "ZoptValueError", "steps",
           "deepspeed", "installation", "zero3_hooks"]

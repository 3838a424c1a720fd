"""zopt: Python bindings (ctypes) of the zopt optimizer-step runtime.

    import zopt
    so = zopt.compile(open("examples/adamw_f32.mlir").read())
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=1e-3,
                         weight_decay=0.01)
    loss.backward(); opt.step()       # opt.last_grad_norm, opt.last_skipped
"""
from . import bf16
from ._lib import (DType, HyperKind, Isa, Placement, StateKind, Status,
                   ZoptError, find_runtime_library)
from .compiler import compile, find_compiler
from .optimizer import Optimizer, Step
from .zero3 import zero3_hooks

__all__ = ["bf16", "compile", "find_compiler", "find_runtime_library",
           "DType", "HyperKind", "Isa", "Placement", "StateKind", "Status",
           "Step", "Optimizer", "ZoptError", "zero3_hooks"]

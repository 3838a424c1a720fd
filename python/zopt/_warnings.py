"""Warnings that point at the user's line.

Every warning the binding raises names the first frame outside the zopt
package AND outside torch (the user's call), however many frames lie
between: zopt's own (decorators, helpers, the linked parts of a
MixedOptimizer) and torch's wrappers around the methods of a
torch.optim.Optimizer (torch 2 puts ``torch._dynamo``'s disable wrapper,
``eval_frame.py``, around ``step``/``load_state_dict``/``zero_grad``...,
its profiling/hook wrapper around ``step``, and ``_use_grad``): a fixed
``stacklevel`` breaks each time a call path changes."""
from __future__ import annotations

import os
import sys
import warnings

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = None  # torch's package folder (+ os.sep), once torch is imported


def _torch_dir():
    global _TORCH
    if _TORCH is None:
        mod = sys.modules.get("torch")
        path = getattr(mod, "__file__", None) if mod is not None else None
        if not path:
            return None  # not imported (yet): no torch frame can be on the stack
        _TORCH = os.path.dirname(os.path.abspath(path)) + os.sep
    return _TORCH


def _internal(frame):
    """A frame of zopt or of torch (by its module's name, else its file)."""
    name = frame.f_globals.get("__name__") or ""
    if name == "torch" or name.startswith("torch.") or name == "zopt" or name.startswith("zopt."):
        return True
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(_PKG):
        return True
    t = _torch_dir()
    return t is not None and path.startswith(t)


def user_stacklevel(skip=1):
    """The ``stacklevel`` for warnings.warn called ``skip`` frames below
    the caller of this function that names the first frame outside zopt
    and torch."""
    level = skip + 1
    f = sys._getframe(skip + 1)
    while f is not None and _internal(f):
        f = f.f_back
        level += 1
    return level


def warn_user(message, category=UserWarning):
    """warnings.warn(message, category) attributed to the user's frame."""
    warnings.warn(message, category, stacklevel=user_stacklevel(1))

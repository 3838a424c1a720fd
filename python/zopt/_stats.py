"""``Optimizer.step_stats()``: where the last step's time went on the host
(the C struct ``zopt_step_stats``, zopt.h; keys: docs/USAGE.md "Step
statistics"), the baseline of an offloaded step: its copies of the grads
to the host, the CPU update, the copies of the params back, the whole."""
import ctypes

from . import _lib
from ._lib import check

_SUMMED = ("total_seconds", "d2h_seconds", "update_seconds", "h2d_seconds", "d2h_bytes",
           "h2d_bytes")


def _one(part):
    s = _lib.StepStats()
    check(part.lib.zopt_optimizer_get_step_stats(part.handle(), ctypes.byref(s)),
          "zopt_optimizer_get_step_stats")
    out = {f: getattr(s, f) for f in _SUMMED}
    out["offloaded"] = bool(s.offloaded)
    out["steps"] = s.steps
    return out


def step_stats(opt):
    """The last completed step's figures; with a step per class the
    classes' summed (``offloaded`` if any is, ``steps`` the most), and
    ``classes``: each class's own."""
    opt._check_open()
    per = {c.cls: _one(c) for c in opt._parts}
    if not opt._mapped:
        return next(iter(per.values()))
    out = {k: sum(p[k] for p in per.values()) for k in _SUMMED}
    out["offloaded"] = any(p["offloaded"] for p in per.values())
    out["steps"] = max(p["steps"] for p in per.values())
    out["classes"] = per
    return out

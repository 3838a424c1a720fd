"""``opt.clip_grad_norm_(max_norm)``: clipping the zopt way.

A DDP script clips between backward and ``step()`` with
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. Under
zopt at several ranks that is wrong: ``p.grad`` holds each rank's own,
unreduced gradient (zopt reduces inside ``step()``), so every rank clips by
a different, local norm; with ``grad_streaming=True`` ``p.grad`` is None and
it clips nothing (and returns 0).

``opt.clip_grad_norm_(max_norm)`` does it where the gradients are: it runs
the first half of the step now (``zopt_optimizer_step_begin``: the ranks'
agreement, the gradient reduction and the global norm over all ranks, the
one the step clips by) with the step's clip threshold set to ``max_norm``,
and returns that norm as torch does (a 0-d float32 tensor); ``step()``
finishes the step, clipping every rank's update by
``min(1, max_norm / (norm + 1e-6))`` (torch's formula). The threshold holds
for that step only (the compiled one afterwards). Between the two calls
the optimizer accepts no other call (``ZoptError`` BAD_STATE; ``zero_grad()``
too): the gradients were taken at ``clip_grad_norm_``, and at several ranks
the reduced ones are in the gradient memory the step reads, so ``p.grad``
must not be written until ``step()``.

GPU steps run as one stream of kernels: ``clip_grad_norm_`` sets the
threshold (the kernels read it from the device, docs/GPU.md) and returns
torch's norm of the gradients the step reads (see :func:`_gpu_clip`);
``step()`` runs the whole step, clipped at ``max_norm``.

The step must have been compiled with clipping (any ``max_norm``:
``zopt.steps.adamw(clip=1.0)``); without a clip in its program the step
computes no norm and cannot clip, and ``clip_grad_norm_`` says so.
"""
from __future__ import annotations

import ctypes
import math
import time

from . import _lib
from ._dtypes import is_torch
from ._lib import Status, ZoptError, check

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["clip_grad_norm_", "finish"]


def _parts(opt):
    """The parts (parameter classes) stepped together and whether they step
    linked (several classes)."""
    return list(opt._parts), len(opt._parts) > 1


def clip_grad_norm_(opt, max_norm, norm_type=2.0, error_if_nonfinite=False):
    try:
        max_norm = float(max_norm)
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: max_norm and norm_type must be numbers, got "
                        f"{max_norm!r}, {norm_type!r}") from None
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"clip_grad_norm_: max_norm must be finite and > 0, got {max_norm!r}")
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r}: the step clips by the L2 "
                         "norm of the gradients (norm_type=2.0) only")
    parts, linked = _parts(opt)
    s = opt.step_obj
    if not s.clipped:
        raise ZoptError(Status.UNSUPPORTED,
                        f"clip_grad_norm_: step '{s.name}' was compiled without global-norm "
                        "clipping, so its program computes no norm and cannot clip. Build it "
                        "with clipping: zopt.steps.<rule>(..., clip=1.0) (any max_norm: "
                        "clip_grad_norm_(max_norm) sets it for each step), or "
                        "zopt.clip_by_global_norm in the description")
    if opt._begun:
        raise ZoptError(Status.BAD_STATE, "clip_grad_norm_ was called already for this step: "
                        "call step() first")
    if not opt._step_prologue():  # world size 1, no gradient: nothing to clip
        return torch.zeros((), dtype=torch.float32) if torch is not None else 0.0
    L = opt._lib
    hs = [c.h for c in parts]
    for h in hs:
        check(L.zopt_optimizer_set_max_norm(h, max_norm), "clip_grad_norm_")
    if any(c.step.gpu for c in parts) and not linked:  # linked (a GPU fraction): begun below
        return _gpu_clip(opt, parts, norm_type, error_if_nonfinite)
    r = _lib.StepResult()
    if linked:
        keep, arr = _lib.c_array(ctypes.c_void_p, [h.value for h in hs])
        st = L.zopt_optimizer_step_linked_begin(arr, len(hs), ctypes.byref(r))
    else:
        st = L.zopt_optimizer_step_begin(hs[0], ctypes.byref(r))
    if st:
        _restore(opt, parts)
        check(st, "clip_grad_norm_ (zopt_optimizer_step_begin)")
    opt._begun = True
    norm = float(r.grad_norm)
    if error_if_nonfinite and not math.isfinite(norm):
        finish(opt, None)  # a skipped step: nothing changes
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return torch.tensor(norm, dtype=torch.float32) if torch is not None else norm


def _gpu_clip(opt, parts, norm_type, error_if_nonfinite):
    """GPU steps run as one stream of kernels (no first half to run now):
    the threshold is set (the kernels read it from the device), step()
    runs the whole step and restores the compiled one. The norm returned
    is torch's, of the gradients the step reads (world size 1: p.grad, or
    p.main_grad for f32 gradients) times the step's gradient scale
    1/(S*D), in float64, as a 0-d float32 tensor on their device (no
    sync); the step clips by its own float64 norm of the same values."""
    try:
        norm = _torch_norm(parts)
    except BaseException:
        _restore(opt, parts)
        raise
    opt._begun = True
    if error_if_nonfinite and not math.isfinite(float(norm)):
        finish(opt, None)  # the step skips on the device: nothing changes
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm


def _torch_norm(parts):
    sq, dev = [], None
    for c in parts:
        S = c.get_loss_scale() if c.step.loss_scaled else 1.0
        gs = 1.0 / (S * c.grad_divisor_value)
        for e in c.entries:
            p = e.param
            g = getattr(p, "main_grad", None) if c.main else None
            if g is None:
                g = getattr(p, "grad", None)
            if g is None or not is_torch(g):
                continue
            dev = g.device
            x = torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float64) * abs(gs)
            sq.append(x * x)
    if not sq:
        return torch.zeros((), dtype=torch.float32)
    return torch.sqrt(torch.stack([t.to(dev) for t in sq]).sum()).to(torch.float32)


def _restore(opt, parts):
    """The compiled max_norm again (the threshold held for one step)."""
    for c in parts:
        if c.h is not None and c.step.clipped:
            c.lib.zopt_optimizer_set_max_norm(c.h, float(c.step.max_norm))


def finish(opt, closure):
    """step() after clip_grad_norm_: the rest of the begun step."""
    if closure is not None:
        raise ZoptError(Status.BAD_STATE,
                        "step(closure) after clip_grad_norm_: clip_grad_norm_ began this step "
                        "with the gradients it saw; a closure would compute new ones. Call "
                        "step() without a closure")
    parts, _ = _parts(opt)
    t0 = time.perf_counter()
    opt._begun = False  # what follows the step (a ZeRO-3 gather, hooks) may call in
    try:
        opt._run_native_step(t0)
    finally:
        _restore(opt, parts)
    opt.last_loss = None
    return None

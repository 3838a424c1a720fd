"""What a compiled step's update rule is where its descriptor does not say:
whether an SGD step's momentum is Nesterov's (torch.optim.SGD's
``nesterov``) and whether an Adam step's weight decay is decoupled
(AdamW; torch 2.x's ``Adam(decoupled_weight_decay=...)``). zopt._hypers
compares torch's group keys with these.

The descriptor (docs/ABI.md) lists states and hyperparameter slots, which
both pairs of rules share, so the step is run once on a scratch native
optimizer (the C API) over one-element numpy params (CPU-updated steps),
and the result read:

* SGD with a momentum buffer: two params in two groups, gradient 1, lr 1,
  momentum 0.5 and 0.25, no dampening, no decay; a first step moves each by
  c*g (buf = g) or, Nesterov, by c*(1 + momentum)*g, with c the same
  factor for both (clipping, loss scale): the ratio of the two moves is 1
  or 1.5/1.25 = 1.2;
* Adam-like: param 1, gradient 0, lr 0.1, weight_decay 0.5: L2 decay makes
  the gradient 0.5 and the step moves the param by lr (to 0.9), decoupled
  decay multiplies it by 1 - lr*wd (0.95) and the zero moments add nothing.

Steps whose params live on the GPU (GPU and offloaded steps) cannot run
here: their flags are unknown (None) and not checked. The answer is kept
on the Step.
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import bf16
from ._lib import DType, LossScalerConfig, StateKind, StepResult, check, lib

_NP = {DType.F32: np.float32, DType.F16: np.float16}


def _arr(dt, v):
    if dt == DType.BF16:
        return bf16.from_f32(np.array([v], np.float32))
    return np.array([v], _NP[dt])


def _run(step, groups):
    """The params (as floats) after one step of a scratch native optimizer
    (the C API, zopt.h) over ``groups``: [(param value, gradient value,
    {hyperparameter: value})], one one-element tensor each, one thread, a
    loss scale of 1. Raises where the step does not fit (then: unknown)."""
    L = lib()
    h = ctypes.c_void_p()
    check(L.zopt_optimizer_create(step._h, ctypes.byref(h)), "probe: zopt_optimizer_create")
    keep = []
    try:
        check(L.zopt_optimizer_set_num_threads(h, 1), "probe: set_num_threads")
        for gid, (p, g, hyp) in enumerate(groups):
            ng = ctypes.c_int()
            check(L.zopt_optimizer_add_group(h, ctypes.byref(ng)), "probe: add_group")
            for name, v in hyp.items():
                check(L.zopt_optimizer_set_hyper(h, gid, name.encode(), float(v)),
                      f"probe: set_hyper({name})")
            pa, ga = _arr(step.param_dtype, p), _arr(step.grad_dtype, g)
            keep += [pa, ga]
            tid = ctypes.c_int()
            check(L.zopt_optimizer_add_tensor(h, gid, ctypes.c_void_p(pa.ctypes.data),
                                              ctypes.c_void_p(ga.ctypes.data), 1,
                                              int(step.param_dtype), ctypes.byref(tid)),
                  "probe: add_tensor")
        if step.loss_scaled:
            cfg = LossScalerConfig(1.0, 2.0, 0.5, 2000, 1.0, 0)
            check(L.zopt_optimizer_configure_loss_scaler(h, ctypes.byref(cfg)),
                  "probe: configure_loss_scaler")
        check(L.zopt_optimizer_finalize(h), "probe: finalize")
        res = StepResult()
        check(L.zopt_optimizer_step(h, ctypes.byref(res)), "probe: step")
        out = []
        for t in range(len(groups)):
            v = np.empty(1, np.float32)
            check(L.zopt_optimizer_read_state_f32(h, t, int(StateKind.PARAM),
                                                  ctypes.c_void_p(v.ctypes.data), 1),
                  "probe: read_state")
            out.append(float(v[0]))
        return out
    finally:
        L.zopt_optimizer_free(h)


def _nesterov(step):
    hyp = {"lr": 1.0, "weight_decay": 0.0}
    if "dampening" in step.hypers:
        hyp["dampening"] = 0.0
    a, b = _run(step, [(0.0, 1.0, dict(hyp, momentum=0.5)),
                       (0.0, 1.0, dict(hyp, momentum=0.25))])
    if not (a < 0 and b < 0):
        return None
    return a / b > 1.1  # 1.0 or 1.2


def _decoupled(step):
    (p,) = _run(step, [(1.0, 0.0, dict(lr=0.1, weight_decay=0.5))])
    if not 0.85 < p < 1.0:
        return None
    return p > 0.925  # 0.9 (L2) or 0.95 (decoupled)


def _probe(step):
    sgd = StateKind.MOMENTUM_BUFFER in step.state_flags and "momentum" in step.hypers
    adam = step.adam_like and "weight_decay" in step.hypers
    # not an SGD step with a buffer: not Nesterov; not Adam: no such question
    flags = {"nesterov": None if sgd else False, "decoupled": None}
    if step.on_device or step.gpu:  # cannot run here: unknown
        return flags
    try:
        if sgd:
            flags["nesterov"] = _nesterov(step)
        if adam:
            flags["decoupled"] = _decoupled(step)
    except Exception:  # a step this probe does not fit: unknown, not checked
        pass
    return flags


def rule_flags(step):
    """{'nesterov': bool or None, 'decoupled': bool or None} of a step
    (None: unknown or not the rule's question), found once per Step."""
    f = step.__dict__.get("_rule_flags")
    if f is None:
        f = step._rule_flags = _probe(step)
    return f

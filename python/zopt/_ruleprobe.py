"""What a compiled step's update rule is where its descriptor does not say:
whether an SGD step's momentum is Nesterov's (torch.optim.SGD's
``nesterov``) and whether an Adam step's weight decay is decoupled
(AdamW; torch 2.x's ``Adam(decoupled_weight_decay=...)``). zopt._hypers
compares torch's group keys with these.

The descriptor (docs/ABI.md) lists states and hyperparameter slots, which
both pairs of rules share, so the step is run once on a scratch optimizer
of its own over one-element numpy params (CPU-updated steps), and the
result read:

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

import time

import numpy as np

from . import bf16
from ._dtypes import torch, torch_of
from ._lib import DType, StateKind

_NP = {DType.F32: np.float32, DType.F16: np.float16}


def _arr(dt, v):
    if dt == DType.BF16:
        return bf16.from_f32(np.array([v], np.float32))
    return np.array([v], _NP[dt])


def _val(dt, a):
    return float(bf16.to_f32(a)[0]) if dt == DType.BF16 else float(a[0])


def _pair(step, p, g):
    if step.zero3 and torch is not None:  # ZeRO-3 holds torch params
        t = torch.nn.Parameter(torch.tensor([p], dtype=torch_of(step.param_dtype)))
        t.grad = torch.tensor([g], dtype=torch_of(step.grad_dtype))
        return t
    return (_arr(step.param_dtype, p), _arr(step.grad_dtype, g))


def _run(step, groups, **kw):
    """The params (as floats) after one step of a scratch optimizer over
    ``groups``; raises where the step does not fit (then: unknown)."""
    from .optimizer import Optimizer  # the probe is an optimizer of its own
    opt = Optimizer(step, groups, num_threads=1,
                    loss_scaler=dict(init_scale=1.0) if step.loss_scaled else None, **kw)
    try:
        # the step itself, not step(): torch 2's global step hooks see no phantom step
        if opt._step_prologue():
            opt._run_native_step(time.perf_counter())
        if step.zero3:  # the model's params, gathered after the step
            return [float(g["params"][0].float()[0]) for g in groups]
        return [_val(step.param_dtype, g["params"][0][0]) for g in groups]
    finally:
        opt.close()


def _nesterov(step):
    hyp = {"lr": 1.0, "weight_decay": 0.0}
    if "dampening" in step.hypers:
        hyp["dampening"] = 0.0
    groups = [dict(params=[_pair(step, 0.0, 1.0)], momentum=0.5, **hyp),
              dict(params=[_pair(step, 0.0, 1.0)], momentum=0.25, **hyp)]
    a, b = _run(step, groups)
    if not (a < 0 and b < 0):
        return None
    return a / b > 1.1  # 1.0 or 1.2


def _decoupled(step):
    hyp = {k: v for k, v in dict(lr=0.1, weight_decay=0.5).items() if k in step.hypers}
    (p,) = _run(step, [dict(params=[_pair(step, 1.0, 0.0)], **hyp)])
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
        # unknown while the probe runs (its own optimizer checks its groups)
        step._rule_flags = {"nesterov": None, "decoupled": None}
        try:
            f = _probe(step)
        finally:
            step.__dict__.pop("_rule_flags", None)
        step._rule_flags = f
    return f

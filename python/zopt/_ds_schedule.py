"""DeepSpeed config import, the ``scheduler`` section: WarmupLR,
WarmupDecayLR and WarmupCosineLR -> ``defaults["scheduler"]`` (OneCycle and
LRRangeTest refused), and DeepSpeed's formulas for them
(deepspeed/runtime/lr_schedules.py): :func:`lr_at` and
:func:`torch_scheduler` (a LambdaLR), both public as zopt.deepspeed's.
Below zopt.deepspeed, over _ds_fields."""
from __future__ import annotations

import math

from ._ds_fields import DeepSpeedConfigError, _no_auto, _num, _str
from ._lib import Status, ZoptError


SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _scheduler(sch, W, st):
    path = "scheduler"
    W.section(sch, path, {"type": "", "params": ""})
    t = _no_auto(sch.get("type"), "scheduler.type")
    if t in ("OneCycle", "LRRangeTest"):
        why = ("it cycles the momentum (beta1) too, which zopt's scheduler mapping "
               "does not carry: use torch.optim.lr_scheduler.OneCycleLR on the optimizer"
               if t == "OneCycle" else "a learning-rate range test is a tuning run, not a "
               "schedule: run it with torch.optim.lr_scheduler.LambdaLR")
        raise DeepSpeedConfigError("scheduler.type", f"{t!r} is not mapped ({why}); "
                                   "supported: " + ", ".join(SUPPORTED_SCHEDULERS))
    if t not in SUPPORTED_SCHEDULERS:
        raise DeepSpeedConfigError("scheduler.type", f"{t!r} is not supported; "
                                   "supported: " + ", ".join(SUPPORTED_SCHEDULERS))
    params = sch.get("params") or {}
    pp = "scheduler.params"
    common = ["warmup_num_steps", "warmup_type", "last_batch_iteration"]
    if t == "WarmupLR":
        known = ["warmup_min_lr", "warmup_max_lr"] + common
    elif t == "WarmupDecayLR":
        known = ["warmup_min_lr", "warmup_max_lr", "total_num_steps"] + common
    else:
        known = ["warmup_min_ratio", "cos_min_ratio", "total_num_steps"] + common
    W.section(params, pp, dict.fromkeys(known))
    out = {"type": t}
    dflt = dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                warmup_type="log", last_batch_iteration=-1, warmup_min_ratio=0.0,
                cos_min_ratio=0.0001)
    for k in known:
        if k == "total_num_steps":
            if k not in params:
                raise DeepSpeedConfigError(f"{pp}.total_num_steps", f"{t} needs it")
            out[k] = _num(params[k], f"{pp}.{k}", lo=1, integer=True)
        elif k == "warmup_type":
            out[k] = _str(params.get(k, "log"), f"{pp}.{k}", ("log", "linear"))
        elif k in ("warmup_num_steps",):
            out[k] = _num(params.get(k, dflt[k]), f"{pp}.{k}", lo=0, integer=True)
        elif k == "last_batch_iteration":
            out[k] = _num(params.get(k, -1), f"{pp}.{k}", lo=-1, integer=True)
        else:
            v = params.get(k, dflt[k])
            if isinstance(v, (list, tuple)):
                raise DeepSpeedConfigError(f"{pp}.{k}", "per-group lists are not mapped: "
                                           "give one value")
            out[k] = _num(v, f"{pp}.{k}", lo=0.0)
        if k in params:
            W.use(f"{pp}.{k}", "honoured: defaults['scheduler']")
    if t == "WarmupCosineLR" and out["total_num_steps"] == max(2, out["warmup_num_steps"]):
        # DeepSpeed's cosine divides by total - warmup after the warm-up (a
        # ZeroDivisionError at its first step there): refused here instead.
        raise DeepSpeedConfigError(f"{pp}.total_num_steps",
                                   f"{out['total_num_steps']} equals the warm-up's length "
                                   f"({max(2, out['warmup_num_steps'])} steps): the cosine "
                                   "after it would divide by zero; give more steps than the warm-up")
    W.use("scheduler.type", f"honoured: torch.optim.lr_scheduler.LambdaLR reproducing "
          f"DeepSpeed's {t} (zopt.deepspeed.torch_scheduler / lr_at)")
    out["torch"] = ("torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda i: "
                    f"zopt.deepspeed.lr_at(scheduler, i, base_lr) / base_lr)")
    st["scheduler"] = out


def lr_at(scheduler, i, base_lr):
    """The learning rate DeepSpeed's scheduler gives the ``i``-th optimizer
    step (0-based) of a group whose configured lr is ``base_lr``. DeepSpeed
    sets the lr when the scheduler is built (step 0) and after each step."""
    t = scheduler["type"]
    it = i - 1 + (scheduler.get("last_batch_iteration", -1) + 1)
    W = max(2, scheduler.get("warmup_num_steps", 1000))
    log = scheduler.get("warmup_type", "log") == "log"

    def warm(it):
        return math.log(it + 1) / math.log(W) if log else it / W

    if t in ("WarmupLR", "WarmupDecayLR"):
        lo, hi = scheduler.get("warmup_min_lr", 0.0), scheduler.get("warmup_max_lr", 0.001)
        if it < 0:
            return lo
        if it < W:
            gamma = warm(it)
        elif t == "WarmupLR":
            gamma = 1.0
        else:
            T = scheduler["total_num_steps"]
            gamma = max(0.0, float(T - it) / float(max(1.0, T - W)))
        return lo + (hi - lo) * gamma
    if t == "WarmupCosineLR":
        if it < 0:
            return 0.0
        if it < W:
            r0 = scheduler.get("warmup_min_ratio", 0.0)
            ratio = r0 + warm(it) * (1.0 - r0)
        else:
            T = scheduler["total_num_steps"]
            cmin = scheduler.get("cos_min_ratio", 0.0001)
            ratio = (1 + math.cos(math.pi * (it - W + 1) / (T - W))) / 2
            ratio = max(0.0, cmin + (1.0 - cmin) * ratio)
        return base_lr * ratio
    raise ZoptError(Status.INVALID_ARGUMENT, f"unknown scheduler type {t!r}")


def torch_scheduler(optimizer, scheduler):
    """A torch.optim.lr_scheduler.LambdaLR on ``optimizer`` (anything with
    torch's ``param_groups``) that gives each step DeepSpeed's learning
    rate: step the scheduler after each optimizer step, as DeepSpeed does."""
    import torch
    lambdas = []
    for g in optimizer.param_groups:
        base = g.get("initial_lr", g["lr"])
        if base <= 0 and scheduler["type"] != "WarmupCosineLR":
            raise ZoptError(Status.INVALID_ARGUMENT, "a LambdaLR needs a positive initial "
                            "lr in every param group")
        lambdas.append(lambda i, b=base: lr_at(scheduler, i, b) / b if b > 0 else 0.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)

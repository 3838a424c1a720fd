"""Param groups and their hyperparameters: torch's group keys (``lr``,
``betas``, ``maximize``, ...) <-> the step's hyperparameter slots (docs/USAGE.md
section 2); the checks a group passes before anything reaches the runtime."""
from __future__ import annotations

import numpy as np

from ._dtypes import is_torch, torch
from ._ext import same
from ._lib import GROUP_MAXIMIZE, StateKind, Status, ZoptError, ZoptTypeError, ZoptValueError, HYPER_BY_NAME


def bool_hyper(name, v):
    """bias_correction, maximize: True/False (or exactly 0/1), like the C
    API's range but without its values in between."""
    if isinstance(v, (bool, np.bool_)):
        return 1.0 if v else 0.0
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = None
    if f in (0.0, 1.0):
        return f
    raise ZoptValueError(f"{name} = {v!r} must be True or False (or 0/1)")


def maximize(group):
    """A group's torch.optim ``maximize`` flag (absent: False)."""
    v = group.get("maximize", False)
    return False if v is None else bool(bool_hyper("maximize", v))


def slots(group, hypers):
    """The hyperparameter keys of a group dict -> {slot name: float}. Keys
    that are not hyperparameter names (schedulers' 'initial_lr', torch's
    'amsgrad', 'foreach', ...) are carried along and ignored here."""
    out = {}
    for key, val in group.items():
        if key == "params" or val is None:
            continue
        if key == "betas":
            try:
                b = tuple(val)
            except TypeError:
                b = ()
            if len(b) != 2:
                raise ZoptValueError(f"betas must be a pair, got {val!r}")
            try:
                out["beta1"], out["beta2"] = float(b[0]), float(b[1])
            except (TypeError, ValueError):
                raise ZoptValueError(f"betas must be a pair of numbers, got {val!r}") from None
        elif key == "bias_correction":
            out[key] = bool_hyper(key, val)
        elif key in HYPER_BY_NAME:
            try:
                out[key] = float(val)
            except (TypeError, ValueError):
                raise ZoptValueError(f"{key} = {val!r} is not a number") from None
    return out


def groups_arg(params):
    """The ``params`` argument as a list (of tensors, pairs or group dicts).
    A bare tensor is refused as torch refuses it (TypeError, torch's text):
    iterating it would give its rows."""
    if is_torch(params):
        raise ZoptTypeError("params argument given to the optimizer should be an iterable "
                            "of Tensors or dicts, but got " + torch.typename(params))
    if isinstance(params, np.ndarray):  # numpy: refused with its reason by _entry
        return [params]
    return list(params)


def frozen(v):
    """A group value as compared between steps (a list edited in place,
    e.g. betas, must count as changed)."""
    return tuple(v) if isinstance(v, list) else v


def complete_group(step, g):
    """A group's hyperparameters with every slot of the step filled in
    (the step's defaults), as torch keys ('betas' a pair)."""
    hyp = step.hypers
    out = dict(g)
    if "beta1" in hyp or "beta2" in hyp:
        if "betas" not in out:
            b1 = out.pop("beta1", hyp.get("beta1", (0.0,))[0])
            b2 = out.pop("beta2", hyp.get("beta2", (0.0,))[0])
            out["betas"] = (float(b1), float(b2))
        else:
            out["betas"] = tuple(float(b) for b in out["betas"])
    for name, (dflt, _, _, _) in hyp.items():
        if name in ("beta1", "beta2") or name in out:
            continue
        out[name] = bool(dflt) if name == "bias_correction" else float(dflt)
    if "bias_correction" in out:
        out["bias_correction"] = bool(bool_hyper("bias_correction", out["bias_correction"]))
    out["maximize"] = maximize(out)  # torch's per-group flag (a runtime group flag)
    return out


def hyper_keys(step):
    """The group keys that reach the runtime (hyperparameter slots, betas,
    maximize), in a fixed order."""
    hyp = step.hypers
    return [k for k in ("lr", "betas", "beta1", "beta2", "eps", "weight_decay",
                        "momentum", "dampening", "bias_correction")
            if k in hyp or (k == "betas" and "beta1" in hyp)] + ["maximize"]


def check_rule_flags(step, group, where):
    """torch.optim's per-group amsgrad flag changes the update rule,
    which is compiled into a zopt step: a group that asks for another
    rule is refused, never silently stepped with the compiled one;
    differentiable=True is refused (the step runs outside autograd).
    (maximize is a runtime group flag: pushed like a hyperparameter.)"""
    if group.get("differentiable"):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{where} has differentiable=True: a zopt step runs in the "
                        "runtime, outside autograd (no graph through the update)")
    a = group.get("amsgrad")
    if a is not None:
        s = step
        mine = s.adam_like and StateKind.MAX_EXP_AVG_SQ in s.state_flags
        if bool(a) != mine:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{where} has amsgrad={a!r}, but step '{s.name}' is compiled "
                            f"{'with' if mine else 'without'} AMSGrad (a state max_exp_avg_sq"
                            f"{'' if mine else ', zopt.steps.adam(amsgrad=True)'}): the rule "
                            "is fixed when the step is compiled")


class Pushed:
    """What reached the runtimes of each param group: the params it was
    built with, the slot values and the maximize flag last pushed, and the
    group's raw values then, so that a step pushes only what changed (an lr
    scheduler's edit: one ``zopt_optimizer_set_hyper`` per class)."""

    def __init__(self, step, groups):
        self.step = step
        self.keys = hyper_keys(step)
        self.reset(groups)

    def reset(self, groups):
        """Every group as it is now is what the runtimes hold."""
        self.params = [tuple(g["params"]) for g in groups]
        self.slots = [slots(g, self.step.hypers) for g in groups]
        self.max = [maximize(g) for g in groups]
        self.raw = [self.raw_of(g) for g in groups]

    def raw_of(self, group):
        return tuple(frozen(group.get(k)) for k in self.keys)

    def push_all(self, groups, parts, steps):
        """Every group's changes -> every part (checked first: the groups'
        length and params, torch's rule flags)."""
        if len(groups) != len(self.raw):
            raise ZoptError(Status.BAD_STATE,
                            "param_groups changed length: add groups with add_param_group()")
        for gid, group in enumerate(groups):
            ps, built = group["params"], self.params[gid]
            if not same(ps, built):
                raise ZoptError(Status.BAD_STATE,
                                f"param_groups[{gid}]['params'] was edited: the optimizer's "
                                "tensors are fixed; add params with add_param_group()")
            if "amsgrad" in group or "differentiable" in group:
                for st in steps:
                    check_rule_flags(st, group, f"param_groups[{gid}]")
            self.push_group(gid, group, parts)

    def push_group(self, gid, group, parts):
        """The hyperparameters of param group gid that changed since they
        were last pushed -> every part's runtime."""
        raw = self.raw_of(group)
        if raw == self.raw[gid]:
            return
        vals = slots(group, self.step.hypers)
        on = maximize(group)
        pushed = self.slots[gid]
        for name, val in vals.items():
            if pushed.get(name) != val:
                for c in parts:
                    c.set_hyper(gid, name, val)
                pushed[name] = val
        if on != self.max[gid]:
            for c in parts:
                c.set_maximize(gid, on)
            self.max[gid] = on
        self.raw[gid] = raw

    def read_back(self, gid, group, c):
        """group <- the values part c's runtime holds (hyperparameters and
        the maximize flag), which are then the pushed ones."""
        vals = {name: c.get_hyper(gid, name) for name in self.step.hypers}
        flags = c.get_group_flags(gid)
        for name, v in vals.items():
            if name in ("beta1", "beta2"):
                continue
            group[name] = bool(v) if name == "bias_correction" else v
        if "beta1" in vals or "beta2" in vals:
            group["betas"] = (vals.get("beta1"), vals.get("beta2"))
        group["maximize"] = bool(flags & GROUP_MAXIMIZE)
        self.slots[gid] = slots(group, self.step.hypers)
        self.max[gid] = group["maximize"]
        self.raw[gid] = self.raw_of(group)

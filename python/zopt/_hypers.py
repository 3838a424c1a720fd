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


# torch.optim's group keys that select the update rule (zopt: compiled
# into the step), besides the hyperparameters; docs/USAGE.md section 2.
RULE_KEYS = ("amsgrad", "nesterov", "decoupled_weight_decay", "differentiable")


def as_number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None  # slots() reports it


def momentum_buffered(step):
    """An SGD step with a momentum buffer and a momentum slot."""
    return "momentum" in step.hypers and StateKind.MOMENTUM_BUFFER in step.state_flags


def held_buffers_text(where, step):
    return (f"{where} has momentum=0 while its params hold momentum buffers (from steps "
            "with momentum != 0): torch.optim.SGD leaves them unchanged while the momentum "
            "is 0 and continues them when it is not, but step "
            f"'{step.name}' would overwrite them with the gradient (its buffer update at "
            "momentum 0 is buf = grad); use a momentum > 0, or build "
            "zopt.steps.sgd(momentum=0) for plain SGD")


def rule_flag_problems(step, group):
    """[(key, text)]: the keys of a param group (torch's
    rule flags, and a momentum that selects another SGD rule) whose rule is
    not the one compiled into ``step``; empty if the group fits the step.
    The one place that knows how torch's keys map onto compiled rules
    (check_rule_flags raises the first; load_state_dict lists them all)."""
    s, out = step, []
    if group.get("differentiable"):
        out.append(("differentiable",
                    "differentiable=True: a zopt step runs in the runtime, outside autograd "
                    "(no graph through the update)"))
    a = group.get("amsgrad")
    if a is not None:
        mine = s.adam_like and StateKind.MAX_EXP_AVG_SQ in s.state_flags
        if bool(a) != mine:
            out.append(("amsgrad",
                        f"amsgrad={a!r}, but step '{s.name}' is compiled "
                        f"{'with' if mine else 'without'} AMSGrad (a state max_exp_avg_sq"
                        f"{'' if mine else ', zopt.steps.adam(amsgrad=True)'}): the rule "
                        "is fixed when the step is compiled"))
    buffered = momentum_buffered(s)
    mu = as_number(group.get("momentum"))
    n = group.get("nesterov")
    mine = s.nesterov if n is not None else None
    if n is not None and mine is not None and bool(n) != mine:
        out.append(("nesterov",
                    f"nesterov={n!r}, but step '{s.name}' is compiled "
                    f"{'with' if mine else 'without'} Nesterov momentum (zopt.steps.sgd("
                    f"nesterov={not mine!r}) is the other rule): the rule is fixed when the "
                    "step is compiled"))
    if mu is not None and s.plain_sgd and mu != 0:
        out.append(("momentum",
                    f"momentum={group['momentum']!r}, but step '{s.name}' is compiled as plain "
                    "SGD, without a momentum buffer (zopt.steps.sgd(momentum=0)): build "
                    "zopt.steps.sgd() (a buffer, the momentum a runtime value) for SGD with "
                    "momentum"))
    if mu == 0 and buffered and s.gpu:  # CPU steps: Pushed honours it
        out.append(("momentum",
                    f"momentum=0, but step '{s.name}' (updated on the GPU) is compiled with a "
                    "momentum buffer: torch.optim.SGD keeps no buffer at momentum 0 and starts "
                    "one, buf = grad, at the first step with momentum != 0, which zopt does by "
                    "restarting the params' step counts, on CPU-updated steps only; build "
                    "zopt.steps.sgd(momentum=0) for plain SGD, or use a momentum > 0"))
    d = group.get("decoupled_weight_decay")
    mine = (s.decoupled_decay if d is not None and s.adam_like and "weight_decay" in s.hypers
            else None)
    if mine is not None and bool(d) != mine:
        out.append(("decoupled_weight_decay",
                    f"decoupled_weight_decay={d!r}, but step '{s.name}' is compiled with "
                    f"{'decoupled (AdamW)' if mine else 'L2 (Adam)'} weight decay ("
                    f"zopt.steps.{'adam' if mine else 'adamw'}() is the other rule): the "
                    "rule is fixed when the step is compiled"))
    return out


def rule_only_keys(step):
    """Hyperparameter names a group may carry although the step has no
    slot for them, since they only say which rule it is: torch's plain SGD
    groups hold momentum 0 and a dampening (unused without momentum)."""
    return ("momentum", "dampening") if step.plain_sgd else ()


def check_nesterov_defaults(step, defaults):
    """torch.optim.SGD(nesterov=True) refuses a momentum <= 0 or a
    dampening at construction (ValueError); so does zopt.Optimizer for a
    Nesterov step's keywords. (A group's own values, and later edits, are
    stepped as torch steps them: the compiled rule is torch's for any
    momentum and dampening.)"""
    if not momentum_buffered(step) or not step.nesterov:
        return
    mu, damp = as_number(defaults.get("momentum")), as_number(defaults.get("dampening"))
    if (mu is not None and mu <= 0) or (damp is not None and damp != 0):
        raise ZoptValueError("Nesterov momentum requires a momentum and zero dampening "
                             f"(step '{step.name}' is Nesterov's; momentum="
                             f"{defaults.get('momentum')!r}, dampening="
                             f"{defaults.get('dampening')!r})")


def check_rule_flags(step, group, where):
    """torch.optim's per-group keys that change the update rule (amsgrad,
    nesterov, decoupled_weight_decay; a momentum != 0 on plain SGD, 0 on a
    GPU step with a buffer), which is compiled into a zopt step: a group
    that asks for another rule is refused, never silently stepped with the
    compiled one; differentiable=True is refused (the step runs outside
    autograd). (maximize is a runtime group flag: pushed like a
    hyperparameter; momentum 0 on a CPU step with a buffer: Pushed.)"""
    probs = rule_flag_problems(step, group)
    if probs:
        raise ZoptError(Status.INVALID_ARGUMENT, f"{where} has {probs[0][1]}")


class Pushed:
    """What reached the runtimes of each param group: the params it was
    built with, the slot values and the maximize flag last pushed, and the
    group's raw values then, so that a step pushes only what changed (an lr
    scheduler's edit: one ``zopt_optimizer_set_hyper`` per class)."""

    def __init__(self, step, groups):
        self.step = step
        self.keys = hyper_keys(step)
        self.reset(groups)

    def reset(self, groups, keep_fresh=False):
        """Every group as it is now is what the runtimes hold. ``fresh``
        (SGD with a buffer): per group, True while its params hold no
        momentum buffer torch would hold (only steps at momentum 0 so far),
        None: not known (after a load: from the step counts)."""
        old = self.__dict__.get("fresh", []) if keep_fresh else []
        self.fresh = old[:len(groups)] + [None] * (len(groups) - len(old))
        self.params = [tuple(g["params"]) for g in groups]
        self.slots = [slots(g, self.step.hypers) for g in groups]
        self.max = [maximize(g) for g in groups]
        self.raw = [self.raw_of(g) for g in groups]

    def added(self, groups):
        """add_param_group's new groups (the last ones), pushed by it with
        their params; the others' pending edits stay pending (pushed next)."""
        n = len(self.raw)
        self.fresh += [None] * (len(groups) - n)
        for g in groups[n:]:
            self.params.append(tuple(g["params"]))
            self.slots.append(slots(g, self.step.hypers))
            self.max.append(maximize(g))
            self.raw.append(self.raw_of(g))

    def repush(self, c):
        """Part c's runtime <- the values last pushed (every group's slots
        and maximize flag): a rebuilt native optimizer took the groups'
        edits not pushed yet."""
        for gid, vals in enumerate(self.slots):
            for name, val in vals.items():
                if name in self.step.hypers:
                    c.set_hyper(gid, name, val)
            c.set_maximize(gid, self.max[gid])

    def loaded(self, groups, parts):
        """After a load (state_dict or file): a group at momentum 0 holds no
        buffer torch would keep (a state holding such buffers at momentum
        0 is refused by every save and load; torch's SGD stores None), so
        its buffers start afresh (buf = g) at its first step with momentum."""
        for c in parts:
            c.restarted.clear()
        if momentum_buffered(self.step):
            self.fresh = [True if as_number(g.get("momentum")) == 0 else None for g in groups]

    def raw_of(self, group):
        return tuple(frozen(group.get(k)) for k in self.keys)

    def push_all(self, groups, parts, steps):
        """Every group's changes -> every part (checked first: the groups'
        length and params, torch's rule flags)."""
        restart = self.check_all(groups, parts, steps)
        for gid, group in enumerate(groups):
            self.push_group(gid, group, parts)
        for gid in restart:
            for c in parts:
                for lt, e in enumerate(c.entries):
                    if e.group == gid and c.tensor_step(lt):
                        c.set_tensor_step(lt, 0)
                        c.restarted.add(lt)  # (state[p]: torch's {'momentum_buffer': None})
            self.fresh[gid] = False

    def check_all(self, groups, parts, steps, dry=False):
        """What push_all refuses, checked before anything is pushed: the
        groups whose counts restart. ``dry``: changes nothing (what
        add_param_group checks before it adds: a refused call pushes no
        pending edit)."""
        if len(groups) != len(self.raw):
            raise ZoptError(Status.BAD_STATE,
                            "param_groups changed length: add groups with add_param_group()")
        for gid, group in enumerate(groups):  # every group checked before any push
            ps, built = group["params"], self.params[gid]
            if not same(ps, built):
                raise ZoptError(Status.BAD_STATE,
                                f"param_groups[{gid}]['params'] was edited: the optimizer's "
                                "tensors are fixed; add params with add_param_group()")
            changed = self.raw_of(group) != self.raw[gid]
            if changed or any(k in group for k in RULE_KEYS + ("momentum",)):
                for st in steps:  # (plain SGD: no momentum slot)
                    check_rule_flags(st, group, f"param_groups[{gid}]")
            if changed:
                slots(group, self.step.hypers)  # validates (betas, bias_correction)
        return self.momentum_zero(groups, parts, dry) if momentum_buffered(self.step) else ()

    def momentum_zero(self, groups, parts, dry=False):
        """torch.optim.SGD's momentum 0 on a step with a buffer: torch keeps
        no buffer while the momentum is 0 (the step's rule does plain SGD
        then: buf = g when mu == 0, docs/NUMERICS.md) and starts one, buf =
        g, at the first step with momentum != 0: the groups whose step
        counts must restart (t = 1: buf = g) now. Refused (nothing changed):
        momentum 0 while buffers torch would keep unchanged are held."""
        restart, fresh = [], list(self.fresh)
        for gid, group in enumerate(groups):
            mu = as_number(group.get("momentum"))
            if mu is None:
                continue
            if mu == 0:
                if not fresh[gid]:
                    fresh[gid] = not any(c.tensor_step(lt) for c in parts
                                         for lt, e in enumerate(c.entries)
                                         if e.group == gid)
                if not fresh[gid]:
                    raise ZoptError(Status.INVALID_ARGUMENT,
                                    held_buffers_text(f"param_groups[{gid}]", self.step))
            elif fresh[gid]:
                restart.append(gid)
            else:
                fresh[gid] = False
        if not dry:
            self.fresh = fresh
        return restart

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
            if name not in self.step.hypers:  # plain SGD's momentum 0 (rule_only_keys)
                continue
            if pushed.get(name) != val:
                for c in parts:
                    c.set_hyper(gid, name, val)
                pushed[name] = val
        if on != self.max[gid]:
            for c in parts:
                c.set_maximize(gid, on)
            self.max[gid] = on
        self.raw[gid] = raw

    def read_one(self, gid, group, c, name):
        """group <- slot ``name`` as part c's runtime holds it (set_hyper):
        that slot is then the pushed one; the group's other edits not
        pushed yet stay in the group, pushed at the next step."""
        v = c.get_hyper(gid, name)
        if name in ("beta1", "beta2"):
            b = list(group.get("betas") or (c.get_hyper(gid, "beta1"), c.get_hyper(gid, "beta2")))
            b[name == "beta2"] = v
            group["betas"] = tuple(b)
        else:
            group[name] = bool(v) if name == "bias_correction" else v
        self.slots[gid][name] = v
        self.raw[gid] = None  # the next step compares slot by slot (any edit pushed)

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

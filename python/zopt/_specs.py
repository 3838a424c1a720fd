"""The parameter classes of one rule: ``zopt.steps.<rule>(..., classes=,
keep32=, gpu_fraction=)`` resolved into one :class:`zopt.steps.Spec` per
class (docs/USAGE.md, "Params of several dtypes", "Params that keep 32-bit
moments", "Part of the params' step on the GPU").

``classes=`` is checked here (per-class arguments apart from the shared
ones), the shared loss scaling decided for all classes, and the twins
built: a ``"<dtype>:keep32"`` class with f32 moments for each narrow class
(``_policy.py``), a ``"<dtype>:gpu"`` class with every state on the GPU for
each offloaded one (``_placement.py``). The rule itself is ``steps.py``'s
(its builders), ``_resolve.py``'s (its options and checks) and
``_steptext.py``'s (its text): each function here takes the rule's function
``fn`` (keyword arguments -> Spec) and calls it once per class.
"""
from __future__ import annotations

import collections.abc
import inspect

from ._dtypes import dtype_name
from ._lib import ZoptError, arg_error as _bad
from ._placement import SUFFIX as _GPU
from ._policy import SUFFIX as _KEEP32

# Arguments that describe one parameter class's layout (given per class
# with ``classes=``); every other argument is shared by all classes.
CLASS_ARGS = ("grad", "master", "moments", "exp_avg", "exp_avg_sq",
              "max_exp_avg_sq", "rounding", "name")
_MOMENT_ARGS = ("moments", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class Specs(dict):
    """spec()'s dict class -> Spec, with the precision policy (.keep32) and
    the GPU fraction (.gpu_fraction)."""
    keep32 = None
    gpu_fraction = None


def one_class(fn, kw):
    """The classes of a rule called without ``classes=``: one, its
    param's dtype, with the step's own layout arguments (taken from kw)."""
    param = kw.pop("param", inspect.signature(fn).parameters["param"].default)
    return {param: {a: kw.pop(a) for a in CLASS_ARGS if a in kw}}


def class_specs(fname, fn, params, classes, kw, keep32=False, gpu=False):
    """{class: Spec} of rule ``fname`` (its function ``fn``, its argument
    names ``params``) for ``classes`` and the shared arguments ``kw``; with
    ``keep32``/``gpu`` the twins too."""
    per = _per_class(fname, params, classes, kw)
    shared = _shared(per, kw)
    out = {}
    for c, ckw in per.items():
        try:
            out[c] = fn(param=c, **shared, **ckw)
        except ZoptError as e:
            raise ZoptError(e.code, f"classes[{c!r}]: {e.message}") from None
    if keep32:
        out.update(_keep32_twins(fn, per, shared, out))
    if gpu:  # each offloaded class's twin with every state on the GPU
        out.update(_gpu_twins(fn, per, shared, out))
    _check_names(out)
    return out


def _per_class(fname, params, classes, kw):
    """``classes=`` checked: {class: its per-class arguments}."""
    if not isinstance(classes, collections.abc.Mapping) or not classes:
        raise _bad("classes", "must be a non-empty dict {param dtype: {per-class "
                   "arguments}}, e.g. {'bf16': dict(master='f32'), 'f32': {}}; "
                   f"got {classes!r}")
    for a in ("param",) + CLASS_ARGS:
        if a in kw:
            if a == "param":
                raise _bad("param", "with classes=, each class's key is its param "
                           "dtype: classes={'bf16': {...}, 'f32': {...}}")
            raise _bad(a, f"with classes=, give {a} per class, e.g. "
                       f"classes={{'bf16': dict({a}=...), 'f32': {{}}}}")
    per = {}
    for key, ckw in classes.items():
        c = dtype_name(key, "classes")
        if c in per:
            raise _bad("classes", f"two keys name the class {c!r}")
        arg = f"classes[{c!r}]"
        if ckw is None:
            ckw = {}
        if not isinstance(ckw, collections.abc.Mapping):
            raise _bad(arg, f"must be a dict of per-class arguments ("
                       f"{', '.join(CLASS_ARGS)}), got {ckw!r}")
        for k in ckw:
            if k == "param":
                raise _bad(f"{arg}['param']", "the class's key is its param dtype")
            if k not in CLASS_ARGS:
                if k in params:
                    raise _bad(f"{arg}[{k!r}]", "is shared by every class (the "
                               "classes step as one: one global norm, one skip "
                               "decision, one loss scaler, one ZeRO layout): give "
                               f"{k}= once, outside classes=; per class: "
                               + ", ".join(CLASS_ARGS))
                raise _bad(f"{arg}[{k!r}]", f"zopt.steps.{fname}() takes no "
                           f"argument {k!r}; per class: " + ", ".join(CLASS_ARGS))
        per[c] = dict(ckw)
    return per


def _shared(per, kw):
    """The arguments every class shares; loss scaling on for all when one
    class needs it (f16 params or grads)."""
    shared = dict(kw)
    if shared.get("loss_scale") is None:
        need = [c for c, ckw in per.items()
                if c == "f16" or (ckw.get("grad") is not None
                                  and dtype_name(ckw["grad"], "grad") == "f16")]
        if need:
            shared["loss_scale"] = True
    return shared


def _keep32_twins(fn, per, shared, out):
    """{"<dtype>:keep32": Spec}: each class with moments narrower than f32,
    again with f32 moments."""
    narrow = [c for c, sp in out.items()
              if sp.q8 or any(dt != "f32" for k, dt in sp.states if k != "master")]
    if not narrow:
        raise _bad("keep32", "every class already has f32 moments: the precision "
                   "policy keeps small tensors and named ones at 32-bit moments "
                   "where the others have narrower ones (moments='bf16' or 'q8')")
    twins = {}
    for c in narrow:
        ckw = {k: v for k, v in per[c].items() if k not in _MOMENT_ARGS}
        if "name" in ckw:
            ckw["name"] = ckw["name"] + "_keep32"
        try:
            twins[c + _KEEP32] = fn(param=c, **shared, **ckw, moments="f32")
        except ZoptError as e:
            raise ZoptError(e.code, f"keep32 (class {c + _KEEP32!r}): "
                            f"{e.message}") from None
    return twins


def _gpu_twins(fn, per, shared, out):
    """{"<dtype>:gpu": Spec}: each (offloaded) class with every state on
    the GPU."""
    twins = {}
    for c in out:
        ckw = dict(per[c])
        if "name" in ckw:
            ckw["name"] = ckw["name"] + "_gpu"
        try:
            twins[c + _GPU] = fn(param=c, **dict(shared, placement="gpu"), **ckw)
        except ZoptError as e:
            raise ZoptError(e.code, f"gpu_fraction (class {c + _GPU!r}): "
                            f"{e.message}") from None
    return twins


def _check_names(out):
    names = {}
    for c, sp in out.items():
        if sp.name in names:
            raise _bad(f"classes[{c!r}]['name']", f"{sp.name!r} is also the name of "
                       f"class {names[sp.name]!r}: each class's step needs its own name")
        names[sp.name] = c

"""One line to a compiled optimizer step.

(This module holds the four builders and their own arguments. The
option set of a step, its defaults and checks -- :class:`Spec`,
:func:`resolve` -- are ``_resolve.py``'s; the text a Spec generates
``_steptext.py``'s; the on-disk cache of compiled steps -- :func:`cache_dir`,
:func:`compile_text`, :func:`load_text` -- ``_stepcache.py``'s; the
parameter classes of a rule -- ``classes=``, the keep32 and gpu_fraction
twins -- ``_specs.py``'s. zopt.steps re-exports their public names.)

    import zopt
    step = zopt.steps.adamw(param="bf16", master="f32", moments="bf16", clip=1.0,
                            rounding="stochastic", zero_stage=2)
    opt = zopt.Optimizer(step, model.parameters(), lr=1e-3, weight_decay=0.01)

    print(zopt.steps.adamw.text(param="bf16", master="f32"))   # the description
    so = zopt.steps.adamw.path(param="bf16", master="f32")     # the step.so (C, zopt-run)

Each builder (``adam``, ``adamw``, ``sgd``, ``lion``) writes a ``zopt.step``
description (commented MLIR, the dialect of docs/Dialects/Zopt.md), compiles
it once and returns the loaded ``zopt.Step``. Compiled steps are cached on
disk by the sha256 of the description text (see :func:`cache_dir`), so the
second call, in this process or any other, loads the cached step.so.

Arguments every builder takes (keyword only):

``param``
    dtype of the model's params: ``"f32"``, ``"bf16"`` or ``"f16"`` (also
    ``"float32"``, ``"bfloat16"``, ``"fp16"``, ``torch.bfloat16``, ...).
``grad``
    dtype of the gradients; ``None`` (default) is the param's dtype (torch
    keeps ``.grad`` in the param's dtype); ``"f32"`` for bf16/f16 params:
    gradients accumulated in f32 (DeepSpeed's bf16 layout with
    ``grad_accum_dtype`` fp32, Megatron's ``main_grad``; rule 7).
    ``zopt.Optimizer`` then takes each param's gradient from ``p.main_grad``
    or accumulates ``p.grad`` into an f32 buffer of its own (docs/USAGE.md).
``master``
    ``None`` (default: the param is the weight the update changes), ``"f32"``
    (an fp32 master copy; the param is the rounded master), ``"remainder"``
    (an exact fp32 master kept as the int16 low half beside a bf16 param on
    the same placement: 2 bytes/param instead of 4, Transformer Engine's
    ``store_param_remainders``; docs/NUMERICS.md section 9), ``"kahan"``
    (no master: a bf16 param with a bf16 Kahan compensation that carries
    the rounding error of its stores into the next step, optimi's
    ``kahan_sum``; the same bytes as ``"remainder"``, approximate where it
    is exact; moments default to f32; docs/NUMERICS.md section 11) or ``"bf16"``
    (only for bf16 params with ``placement="offload"``: the master lives on
    the CPU, the param on the GPU). ``True`` means ``"f32"``.
``moments``
    dtype of every optimizer state (Adam's ``exp_avg``/``exp_avg_sq``/
    ``max_exp_avg_sq``, SGD's momentum buffer, Lion's ``exp_avg``). Default:
    the master's dtype, else the param's, except that f16 params without a
    master get f32 states (``exp_avg_sq`` cannot be f16). Adam also takes
    ``exp_avg=``, ``exp_avg_sq=``, ``max_exp_avg_sq=`` to set one state.
    ``"q8"`` (Adam/AdamW on the CPU or offloaded, on the GPU only with
    ``ZOPT_EXPERIMENTAL_GPU_Q8=1``; without amsgrad): both moments
    block-quantized, one 8-bit code per element and one f32 absmax per 256
    (bitsandbytes' 8-bit Adam; docs/NUMERICS.md section 10).
``clip``
    ``None`` (default) or the ``max_norm`` of global-norm gradient clipping
    over all params of all groups (``torch.nn.utils.clip_grad_norm_``).
``loss_scale``
    ``True``: the gradients arrive multiplied by a loss scale and the step
    divides by it and skips itself on any non-finite gradient
    (``zopt.unscale``; configure the scaler on the optimizer). ``None``
    (default) turns it on for f16 gradients (which require it) and f16
    params (whose backward computes f16 gradients even when they are
    accumulated in f32), off otherwise.
``rounding``
    how narrowing stores round: ``None``/``"nearest_even"`` (default),
    ``"stochastic"`` (every bf16 state the step writes: the param, a bf16
    master, bf16 moments), or a dict ``{state kind: mode}``, e.g.
    ``{"param": "stochastic"}``. Stochastic rounding is implemented for bf16
    states only (docs/Dialects/Zopt.md rule 14).
``placement``
    ``"cpu"`` (default: everything on the CPU), ``"gpu"`` (everything on the
    GPU) or ``"offload"`` (ZeRO-Offload: param and grad on the GPU, the
    optimizer states and the update on the CPU).
``gpu_arch``
    CUDA architecture of GPU and offload steps (default ``"sm_90"``; at least
    ``"sm_70"``); not allowed with ``placement="cpu"``.
``zero_stage``
    0 (default), 1, 2 or 3. ``align``: partition alignment in elements, a
    power of two in [1, 2**20] (default 16).
hyperparameter defaults
    ``lr``, ``betas=(beta1, beta2)``, ``eps``, ``weight_decay`` (Adam, Lion),
    ``momentum``, ``dampening`` (SGD): written into the description as
    ``zopt.hyper ... default``; a param group that sets no value runs with
    them. They stay runtime values (changing them never recompiles).
``name``
    the step's symbol name (default: one made from the options).
``keep32``
    the precision policy (a size threshold in elements, or ``{"below": N,
    "names": [patterns]}``): a twin class with f32 moments for small and
    named params (docs/USAGE.md, "Params that keep 32-bit moments").
``gpu_fraction``
    with ``placement="offload"``, a number in (0, 1): a twin class
    ``"<dtype>:gpu"`` with every state on the GPU takes about that share of
    the params (by elements), those whose gradients arrive last in backward
    (docs/USAGE.md, "Part of the params' step on the GPU").
``comments``
    ``False`` leaves the comments out of the text.

Invalid combinations raise :class:`zopt.ZoptError` (``INVALID_ARGUMENT``)
naming the argument and what is allowed, before anything is compiled; the
rules are the verifier's (docs/Dialects/Zopt.md), and the tests check that
this module accepts exactly what zopt-compile accepts.
"""
from __future__ import annotations

import inspect

from ._dtypes import dtype_name
from ._lib import arg_error as _bad
from ._placement import gpu_fraction_of
from ._policy import Keep32, keep32_of
from ._resolve import (  # noqa: F401 (zopt.steps' names)
    DEFAULT_GPU_ARCH, DTYPES, PLACEMENTS, ROUNDINGS, RULES, STATE_KINDS, Spec, resolve)
from ._specs import Specs, class_specs, one_class
from ._stepcache import (  # noqa: F401 (_loaded, the steps loaded here: the tests clear it)
    _loaded, cache_dir, compile_text, load_text)
from ._steptext import fmt_float  # noqa: F401 (zopt.steps.fmt_float)

_DTYPE_ARGS = ("param", "grad", "master", "moments", "exp_avg", "exp_avg_sq",
               "max_exp_avg_sq")


# ---------------------------------------------------------------------------
# The builders
# ---------------------------------------------------------------------------

class StepClasses(dict):
    """``{param dtype: zopt.Step}``, one compiled step per parameter class
    (``"bf16"``, ``"f16"``, ``"f32"``), built from one rule by
    ``zopt.steps.<rule>(..., classes={...})``. Give it to
    :class:`zopt.Optimizer` as ``step``: each param goes to the class of its
    dtype, and the classes step as one (one global norm, one skip
    decision). With ``keep32=``, ``.keep32`` is the :class:`Keep32` rule
    that sends params to the ``"<dtype>:keep32"`` classes; with
    ``gpu_fraction=``, ``.gpu_fraction`` the share of the params that the
    ``"<dtype>:gpu"`` classes take."""

    keep32 = None
    gpu_fraction = None

    def __repr__(self):
        return "zopt.steps.StepClasses({" + ", ".join(
            f"{k!r}: {v!r}" for k, v in self.items()) + "})"


class Builder:
    """``zopt.steps.<rule>``: call it for a compiled, loaded ``zopt.Step``;
    ``.text(...)``/``.describe(...)`` for the description, ``.path(...)``
    for the step.so, ``.spec(...)`` for the resolved :class:`Spec`. All take
    the same keyword arguments.

    ``classes={param dtype: {per-class arguments}}`` builds one step per
    parameter class from the one rule (a model with bf16 weights and f32
    LayerNorms): the call returns a :class:`StepClasses` (``.text``,
    ``.path`` and ``.spec`` return dicts by class). Per class go the
    layout arguments ``grad``, ``master``, ``moments``, ``exp_avg``,
    ``exp_avg_sq``, ``max_exp_avg_sq``, ``rounding`` and ``name``; every
    other argument (clip, loss_scale, zero_stage, placement, gpu_arch,
    align, amsgrad, momentum, nesterov, the hyperparameter defaults) is
    given once and shared, since the classes step as one: one global norm,
    one skip decision, one loss scaler. ``loss_scale=None`` turns loss
    scaling on for every class when one class needs it (f16).

    ``keep32=`` (an element count, ``{"below": N, "names": [patterns]}`` or
    :class:`Keep32`) is the precision policy of issue 19: each class whose
    moments are narrower than f32 gets a twin class ``"<dtype>:keep32"``,
    the same step with f32 moments, and ``zopt.Optimizer`` sends it the
    params under ``below`` elements (default 4096) and those whose names
    (``model.named_parameters()``) match ``names`` (docs/USAGE.md, "Params
    that keep 32-bit moments"). Without ``classes=`` the call returns a
    :class:`StepClasses` too.

    ``gpu_fraction=f`` (with ``placement="offload"``, 0 < f < 1) gives each
    class a twin ``"<dtype>:gpu"``, the same step with every state on the
    GPU; ``zopt.Optimizer`` sends it the first-added params (the last whose
    gradients arrive in backward) up to about f of the elements, and the
    classes step as one (docs/USAGE.md, "Part of the params' step on the
    GPU"). A :class:`StepClasses` either way."""

    def __init__(self, fname, fn):
        self.fname = fname
        self._fn = fn
        sig = inspect.signature(fn)
        self.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + [
            inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY, default=None)
            for a in ("classes", "keep32", "gpu_fraction")])
        self.__doc__ = fn.__doc__
        self.__name__ = fname
        self._params = [p for p in sig.parameters]

    def _check_known(self, kw):
        unknown = [k for k in kw if k not in self._params]
        if unknown:
            raise _bad(unknown[0], f"zopt.steps.{self.fname}() takes no argument "
                       f"{unknown[0]!r}; its arguments: {', '.join(self._params)}, classes, "
                       "keep32, gpu_fraction")

    def spec(self, **kw):
        """The resolved :class:`Spec` (with ``classes=``: a dict class ->
        Spec)."""
        classes = kw.pop("classes", None)
        keep32 = kw.pop("keep32", None)
        gpu_fraction = kw.pop("gpu_fraction", None)
        self._check_known(kw)
        if gpu_fraction is not None:
            frac = gpu_fraction_of(gpu_fraction, kw.get("placement", "cpu"))
            if keep32 is not None:
                raise _bad("gpu_fraction", "with keep32= is not implemented (a GPU twin of "
                           "each keep32 class): give one of them")
            if classes is None:  # one class: the step's own arguments
                classes = one_class(self._fn, kw)
            out = Specs(self._class_specs(classes, kw, gpu=True))
            out.gpu_fraction = frac
            return out
        if keep32 is not None:
            policy = keep32_of(keep32)
            if classes is None:  # one class: the step's own arguments
                classes = one_class(self._fn, kw)
            out = Specs(self._class_specs(classes, kw, keep32=True))
            out.keep32 = policy
            return out
        if classes is not None:
            return self._class_specs(classes, kw)
        return self._fn(**kw)

    def _class_specs(self, classes, kw, keep32=False, gpu=False):
        return class_specs(self.fname, self._fn, self._params, classes, kw, keep32, gpu)

    def text(self, **kw):
        """The description (MLIR text) these arguments build (with
        ``classes=`` or ``keep32=``: a dict class -> text)."""
        sp = self.spec(**kw)
        if isinstance(sp, dict):
            return {c: s.text() for c, s in sp.items()}
        return sp.text()

    describe = text

    def path(self, **kw):
        """The compiled step.so (through the cache; with ``classes=``: a
        dict class -> path)."""
        t = self.text(**kw)
        if isinstance(t, dict):
            return {c: compile_text(x) for c, x in t.items()}
        return compile_text(t)

    def __call__(self, **kw):
        """The compiled, loaded zopt.Step (with ``classes=``: a
        :class:`StepClasses`)."""
        sp = self.spec(**kw)
        if isinstance(sp, dict):
            out = StepClasses((c, load_text(s.text())) for c, s in sp.items())
            out.keep32 = getattr(sp, "keep32", None)
            out.gpu_fraction = getattr(sp, "gpu_fraction", None)
            return out
        return load_text(sp.text())

    def __repr__(self):
        return f"<zopt.steps.{self.fname}{self.__signature__}>"


def _call_repr(fname, kw):
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"zopt.steps.{fname}({args})"


def _call_string(fname, fn, local):
    sig = inspect.signature(fn)
    kw = {}
    for n, p in sig.parameters.items():
        v = local[n]
        if n == "comments":
            continue
        if p.default is inspect.Parameter.empty or v is not p.default and v != p.default:
            if n in _DTYPE_ARGS and v is not None and not isinstance(v, (str, bool)):
                v = dtype_name(v, n)   # torch/numpy dtypes by their zopt name
            kw[n] = v
    return _call_repr(fname, kw)


def _adam_like(fname, decoupled):
    def fn(*, param="f32", grad=None, master=None, moments=None, exp_avg=None,
           exp_avg_sq=None, max_exp_avg_sq=None, amsgrad=False, clip=None,
           loss_scale=None, rounding=None, placement="cpu", gpu_arch=None,
           zero_stage=0, align=16, lr=None, betas=None, eps=None,
           weight_decay=None, bias_correction=True, style="primitives",
           name=None, comments=True):
        local = dict(locals())
        if decoupled and weight_decay is None:
            # torch.optim.AdamW's default (torch.optim.Adam's is 0, the
            # compiler's for any rule): a drop-in for torch's AdamW decays
            weight_decay = 0.01
        if bias_correction is not True and bias_correction != 1:
            raise _bad("bias_correction", "the description cannot give the "
                       "bias_correction slot a default today (the compiler's "
                       "decompose phase declares the slot itself and refuses a "
                       "second default as conflicting); it is a per-group runtime "
                       "value: pass bias_correction=False to zopt.Optimizer or "
                       "set it in the param group")
        return resolve("adamw" if decoupled else "adam", param=param, grad=grad,
                       master=master, moments=moments, exp_avg=exp_avg,
                       exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq,
                       amsgrad=amsgrad, clip=clip, loss_scale=loss_scale,
                       rounding=rounding, placement=placement, gpu_arch=gpu_arch,
                       zero_stage=zero_stage, align=align, lr=lr, betas=betas,
                       eps=eps, weight_decay=weight_decay, style=style, name=name,
                       comments=comments, call=_call_string(fname, fn, local))
    fn.__doc__ = (
        ("AdamW (torch.optim.AdamW: decoupled weight decay w *= 1 - lr*wd; "
         "the step's default weight_decay is torch's, 0.01)"
         if decoupled else "Adam with L2 weight decay (torch.optim.Adam: g += wd*w)")
        + ".\n\n``amsgrad=True`` adds the max_exp_avg_sq state. Bias correction "
        "is a per-group runtime slot\n(on by default; ``bias_correction=False`` "
        "on the optimizer or a param group\nturns it off). ``style='named'`` "
        "writes the named rule zopt.adam instead of\nthe primitives (no "
        "amsgrad). The other arguments: see zopt.steps.")
    return Builder(fname, fn)


adam = _adam_like("adam", False)
adamw = _adam_like("adamw", True)


def _sgd(*, param="f32", grad=None, master=None, moments=None, momentum=None,
         dampening=None, nesterov=False, weight_decay=None, lr=None, clip=None,
         loss_scale=None, rounding=None, placement="cpu", gpu_arch=None,
         zero_stage=0, align=16, name=None, comments=True):
    """SGD as torch.optim.SGD: L2 weight decay, then with a momentum buffer
    buf = g (first step), buf = momentum*buf + (1 - dampening)*g, and with
    ``nesterov=True`` the direction g + momentum*buf.

    ``momentum``: ``None`` (default) keeps a momentum buffer with the momentum
    a runtime value (the runtime's default 0.9 unless a group sets one); a
    number is the default written into the description; ``0`` is plain SGD
    with no buffer at all (torch's momentum=0), where ``dampening`` and
    ``nesterov`` are refused. The buffer's dtype is ``moments``."""
    local = dict(locals())
    buf = True
    if momentum is not None:
        try:
            mu = float(momentum)
        except (TypeError, ValueError):
            raise _bad("momentum", f"must be a number or None, got {momentum!r}") from None
        if mu == 0.0:
            buf = False
            if nesterov:
                raise _bad("nesterov", "Nesterov momentum needs a momentum "
                           "(torch.optim.SGD refuses nesterov with momentum=0); "
                           "allowed: momentum=None or > 0")
            if dampening is not None:
                raise _bad("dampening", "has no effect without momentum "
                           "(momentum=0 is plain SGD with no buffer)")
    if nesterov and dampening not in (None, 0, 0.0):
        raise _bad("dampening", "Nesterov momentum needs zero dampening "
                   "(torch.optim.SGD); allowed: None or 0")
    return resolve("sgd", param=param, grad=grad, master=master, moments=moments,
                   nesterov=nesterov, momentum_buffer=buf, clip=clip,
                   loss_scale=loss_scale, rounding=rounding, placement=placement,
                   gpu_arch=gpu_arch, zero_stage=zero_stage, align=align, lr=lr,
                   weight_decay=weight_decay,
                   momentum=momentum if buf else None,
                   dampening=dampening, name=name, comments=comments,
                   call=_call_string("sgd", _sgd, local))


sgd = Builder("sgd", _sgd)


def _lion(*, param="f32", grad=None, master=None, moments=None, clip=None,
          loss_scale=None, rounding=None, placement="cpu", gpu_arch=None,
          zero_stage=0, align=16, lr=None, betas=(0.9, 0.99), weight_decay=None,
          name=None, comments=True):
    """Lion (Chen et al. 2023): w = w*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g),
    then m = b2*m + (1-b2)*g. One state, exp_avg (dtype ``moments``). betas
    default to the paper's (0.9, 0.99), written into the description
    (``betas=None`` leaves the runtime's slot defaults, 0.9 and 0.999)."""
    local = dict(locals())
    return resolve("lion", param=param, grad=grad, master=master, moments=moments,
                   clip=clip, loss_scale=loss_scale, rounding=rounding,
                   placement=placement, gpu_arch=gpu_arch, zero_stage=zero_stage,
                   align=align, lr=lr, betas=betas, weight_decay=weight_decay,
                   name=name, comments=comments,
                   call=_call_string("lion", _lion, local))


lion = Builder("lion", _lion)

BUILDERS = {"adam": adam, "adamw": adamw, "sgd": sgd, "lion": lion}


def build(rule, **kw):
    """``zopt.steps.build("adamw", ...)`` is ``zopt.steps.adamw(...)``."""
    if rule not in BUILDERS:
        raise _bad("rule", f"unknown rule {rule!r}; allowed: " + ", ".join(RULES))
    return BUILDERS[rule](**kw)


def text(rule, **kw):
    """``zopt.steps.text("adamw", ...)`` is ``zopt.steps.adamw.text(...)``."""
    if rule not in BUILDERS:
        raise _bad("rule", f"unknown rule {rule!r}; allowed: " + ", ".join(RULES))
    return BUILDERS[rule].text(**kw)


__all__ = ["adam", "adamw", "sgd", "lion", "build", "text", "resolve", "Spec", "Keep32",
           "Builder", "StepClasses", "cache_dir", "compile_text", "load_text", "dtype_name",
           "RULES", "DTYPES", "PLACEMENTS", "ROUNDINGS"]

"""One line to a compiled optimizer step.

(Longer than ~800 lines: one module holds the one option set of a step,
its checks and the four builders, because each option is checked and
defaulted in one place. The text a Spec generates is ``_steptext.py``'s;
the on-disk cache of compiled steps ``_stepcache.py``'s; the parameter
classes of a rule -- ``classes=``, the keep32 and gpu_fraction twins --
are ``_specs.py``'s.)

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

import dataclasses
import inspect
import math
import os
import re

from ._dtypes import dtype_name
from ._lib import arg_error as _bad
from ._placement import gpu_fraction_of
from ._policy import Keep32, keep32_of
from ._specs import Specs, class_specs, one_class
from ._stepcache import (  # noqa: F401 (_loaded, the steps loaded here: the tests clear it)
    _loaded, cache_dir, compile_text, load_text)
from ._steptext import RULE_HYPERS, emit, fmt_float

RULES = ("adam", "adamw", "sgd", "lion")
DTYPES = ("f32", "bf16", "f16")
PLACEMENTS = ("cpu", "gpu", "offload")
ROUNDINGS = ("nearest_even", "stochastic")
STATE_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq",
               "max_exp_avg_sq", "momentum_buffer")
DEFAULT_GPU_ARCH = "sm_90"

_BITS = {"f32": 32, "bf16": 16, "f16": 16}
# Hyperparameter ranges (the runtime's and the verifier's, rule 16):
# name -> (lo, hi, hi_exclusive, lo_exclusive)
_HYPER_RANGES = {
    "lr": (0.0, math.inf, False, False),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "eps": (0.0, math.inf, False, True),
    "weight_decay": (0.0, math.inf, False, False),
    "momentum": (0.0, 1.0, False, False),
    "dampening": (0.0, 1.0, False, False),
}
_DTYPE_ARGS = ("param", "grad", "master", "moments", "exp_avg", "exp_avg_sq",
               "max_exp_avg_sq")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$.]*$")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A resolved step: what the description says, every default filled in.

    ``states``: ((kind, dtype), ...) of the optimizer states the step owns
    beside the param and grad (master first); ``rounding``: ((kind, mode),
    ...) for the states declared with a rounding; ``hypers``: ((name,
    default), ...) of the defaults written into the description.
    """
    rule: str
    param: str
    grad: str
    master: str | None
    states: tuple
    remainder: bool = False  # the f32 master kept as a remainder (NUMERICS §9)
    kahan: bool = False      # no master: a Kahan-compensated bf16 param (NUMERICS §11)
    q8: bool = False  # exp_avg / exp_avg_sq block-quantized (NUMERICS §10)
    amsgrad: bool = False
    nesterov: bool = False
    momentum_buffer: bool = True
    clip: float | None = None
    loss_scale: bool = False
    rounding: tuple = ()
    placement: str = "cpu"
    gpu_arch: str | None = None
    zero_stage: int | None = 0
    align: int | None = 16
    hypers: tuple = ()
    style: str = "primitives"
    name: str = ""
    comments: bool = True
    call: str = ""          # the builder call, for the header comment
    notes: tuple = ()       # extra header comment lines (e.g. DeepSpeed import)

    @property
    def state_dtypes(self):
        return dict(self.states)

    @property
    def user_placement(self):
        return "cpu" if self.placement == "cpu" else "gpu"

    @property
    def state_placement(self):
        return "gpu" if self.placement == "gpu" else "cpu"

    def text(self):
        return emit(self)


# ---------------------------------------------------------------------------
# Resolution and validation
# ---------------------------------------------------------------------------

def _hyper_default(name, arg, value, check=True):
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise _bad(arg, f"must be a number, got {value!r}") from None
    if not check:
        return v
    lo, hi, hi_ex, lo_ex = _HYPER_RANGES[name]
    ok = math.isfinite(v) and (v > lo if lo_ex else v >= lo) and \
        (v < hi if hi_ex else v <= hi)
    if not ok:
        rng = ("(" if lo_ex else "[") + fmt_float(lo) + ", " + \
            ("inf" if hi == math.inf else fmt_float(hi)) + (")" if hi_ex or hi == math.inf else "]")
        raise _bad(arg, f"{value!r} is out of range {rng}")
    return v


def _resolve_hypers(rule_key, lr=None, betas=None, eps=None, weight_decay=None,
                    momentum=None, dampening=None, check=True):
    out = []
    given = {"lr": lr, "eps": eps, "weight_decay": weight_decay,
             "momentum": momentum, "dampening": dampening}
    if betas is not None:
        try:
            b = tuple(betas)
        except TypeError:
            b = ()
        if len(b) != 2:
            raise _bad("betas", f"must be a pair (beta1, beta2), got {betas!r}")
        given["beta1"], given["beta2"] = b
    for name in RULE_HYPERS[rule_key]:
        v = given.get(name)
        if v is not None:
            arg = {"beta1": "betas[0]", "beta2": "betas[1]"}.get(name, name)
            out.append((name, _hyper_default(name, arg, v, check)))
    return tuple(out)


def _default_moments(param, master):
    if master is not None:
        return master
    return "f32" if param == "f16" else param


def _validate(spec):
    """The verifier's rules (docs/Dialects/Zopt.md), as errors naming the
    builder argument."""
    p, g, w = spec.param, spec.grad, spec.master
    if g != p and not (g == "f32" and _BITS[p] == 16):
        raise _bad("grad", f"{g} gradients with {p} params are not supported: the "
                   f"grad has the param's dtype (rule 7; torch keeps .grad in the "
                   f"param's dtype) or is f32 for a bf16/f16 param (gradients "
                   f"accumulated in f32: DeepSpeed's bf16 layout with "
                   f"grad_accum_dtype fp32, Megatron's main_grad); allowed: "
                   f"grad={p!r}, " + ("'f32' " if _BITS[p] == 16 else "") + "or None")
    if g == "f16" and not spec.loss_scale:
        raise _bad("loss_scale", "f16 gradients need loss scaling (rule 8: fp16 "
                   "training without a scaler underflows); allowed: True or None")
    if spec.remainder:
        if p != "bf16":
            raise _bad("master", f"'remainder' keeps the high half of the f32 master in "
                       f"a bf16 param; the param is {p} (allowed: param='bf16')")
        if spec.user_placement != spec.state_placement:
            raise _bad("master", "'remainder' needs the param and the master on one "
                       f"placement (the param is half of the master); placement="
                       f"{spec.placement!r} puts them apart (allowed: 'cpu', 'gpu', or "
                       "master='f32'/'bf16' with 'offload')")
        if dict(spec.rounding).get("param") == "stochastic":
            raise _bad("rounding", "a stochastically rounded param cannot be the high "
                       "half of an exact master (docs/NUMERICS.md section 9); with "
                       "master='remainder' the param is the master rounded to nearest")
    if spec.kahan:
        if p != "bf16":
            raise _bad("master", f"'kahan' compensates a bf16 param (its compensation "
                       f"is bf16 too); the param is {p} (allowed: param='bf16')")
        if spec.user_placement != spec.state_placement:
            raise _bad("master", "'kahan' keeps the compensation beside the param, "
                       "and the update runs where the optimizer states are; placement="
                       f"{spec.placement!r} puts them apart (allowed: 'cpu', 'gpu', or "
                       "master='f32'/'bf16' with 'offload')")
        if dict(spec.rounding).get("param") == "stochastic":
            raise _bad("rounding", "a Kahan-compensated param does not combine with "
                       "stochastic rounding (docs/NUMERICS.md section 11): the "
                       "compensation already recovers every rounding error; with "
                       "master='kahan' the param is rounded to nearest")
    if w is not None:
        if w == "f16":
            raise _bad("master", "an f16 master cannot hold small updates to large "
                       "weights (rule 9); allowed: None, 'f32'" +
                       (", 'bf16'" if p == "bf16" and spec.placement == "offload" else ""))
        if _BITS[w] < _BITS[p] or (w == "bf16" and p == "f16"):
            raise _bad("master", f"a {w} master is less precise than {p} params "
                       "(rule 9); allowed: None, 'f32'")
        if w == p and spec.user_placement == spec.state_placement:
            raise _bad("master", f"a {w} master of {p} params on the same placement "
                       "duplicates the param (rule 9): leave master=None and the "
                       "param is the weight" +
                       (" (a bf16 master is allowed with placement='offload', "
                        "where it lives on the CPU and the param on the GPU)"
                        if w == "bf16" else ""))
    sd = spec.state_dtypes
    for kind in ("exp_avg_sq", "max_exp_avg_sq"):
        if sd.get(kind) == "f16":
            arg = kind if spec.rule in ("adam", "adamw") else "moments"
            raise _bad(arg, f"'{kind}' cannot be f16: squared gradients under 6e-8 "
                       "flush to zero and over 65504 overflow (rule 10); allowed: "
                       "'f32', 'bf16' (exp_avg may be f16: give exp_avg='f16' and "
                       "exp_avg_sq='bf16' or 'f32')")
    if spec.clip is not None and not (spec.clip > 0 and math.isfinite(spec.clip)):
        raise _bad("clip", f"max_norm must be positive and finite, got {spec.clip!r}; "
                   "None turns clipping off")
    if spec.placement not in PLACEMENTS:
        raise _bad("placement", f"unknown placement {spec.placement!r}; allowed: "
                   + ", ".join(PLACEMENTS))
    if spec.gpu_arch is not None:
        m = re.fullmatch(r"sm_(\d+)", spec.gpu_arch)
        if not m or int(m.group(1)) < 70:
            raise _bad("gpu_arch", f"{spec.gpu_arch!r} is not a CUDA architecture "
                       "sm_70 or newer (e.g. 'sm_80', 'sm_90')")
    if spec.zero_stage is not None and spec.zero_stage not in (0, 1, 2, 3):
        raise _bad("zero_stage", f"{spec.zero_stage!r}; allowed: 0, 1, 2, 3")
    if spec.zero_stage == 3 and spec.placement == "offload":
        raise _bad("zero_stage", "3 with placement='offload' (params on the GPU, "
                   "optimizer states on the CPU) is not supported; allowed: 0, 1, 2 "
                   "(2 is ZeRO-Offload)")
    if spec.align is not None and not (
            isinstance(spec.align, int) and 1 <= spec.align <= (1 << 20)
            and spec.align & (spec.align - 1) == 0):
        raise _bad("align", f"{spec.align!r}; allowed: a power of two between 1 "
                   "and 1048576 elements")
    if not _NAME_RE.match(spec.name) or len(spec.name) > 63:
        raise _bad("name", f"{spec.name!r} is not a symbol name of at most 63 "
                   "characters ([A-Za-z_][A-Za-z0-9_$.]*)")


def _written_states(param, master, states):
    """(kind, dtype) of every state the step stores into."""
    out = [("param", param)]
    if master is not None:
        out.append(("master", master))
    out += [kv for kv in states if kv[0] != "master"]
    return out


def _resolve_rounding(rounding, written, check):
    """rounding argument -> ((kind, mode), ...) for the declarations."""
    if rounding is None:
        return ()
    narrow = [(k, d) for k, d in written if d != "f32"]
    if isinstance(rounding, str):
        mode = rounding
        if mode not in ROUNDINGS:
            raise _bad("rounding", f"unknown mode {mode!r}; allowed: None, "
                       "'nearest_even', 'stochastic', or a dict {state: mode}")
        if mode == "nearest_even":
            return ()  # the default of every narrowing store
        if check:
            if not narrow:
                raise _bad("rounding", "'stochastic' has no effect: every state "
                           "the step stores is f32 (stochastic rounding applies to "
                           "bf16 states)")
            f16 = [k for k, d in narrow if d == "f16"]
            bf16 = [k for k, d in narrow if d == "bf16"]
            if f16:
                hint = (f": give a dict naming the bf16 states, e.g. {{{bf16[0]!r}: "
                        "'stochastic'}" if bf16 else "")
                raise _bad("rounding", "'stochastic' would apply to the f16 state"
                           f"{'s' if len(f16) > 1 else ''} "
                           f"{', '.join(repr(k) for k in f16)}; stochastic rounding "
                           f"is implemented for bf16 states only (rule 14){hint}")
        return tuple((k, "stochastic") for k, d in narrow)
    if not isinstance(rounding, dict):
        raise _bad("rounding", f"{rounding!r}; allowed: None, 'nearest_even', "
                   "'stochastic', or a dict {state kind: mode}")
    wd = dict(written)
    out = []
    for kind, mode in rounding.items():
        arg = f"rounding[{kind!r}]"
        if mode not in ROUNDINGS:
            raise _bad(arg, f"unknown mode {mode!r}; allowed: "
                       + ", ".join(repr(r) for r in ROUNDINGS))
        if kind not in wd:
            if not check and kind == "grad":
                out.append((kind, mode))
                continue
            raise _bad(arg, ("the grad is never stored, so it never rounds" if
                             kind == "grad" else f"this step has no {kind!r} state")
                       + "; allowed keys: " + ", ".join(repr(k) for k, _ in written))
        d = wd[kind]
        if check and d == "f32" and mode != "nearest_even":
            raise _bad(arg, f"the {kind!r} state is f32 and never rounds (rule 14); "
                       "stochastic rounding applies to bf16 states")
        if check and mode == "stochastic" and d == "f16":
            raise _bad(arg, f"the {kind!r} state is f16; stochastic rounding is "
                       "implemented for bf16 states only (rule 14); allowed: "
                       "'nearest_even'")
        out.append((kind, mode))
    order = {k: i for i, k in enumerate(STATE_KINDS)}
    return tuple(sorted(out, key=lambda kv: order[kv[0]]))


def _call_repr(fname, kw):
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"zopt.steps.{fname}({args})"


def resolve(rule, *, param="f32", grad=None, master=None, moments=None,
            exp_avg=None, exp_avg_sq=None, max_exp_avg_sq=None, amsgrad=False,
            nesterov=False, momentum_buffer=True, clip=None, loss_scale=None,
            rounding=None, placement="cpu", gpu_arch=None, zero_stage=0,
            align=16, lr=None, betas=None, eps=None, weight_decay=None,
            momentum=None, dampening=None, style="primitives", name=None,
            comments=True, call="", notes=(), check=True):
    """The :class:`Spec` of a step (every builder goes through here).

    ``check=False`` skips the cross-argument rules (used by the tests to
    generate descriptions the verifier must refuse)."""
    if rule not in RULES:
        raise _bad("rule", f"unknown rule {rule!r}; allowed: " + ", ".join(RULES))
    p = dtype_name(param, "param")
    g = p if grad is None else dtype_name(grad, "grad")
    if master is True:
        master = "f32"
    elif master is False:
        master = None
    remainder = master == "remainder"
    kahan = master == "kahan"
    if kahan:
        master = None
    w = None if master is None else "f32" if remainder else dtype_name(master, "master")
    if placement not in PLACEMENTS:
        raise _bad("placement", f"unknown placement {placement!r}; allowed: "
                   + ", ".join(PLACEMENTS))
    if placement == "cpu":
        if gpu_arch is not None and check:
            raise _bad("gpu_arch", "a CPU step has no GPU code; give gpu_arch only "
                       "with placement='gpu' or 'offload'")
        arch = gpu_arch  # (only reaches here unchecked)
    else:
        arch = gpu_arch or DEFAULT_GPU_ARCH
    q8 = isinstance(moments, str) and moments.strip().lower() == "q8"
    if q8 and check:
        why = (f"{rule} has no Adam moments" if rule not in ("adam", "adamw")
               else "amsgrad's running max is not offered with them" if amsgrad
               else "the CUDA backend takes them only with ZOPT_EXPERIMENTAL_GPU_Q8=1 until a GPU "
               "has checked its q8 kernels (docs/GPU.md); use placement 'cpu' or 'offload'"
               if placement == "gpu" and os.environ.get("ZOPT_EXPERIMENTAL_GPU_Q8") != "1"
               else "set them with moments='q8' alone" if exp_avg is not None
               or exp_avg_sq is not None else None)
        if why:
            raise _bad("moments", f"'q8' (block-quantized Adam moments): {why}")
    md = ("f32" if q8 else _default_moments(p, "f32" if kahan else w) if moments is None
          else dtype_name(moments, "moments"))
    states = []
    if w is not None:
        states.append(("master", w))
    if rule in ("adam", "adamw"):
        states.append(("exp_avg", md if exp_avg is None else dtype_name(exp_avg, "exp_avg")))
        states.append(("exp_avg_sq", md if exp_avg_sq is None
                       else dtype_name(exp_avg_sq, "exp_avg_sq")))
        if amsgrad:  # default: the dtype of exp_avg_sq, whose running max it is
            states.append(("max_exp_avg_sq", states[-1][1] if max_exp_avg_sq is None
                           else dtype_name(max_exp_avg_sq, "max_exp_avg_sq")))
        elif max_exp_avg_sq is not None:
            raise _bad("max_exp_avg_sq", "is the amsgrad state: give amsgrad=True")
    else:
        for arg, v in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                       ("max_exp_avg_sq", max_exp_avg_sq)):
            if v is not None:
                raise _bad(arg, f"{rule} has no {arg} dtype to set; use moments=")
        if amsgrad:
            raise _bad("amsgrad", f"amsgrad is an Adam variant; {rule} has none")
        if rule == "sgd" and momentum_buffer:
            states.append(("momentum_buffer", md))
        elif rule == "lion":
            states.append(("exp_avg", md))
    if rule != "sgd" and nesterov:
        raise _bad("nesterov", f"nesterov is an SGD option; {rule} has none")
    if rule == "sgd" and not momentum_buffer and moments is not None and check:
        raise _bad("moments", "plain SGD (momentum=0) has no state to set a dtype for")
    # f16 gradients need loss scaling (rule 8); f16 params with f32
    # gradients too: each backward still computes f16 gradients before
    # they are accumulated in f32.
    ls = (g == "f16" or p == "f16") if loss_scale is None else bool(loss_scale)
    written = _written_states(p, w, states)
    rnd = _resolve_rounding(rounding, written, check)
    if style not in ("primitives", "named"):
        raise _bad("style", f"{style!r}; allowed: 'primitives', 'named' (zopt.adam)")
    if style == "named" and (rule not in ("adam", "adamw") or amsgrad):
        raise _bad("style", "the named rule zopt.adam covers adam/adamw without "
                   "amsgrad; allowed here: 'primitives'")
    rule_key = "sgd_plain" if rule == "sgd" and not momentum_buffer else rule
    hyp = _resolve_hypers(rule_key, lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay, momentum=momentum,
                          dampening=dampening, check=check)
    clip_v = None
    if clip is not None:
        try:
            clip_v = float(clip)
        except (TypeError, ValueError):
            raise _bad("clip", f"must be a number or None, got {clip!r}") from None
    spec = Spec(rule=rule, param=p, grad=g, master=w, states=tuple(states),
                remainder=remainder, kahan=kahan, q8=q8, amsgrad=bool(amsgrad), nesterov=bool(nesterov),
                momentum_buffer=bool(momentum_buffer), clip=clip_v, loss_scale=ls,
                rounding=rnd, placement=placement, gpu_arch=arch,
                zero_stage=zero_stage, align=align, hypers=hyp, style=style,
                name="", comments=comments, call=call, notes=tuple(notes))
    spec = dataclasses.replace(spec, name=name or _auto_name(spec))
    if check:
        _validate(spec)
    return spec


def _auto_name(s):
    parts = [s.rule]
    if s.amsgrad:
        parts.append("amsgrad")
    if s.rule == "sgd":
        parts.append("nesterov" if s.nesterov else ("mom" if s.momentum_buffer else "plain"))
    parts.append(s.param)
    if s.grad != s.param:
        parts.append("g" + s.grad)
    if s.master:
        parts.append("wrem" if s.remainder else "w" + s.master)
    if s.kahan:
        parts.append("kahan")
    sts = [d for k, d in s.states if k != "master"]
    if s.q8:
        parts.append("q8")
    elif sts:
        parts.append("s" + "".join(dict.fromkeys(sts)) if len(set(sts)) == 1
                     else "s" + "_".join(sts))
    if s.clip is not None:
        parts.append("clip")
    if s.loss_scale:
        parts.append("ls")
    if any(m == "stochastic" for _, m in s.rounding):
        parts.append("sr")
    if s.placement != "cpu":
        parts.append(s.placement)
    if s.zero_stage:
        parts.append(f"z{s.zero_stage}")
    return "_".join(parts)[:63]


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

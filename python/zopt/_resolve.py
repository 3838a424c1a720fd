"""The resolved step: :class:`Spec` (what a description says, every default
filled in) and :func:`resolve` (a rule and its builder arguments -> Spec),
behind every ``zopt.steps.<rule>`` builder, ``zopt.describe`` and the
DeepSpeed importer.

Here each option is normalised (dtype names, ``master=True``, the q8
moments), defaulted (the moments' dtype, loss scaling, the step's name)
and checked against the verifier's rules (docs/Dialects/Zopt.md), as a
:class:`zopt.ZoptError` naming the builder argument; the hyperparameter
defaults against their ranges. The text of a Spec is ``_steptext.py``'s;
the builders' own arguments (SGD's momentum, AdamW's weight_decay default,
``classes=``) are ``steps.py``'s and ``_specs.py``'s.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from ._dtypes import dtype_name
from ._lib import arg_error as _bad
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

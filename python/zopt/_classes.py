"""Parameter classes: which step a param is stepped by.

``zopt.Optimizer(step, ...)`` has one class (the step's param dtype) and
takes every param into it (a param of another dtype is refused by the
class, naming the step). ``zopt.Optimizer({dtype: step}, ...)`` has one
class per key (torch dtypes or "f32"/"bf16"/"f16") and routes each param
to the class of its dtype (docs/USAGE.md, "Params of several dtypes").
Classes run in the order bf16, f16, f32 whatever the mapping's order, so
the linked step's norm sum, and with it every result, does not depend on
how the mapping was written. A class ``"<dtype>:keep32"`` (the precision
policy, ``_policy.py``) takes the params of that dtype that its rule keeps
at 32-bit moments, and runs right after its dtype's class. A class
``"<dtype>:gpu"`` (the GPU fraction of an offloaded optimizer,
``_placement.py``) is that offloaded class's step with every state on the
GPU; it takes the first-added params up to the fraction, and runs right
after its dtype's class (after the keep32 one).
"""
from __future__ import annotations

import numpy as np

from ._dtypes import is_torch, torch_dtypes
from ._lib import DType, Status, ZoptError, DTYPE_NAMES
from ._params import split_item
from ._placement import SUFFIX as GPU_SUFFIX, split_key as split_gpu_key
from ._policy import SUFFIX, Keep32, split_key
from ._step import Step
from .steps import dtype_name

DTYPE_ORDER = ("bf16", "f16", "f32")
CLASS_ORDER = tuple(c + t for c in DTYPE_ORDER for t in ("", SUFFIX, GPU_SUFFIX))
DT_OF = {"f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16}
NAME_OF = {v: k for k, v in DT_OF.items()}
_NP_CLASS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
             np.dtype(np.uint16): "bf16"}


def class_key(k):
    base, keep32 = split_key(k)
    base, gpu = split_gpu_key(base) if not keep32 else (base, False)
    try:
        return dtype_name(base, "step") + (SUFFIX if keep32 else GPU_SUFFIX if gpu else "")
    except ZoptError:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"step mapping: key {k!r} is not a dtype; the keys name the "
                        "parameter classes: torch dtypes or 'f32', 'bf16', 'f16', "
                        "'<dtype>:keep32' for the params a precision policy keeps at "
                        "32-bit moments, and '<dtype>:gpu' for the GPU fraction of an "
                        "offloaded class") from None


def check_mapping_options(step, kw):
    """zopt.Optimizer's options a step mapping cannot take: grad_streaming;
    overlap, but for one offloaded class and its GPU fraction
    (``zopt.steps.<rule>(placement="offload", gpu_fraction=f)``)."""
    if kw.get("overlap"):
        keys = [class_key(k) for k in step]
        if getattr(step, "gpu_fraction", None) is None or \
                sum(1 for k in keys if not split_gpu_key(k)[1]) != 1:
            raise ZoptError(Status.UNSUPPORTED, "overlap=True: not for a step per dtype "
                            "(a mapping); the overlap is implemented for one offloaded step, "
                            "with or without its GPU fraction (zopt.steps.<rule>("
                            "placement='offload', gpu_fraction=f))")
    if kw.get("grad_streaming"):
        raise ZoptError(Status.UNSUPPORTED, "grad_streaming=True: not for a step per "
                        "dtype (a mapping); streaming is implemented for one step")


def base_of(c):
    """The dtype class of a class key (a keep32 or GPU twin's dtype)."""
    return split_gpu_key(split_key(c)[0])[0]


def gpu_fraction_of(step, steps):
    """The GPU fraction routing params to ``"<dtype>:gpu"`` classes (set by
    ``zopt.steps.<rule>(..., gpu_fraction=f)``), None without such a class."""
    if not any(split_gpu_key(c)[1] for c in steps):
        return None
    f = getattr(step, "gpu_fraction", None)
    if f is None:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "step mapping: a '<dtype>:gpu' class without the fraction of the "
                        "params it takes: build the classes with zopt.steps.<rule>("
                        "placement='offload', gpu_fraction=f)")
    return f


def policy_of(step, steps):
    """The precision policy routing params to ``"<dtype>:keep32"`` classes:
    the mapping's own (``zopt.steps.<rule>(..., keep32=...)`` sets it), else
    the default Keep32() where the mapping has such a class, else None."""
    if not any(split_key(c)[1] for c in steps):
        return None
    p = getattr(step, "keep32", None)
    return p if isinstance(p, Keep32) else Keep32()


def steps_of(step, mapped):
    """{class: Step} in CLASS_ORDER: one class for a Step (or a step.so
    path), one per key of a mapping, checked to be steppable as one."""
    if not mapped:
        st = step if isinstance(step, Step) else Step(step)
        return {NAME_OF.get(st.param_dtype, "?"): st}
    if not step:
        raise ZoptError(Status.INVALID_ARGUMENT, "step mapping is empty: give "
                        "{dtype: Step or path}, e.g. zopt.steps.adamw(classes=...)")
    steps = {}
    for k, v in step.items():
        c = class_key(k)
        if c in steps:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step mapping: two keys name the class {c!r}")
        st = v if isinstance(v, Step) else Step(v)
        if st.param_dtype != DT_OF[base_of(c)]:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step mapping: the step for class {c!r} ('{st.name}') has "
                            f"{DTYPE_NAMES[st.param_dtype]} params, not {base_of(c)}")
        steps[c] = st
    for c in steps:
        base, keep32 = split_key(c)
        if keep32 and base not in steps:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step mapping: class {c!r} without class {base!r}: the "
                            f"precision policy sends some {base} params to {c!r}, the "
                            f"others to {base!r}")
        base, gpu = split_gpu_key(c)
        if gpu and (base not in steps or not steps[base].on_device or steps[base].gpu
                    or not steps[c].gpu):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step mapping: class {c!r} ('{steps[c].name}') is the GPU "
                            f"fraction of an offloaded class {base!r}: it needs that class "
                            "(placement='offload') and a GPU step (placement='gpu'); build "
                            "both with zopt.steps.<rule>(placement='offload', gpu_fraction=f)")
    steps = {c: steps[c] for c in CLASS_ORDER if c in steps}
    first_c, first = next(iter(steps.items()))
    for c, st in steps.items():
        what = None
        if set(st.hypers) != set(first.hypers):
            what = (f"hyperparameter slots ({', '.join(st.hypers)} vs "
                    f"{', '.join(first.hypers)}): the classes share param_groups")
        elif st.clipped != first.clipped or st.max_norm != first.max_norm:
            what = (f"clipping (max_norm {st.max_norm} vs {first.max_norm}): the "
                    "classes share one global norm")
        elif st.loss_scaled != first.loss_scaled:
            what = ("loss scaling: the classes share one loss scaler and skip "
                    "decision")
        elif st.gpu and not split_gpu_key(c)[1]:
            what = ("placement: linked steps run CPU-updated steps (all-CPU or "
                    "offloaded) and the GPU fraction of an offloaded class ('<dtype>:gpu', "
                    "zopt.steps.<rule>(placement='offload', gpu_fraction=f)); this step "
                    "updates on the GPU")
        if what is not None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step mapping: class {c!r} ('{st.name}') and class "
                            f"{first_c!r} ('{first.name}') differ in {what}")
    return steps


def classify(steps, gid, i, p, pname=None, keep32=None, gpu=None):
    """The class of user item ``p`` of a step mapping (a torch param or a
    (param, grad) pair) at ``param_groups[gid]['params'][i]``, named
    ``pname`` (None: no names given); ``keep32``: the precision policy;
    ``gpu``: the GPU fraction's router (_placement.GpuSplit), asked in add
    order."""
    name = f"param_groups[{gid}]['params'][{i}]"
    param = split_item(p)[0]
    if is_torch(param):
        name += f" (shape {tuple(param.shape)}, {str(param.dtype).replace('torch.', '')})"
        c = NAME_OF.get(torch_dtypes().get(param.dtype))
    elif isinstance(param, np.ndarray):
        name += f" (numpy {param.dtype}, shape {param.shape})"
        c = _NP_CLASS.get(param.dtype)
    else:
        raise ZoptError(Status.INVALID_ARGUMENT, f"{name}: expected a numpy array or "
                        f"torch tensor, got {type(param).__name__}")
    if c is None or c not in steps:
        have = ", ".join(f"{k} ('{s.name}')" for k, s in steps.items())
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{name}: no parameter class for its dtype"
                        + (f" {c}" if c else "") + f"; the step mapping's classes: {have}")
    numel = param.size if isinstance(param, np.ndarray) else param.numel()
    if keep32 is not None and c + SUFFIX in steps and keep32.takes(pname, int(numel)):
        return c + SUFFIX
    if gpu is not None and c + GPU_SUFFIX in steps and gpu.takes(int(numel)):
        return c + GPU_SUFFIX
    return c

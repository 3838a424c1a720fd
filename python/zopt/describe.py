"""The test matrix's names for step descriptions, over zopt.steps.

The public builder is :mod:`zopt.steps` (``zopt.steps.adamw(param="bf16",
master="f32", ...)``); this module keeps the four named layouts the tests,
the float64 reference (python/tests/oracles/reference.py) and the benchmarks are written
against, and generates their text with the same generator (without
comments, so the text, and the cache key, stays short).

Layouts (p/g = param/grad, w = master):
  "f32"            p, g, m, v f32; p is the weight.
  "bf16_master"    bf16 p/g; f32 w, m, v; p is the rounded w.
  "bf16"           bf16 p/g, p is the weight; bf16 m, v; no master.
  "f16_loss_scale" f16 p/g (loss-scaled grads, zopt.unscale); f32 w, m, v.
``state_dtype`` overrides the dtype of the moments/buffers (e.g. Lion with
an f32 master and a bf16 momentum, as in examples/lion_bf16.mlir).
``stochastic``: state kinds (e.g. ("param",)) declared `rounding
stochastic` (bf16 states; abi.h "Stochastic rounding").
``placement``: "cpu" (everything on the CPU), "gpu" (everything on the GPU,
compiled for ``gpu_arch``) or "offload" (param/grad on the GPU, every
optimizer state on the CPU: ZeRO-Offload).
"""
from __future__ import annotations

from . import steps as _steps

LAYOUTS = ("f32", "bf16_master", "bf16", "f16_loss_scale")
RULES = ("adam", "adamw", "sgd", "lion")


def layout_types(layout, state_dtype=None):
    """(param/grad dtype, master dtype or None, moment dtype, loss_scale)."""
    if layout == "f32":
        r = ("f32", None, "f32", False)
    elif layout == "bf16_master":
        r = ("bf16", "f32", "f32", False)
    elif layout == "bf16":
        r = ("bf16", None, "bf16", False)
    elif layout == "f16_loss_scale":
        r = ("f16", "f32", "f32", True)
    else:
        raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")
    if state_dtype is not None:
        r = (r[0], r[1], state_dtype, r[3])
    return r


def step_name(rule, amsgrad=False, nesterov=False, momentum=True, layout="f32",
              clip=None, state_dtype=None, style="auto"):
    parts = [rule]
    if amsgrad:
        parts.append("amsgrad")
    if rule == "sgd":
        parts.append("nesterov" if nesterov else ("mom" if momentum else "plain"))
    parts.append(layout)
    if state_dtype:
        parts.append("st_" + state_dtype)
    if clip is not None:
        parts.append("clip")
    if style != "auto":
        parts.append(style)
    return "_".join(parts)


def describe(rule, amsgrad=False, nesterov=False, momentum=True, layout="f32",
             clip=None, state_dtype=None, style="auto", name=None,
             attributes=None, placement="cpu", gpu_arch="sm_90", stochastic=()):
    """MLIR text of one step of the test matrix.

    rule: "adam" (L2 decay, torch.optim.Adam), "adamw" (decoupled,
    torch.optim.AdamW), "sgd" (torch.optim.SGD: momentum/nesterov select
    the buffer), "lion". clip: max_norm of global-norm clipping or None.
    style: "auto" uses the named rule ``zopt.adam`` where it covers the case
    (no amsgrad), "primitives" always decomposes, "named" forces zopt.adam.
    attributes: {"zero_stage": n, "align": n} (omitted: the dialect's
    defaults, 0 and 1).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}")
    if placement not in ("cpu", "gpu", "offload"):
        raise ValueError(f"unknown placement {placement!r}; known: cpu, gpu, offload")
    pg, wt, st, loss_scale = layout_types(layout, state_dtype)
    adam_like = rule in ("adam", "adamw")
    if style == "named" and amsgrad:
        raise ValueError("the named rule zopt.adam has no amsgrad form here")
    use_named = adam_like and (style == "named" or (style == "auto" and not amsgrad))
    attributes = dict(attributes or {})
    unknown = set(attributes) - {"zero_stage", "align"}
    if unknown:
        raise ValueError(f"unknown step attributes {sorted(unknown)}; known: "
                         "zero_stage, align")
    spec = _steps.resolve(
        rule, param=pg, master=wt, moments=st, amsgrad=amsgrad,
        nesterov=nesterov, momentum_buffer=momentum if rule == "sgd" else True,
        clip=clip, loss_scale=loss_scale,
        rounding={k: "stochastic" for k in stochastic} or None,
        placement=placement, gpu_arch=None if placement == "cpu" else gpu_arch,
        zero_stage=attributes.get("zero_stage"), align=attributes.get("align"),
        style="named" if use_named else "primitives",
        name=name or step_name(rule, amsgrad, nesterov, momentum, layout, clip,
                               state_dtype, style),
        comments=False, check=False)
    return spec.text()

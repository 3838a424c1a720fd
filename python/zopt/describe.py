"""Generates zopt step descriptions (MLIR text) for the test matrix.

The syntax follows examples/*.mlir exactly: states ``zopt.state <kind> :
<dtype> on cpu``, one ``zopt.hyper <name>`` per line, primitives whose type
list names the storage type of each tensor operand (values computed by a
primitive are f32), and ``zopt.yield <values> into <states> : <value types>
into <state types>``.

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


def _fmt(x):
    r = repr(float(x))
    return r


def describe(rule, amsgrad=False, nesterov=False, momentum=True, layout="f32",
             clip=None, state_dtype=None, style="auto", name=None,
             attributes=None, placement="cpu", gpu_arch="sm_90", stochastic=()):
    """MLIR text of one step.

    rule: "adam" (L2 decay, torch.optim.Adam), "adamw" (decoupled,
    torch.optim.AdamW), "sgd" (torch.optim.SGD: momentum/nesterov select
    the buffer), "lion". clip: max_norm of global-norm clipping or None.
    style: "auto" uses the named rule ``zopt.adam`` where it covers the case
    (no amsgrad), "primitives" always decomposes, "named" forces zopt.adam.
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}")
    pg, wt, st, loss_scale = layout_types(layout, state_dtype)
    name = name or step_name(rule, amsgrad, nesterov, momentum, layout, clip,
                             state_dtype, style)
    if placement not in ("cpu", "gpu", "offload"):
        raise ValueError(f"unknown placement {placement!r}; known: cpu, gpu, offload")
    user_on = "cpu" if placement == "cpu" else "gpu"      # param, grad
    state_on = "gpu" if placement == "gpu" else "cpu"     # optimizer states
    L = []
    attr_list = [f"{k} = {v} : i64" for k, v in (attributes or {}).items()]
    if placement != "cpu":
        attr_list.append(f'gpu_arch = "{gpu_arch}"')
    attrs = " attributes {" + ", ".join(attr_list) + "}" if attr_list else ""
    L.append(f"zopt.step @{name}{attrs} {{")
    def rnd(kind):  # `rounding stochastic` for the kinds named in `stochastic`
        return " rounding stochastic" if kind in stochastic else ""
    L.append(f"  %p = zopt.state param : {pg} on {user_on}{rnd('param')}")
    L.append(f"  %g = zopt.state grad : {pg} on {user_on}")
    if wt is not None:
        L.append(f"  %w = zopt.state master : {wt} on {state_on}{rnd('master')}")
        W, WT = "%w", wt
    else:
        W, WT = "%p", pg
    states_decl = []
    if rule in ("adam", "adamw"):
        states_decl = [("%m", "exp_avg"), ("%v", "exp_avg_sq")]
        if amsgrad:
            states_decl.append(("%vm", "max_exp_avg_sq"))
    elif rule == "sgd" and momentum:
        states_decl = [("%buf", "momentum_buffer")]
    elif rule == "lion":
        states_decl = [("%m", "exp_avg")]
    for v, kind in states_decl:
        L.append(f"  {v} = zopt.state {kind} : {st} on {state_on}{rnd(kind)}")
    hypers = {"adam": ["lr", "beta1", "beta2", "eps", "weight_decay"],
              "adamw": ["lr", "beta1", "beta2", "eps", "weight_decay"],
              "sgd": ["lr"] + (["momentum", "dampening"] if momentum else [])
                     + ["weight_decay"],
              "lion": ["lr", "beta1", "beta2", "weight_decay"]}[rule]
    short = {"lr": "%lr", "beta1": "%b1", "beta2": "%b2", "eps": "%eps",
             "weight_decay": "%wd", "momentum": "%mu", "dampening": "%damp"}
    for h in hypers:
        L.append(f"  {short[h]} = zopt.hyper {h}")
    # gradient chain
    G, GT = "%g", pg
    if loss_scale:
        L.append(f"  %gs = zopt.unscale {G} : {GT}")
        G, GT = "%gs", "f32"
    if clip is not None:
        L.append(f"  %gc = zopt.clip_by_global_norm {G} max {_fmt(clip)} : {GT}")
        G, GT = "%gc", "f32"
    yields = []  # (value, state, state dtype)
    if rule in ("adam", "adamw"):
        decoupled = rule == "adamw"
        named = (style == "named") or (style == "auto" and not amsgrad)
        if named:
            if amsgrad:
                raise ValueError("the named rule zopt.adam has no amsgrad form here")
            attr = " {decoupled}" if decoupled else ""
            L.append(f"  %w1, %m1, %v1 = zopt.adam {W}, {G}, %m, %v, %lr, %b1, "
                     f"%b2, %eps, %wd{attr} : {WT}, {GT}, {st}, {st}")
            yields += [("%w1", W, WT), ("%m1", "%m", st), ("%v1", "%v", st)]
            WN = "%w1"
        else:
            WV, WVT = W, WT
            if not decoupled:
                L.append(f"  %gd = zopt.l2_decay {G}, {W}, %wd : {GT}, {WT}")
                G, GT = "%gd", "f32"
            L.append(f"  %m1 = zopt.ema %m, {G}, %b1 : {st}, {GT}")
            L.append(f"  %v1 = zopt.ema_sq %v, {G}, %b2 : {st}, {GT}")
            vsel = "%v1"
            if amsgrad:
                L.append(f"  %vm1 = zopt.max %vm, %v1 : {st}, f32")
                vsel = "%vm1"
            L.append(f"  %u = zopt.adam_direction %m1, {vsel}, %b1, %b2, %eps : f32, f32")
            if decoupled:
                L.append(f"  %wdd = zopt.decoupled_decay {W}, %lr, %wd : {WT}")
                WV, WVT = "%wdd", "f32"
            L.append(f"  %w1 = zopt.apply {WV}, %u, %lr : {WVT}, f32")
            yields += [("%w1", W, WT), ("%m1", "%m", st), ("%v1", "%v", st)]
            if amsgrad:
                yields.append(("%vm1", "%vm", st))
            WN = "%w1"
    elif rule == "sgd":
        L.append(f"  %gd = zopt.l2_decay {G}, {W}, %wd : {GT}, {WT}")
        D = "%gd"
        if momentum:
            L.append(f"  %b1 = zopt.momentum %buf, %gd, %mu, %damp : {st}, f32")
            D = "%b1"
            if nesterov:
                L.append("  %d = zopt.nesterov %gd, %b1, %mu : f32, f32")
                D = "%d"
            yields.append(("%b1", "%buf", st))
        L.append(f"  %w1 = zopt.apply {W}, {D}, %lr : {WT}, f32")
        yields.insert(0, ("%w1", W, WT))
        WN = "%w1"
    else:  # lion
        L.append(f"  %c = zopt.ema %m, {G}, %b1 : {st}, {GT}")
        L.append("  %s = zopt.sign %c : f32")
        L.append(f"  %wdd = zopt.decoupled_decay {W}, %lr, %wd : {WT}")
        L.append("  %w1 = zopt.apply %wdd, %s, %lr : f32, f32")
        L.append(f"  %m1 = zopt.ema %m, {G}, %b2 : {st}, {GT}")
        yields += [("%w1", W, WT), ("%m1", "%m", st)]
        WN = "%w1"
    if wt is not None:
        yields.append((WN, "%p", pg))  # low-precision param = rounded master
    vals = ", ".join(v for v, _, _ in yields)
    sts = ", ".join(s for _, s, _ in yields)
    vts = ", ".join("f32" for _ in yields)
    sdt = ", ".join(t for _, _, t in yields)
    L.append(f"  zopt.yield {vals} into {sts} : {vts} into {sdt}")
    L.append("}")
    return "\n".join(L) + "\n"

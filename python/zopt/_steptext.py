"""The MLIR text of a resolved step: a :class:`zopt.steps.Spec` written as a
commented ``zopt.step`` description (the dialect of docs/Dialects/Zopt.md).

``emit(spec)`` is ``Spec.text()``: the header comment (the builder call,
where the tensors live, the bytes moved per parameter), the state and
hyperparameter declarations and the rule's ops, with or without comments.
No checks here: the Spec is resolved and validated by
``zopt.steps.resolve``, which also takes ``RULE_HYPERS`` (which
hyperparameter slots each rule declares) and ``fmt_float`` from here.
"""
from __future__ import annotations

_HYPER_SSA = {"lr": "%lr", "beta1": "%b1", "beta2": "%b2", "eps": "%eps",
              "weight_decay": "%wd", "momentum": "%mu", "dampening": "%damp"}
RULE_HYPERS = {
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay"),
    "sgd_plain": ("lr", "weight_decay"),
    "lion": ("lr", "beta1", "beta2", "weight_decay"),
}
_STATE_SSA = {"param": "%p", "grad": "%g", "master": "%w", "exp_avg": "%m",
              "exp_avg_sq": "%v", "max_exp_avg_sq": "%vm",
              "momentum_buffer": "%buf"}


def fmt_float(x):
    """A double as an MLIR float literal that parses back to the same value."""
    x = float(x)
    s = repr(x)
    if "e" in s or "E" in s:
        mant, exp = s.lower().split("e")
        if "." not in mant:
            mant += ".0"
        s = f"{mant}e{exp}"
    elif "." not in s:
        s += ".0"
    return s


_RULE_TITLES = {
    "adam": "Adam with L2 weight decay (torch.optim.Adam)",
    "adamw": "AdamW, decoupled weight decay (torch.optim.AdamW)",
    "sgd": "SGD (torch.optim.SGD)",
    "lion": "Lion (Chen et al. 2023; decoupled weight decay)",
}


def _title(s):
    t = _RULE_TITLES[s.rule]
    if s.amsgrad:
        t += ", amsgrad"
    if s.rule == "sgd":
        t = ("SGD with Nesterov momentum (torch.optim.SGD, nesterov=True)" if s.nesterov
             else "SGD with momentum (torch.optim.SGD)" if s.momentum_buffer
             else "plain SGD, no momentum buffer (torch.optim.SGD, momentum=0)")
    return t


def _wrap(prefix, words, width=80):
    """Comment lines of at most ``width`` columns; continuation lines keep
    the prefix's indentation and comment marker, indented two more."""
    cont = prefix[:prefix.index("//") + 2] + "   "
    lines, cur = [], prefix
    for w in words:
        if len(cur) + len(w) + 1 > width and cur.strip() not in ("//", ""):
            lines.append(cur.rstrip())
            cur = cont
        cur += ("" if cur.endswith(" ") else " ") + w
    lines.append(cur.rstrip())
    return lines


def _header(s):
    L = [f"// {_title(s)}."]
    if s.call:
        L += _wrap("// Built by", s.call.split(" "))
    for n in s.notes:
        L += _wrap("//", n.split(" "))
    owned = ", ".join(f"{k} {d}" for k, d in s.states)
    L += _wrap("//", (f"Tensors: the user's param ({s.param}) and grad ({s.grad}) on "
                      f"{s.user_placement}; the optimizer's states"
                      + (f" ({owned}) on {s.state_placement}." if owned else
                         ": none.")).split(" "))
    where = {"cpu": "The update runs on the CPU (AVX-512/AVX2 kernels).",
             "gpu": f"The update runs on the GPU ({s.gpu_arch}).",
             "offload": "ZeRO-Offload: grads go to the CPU, the update runs "
                        "there, params come back to the GPU."}[s.placement]
    L += _wrap("//", where.split(" "))
    # Bytes per element the fused update moves.
    b = {"f32": 4, "bf16": 2, "f16": 2}
    if s.remainder:  # the master is the param (read, written) and its remainder
        rd = [("g", b[s.grad]), ("p+r", b[s.param] + 2)]
        wr = [("r", 2)]
    elif s.kahan:  # the param and its compensation, read and written
        rd = [("g", b[s.grad]), ("p+c", b[s.param] + 2)]
        wr = [("p+c", b[s.param] + 2)]
    else:
        rd = [("g", b[s.grad]), ("w" if s.master else "p", b[s.master or s.param])]
        wr = [("w" if s.master else "p", b[s.master or s.param])]
    short = {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vm",
             "momentum_buffer": "buf"}
    for k, d in s.states:
        if k == "master":
            continue
        # a q8 moment: a 1-byte code and its block's f32 absmax (NUMERICS §10)
        n = 1 + 4 / 256 if s.q8 and k in ("exp_avg", "exp_avg_sq") else b[d]
        rd.append((short[k], n))
        wr.append((short[k], n))
    if s.master:
        wr.append(("p", b[s.param]))
    fmt = lambda x: f"{x:g}" if x == int(x) else f"{x:.2f}"  # noqa: E731
    L.append(f"// Bytes per parameter and step: read {fmt(sum(x for _, x in rd))} "
             f"({', '.join(n for n, _ in rd)}), write {fmt(sum(x for _, x in wr))} "
             f"({', '.join(n for n, _ in wr)}).")
    return L


class _Body:
    def __init__(self, comments):
        self.lines = []
        self.comments = comments

    def comment(self, text):
        if self.comments:
            for ln in _wrap("  //", text.split(" ")):
                self.lines.append(ln)

    def op(self, code, note=None):
        if self.comments and note:
            self.lines.append(f"  {code}   // {note}")
        else:
            self.lines.append(f"  {code}")


def emit(s):
    """The MLIR text of a Spec (no validation: see resolve())."""
    B = _Body(s.comments)
    sd = s.state_dtypes
    rnd = dict(s.rounding)
    up, sp = s.user_placement, s.state_placement

    def decl(kind, dtype, on, note=None):
        r = f" rounding {rnd[kind]}" if kind in rnd else ""
        if kind == "master" and s.remainder:
            r += " remainder"
        if kind == "param" and s.kahan:
            r += " kahan"
        if kind in ("exp_avg", "exp_avg_sq") and s.q8:
            r += " q8"
        B.op(f"{_STATE_SSA[kind]} = zopt.state {kind} : {dtype} on {on}{r}", note)

    # --- states
    B.comment("The user's tensors (the grad is read-only) and the optimizer's "
              "states, each with its dtype and placement.")
    decl("param", s.param, up, "the rounded master, written by the step"
         if s.master else "the weight the update changes, with its Kahan "
         "compensation (a state of its own)" if s.kahan else
         "the weight the update changes")
    decl("grad", s.grad, up)
    if s.master:
        decl("master", s.master, sp, "the weight the update changes" + (
            ": its low half beside the param, exact" if s.remainder else ""))
    notes = {"exp_avg": "first moment m" if s.rule != "lion" else "momentum m",
             "exp_avg_sq": "second moment v",
             "max_exp_avg_sq": "running max of v (amsgrad)",
             "momentum_buffer": "momentum buffer"}
    for k, d in s.states:
        if k != "master":
            decl(k, d, sp, notes[k])
    # --- hyperparameters
    rule_key = "sgd_plain" if s.rule == "sgd" and not s.momentum_buffer else s.rule
    defaults = dict(s.hypers)
    B.comment("Hyperparameters: per-group runtime values (changing them never "
              "recompiles); a default applies when a group sets none.")
    for h in RULE_HYPERS[rule_key]:
        d = f" default {fmt_float(defaults[h])}" if h in defaults else ""
        B.op(f"{_HYPER_SSA[h]} = zopt.hyper {h}{d}")
    # --- gradient transformations
    G, GT = "%g", s.grad
    if s.loss_scale:
        B.comment("The gradients arrive multiplied by the loss scale S: divide by "
                  "it; any non-finite gradient skips the whole step (and the "
                  "dynamic scaler backs off).")
        B.op(f"%gs = zopt.unscale {G} : {GT}")
        G, GT = "%gs", "f32"
    if s.clip is not None:
        B.comment("Clip by the global norm of all gradients of all groups: g *= "
                  f"min(1, {fmt_float(s.clip)} / (norm + 1e-6)) "
                  "(torch.nn.utils.clip_grad_norm_).")
        B.op(f"%gc = zopt.clip_by_global_norm {G} max {fmt_float(s.clip)} : {GT}")
        G, GT = "%gc", "f32"
    W, WT = ("%w", s.master) if s.master else ("%p", s.param)
    NEW = "%w1" if s.master else "%p1"
    yields = []  # (value, state ssa, state dtype)
    if s.rule in ("adam", "adamw"):
        mt, vt = sd["exp_avg"], sd["exp_avg_sq"]
        dec = s.rule == "adamw"
        if s.style == "named":
            B.comment("The named rule zopt.adam (decomposed by the compiler into "
                      "the primitives ema, ema_sq, adam_direction, "
                      + ("decoupled_decay" if dec else "l2_decay") + ", apply).")
            attr = " {decoupled}" if dec else ""
            B.op(f"{NEW}, %m1, %v1 = zopt.adam {W}, {G}, %m, %v, %lr, %b1, %b2, "
                 f"%eps, %wd{attr} : {WT}, {GT}, {mt}, {vt}")
        else:
            if not dec:
                B.comment("L2 weight decay folded into the gradient: g += wd * w.")
                B.op(f"%gd = zopt.l2_decay {G}, {W}, %wd : {GT}, {WT}")
                G, GT = "%gd", "f32"
            B.comment("m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2.")
            B.op(f"%m1 = zopt.ema %m, {G}, %b1 : {mt}, {GT}")
            B.op(f"%v1 = zopt.ema_sq %v, {G}, %b2 : {vt}, {GT}")
            den = "%v1"
            if s.amsgrad:
                B.comment("amsgrad: the denominator uses the running max of v.")
                B.op(f"%vm1 = zopt.max %vm, %v1 : {sd['max_exp_avg_sq']}, f32")
                den = "%vm1"
            B.comment("u = (m/bc1) / (sqrt(v)/sqrt(bc2) + eps), bc = 1 - beta^t "
                      "when the group's bias_correction slot is set (the default).")
            B.op(f"%u = zopt.adam_direction %m1, {den}, %b1, %b2, %eps : f32, f32")
            if dec:
                B.comment("Decoupled weight decay, then the step: w = w*(1 - lr*wd) "
                          "- lr*u.")
                B.op(f"%wdec = zopt.decoupled_decay {W}, %lr, %wd : {WT}")
                B.op(f"{NEW} = zopt.apply %wdec, %u, %lr : f32, f32")
            else:
                B.comment("w = w - lr*u.")
                B.op(f"{NEW} = zopt.apply {W}, %u, %lr : {WT}, f32")
        yields += [(NEW, W, WT), ("%m1", "%m", mt), ("%v1", "%v", vt)]
        if s.amsgrad:
            yields.append(("%vm1", "%vm", sd["max_exp_avg_sq"]))
    elif s.rule == "sgd":
        B.comment("L2 weight decay folded into the gradient: g += wd * w.")
        B.op(f"%gd = zopt.l2_decay {G}, {W}, %wd : {GT}, {WT}")
        D = "%gd"
        if s.momentum_buffer:
            bt = sd["momentum_buffer"]
            B.comment("buf = g at the first step, then buf = mu*buf + "
                      "(1-dampening)*g.")
            B.op(f"%buf1 = zopt.momentum %buf, %gd, %mu, %damp : {bt}, f32")
            D = "%buf1"
            if s.nesterov:
                B.comment("Nesterov: d = g + mu*buf.")
                B.op("%d = zopt.nesterov %gd, %buf1, %mu : f32, f32")
                D = "%d"
        B.comment("w = w - lr*d.")
        B.op(f"{NEW} = zopt.apply {W}, {D}, %lr : {WT}, f32")
        yields.append((NEW, W, WT))
        if s.momentum_buffer:
            yields.append(("%buf1", "%buf", sd["momentum_buffer"]))
    else:  # lion
        mt = sd["exp_avg"]
        B.comment("The direction is the sign of an interpolation with beta1: "
                  "d = sign(b1*m + (1-b1)*g).")
        B.op(f"%c = zopt.ema %m, {G}, %b1 : {mt}, {GT}")
        B.op("%d = zopt.sign %c : f32")
        B.comment("Decoupled weight decay, then the step: w = w*(1 - lr*wd) - lr*d.")
        B.op(f"%wdec = zopt.decoupled_decay {W}, %lr, %wd : {WT}")
        B.op(f"{NEW} = zopt.apply %wdec, %d, %lr : f32, f32")
        B.comment("The momentum is updated with beta2: m = b2*m + (1-b2)*g.")
        B.op(f"%m1 = zopt.ema %m, {G}, %b2 : {mt}, {GT}")
        yields += [(NEW, W, WT), ("%m1", "%m", mt)]
    if s.master:
        yields.append((NEW, "%p", s.param))
    B.comment("Store every new value into its state"
              + (" (the param is the rounded master)." if s.master else "."))
    vals = ", ".join(v for v, _, _ in yields)
    sts = ", ".join(t for _, t, _ in yields)
    vts = ", ".join("f32" for _ in yields)
    sdt = ", ".join(d for _, _, d in yields)
    B.op(f"zopt.yield {vals} into {sts} : {vts} into {sdt}")

    attrs = []
    if s.zero_stage is not None:
        attrs.append(f"zero_stage = {int(s.zero_stage)} : i64")
    if s.align is not None:
        attrs.append(f"align = {int(s.align)} : i64")
    if s.gpu_arch is not None:
        attrs.append(f'gpu_arch = "{s.gpu_arch}"')
    attr = " attributes {" + ", ".join(attrs) + "}" if attrs else ""
    out = _header(s) if s.comments else []
    out.append(f"zopt.step @{s.name}{attr} {{")
    out += B.lines
    out.append("}")
    return "\n".join(out) + "\n"

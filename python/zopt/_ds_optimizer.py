"""DeepSpeed config import, the ``optimizer`` section: ``type`` (Adam,
AdamW, Lion, SGD) -> the zopt.steps rule, ``params`` -> the description's
hyperparameter defaults (``defaults["hypers"]``) and the rule's own options
(amsgrad; SGD's momentum and nesterov), every other optimizer field honoured
or refused. Below zopt.deepspeed, over _ds_fields."""
from __future__ import annotations

from ._ds_fields import DeepSpeedConfigError, _bool, _no_auto, _num


SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Lion", "SGD")


def _optimizer(opt, W, st):
    """optimizer section -> builder rule and kwargs; fills st."""
    path = "optimizer"
    W.section(opt, path, {"type": "", "params": "", "legacy_fusion": ""})
    if "legacy_fusion" in opt:
        if _bool(opt["legacy_fusion"], "optimizer.legacy_fusion"):
            raise DeepSpeedConfigError("optimizer.legacy_fusion",
                                       "DeepSpeed's legacy fused fp16 optimizer path; "
                                       "allowed: false")
        W.use("optimizer.legacy_fusion", "no effect on the step (false)")
    if "type" not in opt:
        raise DeepSpeedConfigError("optimizer.type", "missing; supported: "
                                   + ", ".join(SUPPORTED_OPTIMIZERS))
    t = _no_auto(opt["type"], "optimizer.type")
    if not isinstance(t, str):
        raise DeepSpeedConfigError("optimizer.type", f"must be a string, got {t!r}")
    # DeepSpeed lower-cases its own optimizers' names; torch's (SGD) are
    # looked up in torch.optim by their exact name.
    kind = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion"}.get(t.lower())
    if kind is None and t == "SGD":
        kind = "SGD"
    if kind is None:
        hint = " (DeepSpeed looks torch optimizers up by their exact name: 'SGD')" \
            if t.lower() == "sgd" else ""
        raise DeepSpeedConfigError("optimizer.type", f"{t!r} is not supported{hint}; "
                                   "supported: " + ", ".join(SUPPORTED_OPTIMIZERS))
    W.use("optimizer.type", f"honoured: {kind}")
    params = opt.get("params", {})
    if params is None:
        params = {}
    pp = "optimizer.params"
    hy = {}
    if kind in ("Adam", "AdamW"):
        known = dict.fromkeys(["lr", "betas", "eps", "weight_decay", "bias_correction",
                               "adam_w_mode", "torch_adam", "amsgrad", "foreach",
                               "fused", "capturable", "differentiable", "maximize",
                               "set_grad_none", "max_grad_norm"])
    elif kind == "Lion":
        known = dict.fromkeys(["lr", "betas", "weight_decay", "set_grad_none",
                               "max_grad_norm"])
    else:
        known = dict.fromkeys(["lr", "momentum", "dampening", "weight_decay", "nesterov",
                               "maximize", "foreach", "differentiable", "fused",
                               "max_grad_norm"])
    W.section(params, pp, known)
    if "max_grad_norm" in params:
        raise DeepSpeedConfigError(f"{pp}.max_grad_norm", "DeepSpeed refuses it as an "
                                   "optimizer parameter: use the top-level "
                                   "gradient_clipping")
    if "maximize" in params:
        # torch.optim's maximize: a runtime group flag (the gradient's sign)
        hy["maximize"] = _bool(params["maximize"], f"{pp}.maximize")
        W.use(f"{pp}.maximize", f"honoured: defaults['hypers']['maximize'] = "
              f"{hy['maximize']} (zopt.Optimizer(maximize=...), a runtime group flag)")
    for k in ("foreach", "fused", "capturable", "differentiable", "set_grad_none"):
        if k in params:
            _bool(params[k], f"{pp}.{k}")
            W.use(f"{pp}.{k}", "no effect on the step (an implementation choice of "
                  "the DeepSpeed/torch optimizer)")
    if "lr" in params:
        hy["lr"] = _num(params["lr"], f"{pp}.lr", lo=0.0)
        W.use(f"{pp}.lr", f"honoured: lr default {hy['lr']!r}")
    if "betas" in params:
        b = _no_auto(params["betas"], f"{pp}.betas")
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise DeepSpeedConfigError(f"{pp}.betas", f"must be a pair [beta1, beta2], got {b!r}")
        hy["betas"] = (_num(b[0], f"{pp}.betas[0]", lo=0.0, hi=1.0),
                       _num(b[1], f"{pp}.betas[1]", lo=0.0, hi=1.0))
        for i in (0, 1):
            if hy["betas"][i] >= 1.0:
                raise DeepSpeedConfigError(f"{pp}.betas[{i}]", "must be below 1")
        W.use(f"{pp}.betas", f"honoured: betas default {hy['betas']!r}")
    if "eps" in params:
        hy["eps"] = _num(params["eps"], f"{pp}.eps", lo=0.0, lo_open=True)
        W.use(f"{pp}.eps", f"honoured: eps default {hy['eps']!r}")
    if "weight_decay" in params:
        hy["weight_decay"] = _num(params["weight_decay"], f"{pp}.weight_decay", lo=0.0)
        W.use(f"{pp}.weight_decay", f"honoured: weight_decay default {hy['weight_decay']!r}")
    kw = {}
    if kind in ("Adam", "AdamW"):
        torch_adam = _bool(params.get("torch_adam", False), f"{pp}.torch_adam")
        w_mode = _bool(params.get("adam_w_mode", True), f"{pp}.adam_w_mode")
        decoupled = kind == "AdamW" or w_mode
        rule = "adamw" if decoupled else "adam"
        if "adam_w_mode" in params:
            W.use(f"{pp}.adam_w_mode", f"honoured: {'decoupled (AdamW)' if decoupled else 'L2 (Adam)'} weight decay")
        if "torch_adam" in params:
            W.use(f"{pp}.torch_adam", "honoured: the same rule as DeepSpeed's fused "
                  "Adam" + ("; torch.optim.AdamW's default weight_decay 0.01 applies"
                            if torch_adam and decoupled else ""))
        if decoupled and "weight_decay" not in hy:
            # torch.optim.AdamW's default with torch_adam; DeepSpeed's fused
            # Adam's (0) otherwise: explicit, since zopt.steps.adamw()
            # defaults to torch's
            hy["weight_decay"] = 0.01 if torch_adam else 0.0
        if "bias_correction" in params:
            bc = _bool(params["bias_correction"], f"{pp}.bias_correction")
            if torch_adam:
                raise DeepSpeedConfigError(f"{pp}.bias_correction", "torch.optim.Adam(W) "
                                           "has no bias_correction parameter (torch_adam: "
                                           "true): DeepSpeed would fail")
            hy["bias_correction"] = bc
            W.use(f"{pp}.bias_correction", f"honoured: bias_correction {bc} (a per-group "
                  "runtime value: defaults['hypers'])")
        amsgrad = _bool(params.get("amsgrad", False), f"{pp}.amsgrad")
        if amsgrad and not torch_adam:
            raise DeepSpeedConfigError(f"{pp}.amsgrad", "DeepSpeed's fused Adam refuses "
                                       "amsgrad and its CPU Adam ignores it; only "
                                       "torch_adam: true runs amsgrad (zopt honours that)")
        if "amsgrad" in params:
            W.use(f"{pp}.amsgrad", f"honoured: amsgrad {amsgrad}")
        kw["amsgrad"] = amsgrad
        st["title"] = f"{kind} ({'torch' if torch_adam else 'DeepSpeed fused/CPU'} Adam, " \
                      f"{'adam_w_mode' if decoupled else 'L2 weight decay'})"
    elif kind == "Lion":
        rule = "lion"
        hy.setdefault("betas", (0.9, 0.999))   # DeepSpeed's FusedLion/CPU Lion default
        st["title"] = "Lion (DeepSpeed FusedLion / CPU Lion)"
    else:
        rule = "sgd"
        mom = params.get("momentum", 0.0)
        mom = _num(mom, f"{pp}.momentum", lo=0.0, hi=1.0)
        damp = _num(params.get("dampening", 0.0), f"{pp}.dampening", lo=0.0, hi=1.0)
        nest = _bool(params.get("nesterov", False), f"{pp}.nesterov")
        if nest and (mom <= 0 or damp != 0):
            raise DeepSpeedConfigError(f"{pp}.nesterov", "Nesterov momentum requires a "
                                       "momentum and zero dampening (torch.optim.SGD)")
        kw["momentum"] = mom
        kw["nesterov"] = nest
        if mom > 0:
            hy["momentum"] = mom
            if "dampening" in params:
                hy["dampening"] = damp
        elif "dampening" in params:
            W.use(f"{pp}.dampening", "no effect: plain SGD (momentum 0) has no buffer")
        for k in ("momentum", "nesterov"):
            if k in params:
                W.use(f"{pp}.{k}", f"honoured: {k} {params[k]!r}")
        if "dampening" in params and mom > 0:
            W.use(f"{pp}.dampening", f"honoured: dampening default {damp!r}")
        if "lr" not in hy:
            st["notes"].append("optimizer.params.lr: not given (torch.optim.SGD "
                               "requires it in torch 1.x); the runtime's default "
                               "lr 0.001 applies")
        st["title"] = "SGD (torch.optim.SGD)"
    st["hypers"] = hy
    return rule, kw

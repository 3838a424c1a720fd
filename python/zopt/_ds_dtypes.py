"""DeepSpeed config import, the dtypes: ``fp16``, ``bf16`` (or its old name
``bfloat16``) and ``data_types.grad_accum_dtype`` -> the param, gradient,
master and moment dtypes of the step and its loss scaling
(``defaults["loss_scaler"]``), with the notes on DeepSpeed's versions (its
gradient accumulation dtype's default, BF16_Optimizer). Below
zopt.deepspeed, over _ds_fields."""
from __future__ import annotations

from ._ds_fields import DeepSpeedConfigError, _bool, _num, _str


def _dtypes(cfg, W, stage, st):
    """fp16 / bf16 / data_types -> param dtype, master, moments, loss scaling."""
    fp16 = cfg.get("fp16") or {}
    bf16_key = "bf16" if "bf16" in cfg else ("bfloat16" if "bfloat16" in cfg else "bf16")
    bf16 = cfg.get(bf16_key) or {}
    W.section(fp16, "fp16", dict.fromkeys([
        "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
        "hysteresis", "consecutive_hysteresis", "min_loss_scale",
        "fp16_master_weights_and_grads"]))
    W.section(bf16, bf16_key, dict.fromkeys([
        "enabled", "immediate_grad_update", "check_grad_overflow", "check_overflow",
        "bf16_master_weights_and_grads", "bf16_optimizer_states"]))
    fp16_on = _bool(fp16.get("enabled", False), "fp16.enabled")
    bf16_on = _bool(bf16.get("enabled", False), f"{bf16_key}.enabled")
    if fp16_on and bf16_on:
        raise DeepSpeedConfigError(f"{bf16_key}.enabled", "fp16 and bf16 cannot both be "
                                   "enabled (DeepSpeed refuses it too)")
    mwg = bos = False
    if bf16_on:
        mwg = _bool(bf16.get("bf16_master_weights_and_grads", False),
                    f"{bf16_key}.bf16_master_weights_and_grads")
        bos = _bool(bf16.get("bf16_optimizer_states", False),
                    f"{bf16_key}.bf16_optimizer_states")
        if (mwg or bos) and stage == 0:
            f = "bf16_optimizer_states" if bos and not mwg else "bf16_master_weights_and_grads"
            raise DeepSpeedConfigError(f"{bf16_key}.{f}", "DeepSpeed supports it with "
                                       "ZeRO stage 1, 2 or 3 only (zero_optimization.stage "
                                       "is 0)")
        if bos and not mwg:
            raise DeepSpeedConfigError(
                f"{bf16_key}.bf16_optimizer_states", "DeepSpeed requires "
                "bf16_master_weights_and_grads with it (bf16 states under an fp32 "
                "master are a zopt layout DeepSpeed cannot configure: "
                "zopt.steps.adamw(param='bf16', master='f32', moments='bf16'))")
    dt = cfg.get("data_types") or {}
    W.section(dt, "data_types", {"grad_accum_dtype": ""})
    acc = None
    if "grad_accum_dtype" in dt and dt["grad_accum_dtype"] is not None:
        acc = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}[
            _str(dt["grad_accum_dtype"], "data_types.grad_accum_dtype",
                 ("fp32", "fp16", "bf16"))]
    model = "f16" if fp16_on else ("bf16" if bf16_on else "f32")
    # DeepSpeed's engine (get_data_types, v0.17.6 and later): gradients
    # accumulate in data_types.grad_accum_dtype, by default the model's
    # dtype. (v0.7.7 to v0.17.5 defaulted to fp32 for bf16 without ZeRO.)
    grad = model if acc is None else acc
    if acc is None and model == "bf16" and stage == 0:
        st["notes"].append(
            "data_types.grad_accum_dtype: not given, so bf16 gradients accumulate in "
            "bf16 (DeepSpeed's default since v0.17.6: the model's dtype). DeepSpeed "
            "v0.7.7 to v0.17.5 accumulated them in fp32 without ZeRO (BF16_Optimizer): "
            "give \"data_types\": {\"grad_accum_dtype\": \"fp32\"} for that "
            "(zopt's f32-gradient layout)")
    f32_grads = False
    if grad != model:
        if grad == "f32" and model in ("bf16", "f16"):
            if mwg:
                raise DeepSpeedConfigError(
                    f"{bf16_key}.bf16_master_weights_and_grads", "keeps the gradients in "
                    "bf16, and data_types.grad_accum_dtype 'fp32' asks for fp32 "
                    "gradients: give one of them")
            f32_grads = True
            st["notes"].append(
                "data_types.grad_accum_dtype fp32: the step reads f32 gradients of the "
                f"{model} params; zopt.Optimizer takes each one from p.main_grad, "
                "accumulating p.grad into it in f32 after every backward (its hooks, "
                "as DeepSpeed's) unless a framework provides p.main_grad (docs/USAGE.md)")
            if stage == 0:
                st["notes"].append(
                    "data_types.grad_accum_dtype fp32 without ZeRO: DeepSpeed v0.7.7 to "
                    "v0.18.4 ran it with BF16_Optimizer; v0.18.5 and later refuse it "
                    "(NotImplementedError); zopt runs it")
        else:
            allowed = ", ".join(repr(x) for x in (
                [{"f32": "fp32", "bf16": "bf16", "f16": "fp16"}[model]]
                + (["fp32"] if model != "f32" else [])))
            raise DeepSpeedConfigError(
                "data_types.grad_accum_dtype",
                f"{grad} gradient accumulation with {model} params is not supported: "
                "gradients have the param's dtype, or are f32 for bf16/fp16 params "
                f"(docs/Dialects/Zopt.md rule 7); allowed here: {allowed}")
    if "grad_accum_dtype" in dt:
        W.use("data_types.grad_accum_dtype", f"honoured: {grad} gradients" + (
            " (accumulated in f32 into p.main_grad)" if f32_grads else ""))
    kw = dict(param=model)
    if f32_grads:
        kw["grad"] = "f32"
    # ---- fp16
    for k in ("enabled",):
        if k in fp16:
            W.use(f"fp16.{k}", f"honoured: fp16 {'on' if fp16_on else 'off'}")
    scaler = None
    if fp16_on:
        if _bool(fp16.get("fp16_master_weights_and_grads", False),
                 "fp16.fp16_master_weights_and_grads"):
            raise DeepSpeedConfigError("fp16.fp16_master_weights_and_grads",
                                       "an f16 master is refused by the dialect (rule 9: "
                                       "it cannot hold small updates to large weights); "
                                       "allowed: false")
        if "auto_cast" in fp16:
            _bool(fp16["auto_cast"], "fp16.auto_cast")
            W.use("fp16.auto_cast", "no effect on the step (casts the model's inputs)")
        ls = _num(fp16.get("loss_scale", 0), "fp16.loss_scale", lo=0.0)
        power = _num(fp16.get("initial_scale_power", 16), "fp16.initial_scale_power",
                     lo=0, hi=126, integer=True)
        window = _num(fp16.get("loss_scale_window", 1000), "fp16.loss_scale_window",
                      lo=1, integer=True)
        hyst = _num(fp16.get("hysteresis", 2), "fp16.hysteresis", lo=1, integer=True)
        consec = _bool(fp16.get("consecutive_hysteresis", False),
                       "fp16.consecutive_hysteresis")
        min_ls = _num(fp16.get("min_loss_scale", 1), "fp16.min_loss_scale", lo=0.0,
                      lo_open=True)
        dynamic = ls == 0
        if dynamic and "hysteresis" in fp16 and hyst != 1:
            raise DeepSpeedConfigError(
                "fp16.hysteresis", f"{hyst}: zopt's dynamic loss scaler backs off at "
                "every overflow (hysteresis 1); it has no delayed back-off. Set "
                "\"hysteresis\": 1 to accept that")
        if dynamic and "hysteresis" not in fp16:
            st["notes"].append("fp16.hysteresis: not given; DeepSpeed's default 2 "
                               "(tolerate one overflow before backing off) is not "
                               "reproduced: zopt backs off at every overflow")
        if consec and hyst != 1:
            raise DeepSpeedConfigError("fp16.consecutive_hysteresis",
                                       "needs a hysteresis, which zopt's scaler does not have")
        if dynamic:
            scaler = dict(init_scale=float(2 ** power), growth_factor=2.0,
                          backoff_factor=0.5, growth_interval=window,
                          min_scale=min_ls, dynamic=True)
        else:
            scaler = dict(init_scale=ls, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=window, min_scale=min_ls, dynamic=False)
        desc = "dynamic" if dynamic else f"static {ls!r}"
        for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                  "hysteresis", "consecutive_hysteresis", "min_loss_scale"):
            if k in fp16:
                used = dynamic or k in ("loss_scale",)
                W.use(f"fp16.{k}", f"honoured: loss scaler ({desc}) in "
                      "defaults['loss_scaler']" if used else
                      "no effect: the loss scale is static")
        if "fp16_master_weights_and_grads" in fp16:
            W.use("fp16.fp16_master_weights_and_grads", "honoured: f32 master (false)")
        kw.update(master="f32", moments="f32", loss_scale=True)
    else:
        for k in fp16:
            if k != "enabled":
                W.use(f"fp16.{k}", "no effect: fp16 is off")
    # ---- bf16
    if "enabled" in bf16:
        W.use(f"{bf16_key}.enabled", f"honoured: bf16 {'on' if bf16_on else 'off'}")
    if bf16_on:
        chk_key = "check_grad_overflow" if "check_grad_overflow" in bf16 else "check_overflow"
        chk = _bool(bf16.get(chk_key, False), f"{bf16_key}.{chk_key}")
        if "immediate_grad_update" in bf16:
            _bool(bf16["immediate_grad_update"], f"{bf16_key}.immediate_grad_update")
            W.use(f"{bf16_key}.immediate_grad_update", "no effect on the step (when "
                  "the engine accumulates gradients)")
        if chk_key in bf16:
            W.use(f"{bf16_key}.{chk_key}", "honoured: " + (
                "non-finite gradients skip the step (zopt.unscale with a static "
                "scale of 1)" if chk else "no overflow check"))
        for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if k in bf16:
                W.use(f"{bf16_key}.{k}", f"honoured: {k} {bf16[k]}")
        kw["master"] = None if mwg else "f32"
        st["bf16_master"] = mwg
        kw["moments"] = "bf16" if bos else "f32"
        if chk:
            kw["loss_scale"] = True
            scaler = dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=1000, min_scale=1.0, dynamic=False)
    else:
        for k in bf16:
            if k != "enabled":
                W.use(f"{bf16_key}.{k}", "no effect: bf16 is off")
    st["loss_scaler"] = scaler
    return kw

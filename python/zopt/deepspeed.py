"""DeepSpeed config import: a ``ds_config.json`` -> a zopt step description.

(This module: the top level of the config, the batch sizes, where the
step runs, the step's assembly and the command line. Each section's
fields, with their refusal texts and version notes, are a package-private
module's under it: _ds_optimizer, _ds_dtypes (fp16 / bf16 / data_types),
_ds_zero, _ds_schedule (also lr_at, torch_scheduler), all over _ds_fields
(DeepSpeedConfigError, the field bookkeeping, the value checks). It imports
zopt.steps; nothing in zopt imports it.)

    import zopt
    text, defaults = zopt.deepspeed.from_config("ds_config.json")
    step = zopt.steps.load_text(text)                    # compiled, cached
    opt = zopt.Optimizer(step, model.parameters(), **zopt.deepspeed.optimizer_kwargs(defaults))

or from the shell: ``zopt-import-deepspeed ds_config.json -o step.mlir
[--defaults defaults.json]`` (``python3 -m zopt.deepspeed``).

Every field of the config is either honoured or refused: a refusal raises
:class:`DeepSpeedConfigError` (a ``ZoptError``) whose ``field`` is the
dotted path of the field (``"zero_optimization.offload_optimizer.device"``)
and whose message says why and what is supported; an unknown field is
refused with the list of the fields its section supports.
``defaults["fields"]`` tells, for every field the config gave, how it was
used.

What maps to what (the table in python/README.md has the details):

``optimizer``
    ``type`` Adam / AdamW (DeepSpeed's ``adam_w_mode``, default true, makes
    "Adam" AdamW; ``torch_adam`` picks torch's implementation, which for
    AdamW defaults weight_decay to 0.01), Lion, SGD (torch.optim.SGD);
    ``params`` lr, betas, eps, weight_decay, bias_correction, amsgrad,
    momentum, dampening, nesterov become the description's
    ``zopt.hyper ... default`` values (and ``defaults["hypers"]``).
``fp16`` / ``bf16`` / ``data_types.grad_accum_dtype``
    the dtypes: fp16 -> f16 params and grads, an f32 master and states,
    loss scaling (``defaults["loss_scaler"]``: ``loss_scale`` 0 is dynamic
    from ``2**initial_scale_power``, grown x2 every ``loss_scale_window``
    good steps, halved on an overflow down to ``min_loss_scale``; a
    non-zero ``loss_scale`` is static); bf16 -> bf16 params and grads, an
    f32 master and f32 states, or with ``bf16_master_weights_and_grads`` the
    bf16 param as the master, and with ``bf16_optimizer_states`` bf16
    moments. ``data_types.grad_accum_dtype`` "fp32" with bf16 (or fp16)
    gives f32 gradients (``grad="f32"``: zopt.Optimizer accumulates each
    micro-batch's gradient into ``p.main_grad`` in f32). Without
    ``grad_accum_dtype`` the gradients have the model's dtype: DeepSpeed's
    default since v0.17.6 (engine.get_data_types; v0.7.7 to v0.17.5
    accumulated bf16 gradients in fp32 without ZeRO, a note says so).
``gradient_clipping``
    ``zopt.clip_by_global_norm`` (0: off).
``zero_optimization``
    ``stage`` -> ``zero_stage``; ``offload_optimizer.device`` cpu ->
    placement "offload" (params and grads on the GPU, states and update on
    the CPU), none -> "gpu", nvme refused (on a CUDA device; on the CPU,
    placement "cpu": see :func:`from_config`, ``device``); ``reduce_bucket_size`` ->
    ``defaults["bucket_elems"]``; the engine's other knobs have no effect
    on the step and are listed as such.
``gradient_accumulation_steps`` / ``train_batch_size`` / ``train_micro_batch_size_per_gpu``
    ``defaults["gradient_accumulation_steps"]`` A and
    ``defaults["grad_divisor"]`` = world_size * A (DeepSpeed divides each
    micro-batch's loss by A; with zopt either do the same or sum the
    gradients and set the divisor).
``scheduler``
    WarmupLR, WarmupDecayLR, WarmupCosineLR -> ``defaults["scheduler"]``, an
    equivalent ``torch.optim.lr_scheduler.LambdaLR`` (:func:`torch_scheduler`)
    or, without torch, :func:`lr_at`; OneCycle and LRRangeTest are refused.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from . import compiler as _compiler, steps as _steps
from ._ds_fields import DeepSpeedConfigError, _bool, _no_auto, _num, _Walker
from ._ds_dtypes import _dtypes
from ._ds_optimizer import SUPPORTED_OPTIMIZERS, _optimizer  # noqa: F401 (public)
from ._ds_schedule import (SUPPORTED_SCHEDULERS, _scheduler, lr_at,  # noqa: F401 (public)
                           torch_scheduler)
from ._ds_zero import _zero
from ._lib import Status, ZoptError


# Fields that configure DeepSpeed's engine outside the optimizer step:
# accepted, listed in defaults["fields"] as having no effect on the step.
_TOP_NO_EFFECT = {
    "steps_per_print": "logging",
    "wall_clock_breakdown": "profiling",
    "memory_breakdown": "profiling",
    "dump_state": "logging",
    "tensorboard": "monitoring",
    "wandb": "monitoring",
    "csv_monitor": "monitoring",
    "comet": "monitoring",
    "comms_logger": "logging",
    "flops_profiler": "profiling",
    "activation_checkpointing": "the model's forward/backward",
    "checkpoint": "DeepSpeed's checkpoint files (zopt's optimizer checkpoints "
                  "are its own: docs/CHECKPOINT.md)",
    "dataloader_drop_last": "the data loader",
    "aio": "asynchronous I/O of NVMe offload (device nvme is refused)",
    "zero_allow_untested_optimizer": "every zopt rule is supported under ZeRO",
    "zero_force_ds_cpu_optimizer": "zopt's own CPU kernels run offloaded steps",
    "torch_autocast": "the model's forward/backward (the step sees the params' "
                      "and grads' dtypes)",
}


# ---------------------------------------------------------------------------
# The import
# ---------------------------------------------------------------------------

def load_config(ds_config):
    """A config dict from a dict, a JSON file path or JSON text."""
    if isinstance(ds_config, dict):
        return ds_config
    if isinstance(ds_config, (str, os.PathLike)):
        s = os.fspath(ds_config)
        if s.lstrip().startswith("{"):
            src, text = "<text>", s
        else:
            try:
                with open(s) as f:
                    text = f.read()
            except OSError as e:
                raise ZoptError(Status.IO, f"cannot read DeepSpeed config {s}: {e}") from None
            src = s
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{src}: not JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise DeepSpeedConfigError("<config>", "must be a JSON object")
        return cfg
    raise DeepSpeedConfigError("<config>", "must be a JSON object (a dict), a path or "
                               f"JSON text, got {type(ds_config).__name__}")


def _batch(cfg, W, world_size, st):
    A = None
    if "gradient_accumulation_steps" in cfg:
        A = _num(cfg["gradient_accumulation_steps"], "gradient_accumulation_steps",
                 lo=1, integer=True)
    tb = cfg.get("train_batch_size")
    mb = cfg.get("train_micro_batch_size_per_gpu")
    if tb is not None:
        tb = _num(tb, "train_batch_size", lo=1, integer=True)
    if mb is not None:
        mb = _num(mb, "train_micro_batch_size_per_gpu", lo=1, integer=True)
    if A is None and tb is not None and mb is not None:
        if world_size:
            if tb % (mb * world_size):
                raise DeepSpeedConfigError("train_batch_size", f"{tb} is not a multiple "
                                           f"of train_micro_batch_size_per_gpu ({mb}) x "
                                           f"world size ({world_size})")
            A = tb // (mb * world_size)
            st["notes"].append(f"gradient_accumulation_steps: {A}, derived from "
                               "train_batch_size / (micro batch x world size)")
        else:
            st["notes"].append("gradient_accumulation_steps: not given; DeepSpeed derives "
                               "it from train_batch_size / (micro batch x world size): pass "
                               "world_size to get it (taken as 1 here)")
    if A is not None and tb is not None and mb is not None and world_size and \
            tb != A * mb * world_size:
        raise DeepSpeedConfigError("train_batch_size", f"{tb} != micro batch {mb} x "
                                   f"accumulation {A} x world size {world_size}")
    A = A or 1
    if "gradient_accumulation_steps" in cfg:
        W.use("gradient_accumulation_steps", f"honoured: defaults['grad_divisor'] = "
              f"world size x {A}")
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if k in cfg:
            W.use(k, "no effect on the step (the data loader's); checked against "
                  "gradient_accumulation_steps")
    st["gas"] = A
    st["grad_divisor"] = (world_size * A) if world_size else None
    if A > 1:
        st["notes"].append(
            f"gradient_accumulation_steps {A}: DeepSpeed divides each micro-batch's "
            f"loss by {A}. With zopt, either divide the loss by {A} too, or sum the "
            f"micro-batch gradients and set the gradient divisor to world_size x {A} "
            f"(defaults['grad_divisor'], zopt_optimizer_set_grad_divisor)")


def _cuda_present():
    """(CUDA device here?, how that was found)."""
    try:
        import torch
    except Exception:
        torch = None
    if torch is not None:
        ok = bool(torch.cuda.is_available())
        return ok, f"torch.cuda.is_available() is {ok}"
    import ctypes
    try:
        cu = ctypes.CDLL(os.environ.get("ZOPT_CUDA_DRIVER") or "libcuda.so.1")
        n = ctypes.c_int(0)
        ok = cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except (OSError, AttributeError):
        return False, "no CUDA driver (libcuda.so.1)"
    return ok, f"the CUDA driver reports {n.value} device(s)"


def _params_device(params):
    """'cuda' or 'cpu': where the given params (tensors, or param group
    dicts) live; refused if they are on both."""
    kinds = set()
    for p in params:
        ps = p.get("params", []) if isinstance(p, dict) else [p]
        if hasattr(ps, "device"):
            ps = [ps]
        for t in ps:
            dev = getattr(t, "device", None)
            if dev is None:  # numpy arrays, (param, grad) pairs: host memory
                t = t[0] if isinstance(t, (tuple, list)) and t else t
                dev = getattr(t, "device", None)
            kinds.add("cuda" if dev is not None and dev.type == "cuda" else "cpu")
    if len(kinds) > 1:
        raise ZoptError(Status.INVALID_ARGUMENT, "params: some are CUDA tensors and some are "
                        "not; one optimizer's params share one placement (give device=)")
    return kinds.pop() if kinds else None


def resolve_device(device=None, params=None):
    """(device, why): where the step of an imported config runs. ``device``
    "cuda" or "cpu" as given; else the device of ``params`` when given;
    else this machine's: "cuda" when it has a CUDA device, "cpu" otherwise
    (DeepSpeed itself picks its CPU accelerator on a machine without CUDA)."""
    if device is not None:
        if device not in ("cuda", "cpu"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"device: {device!r}; allowed: 'cuda', 'cpu', None (automatic)")
        return device, f"device={device!r} given"
    if params is not None:
        dev = _params_device(params)
        if dev is not None:
            return dev, ("the params are CUDA tensors" if dev == "cuda"
                         else "the params are on the CPU")
    ok, how = _cuda_present()
    if ok:
        return "cuda", f"no params given; this machine has CUDA ({how})"
    return "cpu", (f"no params given and this machine has no CUDA device ({how}), as "
                   "DeepSpeed falls back to its CPU accelerator")


def from_config(ds_config, *, world_size=None, gpu_arch=None, device=None, params=None,
                name=None, optimizer=None, comments=True):
    """A DeepSpeed config (dict, JSON file path or JSON text) -> ``(text,
    defaults)``: the zopt step description, and what to apply at runtime.

    ``world_size``: the data-parallel world size, for the gradient divisor
    and to derive gradient_accumulation_steps from the batch sizes.
    Where the step runs (``defaults["device"]``, and why in
    ``defaults["notes"]``): ``device`` "cuda" (DeepSpeed's on a GPU: params
    on the GPU, the update on the GPU or, with offload_optimizer, on the
    CPU) or "cpu" (everything on the CPU: DeepSpeed's CPU accelerator, or a
    config tried on a CPU machine); by default the device of ``params``
    (the model's params or param groups, e.g. ``model.parameters()``) when
    given, else this machine's (CUDA if it has a CUDA device, else CPU).
    ``gpu_arch``: the CUDA architecture (default sm_90). ``optimizer``: an
    ``optimizer`` section to use when the config has none (DeepSpeed then
    uses the client's torch optimizer, which a config cannot name).

    ``defaults`` holds: ``hypers`` (zopt.Optimizer keyword arguments: lr,
    betas, eps, weight_decay, momentum, dampening, bias_correction),
    ``loss_scaler`` (zopt.Optimizer(loss_scaler=...) or None),
    ``gradient_accumulation_steps``, ``grad_divisor`` (world_size x
    accumulation, None without world_size), ``bucket_elems`` (or None),
    ``scheduler`` (or None), ``device`` ("cuda" or "cpu", as above),
    ``step`` (the equivalent zopt.steps call: ``{"rule": ..., **kwargs}``),
    ``fields`` ({dotted path: how it was used}) and ``notes``. Raises
    DeepSpeedConfigError naming the field it refuses.
    """
    cfg = load_config(ds_config)
    W = _Walker()
    known = {"optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping",
             "zero_optimization", "gradient_accumulation_steps", "train_batch_size",
             "train_micro_batch_size_per_gpu", "data_types", "prescale_gradients",
             "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
             "amp"} | set(_TOP_NO_EFFECT)
    W.section(cfg, "", dict.fromkeys(known))
    if "bf16" in cfg and "bfloat16" in cfg:
        raise DeepSpeedConfigError("bfloat16", "give bf16 once ('bfloat16' is its old name)")
    device, device_why = resolve_device(device, params)
    st = {"notes": [f"device: {device!r} ({device_why})"]}
    for k, why in _TOP_NO_EFFECT.items():
        if k in cfg:
            W.use(k, f"no effect on the step ({why})")
    # Top-level fields that must keep DeepSpeed's default.
    for k, dflt, why in (
            ("prescale_gradients", False, "zopt applies the gradient divisor in the "
             "update, after the reduction"),
            ("gradient_predivide_factor", 1.0, "zopt applies the gradient divisor in the "
             "update, after the reduction"),
            ("communication_data_type", None, "zopt's communicators reduce gradients in "
             "their own dtype (docs/COMM.md)"),
            ("sparse_gradients", False, "sparse embedding gradients are not supported")):
        if k in cfg:
            v = _no_auto(cfg[k], k)
            if v != dflt:
                raise DeepSpeedConfigError(k, f"{v!r}: {why}; allowed: {json.dumps(dflt)}")
            W.use(k, f"honoured: {json.dumps(dflt)} (the default)")
    if "amp" in cfg:
        amp = cfg["amp"] or {}
        if not isinstance(amp, dict):
            raise DeepSpeedConfigError("amp", f"must be a JSON object, got {amp!r}")
        W.section(amp, "amp", {k: "" for k in amp})  # apex arguments, if disabled
        if _bool(amp.get("enabled", False), "amp.enabled"):
            raise DeepSpeedConfigError("amp.enabled", "NVIDIA apex AMP is not supported: "
                                       "use fp16 or bf16")
        W.use("amp", "honoured: apex AMP off")
    # ZeRO first: the bf16 gradient dtype depends on the stage.
    stage, offload = _zero(cfg, W, st)
    if "optimizer" not in cfg or cfg["optimizer"] is None:
        if optimizer is None:
            raise DeepSpeedConfigError(
                "optimizer", "the config names no optimizer (DeepSpeed then uses the "
                "client's torch optimizer, which a config cannot say): add an "
                "optimizer section, pass optimizer={'type': ..., 'params': ...}, or "
                "build the step with zopt.steps")
        rule, okw = _optimizer(optimizer, W, st)
        st["notes"].append("optimizer: from the optimizer= argument (the config has none)")
    else:
        rule, okw = _optimizer(cfg["optimizer"], W, st)
    dkw = _dtypes(cfg, W, stage, st)
    clip = None
    if "gradient_clipping" in cfg:
        c = _num(cfg["gradient_clipping"], "gradient_clipping", lo=0.0)
        clip = c if c > 0 else None
        W.use("gradient_clipping", f"honoured: clip_by_global_norm max {c!r}" if clip
              else "honoured: no clipping (0)")
    _batch(cfg, W, world_size, st)
    st["scheduler"] = None
    if cfg.get("scheduler") is not None:
        _scheduler(cfg["scheduler"], W, st)
    # ---- the step
    if device == "cpu":
        placement = "cpu"
        if offload:
            st["notes"].append("zero_optimization.offload_optimizer: device='cpu' puts "
                               "everything on the CPU already")
    else:
        placement = "offload" if offload else "gpu"
    if placement == "offload" and stage == 3:
        raise DeepSpeedConfigError(
            "zero_optimization.offload_optimizer.device",
            "CPU offload of the optimizer with stage 3 (ZeRO-Infinity: params sharded "
            "on the GPUs, states on the CPU) is not supported; allowed: stage 2 with "
            "offload (ZeRO-Offload), or stage 3 without offload")
    master = dkw.get("master")
    if st.get("bf16_master") and placement == "offload":
        master = "bf16"  # DeepSpeed keeps the bf16 master partition on the CPU
    kw = dict(param=dkw["param"], master=master, moments=dkw.get("moments"),
              clip=clip, placement=placement, zero_stage=stage)
    if dkw.get("grad"):
        kw["grad"] = dkw["grad"]
    if dkw.get("loss_scale"):
        kw["loss_scale"] = True
    if placement != "cpu":
        kw["gpu_arch"] = gpu_arch or _steps.DEFAULT_GPU_ARCH
    hy = dict(st["hypers"])
    hkw = {}
    for k in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening"):
        if k in hy:
            hkw[k] = hy[k]
    if rule == "sgd":
        mom = okw["momentum"]
        kw.update(momentum=mom if mom > 0 else 0, nesterov=okw["nesterov"])
        if mom == 0:
            kw.pop("moments", None)   # plain SGD keeps no state
        hkw.pop("momentum", None)
        if mom == 0:
            hkw.pop("dampening", None)
    if rule in ("adam", "adamw"):
        kw["amsgrad"] = okw["amsgrad"]
    if name:
        kw["name"] = name
    notes = ["Imported from a DeepSpeed config by zopt.deepspeed.from_config: "
             f"{st['title']}; zero stage {stage}"
             + (", optimizer offloaded to the CPU" if offload else "") + "."]
    if placement == "gpu" and stage > 0:
        st["notes"].append("zero_optimization.stage: zopt runs GPU-placed steps at "
                           "world size 1 today (zopt.h, zopt_optimizer_set_comm); "
                           "partitioning across ranks applies to offloaded and CPU steps")
    builder = _steps.BUILDERS[rule]
    try:
        spec = builder.spec(comments=comments, **kw, **hkw)
    except ZoptError as e:   # a combination the dialect refuses
        raise DeepSpeedConfigError("<config>", f"the layout this config asks for is "
                                   f"refused by zopt: {e.message}") from None
    spec = dataclasses.replace(spec, notes=tuple(notes))
    text = spec.text()
    runtime_hy = dict(hy)
    if rule == "sgd" and okw["momentum"] == 0:
        runtime_hy.pop("momentum", None)
        runtime_hy.pop("dampening", None)
    defaults = {
        "hypers": runtime_hy,
        "loss_scaler": st.get("loss_scaler"),
        "gradient_accumulation_steps": st["gas"],
        "grad_divisor": st["grad_divisor"],
        "bucket_elems": st.get("bucket_elems"),
        "scheduler": st["scheduler"],
        "device": device,
        "step": {"rule": rule, **{k: v for k, v in kw.items()}, **hkw},
        "call": spec.call,
        "fields": W.fields,
        "notes": st["notes"],
    }
    return text, defaults


def optimizer_kwargs(defaults):
    """Keyword arguments for zopt.Optimizer from ``defaults``: the hypers and
    the loss scaler."""
    kw = dict(defaults.get("hypers") or {})
    if defaults.get("loss_scaler"):
        kw["loss_scaler"] = dict(defaults["loss_scaler"])
    return kw


def load(ds_config, **kw):
    """``(zopt.Step, defaults)`` of a DeepSpeed config (compiled through the
    zopt.steps cache)."""
    text, defaults = from_config(ds_config, **kw)
    return _steps.load_text(text), defaults


# ---------------------------------------------------------------------------
# Command line: zopt-import-deepspeed
# ---------------------------------------------------------------------------

def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(
        prog="zopt-import-deepspeed",
        description="Writes the zopt step description of a DeepSpeed config "
                    "(ds_config.json). Every field is honoured or refused, naming it.")
    ap.add_argument("config", help="DeepSpeed config JSON file ('-': stdin)")
    ap.add_argument("-o", "--output", default="-", help="step description (.mlir); "
                    "default: stdout")
    ap.add_argument("--defaults", metavar="JSON", help="also write the runtime "
                    "defaults (hyperparameters, loss scaler, scheduler, divisor) and "
                    "how each field was used")
    ap.add_argument("--compile", metavar="SO", help="also compile the step to SO "
                    "(zopt-compile)")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--gpu-arch", default=None, help="CUDA architecture (default sm_90)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="where the step runs; auto (default): cuda if this machine has a "
                    "CUDA device, else cpu")
    ap.add_argument("--name", default=None, help="the step's symbol name")
    ap.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")
    a = ap.parse_args(argv)
    try:
        if a.config == "-":
            try:
                src = json.loads(sys.stdin.read())
            except json.JSONDecodeError as e:
                raise ZoptError(Status.INVALID_ARGUMENT, f"<stdin>: not JSON: {e}") from None
        else:
            src = a.config
        text, defaults = from_config(src, world_size=a.world_size, gpu_arch=a.gpu_arch,
                                     device=None if a.device == "auto" else a.device,
                                     name=a.name)
        if a.output == "-":
            sys.stdout.write(text)
        else:
            with open(a.output, "w") as f:
                f.write(text)
        if a.defaults:
            with open(a.defaults, "w") as f:
                json.dump(defaults, f, indent=2)
                f.write("\n")
        if a.compile:
            _compiler.compile(text, out_path=a.compile)
    except ZoptError as e:
        print(f"zopt-import-deepspeed: {e.message}", file=sys.stderr)
        return 1
    if not a.quiet:
        print(f"zopt-import-deepspeed: {defaults['call']}", file=sys.stderr)
        for n in defaults["notes"]:
            print(f"  note: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

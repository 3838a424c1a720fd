"""DeepSpeed config import, the ``zero_optimization`` section: ``stage`` ->
``zero_stage``, ``offload_optimizer`` -> the offloaded placement,
``reduce_bucket_size`` -> ``defaults["bucket_elems"]``; the tables of the
engine's knobs that have no effect on the step and of those that must keep
their default (ZeRO++, MiCS, parameter offload), with why. Below
zopt.deepspeed, over _ds_fields."""
from __future__ import annotations

import json

from ._ds_fields import DeepSpeedConfigError, _bool, _no_auto, _num, _str


_ZERO_NO_EFFECT = {
    "contiguous_gradients": "gradient buffer layout of the engine",
    "reduce_scatter": "collective choice of the engine",
    "use_multi_rank_bucket_allreduce": "collective choice of the engine",
    "allgather_partitions": "collective choice of the engine",
    "allgather_bucket_size": "the engine's all-gather size (zopt uses one bucket "
                             "size, reduce_bucket_size)",
    "overlap_comm": "the engine's overlap of backward and reduction",
    "load_from_fp32_weights": "checkpoint loading of the engine",
    "elastic_checkpoint": "DeepSpeed's checkpoint files (zopt's load at any "
                          "world size)",
    "sub_group_size": "the engine's grouping of the update",
    "stage3_prefetch_bucket_size": "ZeRO-3 parameter fetching of the engine",
    "prefetch_bucket_size": "ZeRO-3 parameter fetching of the engine",
    "stage3_param_persistence_threshold": "ZeRO-3 parameter fetching of the engine",
    "param_persistence_threshold": "ZeRO-3 parameter fetching of the engine",
    "stage3_model_persistence_threshold": "ZeRO-3 parameter fetching of the engine",
    "model_persistence_threshold": "ZeRO-3 parameter fetching of the engine",
    "stage3_max_live_parameters": "ZeRO-3 parameter fetching of the engine",
    "max_live_parameters": "ZeRO-3 parameter fetching of the engine",
    "stage3_max_reuse_distance": "ZeRO-3 parameter fetching of the engine",
    "max_reuse_distance": "ZeRO-3 parameter fetching of the engine",
    "stage3_gather_16bit_weights_on_model_save": "model saving",
    "gather_16bit_weights_on_model_save": "model saving",
    "stage3_gather_fp16_weights_on_model_save": "model saving",
    "stage3_module_granularity_threshold": "ZeRO-3 parameter fetching of the engine",
    "stage3_use_all_reduce_for_fetch_params": "ZeRO-3 parameter fetching of the engine",
    "ignore_unused_parameters": "the engine's hooks (zopt skips a param whose "
                                "grad is None)",
    "legacy_stage1": "the engine's stage-1 implementation",
    "round_robin_gradients": "the engine's gradient copy order",
    "memory_efficient_linear": "the model's linear layers",
    "pipeline_loading_checkpoint": "checkpoint loading of the engine",
    "override_module_apply": "the model's module hooks",
    "log_trace_cache_warnings": "logging",
    "cpu_offload_use_pin_memory": "the engine's host buffers",
    "mics_hierarchical_params_gather": "MiCS (refused unless mics_shard_size is -1)",
}


# Fields whose non-default value changes the step in a way zopt has no
# counterpart for: (default, why).
_ZERO_DEFAULT_ONLY = {
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weights"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized weights"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients"),
    "zeropp_loco_param": (None, "ZeRO++ LoCo"),
    "mics_shard_size": (-1, "MiCS sharding"),
    "cpu_offload_param": (False, "parameter offload (zopt does not move the "
                          "model's params between devices)"),
}


_OFFLOAD_OPT_NO_EFFECT = {
    "pin_memory": "zopt's offloaded steps copy through the runtime's own host buffers",
    "nvme_path": "NVMe offload only (device nvme is refused)",
    "buffer_count": "NVMe offload only",
    "pipeline_read": "NVMe offload only",
    "pipeline_write": "NVMe offload only",
    "fast_init": "NVMe offload only",
}


def _zero(cfg, W, st):
    z = cfg.get("zero_optimization") or {}
    if isinstance(z, bool):
        raise DeepSpeedConfigError("zero_optimization", "the boolean form is DeepSpeed's "
                                   "deprecated one; give {\"stage\": N}")
    known = dict.fromkeys(["stage", "offload_optimizer", "offload_param", "cpu_offload",
                           "reduce_bucket_size"])
    known.update(_ZERO_NO_EFFECT)
    known.update(_ZERO_DEFAULT_ONLY)
    W.section(z, "zero_optimization", known)
    stage = _num(z.get("stage", 0), "zero_optimization.stage", lo=0, hi=3, integer=True)
    if "stage" in z:
        W.use("zero_optimization.stage", f"honoured: zero_stage {stage}")
    for k, why in _ZERO_NO_EFFECT.items():
        if k in z:
            _no_auto(z[k], f"zero_optimization.{k}")
            W.use(f"zero_optimization.{k}", f"no effect on the step ({why})")
    for k, (dflt, why) in _ZERO_DEFAULT_ONLY.items():
        if k in z:
            v = _no_auto(z[k], f"zero_optimization.{k}")
            if v != dflt:
                raise DeepSpeedConfigError(f"zero_optimization.{k}",
                                           f"{why} is not supported; allowed: {json.dumps(dflt)}")
            W.use(f"zero_optimization.{k}", f"honoured: {json.dumps(dflt)} (the default)")
    if "reduce_bucket_size" in z:
        st["bucket_elems"] = _num(z["reduce_bucket_size"],
                                  "zero_optimization.reduce_bucket_size", lo=1, integer=True)
        W.use("zero_optimization.reduce_bucket_size", "honoured: defaults['bucket_elems'] "
              "(zopt_optimizer_set_bucket_elems; rounded up to W norm blocks)")
    offload = False
    oo = z.get("offload_optimizer")
    if oo is not None:
        path = "zero_optimization.offload_optimizer"
        kn = {"device": "", "ratio": ""}
        kn.update(_OFFLOAD_OPT_NO_EFFECT)
        W.section(oo, path, kn)
        dev = _str(oo.get("device", "none"), f"{path}.device", ("none", "cpu", "nvme"))
        if dev == "nvme":
            raise DeepSpeedConfigError(f"{path}.device", "NVMe offload is not supported; "
                                       "allowed: 'cpu' (states and the update on the "
                                       "CPU), 'none'")
        offload = dev == "cpu"
        W.use(f"{path}.device", "honoured: placement 'offload'" if offload else
              "honoured: no offload")
        if "ratio" in oo:
            r = _num(oo["ratio"], f"{path}.ratio", lo=0.0, hi=1.0)
            if r != 1.0 and offload:
                raise DeepSpeedConfigError(f"{path}.ratio", "partial offload (a fraction "
                                           "of the states on the CPU) is not supported: "
                                           "zopt's optimizer states share one placement "
                                           "(rule 13); allowed: 1.0")
            W.use(f"{path}.ratio", "honoured: 1.0" if offload else "no effect: no offload")
        for k, why in _OFFLOAD_OPT_NO_EFFECT.items():
            if k in oo:
                W.use(f"{path}.{k}", f"no effect on the step ({why})")
    if "cpu_offload" in z:
        if _bool(z["cpu_offload"], "zero_optimization.cpu_offload"):
            offload = True
            W.use("zero_optimization.cpu_offload", "honoured: placement 'offload' "
                  "(DeepSpeed's deprecated spelling of offload_optimizer.device cpu)")
        else:
            W.use("zero_optimization.cpu_offload", "honoured: false")
    op = z.get("offload_param")
    if op is not None:
        path = "zero_optimization.offload_param"
        W.section(op, path, dict.fromkeys(["device", "nvme_path", "buffer_count",
                                           "buffer_size", "max_in_cpu", "pin_memory"]))
        dev = _str(op.get("device", "none"), f"{path}.device", ("none", "cpu", "nvme"))
        if dev != "none":
            raise DeepSpeedConfigError(f"{path}.device", f"'{dev}': parameter offload "
                                       "(ZeRO-Infinity moves the model's params off the "
                                       "GPU between uses) is not supported: zopt updates "
                                       "the params where the model keeps them; allowed: "
                                       "'none' (offload_optimizer.device 'cpu' offloads "
                                       "the optimizer)")
        for k in op:
            W.use(f"{path}.{k}", "honoured: no parameter offload" if k == "device"
                  else "no effect: no parameter offload")
    return stage, offload

"""zopt.deepspeed: DeepSpeed configs (python/tests/data/deepspeed/*.json) ->
step descriptions. Each good config compiles and loads into the layout it
asks for, with its hyperparameters as the description's defaults and every
field accounted for; each bad one is refused naming the field; two configs
run on the CPU against the float64 reference with the imported defaults
(loss scaler included); the schedulers follow DeepSpeed's formulas; the
zopt-import-deepspeed tool."""
import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import zopt
from zopt import deepspeed as ds
from oracles.reference import Reference
from zopt_testutil import Problem, StateChecker, check_param, from_storage

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
K = zopt.StateKind
DT = {"f32": zopt.DType.F32, "bf16": zopt.DType.BF16, "f16": zopt.DType.F16}
CPU, GPU = 1, 2
CUDA_ROOT = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
HAVE_CUDA_TOOLKIT = all(os.path.exists(os.path.join(CUDA_ROOT, p)) for p in
                        ("bin/ptxas", "bin/fatbinary", "nvvm/libdevice/libdevice.10.bc"))


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("zopt-cache"))
    old = os.environ.get("ZOPT_CACHE_DIR")
    os.environ["ZOPT_CACHE_DIR"] = d
    yield d
    if old is None:
        os.environ.pop("ZOPT_CACHE_DIR", None)
    else:
        os.environ["ZOPT_CACHE_DIR"] = old


_REAL_CUDA_PRESENT = ds._cuda_present


@pytest.fixture(autouse=True)
def gpu_machine(monkeypatch):
    """The import as on a machine with CUDA (DeepSpeed's usual one): without
    device= or params, from_config follows the machine (tested with the real
    detection in test_placement_*)."""
    monkeypatch.setattr(ds, "_cuda_present", lambda: (True, "assumed by the test"))


def leaf_paths(d, path=""):
    for k, v in d.items():
        p = f"{path}.{k}" if path else k
        if isinstance(v, dict) and v:
            yield from leaf_paths(v, p)
        else:
            yield p


# file -> (from_config kwargs, expected zopt.steps call, expected
#          {state: (dtype, placement)}, expected defaults subset)
GOOD = {
    "zero1_adam.json": (
        {}, dict(rule="adamw", param="f32", master=None, placement="gpu", zero_stage=1,
                 lr=0.00015, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        {"param": ("f32", GPU), "exp_avg": ("f32", GPU), "exp_avg_sq": ("f32", GPU)},
        dict(loss_scaler=None, gradient_accumulation_steps=1, bucket_elems=500000000,
             scheduler=None)),
    "zero2_fp16_dynamic_clip.json": (
        dict(world_size=8), dict(rule="adamw", param="f16", master="f32", moments="f32",
                                 loss_scale=True, clip=1.0, placement="gpu", zero_stage=2,
                                 lr=0.0003, betas=(0.9, 0.95), weight_decay=0.1),
        {"param": ("f16", GPU), "master": ("f32", GPU), "exp_avg_sq": ("f32", GPU)},
        dict(loss_scaler=dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=1000, min_scale=1.0, dynamic=True),
             gradient_accumulation_steps=4, grad_divisor=32)),
    "zero3_bf16_fp32_master.json": (
        {}, dict(rule="adamw", param="bf16", master="f32", moments="f32", clip=1.0,
                 placement="gpu", zero_stage=3, lr=2e-5, weight_decay=0.0),
        {"param": ("bf16", GPU), "grad": ("bf16", GPU), "master": ("f32", GPU),
         "exp_avg": ("f32", GPU)},
        dict(loss_scaler=None, bucket_elems=10000000)),
    "zero2_bf16_offload.json": (
        dict(world_size=4), dict(rule="adamw", param="bf16", master="f32", moments="f32",
                                 clip=1.0, placement="offload", zero_stage=2,
                                 lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05),
        {"param": ("bf16", GPU), "grad": ("bf16", GPU), "master": ("f32", CPU),
         "exp_avg": ("f32", CPU), "exp_avg_sq": ("f32", CPU)},
        dict(gradient_accumulation_steps=8, grad_divisor=32)),
    # The headline cell: bf16 params/grads on the GPU, bf16 master and bf16
    # moments on the CPU (DeepSpeed PR "bf16 optimizer states with CPU offload").
    "zero2_bf16_states_offload.json": (
        {}, dict(rule="adamw", param="bf16", master="bf16", moments="bf16", clip=1.0,
                 placement="offload", zero_stage=2, lr=3e-4, betas=(0.9, 0.95),
                 weight_decay=0.1),
        {"param": ("bf16", GPU), "grad": ("bf16", GPU), "master": ("bf16", CPU),
         "exp_avg": ("bf16", CPU), "exp_avg_sq": ("bf16", CPU)},
        dict(loss_scaler=None)),
    "zero3_bf16_master_weights.json": (
        {}, dict(rule="adamw", param="bf16", master=None, moments="f32", placement="gpu",
                 zero_stage=3, lr=1e-4),
        {"param": ("bf16", GPU), "exp_avg": ("f32", GPU)},
        dict(loss_scaler=None)),
    "fp16_static_adam_amsgrad.json": (
        {}, dict(rule="adam", amsgrad=True, param="f16", master="f32", loss_scale=True,
                 placement="gpu", zero_stage=0, lr=1e-3, weight_decay=1e-4),
        {"param": ("f16", GPU), "max_exp_avg_sq": ("f32", GPU)},
        dict(loss_scaler=dict(init_scale=128.0, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=1000, min_scale=1.0, dynamic=False))),
    "lion_bf16_zero2.json": (
        {}, dict(rule="lion", param="bf16", master="f32", moments="f32", clip=0.5,
                 placement="gpu", zero_stage=2, lr=1e-4, betas=(0.95, 0.98),
                 weight_decay=0.1),
        {"param": ("bf16", GPU), "master": ("f32", GPU), "exp_avg": ("f32", GPU)},
        dict(loss_scaler=None)),
    # bf16 without ZeRO: DeepSpeed (v0.17.6 and later) accumulates in bf16.
    "bf16_no_zero.json": (
        {}, dict(rule="adamw", param="bf16", master="f32", moments="f32", placement="gpu",
                 zero_stage=0, lr=1e-4, weight_decay=0.01),
        {"param": ("bf16", GPU), "grad": ("bf16", GPU), "master": ("f32", GPU)},
        dict(loss_scaler=None)),
    # data_types.grad_accum_dtype fp32: f32 gradients of the bf16 params.
    "zero1_bf16_fp32_grad_accum.json": (
        dict(world_size=2), dict(rule="adamw", param="bf16", grad="f32", master="f32",
                                 moments="f32", clip=1.0, placement="offload",
                                 zero_stage=1, lr=2e-4, betas=(0.9, 0.95),
                                 weight_decay=0.1),
        {"param": ("bf16", GPU), "grad": ("f32", GPU), "master": ("f32", CPU),
         "exp_avg": ("f32", CPU)},
        dict(loss_scaler=None, gradient_accumulation_steps=4, grad_divisor=8)),
    "sgd_nesterov_fp32.json": (
        dict(world_size=2), dict(rule="sgd", param="f32", momentum=0.9, nesterov=True,
                                 placement="offload", zero_stage=1, lr=0.1,
                                 weight_decay=5e-4),
        {"param": ("f32", GPU), "momentum_buffer": ("f32", CPU)},
        dict(gradient_accumulation_steps=4, grad_divisor=8)),
}

BAD = {
    "bad_nvme_offload.json": "zero_optimization.offload_optimizer.device",
    "bad_zero3_offload_param.json": "zero_optimization.offload_param.device",
    "bad_zero3_offload_optimizer.json": "zero_optimization.offload_optimizer.device",
    "bad_onebit_adam.json": "optimizer.type",
    "bad_fp16_hysteresis.json": "fp16.hysteresis",
    "bad_hf_auto.json": "optimizer.params.lr",
}


def test_the_table_covers_every_file():
    files = {f for f in os.listdir(DATA) if f.endswith(".json")}
    assert files == set(GOOD) | set(BAD)
    assert 10 <= len(files) <= 20


@pytest.mark.parametrize("fname", sorted(GOOD))
def test_config_imports_compiles_and_loads(zopt_bins, fname):
    kw, want, states, dflt = GOOD[fname]
    path = os.path.join(DATA, fname)
    text, d = ds.from_config(path, **kw)
    cfg = json.load(open(path))
    # The equivalent zopt.steps call.
    step_kw = dict(d["step"])
    for k, v in want.items():
        got = step_kw.get(k)
        if isinstance(v, tuple):
            got = tuple(got)
        assert got == v, f"{k}: {got!r} != {v!r} ({d['call']})"
    for k, v in dflt.items():
        assert d[k] == v, (k, d[k], v)
    # Every field of the config is accounted for.
    for p in leaf_paths(cfg):
        parts = p.split(".")
        assert any(".".join(parts[:i]) in d["fields"] for i in range(len(parts), 0, -1)), \
            f"{p} not accounted for: {sorted(d['fields'])}"
    # The description compiles and loads into the layout.
    assert "Imported from a DeepSpeed config" in text
    if want["placement"] == "gpu" and not HAVE_CUDA_TOOLKIT:
        pytest.skip(f"no CUDA toolkit at {CUDA_ROOT} to compile GPU kernels "
                    "(the import itself was checked)")
    step = zopt.steps.load_text(text)
    got = {k.name.lower(): (dt, pl) for k, dt, pl in step.states}
    for kind, (dt, pl) in states.items():
        assert got.get(kind) == (DT[dt], pl), (kind, got.get(kind), (dt, pl))
    assert step.zero_stage == want["zero_stage"]
    assert step.clipped == ("clip" in want)
    if "clip" in want:
        assert step.max_norm == want["clip"]
    assert step.loss_scaled == bool(want.get("loss_scale"))
    for h in ("lr", "eps", "weight_decay", "momentum"):
        if h in want:
            assert step.hypers[h][0] == want[h], (h, step.hypers[h])
    if "betas" in want:
        assert (step.hypers["beta1"][0], step.hypers["beta2"][0]) == want["betas"]
    # The runtime defaults repeat the hyperparameters.
    for h in ("lr", "weight_decay"):
        if h in want:
            assert d["hypers"][h] == want[h]
    json.dumps(d)  # the defaults are plain data (the tool writes them as JSON)


@pytest.mark.parametrize("fname", sorted(BAD))
def test_bad_config_is_refused_naming_the_field(fname):
    with pytest.raises(ds.DeepSpeedConfigError) as ei:
        ds.from_config(os.path.join(DATA, fname), world_size=2)
    assert ei.value.field == BAD[fname], str(ei.value)
    assert str(ei.value).startswith(f"[INVALID_ARGUMENT] {BAD[fname]}: ")


def test_grad_accum_dtype_maps_to_the_gradient_dtype():
    """DeepSpeed's default (engine.get_data_types, v0.17.6 and later): the
    model's dtype, also for bf16 without ZeRO (a note names the older
    fp32 default); grad_accum_dtype fp32 gives f32 gradients at every
    stage, for bf16 and fp16 params."""
    _, d = ds.from_config(os.path.join(DATA, "bf16_no_zero.json"))
    assert d["step"].get("grad") is None
    assert any("v0.7.7 to v0.17.5" in n and "grad_accum_dtype" in n for n in d["notes"])
    for stage in (0, 1, 2, 3):
        _, d = ds.from_config(with_(zero_optimization__stage=stage,
                                    data_types={"grad_accum_dtype": "fp32"}))
        assert d["step"]["grad"] == "f32" and d["step"]["master"] == "f32", stage
        assert d["fields"]["data_types.grad_accum_dtype"] == \
            "honoured: f32 gradients (accumulated in f32 into p.main_grad)"
        assert any("p.main_grad" in n for n in d["notes"])
        assert any("NotImplementedError" in n for n in d["notes"]) == (stage == 0)
    text, d = ds.from_config(with_(bf16=None, fp16={"enabled": True, "hysteresis": 1},
                                   data_types={"grad_accum_dtype": "fp32"}))
    assert d["step"]["grad"] == "f32" and d["step"]["loss_scale"] is True
    assert "zopt.state grad : f32 on gpu" in text and "zopt.unscale %g : f32" in text


BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}


def with_(**changes):
    """BASE with dotted-path changes (None deletes)."""
    cfg = copy.deepcopy(BASE)
    for path, v in changes.items():
        keys = path.split("__")
        d = cfg
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        if v is None:
            d.pop(keys[-1], None)
        else:
            d[keys[-1]] = v
    return cfg


REFUSED = [
    (dict(zero_optimisation={"stage": 2}), "zero_optimisation", "zero_optimization"),
    (dict(optimizer__params__foo=1), "optimizer.params.foo", "fields zopt supports"),
    (dict(optimizer__params__max_grad_norm=1.0), "optimizer.params.max_grad_norm",
     "gradient_clipping"),
    (dict(optimizer__params__amsgrad=True), "optimizer.params.amsgrad", "torch_adam"),
    (dict(optimizer__params__torch_adam=True, optimizer__params__bias_correction=False),
     "optimizer.params.bias_correction", "torch.optim"),
    (dict(optimizer__type="sgd"), "optimizer.type", "exact name: 'SGD'"),
    (dict(optimizer__type="Lamb"), "optimizer.type", "Adam, AdamW, Lion, SGD"),
    (dict(optimizer={"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}),
     "optimizer.params.nesterov", "momentum"),
    (dict(optimizer__params__betas=[0.9]), "optimizer.params.betas", "pair"),
    (dict(optimizer__params__betas=[0.9, 1.0]), "optimizer.params.betas[1]", "below 1"),
    (dict(optimizer__params__eps=0), "optimizer.params.eps", "out of range"),
    (dict(optimizer=None), "optimizer", "names no optimizer"),
    (dict(fp16={"enabled": True}), "bf16.enabled", "both"),
    (dict(amp={"enabled": True, "opt_level": "O1"}), "amp.enabled", "apex"),
    (dict(bf16__bf16_optimizer_states=True), "bf16.bf16_optimizer_states",
     "bf16_master_weights_and_grads"),
    (dict(zero_optimization__stage=0, bf16__bf16_master_weights_and_grads=True),
     "bf16.bf16_master_weights_and_grads", "stage 1, 2 or 3"),
    (dict(data_types={"grad_accum_dtype": "fp16"}), "data_types.grad_accum_dtype",
     "allowed here: 'bf16', 'fp32'"),
    (dict(bf16=None, data_types={"grad_accum_dtype": "bf16"}), "data_types.grad_accum_dtype",
     "rule 7"),
    (dict(bf16__bf16_master_weights_and_grads=True, data_types={"grad_accum_dtype": "fp32"}),
     "bf16.bf16_master_weights_and_grads", "give one of them"),
    (dict(bf16=None, fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
     "fp16.fp16_master_weights_and_grads", "rule 9"),
    (dict(bf16=None, fp16={"enabled": True, "hysteresis": 1,
                           "consecutive_hysteresis": True, "loss_scale": 0}), None, None),
    (dict(zero_optimization__offload_optimizer={"device": "cpu", "ratio": 0.5}),
     "zero_optimization.offload_optimizer.ratio", "rule 13"),
    (dict(zero_optimization__zero_quantized_gradients=True),
     "zero_optimization.zero_quantized_gradients", "ZeRO++"),
    (dict(zero_optimization__zero_hpz_partition_size=8),
     "zero_optimization.zero_hpz_partition_size", "allowed: 1"),
    (dict(zero_optimization__stage=4), "zero_optimization.stage", "out of range"),
    (dict(zero_optimization__stage3_foo=1), "zero_optimization.stage3_foo",
     "stage3_max_live_parameters"),
    (dict(zero_optimization__offload_optimizer={"device": "gpu"}),
     "zero_optimization.offload_optimizer.device", "'cpu'"),
    (dict(zero_optimization=True), "zero_optimization", "stage"),
    (dict(communication_data_type="fp32"), "communication_data_type", "allowed: null"),
    (dict(prescale_gradients=True), "prescale_gradients", "allowed: false"),
    (dict(gradient_predivide_factor=8.0), "gradient_predivide_factor", "allowed: 1.0"),
    (dict(sparse_gradients=True), "sparse_gradients", "sparse"),
    (dict(gradient_clipping=-1.0), "gradient_clipping", "out of range"),
    (dict(gradient_clipping="auto"), "gradient_clipping", "Hugging Face"),
    (dict(scheduler={"type": "OneCycle", "params": {}}), "scheduler.type", "OneCycleLR"),
    (dict(scheduler={"type": "LRRangeTest"}), "scheduler.type", "tuning run"),
    (dict(scheduler={"type": "StepLR"}), "scheduler.type", "WarmupLR"),
    (dict(scheduler={"type": "WarmupLR", "params": {"warmup_type": "exp"}}),
     "scheduler.params.warmup_type", "'linear'"),
    (dict(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}),
     "scheduler.params.total_num_steps", "needs it"),
    (dict(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 1e-4]}}),
     "scheduler.params.warmup_max_lr", "per-group"),
    (dict(scheduler={"type": "WarmupLR", "params": {"warmup_ratio": 0.1}}),
     "scheduler.params.warmup_ratio", "warmup_num_steps"),
    (dict(train_batch_size=100, train_micro_batch_size_per_gpu=8,
          gradient_accumulation_steps=2), "train_batch_size", "world size"),
    (dict(bfloat16={"enabled": True}), "bfloat16", "once"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps", "out of range"),
    # Found by a generated matrix of configs (each raised a bare TypeError,
    # ValueError/OverflowError or, later in lr_at, ZeroDivisionError):
    (dict(amp=1), "amp", "JSON object"),
    (dict(amp=[{"enabled": False}]), "amp", "JSON object"),
    (dict(zero_optimization__stage=float("nan")), "zero_optimization.stage", "finite"),
    (dict(gradient_accumulation_steps=float("inf")), "gradient_accumulation_steps", "finite"),
    (dict(scheduler={"type": "WarmupCosineLR",
                     "params": {"warmup_num_steps": 10, "total_num_steps": 10}}),
     "scheduler.params.total_num_steps", "divide by zero"),
]


@pytest.mark.parametrize("changes,field,words", REFUSED,
                         ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(REFUSED)])
def test_field_refusals(changes, field, words):
    cfg = with_(**changes)
    if field is None:  # accepted (consecutive_hysteresis with hysteresis 1)
        ds.from_config(cfg, world_size=2)
        return
    with pytest.raises(ds.DeepSpeedConfigError) as ei:
        ds.from_config(cfg, world_size=2)
    assert ei.value.field == field, str(ei.value)
    assert words in str(ei.value), str(ei.value)


def test_accepted_variants():
    # DeepSpeed's old "bfloat16" key, the deprecated cpu_offload flag.
    _, d = ds.from_config({"optimizer": BASE["optimizer"], "bfloat16": {"enabled": True},
                           "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert d["step"]["placement"] == "offload" and d["step"]["param"] == "bf16"
    # bf16 overflow check -> skip on non-finite gradients (static scale 1).
    _, d = ds.from_config(with_(bf16__check_grad_overflow=True))
    assert d["step"]["loss_scale"] and d["loss_scaler"]["dynamic"] is False
    assert d["loss_scaler"]["init_scale"] == 1.0
    # torch_adam AdamW: torch's default weight_decay 0.01; "Adam" is AdamW
    # unless adam_w_mode is false.
    _, d = ds.from_config(with_(optimizer={"type": "Adam", "params": {"torch_adam": True}}))
    assert d["step"]["rule"] == "adamw" and d["hypers"]["weight_decay"] == 0.01
    # DeepSpeed's fused AdamW without weight_decay: its default, 0 (not
    # zopt.steps.adamw()'s torch default), in the hypers and the step text.
    text, d = ds.from_config(with_(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    assert d["step"]["rule"] == "adamw" and d["hypers"]["weight_decay"] == 0.0
    assert "zopt.hyper weight_decay default 0.0" in text
    _, d = ds.from_config(with_(optimizer={"type": "adam", "params": {"adam_w_mode": False}}))
    assert d["step"]["rule"] == "adam"
    # FusedAdam's bias_correction: a runtime value.
    _, d = ds.from_config(with_(optimizer__params__bias_correction=False))
    assert d["hypers"]["bias_correction"] is False
    # No optimizer in the config: the optimizer= argument.
    text, d = ds.from_config(with_(optimizer=None),
                             optimizer={"type": "Lion", "params": {"lr": 3e-5}})
    assert d["step"]["rule"] == "lion" and d["step"]["betas"] == (0.9, 0.999)
    # fp16 without hysteresis: DeepSpeed's default 2 is noted, not refused.
    _, d = ds.from_config(with_(bf16=None, fp16={"enabled": True}))
    assert any("hysteresis" in n for n in d["notes"])
    # Plain SGD (momentum 0): no buffer, no momentum slot at runtime.
    _, d = ds.from_config(with_(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert d["step"]["momentum"] == 0 and "momentum" not in d["hypers"]
    # The batch sizes derive the accumulation steps with a world size.
    _, d = ds.from_config(with_(train_batch_size=64, train_micro_batch_size_per_gpu=4),
                          world_size=4)
    assert d["gradient_accumulation_steps"] == 4 and d["grad_divisor"] == 16
    # JSON text and a cpu device.
    text, d = ds.from_config(json.dumps(BASE), device="cpu")
    assert d["step"]["placement"] == "cpu" and "gpu_arch" not in text
    assert d["device"] == "cpu" and "device: 'cpu' (device='cpu' given)" in d["notes"]
    # torch's maximize: a runtime group flag (zopt.Optimizer(maximize=True)).
    _, d = ds.from_config(with_(optimizer__params__maximize=True))
    assert d["hypers"]["maximize"] is True
    assert ds.optimizer_kwargs(d)["maximize"] is True


def test_dtype_layout_follows_deepspeed_engine():
    """DeepSpeed's engine accumulates bf16 gradients in bf16 under ZeRO
    stage 1-3 (get_data_types): the default bf16 config at stage 1 is
    honoured, and an explicit bf16 accumulation too."""
    for stage in (1, 2, 3):
        _, d = ds.from_config(with_(zero_optimization__stage=stage))
        assert d["step"]["param"] == "bf16" and d["step"]["master"] == "f32"
    _, d = ds.from_config(with_(data_types={"grad_accum_dtype": "bf16"}))
    assert d["fields"]["data_types.grad_accum_dtype"].startswith("honoured")


# ---------------------------------------------------------------------------
# Running imported steps (on the CPU) against the float64 reference
# ---------------------------------------------------------------------------

SIZES = [[1, 17, 1000], [33]]


def _run(text, defaults, rule, layout, state_dtype, clip, grad_scales, kinds, seed,
         ref_kw=None):
    step = zopt.steps.load_text(text)
    prob = Problem(seed, layout, SIZES, state_dtype)
    okw = ds.optimizer_kwargs(defaults)
    opt = zopt.Optimizer(step, [dict(params=gp) for gp in prob.group_params()], **okw)
    hy = {k: v for k, v in defaults["hypers"].items()}
    p64 = prob.params64()
    ref = Reference(rule, [dict(params=[p64[i] for i, g in enumerate(prob.group_of)
                                        if g == gi], **hy) for gi in range(len(SIZES))],
                    layout=layout, state_dtype=state_dtype, clip=clip,
                    loss_scaler=defaults["loss_scaler"], **(ref_kw or {}))
    chk = StateChecker()
    skipped = []
    for s, scale in enumerate(grad_scales):
        S = opt.loss_scale if prob.loss_scaled else 1.0
        g64 = prob.set_grads(scale, loss_scale=S)
        opt.step()
        sk = opt.last_skipped
        _, _, _ = ref.step(g64)
        skipped.append(bool(sk))
        if prob.loss_scaled:
            assert opt.loss_scale == ref.scaler.scale
        for i in range(len(prob.params)):
            tag = f"step {s} tensor {i}"
            check_param(from_storage(prob.params[i], prob.pg), ref.param(i), prob.pg,
                        f"{tag} param")
            for k in kinds:
                if k == "master":
                    check_param(opt.read_state(i, k), ref.state(i, k), prob.wt, f"{tag} master")
                else:
                    chk.check((i, k), opt.read_state(i, k), ref.state(i, k), prob.st,
                              f"{tag} {k}")
    return skipped


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the overflow step
def test_fp16_dynamic_config_runs_like_the_reference(zopt_bins):
    """zero2_fp16_dynamic_clip on the CPU: f16 params, f32 master, dynamic
    loss scaling from 2**16 (a gradient that overflows skips its step and
    halves the scale), clipping at 1.0, the config's hyperparameters."""
    text, d = ds.from_config(os.path.join(DATA, "zero2_fp16_dynamic_clip.json"),
                             device="cpu")
    scales = [1e-4, 1e-3, 3.0, 1e-3, 2e-4, 1e-3]   # 3.0 * 65536 overflows f16
    skipped = _run(text, d, "adamw", "f16_loss_scale", None, 1.0, scales,
                   ["master", "exp_avg", "exp_avg_sq"], 11)
    assert skipped == [False, False, True, False, False, False]


def test_bf16_states_config_runs_like_the_reference(zopt_bins):
    """The headline config on the CPU: bf16 params as the master, bf16
    moments, clipping at 1.0."""
    text, d = ds.from_config(os.path.join(DATA, "zero2_bf16_states_offload.json"),
                             device="cpu")
    assert d["step"]["master"] is None and d["step"]["moments"] == "bf16"
    _run(text, d, "adamw", "bf16", None, 1.0, [1.0, 0.03, 0.5, 0.02, 1.0, 0.05],
         ["exp_avg", "exp_avg_sq"], 12)


def test_bf16_fp32_grad_accum_config_trains_like_torch(zopt_bins):
    """zero1_bf16_fp32_grad_accum on the CPU: a bf16 model, 4 micro-batches
    per step (each loss divided by 4, as DeepSpeed does) accumulated in f32
    by the optimizer's hooks, clipping at 1.0, the config's AdamW; beside
    torch's recipe (f32 masters, the micro-batches' bf16 gradients summed
    in f32, clip_grad_norm_, torch.optim.AdamW)."""
    torch = pytest.importorskip("torch")
    text, d = ds.from_config(os.path.join(DATA, "zero1_bf16_fp32_grad_accum.json"),
                             device="cpu")
    step = zopt.steps.load_text(text)
    assert step.f32_grads and step.max_norm == 1.0
    A = d["gradient_accumulation_steps"]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 2)).to(torch.bfloat16)

    def loss(m, s, k):
        g = torch.Generator().manual_seed(100 * s + k)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        return torch.nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y) / A
    mz, mt = model(), model()
    opt = zopt.Optimizer(step, mz.parameters(), **ds.optimizer_kwargs(d))
    masters = [torch.nn.Parameter(p.detach().float()) for p in mt.parameters()]
    hy = d["hypers"]
    ref = torch.optim.AdamW(masters, lr=hy["lr"], betas=hy["betas"],
                            weight_decay=hy["weight_decay"], foreach=False)
    for s in range(4):
        opt.zero_grad()
        acc = [torch.zeros(p.shape) for p in mt.parameters()]
        for k in range(A):
            loss(mz, s, k).backward()
            mt.zero_grad(set_to_none=True)
            loss(mt, s, k).backward()
            for a, p in zip(acc, mt.parameters()):
                a += p.grad.float()
        for m, a in zip(masters, acc):
            m.grad = a
        norm = float(torch.nn.utils.clip_grad_norm_(masters, 1.0))
        ref.step()
        with torch.no_grad():
            for m, p in zip(masters, mt.parameters()):
                p.copy_(m)
        opt.step()
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5)
        for t, m in enumerate(masters):
            np.testing.assert_allclose(opt.read_state(t, "master"),
                                       m.detach().reshape(-1).numpy(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Schedulers
# ---------------------------------------------------------------------------

def _sched(fname, **kw):
    _, d = ds.from_config(os.path.join(DATA, fname), **kw)
    return d["scheduler"], d["hypers"]["lr"]


def test_warmup_lr_linear():
    s, base = _sched("zero3_bf16_fp32_master.json")   # linear, 0 -> 2e-5 over 500
    assert s["type"] == "WarmupLR" and s["warmup_type"] == "linear"
    # DeepSpeed sets the lr when the scheduler is built (step 0: min) and
    # after each step: step i runs with iteration i - 1.
    assert ds.lr_at(s, 0, base) == 0.0 and ds.lr_at(s, 1, base) == 0.0
    assert ds.lr_at(s, 2, base) == pytest.approx(2e-5 / 500, rel=1e-12)
    assert ds.lr_at(s, 251, base) == pytest.approx(1e-5, rel=1e-12)
    assert ds.lr_at(s, 501, base) == 2e-5 and ds.lr_at(s, 10**6, base) == 2e-5


def test_warmup_decay_lr_log():
    s, base = _sched("zero2_bf16_offload.json")      # log warmup 100, total 10000
    assert s["warmup_type"] == "log"
    assert ds.lr_at(s, 2, base) == pytest.approx(1e-4 * math.log(2) / math.log(100))
    assert ds.lr_at(s, 101, base) == pytest.approx(1e-4)
    assert ds.lr_at(s, 5051, base) == pytest.approx(0.5e-4)
    assert ds.lr_at(s, 10001, base) == 0.0 and ds.lr_at(s, 20000, base) == 0.0


def test_warmup_cosine_lr():
    s, base = _sched("lion_bf16_zero2.json")         # ratio 0.1 -> 1 over 50, cos to 0.01
    assert ds.lr_at(s, 0, base) == 0.0
    assert ds.lr_at(s, 1, base) == pytest.approx(base * 0.1)
    assert ds.lr_at(s, 51, base) == pytest.approx(
        base * (0.01 + 0.99 * (1 + math.cos(math.pi / 1950)) / 2))
    assert ds.lr_at(s, 2000, base) == pytest.approx(base * 0.01)   # cos(pi)


@pytest.mark.parametrize("fname", ["zero3_bf16_fp32_master.json",
                                   "zero2_bf16_offload.json", "lion_bf16_zero2.json"])
def test_torch_scheduler_gives_deepspeeds_lr(fname):
    torch = pytest.importorskip("torch")
    s, base = _sched(fname)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=base)
    sch = ds.torch_scheduler(opt, s)
    for i in range(700):
        assert opt.param_groups[0]["lr"] == pytest.approx(ds.lr_at(s, i, base), rel=1e-12,
                                                          abs=1e-30), i
        opt.step()
        sch.step()


# ---------------------------------------------------------------------------
# The command-line tool
# ---------------------------------------------------------------------------

def _tool():
    exe = os.path.join(os.path.dirname(zopt.find_compiler()), "zopt-import-deepspeed")
    assert os.path.exists(exe), f"{exe} is not built (tools/zopt-import-deepspeed)"
    return exe


def test_tool_writes_description_defaults_and_step(compiler_binary, tmp_path):
    env = dict(os.environ, ZOPT_PYTHON=sys.executable)
    out, dj, so = tmp_path / "step.mlir", tmp_path / "d.json", tmp_path / "step.so"
    r = subprocess.run([_tool(), os.path.join(DATA, "zero2_bf16_states_offload.json"),
                        "-o", str(out), "--defaults", str(dj), "--compile", str(so),
                        "--device", "cuda"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "zopt.steps.adamw(param='bf16', master='bf16', moments='bf16'" in r.stderr
    text = out.read_text()
    assert text == ds.from_config(os.path.join(DATA, "zero2_bf16_states_offload.json"))[0]
    d = json.loads(dj.read_text())
    assert d["step"]["placement"] == "offload" and d["hypers"]["lr"] == 3e-4
    assert zopt.Step(str(so)).state_dtype("exp_avg") == zopt.DType.BF16


def test_cli_main_stdout_and_stdin(capsys, monkeypatch):
    """The same entry point in-process: stdout, --device cpu, --world-size,
    -q; a config on stdin that is not an object."""
    rc = ds.main([os.path.join(DATA, "sgd_nesterov_fp32.json"), "--device", "cpu",
                  "--world-size", "2", "-q"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "" and "zopt.nesterov" in out and "gpu_arch" not in out
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("[1, 2]"))
    assert ds.main(["-"]) == 1
    assert "must be a JSON object" in capsys.readouterr().err


def test_tool_refusal_names_the_field(compiler_binary, tmp_path):
    env = dict(os.environ, ZOPT_PYTHON=sys.executable)
    out = tmp_path / "x.mlir"
    r = subprocess.run([_tool(), os.path.join(DATA, "bad_nvme_offload.json"), "-o", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.startswith("zopt-import-deepspeed: zero_optimization.offload_optimizer"
                               ".device: NVMe offload is not supported")


# ---- where the imported step runs (issue 16 item 11) -----------------------------

def _readme_snippet():
    """The first python block of python/README.md's DeepSpeed section."""
    text = open(os.path.join(os.path.dirname(DATA), "..", "..", "README.md")).read()
    sec = text[text.index("## DeepSpeed configs: `zopt.deepspeed`"):]
    return sec[sec.index("```python\n") + 10:sec.index("\n```", sec.index("```python\n"))]


def test_readme_snippet_runs_on_a_cpu_machine(zopt_bins, tmp_path, monkeypatch):
    """python/README.md's DeepSpeed snippet, as written, on a machine without
    CUDA (this one, or emulated on a GPU machine): a CPU step that trains
    (it used to build the GPU step and end in "no CUDA driver
    (libcuda.so.1)"), DeepSpeed's scheduler on the zopt optimizer."""
    import shutil
    import torch
    if torch.cuda.is_available():
        monkeypatch.setattr(ds, "_cuda_present", lambda: (False, "emulated: no CUDA"))
    else:
        monkeypatch.setattr(ds, "_cuda_present", _REAL_CUDA_PRESENT)
    shutil.copy(os.path.join(DATA, "zero2_bf16_offload.json"), tmp_path / "ds_config.json")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(torch.bfloat16)
    ns = {"zopt": zopt, "torch": torch, "model": model}
    exec(compile(_readme_snippet(), "python/README.md", "exec"), ns)
    defaults, opt, sched = ns["defaults"], ns["opt"], ns["sched"]
    assert defaults["device"] == "cpu" and defaults["step"]["placement"] == "cpu"
    assert any(n.startswith("device: 'cpu' (no params given and this machine has no CUDA")
               for n in defaults["notes"]), defaults["notes"]
    assert not opt.step_obj.gpu and not opt.step_obj.on_device
    before = [opt.state[p]["master"] if opt.state[p] else p.detach().float()
              for p in model.parameters()]
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16).to(torch.bfloat16)).float().square().mean().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(
        ds.lr_at(defaults["scheduler"], 3, 1e-4))
    for p, m0 in zip(model.parameters(), before):  # the warm-up's lr moves the f32 master
        assert opt.tensor_step(p) == 3 and not torch.equal(opt.state[p]["master"], m0)


def test_placement_follows_device_then_params_then_machine(monkeypatch):
    """device= as given; else the params' device (CPU params: a CPU step even
    on a CUDA machine; CUDA params: the GPU step, or offloaded with
    offload_optimizer.device cpu); else the machine's; the reason is in the
    notes. Params on both devices are refused."""
    import types
    import torch
    cfg = os.path.join(DATA, "zero2_bf16_offload.json")
    cpu = [torch.zeros(3, dtype=torch.bfloat16)]
    cuda = [types.SimpleNamespace(device=torch.device("cuda", 0))]

    def imp(**kw):
        _, d = ds.from_config(cfg, **kw)
        return d["device"], d["step"]["placement"], d["notes"][0]
    # the fixture's machine has CUDA
    assert imp() == ("cuda", "offload", "device: 'cuda' (no params given; this machine has "
                     "CUDA (assumed by the test))")
    assert imp(params=cpu) == ("cpu", "cpu", "device: 'cpu' (the params are on the CPU)")
    assert imp(params=[{"params": cpu}])[:2] == ("cpu", "cpu")
    assert imp(params=iter(cuda))[:2] == ("cuda", "offload")
    assert imp(params=cpu, device="cuda")[:2] == ("cuda", "offload")
    monkeypatch.setattr(ds, "_cuda_present", lambda: (False, "none here"))
    assert imp()[:2] == ("cpu", "cpu")
    assert imp(params=cuda)[:2] == ("cuda", "offload")
    with pytest.raises(zopt.ZoptError, match="some are CUDA tensors"):
        ds.from_config(cfg, params=cpu + cuda)
    with pytest.raises(zopt.ZoptError, match="'tpu'"):
        ds.from_config(cfg, device="tpu")
    # the real detection agrees with torch
    assert _REAL_CUDA_PRESENT()[0] == torch.cuda.is_available()


def test_cli_device_auto(capsys, monkeypatch, tmp_path):
    """zopt-import-deepspeed's --device auto (the default) is the machine's
    rule; its note says which and why."""
    monkeypatch.setattr(ds, "_cuda_present", lambda: (False, "none here"))
    out = tmp_path / "s.mlir"
    rc = ds.main([os.path.join(DATA, "zero2_bf16_offload.json"), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and "note: device: 'cpu' (no params given" in err, err
    assert "on gpu" not in out.read_text() and "on cpu" in out.read_text()
    rc = ds.main([os.path.join(DATA, "zero2_bf16_offload.json"), "-o", str(out),
                  "--device", "cuda"])
    assert rc == 0 and "on gpu" in out.read_text()

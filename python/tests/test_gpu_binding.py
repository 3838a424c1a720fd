"""The Python binding's GPU path without a GPU (docs/GPU.md, "What the Python
binding does").

Two layers:

- Recording tests (run everywhere): a zopt.Optimizer over a real CPU step
  whose Step is made to look like a GPU (or offloaded) step, with torch.cuda
  replaced by a fake (current stream, capture flag, device context, caching
  allocator) and the runtime library wrapped by a recorder that forwards
  every C call to the real runtime except the GPU-only ones
  (set_stream, set_device_allocator, gpu_result), which it records. They
  check the binding's call sequence: torch's current stream is the
  optimizer's stream at every call that enqueues or reads; a scheduler's lr
  change reaches set_hyper without step(); a change inside a capture is
  refused; torch's allocator is registered before finalize and kept alive;
  the native optimizer is created with the params' device current; an
  offloaded step inside a capture is refused.

- Stand-in driver tests (need the CUDA toolkit to compile a GPU step and
  libzopt-fake-cuda.so, built with the runtime): a subprocess runs this file
  with ZOPT_CUDA_DRIVER pointing at the stand-in driver
  (test/Integration/GPUHost/fake-cuda.cpp), so that the real runtime runs a
  real GPU step's host side: params in the stand-in's device memory, a step
  captured into a CUDA graph on one stream and replayed on another with an
  lr scheduler stepping between replays, the stand-in emulating what the
  kernels do that the host can observe (PREPARE records the hyperparameter
  table it read, FINISH counts steps). The numerics of the kernels are not
  run here: python/tests/test_cuda.py does that on a GPU.

GPU steps' params without a gradient and frozen params (the runtime's
active mask): test_gpu_frozen.py. The fakes of both: gpu_fakes.py.
"""
import ctypes
import gc
import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch

import zopt
import zopt.mixed
from gpu_fakes import HAVE_TOOLKIT, StandIn, needs_fake, needs_toolkit, run_worker
from gpu_fakes import assert_on_current_stream as _assert_on_current_stream
from gpu_fakes import params_with_grads as _params
from zopt._lib import Status, ZoptError


# ---- recording tests ------------------------------------------------------------

def test_current_stream_before_every_device_call(steps, gpu_env, tmp_path):
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    assert opt._parts[0].streams and not opt._parts[0].offload
    names = [c[0] for c in rec.calls()]
    # the stream is set right after create, before anything is enqueued
    assert names.index("zopt_optimizer_set_stream") < names.index("zopt_optimizer_finalize")
    for s in (0x5200, 0x5300):
        fc.stream = s
        n0 = len(rec.log)
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
        opt.step()
        sub = [c[0] for c in rec.log[n0:] if isinstance(c, tuple) and c[0].startswith("zopt_")]
        assert sub.index("zopt_optimizer_set_stream") < sub.index("zopt_optimizer_set_hyper") \
            < sub.index("zopt_optimizer_step")
    # reads and writes after a "replay" on yet another stream
    fc.stream = 0x5400
    assert opt.gpu_result() == (0.25, False, 1.0)
    fc.stream = 0x5500
    opt.step_count()
    opt.tensor_step(ps[0])
    opt.loss_scale
    opt.read_state(0, "exp_avg")
    opt.read_state_raw(1, "exp_avg_sq")
    opt.write_state(0, "exp_avg", np.zeros(ps[0].numel(), np.float32))
    fc.stream = 0x5600
    sd = opt.state_dict()
    opt.save(tmp_path / "ck")
    fc.stream = 0x5700
    opt.load(tmp_path / "ck")
    opt.load_state_dict(sd)
    opt.set_hyper(0, "weight_decay", 0.1)
    opt.grad_divisor = 2.0
    opt.configure_loss_scaler(init_scale=8.0)
    opt.refresh_master()
    _assert_on_current_stream(rec)
    got = {c[0] for c in rec.calls()}
    for name in ("zopt_optimizer_gpu_result", "zopt_optimizer_get_step_count",
                 "zopt_optimizer_read_state_f32", "zopt_optimizer_read_state_raw",
                 "zopt_optimizer_save", "zopt_optimizer_load_ex", "zopt_optimizer_set_hyper",
                 "zopt_optimizer_step"):
        assert name in got, name
    # torch's current stream was asked of the params' device
    assert all(c[1] == ps[0].device for c in rec.log if c[0] == "current_stream")


def test_scheduler_between_replays_reaches_the_runtime_without_step(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2, betas=(0.9, 0.99))
    assert all(isinstance(g, zopt._gpu.GpuGroup) for g in opt.param_groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    opt.step()  # "the capture" (a GPU step only enqueues)
    n_steps = len(rec.calls("zopt_optimizer_step"))
    for k in range(1, 4):
        fc.stream = 0x6000 + k  # each replay on the caller's stream
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
            sched.step()
        want = 1e-2 * 0.5 ** k
        assert opt.get_hyper(0, "lr") == pytest.approx(want, rel=1e-15)
        last = rec.calls("zopt_optimizer_set_hyper")[-1]
        assert last[4][2] == b"lr" and last[4][3] == pytest.approx(want, rel=1e-15)
        assert last[1] == fc.stream  # on the stream current at the change
    assert len(rec.calls("zopt_optimizer_step")) == n_steps  # no step() in between
    # betas (OneCycleLR cycles beta1): only the changed slot is written
    n = len(rec.calls("zopt_optimizer_set_hyper"))
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    new = [c[4][2] for c in rec.calls("zopt_optimizer_set_hyper")[n:]]
    assert new == [b"beta1"] and opt.get_hyper(0, "beta1") == pytest.approx(0.8)
    # update()/setdefault() push too; other keys do not
    opt.param_groups[0].update(eps=1e-6, note="x")
    assert opt.get_hyper(0, "eps") == pytest.approx(1e-6)
    n = len(rec.calls("zopt_optimizer_set_hyper"))
    opt.param_groups[0]["initial_lr"] = 3.0
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # unchanged: nothing written
    assert len(rec.calls("zopt_optimizer_set_hyper")) == n
    # an invalid value is refused at the assignment, the group keeps the old one
    with pytest.raises(ZoptError):
        opt.param_groups[0]["lr"] = -1.0
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)
    # copies are plain dicts (torch's state_dict, deepcopy, pickle)
    import copy
    import pickle
    assert type(copy.deepcopy(opt.param_groups[0])) is dict
    assert type(pickle.loads(pickle.dumps(opt.param_groups[0]))) is dict
    _assert_on_current_stream(rec)


def test_hyperparameter_change_inside_capture_refused(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    opt.step()
    fc.capturing = True
    n = len(rec.calls("zopt_optimizer_set_hyper"))
    with pytest.raises(ZoptError) as e:
        opt.param_groups[0]["lr"] = 5e-3
    assert e.value.code == Status.BAD_STATE
    msg = str(e.value)
    assert "CUDA graph capture" in msg and "before capturing" in msg and "lr" in msg
    assert opt.param_groups[0]["lr"] == 1e-2  # unchanged, as on the device
    with pytest.raises(ZoptError, match="CUDA graph capture"):
        opt.set_hyper(0, "lr", 5e-3)
    opt.param_groups[0]["lr"] = 1e-2  # the same value: nothing to write
    opt.step()  # the captured step: nothing changed, nothing pushed
    assert len(rec.calls("zopt_optimizer_set_hyper")) == n
    # a change made behind the group's back is caught by step() too
    dict.__setitem__(opt.param_groups[0], "lr", 7e-3)
    with pytest.raises(ZoptError, match="CUDA graph capture"):
        opt.step()
    fc.capturing = False
    opt.param_groups[0]["lr"] = 5e-3  # between replays: written
    assert opt.get_hyper(0, "lr") == 5e-3
    assert len(rec.calls("zopt_optimizer_set_hyper")) == n + 1


def test_maximize_reaches_the_runtime_at_once(steps, gpu_env):
    """torch's maximize on a GPU step: set at build (before finalize, so the
    device's table starts with the sign), an assignment in param_groups
    written at once on torch's current stream (graph replays read the
    table), refused inside a capture (the group keeps its value)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"),
                         [{"params": ps[:1], "maximize": True}, {"params": ps[1:]}], lr=1e-2)
    names = [c[0] for c in rec.calls()]
    assert names.index("zopt_optimizer_set_group_flags") < names.index("zopt_optimizer_finalize")
    assert [opt.get_group_flags(g) for g in range(2)] == [1, 0]
    opt.step()
    fc.stream = 0x6100
    n = len(rec.calls("zopt_optimizer_set_group_flags"))
    opt.param_groups[1]["maximize"] = True
    last = rec.calls("zopt_optimizer_set_group_flags")[-1]
    assert len(rec.calls("zopt_optimizer_set_group_flags")) == n + 1
    assert last[1] == fc.stream and last[4][1:] == (1, 1)
    assert opt.get_group_flags(1) == 1
    fc.capturing = True
    with pytest.raises(ZoptError, match="maximize = False inside a CUDA graph capture"):
        opt.param_groups[0]["maximize"] = False
    assert opt.param_groups[0]["maximize"] is True and opt.get_group_flags(0) == 1
    fc.capturing = False
    _assert_on_current_stream(rec)


def test_clip_grad_norm_passes_max_norm_to_a_gpu_step(steps, gpu_env):
    """opt.clip_grad_norm_(max_norm) on a GPU step (one stream of kernels: no
    first half to run now): the threshold reaches the runtime
    (set_max_norm, on torch's current stream) before the whole step and the
    compiled one after it; the returned norm is torch's; the step clips at
    max_norm (compiled 1.0 would not clip here), as torch's SGD after
    torch's clip_grad_norm_ (SGD: the update is proportional to the
    clipped gradient)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    ps, tps = _params(seed=3), _params(seed=3)
    opt = zopt.Optimizer(steps(rule="sgd", layout="f32", clip=1.0), ps, lr=0.5)
    topt = torch.optim.SGD(tps, lr=0.5)
    want = torch.nn.utils.clip_grad_norm_(tps, 0.1)
    assert 0.2 < float(want)  # so max_norm 0.1 clips, 1.0 would not
    n0 = len(rec.calls())
    norm = opt.clip_grad_norm_(0.1)
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert float(norm) == pytest.approx(float(want), rel=1e-6)
    opt.step()
    topt.step()
    for p, tp in zip(ps, tps):
        np.testing.assert_allclose(p.detach().numpy(), tp.detach().numpy(), rtol=1e-6, atol=1e-7)
    calls = [(c[0], c[4][1] if c[0] == "zopt_optimizer_set_max_norm" else None)
             for c in rec.calls()[n0:]
             if c[0] in ("zopt_optimizer_set_max_norm", "zopt_optimizer_step",
                         "zopt_optimizer_step_begin")]
    assert calls == [("zopt_optimizer_set_max_norm", 0.1), ("zopt_optimizer_step", None),
                     ("zopt_optimizer_set_max_norm", 1.0)]
    _assert_on_current_stream(rec, n0)


@pytest.mark.parametrize("where", ["gpu", "offload"])
def test_rule_flags_checked_on_device_steps(steps, gpu_env, where):
    """torch's nesterov and decoupled_weight_decay against a GPU or
    offloaded step's rule, which its descriptor states (the step cannot be
    run on the host to find it, so it used to go unchecked): the other
    value is refused at construction (no native optimizer made) and at
    step() after an edit (nothing stepped); the step's own value steps."""
    fc, rec, mode = gpu_env
    mode(where)
    nest = steps(rule="sgd", nesterov=True, layout="f32")
    assert nest.nesterov is True
    with pytest.raises(ZoptError, match="nesterov=False.*compiled with Nesterov"):
        zopt.Optimizer(nest, [{"params": _params(), "nesterov": False}], lr=0.1, momentum=0.9)
    with pytest.raises(ZoptError, match="decoupled_weight_decay=False.*decoupled .AdamW."):
        zopt.Optimizer(steps(rule="adamw", layout="f32"),
                       [{"params": _params(), "decoupled_weight_decay": False}], lr=1e-2)
    assert not rec.calls("zopt_optimizer_create")
    ps = _params()
    opt = zopt.Optimizer(nest, [{"params": ps, "nesterov": True}], lr=0.1, momentum=0.9)
    opt.step()
    n = len(rec.calls("zopt_optimizer_step"))
    assert n == 1
    opt.param_groups[0]["nesterov"] = False
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ZoptError, match=r"param_groups\[0\] has nesterov=False"):
        opt.step()
    assert len(rec.calls("zopt_optimizer_step")) == n
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    opt.param_groups[0]["nesterov"] = True
    opt.step()
    assert len(rec.calls("zopt_optimizer_step")) == n + 1


def test_torch_allocator_registered_before_finalize_and_kept(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    fc.stream = 0x5a00
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    names = [c[0] for c in rec.calls()]
    assert names.index("zopt_optimizer_set_stream") \
        < names.index("zopt_optimizer_set_device_allocator") \
        < names.index("zopt_optimizer_finalize")
    (h, a), = rec.allocators
    assert h == opt._h.value
    keep = opt._parts[0].dev_alloc
    assert keep is not None
    del keep
    gc.collect()
    # the C side holds only the function pointers: they must still work
    p = a.alloc(None, 1000, ctypes.c_void_p(0x5a00))
    assert p == fc.allocs[-1][3] and fc.allocs[-1][:3] == (1000, ps[0].device.index, 0x5a00)
    a.free(None, p, 1000, ctypes.c_void_p(0x5a00))
    assert fc.deletes == [p]
    a.free(None, 0x1234, 16, None)  # not ours: not handed to torch
    assert fc.deletes == [p]
    # a rebuild (add_param_group) registers the same allocator again
    extra = _params(1, seed=1)
    opt.add_param_group({"params": extra})
    assert len(rec.allocators) == 2 and opt._parts[0].dev_alloc.c.alloc is not None
    names = [c[0] for c in rec.calls()]
    last_fin = len(names) - 1 - names[::-1].index("zopt_optimizer_finalize")
    last_alloc = len(names) - 1 - names[::-1].index("zopt_optimizer_set_device_allocator")
    assert last_alloc < last_fin
    # device_allocator="driver": cuMemAlloc, nothing registered
    n = len(rec.allocators)
    zopt.Optimizer(steps(rule="adamw", layout="f32"), _params(seed=2), lr=1e-2,
                   device_allocator="driver")
    assert len(rec.allocators) == n
    with pytest.raises(ZoptError, match="device_allocator"):
        zopt.Optimizer(steps(rule="adamw", layout="f32"), _params(seed=3),
                       device_allocator="cuda")


def test_created_with_the_params_device_current(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("gpu")
    ps = _params()
    zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    seq = [c[0] for c in rec.log if c[0] in ("device_enter", "device_exit",
                                             "zopt_optimizer_create", "zopt_optimizer_finalize")]
    assert seq == ["device_enter", "zopt_optimizer_create", "zopt_optimizer_finalize",
                   "device_exit"]
    assert [c[1] for c in rec.log if c[0] == "device_enter"] == [ps[0].device]


def test_offloaded_step_inside_capture_refused(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("offload")
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    assert opt._parts[0].offload and not any(isinstance(g, zopt._gpu.GpuGroup) for g in opt.param_groups)
    assert not rec.calls("zopt_optimizer_set_device_allocator")  # pinned host staging only
    fc.capturing = True
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ZoptError) as e:
        opt.step()
    assert e.value.code == Status.UNSUPPORTED
    assert "offloaded" in str(e.value) and "CUDA graph capture" in str(e.value)
    assert not rec.calls("zopt_optimizer_step")
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    fc.capturing = False
    fc.stream = 0x5b00
    opt.step()
    assert rec.calls("zopt_optimizer_step")
    _assert_on_current_stream(rec)


def test_mixed_offloaded_parts(steps, gpu_env):
    fc, rec, mode = gpu_env
    mode("offload")
    texts = zopt.steps.BUILDERS["adamw"].text(comments=False, clip=1.0,
                                               classes={"bf16": dict(master="f32"), "f32": {}})
    cl = {c: steps.text(t) for c, t in texts.items()}
    ps = _params(2) + [torch.nn.Parameter(torch.randn(7).to(torch.bfloat16))]
    ps[-1].grad = torch.randn(7).to(torch.bfloat16)
    opt = zopt.Optimizer(cl, ps, lr=1e-2)
    assert isinstance(opt, zopt.mixed.MixedOptimizer)
    fc.capturing = True
    with pytest.raises(ZoptError, match="offloaded"):
        opt.step()
    assert not rec.calls("zopt_optimizer_step_linked")
    fc.capturing = False
    fc.stream = 0x5c00
    opt.step()
    (link,) = rec.calls("zopt_optimizer_step_linked")
    assert link[1] == (0x5c00, 0x5c00)  # every part on the current stream
    _assert_on_current_stream(rec)


def test_gpu_scaler_state_read_without_a_checkpoint(steps, gpu_env):
    """GPU steps keep the loss scaler on the device: state_dict() reads its
    scale and good-step count with zopt_optimizer_get_loss_scaler_state
    (which waits for the stream), not by saving a whole checkpoint to a
    temporary directory to read two numbers (issue 17)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    g = torch.Generator().manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(5 + 3 * i, generator=g).half()) for i in range(3)]
    opt = zopt.Optimizer(steps(rule="adamw", layout="f16_loss_scale"), ps, lr=1e-3,
                         loss_scaler=dict(init_scale=256.0, growth_interval=5))
    for _ in range(2):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 0.01 * opt.loss_scale).half()
        opt.step()
    n0 = len(rec.calls())
    ls = opt.state_dict()["zopt"]["loss_scaler"]
    names = [c[0] for c in rec.calls()[n0:]]
    assert "zopt_optimizer_save" not in names
    assert "zopt_optimizer_get_loss_scaler_state" in names
    assert (ls["scale"], ls["good_steps"], ls["growth_interval"]) == (256.0, 2, 5)
    _assert_on_current_stream(rec, n0)


def test_cpu_steps_untouched(steps, monkeypatch):
    """A CPU step never asks torch.cuda for anything (and its groups are
    plain dicts)."""
    def boom(*a, **k):
        raise AssertionError("torch.cuda used by a CPU step")
    for name in ("current_stream", "is_current_stream_capturing", "device",
                 "caching_allocator_alloc"):
        monkeypatch.setattr(torch.cuda, name, boom)
    ps = _params()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt.step()
    sched.step()
    opt.step()
    opt.step_count()
    assert not opt._parts[0].streams and all(type(g) is dict for g in opt.param_groups)


# ---- Step placement ---------------------------------------------------------------

def test_step_placement(steps):
    cpu = steps(rule="adamw", layout="f32")
    off = steps(rule="adamw", layout="f32", placement="offload")
    assert (cpu.gpu, cpu.on_device, cpu.offloaded) == (False, False, False)
    assert (off.gpu, off.on_device, off.offloaded) == (False, True, True)
    if HAVE_TOOLKIT:
        gpu = steps(rule="adamw", layout="f32", placement="gpu")
        assert (gpu.gpu, gpu.on_device, gpu.offloaded) == (True, True, False)


# ---- the real runtime against the stand-in driver (subprocess) ----------------------

@needs_fake
@needs_toolkit
def test_stand_in_driver_graph_replays_with_scheduler(steps, tmp_path):
    st = steps(rule="adamw", layout="f32", clip=1.0, placement="gpu")
    out = run_worker(__file__, "graph", st.path, tmp_path)
    assert out["refused_in_capture"].startswith("[BAD_STATE]")
    assert out["lr_in_group_after_refusal"] == 1e-3
    # each replay's PREPARE read the lr the scheduler set before that replay
    assert out["replay_lrs"] == out["scheduled_lrs"]
    assert out["step_count_after_replays"] == 4       # warm-up + 3 replays
    assert out["step_count_after_more"] == 6
    assert out["gpu_result_ok"]
    # torch's allocator: every buffer of finalize, on the stream current then,
    # 256-byte aligned; all given back at close
    assert out["allocs"] > 0 and out["alloc_streams"] == [out["construct_stream"]]
    assert out["freed"] == out["allocs"]
    assert out["bad_ranges"] == 0
    # torch's allocator failing: finalize fails with OUT_OF_MEMORY and says why
    assert out["alloc_failure"].startswith("[OUT_OF_MEMORY]")
    assert "CUDA out of memory (test)" in out["alloc_failure"]


@needs_fake
def test_stand_in_driver_offloaded_step(steps, tmp_path):
    st = steps(rule="adamw", layout="f32", placement="offload")
    cpu = steps(rule="adamw", layout="f32")
    out = run_worker(__file__, "offload", st.path + os.pathsep + cpu.path, tmp_path)
    assert out["refused_in_capture"].startswith("[UNSUPPORTED]")
    assert out["capture_ok"]  # nothing the capture forbids was done
    assert out["same_as_cpu"]  # scheduled lr, several streams: bit-identical to the CPU twin


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _worker(what, step_path, tmp):
    s = StandIn()
    fake, vp, cur, stream, dev_array = s.fake, ctypes.c_void_p, s.cur, s.stream, s.dev_array
    allocs, freed = s.allocs, s.freed
    rng = np.random.default_rng(0)
    sizes = [33, 1000, 5000]
    out = {}
    if what == "graph":
        fake.fake_cuda_set_emulation(1, 2000)  # kernels queued, 2 ms each
        st = zopt.Step(step_path)
        lr_i = list(st.hypers).index("lr")
        H = len(st.hypers)
        pairs = [(dev_array(n, rng.standard_normal(n)), dev_array(n, 0.01)) for n in sizes]
        out["construct_stream"] = cur["s"]
        opt = zopt.Optimizer(st, pairs, lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
        cs, rs = stream(), stream()
        cur["s"] = cs
        opt.step()  # warm-up on the capture stream
        fake.fake_cuda_drain_all()
        p0 = fake.fake_cuda_num_prepares()
        assert fake.cuStreamBeginCapture_v2(vp(cs), 0) == 0
        opt.step()
        try:
            opt.param_groups[0]["lr"] = 7e-4
            out["refused_in_capture"] = ""
        except zopt.ZoptError as e:
            out["refused_in_capture"] = str(e)
        out["lr_in_group_after_refusal"] = opt.param_groups[0]["lr"]
        graph, exe = vp(), vp()
        assert fake.cuStreamEndCapture(vp(cs), ctypes.byref(graph)) == 0
        assert fake.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
        cur["s"] = rs  # replays on another stream, as torch's graph.replay()
        sched_lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(3):
                if k:
                    sched.step()
                sched_lrs.append(opt.param_groups[0]["lr"])
                fake.cuGraphLaunch(exe, vp(rs))
        out["scheduled_lrs"] = sched_lrs
        out["step_count_after_replays"] = opt.step_count()
        seen = []
        h = (ctypes.c_double * 64)()
        for k in range(fake.fake_cuda_num_prepares() - p0):
            fake.fake_cuda_prepare_hypers(p0 + k, h, 64)
            seen.append(h[lr_i])
        out["replay_lrs"] = seen
        fake.cuGraphLaunch(exe, vp(rs))
        fake.cuGraphLaunch(exe, vp(rs))
        out["step_count_after_more"] = opt.step_count()
        opt.gpu_result()
        out["gpu_result_ok"] = True
        assert H <= 64
        out["allocs"] = len(allocs)
        out["alloc_streams"] = sorted({s for _, s in allocs})
        fake.fake_cuda_drain_all()
        opt.close()
        out["freed"] = len(freed)
        out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
        s.fail_alloc = True
        try:
            zopt.Optimizer(st, pairs, lr=1e-3)
            out["alloc_failure"] = ""
        except zopt.ZoptError as e:
            out["alloc_failure"] = str(e)
    elif what == "offload":
        off_path, cpu_path = step_path.split(os.pathsep)
        init = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        grads = [[rng.standard_normal(n).astype(np.float32) * 0.1 for n in sizes]
                 for _ in range(4)]
        dp = [(dev_array(n, w), dev_array(n)) for n, w in zip(sizes, init)]
        hp = [(w.copy(), np.zeros_like(w)) for w in init]
        o_dev = zopt.Optimizer(zopt.Step(off_path), dp, lr=1e-2)
        o_cpu = zopt.Optimizer(zopt.Step(cpu_path), hp, lr=1e-2)
        s_dev = torch.optim.lr_scheduler.StepLR(o_dev, 1, gamma=0.5)
        s_cpu = torch.optim.lr_scheduler.StepLR(o_cpu, 1, gamma=0.5)
        streams = [stream(), stream()]
        for k, gs in enumerate(grads):
            cur["s"] = streams[k % 2]
            for (_, g), (_, hg), x in zip(dp, hp, gs):
                g[:] = x
                hg[:] = x
            o_dev.step()
            o_cpu.step()
            s_dev.step()
            s_cpu.step()
        cs = stream()
        cur["s"] = cs
        assert fake.cuStreamBeginCapture_v2(vp(cs), 0) == 0
        try:
            o_dev.step()
            out["refused_in_capture"] = ""
        except zopt.ZoptError as e:
            out["refused_in_capture"] = str(e)
        graph = vp()
        out["capture_ok"] = fake.cuStreamEndCapture(vp(cs), ctypes.byref(graph)) == 0
        cur["s"] = streams[0]
        o_dev.step_count()  # waits for the last step's param copies
        fake.fake_cuda_drain_all()
        out["same_as_cpu"] = all(np.array_equal(a, b) for (a, _), (b, _) in zip(dp, hp))
        o_dev.close()
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

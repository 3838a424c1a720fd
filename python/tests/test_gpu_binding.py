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
"""
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import zopt
import zopt.mixed
import zopt.optimizer as zo
from zopt._lib import Status, ZoptError

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

# Calls that enqueue work on the optimizer's stream or read device state.
DEVICE_CALLS = {
    "zopt_optimizer_finalize", "zopt_optimizer_step", "zopt_optimizer_step_linked",
    "zopt_optimizer_set_hyper", "zopt_optimizer_gpu_result",
    "zopt_optimizer_get_step_count", "zopt_optimizer_get_tensor_step",
    "zopt_optimizer_get_loss_scale", "zopt_optimizer_read_state_f32",
    "zopt_optimizer_write_state_f32", "zopt_optimizer_read_state_raw",
    "zopt_optimizer_write_state_raw", "zopt_optimizer_save", "zopt_optimizer_load_ex",
    "zopt_optimizer_configure_loss_scaler", "zopt_optimizer_set_grad_divisor",
    "zopt_optimizer_refresh_master", "zopt_optimizer_set_tensor_step",
    "zopt_optimizer_set_group_flags",
}


class FakeCuda:
    """What the binding uses of torch.cuda, recorded."""

    def __init__(self, log):
        self.log = log
        self.stream = 0x5100
        self.capturing = False
        self.allocs = []    # (size, device, stream) -> pointer
        self.deletes = []
        self.next_ptr = 0x7f0000000000

    def is_available(self):
        return True

    def current_stream(self, device=None):
        self.log.append(("current_stream", device))
        return types.SimpleNamespace(cuda_stream=self.stream)

    def is_current_stream_capturing(self):
        return self.capturing

    @contextlib.contextmanager
    def device(self, d):
        self.log.append(("device_enter", d))
        try:
            yield
        finally:
            self.log.append(("device_exit", d))

    def caching_allocator_alloc(self, size, device=None, stream=None):
        p = self.next_ptr
        self.next_ptr += (size + 511) // 512 * 512
        self.allocs.append((size, device, stream, p))
        return p

    def caching_allocator_delete(self, ptr):
        self.deletes.append(ptr)

    def install(self, mp):
        for name in ("is_available", "current_stream", "is_current_stream_capturing",
                     "device", "caching_allocator_alloc", "caching_allocator_delete"):
            mp.setattr(torch.cuda, name, getattr(self, name))


class RecordingLib:
    """The runtime library, every call recorded as (name, the stream the
    native optimizer holds, torch's current stream, capturing). GPU-only
    calls are answered here (the real runtime runs the CPU step)."""

    def __init__(self, real, fc, log):
        self._real, self._fc, self.log = real, fc, log
        self.stream_of = {}    # native handle -> the stream it was given
        self.allocators = []   # (handle, zopt_device_allocator copy)

    def _handle_of(self, name, args):
        if not args or name == "zopt_optimizer_step_linked":
            return None
        a = args[0]
        return a.value if isinstance(a, ctypes.c_void_p) else a

    def calls(self, name=None):
        return [c for c in self.log if isinstance(c, tuple) and c[0].startswith("zopt_")
                and (name is None or c[0] == name)]

    def __getattr__(self, name):
        if not name.startswith("zopt_"):
            return getattr(self._real, name)
        real = getattr(self._real, name)
        fc = self._fc

        def call(*args):
            h = self._handle_of(name, args)
            if name == "zopt_optimizer_step_linked":
                arr, n = args[0], args[1]
                held = tuple(self.stream_of.get(arr[i]) for i in range(n))
            else:
                held = self.stream_of.get(h)
            self.log.append((name, held, fc.stream, fc.capturing, args))
            if name == "zopt_optimizer_set_stream":
                self.stream_of[h] = args[1].value
                return 0
            if name == "zopt_optimizer_set_device_allocator":
                a = args[1]._obj
                self.allocators.append((h, zopt._gpu.DeviceAllocatorC(a.alloc, a.free, a.user)))
                return 0
            if name == "zopt_optimizer_gpu_result":
                r = args[1]._obj
                r.grad_norm, r.skipped, r.loss_scale = 0.25, 0, 1.0
                return 0
            return real(*args)
        return call


@pytest.fixture
def gpu_env(monkeypatch):
    """(FakeCuda, RecordingLib, mode setter): mode 'gpu' makes every Step a
    GPU step, 'offload' an offloaded one; torch params are marked as CUDA
    params (their device is what torch.cuda.device gets)."""
    log = []
    fc = FakeCuda(log)
    fc.install(monkeypatch)
    rec = RecordingLib(zopt._native.lib(), fc, log)
    monkeypatch.setattr(zopt._native, "lib", lambda: rec)

    def mode(m):
        monkeypatch.setattr(zo.Step, "gpu", property(lambda s: m == "gpu"))
        monkeypatch.setattr(zo.Step, "on_device", property(lambda s: True))

    orig_entry = zopt._params.make_entry

    def entry(step, gid, i, p):
        e = orig_entry(step, gid, i, p)
        e.cuda = e.torch
        return e
    monkeypatch.setattr(zopt._params, "make_entry", entry)
    return fc, rec, mode


def _params(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5 + 3 * i, generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    return ps


def _assert_on_current_stream(rec, since=0):
    bad = [(c[0], hex(c[1] or 0), hex(c[2])) for c in rec.log[since:]
           if isinstance(c, tuple) and c[0] in DEVICE_CALLS
           and (c[1] != c[2] if not isinstance(c[1], tuple) else any(x != c[2] for x in c[1]))]
    assert not bad, f"calls on another stream than torch's current one: {bad}"


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
        sub = [c[0] for c in rec.calls()[len(rec.calls()) - (len(rec.log) - n0):]]
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


# ---- frozen params of GPU steps -------------------------------------------------------

LR, WD = 1e-2, 0.1


def _mlp(seed=0, frozen=True):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if frozen:
        m[0].weight.requires_grad_(False)  # a frozen base weight (LoRA, embeddings)
    return m


def _train(model, opt, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _close(a, b, rtol=2e-5, atol=1e-6):
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=rtol, atol=atol)


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _built(rec, opt):
    """(group, param pointer, grad pointer, numel) of every tensor the
    native optimizer now running was given."""
    return [(c[4][1], c[4][2].value, c[4][3].value, c[4][4])
            for c in rec.calls("zopt_optimizer_add_tensor") if c[4][0].value == opt._h.value]


def test_gpu_step_leaves_frozen_params_out(steps, gpu_env, tmp_path):
    """A model with a frozen weight in model.parameters() on a GPU step (no
    per-tensor skip on the device): the frozen weight is left out of the
    native optimizer (an empty slot: no state or gradient memory, never
    written), the others are stepped bit for bit as by the same step built
    on the trainable params only (and as torch.optim.AdamW)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr, mt = _mlp(), _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, [p for p in mr.parameters() if p.requires_grad], lr=LR,
                         weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    w = mz[0].weight
    assert oz._parts[0].excluded == {0} and len(oz.param_groups[0]["params"]) == 4
    built = _built(rec, oz)
    assert built[0] == (0, None, None, 0)  # an empty slot: tensor ids stay param indices
    assert all(n > 0 and pp and gp for _, pp, gp, n in built[1:])
    assert oz.memory_info()["state_bytes"] == orf.memory_info()["state_bytes"]
    assert sum(f.numel() for f in oz._parts[0].grad_flats) == sum(f.numel() for f in orf._parts[0].grad_flats)
    w0 = w.detach().clone()
    for i in range(3):
        for m, o in ((mz, oz), (mr, orf), (mt, ot)):
            _train(m, o, i)
    assert torch.equal(w, w0) and w.grad is None
    assert _same(list(mz.parameters())[1:], list(mr.parameters())[1:])
    _close(mz.parameters(), mt.parameters())
    assert oz.last_metrics["active_tensors"] == 3
    assert oz.last_metrics["updated_elems"] == sum(p.numel() for p in mr.parameters()
                                                   if p.requires_grad)
    # state: empty for the frozen weight, as torch's
    assert oz.state[w] == {} and w not in oz.state and len(oz.state) == 3
    assert oz.tensor_step(w) == 0 and oz.tensor_step(mz[0].bias) == 3
    with pytest.raises(ZoptError, match="left out"):
        oz.state[w] = {"exp_avg": torch.zeros(8, 6)}
    with pytest.raises(ZoptError, match="left out"):
        oz.read_state(w, "exp_avg")
    del oz.state[w]  # nothing to reset
    sd = oz.state_dict()
    assert sorted(sd["state"]) == [1, 2, 3] and sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    t2 = torch.optim.AdamW(_mlp().parameters(), lr=LR)
    t2.load_state_dict(sd)  # torch's layout: loads into torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        oz.load_state_dict(sd)
    oz.save(tmp_path / "ck")
    oz.load(tmp_path / "ck")
    # a torch state_dict with states for the weight (trained there): dropped, with a warning
    mt[0].weight.requires_grad_(True)
    _train(mt, ot, 3)
    with pytest.warns(UserWarning, match=r"left out .*\['params'\]\[0\]"):
        oz.load_state_dict(ot.state_dict())
    assert oz.state[w] == {} and oz.tensor_step(mz[2].weight) == 4
    assert torch.equal(w, w0)


def test_gpu_step_frozen_params_in_a_new_group_and_other_dtypes(steps, gpu_env):
    """add_param_group: its frozen params are left out too, whatever their
    dtype (a frozen bf16 table beside an f32 step); the rebuilt optimizer
    keeps stepping bit for bit as one over the trainable params only. A
    param left out that is unfrozen with a dtype the step cannot update is
    refused then, naming it."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr = _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, [p for p in mr.parameters() if p.requires_grad], lr=LR,
                         weight_decay=WD)
    for i in range(2):
        _train(mz, oz, i)
        _train(mr, orf, i)
    torch.manual_seed(5)
    table = torch.nn.Parameter(torch.randn(10, 4).to(torch.bfloat16), requires_grad=False)
    frozen32 = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    head_z = torch.nn.Parameter(torch.randn(3, 3))
    head_r = torch.nn.Parameter(head_z.detach().clone())
    oz.add_param_group({"params": [table, head_z, frozen32], "lr": 5e-3})
    orf.add_param_group({"params": [head_r], "lr": 5e-3})
    assert oz._parts[0].excluded == {0, 4, 6} and oz.rebuilds == 1
    t0 = table.detach().clone()
    for i in range(2, 5):
        for m, o, h in ((mz, oz, head_z), (mr, orf, head_r)):
            g = torch.Generator().manual_seed(100 + i)
            x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x) @ h, y).backward()
            o.step()
    assert _same(list(mz.parameters())[1:] + [head_z], list(mr.parameters())[1:] + [head_r])
    assert torch.equal(table.view(torch.int16), t0.view(torch.int16))
    assert oz.state[table] == {} and oz.tensor_step(head_z) == 3
    table.requires_grad_(True)
    table.grad = torch.ones_like(table)
    for p in oz.param_groups[0]["params"][1:] + [head_z]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ZoptError, match=r"param_groups\[1\]\['params'\]\[0\].*bf16"):
        oz.step()
    assert torch.equal(table.view(torch.int16), t0.view(torch.int16))


def test_gpu_step_unfrozen_param_joins_with_fresh_states(steps, gpu_env, tmp_path):
    """A frozen weight unfrozen after 3 steps: from its first gradient on it
    is stepped, starting from zero states and step 0 like torch's lazily
    created state. GPU steps count steps per group, so it joins in a native
    group of its own (step count 0, the param group's hyperparameters);
    state_dict() and save() carry that into a new optimizer (all params
    trainable at build), which steps on bit for bit."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mt = _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    w, wt = mz[0].weight, mt[0].weight
    for i in range(3):
        _train(mz, oz, i)
        _train(mt, ot, i)
    assert oz.rebuilds == 0 and oz._parts[0].excluded == {0}
    w.requires_grad_(True)
    wt.requires_grad_(True)
    for i in range(3, 6):
        _train(mz, oz, i)
        _train(mt, ot, i)
        _close(mz.parameters(), mt.parameters())
        assert float(oz.state[w]["step"]) == float(ot.state[wt]["step"]) == i - 2
        _close([oz.state[w]["exp_avg"], oz.state[w]["exp_avg_sq"]],
               [ot.state[wt]["exp_avg"], ot.state[wt]["exp_avg_sq"]])
    assert oz.rebuilds == 1 and not oz._parts[0].excluded
    assert oz._parts[0].cohort_gid == [0] and oz._parts[0].cohort_of == {0: 0}
    assert [b[0] for b in _built(rec, oz)] == [1, 0, 0, 0]  # native group 1: its own
    assert oz._parts[0].native_steps() == [6, 3] and oz.step_count(0) == 6
    assert oz.tensor_step(w) == 3 and oz.tensor_step(mz[0].bias) == 6
    # a scheduler's lr reaches both native groups of param group 0
    n = len(rec.calls("zopt_optimizer_set_hyper"))
    oz.param_groups[0]["lr"] = 5e-3
    assert sorted(c[4][1] for c in rec.calls("zopt_optimizer_set_hyper")[n:]) == [0, 1]
    assert oz.get_hyper(0, "lr") == 5e-3
    # state_dict() into a new optimizer whose weight is trainable from the start
    sd = oz.state_dict()
    assert sd["zopt"]["group_steps"] == [6]
    m2 = _mlp(frozen=False)
    m2.load_state_dict(mz.state_dict())
    o2 = zopt.Optimizer(st, m2.parameters(), lr=LR, weight_decay=WD)
    assert not o2._parts[0].excluded and not o2._parts[0].cohort_gid
    o2.load_state_dict(sd)
    assert zopt._cohorts.partition(o2._parts[0].cohort_of) == {frozenset({0})} and o2._parts[0].native_steps() == [6, 3]
    assert o2.param_groups[0]["lr"] == 5e-3 and o2.get_hyper(0, "lr") == 5e-3
    # save() / load(): the file's native groups
    oz.save(tmp_path / "ck")
    m3 = _mlp(frozen=False)
    m3.load_state_dict(mz.state_dict())
    o3 = zopt.Optimizer(st, m3.parameters(), lr=LR, weight_decay=WD)
    o3.load(tmp_path / "ck")
    assert o3._parts[0].cohort_of == {0: 0} and o3._parts[0].native_steps() == [6, 3]
    for i in range(6, 8):
        for m, o in ((mz, oz), (m2, o2), (m3, o3)):
            _train(m, o, i)
    assert _same(mz.parameters(), m2.parameters()) and _same(mz.parameters(), m3.parameters())
    assert o2.tensor_step(m2[0].weight) == o3.tensor_step(m3[0].weight) == 5
    # a load that fails after the regrouping puts the old native optimizer back
    m4 = _mlp(frozen=False)
    o4 = zopt.Optimizer(st, m4.parameters(), lr=LR, weight_decay=WD)
    _train(m4, o4, 0)
    before = o4.state_dict()
    real = zopt._rebuild.restore

    def failing(c, snap, **kw):
        zopt._rebuild.restore = real
        raise ZoptError(Status.CHECKPOINT, "refused (test)")
    zopt._rebuild.restore = failing
    with pytest.raises(ZoptError, match="refused"):
        o4.load_state_dict(sd)
    assert o4.rebuilds == 2 and not o4._parts[0].cohort_gid and o4._parts[0].native_steps() == [1]
    after = o4.state_dict()
    for t in before["state"]:
        for k in before["state"][t]:
            assert torch.equal(before["state"][t][k], after["state"][t][k])


def test_gpu_step_unfrozen_before_the_first_step(steps, gpu_env):
    """Unfrozen before any step: it joins its param group's own native
    group (the count is 0 there too)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr = _mlp(), _mlp(frozen=False)
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, mr.parameters(), lr=LR, weight_decay=WD)
    mz[0].weight.requires_grad_(True)
    for i in range(3):
        _train(mz, oz, i)
        _train(mr, orf, i)
    assert oz.rebuilds == 1 and not oz._parts[0].excluded and not oz._parts[0].cohort_gid
    assert _same(mz.parameters(), mr.parameters())


def test_gpu_step_f32_grads_frozen_param_joins_with_hooks(steps, gpu_env):
    """bf16 params with f32 gradients (p.main_grad, accumulated by hooks):
    a frozen param has no hook and no main_grad buffer; unfrozen, its
    p.grad of the first backward is accumulated at step() and it joins
    (hooked from then on)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps.text(zopt.steps.adamw.text(param="bf16", grad="f32", master="f32",
                                          comments=False))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (5, 7, 9)]
    ps[1].requires_grad_(False)
    opt = zopt.Optimizer(st, ps, lr=1e-2)
    assert opt._parts[0].excluded == {1} and len(opt._parts[0].acc_hooks) == 2
    frozen0 = ps[1].detach().clone()

    def backward():
        (sum((p.float() ** 2).sum() for p in ps)).backward()
    backward()
    opt.step()
    assert torch.equal(ps[1], frozen0) and getattr(ps[1], "main_grad", None) is None
    ps[1].requires_grad_(True)
    backward()
    assert ps[1].grad is not None  # no hook yet: taken at step()
    opt.step()
    assert opt.rebuilds == 1 and not opt._parts[0].excluded and len(opt._parts[0].acc_hooks) == 3
    assert opt.tensor_step(ps[1]) == 1 and opt.tensor_step(ps[0]) == 2
    assert not torch.equal(ps[1], frozen0) and ps[1].main_grad.dtype == torch.float32
    opt.zero_grad()
    backward()
    assert ps[1].grad is None and ps[1].main_grad is not None  # the hook took it
    opt.step()
    assert opt.tensor_step(ps[1]) == 2


def test_gpu_step_param_without_grad_refused(steps, gpu_env):
    """A param that requires grad but has no gradient at a GPU step: a
    ZoptError naming it (GPU steps have no per-tensor skip), nothing
    updated, at every such step; no gradient at all is a no-op (torch's).
    Offloaded steps (updated on the CPU) skip it as torch does."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    ps = _params()
    ps[1].grad = None
    opt = zopt.Optimizer(st, ps, lr=1e-2)
    before = [p.detach().clone() for p in ps]
    for _ in range(2):
        with pytest.raises(ZoptError) as e:
            opt.step()
        assert e.value.code == Status.UNSUPPORTED
        msg = str(e.value)
        assert "param_groups[0]['params'][1] (shape (8,), float32)" in msg
        assert "no gradient" in msg and "GPU" in msg and "requires_grad=False" in msg
        assert "['params'][0]" not in msg and "(1 of 3 params)" in msg
    assert not rec.calls("zopt_optimizer_step") and _same(ps, before)
    ps[1].grad = torch.ones_like(ps[1])
    opt.step()
    assert len(rec.calls("zopt_optimizer_step")) == 1
    assert all(opt.tensor_step(p) == 1 for p in ps)
    opt.zero_grad(set_to_none=True)
    after = [p.detach().clone() for p in ps]
    opt.step()  # no gradient at all: nothing happens, as in torch
    assert opt.last_metrics["no_grads"] and _same(ps, after)
    ps[0].grad = torch.ones_like(ps[0])
    with pytest.raises(ZoptError, match=r"\(2 of 3 params\)"):
        opt.step()
    mode("offload")
    qs = _params(seed=1)
    qs[1].grad = None
    q1 = qs[1].detach().clone()
    off = zopt.Optimizer(st, qs, lr=1e-2)
    off.step()
    assert torch.equal(qs[1], q1) and off.tensor_step(qs[1]) == 0 and off.tensor_step(qs[0]) == 1


# ---- Step placement ---------------------------------------------------------------

CUDA_ROOT = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
HAVE_TOOLKIT = os.path.exists(os.path.join(CUDA_ROOT, "bin", "ptxas"))
needs_toolkit = pytest.mark.skipif(not HAVE_TOOLKIT,
                                   reason="no CUDA toolkit (ptxas) to compile GPU steps")


def test_step_placement(steps):
    cpu = steps(rule="adamw", layout="f32")
    off = steps(rule="adamw", layout="f32", placement="offload")
    assert (cpu.gpu, cpu.on_device, cpu.offloaded) == (False, False, False)
    assert (off.gpu, off.on_device, off.offloaded) == (False, True, True)
    if HAVE_TOOLKIT:
        gpu = steps(rule="adamw", layout="f32", placement="gpu")
        assert (gpu.gpu, gpu.on_device, gpu.offloaded) == (True, True, False)


# ---- the real runtime against the stand-in driver (subprocess) ----------------------

def _fake_driver():
    from zopt._lib import find_runtime_library
    lib = find_runtime_library()
    if lib is None:
        return None
    p = os.path.join(os.path.dirname(lib), "libzopt-fake-cuda.so")
    return p if os.path.exists(p) else None


FAKE = _fake_driver()
needs_fake = pytest.mark.skipif(FAKE is None, reason="libzopt-fake-cuda.so not built")


def _run_worker(what, step_path, tmp_path):
    env = dict(os.environ, ZOPT_CUDA_DRIVER=FAKE,
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), what, step_path,
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"worker failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_fake
@needs_toolkit
def test_stand_in_driver_graph_replays_with_scheduler(steps, tmp_path):
    st = steps(rule="adamw", layout="f32", clip=1.0, placement="gpu")
    out = _run_worker("graph", st.path, tmp_path)
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
@needs_toolkit
def test_stand_in_driver_frozen_params(steps, tmp_path):
    """The real runtime's GPU host path with a frozen param left out (an
    empty slot in the device tables) and unfrozen later (a native group of
    its own, its count advanced by the emulated FINISH from 0)."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    out = _run_worker("frozen", st.path, tmp_path)
    assert out["excluded"] == [1]
    assert out["state_bytes"][0] == out["state_bytes"][1] > 0  # as without the frozen param
    assert out["counts_before"] == [3]
    assert out["o0"] == [[3], [1], 2]  # save/load and state_dict with the empty slot
    assert "['params'][0]" in out["missing"] and "no gradient" in out["missing"]
    assert out["rebuilds"] == 1 and out["cohorts"] == [0]
    assert out["counts_after"] == [5, 2] and out["tensor_steps"] == [5, 2, 5]
    assert out["lr_table"] == [5e-4, 5e-4]  # the scheduler's lr in both native groups
    assert out["o2_counts"] == [6, 3] and out["o2_cohorts"] == [[1]]
    assert out["o3_counts"] == [6, 3] and out["o3_cohorts"] == [[1]]
    assert out["bad_ranges"] == 0


@needs_fake
def test_stand_in_driver_offloaded_step(steps, tmp_path):
    st = steps(rule="adamw", layout="f32", placement="offload")
    cpu = steps(rule="adamw", layout="f32")
    out = _run_worker("offload", st.path + os.pathsep + cpu.path, tmp_path)
    assert out["refused_in_capture"].startswith("[UNSUPPORTED]")
    assert out["capture_ok"]  # nothing the capture forbids was done
    assert out["same_as_cpu"]  # scheduled lr, several streams: bit-identical to the CPU twin


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _worker(what, step_path, tmp):
    fake = ctypes.CDLL(os.environ["ZOPT_CUDA_DRIVER"])
    fake.cuInit(0)
    vp = ctypes.c_void_p

    def stream():
        s = vp()
        assert fake.cuStreamCreate(ctypes.byref(s), 0) == 0
        return s.value

    cur = {"s": stream()}

    def capturing():
        st = ctypes.c_int(0)
        fake.cuStreamIsCapturing(vp(cur["s"]), ctypes.byref(st))
        return st.value != 0

    allocs, freed = [], []
    fail_alloc = False

    def alloc(size, device=None, stream=None):
        if fail_alloc:
            raise RuntimeError("CUDA out of memory (test)")
        p = ctypes.c_ulonglong()
        assert fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)) == 0
        allocs.append((p.value, stream))
        assert p.value % 256 == 0
        return p.value

    def delete(ptr):
        freed.append(ptr)
        fake.cuMemFree_v2(ctypes.c_ulonglong(ptr))

    torch.cuda.is_available = lambda: True
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=cur["s"])
    torch.cuda.is_current_stream_capturing = capturing
    torch.cuda.caching_allocator_alloc = alloc
    torch.cuda.caching_allocator_delete = delete

    def dev_array(n, fill=None):
        p = ctypes.c_ulonglong()
        assert fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4 * n)) == 0
        a = np.frombuffer((ctypes.c_char * (4 * n)).from_address(p.value), dtype=np.float32)
        a[:] = fill if fill is not None else 0
        return a

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
        fail_alloc = True
        try:
            zopt.Optimizer(st, pairs, lr=1e-3)
            out["alloc_failure"] = ""
        except zopt.ZoptError as e:
            out["alloc_failure"] = str(e)
    elif what == "frozen":
        fake.fake_cuda_set_emulation(1, 0)  # FINISH counts steps, PREPARE records the table
        st = zopt.Step(step_path)
        lr_i, H = list(st.hypers).index("lr"), len(st.hypers)
        real_alloc = zopt._grads.alloc_grads

        def alloc_grads(c, entries):  # the grad buffers in the stand-in's device memory
            zeros = torch.zeros
            torch.zeros = lambda n, dtype=None, device=None: torch.from_numpy(dev_array(n))
            try:
                return real_alloc(c, entries)
            finally:
                torch.zeros = zeros
        zopt._grads.alloc_grads = alloc_grads

        def params(trainable=(True, False, True)):
            return [torch.nn.Parameter(torch.from_numpy(dev_array(n, rng.standard_normal(n))),
                                       requires_grad=r) for n, r in zip(sizes, trainable)]

        def grads(ps):
            for p in ps:
                if p.requires_grad:
                    p.grad = torch.full(p.shape, 0.01)
        ps = params()
        opt = zopt.Optimizer(st, ps, lr=1e-3)
        twin = zopt.Optimizer(st, [p for p in params() if p.requires_grad], lr=1e-3)
        out["excluded"] = sorted(opt._parts[0].excluded)
        out["state_bytes"] = [opt.memory_info()["state_bytes"],
                              twin.memory_info()["state_bytes"]]
        for _ in range(3):
            grads(ps)
            opt.step()
        out["counts_before"] = opt._parts[0].native_steps()
        opt.save(os.path.join(tmp, "ck0"))  # with the empty slot
        o0 = zopt.Optimizer(st, params(), lr=1e-3)
        o0.load(os.path.join(tmp, "ck0"))
        o0.load_state_dict(opt.state_dict())
        out["o0"] = [o0._parts[0].native_steps(), sorted(o0._parts[0].excluded), len(o0.state_dict()["state"])]
        o0.close()
        ps[0].grad = None
        try:
            opt.step()
            out["missing"] = ""
        except zopt.ZoptError as e:
            out["missing"] = str(e)
        ps[1].requires_grad_(True)
        for _ in range(2):
            grads(ps)
            opt.step()
        out["rebuilds"], out["cohorts"] = opt.rebuilds, opt._parts[0].cohort_gid
        out["counts_after"] = opt._parts[0].native_steps()
        out["tensor_steps"] = [opt.tensor_step(p) for p in ps]
        opt.param_groups[0]["lr"] = 5e-4
        grads(ps)
        opt.step()
        opt.step_count()  # waits for the step
        h = (ctypes.c_double * (2 * H))()
        fake.fake_cuda_prepare_hypers(fake.fake_cuda_num_prepares() - 1, h, 2 * H)
        out["lr_table"] = [h[lr_i], h[H + lr_i]]
        sd = opt.state_dict()
        o2 = zopt.Optimizer(st, params((True, True, True)), lr=1e-3)
        o2.load_state_dict(sd)
        out["o2_counts"] = o2._parts[0].native_steps()
        out["o2_cohorts"] = sorted(map(sorted, zopt._cohorts.partition(o2._parts[0].cohort_of)))
        opt.save(os.path.join(tmp, "ck"))
        o3 = zopt.Optimizer(st, params((True, True, True)), lr=1e-3)
        o3.load(os.path.join(tmp, "ck"))
        out["o3_counts"] = o3._parts[0].native_steps()
        out["o3_cohorts"] = sorted(map(sorted, zopt._cohorts.partition(o3._parts[0].cohort_of)))
        fake.fake_cuda_drain_all()
        for o in (opt, twin, o2, o3):
            o.close()
        out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
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

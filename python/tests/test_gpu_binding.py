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
                self.allocators.append((h, zo._DeviceAllocatorC(a.alloc, a.free, a.user)))
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
    rec = RecordingLib(zo.lib(), fc, log)
    monkeypatch.setattr(zo, "lib", lambda: rec)
    monkeypatch.setattr(zopt.mixed, "lib", lambda: rec)

    def mode(m):
        monkeypatch.setattr(zo.Step, "gpu", property(lambda s: m == "gpu"))
        monkeypatch.setattr(zo.Step, "on_device", property(lambda s: True))

    orig_entry = zo.Optimizer._entry

    def entry(self, gid, i, p):
        e = orig_entry(self, gid, i, p)
        e.cuda = e.torch
        return e
    monkeypatch.setattr(zo.Optimizer, "_entry", entry)
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
    assert opt._streams and not opt._offload
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
    assert all(isinstance(g, zo._GpuGroup) for g in opt.param_groups)
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
    keep = opt._dev_alloc
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
    assert len(rec.allocators) == 2 and opt._dev_alloc.c.alloc is not None
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
    assert opt._offload and not any(isinstance(g, zo._GpuGroup) for g in opt.param_groups)
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
    assert not opt._streams and all(type(g) is dict for g in opt.param_groups)


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

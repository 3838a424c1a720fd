"""What the tests of the binding's GPU path use without a GPU
(test_gpu_binding.py, test_gpu_frozen.py; docs/GPU.md "What the Python
binding does"):

- recording tests: ``make_gpu_env`` (conftest.py's ``gpu_env`` fixture),
  a fake ``torch.cuda`` (current stream,
  capture flag, device context, caching allocator) and a recorder around
  the runtime library that forwards every C call to the real runtime
  except the GPU-only ones (set_stream, set_device_allocator, gpu_result),
  which it records, over a real CPU step made to look like a GPU (or
  offloaded) step;
- stand-in driver tests: :func:`run_worker` runs a test file's worker in a
  subprocess with ZOPT_CUDA_DRIVER pointing at the stand-in driver
  (test/Integration/GPUHost/fake-cuda.cpp), and :class:`StandIn` is that
  worker's side: torch.cuda over the stand-in's streams, capture and
  memory; :func:`same_as_twin_close_to_torch` its check after a step;
  :func:`cuda_params`, :func:`device_tensors` and :func:`grads_on_device`
  make the worker's params, tensors and gradient buffers (of any dtype)
  those of the stand-in's device memory.
"""
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import zopt
import zopt.optimizer as zo

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
    "zopt_optimizer_set_group_flags", "zopt_optimizer_set_active",
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


def make_gpu_env(monkeypatch):
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


def params_with_grads(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5 + 3 * i, generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    return ps


def assert_on_current_stream(rec, since=0):
    bad = [(c[0], hex(c[1] or 0), hex(c[2])) for c in rec.log[since:]
           if isinstance(c, tuple) and c[0] in DEVICE_CALLS
           and (c[1] != c[2] if not isinstance(c[1], tuple) else any(x != c[2] for x in c[1]))]
    assert not bad, f"calls on another stream than torch's current one: {bad}"


CUDA_ROOT = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
HAVE_TOOLKIT = os.path.exists(os.path.join(CUDA_ROOT, "bin", "ptxas"))
needs_toolkit = pytest.mark.skipif(not HAVE_TOOLKIT,
                                   reason="no CUDA toolkit (ptxas) to compile GPU steps")


def _fake_driver():
    from zopt._lib import find_runtime_library
    lib = find_runtime_library()
    if lib is None:
        return None
    p = os.path.join(os.path.dirname(lib), "libzopt-fake-cuda.so")
    return p if os.path.exists(p) else None


FAKE = _fake_driver()
needs_fake = pytest.mark.skipif(FAKE is None, reason="libzopt-fake-cuda.so not built")


def same_as_twin_close_to_torch(opt, cpu, ps, hs, ts):
    """After a step of the stand-in GPU optimizer ``opt`` (params ``ps``),
    its CPU twin ``cpu`` (``hs``) and torch's reference (``ts``): (the
    params and every state bit-identical to the twin's, the params close
    to torch's, opt's state_dict states) -- the stand-in workers' check."""
    opt.step_count()  # waits for the step
    sd, sc = opt.state_dict()["state"], cpu.state_dict()["state"]
    same = all(torch.equal(p, h) for p, h in zip(ps, hs)) and sorted(sd) == sorted(sc)
    same = same and all(torch.equal(sd[i][key], sc[i][key]) for i in sd for key in sd[i])
    close = all(np.allclose(p.detach().numpy(), q.detach().numpy(), rtol=2e-5, atol=1e-6)
                for p, q in zip(ps, ts))
    return same, close, sd


def run_worker(script, what, step_path, tmp_path, **env_extra):
    """Runs ``script``'s worker (its ``__main__``) against the stand-in driver
    (where it is built; a worker of CPU copies only runs without): the JSON
    it prints last."""
    env = dict(os.environ, **env_extra,
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    if FAKE is not None:
        env["ZOPT_CUDA_DRIVER"] = FAKE
    r = subprocess.run([sys.executable, os.path.abspath(script), what, step_path,
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"worker failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


class StandIn:
    """The worker's side (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so):
    torch.cuda's current stream is ``cur["s"]`` (a stand-in stream), its
    capture flag the stand-in's, its caching allocator the stand-in's
    memory (``allocs``, ``freed``; ``fail_alloc`` makes it raise);
    :meth:`dev_array` gives f32 arrays in device memory and
    :meth:`grads_on_device` puts the binding's gradient buffers there."""

    def __init__(self):
        self.fake = fake = ctypes.CDLL(os.environ["ZOPT_CUDA_DRIVER"])
        fake.cuInit(0)
        self.cur = {"s": self.stream()}
        self.allocs, self.freed, self.fail_alloc = [], [], False
        torch.cuda.is_available = lambda: True
        torch.cuda.current_stream = \
            lambda device=None: types.SimpleNamespace(cuda_stream=self.cur["s"])
        torch.cuda.is_current_stream_capturing = self.capturing
        torch.cuda.caching_allocator_alloc = self.alloc
        torch.cuda.caching_allocator_delete = self.delete

    def stream(self):
        s = ctypes.c_void_p()
        assert self.fake.cuStreamCreate(ctypes.byref(s), 0) == 0
        return s.value

    def capturing(self):
        st = ctypes.c_int(0)
        self.fake.cuStreamIsCapturing(ctypes.c_void_p(self.cur["s"]), ctypes.byref(st))
        return st.value != 0

    def alloc(self, size, device=None, stream=None):
        if self.fail_alloc:
            raise RuntimeError("CUDA out of memory (test)")
        p = ctypes.c_ulonglong()
        assert self.fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)) == 0
        self.allocs.append((p.value, stream))
        assert p.value % 256 == 0
        return p.value

    def delete(self, ptr):
        self.freed.append(ptr)
        self.fake.cuMemFree_v2(ctypes.c_ulonglong(ptr))

    def dev_array(self, n, fill=None):
        p = ctypes.c_ulonglong()
        assert self.fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4 * n)) == 0
        a = np.frombuffer((ctypes.c_char * (4 * n)).from_address(p.value), dtype=np.float32)
        a[:] = fill if fill is not None else 0
        return a

    def close_all(self, out, *opts):
        """Every copy done, the optimizers closed, out["bad_ranges"]: the
        stand-in's count of bad ranges."""
        self.fake.fake_cuda_drain_all()
        for o in opts:
            o.close()
        out["bad_ranges"] = self.fake.fake_cuda_num_bad_ranges()

    def grads_on_device(self):
        """zopt._grads.alloc_grads makes the gradient buffers in the
        stand-in's device memory (f32 arrays: dev_array)."""
        grads_on_device(lambda shape, fill, dtype: torch.from_numpy(self.dev_array(shape[0])))


# ---- a stand-in worker's params, tensors and gradient buffers in device memory ----

def cuda_params():
    """The stand-in's memory in CPU tensors counts as CUDA params (also
    for a param left out at build that joins later: zopt._frozen lays it
    out again, which read ``e.cuda`` from the CPU tensor's device; the
    host's write sampler then watched the stand-in's device memory, read
    before the queued step wrote it, and remade the master from the param:
    a harness artifact the overlap fuzzer found)."""
    make_entry, layout = zopt._params.make_entry, zopt._params.layout

    def entry(step, gid, i, p):
        e = make_entry(step, gid, i, p)
        e.cuda = e.torch and step.on_device
        return e

    def lay(step, e):
        r = layout(step, e)
        e.cuda = e.torch and step.on_device
        return r
    zopt._params.make_entry = entry
    zopt._params.layout = lay
    torch.cuda.device = lambda d: contextlib.nullcontext()


def device_tensors(fake):
    """dev(shape, fill=None, dtype=bf16): a tensor over fresh stand-in device
    memory, ``fill``'s values (zeros without it)."""
    def dev(shape, fill=None, dtype=torch.bfloat16):
        n = int(np.prod(shape)) if shape else 1
        es = torch.empty((), dtype=dtype).element_size()
        p = ctypes.c_ulonglong()
        assert fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(es * max(n, 1))) == 0
        raw = np.frombuffer((ctypes.c_char * (es * n)).from_address(p.value),
                            dtype=np.int16 if es == 2 else np.float32)
        t = torch.from_numpy(raw).view(dtype).view(shape)
        t.zero_() if fill is None else t.copy_(fill)
        return t
    return dev


def grads_on_device(dev, device_steps_only=False):
    """The binding's own gradient buffers in stand-in device memory (``dev``,
    of device_tensors; in the gradient's dtype, where StandIn.grads_on_device
    makes f32 arrays); with device_steps_only, a CPU step's stay in host
    memory."""
    real_alloc, zeros = zopt._grads.alloc_grads, torch.zeros

    def alloc_grads(c, entries):
        if device_steps_only and not c.step.on_device:
            return real_alloc(c, entries)
        torch.zeros = lambda n, dtype=None, device=None: dev((n,), zeros(n), dtype)
        try:
            return real_alloc(c, entries)
        finally:
            torch.zeros = zeros
    zopt._grads.alloc_grads = alloc_grads

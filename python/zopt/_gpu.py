"""GPU and offloaded steps: torch's streams, torch's caching allocator for
a GPU step's device memory, and the param groups whose hyperparameters
reach the device at once (docs/GPU.md, "What the Python binding does").

Every call that enqueues work or reads device results runs on torch's
current stream of the params' device (``zopt_optimizer_set_stream`` before
it, :func:`use_stream`), so reads after a CUDA graph replay are ordered
after it.
"""
from __future__ import annotations

import contextlib
import ctypes
import weakref

from ._lib import Status, ZoptError, check

try:  # torch is optional
    import torch
except Exception:  # pragma: no cover
    torch = None


def device_current(device):
    """``torch.cuda.device(device)`` (the params' device; the runtime takes
    the context current at create: PyTorch's, of that device), or nothing
    for CPU params."""
    if device is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def use_stream(lib, h, device):
    """torch's current stream (of ``device``) becomes the native optimizer's
    stream (zopt_optimizer_set_stream; the runtime orders the new stream
    after its own last work, a graph replay included)."""
    s = torch.cuda.current_stream(device).cuda_stream
    check(lib.zopt_optimizer_set_stream(h, ctypes.c_void_p(s or None)),
          "zopt_optimizer_set_stream")


def capturing(device):
    """Is torch's current stream of ``device`` capturing a CUDA graph
    (torch.cuda.graph)?"""
    with device_current(device):
        return bool(torch.cuda.is_current_stream_capturing())


def refuse_offload_capture(step):
    raise ZoptError(
        Status.UNSUPPORTED,
        f"step() of an offloaded optimizer (step '{step.name}': params and "
        "grads on the GPU, the update on the CPU) inside a CUDA graph capture "
        "(torch.cuda.graph): the step copies the grads to the host, waits for them "
        "and updates on the CPU, which a graph cannot hold. Call step() outside the "
        "captured region (or use a step whose states are on the GPU)")


# zopt_device_allocator (zopt.h): alloc(user, bytes, cu_stream),
# free(user, ptr, bytes, cu_stream), user.
_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p)


class DeviceAllocatorC(ctypes.Structure):
    _fields_ = [("alloc", _ALLOC_FN), ("free", _FREE_FN), ("user", ctypes.c_void_p)]


def set_device_allocator(L, h, alloc):
    """zopt_optimizer_set_device_allocator(h, &alloc.c) (declared here: the
    binding's only caller)."""
    fn = L.zopt_optimizer_set_device_allocator
    if isinstance(fn, ctypes._CFuncPtr) and fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(DeviceAllocatorC)]
    return fn(h, ctypes.byref(alloc.c))


class TorchAllocator:
    """The device memory of a GPU step from torch's caching allocator
    (torch.cuda.caching_allocator_alloc / _delete): the optimizer's buffers
    and torch's cached blocks are one pool, so finalize can use memory
    torch has cached, and torch.cuda.memory_allocated() counts the
    optimizer's states. One per zopt.Optimizer, kept (with its ctypes
    callbacks) as long as the optimizer: every native optimizer it built
    gives its buffers back through it at zopt_optimizer_free."""

    def __init__(self, device):
        self.device = device      # a device index, or None: the current device
        self.live = {}            # pointer -> bytes, allocated and not yet freed
        self.error = None         # what torch raised in the last failed alloc
        self._alloc_cb = _ALLOC_FN(self._alloc)
        self._free_cb = _FREE_FN(self._free)
        self.c = DeviceAllocatorC(self._alloc_cb, self._free_cb, None)

    def _alloc(self, user, nbytes, stream):
        try:
            p = int(torch.cuda.caching_allocator_alloc(int(nbytes), self.device, int(stream or 0)))
        except BaseException as e:  # out of memory: finalize fails, naming it
            self.error = e
            return None
        self.live[p] = int(nbytes)
        return p

    def _free(self, user, ptr, nbytes, stream):
        try:
            if ptr and self.live.pop(int(ptr), None) is not None:
                torch.cuda.caching_allocator_delete(int(ptr))
        except BaseException:  # pragma: no cover - torch torn down at exit
            pass


class GpuGroup(dict):
    """A param group of a GPU step. Assigning a hyperparameter
    (``group["lr"] = x``: an lr scheduler, by hand) writes the changed value
    into the device's hyperparameter table at once (the optimizer's
    _group_assigned),
    because under ``torch.cuda.graph`` nobody calls step() between replays
    and each replay reads the table. Inside a capture a changed value is
    refused (ZoptError, the dict keeps its old value). Copies and pickles
    are plain dicts."""
    __slots__ = ("_opt",)

    def __init__(self, opt, *args, **kw):
        dict.__init__(self, *args, **kw)
        self._opt = weakref.ref(opt)

    def __setitem__(self, key, value):
        opt = self._opt()
        if opt is None or key not in opt._hyper_keys():
            dict.__setitem__(self, key, value)
            return
        had = key in self
        old = dict.get(self, key)
        dict.__setitem__(self, key, value)
        try:
            opt._group_assigned(self)
        except BaseException:
            if had:
                dict.__setitem__(self, key, old)
            else:
                dict.pop(self, key, None)
            raise

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self):
        return dict(self)

    def __reduce__(self):
        return (dict, (dict(self),))

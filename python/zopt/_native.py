"""The native optimizer of one parameter class, and the call lock.

:class:`Native` owns one ``zopt_optimizer`` (zopt.h): it creates it over
the tensors registered so far (their memory; one native group per param
group, GPU steps' frozen params as empty slots: zopt._frozen), configures it
(threads, communicator, buckets, scaler, seed, stream, allocator),
finalizes and frees it, and wraps the C calls on it the layers above use.
The C API's own semantics are in runtime/include/zopt/zopt.h.

One call at a time per optimizer (docs/USAGE.md "Threads"): the runtime
takes one C call at a time per native optimizer and refuses a call from
another thread while one runs (zopt.h "Threading"); the binding keeps
Python-side tables too (the gradient registrations, the masks, the native
handle, which a step may replace), so it holds a per-optimizer lock around
each public call (:func:`exclusive`): a call made while another thread's
call runs on the optimizer raises ZoptError (BAD_STATE, a RuntimeError as
torch raises for misuse) naming the running call and changes nothing;
calls nested on the thread that holds it (a closure's zero_grad inside
step) pass; close() waits for the running call, then frees.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from . import _gpu, _hypers, _lib, _stateio, _strided
from ._lib import DTYPE_ITEMSIZE, STATE_NAMES, StateKind, Status, ZoptError, check, lib
from ._dtypes import NP_OF, torch

class CallLock:
    """The lock of one optimizer and the name of the call holding it."""

    __slots__ = ("_lock", "_depth", "running")

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self.running = None  # the outermost call holding it, or None

    def enter(self, name):
        if not self._lock.acquire(blocking=False):
            raise ZoptError(
                Status.BAD_STATE,
                f"{name}(): another call ({self.running or '?'}) is running on this optimizer "
                "on another thread: one optimizer takes one call at a time (step it from one "
                "thread, or serialize the calls with a lock of your own)")
        if self._depth == 0:
            self.running = name
        self._depth += 1

    def leave(self):
        self._depth -= 1
        if self._depth == 0:
            self.running = None
        self._lock.release()

    def wait(self):
        """Context manager: blocks until no other thread's call runs, and
        holds the lock meanwhile (close())."""
        return _Waiting(self)


class _Waiting:
    __slots__ = ("c",)

    def __init__(self, c):
        self.c = c

    def __enter__(self):
        self.c._lock.acquire()
        if self.c._depth == 0:
            self.c.running = "close"
        self.c._depth += 1

    def __exit__(self, *exc):
        self.c.leave()


def lock_of(opt):
    """The optimizer's CallLock (made by Optimizer.__new__; created here for
    an object made without it, e.g. by copy)."""
    c = opt.__dict__.get("_calls")
    if c is None:
        c = opt.__dict__.setdefault("_calls", CallLock())
    return c


def exclusive(name):
    """Decorator of a public method: holds the optimizer's lock for the call
    (raises ZoptError BAD_STATE while another thread's call holds it)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kw):
            c = lock_of(self)
            c.enter(name)
            try:
                return fn(self, *args, **kw)
            finally:
                c.leave()
        return wrapper
    return deco


def _param_addr(e):
    """The address of an entry's param: a torch tensor's data_ptr, a numpy
    array's data (the (param, grad) pairs of the numpy API)."""
    return e.param.data_ptr() if e.torch else e.param.ctypes.data


# ---- the native optimizer of one parameter class --------------------------

def scaler_config(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=2000, min_scale=1.0, dynamic=True):
    """The loss scaler's configuration (zopt_loss_scaler_config) as a dict."""
    return dict(init_scale=float(init_scale), growth_factor=float(growth_factor),
                backoff_factor=float(backoff_factor), growth_interval=int(growth_interval),
                min_scale=float(min_scale), dynamic=bool(dynamic))


class Native:
    """One ``zopt_optimizer`` over the tensors of one parameter class.

    Settings given to every native optimizer it builds: ``num_threads``,
    ``bucket_elems``, ``divisor`` (the gradient divisor), ``seed_value``,
    ``scaler_cfg`` (the loss scaler's configuration), ``comm``,
    ``device_allocator``. ``entries`` are the registered tensors (tensor
    ids = their indices); GPU steps leave ``excluded`` ones out (empty slots
    masked off, zopt._frozen)."""

    def __init__(self, step, *, num_threads=None, bucket_elems=None, grad_divisor=None,
                 seed=None, scaler_cfg=None, comm=None, device_allocator=None):
        self.step = step
        self.lib = lib()
        self.h = None
        self.num_threads = num_threads
        self.bucket_elems = bucket_elems
        self.divisor = grad_divisor
        self.seed_value = seed
        self.scaler_cfg = scaler_cfg
        self.comm = comm
        self.device_allocator = device_allocator
        self.dev_alloc = None     # GPU steps: a _gpu.TorchAllocator, kept with the optimizer
        self.streamer = None      # grad_streaming=True: a zopt.streaming.GradStreamer
        self.overlap = None       # overlap=True: a zopt.overlap.OffloadOverlap
        self.entries = []
        self.excluded = set()
        self.restarted = set()    # SGD's momentum restart reset their counts (zopt._state)
        self.native_G = 0
        self.device = None
        self.on_cuda = self.streams = self.offload = False
        self.rank, self.world_size = 0, 1

    # ---- create, finalize, free -------------------------------------------------
    def build_native(self, groups):
        """Creates and finalizes a native optimizer over ``groups`` (the
        param groups: their hyperparameters and flags) and the registered
        tensors (collective at world size > 1); frees the old one."""
        devs = [e.param.device for e in self.entries if e.cuda]
        self.device = devs[0] if devs else None  # the params' device (torch)
        self.on_cuda = bool(devs) or self.step.on_device
        self.streams = self.on_cuda and torch is not None and torch.cuda.is_available()
        self.offload = self.streams and not self.step.gpu
        with _gpu.device_current(self.device):
            self._create(groups)

    def _create(self, groups):
        L = self.lib
        step = self.step
        h = ctypes.c_void_p()
        check(L.zopt_optimizer_create(step._h, ctypes.byref(h)), "zopt_optimizer_create")
        try:
            if self.streams:
                # finalize's copies and INIT (which reads the params) and
                # torch's allocator: on the current stream
                _gpu.use_stream(L, h, self.device)
            if step.gpu:
                self._attach_allocator(h)
            if self.num_threads is not None:
                check(L.zopt_optimizer_set_num_threads(h, int(self.num_threads)),
                      "set_num_threads")
            if self.comm is not None:
                check(L.zopt_optimizer_set_comm(h, self.comm._handle()),
                      "zopt_optimizer_set_comm")
            if self.bucket_elems is not None:
                check(L.zopt_optimizer_set_bucket_elems(h, int(self.bucket_elems)),
                      "set_bucket_elems")
            if self.streamer is not None:
                self.streamer.configure(h)
            if self.divisor is not None:
                check(L.zopt_optimizer_set_grad_divisor(h, float(self.divisor)),
                      "set_grad_divisor")
            G = len(groups)  # one native group per param group
            for gid in range(G):
                g = ctypes.c_int()
                check(L.zopt_optimizer_add_group(h, ctypes.byref(g)), "zopt_optimizer_add_group")
                self.push_group(h, gid, gid, groups[gid])
            excluded = self.excluded
            for t, e in enumerate(self.entries):
                tid = ctypes.c_int()
                if t in excluded:  # an empty slot: tensor ids stay param indices
                    pptr = gptr = numel = 0
                else:
                    pptr, gptr, numel = e.pptr, e.gptr, e.numel
                check(L.zopt_optimizer_add_tensor(
                    h, e.group, ctypes.c_void_p(pptr or None),
                    ctypes.c_void_p(gptr or None), numel, int(step.param_dtype),
                    ctypes.byref(tid)),
                    f"zopt_optimizer_add_tensor({e.name})")
            if self.scaler_cfg is not None:
                self.configure_scaler(h, self.scaler_cfg)
            if self.seed_value is not None:
                check(L.zopt_optimizer_set_seed(h, int(self.seed_value) & (2**64 - 1)),
                      "set_seed")
            st = L.zopt_optimizer_finalize(h)
            if st and self.dev_alloc is not None and self.dev_alloc.error is not None:
                err = self.dev_alloc.error
                self.dev_alloc.error = None
                try:
                    check(st, "zopt_optimizer_finalize")
                except ZoptError as e:
                    raise ZoptError(e.code, f"{e.message}; torch's caching allocator: "
                                    f"{type(err).__name__}: {err}") from None
            check(st, "zopt_optimizer_finalize")
        except BaseException:
            L.zopt_optimizer_free(h)
            raise
        old, self.h = self.h, h
        self.native_G = G
        if old is not None and old.value:
            L.zopt_optimizer_free(old)
        r, w = ctypes.c_int(), ctypes.c_int()
        check(L.zopt_optimizer_get_world(h, ctypes.byref(r), ctypes.byref(w)), "get_world")
        self.rank, self.world_size = r.value, w.value
        self._tables()
        if self.excluded:  # GPU steps' empty slots: never updated, never counted
            for t in self.excluded:
                self.active[t] = 0
            self.push_mask()

    def _tables(self):
        """The per-native tables after its tensors changed (finalize,
        add_tensors): every tensor active, as the runtime starts."""
        L, step = self.lib, self.step
        T = len(self.entries)
        self.active = bytearray(b"\x01" * T)
        # the mask's address for set_active (a c_char over the bytearray:
        # no ctypes array type, which would be left behind as garbage)
        self.active_c = ctypes.c_char.from_buffer(self.active if T else bytearray(1))
        self.active_addr = ctypes.addressof(self.active_c)
        self.mask_all = True
        self.pushed = bytes(self.active)  # the mask the runtime has
        self.step_fn = L.zopt_optimizer_step
        self.res = _lib.StepResult()
        self.res_ref = ctypes.byref(self.res)
        # Bytes the update moves per updated element (for the metrics):
        # each state read and/or written once, as the descriptor says.
        bpe = 0
        for k, dt, _ in step.states:
            acc = step.state_access.get(k, 3)
            es = DTYPE_ITEMSIZE[dt]
            if k in (StateKind.EXP_AVG_ABSMAX, StateKind.EXP_AVG_SQ_ABSMAX):
                es = es / 256  # a q8 absmax: one f32 per 256 elements
            bpe += es * ((acc & 1) + ((acc >> 1) & 1))
        self.bytes_per_elem = bpe
        self.numels = np.array([e.numel for e in self.entries], dtype=np.int64)
        self.active_elems = int(self.numels.sum())

    def push_group(self, h, ng, gid, group):
        """Native group ng <- param group ``group`` (number gid): its
        hyperparameters and maximize flag (a new group's)."""
        L = self.lib
        for name, val in _hypers.slots(group, self.step.hypers).items():
            if name not in self.step.hypers:  # plain SGD's momentum 0 (rule_only_keys)
                continue
            _lib.check_value(L.zopt_optimizer_set_hyper(h, ng, name.encode(), float(val)),
                             f"param group {gid}: {name}={val!r}")
        if _hypers.maximize(group):
            check(L.zopt_optimizer_set_group_flags(h, ng, _lib.GROUP_MAXIMIZE),
                  f"param group {gid}: maximize=True")

    def _attach_allocator(self, h):
        """GPU steps: torch's caching allocator for finalize's buffers
        (device_allocator="torch", the default when torch has CUDA)."""
        want = self.device_allocator
        if want == "driver":
            return
        have = torch is not None and torch.cuda.is_available()
        if not have:
            if want == "torch":
                raise ZoptError(Status.UNSUPPORTED, "device_allocator='torch': this torch "
                                "has no CUDA (torch.cuda.is_available() is False)")
            return
        if self.dev_alloc is None:
            dev = self.device
            self.dev_alloc = _gpu.TorchAllocator(dev.index if dev is not None else None)
        check(_gpu.set_device_allocator(self.lib, h, self.dev_alloc),
              "zopt_optimizer_set_device_allocator")

    def free_native(self):
        h = self.h
        if h is not None and h.value:
            if self.comm is not None:
                self.comm._drain()  # operations of a failed collective still writing our scratch
            self.lib.zopt_optimizer_free(h)
        self.h = None

    def handle(self):
        """The native optimizer, for a call that uses it now (GPU and
        offloaded steps: on torch's current stream)."""
        if self.h is None:
            raise ZoptError(Status.BAD_STATE, "the optimizer is closed")
        if self.streams:
            _gpu.use_stream(self.lib, self.h, self.device)
        if self.streamer is not None:
            self.streamer.wait()  # gradient buckets in flight
        return self.h

    def capturing(self):
        """Is torch's current stream of the params' device capturing a CUDA
        graph (torch.cuda.graph)?"""
        return self.streams and _gpu.capturing(self.device)

    # ---- hyperparameters and group flags ----------------------------------------
    def set_hyper(self, gid, name, value):
        """One slot of param group gid (its native group)."""
        if self.step.gpu and self.capturing():
            raise ZoptError(
                Status.BAD_STATE,
                f"param_groups[{gid}]: {name} = {value!r} inside a CUDA graph capture "
                "(torch.cuda.graph): a GPU step reads its hyperparameters from a device "
                "table at run time, and a value written during the capture would be baked "
                "into the graph. Set it before capturing, or between replays (e.g. the lr "
                "scheduler's step() after graph.replay()): each replay uses the value set "
                "before it")
        _lib.check_value(
            self.lib.zopt_optimizer_set_hyper(self.handle(), gid, name.encode(), float(value)),
            f"set_hyper(group {gid}, {name}={value!r})")

    def set_maximize(self, gid, on):
        """torch's ``maximize`` of param group gid -> the runtime's group
        flag (the gradient's sign). GPU steps:
        written into the device's table at once, never inside a capture."""
        if self.step.gpu and self.capturing():
            raise ZoptError(
                Status.BAD_STATE,
                f"param_groups[{gid}]: maximize = {on!r} inside a CUDA graph capture "
                "(torch.cuda.graph): the flag is the sign of the group's gradient scale in "
                "the device's table, which a capture cannot change. Set it before capturing "
                "or between replays")
        check(self.lib.zopt_optimizer_set_group_flags(
            self.handle(), gid, _lib.GROUP_MAXIMIZE if on else 0),
            f"param_groups[{gid}]: maximize={on}")

    def get_hyper(self, gid, name):
        v = ctypes.c_double()
        check(self.lib.zopt_optimizer_get_hyper(self.handle(), gid, name.encode(),
                                                ctypes.byref(v)),
              f"get_hyper(group {gid}, {name})")
        return v.value

    def get_group_flags(self, gid):
        fl = ctypes.c_uint32()
        check(self.lib.zopt_optimizer_get_group_flags(self.handle(), gid, ctypes.byref(fl)),
              f"get_group_flags(group {gid})")
        return fl.value

    # ---- settings -----------------------------------------------------------------
    @property
    def grad_divisor_value(self):
        v = ctypes.c_double()
        check(self.lib.zopt_optimizer_get_grad_divisor(self.handle(), ctypes.byref(v)),
              "get_grad_divisor")
        return v.value

    def set_grad_divisor(self, d):
        check(self.lib.zopt_optimizer_set_grad_divisor(self.handle(), float(d)),
              "set_grad_divisor")
        self.divisor = float(d)

    def set_seed(self, seed):
        check(self.lib.zopt_optimizer_set_seed(self.handle(), int(seed) & (2**64 - 1)),
              "set_seed")
        self.seed_value = int(seed) & (2**64 - 1)

    def get_seed(self):
        s = ctypes.c_uint64()
        check(self.lib.zopt_optimizer_get_seed(self.handle(), ctypes.byref(s)), "get_seed")
        return s.value

    # ---- loss scaler --------------------------------------------------------------
    def configure_scaler(self, h, c):
        cfg = _lib.LossScalerConfig(c["init_scale"], c["growth_factor"], c["backoff_factor"],
                                    c["growth_interval"], c["min_scale"],
                                    1 if c["dynamic"] else 0)
        check(self.lib.zopt_optimizer_configure_loss_scaler(h, ctypes.byref(cfg)),
              "configure_loss_scaler")

    def get_loss_scale(self):
        s = ctypes.c_double()
        check(self.lib.zopt_optimizer_get_loss_scale(self.handle(), ctypes.byref(s)),
              "get_loss_scale")
        return s.value

    def scaler_state(self):
        """(scale, good_steps, config) of the runtime's scaler, read from
        the runtime, which owns them (GPU steps: from the device). A step
        without loss scaling reports its configured initial scale."""
        cfg = self.scaler_config_now()
        scale, good = ctypes.c_double(), ctypes.c_int64()
        check(self.lib.zopt_optimizer_get_loss_scaler_state(
            self.handle(), ctypes.byref(scale), ctypes.byref(good)),
            "zopt_optimizer_get_loss_scaler_state")
        return (scale.value if self.step.loss_scaled else cfg["init_scale"]), good.value, cfg

    def set_scaler_state(self, scale, good):
        check(self.lib.zopt_optimizer_set_loss_scaler_state(self.handle(), float(scale),
                                                             int(good)),
              "zopt_optimizer_set_loss_scaler_state")

    # ---- step counts --------------------------------------------------------------
    def native_step_count(self, ng):
        c = ctypes.c_int64()
        check(self.lib.zopt_optimizer_get_step_count(self.handle(), ng, ctypes.byref(c)),
              "get_step_count")
        return c.value

    def native_steps(self):
        """The step count of every native group (one per param group)."""
        return [self.native_step_count(ng) for ng in range(self.native_G)]

    def group_step_count(self, gid):
        """Steps in which any tensor of param group ``gid`` was updated."""
        return self.native_step_count(gid)

    def tensor_step(self, t):
        if t in self.excluded:  # left out (GPU step): never stepped
            return 0
        c = ctypes.c_int64()
        check(self.lib.zopt_optimizer_get_tensor_step(self.handle(), int(t), ctypes.byref(c)),
              "get_tensor_step")
        return c.value

    def set_tensor_step(self, t, n):
        check(self.lib.zopt_optimizer_set_tensor_step(self.handle(), int(t), int(n)),
              f"zopt_optimizer_set_tensor_step({self.entries[t].name})")

    # ---- states and params --------------------------------------------------------
    def read_raw(self, t, k):
        dt = self.step.state_dtype(k)
        n = self.entries[t].numel
        if k in (StateKind.EXP_AVG_ABSMAX, StateKind.EXP_AVG_SQ_ABSMAX):
            n = -(-n // 256)  # a q8 absmax: one f32 per block (abi.h "q8 moments")
        out = np.empty(n, dtype=NP_OF[dt])
        check(self.lib.zopt_optimizer_read_state_raw(
            self.h, t, int(k), ctypes.c_void_p(out.ctypes.data if n else None),
            out.nbytes), f"read_state_raw({t}, {STATE_NAMES[k]})")
        return out

    def write_raw(self, t, k, arr):
        a = np.ascontiguousarray(arr)
        check(self.lib.zopt_optimizer_write_state_raw(
            self.h, t, int(k), ctypes.c_void_p(a.ctypes.data if a.size else None),
            a.nbytes), f"write_state_raw({t}, {STATE_NAMES[k]})")
        if k == StateKind.PARAM and self.entries[t].dense is not None:
            _strided.copy_out(self.entries, [t])

    def read_f32(self, t, k):
        n = self.entries[t].numel
        out = np.empty(n, dtype=np.float32)
        check(self.lib.zopt_optimizer_read_state_f32(
            self.h, t, int(k), ctypes.c_void_p(out.ctypes.data if n else None), n),
            f"read_state({t}, {STATE_NAMES[k]})")
        return out

    def write_f32(self, t, k, a):
        n = self.entries[t].numel
        check(self.lib.zopt_optimizer_write_state_f32(
            self.handle(), t, int(k), ctypes.c_void_p(a.ctypes.data if n else None), n),
            f"write_state({t}, {STATE_NAMES[k]})")

    def refresh_runs(self, tids):
        """zopt_optimizer_refresh_master over the runs of consecutive ids."""
        for first, count in _runs(tids):
            check(self.lib.zopt_optimizer_refresh_master(self.h, first, count),
                  "zopt_optimizer_refresh_master")

    def gather_runs(self, tids):
        """zopt_optimizer_gather_params into the params' current storage,
        over the runs of consecutive ids (ZeRO-3: collective)."""
        for first, count in _runs(tids):
            dst, _ = _lib.c_array(ctypes.c_void_p, [
                _param_addr(self.entries[u]) if self.entries[u].numel else None
                for u in range(first, first + count)])
            check(self.lib.zopt_optimizer_gather_params(self.h, first, count,
                                                        dst.ctypes.data),
                  "zopt_optimizer_gather_params")

    def set_grad_memory(self, tids, ptrs, what="zopt_optimizer_set_grad_memory"):
        """The runtime reads tensor tids[i]'s gradient at ptrs[i] (None:
        no memory) from the next step on; one call for all of them."""
        n = len(tids)
        ta, tp = _lib.c_array(ctypes.c_int32, tids)  # (ta, pa: alive across the call)
        pa, pp = _lib.c_array(ctypes.c_void_p, ptrs)
        check(self.lib.zopt_optimizer_set_grad_memory(self.h, n, ta.ctypes.data,
                                                      pa.ctypes.data), what)

    def set_grad_memory_packed(self, tids, ptrs):
        """set_grad_memory from packed arrays (bytes of int32 tensor ids and
        of pointers, as zopt._scan returns them)."""
        check(self.lib.zopt_optimizer_set_grad_memory(self.h, len(tids) // 4, tids, ptrs),
              "zopt_optimizer_set_grad_memory")

    def push_mask(self):
        """The active mask (which tensors have a gradient) -> the runtime
        (zopt_optimizer_set_active; GPU steps: into the device's table, two
        stream syncs, refused inside a CUDA graph capture). If the runtime
        refuses it, ``active`` is put back to the mask it has (and the
        error raised)."""
        act = self.active
        all_on = 0 not in act
        if all_on:
            st = self.lib.zopt_optimizer_set_active(self.h, None, 0)
        else:
            st = self.lib.zopt_optimizer_set_active(self.h, self.active_addr, len(act))
        if st:
            act[:] = self.pushed
            check(st, "zopt_optimizer_set_active")
        self.pushed = bytes(act)
        self.mask_all = all_on
        self.active_elems = int(np.dot(np.frombuffer(act, dtype=np.uint8).astype(np.int64),
                                       self.numels)) if len(act) else 0

    # ---- tensors added after finalize; the state in memory --------------------------
    def add_tensors(self, new_groups, tids):
        """``zopt_optimizer_add_tensors``: ``new_groups`` native groups
        (at the descriptor's defaults) and the entries ``tids`` (the last
        ones, registered like at build) added to the finalized native
        optimizer, every state kept (collective at world size > 1). CPU and
        offloaded steps; a refused call changes nothing (ZoptError)."""
        ents = self.entries
        n = len(tids)
        ga, gp = _lib.c_array(ctypes.c_int, [ents[t].group for t in tids])
        pa, _ = _lib.c_array(ctypes.c_void_p, [ents[t].pptr or None for t in tids])
        na, _ = _lib.c_array(ctypes.c_int64, [ents[t].numel for t in tids])
        if self.streamer is None:
            da, _ = _lib.c_array(ctypes.c_void_p, [ents[t].gptr or None for t in tids])
            dp = da.ctypes.data
        else:  # streamed gradients: the runtime holds no gradient memory
            da, dp = None, None
        fg, ft = ctypes.c_int(), ctypes.c_int()
        check(self.lib.zopt_optimizer_add_tensors(
            self.handle(), int(new_groups), n, ga.ctypes.data, pa.ctypes.data, dp,
            na.ctypes.data, int(self.step.param_dtype), ctypes.byref(fg), ctypes.byref(ft)),
            "zopt_optimizer_add_tensors")
        self.native_G += int(new_groups)
        # every tensor active again (as after a build): the binding's next
        # step sets the mask from the gradients
        check(self.lib.zopt_optimizer_set_active(self.h, None, 0), "set_active")
        self._tables()

    def export_whole(self):
        """The whole state as an image of the checkpoint format
        (``zopt_optimizer_export_state``, ZOPT_EXPORT_WHOLE) for this
        process to read (ZOPT_EXPORT_NO_CHECKSUMS: not hashed): a numpy
        uint8 array over the runtime's buffer, freed when it and every view
        of it are gone. Collective at world size > 1."""
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(self.lib.zopt_optimizer_export_state(
            self.handle(), ctypes.byref(buf), ctypes.byref(size),
            _lib.EXPORT_WHOLE | _lib.EXPORT_NO_CHECKSUMS), "zopt_optimizer_export_state")
        return np.asarray(_stateio.StateBuffer(self.lib, buf.value, size.value))

    def import_image(self, img, flags=0, what="import_state"):
        """``zopt_optimizer_import_state`` of an image in memory (load's
        checks and semantics; collective at world size > 1)."""
        a = np.ascontiguousarray(np.frombuffer(img, dtype=np.uint8)
                                 if not isinstance(img, np.ndarray) else img)
        check(self.lib.zopt_optimizer_import_state(self.handle(), ctypes.c_void_p(a.ctypes.data),
                                                   a.nbytes, int(flags)), what)

    def begin_import(self):
        """A staged import (zopt._stateio.StagedImport) into the native
        optimizer."""
        return _stateio.StagedImport(self.lib, self.handle())

    def scaler_config_now(self):
        """The runtime's loss scaler configuration (scaler_config's dict)."""
        c = _lib.LossScalerConfig()
        check(self.lib.zopt_optimizer_get_loss_scaler_config(self.handle(), ctypes.byref(c)),
              "zopt_optimizer_get_loss_scaler_config")
        return scaler_config(c.init_scale, c.growth_factor, c.backoff_factor,
                             c.growth_interval, c.min_scale, bool(c.dynamic))

    def memory_info(self):
        m = _lib.MemoryInfo()
        check(self.lib.zopt_optimizer_memory_info(self.handle(), ctypes.byref(m)),
              "memory_info")
        return {f: getattr(m, f) for f, _ in _lib.MemoryInfo._fields_}


def _runs(tids):
    """(first, count) of each run of consecutive ids in the sorted tids."""
    out = []
    for t in sorted(set(tids)):
        if out and t == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return [tuple(r) for r in out]

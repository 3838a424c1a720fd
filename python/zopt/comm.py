"""Communicators (runtime/include/zopt/comm.h, docs/COMM.md).

A :class:`Comm` owns a ``zopt_comm*``: the collectives of a multi-rank step
move bytes between the ranks through it.

    from zopt.comm import Comm, TorchComm
    c = Comm.self()                     # W = 1
    ranks = Comm.loopback(4)            # 4 ranks as threads of this process
    c = Comm.mpi()                      # under mpirun (the MPI plugin)
    c = TorchComm()                     # over torch.distributed (gloo, CPU)
    c.all_to_all(send, recv)            # numpy arrays or torch tensors
    c.all_gather(send, recv)

Buffers are C-contiguous numpy arrays or torch tensors of any dtype; only
their bytes matter. ``all_to_all``: send and recv have the same byte size,
a multiple of W (piece r of send goes to rank r; piece q of recv came from
rank q). ``all_gather``: recv holds W times send's bytes; send may be piece
``rank`` of recv (in place). Failures raise :class:`zopt.ZoptError` with the
runtime's message (naming the ranks that differ or did not arrive); a failed
communicator stays failed.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import math
import threading
import time
import weakref

from . import _lib
from ._lib import Status, ZoptError, check, lib

__all__ = ["Comm", "TorchComm", "nccl_unique_id", "seconds"]


def _buffer(x, what, writable):
    """(address, nbytes, device) of a contiguous numpy array or torch tensor."""
    try:
        import numpy as np
        if isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ValueError(f"{what}: the numpy array is not C-contiguous")
            if writable and not x.flags.writeable:
                raise ValueError(f"{what}: the numpy array is read-only")
            return x.ctypes.data, x.nbytes, "cpu"
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch
        if isinstance(x, torch.Tensor):
            if not x.is_contiguous():
                raise ValueError(f"{what}: the tensor is not contiguous")
            return x.data_ptr(), x.numel() * x.element_size(), x.device.type
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{what}: expected a numpy array or a torch tensor, got {type(x).__name__}")



class _RawBytes:
    """n bytes at addr, as numpy sees them (``__array_interface__``)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr, n):
        self.__array_interface__ = {"data": (addr, False), "shape": (n,),
                                    "typestr": "|u1", "version": 3}

class Comm:
    """A zopt communicator. Use the constructors :meth:`self`,
    :meth:`loopback`, :meth:`mpi`, :meth:`nccl`, or :class:`TorchComm`."""

    def __init__(self, handle, keep=None):
        self._h = handle
        self._keep = keep  # objects the C side points into (tables, callbacks)
        L = lib()
        self.rank = L.zopt_comm_rank(handle)
        self.size = L.zopt_comm_size(handle)
        self.name = L.zopt_comm_name(handle).decode()
        self.memory = L.zopt_comm_memory(handle)

    # ---- constructors -------------------------------------------------------
    @classmethod
    def self(cls):
        """The W = 1 communicator."""
        h = ctypes.c_void_p()
        check(lib().zopt_comm_create_self(ctypes.byref(h)), "zopt_comm_create_self")
        return cls(h)

    @classmethod
    def loopback(cls, size, timeout=30.0, delay=False, poison=False, seed=0):
        """``size`` ranks as threads of this process: a list of communicators,
        each to be used by its own thread."""
        opts = _lib.LoopbackOptions(timeout_s=timeout,
                                    flags=(_lib.LOOPBACK_DELAY if delay else 0)
                                    | (_lib.LOOPBACK_POISON if poison else 0),
                                    seed=seed)
        hs, ptr = _lib.c_array(ctypes.c_void_p, [0] * size)
        check(lib().zopt_comm_create_loopback(size, ctypes.byref(opts), ptr),
              "zopt_comm_create_loopback")
        return [cls(ctypes.c_void_p(int(h))) for h in hs]

    @classmethod
    def mpi(cls, mpi_comm_address=None):
        """The MPI communicator (the plugin libzopt_comm_mpi.so). With no
        argument: MPI_COMM_WORLD, initializing MPI if the process has not (and
        finalizing it when the last such communicator is closed). Otherwise
        the address of an MPI_Comm handle (e.g. mpi4py's
        ``MPI._addressof(comm)``)."""
        h = ctypes.c_void_p()
        check(lib().zopt_comm_create_mpi(mpi_comm_address, ctypes.byref(h)),
              "zopt_comm_create_mpi")
        return cls(h)

    @classmethod
    def nccl(cls, unique_id, rank, size, stream=None):
        """An NCCL communicator over CUDA device memory (torch CUDA tensors).
        ``unique_id``: the 128 bytes of :func:`nccl_unique_id` from one rank,
        handed to all; ``stream``: a CUstream address (None: the legacy
        default stream), e.g. ``torch.cuda.current_stream().cuda_stream``."""
        uid = bytes(unique_id)
        if len(uid) != _lib.NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id has {len(uid)} bytes, want {_lib.NCCL_UNIQUE_ID_BYTES}")
        h = ctypes.c_void_p()
        check(lib().zopt_comm_create_nccl(uid, rank, size, stream, ctypes.byref(h)),
              "zopt_comm_create_nccl")
        return cls(h)

    # ---- settings and queries ---------------------------------------------
    def _handle(self):
        if self._h is None:
            raise ZoptError(Status.BAD_STATE, "the communicator is closed")
        return self._h

    def set_timeout(self, seconds):
        check(lib().zopt_comm_set_timeout(self._handle(), float(seconds)))

    def set_checks(self, on):
        check(lib().zopt_comm_set_checks(self._handle(), 1 if on else 0))

    @property
    def count(self):
        """Collectives issued so far."""
        return lib().zopt_comm_count(self._handle())

    # ---- collectives --------------------------------------------------------
    def _check_device(self, dev, what):
        want = "cuda" if self.memory == _lib.COMM_MEM_DEVICE else "cpu"
        if dev != want:
            raise ValueError(f"{what}: a {dev} buffer for the {self.name} communicator "
                             f"(it moves {want} memory)")

    def all_to_all(self, send, recv):
        s, ns, ds = _buffer(send, "send", False)
        r, nr, dr = _buffer(recv, "recv", True)
        self._check_device(ds, "send")
        self._check_device(dr, "recv")
        if ns != nr or ns % self.size:
            raise ValueError(f"all_to_all: send has {ns} bytes, recv {nr}: both must be the "
                             f"same multiple of the world size {self.size}")
        check(lib().zopt_comm_all_to_all(self._handle(), s, r, ns // self.size))

    def all_gather(self, send, recv):
        s, ns, ds = _buffer(send, "send", False)
        r, nr, dr = _buffer(recv, "recv", True)
        self._check_device(ds, "send")
        self._check_device(dr, "recv")
        if nr != ns * self.size:
            raise ValueError(f"all_gather: recv has {nr} bytes, want {self.size} x {ns}")
        check(lib().zopt_comm_all_gather(self._handle(), s, r, ns))

    def barrier(self):
        check(lib().zopt_comm_barrier(self._handle()))

    def synchronize(self):
        check(lib().zopt_comm_synchronize(self._handle()))

    # ---- lifetime ------------------------------------------------------------
    def _drain(self):
        """Waits for engine operations that outlived a failed call (their
        buffers may be runtime memory: before that memory is freed)."""

    def close(self):
        if getattr(self, "_h", None) is not None:
            lib().zopt_comm_free(self._h)
            self._h = None
            self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self):
        return f"<zopt.comm.Comm {self.name} rank {self.rank} of {self.size}>"


def nccl_unique_id():
    """128 bytes naming a new NCCL rendezvous (call on one rank, hand to all)."""
    buf = ctypes.create_string_buffer(_lib.NCCL_UNIQUE_ID_BYTES)
    check(lib().zopt_comm_nccl_unique_id(buf), "zopt_comm_nccl_unique_id")
    return buf.raw


def _rank_list(ranks):
    """'rank 3' / 'ranks 0, 2-4' (as the runtime's messages)."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else
                     f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def seconds(timeout, what="timeout"):
    """A timeout in seconds (a number or a datetime.timedelta), finite and
    > 0; None stays None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or a datetime.timedelta, "
                        f"got {type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{what} must be finite and > 0 seconds, got {timeout!r}")
    return float(timeout)


# Private process groups made in this process, per tuple of global ranks:
# every rank of a group makes its communicators in the same order (as it
# builds its optimizers), so the n-th one of the same ranks meets its peers
# under the same store prefix.
_PRIVATE_GROUPS = {}
_GROUPS_LOCK = threading.Lock()
# Store calls (the TCPStore client is one socket; engines may run on
# several threads: the optimizers' background threads).
_STORE_LOCK = threading.Lock()
# Engines with works still running after their call returned (their
# buffers must outlive them): drained at close and at interpreter exit.
_LIVE_ENGINES = weakref.WeakSet()


# Run at exit before the engines are released (before_release): work that
# the runtime's own threads still do on them ends first, while the
# interpreter can still run their callbacks.
_BEFORE_RELEASE = []


def before_release(fn):
    """Runs ``fn()`` at interpreter exit before any engine is released (an
    offloaded step's tail: zopt._early). Its exceptions are ignored."""
    _BEFORE_RELEASE.append(fn)


@atexit.register
def _release_all():  # pragma: no cover - interpreter exit
    """At exit, before the interpreter tears modules down: every engine's
    gloo operations end and its private process group is destroyed here, in
    the main thread (left to the interpreter's teardown, a gloo group's
    threads were found still joinable: std::terminate, SIGABRT). First the
    before_release callbacks: an optimizer's pipeline thread may still be
    inside a collective of its step's tail, calling these engines from C;
    at the teardown it could no longer take the GIL (Python ends such a
    thread there), and the optimizer's free would wait for it forever."""
    for fn in list(_BEFORE_RELEASE):
        try:
            fn()
        except Exception:
            pass
    for e in list(_LIVE_ENGINES):
        try:
            e.drain()
            e.release()
        except Exception:
            pass


class _TorchEngine:
    """The engine table over a torch.distributed process group.

    zopt's collectives run on a gloo process group of their own (``private``,
    the default): created over the same ranks through the default store
    (``ProcessGroupGloo`` over a ``PrefixStore``, so only the group's ranks
    take part), with zopt's timeout as gloo's own. So they never interleave
    with another user of the caller's group (DDP's reducer, the script's
    all_reduce), and a stalled peer fails every gloo operation within the
    timeout. The raw buffers are wrapped (no copy) as uint8 tensors and moved
    with alltoall_base and one broadcast per rank.

    Every call waits for every operation it issued before it returns, also
    after a failure (gloo ends them within its timeout), so no operation
    writes into runtime memory after the call; one that outlives a shorter
    ``set_timeout`` (or the caller's group's timeout, ``private=False``) is
    kept with its buffers and waited for at ``close()`` and at exit.

    After a failure a short liveness exchange over the store names the
    ranks that do not answer: every rank waiting in a call posts a
    heartbeat, every rank that failed posts that it gave up."""

    def __init__(self, pg, timeout=None, private=True):
        import torch.distributed as dist
        from torch._C._distributed_c10d import AllToAllOptions, BroadcastOptions
        self._a2a_opts, self._bcast_opts = AllToAllOptions, BroadcastOptions
        self.size = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)
        if self.rank < 0:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "TorchComm: this process is not a member of the process group")
        c10d = dist.distributed_c10d
        to_global = getattr(c10d, "get_global_rank", None) or getattr(c10d, "_get_global_rank", None)
        if pg is None or pg is c10d.GroupMember.WORLD or to_global is None:
            self._global = list(range(self.size))
        else:
            self._global = [to_global(pg, q) for q in range(self.size)]
        try:
            store = c10d._get_default_store()
        except Exception:  # pragma: no cover - a group without the default store
            store = None
        self.timeout = timeout  # seconds; None: the process group's own timeout
        self.private = bool(private) and store is not None and self.size > 1
        self.live = None
        if store is not None and self.size > 1:
            key = tuple(self._global)
            with _GROUPS_LOCK:
                n = _PRIVATE_GROUPS.get(key, 0)
                _PRIVATE_GROUPS[key] = n + 1
            prefix = f"zopt/comm/{'.'.join(map(str, key))}/{n}/"
            self.live = dist.PrefixStore(prefix + "live/", store)
        if self.private:
            from torch._C._distributed_c10d import ProcessGroupGloo
            pg_timeout = datetime.timedelta(seconds=timeout) if timeout else store.timeout
            # gloo's own timeout: every operation ends within it
            self.pg_timeout = pg_timeout.total_seconds()
            self.pg = ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store), self.rank,
                                       self.size, pg_timeout)
        else:
            self.pg = pg if pg is not None else c10d._get_default_group()
            self.pg_timeout = None
        self.dist = dist
        self.calls = 0        # engine calls (collectives and signature exchanges)
        self.failed = None    # the first failure's message
        self.orphans = []     # (works, buffers) still running after their call
        self.err = ctypes.create_string_buffer(1024)
        self.ops = _lib.CommOps(
            version=_lib.COMM_OPS_VERSION, memory=_lib.COMM_MEM_HOST, name=b"torch",
            all_to_all=_lib.COMM_XFER_FN(self._all_to_all),
            all_gather=_lib.COMM_XFER_FN(self._all_gather),
            set_timeout=_lib.COMM_TIMEOUT_FN(self._set_timeout),
            last_error=_lib.COMM_ERROR_FN(self._last_error))
        # exchange: NULL (the runtime uses all_gather for the signatures of a
        # host communicator); synchronize, abort, destroy: NULL.
        _LIVE_ENGINES.add(self)

    @staticmethod
    def _bytes(addr, n):
        import numpy as np
        import torch
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        # An array interface over the address, not ctypes' `c_uint8 * n`: each
        # such type (one per size) would be left as cyclic garbage.
        return torch.from_numpy(np.asarray(_RawBytes(addr, n)))

    # ---- waiting ------------------------------------------------------------
    def _beat_every(self):
        t = self.timeout or self.pg_timeout or 10.0
        return min(0.5, max(0.05, t / 10))

    def _store(self, fn, *args):
        with _STORE_LOCK:
            return fn(*args)

    def _wait(self, works, bufs):
        """Waits for every work; returns the first failure (an exception) or
        None. While waiting, posts a heartbeat every few tenths of a second
        (the peers' liveness check sees this rank is inside a call). Works
        still running past the timeout (a set_timeout shorter than the
        group's) are kept with their buffers (self.orphans)."""
        err = None
        beat = self._beat_every()
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        if self.private and deadline is not None and self.pg_timeout <= self.timeout:
            deadline = None  # gloo ends every work within its own (shorter) timeout
        pending = list(works)
        while pending:
            w = pending[0]
            done, e = self._wait_slice(w, beat)
            if done:
                err = err or e  # a failed work: the others still end
                pending.pop(0)
                continue
            # this slice expired: tell the peers this rank is here
            now = time.monotonic()
            if self.live is not None:
                try:
                    self._store(self.live.add, f"beat/{self.rank}", 1)
                except Exception:
                    pass
            if deadline is not None and now >= deadline:
                self.orphans.append((pending, bufs))
                err = err or TimeoutError(
                    f"timed out after {self.timeout:g} s (the gloo operation goes on until the "
                    f"group's own timeout; its buffers are kept until it ends)")
                break
        return err

    @staticmethod
    def _wait_slice(w, seconds):
        """Waits up to ``seconds`` for work ``w``: (True, None) when it
        succeeded, (True, its exception) when it failed, (False, None) when
        it is still running.

        The expired slice is told apart from a failed work by the work's
        own state, never by the exception of the timed wait: Work.wait(
        timeout) raises "Operation timed out!" when the slice expires,
        and the work may complete between that and any check after it
        (this thread re-takes the GIL first, which another thread may hold
        for milliseconds: torch 2.11, gloo, streamed buckets on the
        runtime's thread). Taking that exception as the work's failure
        failed a collective that succeeded. So a completed work is always
        asked again with an untimed wait(), which returns at once: it
        raises the work's own error, or returns because it succeeded."""
        try:
            w.wait(datetime.timedelta(seconds=seconds))
            return True, None
        except RuntimeError:
            if not w.is_completed():
                return False, None  # the slice expired: still running
        try:
            w.wait()  # completed: no wait; its own outcome
            return True, None
        except Exception as e:  # noqa: BLE001 (the work's error, reported by the caller)
            return True, e

    def drain(self):
        """Waits for the works that outlived their call (they end within the
        group's timeout), then drops their buffers."""
        while self.orphans:
            works, _ = self.orphans.pop()
            for w in works:
                try:
                    w.wait()
                except Exception:
                    pass

    # ---- failures -------------------------------------------------------------
    def _liveness(self):
        """After a failure: posts that this rank gave up, then waits a short
        window for every peer to show it is inside a call (a heartbeat, or
        its own give-up). Returns the text naming the ranks that did not."""
        if self.live is None:
            return ""
        window = min(2.0, max(0.25, (self.timeout or self.pg_timeout or 8.0) / 4))
        beat = self._beat_every()
        window = max(window, 2.5 * beat)
        peers = [q for q in range(self.size) if q != self.rank]
        try:
            self._store(self.live.add, f"fail/{self.rank}", self.calls)
            base = {q: self._store(self.live.add, f"beat/{q}", 0) for q in peers}
            answered = {}
            end = time.monotonic() + window
            while True:
                for q in peers:
                    if q in answered:
                        continue
                    if self._store(self.live.add, f"fail/{q}", 0):
                        answered[q] = "failed"
                    elif self._store(self.live.add, f"beat/{q}", 0) != base[q]:
                        answered[q] = "waiting"
                if len(answered) == len(peers) or time.monotonic() >= end:
                    break
                time.sleep(min(0.05, beat / 2))
        except Exception as e:
            return (f"; the liveness check could not reach the store ({type(e).__name__}: {e}): "
                    f"global rank 0's process, which holds it, may be dead")
        silent = [q for q in peers if q not in answered]
        if not silent:
            return f"; every rank answered the liveness check within {window:g} s"
        others = ""
        gave = [q for q in peers if answered.get(q) == "failed"]
        if gave:
            others = f"; {_rank_list(gave)} failed too"
        return (f"; {_rank_list(silent)} did not answer within {window:g} s (liveness check: "
                f"{'it is' if len(silent) == 1 else 'they are'} not waiting in this collective: "
                f"stalled or still busy outside zopt, dead or unreachable){others}")

    def _fail(self, e):
        text = f"{type(e).__name__}: {e}"
        low = text.lower()
        timed_out = "timed out" in low or "timeout" in low
        text += self._liveness()
        msg = f"torch.distributed: {text}"
        self.failed = msg
        b = msg.encode("utf-8", "replace")[:1023]
        ctypes.memmove(self.err, b + b"\0", len(b) + 1)
        return _lib.COMM_ERR_TIMEOUT if timed_out else _lib.COMM_ERR_FAILED

    # ---- the table ---------------------------------------------------------------
    def _all_to_all(self, ctx, send, recv, nbytes):
        self.calls += 1
        try:
            total = nbytes * self.size
            s, r = self._bytes(send, total), self._bytes(recv, total)
            w = self.pg.alltoall_base(r, s, [], [], self._a2a_opts())
            err = self._wait([w], (s, r))
        except BaseException as e:  # never let an exception cross into C
            err = e
        return self._fail(err) if err is not None else _lib.COMM_OK

    def _all_gather(self, ctx, send, recv, nbytes):
        # W broadcasts, piece q from rank q straight into its place in recv:
        # torch 1.13's gloo all_gather (a list of outputs) stages through a
        # flat buffer and measured 4-6x slower than the broadcasts moving the
        # same bytes (64 MiB of f32 at W = 2: 207 vs 32 ms; W = 4: 341 vs
        # 93 ms, loopback TCP on this 2-core machine).
        self.calls += 1
        works = []
        err = None
        try:
            r = self._bytes(recv, nbytes * self.size)
            mine = recv + self.rank * nbytes
            if send != mine:
                ctypes.memmove(mine, send, nbytes)
            for q in range(self.size):
                o = self._bcast_opts()
                o.rootRank, o.rootTensor = q, 0
                works.append(self.pg.broadcast([r[q * nbytes:(q + 1) * nbytes]], o))
        except BaseException as e:
            err = e
        try:
            # every issued broadcast ends before this returns
            if works:
                err = self._wait(works, r) or err
        except BaseException as e:
            err = err or e
        return self._fail(err) if err is not None else _lib.COMM_OK

    def _set_timeout(self, ctx, seconds):
        self.timeout = seconds
        return _lib.COMM_OK

    def _last_error(self, ctx):
        return ctypes.addressof(self.err)

    def release(self):
        """Drops the process groups (the private one is destroyed now); a
        later call fails cleanly."""
        self.failed = self.failed or "the communicator was released at interpreter exit"
        self.pg = self.live = None

    def close(self):
        self.drain()
        _LIVE_ENGINES.discard(self)
        self.pg = self.dist = self.live = None
        self.ops = None


class TorchComm(Comm):
    """A communicator over a torch.distributed process group (default: the
    world group), e.g. gloo on CPU, in tensors of CPU memory.

    ``private=True`` (the default): zopt's collectives run on a gloo group
    of their own over the same ranks (made now, collectively: every rank of
    the group constructs its TorchComms in the same order), so they never
    interleave with DDP or other collectives on ``process_group``, and
    ``timeout`` (seconds or a timedelta; default: the default store's, i.e.
    init_process_group's timeout) is that group's gloo timeout: a stalled
    or dead peer fails every collective within it. After a failure the
    error names the ranks that did not answer a short liveness exchange
    over the store. ``private=False`` runs on ``process_group`` itself (its
    own timeout applies; ``set_timeout`` bounds the waits)."""

    def __init__(self, process_group=None, timeout=None, private=True):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise ZoptError(Status.BAD_STATE, "TorchComm: torch.distributed is not initialized "
                            "(call torch.distributed.init_process_group first)")
        timeout = seconds(timeout)
        pg = process_group if process_group is not None else dist.group.WORLD
        engine = _TorchEngine(pg, timeout=timeout, private=private)
        h = ctypes.c_void_p()
        try:
            check(lib().zopt_comm_create(ctypes.byref(engine.ops), None, engine.rank, engine.size,
                                         ctypes.byref(h)), "zopt_comm_create")
        except BaseException:
            engine.close()
            raise
        super().__init__(h, keep=engine)
        if timeout is not None:
            self.set_timeout(timeout)

    def _drain(self):
        engine = getattr(self, "_keep", None)
        if isinstance(engine, _TorchEngine):
            engine.drain()

    def close(self):
        """Waits for gloo operations that outlived a failed call, frees the
        communicator and drops its references to the process groups at once:
        the engine's callbacks refer back to it (a cycle), and a cycle
        collected later in one of gloo's threads would destroy the process
        group from its own thread (std::terminate)."""
        engine = getattr(self, "_keep", None)
        if isinstance(engine, _TorchEngine):
            engine.drain()
        super().close()
        if isinstance(engine, _TorchEngine):
            engine.close()

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

import ctypes
import datetime

from . import _lib
from ._lib import Status, ZoptError, check, lib

__all__ = ["Comm", "TorchComm", "nccl_unique_id"]


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
        hs = (ctypes.c_void_p * size)()
        check(lib().zopt_comm_create_loopback(size, ctypes.byref(opts), hs),
              "zopt_comm_create_loopback")
        return [cls(ctypes.c_void_p(h)) for h in hs]

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


class _TorchEngine:
    """The engine table over a torch.distributed process group: the raw
    buffers are wrapped (no copy) as uint8 tensors and moved with
    all_to_all_single and a list all_gather, which torch 1.13's gloo supports
    for uint8 CPU tensors."""

    def __init__(self, pg):
        import torch.distributed as dist
        self.dist = dist
        self.pg = pg
        self.size = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)
        # broadcast() takes the source's global rank
        c10d = dist.distributed_c10d
        to_global = getattr(c10d, "get_global_rank", None) or getattr(c10d, "_get_global_rank", None)
        if pg is None or pg is c10d.GroupMember.WORLD or to_global is None:
            self._global = list(range(self.size))
        else:
            self._global = [to_global(pg, q) for q in range(self.size)]
        self.timeout = None  # seconds; None: the process group's own timeout
        self.err = ctypes.create_string_buffer(1024)
        self.ops = _lib.CommOps(
            version=_lib.COMM_OPS_VERSION, memory=_lib.COMM_MEM_HOST, name=b"torch",
            all_to_all=_lib.COMM_XFER_FN(self._all_to_all),
            all_gather=_lib.COMM_XFER_FN(self._all_gather),
            set_timeout=_lib.COMM_TIMEOUT_FN(self._set_timeout),
            last_error=_lib.COMM_ERROR_FN(self._last_error))
        # exchange: NULL (the runtime uses all_gather for the signatures of a
        # host communicator); synchronize, abort, destroy: NULL.

    @staticmethod
    def _bytes(addr, n):
        import numpy as np
        import torch
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)))

    def _wait(self, work):
        if self.timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))

    def _fail(self, e):
        text = f"{type(e).__name__}: {e}"
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        if timed_out and self.timeout is not None:
            text = f"timed out after {self.timeout:g} s ({text}; torch cannot tell which rank is missing)"
        msg = f"torch.distributed: {text}".encode("utf-8", "replace")[:1023]
        ctypes.memmove(self.err, msg + b"\0", len(msg) + 1)
        return _lib.COMM_ERR_TIMEOUT if timed_out else _lib.COMM_ERR_FAILED

    def _all_to_all(self, ctx, send, recv, nbytes):
        try:
            total = nbytes * self.size
            s, r = self._bytes(send, total), self._bytes(recv, total)
            self._wait(self.dist.all_to_all_single(r, s, group=self.pg, async_op=True))
            return _lib.COMM_OK
        except BaseException as e:  # never let an exception cross into C
            return self._fail(e)

    def _all_gather(self, ctx, send, recv, nbytes):
        # W broadcasts, piece q from rank q straight into its place in recv:
        # torch 1.13's gloo all_gather (a list of outputs) stages through a
        # flat buffer and measured 4-6x slower than the broadcasts moving the
        # same bytes (64 MiB of f32 at W = 2: 207 vs 32 ms; W = 4: 341 vs
        # 93 ms, loopback TCP on this 2-core machine).
        try:
            r = self._bytes(recv, nbytes * self.size)
            mine = recv + self.rank * nbytes
            if send != mine:
                ctypes.memmove(mine, send, nbytes)
            works = [self.dist.broadcast(r[q * nbytes:(q + 1) * nbytes], src=self._global[q],
                                         group=self.pg, async_op=True)
                     for q in range(self.size)]
            for w in works:
                self._wait(w)
            return _lib.COMM_OK
        except BaseException as e:
            return self._fail(e)

    def _set_timeout(self, ctx, seconds):
        self.timeout = seconds
        return _lib.COMM_OK

    def _last_error(self, ctx):
        return ctypes.addressof(self.err)


class TorchComm(Comm):
    """A communicator over a torch.distributed process group (default: the
    world group), e.g. gloo on CPU. ``set_timeout`` bounds each collective's
    wait (``Work.wait(timeout)``); without it the process group's own timeout
    applies. A timed-out gloo operation keeps running in gloo's worker
    thread until the process group's timeout, so give the group a short one
    (``init_process_group(..., timeout=...)``) where that matters."""

    def __init__(self, process_group=None):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise ZoptError(Status.BAD_STATE, "TorchComm: torch.distributed is not initialized "
                            "(call torch.distributed.init_process_group first)")
        pg = process_group if process_group is not None else dist.group.WORLD
        engine = _TorchEngine(pg)
        rank = dist.get_rank(pg)
        h = ctypes.c_void_p()
        check(lib().zopt_comm_create(ctypes.byref(engine.ops), None, rank, engine.size,
                                     ctypes.byref(h)), "zopt_comm_create")
        super().__init__(h, keep=engine)

    def close(self):
        """Frees the communicator and drops its references to the process
        group at once: the engine's callbacks refer back to it (a cycle),
        and a cycle collected later in one of gloo's threads would destroy
        the process group from its own thread (std::terminate)."""
        engine = getattr(self, "_keep", None)
        super().close()
        if isinstance(engine, _TorchEngine):
            engine.pg = engine.dist = None
            engine.ops = None

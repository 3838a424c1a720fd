"""ctypes bindings of libzopt_runtime (runtime/include/zopt/zopt.h, abi.h).

The library is located, in order, by:
  1. the environment variable ZOPT_RUNTIME_LIB (a path to the .so);
  2. ``build/**/libzopt_runtime.so*`` under the repository root (the folder
     two levels above this package);
  3. the dynamic loader's search path (``libzopt_runtime.so``).
"""
from __future__ import annotations

import ctypes
import enum
import glob
import os
import threading

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# ---- abi.h ---------------------------------------------------------------
ABI_VERSION = 4
API_VERSION = 3
MAX_STATES = 12
MAX_HYPERS = 16
MAX_COEFFS = 64
MAX_KERNELS = 16
MAX_PROGRAM = 16
NAME_LEN = 64

FLAG_CLIP = 1
FLAG_LOSS_SCALE = 2
FLAG_SUMSQ = 4
FLAG_NESTEROV = 16
FLAG_DECOUPLED_DECAY = 32
FLAG_RULE_STATED = 64
FLAG_FINISH_GRID = 128


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    IO = 2
    ABI = 3
    BAD_STATE = 4
    CHECKPOINT = 5
    OUT_OF_MEMORY = 6
    UNSUPPORTED = 7
    INTERNAL = 8
    COMM = 9


class DType(enum.IntEnum):
    F32 = 1
    BF16 = 2
    F16 = 3
    I16 = 4  # a remainder master's low half (abi.h "Remainder masters")
    Q8 = 5  # a q8 moment's codes (abi.h "q8 moments"; the runtime runs them on the CPU)


class Placement(enum.IntEnum):
    CPU = 1
    GPU = 2


class StateKind(enum.IntEnum):
    PARAM = 1
    GRAD = 2
    MASTER = 3
    EXP_AVG = 4
    EXP_AVG_SQ = 5
    MAX_EXP_AVG_SQ = 6
    MOMENTUM_BUFFER = 7
    EXP_AVG_ABSMAX = 8  # a q8 moment's per-block absmax (abi.h "q8 moments")
    EXP_AVG_SQ_ABSMAX = 9
    KAHAN_COMP = 10  # a kahan param's compensation (abi.h "Kahan-compensated params")


class HyperKind(enum.IntEnum):
    LR = 1
    BETA1 = 2
    BETA2 = 3
    EPS = 4
    WEIGHT_DECAY = 5
    MOMENTUM = 6
    DAMPENING = 7
    BIAS_CORRECTION = 8


class Isa(enum.IntEnum):
    NONE = 0
    AVX2 = 1
    AVX512 = 2
    AVX512BF16 = 3


STATE_NAMES = {k: k.name.lower() for k in StateKind}
STATE_BY_NAME = {v: k for k, v in STATE_NAMES.items()}
HYPER_NAMES = {k: k.name.lower() for k in HyperKind}
HYPER_BY_NAME = {v: k for k, v in HYPER_NAMES.items()}
DTYPE_NAMES = {DType.F32: "f32", DType.BF16: "bf16", DType.F16: "f16", DType.I16: "i16",
               DType.Q8: "q8"}
DTYPE_ITEMSIZE = {DType.F32: 4, DType.BF16: 2, DType.F16: 2, DType.I16: 2, DType.Q8: 1}


class StateDesc(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("placement", ctypes.c_uint32), ("rounding", ctypes.c_uint32),
                ("init", ctypes.c_uint32), ("access", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("reserved", ctypes.c_uint32)]


class ProgramOp(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint32), ("state", ctypes.c_uint32),
                ("range", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("accum", ctypes.c_uint32), ("src", ctypes.c_uint32),
                ("dst", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class HyperDesc(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("default_value", ctypes.c_double),
                ("min_value", ctypes.c_double), ("max_value", ctypes.c_double),
                ("max_exclusive", ctypes.c_uint32),
                ("reserved2", ctypes.c_uint32)]


class KernelDesc(ctypes.Structure):
    _fields_ = [("role", ctypes.c_uint32), ("isa", ctypes.c_uint32),
                ("device", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("symbol", ctypes.c_char * NAME_LEN)]


class StepDescriptor(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_char * 8), ("abi_version", ctypes.c_uint32),
                ("size", ctypes.c_uint32), ("checksum", ctypes.c_uint64),
                ("name", ctypes.c_char * NAME_LEN),
                ("zero_stage", ctypes.c_uint32), ("align", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("num_states", ctypes.c_uint32),
                ("num_hypers", ctypes.c_uint32), ("num_coeffs", ctypes.c_uint32),
                ("num_kernels", ctypes.c_uint32), ("reserved0", ctypes.c_uint32),
                ("max_norm", ctypes.c_double),
                ("states", StateDesc * MAX_STATES),
                ("hypers", HyperDesc * MAX_HYPERS),
                ("kernels", KernelDesc * MAX_KERNELS),
                ("num_program", ctypes.c_uint32), ("reserved1", ctypes.c_uint32),
                ("program", ProgramOp * MAX_PROGRAM)]


# ---- zopt.h ----------------------------------------------------------------
class LossScalerConfig(ctypes.Structure):
    _fields_ = [("init_scale", ctypes.c_double),
                ("growth_factor", ctypes.c_double),
                ("backoff_factor", ctypes.c_double),
                ("growth_interval", ctypes.c_int64),
                ("min_scale", ctypes.c_double), ("dynamic", ctypes.c_int)]


class StepResult(ctypes.Structure):
    _fields_ = [("grad_norm", ctypes.c_double), ("skipped", ctypes.c_int),
                ("loss_scale", ctypes.c_double)]


class MemoryInfo(ctypes.Structure):
    _fields_ = [("bytes_cpu", ctypes.c_uint64), ("bytes_gpu", ctypes.c_uint64),
                ("num_params", ctypes.c_uint64), ("state_bytes", ctypes.c_uint64),
                ("state_bytes_one_rank", ctypes.c_uint64),
                ("scratch_bytes", ctypes.c_uint64), ("world_size", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("grad_bytes", ctypes.c_uint64)]


class PipelineStats(ctypes.Structure):
    """zopt_pipeline_stats (zopt.h): the last pipelined offloaded step's."""
    _fields_ = [("size", ctypes.c_uint32), ("outcome", ctypes.c_int32),
                ("buckets", ctypes.c_int32), ("speculated", ctypes.c_int32),
                ("committed", ctypes.c_int32), ("recomputed", ctypes.c_int32),
                ("late", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("steps", ctypes.c_int64), ("overlapped_seconds", ctypes.c_double),
                ("exposed_seconds", ctypes.c_double), ("copies_in_flight", ctypes.c_int32),
                ("reserved2", ctypes.c_int32)]


class StepStats(ctypes.Structure):
    """zopt_step_stats (zopt.h): the last completed step's host time by kind."""
    _fields_ = [("total_seconds", ctypes.c_double), ("d2h_seconds", ctypes.c_double),
                ("update_seconds", ctypes.c_double), ("h2d_seconds", ctypes.c_double),
                ("d2h_bytes", ctypes.c_uint64), ("h2d_bytes", ctypes.c_uint64),
                ("offloaded", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("steps", ctypes.c_int64)]


class ZoptError(RuntimeError):
    """An error reported by the zopt runtime, the compiler or the bindings.

    ``code`` is a :class:`Status` (the C ``zopt_status``), ``message`` the
    runtime's ``zopt_last_error()`` text (or the compiler's diagnostics).
    """

    def __init__(self, code, message):
        try:
            code = Status(int(code))
        except ValueError:
            code = int(code)
        self.code = code
        self.message = message
        name = code.name if isinstance(code, Status) else str(code)
        super().__init__(f"[{name}] {message}")


class ZoptValueError(ZoptError, ValueError):
    """A value torch.optim refuses with ``ValueError`` (an invalid
    hyperparameter: lr < 0, betas outside [0, 1), ...): both a ZoptError
    (``code`` INVALID_ARGUMENT) and a ValueError, so code written for
    either catches it."""

    def __init__(self, message, code=Status.INVALID_ARGUMENT):
        super().__init__(code, message)


class ZoptTypeError(ZoptError, TypeError):
    """What torch.optim refuses with ``TypeError`` (``params`` a bare
    tensor): both a ZoptError and a TypeError."""

    def __init__(self, message, code=Status.INVALID_ARGUMENT):
        super().__init__(code, message)


def arg_error(arg, msg):
    """ZoptError INVALID_ARGUMENT "<arg>: <msg>" (a bad argument of a
    zopt.steps builder, named first)."""
    return ZoptError(Status.INVALID_ARGUMENT, f"{arg}: {msg}")


def find_runtime_library():
    env = os.environ.get("ZOPT_RUNTIME_LIB")
    if env:
        if not os.path.exists(env):
            raise ZoptError(Status.IO, f"ZOPT_RUNTIME_LIB={env!r} does not exist")
        return env
    hits = sorted(glob.glob(os.path.join(REPO_ROOT, "build", "**",
                                         "libzopt_runtime.so*"),
                            recursive=True), key=len)
    hits = [h for h in hits if os.path.isfile(h)]
    if hits:
        return hits[0]
    return None


_P = ctypes.c_void_p
_S = ctypes.c_int  # zopt_status
_SIGS = {
    "zopt_last_error": (ctypes.c_char_p, []),
    "zopt_api_version": (ctypes.c_uint32, []),
    "zopt_abi_version": (ctypes.c_uint32, []),
    "zopt_step_load": (_S, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "zopt_step_free": (None, [_P]),
    "zopt_step_get_descriptor": (ctypes.POINTER(StepDescriptor), [_P]),
    "zopt_step_isa": (ctypes.c_int, [_P]),
    "zopt_optimizer_create": (_S, [_P, ctypes.POINTER(_P)]),
    "zopt_optimizer_free": (None, [_P]),
    "zopt_optimizer_set_num_threads": (_S, [_P, ctypes.c_int]),
    "zopt_optimizer_add_group": (_S, [_P, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_set_hyper": (_S, [_P, ctypes.c_int, ctypes.c_char_p,
                                      ctypes.c_double]),
    "zopt_optimizer_get_hyper": (_S, [_P, ctypes.c_int, ctypes.c_char_p,
                                      ctypes.POINTER(ctypes.c_double)]),
    "zopt_optimizer_set_group_flags": (_S, [_P, ctypes.c_int, ctypes.c_uint32]),
    "zopt_optimizer_get_group_flags": (_S, [_P, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_uint32)]),
    "zopt_optimizer_add_tensor": (_S, [_P, ctypes.c_int, _P, _P, ctypes.c_int64,
                                       ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_finalize": (_S, [_P]),
    "zopt_optimizer_configure_loss_scaler": (_S, [_P, ctypes.POINTER(LossScalerConfig)]),
    "zopt_optimizer_get_loss_scale": (_S, [_P, ctypes.POINTER(ctypes.c_double)]),
    "zopt_optimizer_step": (_S, [_P, ctypes.POINTER(StepResult)]),
    "zopt_optimizer_step_linked": (_S, [ctypes.POINTER(_P), ctypes.c_int,
                                        ctypes.POINTER(StepResult)]),
    "zopt_optimizer_step_begin": (_S, [_P, ctypes.POINTER(StepResult)]),
    "zopt_optimizer_step_linked_begin": (_S, [ctypes.POINTER(_P), ctypes.c_int,
                                              ctypes.POINTER(StepResult)]),
    "zopt_optimizer_set_max_norm": (_S, [_P, ctypes.c_double]),
    "zopt_optimizer_get_max_norm": (_S, [_P, ctypes.POINTER(ctypes.c_double)]),
    "zopt_optimizer_set_grad_streaming": (_S, [_P, ctypes.c_int]),
    "zopt_optimizer_num_buckets": (_S, [_P, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_bucket_tensors": (_S, [_P, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                           ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_reduce_bucket": (_S, [_P, ctypes.c_int, ctypes.POINTER(_P), ctypes.c_int]),
    "zopt_optimizer_reduce_bucket_async": (_S, [_P, ctypes.c_int, ctypes.POINTER(_P), ctypes.c_int]),
    "zopt_optimizer_bucket_done": (_S, [_P, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_wait_buckets": (_S, [_P]),
    "zopt_optimizer_get_step_count": (_S, [_P, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_int64)]),
    "zopt_optimizer_set_seed": (_S, [_P, ctypes.c_uint64]),
    "zopt_optimizer_get_seed": (_S, [_P, ctypes.POINTER(ctypes.c_uint64)]),
    "zopt_optimizer_read_state_f32": (_S, [_P, ctypes.c_int, ctypes.c_int, _P,
                                           ctypes.c_int64]),
    "zopt_optimizer_write_state_f32": (_S, [_P, ctypes.c_int, ctypes.c_int, _P,
                                            ctypes.c_int64]),
    "zopt_optimizer_read_state_raw": (_S, [_P, ctypes.c_int, ctypes.c_int, _P,
                                           ctypes.c_size_t]),
    "zopt_remainder_join_n": (_S, [_P, _P, _P, ctypes.c_int64]),
    "zopt_remainder_split_n": (_S, [_P, _P, _P, ctypes.c_int64]),
    "zopt_optimizer_write_state_raw": (_S, [_P, ctypes.c_int, ctypes.c_int, _P,
                                            ctypes.c_size_t]),
    "zopt_optimizer_save": (_S, [_P, ctypes.c_char_p]),
    "zopt_optimizer_load": (_S, [_P, ctypes.c_char_p]),
    "zopt_optimizer_load_ex": (_S, [_P, ctypes.c_char_p, ctypes.c_uint32]),
    # paths: a C array of char * (c_array of c_void_p: each a buffer's address)
    "zopt_optimizer_save_linked": (_S, [ctypes.POINTER(_P), ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_void_p)]),
    "zopt_optimizer_load_linked": (_S, [ctypes.POINTER(_P), ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint32]),
    "zopt_optimizer_memory_info": (_S, [_P, ctypes.POINTER(MemoryInfo)]),
    "zopt_optimizer_set_stream": (_S, [_P, _P]),
    "zopt_optimizer_gpu_result": (_S, [_P, ctypes.POINTER(StepResult)]),
    "zopt_optimizer_set_comm": (_S, [_P, _P]),
    "zopt_optimizer_get_world": (_S, [_P, ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_set_bucket_elems": (_S, [_P, ctypes.c_int64]),
    "zopt_optimizer_set_grad_divisor": (_S, [_P, ctypes.c_double]),
    "zopt_optimizer_get_grad_divisor": (_S, [_P, ctypes.POINTER(ctypes.c_double)]),
    "zopt_optimizer_set_active": (_S, [_P, _P, ctypes.c_int64]),
    "zopt_optimizer_get_tensor_step": (_S, [_P, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_int64)]),
    "zopt_optimizer_gather_params": (_S, [_P, ctypes.c_int, ctypes.c_int, _P]),
    "zopt_optimizer_refresh_master": (_S, [_P, ctypes.c_int, ctypes.c_int]),
    "zopt_optimizer_set_tensor_memory": (_S, [_P, ctypes.c_int, _P, _P]),
    "zopt_optimizer_set_grad_memory": (_S, [_P, ctypes.c_int64, _P, _P]),
    "zopt_optimizer_set_tensor_step": (_S, [_P, ctypes.c_int, ctypes.c_int64]),
    "zopt_optimizer_set_step_count": (_S, [_P, ctypes.c_int, ctypes.c_int64]),
    "zopt_optimizer_get_loss_scaler_state": (_S, [_P, ctypes.POINTER(ctypes.c_double),
                                                  ctypes.POINTER(ctypes.c_int64)]),
    "zopt_optimizer_set_loss_scaler_state": (_S, [_P, ctypes.c_double, ctypes.c_int64]),
    "zopt_optimizer_get_op_times": (_S, [_P, ctypes.POINTER(ctypes.c_double), ctypes.c_int]),
    "zopt_optimizer_get_step_stats": (_S, [_P, ctypes.POINTER(StepStats)]),
    # offloaded steps: bucket readiness and speculation (zopt.h; issue 18)
    "zopt_optimizer_grad_bucket_ready": (_S, [_P, ctypes.c_int]),
    "zopt_optimizer_set_speculation_budget": (_S, [_P, ctypes.c_uint64]),
    "zopt_optimizer_get_pipeline_stats": (_S, [_P, ctypes.POINTER(PipelineStats)]),
    # offloaded steps: the params back per bucket (zopt.h; issue 18)
    "zopt_optimizer_set_param_wait": (_S, [_P, ctypes.c_int]),
    "zopt_optimizer_get_param_wait": (_S, [_P, ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_wait_params": (_S, [_P, ctypes.c_int, _P]),
    # the state in memory, tensors added after finalize (zopt.h; issue 17)
    "zopt_optimizer_add_tensors": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P,
                                        ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_int)]),
    "zopt_optimizer_export_state": (_S, [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.c_uint32]),
    "zopt_state_buffer_free": (None, [_P]),
    "zopt_optimizer_import_state": (_S, [_P, _P, ctypes.c_size_t, ctypes.c_uint32]),
    "zopt_optimizer_import_begin": (_S, [_P, ctypes.POINTER(_P)]),
    "zopt_state_import_put": (_S, [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _P,
                                   ctypes.c_int64]),
    "zopt_state_import_set_tensor_step": (_S, [_P, ctypes.c_int, ctypes.c_int64]),
    "zopt_state_import_set_group": (_S, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32]),
    "zopt_state_import_set_hyper": (_S, [_P, ctypes.c_int, ctypes.c_char_p, ctypes.c_double]),
    "zopt_state_import_set_loss_scaler": (_S, [_P, ctypes.POINTER(LossScalerConfig),
                                               ctypes.c_double, ctypes.c_int64]),
    "zopt_state_import_set_seed": (_S, [_P, ctypes.c_uint64]),
    "zopt_state_import_commit": (_S, [_P]),
    "zopt_state_import_abort": (None, [_P]),
    "zopt_optimizer_get_loss_scaler_config": (_S, [_P, ctypes.POINTER(LossScalerConfig)]),
    "zopt_optimizer_get_tensor_steps": (_S, [_P, ctypes.c_int, ctypes.c_int, _P]),
}

_lib = None
_lib_lock = threading.Lock()


def lib():
    """The loaded runtime library (loaded on first use)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = find_runtime_library()
        if path is None:
            raise ZoptError(
                Status.IO,
                "libzopt_runtime.so not found: set ZOPT_RUNTIME_LIB or build the "
                f"runtime under {os.path.join(REPO_ROOT, 'build')}")
        try:
            L = ctypes.CDLL(path)
        except OSError as e:
            raise ZoptError(Status.IO, f"cannot load {path}: {e}") from None
        for name, (res, args) in _SIGS.items():
            try:
                fn = getattr(L, name)
            except AttributeError:
                raise ZoptError(Status.ABI,
                                f"{path} does not export {name}") from None
            fn.restype = res
            fn.argtypes = args
        if L.zopt_api_version() != API_VERSION:
            raise ZoptError(Status.ABI, f"{path}: API version "
                            f"{L.zopt_api_version()}, bindings expect {API_VERSION}")
        L._zopt_path = path
        _lib = L
        return L


_NP_OF_CTYPE = {ctypes.c_void_p: "uintp", ctypes.c_int: "intc", ctypes.c_int32: "int32",
                ctypes.c_uint8: "uint8", ctypes.c_int64: "int64"}


def c_array(ctype, values):
    """``values`` as a C array of ``ctype``: (a numpy array holding them, to
    keep alive across the call; a ctypes pointer to its first element, for
    a ``POINTER(ctype)`` argument; ``.ctypes.data`` for a ``void *`` one).
    Never ``ctype * n``: ctypes caches the array type of each length only
    weakly, so every such array left its type (a class: a reference cycle)
    behind as cyclic garbage once it died; nor numpy's ``data_as``, whose
    ``ctypes.cast`` of a ctypes object makes a cycle too (a cast of the
    integer address does not). At least one element."""
    import numpy as np
    a = np.array([0 if v is None else v for v in values] or [0],
                 dtype=getattr(np, _NP_OF_CTYPE[ctype]))
    return a, ctypes.cast(a.ctypes.data, ctypes.POINTER(ctype))


def check(status, what=""):
    """Raises ZoptError for a non-OK status with zopt_last_error()."""
    if status != 0:
        msg = lib().zopt_last_error()
        msg = msg.decode("utf-8", "replace") if msg else ""
        if what:
            msg = f"{what}: {msg}" if msg else what
        raise ZoptError(status, msg)


def check_value(status, what):
    """check() of a call that sets a hyperparameter: a value the runtime
    refuses (INVALID_ARGUMENT: out of range) raises ZoptValueError, the
    ValueError torch.optim raises for it."""
    if status:
        try:
            check(status, what)
        except ZoptError as e:
            if e.code == Status.INVALID_ARGUMENT:
                raise ZoptValueError(e.message) from None
            raise


# ---- comm.h (runtime/include/zopt/comm.h): communicators ---------------------
COMM_OPS_VERSION = 1
COMM_OK = 0
COMM_ERR_FAILED = 1
COMM_ERR_TIMEOUT = 2
COMM_ERR_MISMATCH = 3
COMM_MEM_HOST = 1
COMM_MEM_DEVICE = 2
LOOPBACK_DELAY = 1
LOOPBACK_POISON = 2
NCCL_UNIQUE_ID_BYTES = 128

# The engine table's function types. last_error returns a char* as an
# integer address (a c_char_p result of a callback would dangle).
COMM_XFER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_size_t)
COMM_SYNC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
COMM_TIMEOUT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double)
COMM_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
COMM_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
COMM_DESTROY_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class CommOps(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("memory", ctypes.c_uint32),
                ("name", ctypes.c_char_p),
                ("all_to_all", COMM_XFER_FN), ("all_gather", COMM_XFER_FN),
                ("exchange", COMM_XFER_FN), ("synchronize", COMM_SYNC_FN),
                ("set_timeout", COMM_TIMEOUT_FN), ("abort", COMM_ABORT_FN),
                ("last_error", COMM_ERROR_FN), ("destroy", COMM_DESTROY_FN)]


class LoopbackOptions(ctypes.Structure):
    _fields_ = [("timeout_s", ctypes.c_double), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32), ("seed", ctypes.c_uint64)]


_SIGS.update({
    "zopt_comm_create": (_S, [ctypes.POINTER(CommOps), _P, ctypes.c_int, ctypes.c_int,
                              ctypes.POINTER(_P)]),
    "zopt_comm_create_self": (_S, [ctypes.POINTER(_P)]),
    "zopt_comm_create_loopback": (_S, [ctypes.c_int, ctypes.POINTER(LoopbackOptions),
                                       ctypes.POINTER(_P)]),
    "zopt_comm_create_mpi": (_S, [_P, ctypes.POINTER(_P)]),
    "zopt_comm_nccl_unique_id": (_S, [_P]),
    "zopt_comm_create_nccl": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.POINTER(_P)]),
    "zopt_comm_free": (None, [_P]),
    "zopt_comm_rank": (ctypes.c_int, [_P]),
    "zopt_comm_size": (ctypes.c_int, [_P]),
    "zopt_comm_name": (ctypes.c_char_p, [_P]),
    "zopt_comm_memory": (ctypes.c_uint32, [_P]),
    "zopt_comm_set_timeout": (_S, [_P, ctypes.c_double]),
    "zopt_comm_set_checks": (_S, [_P, ctypes.c_int]),
    "zopt_comm_count": (ctypes.c_uint64, [_P]),
    "zopt_comm_all_to_all": (_S, [_P, _P, _P, ctypes.c_size_t]),
    "zopt_comm_all_gather": (_S, [_P, _P, _P, ctypes.c_size_t]),
    "zopt_comm_barrier": (_S, [_P]),
    "zopt_comm_synchronize": (_S, [_P]),
})


# ---- abi.h state flags, zopt.h load flags (appended) -------------------------
STATE_PER_BLOCK = 2            # ZOPT_STATE_PER_BLOCK: one element per ZOPT_Q8_BLOCK (a q8 absmax)
STATE_PARTITIONED = 1          # ZOPT_STATE_PARTITIONED: sharded across ranks under ZeRO
LOAD_ALLOW_RULE_CHANGE = 1     # ZOPT_LOAD_ALLOW_RULE_CHANGE (zopt_optimizer_load_ex)
LOAD_VALIDATE_ONLY = 2         # ZOPT_LOAD_VALIDATE_ONLY (load_ex, import_state)
EXPORT_WHOLE = 1               # ZOPT_EXPORT_WHOLE (zopt_optimizer_export_state)
EXPORT_NO_CHECKSUMS = 2        # ZOPT_EXPORT_NO_CHECKSUMS (export_state: an image for this process)
GROUP_MAXIMIZE = 1             # ZOPT_GROUP_MAXIMIZE (zopt_optimizer_set_group_flags)
PARAM_WAIT_ALL = 0             # ZOPT_PARAM_WAIT_ALL (zopt_optimizer_set_param_wait)
PARAM_WAIT_PER_BUCKET = 1      # ZOPT_PARAM_WAIT_PER_BUCKET (zopt_optimizer_wait_params)
DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}

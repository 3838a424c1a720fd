"""The dtypes of the binding: zopt's (``_lib.DType``), numpy's and torch's,
and conversions of state values between them as *storage bits* (the
runtime's raw state layout: float32, float16, and bf16 as uint16 bit
patterns, in a param's memory order).

Also torch's per-param state keys and the zopt state kinds they name, and
the canonical names of a step's dtype arguments (``dtype_name``: "bf16" for
"bfloat16", torch.bfloat16, ...).
"""
from __future__ import annotations

import numpy as np

from . import _lib, bf16
from ._lib import DType, Placement, StateKind, Status, ZoptError, STATE_BY_NAME, arg_error, check

try:  # torch is optional
    import torch
except Exception:  # pragma: no cover
    torch = None

NP_DTYPES = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16,
             np.dtype(np.uint16): DType.BF16}
NP_OF = {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16,
         DType.I16: np.int16,  # a remainder master's raw low halves
         DType.Q8: np.uint8}  # a q8 moment's codes
# the dtypes of state data (a remainder master's low halves too; never a param's)
STATE_NP_DTYPES = {**NP_DTYPES, np.dtype(np.int16): DType.I16,
                   np.dtype(np.uint8): DType.Q8}  # a q8 moment's codes

PLACE_GPU = int(Placement.GPU)  # ZOPT_PLACE_GPU (abi.h)

# torch's per-param state keys <-> zopt state kinds ("master" and "param" are
# zopt's own: the f32 master of low-precision params, ZeRO-3's held params).
TORCH_KEY = {StateKind.EXP_AVG: "exp_avg", StateKind.EXP_AVG_SQ: "exp_avg_sq",
             StateKind.MAX_EXP_AVG_SQ: "max_exp_avg_sq",
             StateKind.MOMENTUM_BUFFER: "momentum_buffer",
             StateKind.MASTER: "master", StateKind.PARAM: "param",
             # a Kahan param's compensation: optimi's name for it (NUMERICS §11)
             StateKind.KAHAN_COMP: "kahan_comp"}
KIND_OF_KEY = {v: k for k, v in TORCH_KEY.items()}


def torch_dtypes():
    return {torch.float32: DType.F32, torch.float16: DType.F16,
            torch.bfloat16: DType.BF16}


def torch_of(dt):
    return {DType.F32: torch.float32, DType.F16: torch.float16,
            DType.BF16: torch.bfloat16}[dt]


def is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def kind(k):
    """A state kind from its name ('exp_avg') or number."""
    if isinstance(k, str):
        try:
            return STATE_BY_NAME[k]
        except KeyError:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"unknown state kind {k!r}; known: "
                            f"{sorted(STATE_BY_NAME)}") from None
    return StateKind(int(k))


def np_bits(x):
    """A torch CPU tensor (any layout) -> numpy array (a copy) of its
    storage bits, in memory order. A copy: ``.numpy()`` on a tensor makes
    its storage non-resizable for good (ZeRO-3 release would fail)."""
    x = x.detach().clone()
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
        return x.numpy().view(np.uint16).reshape(-1)
    return x.numpy().reshape(-1)


def from_bits(a, dt):
    """numpy storage array -> torch tensor (shares memory)."""
    c = bf16.contiguous(a)
    if dt == DType.BF16:
        return torch.from_numpy(c.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(c)


def remainder_join(param_bits, rem):
    """f32 masters from their bf16 params' bits (uint16) and int16
    remainders (abi.h "Remainder masters": the runtime's definition)."""
    p = np.ascontiguousarray(param_bits, dtype=np.uint16).reshape(-1)
    r = np.ascontiguousarray(rem, dtype=np.int16).reshape(-1)
    out = np.empty(p.size, dtype=np.float32)
    if p.size != r.size:
        raise ZoptError(Status.INVALID_ARGUMENT, f"remainder_join: {p.size} params, {r.size} remainders")
    check(_lib.lib().zopt_remainder_join_n(p.ctypes.data, r.ctypes.data, out.ctypes.data, p.size),
          "zopt_remainder_join_n")
    return out


def remainder_split(master):
    """f32 masters -> (bf16 param bits (uint16): the master rounded to
    nearest with ties away, int16 remainders), the runtime's split."""
    m = np.ascontiguousarray(master, dtype=np.float32).reshape(-1)
    p = np.empty(m.size, dtype=np.uint16)
    r = np.empty(m.size, dtype=np.int16)
    check(_lib.lib().zopt_remainder_split_n(m.ctypes.data, p.ctypes.data, r.ctypes.data, m.size),
          "zopt_remainder_split_n")
    return p, r


def f32_of_bits(flat, dt):
    """numpy storage bits of dtype dt -> float32 values."""
    if dt == DType.BF16:
        return bf16.to_f32(flat)
    return np.asarray(flat, dtype=np.float32)


def round_bits(f32, dt):
    """float32 values -> storage bits of dtype dt, nearest even (as the
    runtime writes a param from its master)."""
    if dt == DType.BF16:
        return bf16.from_f32(f32)
    with np.errstate(over="ignore"):
        return bf16.contiguous(f32, NP_OF[dt])


def is_rounding_of(pbits, dt, m):
    """Per element: the param (storage bits of dtype dt) is a rounding of
    the master m (float32): the nearest, or the other neighbour of m (what
    stochastic rounding may write); NaN for NaN."""
    pbits = bf16.contiguous(pbits)
    r = round_bits(m, dt)
    pv, rv = f32_of_bits(pbits, dt), f32_of_bits(r, dt)
    signed = {2: np.int16, 4: np.int32}[pbits.dtype.itemsize]
    pi = pbits.view(signed).astype(np.int64)
    ri = r.view(signed).astype(np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (pi == ri) | (pv == m) | (np.isnan(pv) & np.isnan(m))
        other = (np.abs(pi - ri) == 1) & ((pi < 0) == (ri < 0)) & ((pv - m) * (rv - m) < 0)
    return same | other


def convert_bits(a, src, dst):
    """Storage bits of dtype src -> storage bits of dtype dst (rounded to
    nearest even)."""
    if torch is not None:
        return np_bits(from_bits(a, src).to(torch_of(dst)))
    f = bf16.to_f32(a) if src == DType.BF16 else a.astype(np.float32)
    return bf16.from_f32(f) if dst == DType.BF16 else f.astype(NP_OF[dst])


# The names a step's dtype arguments take (zopt.steps), by alias.
DTYPE_ALIASES = {
    "f32": "f32", "fp32": "f32", "float32": "f32", "float": "f32",
    "bf16": "bf16", "bfloat16": "bf16",
    "f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
}


def dtype_name(x, arg="dtype"):
    """Canonical dtype name ("f32", "bf16", "f16") of a string alias, a torch
    dtype or a numpy dtype; ZoptError naming ``arg`` otherwise."""
    s = x
    if not isinstance(s, str):
        s = getattr(x, "__name__", None) or str(x)
        s = s.replace("torch.", "")
        try:  # numpy dtypes and scalar types
            s = np.dtype(x).name if not str(x).startswith("torch.") else s
        except Exception:
            pass
    key = str(s).strip().lower()
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    raise arg_error(arg, f"unknown dtype {x!r}; allowed: f32, bf16, f16 (or float32, "
                    "bfloat16, float16, fp32, fp16, torch/numpy dtypes)")

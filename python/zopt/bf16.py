"""bfloat16 helpers for numpy.

numpy has no bfloat16 type. zopt represents bf16 arrays on the numpy side as
``np.uint16`` arrays holding the raw bit patterns (the upper 16 bits of the
IEEE float32 with the same value). torch.bfloat16 tensors are used directly.
"""
from __future__ import annotations

import numpy as np


def contiguous(x, dtype=None):
    """x as a C-contiguous numpy array of x's own shape: a 0-d array (a
    scalar) stays 0-d (np.ascontiguousarray alone makes it a 1-element
    array, which numpy >= 2.5 refuses as a scalar)."""
    a = np.asarray(x, dtype=dtype)
    return np.ascontiguousarray(a).reshape(a.shape)


def _flat(x, dtype=None):
    """(x as a flat C-contiguous array, x's shape): each conversion works on
    the flat array and returns its result in x's shape, so a 0-d array (a
    scalar) in gives a 0-d array out. (np.ascontiguousarray alone made it a
    1-element array, which numpy >= 2.5 refuses as a scalar: ``arr[i] =
    it`` and ``float(it)`` raise.)"""
    a = np.asarray(x, dtype=dtype)
    return np.ascontiguousarray(a).reshape(-1), a.shape


def to_f32(u16):
    """bf16 bit patterns (uint16) -> float32 values (exact), of u16's shape."""
    a, shape = _flat(u16)
    if a.dtype != np.uint16:
        raise TypeError(f"bf16 arrays are uint16 bit patterns, got {a.dtype}")
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def from_f32(f32):
    """float32 (or anything castable to it) -> bf16 bit patterns (uint16).

    Rounds to nearest, ties to even; NaN stays NaN (quiet, sign kept);
    values past the bf16 range become +-inf like any RNE narrowing.
    """
    a, shape = _flat(f32, np.float32)
    bits = a.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        quiet = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
        rounded = np.where(nan, quiet, rounded)
    return rounded.reshape(shape)


def round_f64(x):
    """float64 -> float64 value of the nearest bf16 (ties to even).

    Rounds the float64 directly (one rounding, no float32 detour) by bit
    manipulation of the float64 mantissa (52 -> 7 bits) in the normal bf16
    range, and to a multiple of 2^-133 (the subnormal quantum) below 2^-126;
    NaN stays NaN; overflow gives inf.
    """
    a, shape = _flat(x, np.float64)
    bits = a.view(np.uint64)
    drop = np.uint64(45)
    lsb = (bits >> drop) & np.uint64(1)
    half = np.uint64((1 << 44) - 1)
    r = ((bits + half + lsb) >> drop) << drop
    out = r.view(np.float64).copy()
    # The f64 mantissa is rounded; a value past the largest bf16 overflows.
    big = np.abs(out) > float(np.float32(3.3895313892515355e38))
    out[big] = np.copysign(np.inf, out[big])
    nan = np.isnan(a)
    out[nan] = np.nan
    inf = np.isinf(a)
    out[inf] = a[inf]
    # bf16 subnormals (below 2^-126): multiples of 2^-133, ties to even
    # (the scaling by a power of two is exact in float64).
    tiny = np.abs(a) < 2.0 ** -126
    out[tiny] = np.round(a[tiny] * 2.0 ** 133) * 2.0 ** -133
    return out.reshape(shape)


# ---- stochastic rounding (runtime/include/zopt/abi.h, the definition) -----
_M32 = 0xFFFFFFFF


def fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 (numpy arrays or ints)."""
    h = np.asarray(h, dtype=np.uint32)
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        h = h ^ (h >> np.uint32(16))
    return h


def sr_key(seed, t, tensor, index_hi=0):
    """zopt_sr_key: the key of (seed, 1-based step t, tensor, index >> 32)."""
    seed, t = int(seed), int(t)
    k = fmix32(np.uint32(seed & _M32) ^ fmix32(np.uint32(((seed >> 32) + 0x9E3779B9) & _M32)))
    k = fmix32(k ^ np.uint32(t & _M32) ^ fmix32(np.uint32(((t >> 32) + 0x7F4A7C15) & _M32)))
    k = fmix32(k ^ np.uint32(tensor))
    return fmix32(k ^ np.uint32(index_hi))


def sr_bits(key, slot, index):
    """zopt_sr_bits: 16 random bits for element `index` (uint32 array) of
    state `slot` under `key`."""
    index = np.asarray(index, dtype=np.uint32)
    with np.errstate(over="ignore"):
        ks = np.uint32((int(key) + int(slot) * 0x27D4EB2F) & _M32)
        h = (index * np.uint32(0x9E3779B1)) ^ ks
    return fmix32(h) >> np.uint32(16)


def from_f32_stochastic(f32, rbits):
    """float32 -> bf16 bit patterns, rounded stochastically with the 16-bit
    values `rbits`: (bits + r) >> 16; NaN as from_f32 (quiet)."""
    a, shape = _flat(f32, np.float32)
    bits = a.view(np.uint32)
    r = np.broadcast_to(np.asarray(rbits, dtype=np.uint32), shape).reshape(-1)
    with np.errstate(over="ignore"):
        out = ((bits + r) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out = np.where(nan, from_f32(a), out)
    return out.reshape(shape)

"""Runtime checkpoint files (format 2, runtime/src/checkpoint/checkpoint.cpp)
written and read from Python.

The C API has no setter for the per-tensor and per-group step counts, the
loss scaler's good-step counter or (before finalize) a tensor's states; a
checkpoint file carries all of them, and ``zopt_optimizer_load_ex``
validates a file completely before it changes anything. So the binding
writes a one-rank (world size 1) format-2 file of what it wants the
optimizer to hold and loads it: ``Optimizer.load_state_dict`` (torch's
layout, or a torch optimizer's state_dict) and the rebuilds of the native
optimizer (``add_param_group``, a param whose storage moved) go this way.
A world-size-1 file loads at any world size: every rank reads the pieces it
holds.

Checksums are FNV-1a-64. The header's is computed byte by byte (it is
small: 24 bytes per tensor, 40 per piece); the data's is computed for many
pieces at once with numpy (FNV is sequential within a piece, so the data
are cut into pieces of at most ``PIECE_BYTES`` and the pieces are hashed
side by side).
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC2 = b"ZOPTCKP2"
VERSION = 2
FNV_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1
DATA_ALIGN = 64
PIECE_BYTES = 1 << 16
NAME_LEN = 64


def fnv1a64(data, h=FNV_BASIS):
    """FNV-1a-64 of a bytes-like object (sequential; for headers)."""
    p = FNV_PRIME
    m = _MASK
    for b in bytes(data):
        h = ((h ^ b) * p) & m
    return h


def fnv1a64_many(chunks):
    """FNV-1a-64 of each uint8 array in ``chunks`` (a list), hashed side by
    side: one numpy step per byte position of the longest chunk."""
    n = len(chunks)
    if n == 0:
        return []
    lens = np.array([c.size for c in chunks], dtype=np.int64)
    order = np.argsort(-lens, kind="stable")
    L = int(lens.max())
    pad = np.zeros((n, max(L, 1)), dtype=np.uint8)
    for row, i in enumerate(order):
        c = chunks[i]
        pad[row, :c.size] = c
    slens = lens[order]
    # active[j] = how many (sorted, longest first) chunks have a byte j
    active = n - np.searchsorted(slens[::-1], np.arange(L), side="right")
    h = np.full(n, FNV_BASIS, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    col = np.empty(n, dtype=np.uint64)
    for j in range(L):
        k = int(active[j])
        if k == 0:
            break
        np.copyto(col[:k], pad[:k, j], casting="unsafe")
        np.bitwise_xor(h[:k], col[:k], out=h[:k])
        np.multiply(h[:k], prime, out=h[:k])
    out = [0] * n
    for row, i in enumerate(order):
        out[i] = int(h[row])
    return out


def _align(x, a=DATA_ALIGN):
    return (x + a - 1) // a * a


def write(path, *, name, desc_checksum, scaler, seed, kinds, groups, tensors,
          data):
    """Writes a world-size-1 format-2 checkpoint.

    scaler: (scale, good_steps, init_scale, growth_factor, backoff_factor,
    growth_interval, min_scale, dynamic); kinds: [(state kind, dtype)] (a
    kind may have no data: the loader then starts it at zero, a master from
    the params); groups: [(step_count, [(hyper kind, value)])]; tensors:
    [(group, numel, steps)]; data: {(kind index, tensor): flat numpy array
    of the kind's dtype (its bytes are stored)}.
    """
    pieces = []  # (ki, t, start_elem, len_elem, uint8 array)
    for (ki, t), arr in sorted(data.items()):
        a = np.ascontiguousarray(arr).reshape(-1)
        es = a.dtype.itemsize
        if a.size != tensors[t][1]:
            raise ValueError(f"tensor {t}: {a.size} values for {tensors[t][1]} elements")
        if a.size == 0:
            continue
        per = max(1, PIECE_BYTES // es)
        b = a.view(np.uint8)
        for s in range(0, a.size, per):
            e = min(a.size, s + per)
            pieces.append((ki, t, s, e - s, b[s * es:e * es]))
    fnvs = fnv1a64_many([p[4] for p in pieces])
    nm = name.encode()[:NAME_LEN - 1]
    H = bytearray()
    H += MAGIC2
    H += struct.pack("<IIQ", VERSION, 0, 0)  # header size patched below
    H += struct.pack("<Q", desc_checksum & _MASK)
    H += nm + b"\0" * (NAME_LEN - len(nm))
    H += struct.pack("<IIII", 1, 0, len(groups), len(tensors))
    (scale, good, init, growth, backoff, interval, min_scale, dynamic) = scaler
    H += struct.pack("<dqdddqdII", scale, good, init, growth, backoff, interval,
                     min_scale, 1 if dynamic else 0, 0)
    H += struct.pack("<Q", seed & _MASK)
    H += struct.pack("<II", len(kinds), 0)
    for k, dt in kinds:
        H += struct.pack("<II", int(k), int(dt))
    for count, hypers in groups:
        H += struct.pack("<qII", int(count), len(hypers), 0)
        for hk, v in hypers:
            H += struct.pack("<IId", int(hk), 0, float(v))
    for g, numel, steps in tensors:
        H += struct.pack("<IIqq", int(g), 0, int(numel), int(steps))
    H += struct.pack("<Q", len(pieces))
    hsize = len(H) + 40 * len(pieces) + 8
    off = _align(hsize + 8)
    offsets = []
    for p in pieces:
        offsets.append(off)
        off = _align(off + p[4].size)
    data_end = offsets[-1] + pieces[-1][4].size if pieces else hsize + 8
    for p, o, f in zip(pieces, offsets, fnvs):
        H += struct.pack("<IIqqQQ", p[0], p[1], p[2], p[3], o, f)
    H += struct.pack("<Q", data_end)
    assert len(H) == hsize
    H[16:24] = struct.pack("<Q", hsize)
    H += struct.pack("<Q", fnv1a64(H))
    with open(path, "wb") as fh:
        fh.write(H)
        pos = len(H)
        for p, o in zip(pieces, offsets):
            if o > pos:
                fh.write(b"\0" * (o - pos))
            fh.write(p[4].tobytes())
            pos = o + p[4].size
    return path


def read_scaler(path):
    """(scale, good_steps, config dict, seed or None) from the fixed header
    of a checkpoint file (format 1 or 2), without checking it (the runtime
    checked it when it loaded the file)."""
    with open(os.fspath(path), "rb") as fh:
        head = fh.read(256)
    if head[:8] == MAGIC2:
        pos = 24 + 8 + NAME_LEN + 16
        seed_at = pos + 64
    elif head[:8] == b"ZOPTCKP1":
        pos = 16 + 8 + NAME_LEN + 8
        seed_at = None
    else:
        raise ValueError(f"{path}: not a zopt checkpoint")
    (scale, good, init, growth, backoff, interval, min_scale,
     dynamic, _) = struct.unpack_from("<dqdddqdII", head, pos)
    seed = struct.unpack_from("<Q", head, seed_at)[0] if seed_at else None
    cfg = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
               growth_interval=interval, min_scale=min_scale, dynamic=bool(dynamic))
    return scale, good, cfg, seed


def read_tensor_table(path):
    """(step name, world size, number of groups, [(group, numel) per
    tensor]) from a format-2 checkpoint's header, without checking it (the
    runtime checks the file when it loads it); None for another format."""
    with open(os.fspath(path), "rb") as fh:
        head = fh.read(24)
        if head[:8] != MAGIC2:
            return None
        hsize = struct.unpack_from("<Q", head, 16)[0]
        if hsize > (1 << 34):
            raise ValueError(f"{path}: implausible header size {hsize}")
        head += fh.read(hsize - 24)
    name = head[32:32 + NAME_LEN].split(b"\0", 1)[0].decode(errors="replace")
    pos = 32 + NAME_LEN
    world, _rank, ngroups, ntensors = struct.unpack_from("<IIII", head, pos)
    pos += 16 + 64 + 8
    nkinds = struct.unpack_from("<I", head, pos)[0]
    pos += 8 + 8 * nkinds
    for _ in range(ngroups):
        nh = struct.unpack_from("<qI", head, pos)[1]
        pos += 16 + 16 * nh
    table = []
    for i in range(ntensors):
        group, _pad, numel, _steps = struct.unpack_from("<IIqq", head, pos + 24 * i)
        table.append((group, numel))
    return name, world, ngroups, table


def read_tensors(path):
    """(step name, world size, [numel per tensor]) from a format-2
    checkpoint's header (read_tensor_table); None for another format."""
    t = read_tensor_table(path)
    if t is None:
        return None
    name, world, _ngroups, table = t
    return name, world, [numel for _, numel in table]

"""Runtime checkpoint files (format 3, runtime/src/checkpoint/checkpoint.cpp;
docs/CHECKPOINT.md) read, and written, from Python.

Reading: the header's tensor table (which class a ``load()`` file holds,
a GPU step's extra native groups) and the loss scaler's configuration (the
C API has no getter for it). Writing, for one user only (zopt._rebuild): a
native optimizer rebuilt with its states (``add_param_group``, a param
whose storage moved, ``load_state_dict``) loads a one-rank (world size 1)
format-3 file the binding writes, because the C API cannot set a tensor's
states before finalize nor a GPU step's per-tensor counts, and
``zopt_optimizer_load_ex`` validates a whole file before it changes
anything. The runtime's in-memory state export/import replaces the writer.
A world-size-1 file loads at any world size: every rank reads the pieces it
holds. Its save identity is random (a one-file set has no other file to
match). The readers read formats 2 and 3 (and the scaler of 1).

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

MAGIC2 = b"ZOPTCKP2"  # formats 2 and 3
VERSION = 3
SAVE_ID_BYTES = 16  # format 3: after world and rank
GROUP_MAXIMIZE = 1  # format 3: bit 0 of a group's flags
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
    """Writes a world-size-1 format-3 checkpoint.

    scaler: (scale, good_steps, init_scale, growth_factor, backoff_factor,
    growth_interval, min_scale, dynamic); kinds: [(state kind, dtype)] (a
    kind may have no data: the loader then starts it at zero, a master from
    the params); groups: [(step_count, [(hyper kind, value)], flags)] (flags:
    GROUP_MAXIMIZE or 0; may be left out: 0); tensors:
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
    H += struct.pack("<II", 1, 0)
    H += os.urandom(SAVE_ID_BYTES)
    H += struct.pack("<II", len(groups), len(tensors))
    (scale, good, init, growth, backoff, interval, min_scale, dynamic) = scaler
    H += struct.pack("<dqdddqdII", scale, good, init, growth, backoff, interval,
                     min_scale, 1 if dynamic else 0, 0)
    H += struct.pack("<Q", seed & _MASK)
    H += struct.pack("<II", len(kinds), 0)
    for k, dt in kinds:
        H += struct.pack("<II", int(k), int(dt))
    for grp in groups:
        count, hypers = grp[0], grp[1]
        flags = int(grp[2]) if len(grp) > 2 else 0
        H += struct.pack("<qII", int(count), len(hypers), flags)
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
    of a checkpoint file (format 1, 2 or 3), without checking it (the
    runtime checked it when it loaded the file)."""
    with open(os.fspath(path), "rb") as fh:
        head = fh.read(256)
    if head[:8] == MAGIC2:
        pos = 24 + 8 + NAME_LEN + 16 + _id_bytes(head, path)
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


def _id_bytes(head, path):
    """Bytes of the save identity in a ZOPTCKP2 header: 16 in format 3, 0
    in format 2."""
    version = struct.unpack_from("<I", head, 8)[0]
    if version not in (2, 3):
        raise ValueError(f"{path}: checkpoint format version {version}, this binding reads 1 to 3")
    return SAVE_ID_BYTES if version == 3 else 0


def read_tensor_table(path):
    """(step name, world size, number of groups, [(group, numel) per
    tensor]) from a format-2 or 3 checkpoint's header, without checking it
    (the runtime checks the file when it loads it); None for another
    format."""
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
    world, _rank = struct.unpack_from("<II", head, pos)
    pos += 8 + _id_bytes(head, path)
    ngroups, ntensors = struct.unpack_from("<II", head, pos)
    pos += 8 + 64 + 8
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
    """(step name, world size, [numel per tensor]) from a format-2 or 3
    checkpoint's header (read_tensor_table); None for another format."""
    t = read_tensor_table(path)
    if t is None:
        return None
    name, world, _ngroups, table = t
    return name, world, [numel for _, numel in table]

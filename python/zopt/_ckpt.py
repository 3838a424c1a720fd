"""The checkpoint format (docs/CHECKPOINT.md), read from Python: an image in
memory (``zopt_optimizer_export_state``'s buffer: what ``state_dict()`` and
the rebuilds read) and the header of a file (which class a ``load()`` file
holds, a GPU step's extra native groups).

A reader only: the runtime is the format's one writer (files, and images in
memory). :func:`parse` reads formats 2 and 3 (the scaler of format 1 too,
:func:`read_scaler`); it checks the sizes it reads against the buffer but
not the checksums: the images it reads come from the runtime that just
wrote them, and a file the binding loads is loaded (and checked) by the
runtime.
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC2 = b"ZOPTCKP2"  # formats 2 and 3
SAVE_ID_BYTES = 16  # format 3: after world and rank
GROUP_MAXIMIZE = 1  # format 3: bit 0 of a group's flags
NAME_LEN = 64
_FIXED = 24 + 8 + NAME_LEN + 8  # magic .. world, rank
_SCALER = struct.Struct("<dqdddqdII")
_TENSOR = np.dtype([("group", "<u4"), ("pad", "<u4"), ("numel", "<i8"), ("steps", "<i8")])
_PIECE = np.dtype([("ki", "<u4"), ("t", "<u4"), ("start", "<i8"), ("len", "<i8"),
                   ("off", "<u8"), ("fnv", "<u8")])
# storage dtype of zopt_dtype (F32, BF16 bits, F16, I16: a remainder master's low halves)
_NP = {1: np.dtype("<f4"), 2: np.dtype("<u2"), 3: np.dtype("<f2"), 4: np.dtype("<i2"),
       5: np.dtype("u1")}  # q8 codes
# q8 absmax kinds (abi.h "q8 moments"): one f32 per block of 256 elements
_PER_BLOCK = (8, 9)
Q8_BLOCK = 256


class Image:
    """One image of the format, read: the header's fields and tables, and
    the states as numpy arrays over the image's bytes (views, no copy).

    ``kinds`` [(state kind, dtype)]; ``groups`` [(step count, {hyper kind:
    value}, flags)]; ``tensors`` a structured array (group, numel, steps);
    ``scale``, ``good_steps``, ``scaler_cfg`` (zopt._native.scaler_config's
    keys), ``seed``; ``world``, ``rank``, ``save_id`` (None in format 2)."""

    def __init__(self, buf, what="image"):
        b = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        self.buf = b
        h = _header(b, what)
        self.__dict__.update(h)
        p = h["pieces"]
        # (kind index, tensor) -> its pieces (one per tensor in a whole image)
        self._where = where = {}
        for ki, t, start, n, off in zip(p["ki"].tolist(), p["t"].tolist(), p["start"].tolist(),
                                        p["len"].tolist(), p["off"].tolist()):
            where.setdefault((ki, t), []).append((start, n, off))

    def state(self, ki, t):
        """State ``kinds[ki]`` of tensor t, every element (its storage dtype,
        the tensor's memory order): a view of the image where one piece
        holds it, else the pieces joined; None where the image has none."""
        runs = self._where.get((ki, t))
        if not runs:
            return None
        dt = _NP[self.kinds[ki][1]]
        numel = int(self.tensors["numel"][t])
        if self.kinds[ki][0] in _PER_BLOCK:
            numel = -(-numel // Q8_BLOCK)
        es = dt.itemsize

        def view(off, n):
            if off + n * es > self.buf.size:
                raise ValueError(f"{self.what}: a piece of tensor {t} ends past the image")
            return self.buf[off:off + n * es].view(dt)
        if len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == numel:
            return view(runs[0][2], numel)
        out = np.empty(numel, dtype=dt)
        at = 0
        for start, n, off in sorted(runs):
            if start != at:
                raise ValueError(f"{self.what}: tensor {t}'s pieces do not cover it")
            out[start:start + n] = view(off, n)
            at = start + n
        if at != numel:
            raise ValueError(f"{self.what}: tensor {t}'s pieces do not cover it")
        return out


def parse(buf, what="image"):
    """An image in memory (bytes, or a numpy uint8 array: kept, viewed)."""
    return Image(buf, what)


def _header(b, what):
    """The fields and tables of the header of image b (uint8 array; the
    header at least)."""
    def need(n):
        if n > b.size:
            raise ValueError(f"{what}: truncated header ({b.size} bytes, needs {n})")
    need(24)
    if bytes(b[:8]) != MAGIC2:
        raise ValueError(f"{what}: not a zopt checkpoint (format 2 or 3)")
    version, _flags, hsize = struct.unpack_from("<IIQ", b, 8)
    if version not in (2, 3):
        raise ValueError(f"{what}: checkpoint format version {version}, this binding reads 1 to 3")
    need(hsize)
    head = b[:hsize]
    desc_checksum = struct.unpack_from("<Q", head, 24)[0]
    name = bytes(head[32:32 + NAME_LEN]).split(b"\0", 1)[0].decode(errors="replace")
    world, rank = struct.unpack_from("<II", head, 32 + NAME_LEN)
    pos = _FIXED
    save_id = None
    if version == 3:
        save_id = bytes(head[pos:pos + SAVE_ID_BYTES])
        pos += SAVE_ID_BYTES
    ngroups, ntensors = struct.unpack_from("<II", head, pos)
    pos += 8
    (scale, good, init, growth, backoff, interval, min_scale,
     dynamic, _) = _SCALER.unpack_from(head, pos)
    pos += _SCALER.size
    seed = struct.unpack_from("<Q", head, pos)[0]
    pos += 8
    nkinds = struct.unpack_from("<I", head, pos)[0]
    pos += 8
    kinds = [struct.unpack_from("<II", head, pos + 8 * i) for i in range(nkinds)]
    pos += 8 * nkinds
    groups = []
    for _ in range(ngroups):
        count, nh, flags = struct.unpack_from("<qII", head, pos)
        pos += 16
        hypers = {}
        for i in range(nh):
            hk, _pad, v = struct.unpack_from("<IId", head, pos + 16 * i)
            hypers[hk] = v
        pos += 16 * nh
        groups.append((count, hypers, flags if version >= 3 else 0))
    need(pos + _TENSOR.itemsize * ntensors + 8)
    tensors = np.frombuffer(head, dtype=_TENSOR, count=ntensors, offset=pos)
    pos += _TENSOR.itemsize * ntensors
    npieces = struct.unpack_from("<Q", head, pos)[0]
    pos += 8
    need(pos + _PIECE.itemsize * npieces)
    pieces = np.frombuffer(head, dtype=_PIECE, count=npieces, offset=pos)
    return dict(what=what, version=version, name=name, desc_checksum=desc_checksum,
                world=world, rank=rank, save_id=save_id, scale=scale, good_steps=good,
                scaler_cfg=dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                                growth_interval=interval, min_scale=min_scale,
                                dynamic=bool(dynamic)),
                seed=seed, kinds=kinds, groups=groups, tensors=tensors, pieces=pieces)


# ---- files: their headers --------------------------------------------------------
def _file_header(path):
    """The header of a format-2/3 file as an array; None for another format."""
    with open(os.fspath(path), "rb") as fh:
        head = fh.read(24)
        if head[:8] != MAGIC2:
            return None
        hsize = struct.unpack_from("<Q", head, 16)[0]
        if hsize > (1 << 34):
            raise ValueError(f"{path}: implausible header size {hsize}")
        head += fh.read(hsize - 24)
    return np.frombuffer(head, dtype=np.uint8)


def read_scaler(path):
    """(scale, good_steps, config dict, seed or None) from the fixed header
    of a checkpoint file (format 1, 2 or 3), without checking it (the
    runtime checked it when it loaded the file)."""
    with open(os.fspath(path), "rb") as fh:
        head = fh.read(256)
    if head[:8] == MAGIC2:
        version = struct.unpack_from("<I", head, 8)[0]
        if version not in (2, 3):
            raise ValueError(f"{path}: checkpoint format version {version}, this binding "
                             "reads 1 to 3")
        pos = _FIXED + (SAVE_ID_BYTES if version == 3 else 0) + 8
        seed_at = pos + _SCALER.size
    elif head[:8] == b"ZOPTCKP1":
        pos = 16 + 8 + NAME_LEN + 8
        seed_at = None
    else:
        raise ValueError(f"{path}: not a zopt checkpoint")
    (scale, good, init, growth, backoff, interval, min_scale,
     dynamic, _) = _SCALER.unpack_from(head, pos)
    seed = struct.unpack_from("<Q", head, seed_at)[0] if seed_at else None
    cfg = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
               growth_interval=interval, min_scale=min_scale, dynamic=bool(dynamic))
    return scale, good, cfg, seed


def read_tensor_table(path):
    """(step name, world size, number of groups, [(group, numel) per
    tensor]) from a format-2 or 3 checkpoint's header, without checking it
    (the runtime checks the file when it loads it); None for another
    format."""
    b = _file_header(path)
    if b is None:
        return None
    h = _header(b, os.fspath(path))
    table = [(int(g), int(n)) for g, n in zip(h["tensors"]["group"], h["tensors"]["numel"])]
    return h["name"], h["world"], len(h["groups"]), table


def read_tensors(path):
    """(step name, world size, [numel per tensor]) from a format-2 or 3
    checkpoint's header (read_tensor_table); None for another format."""
    t = read_tensor_table(path)
    if t is None:
        return None
    name, world, _ngroups, table = t
    return name, world, [numel for _, numel in table]

"""An oracle of the checkpoint format's checksums (docs/CHECKPOINT.md):
FNV-1a-64 computed in Python, to check the runtime's writer (its header and
piece checksums) from the outside; kept beside the tests, not in the zopt
package (whose _ckpt only reads the format).

``fnv1a64`` is sequential (for headers); ``fnv1a64_many`` hashes many
byte arrays side by side with numpy (FNV is sequential within an array:
one numpy step per byte position of the longest)."""
from __future__ import annotations

import struct

import numpy as np

FNV_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1
PIECE_BYTES = 1 << 16  # a state of more bytes than this is a long piece


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


def check_image(buf):
    """Checks an image of the format (bytes or a uint8 array): its header
    checksum and every piece's; returns the number of pieces."""
    from zopt import _ckpt
    b = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    img = _ckpt.parse(b)
    hsize = struct.unpack_from("<Q", b, 16)[0]
    assert struct.unpack_from("<Q", b, hsize)[0] == fnv1a64(b[:hsize].tobytes()), "header"
    p = img.pieces
    es = {k: _ckpt._NP[dt].itemsize for k, (_, dt) in enumerate(img.kinds)}
    chunks = [b[int(o):int(o) + int(n) * es[int(ki)]]
              for ki, o, n in zip(p["ki"], p["off"], p["len"])]
    assert fnv1a64_many(chunks) == [int(f) for f in p["fnv"]], "pieces"
    return len(chunks)

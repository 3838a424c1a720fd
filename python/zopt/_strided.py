"""Strided (non-dense) torch params: a dense copy is what the runtime sees.

The runtime is elementwise over one block of memory per tensor, so a param
whose elements do not fill one block (a strided view such as ``w[:, ::2]``
or ``w[2:, 1:]``, sharing its storage with other data) cannot be registered
as it is. torch.optim steps such params in place; zopt does it through a
contiguous copy of the param (``e.dense``, the param's shape, C order),
registered as the param's memory and kept in sync with the user's tensor:

* in: the param's values -> the copy before the runtime reads the params
  (every ``step()`` and every call that checks the params first, which is
  also where writes into the params are looked for);
* out: the copy -> the param after the runtime wrote the params (a step, a
  master written into the params, ``write_state`` of the param), through
  ``p.data`` so that ``p._version`` does not change (the runtime's own
  writes never bump it either).

Gradients, ``state[p]`` tensors and state_dict states of such a param are
contiguous (torch's ``zeros_like(p)`` of a non-dense param is contiguous
too). Supported for torch CPU params of CPU-updated steps without ZeRO-3;
refused (naming the param and why) for CUDA params (GPU and offloaded
steps keep device tables of the registered memory and may run inside CUDA
graphs, where no copy can be added), ZeRO-3 (the model's param is a window
onto the runtime's held shard), ``(param, grad)`` pairs (the grad memory is
the user's) and params whose elements overlap each other (an expanded view:
torch refuses to write those in place too).
"""
from __future__ import annotations

import numpy as np

from ._lib import Status, ZoptError

try:
    import torch
except Exception:  # pragma: no cover
    torch = None


def dense(t):
    """True if a torch tensor's elements fill one block of memory without
    overlap (contiguous, channels_last, transposed, ...)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def overlapping(t):
    """True unless the elements of t are provably distinct memory: the
    dims sorted by stride, each stride beyond the extent of the ones
    below it (a sufficient condition; an expanded view fails it)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    extent = 0  # elements spanned by the dims so far, minus one
    for st, sz in dims:
        if st <= extent:
            return True
        extent += (sz - 1) * st
    return False


def unsupported(s, e):
    """Why entry e (a non-dense torch param) cannot be stepped through a
    dense copy by step s, or None."""
    if e.param.device.type != "cpu":
        return ("a CUDA param: GPU and offloaded steps read the registered device memory "
                "directly (CUDA graphs included), with no copy around the step")
    if s.zero3:
        return "ZeRO-3 steps make the model's param a window onto the runtime's shard"
    if not e.auto:
        return "a (param, grad) pair: its grad memory is the user's, laid out like the param"
    if overlapping(e.param):
        return "its elements overlap in memory (an expanded view): torch cannot step it either"
    return None


def make_copy(param):
    """The dense copy of a strided param (C order, its values)."""
    c = torch.empty(tuple(param.shape), dtype=param.dtype, device=param.device)
    c.copy_(param.detach())
    return c


def copy_in(entries, tids):
    """The params' current values -> their dense copies."""
    for t in tids:
        e = entries[t]
        if tuple(e.param.shape) == tuple(e.dense.shape):  # else: _moved names the change
            e.dense.copy_(e.param.detach())


def copy_out(entries, tids):
    """The dense copies (written by the runtime) -> the params, without
    bumping ``p._version`` (``p.data`` has a version counter of its own)."""
    for t in tids:
        e = entries[t]
        e.param.data.copy_(e.dense)


def span(e):
    """(device, first byte, end byte) of a torch param's elements in memory
    (for a strided view: from its first to past its last element)."""
    p = e.param
    ptr = p.data_ptr()
    es = p.element_size()
    last = sum((sz - 1) * st for sz, st in zip(p.shape, p.stride()) if sz > 0)
    return ("cuda" if p.device.type == "cuda" else "cpu"), ptr, ptr + (last + 1) * es


def elements_overlap(a, b):
    """Do two torch tensors (on one device, spans intersecting) share an
    element? Exact: their element addresses are compared."""
    def addrs(t):
        es = t.element_size()
        idx = np.zeros((), dtype=np.int64)
        for sz, st in zip(t.shape, t.stride()):
            idx = idx[..., None] + np.arange(sz, dtype=np.int64) * st
        return (t.data_ptr() + idx.reshape(-1) * es, es)
    (xa, ea), (xb, eb) = addrs(a), addrs(b)
    if ea != eb:  # other element sizes: byte ranges
        xa = (xa[:, None] + np.arange(ea)).reshape(-1)
        xb = (xb[:, None] + np.arange(eb)).reshape(-1)
    return np.intersect1d(xa, xb).size > 0


def check_spans(entries):
    """No two entries' params (nor explicit grads) share memory: two views
    of one storage would be updated twice per step. Strided params whose
    spans intersect (interleaved views, w[:, ::2] and w[:, 1::2]) are
    compared element by element."""
    spans = []
    for e in entries:
        if e.torch:
            dev, lo, hi = span(e)
        else:
            dev, lo = "cpu", e.param.ctypes.data
            hi = lo + e.nbytes
        spans.append((dev, lo, hi, e.name, e))
        if not e.auto:
            spans.append(("cuda" if e.cuda else "cpu", e.gptr, e.gptr + e.gbytes,
                          e.name + "'s grad", None))
    spans.sort(key=lambda x: x[:3])
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            if b[0] != a[0] or b[1] >= a[2]:
                break
            ea, eb = a[4], b[4]
            if ea is not None and eb is not None and \
                    (ea.dense is not None or eb.dense is not None) and \
                    not elements_overlap(ea.param, eb.param):
                continue
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{a[3]} and {b[3]} overlap in memory (views of one "
                            "storage): each param must have memory of its own")

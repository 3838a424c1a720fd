"""A cheap check that the user wrote into params behind the optimizer's back.

``p.data.copy_(x)`` (and numpy writes) change a param without bumping
``p._version``. For steps whose weight is a runtime-held master (bf16/f16
params with an f32 master; ZeRO-3's held params) such writes would be lost:
the next step continues from the old master. The optimizer knows what it
wrote into each param (round(master)); :class:`Sampler` reads two
elements of every watched param (the first and one at a hashed position)
in one numpy gather over the process's address space, once after each step
and once before the next, and reports the tensors whose samples changed. A write that misses every sampled element is not seen
(``Optimizer.refresh_master()`` covers it).

Only host memory is read, and only params whose storage the optimizer has
checked is still the registered one (a moved or freed storage is never
read).
"""
from __future__ import annotations

import numpy as np

_VIEW_DTYPE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _Memory:
    """``n`` elements of ``dtype`` at a raw address, for np.asarray."""

    def __init__(self, addr, n, dtype):
        self.__array_interface__ = {"data": (addr, False), "shape": (n,),
                                    "typestr": np.dtype(dtype).str, "version": 3}


class Sampler:
    """Samples of the params ``entries``: (tensor id, host address, numel)."""

    def __init__(self, itemsize, entries):
        self.itemsize = es = int(itemsize)
        addrs, owners = [], []
        for tid, ptr, n in entries:
            if n <= 0 or not ptr:
                continue
            pos = {0, (tid * 2654435761 + 97) % n}
            for q in sorted(pos):
                addrs.append(ptr + q * es)
                owners.append(tid)
        self.empty = not addrs
        if self.empty:
            return
        a = np.array(addrs, dtype=np.int64)
        lo = int(a.min()) // es * es
        hi = int(a.max()) + es
        span = (hi - lo + es - 1) // es * es
        # A view of [lo, hi) without reading it; the gather below reads only
        # the sampled addresses, which lie inside live params. (Through the
        # array interface: a ctypes array type per span would be left
        # behind as cyclic garbage.)
        self._view = np.asarray(_Memory(lo, span // es, _VIEW_DTYPE[es]))
        self._idx = (a - lo) // es
        self._owners = np.array(owners, dtype=np.int64)
        self.baseline = None

    def read(self):
        return None if self.empty else self._view[self._idx]

    def snapshot(self, tids=None):
        """Records the current samples (after the optimizer wrote params):
        of every param, or only of the tensor ids ``tids`` (the others keep
        their baselines, so writes into them are still found)."""
        if tids is None or self.baseline is None:
            self.baseline = self.read()
            return
        if self.empty:
            return
        sel = np.isin(self._owners, np.asarray(list(tids), dtype=np.int64))
        self.baseline[sel] = self._view[self._idx[sel]]

    def changed(self, skip=()):
        """Tensor ids whose samples differ from the last snapshot; the
        tensors in ``skip`` are not read (their storage may be gone)."""
        if self.empty or self.baseline is None:
            return []
        if skip:
            keep = ~np.isin(self._owners, np.asarray(list(skip), dtype=np.int64))
            diff = np.zeros(self._idx.shape, dtype=bool)
            diff[keep] = self._view[self._idx[keep]] != self.baseline[keep]
        else:
            diff = self._view[self._idx] != self.baseline
        if not diff.any():
            return []
        return sorted(set(self._owners[diff].tolist()))

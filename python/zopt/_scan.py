"""The per-step pass over a part's torch params (zopt._part.Part.pre_step):
which params have a gradient, where the runtime reads each one, and
whether a param's storage or version changed since the last check.

:class:`Scan` is the pure-Python implementation; ``zopt._fast.Scan`` (the
compiled extension, loaded by zopt._ext) runs the same loop in C++ with the
same state and results; python/README.md ("The cost of step()") says why
both exist. The rules (docs/USAGE.md section 3, "Gradient memory"):

* A gradient that is the object last seen, at the address last seen, is
  done (one that is copied is copied again: the user may have written it).
* A new ``p.grad`` (or the same object given other memory) of a CPU step,
  or of a GPU or offloaded step over CUDA params (the runtime rewrites the
  device's pointer table, inside a CUDA graph capture too; an offloaded
  step's copy to the host reads it there), is read in place
  (``zopt_optimizer_set_grad_memory``, one call for all that changed,
  none for a gradient at the address already registered) when it has the
  param's memory layout and is not the param's memory; a view (DeepSpeed's
  and FSDP's flat gradient buffers) also when it overlaps no param and no
  other gradient read in place. Otherwise (other strides, overlapping
  views) it is copied into the optimizer's own memory at
  every step. (``zero_copy`` says which steps read in place.)
* ``p.grad`` None: the param is masked off (``zopt_optimizer_set_active``)
  and its gradient memory is the optimizer's own again.
* A sparse (or otherwise non-strided) gradient is refused before anything
  changes.

``forget()`` makes the next ``sync()`` look at every gradient again (a
mask change the caller could not push is reported again).

``sync()`` returns None when there is nothing to do, else ``(moved, copies,
mask, dirty)``: ``moved`` None or ``(tids, ptrs)`` packed as int32 and
pointer-sized words for ``zopt_optimizer_set_grad_memory``; ``copies`` None
or the indices whose ``p.grad`` the caller copies into its registered
memory now; ``mask`` whether the active mask changed; ``dirty`` whether a
param's data pointer or version differs from the baselines given to
``rebase`` (only when built with ``check``); or the index of a gradient
it refuses (an int; nothing changed).
"""
from __future__ import annotations

import bisect
import operator
from array import array

from ._dtypes import torch

OWN, IN_PLACE, COPIED = 0, 1, 2
_UNSET = object()
_VIEW = object()
_is = operator.is_
_data_ptr = torch.Tensor.data_ptr if torch is not None else None
_grad_of = operator.attrgetter("grad")


class Scan:
    """The gradients of ``params`` (torch tensors given alone; ``tids``
    their tensor ids, ``regs`` their registered gradient views, ``own``
    those views' addresses, ``pptrs``/``numels``/``strides`` the
    registered params' addresses and layouts), the mask ``active`` (a
    bytearray by tensor id), ``spans`` the sorted (start, end) byte ranges
    of every registered param; ``zero_copy``: gradients may be read in
    place; ``check``: also compare each param's data pointer (and with
    ``watch`` its version) with the baselines of :meth:`rebase`.
    ``gbytes``: each gradient's size in bytes."""

    def __init__(self, params, tids, regs, own, pptrs, numels, gbytes, strides, active,
                 spans, zero_copy, check, watch):
        self.params = list(params)
        self.tids = list(tids)
        self.regs = list(regs)
        self.own = list(own)
        self.pptrs = list(pptrs)
        self.numels = list(numels)
        self.gbytes = list(gbytes)
        self.strides = [tuple(s) for s in strides]
        self.active = active
        self.starts = [a for a, _ in spans]
        self.ends = [b for _, b in spans]
        self.zero_copy = bool(zero_copy)
        self.check = bool(check)
        self.watch = bool(watch)
        n = len(self.params)
        self.last = [_UNSET] * n    # p.grad when last seen (None: none)
        self.gp = [0] * n           # its data_ptr() then; IN_PLACE: what the runtime reads
        self.mode = bytearray(n)    # OWN / IN_PLACE / COPIED
        self.views = bytearray(n)   # IN_PLACE and a view
        self.n_views = 0
        self.pb_ptrs = self.pb_vers = None

    def rebase(self, ptrs, vers=None):
        """The baselines of the param checks: data pointers (and versions)."""
        self.pb_ptrs = list(ptrs)
        self.pb_vers = list(vers) if vers is not None else None

    # ---- the pass --------------------------------------------------------------------
    def sync(self):
        ps, last, gp, mode = self.params, self.last, self.gp, self.mode
        dirty = False
        if self.check:
            G, P = [], []
            ga, pa = G.append, P.append
            if self.watch:
                V = []
                va = V.append
                for p in ps:
                    ga(p.grad)
                    pa(p.data_ptr())
                    va(p._version)
                dirty = P != self.pb_ptrs or V != self.pb_vers
            else:
                for p in ps:
                    ga(p.grad)
                    pa(p.data_ptr())
                dirty = P != self.pb_ptrs
        else:
            G = list(map(_grad_of, ps))
        if all(map(_is, G, last)):
            try:
                ptrs = list(map(_data_ptr, G))
            except TypeError:  # some None
                ptrs = [0 if g is None else g.data_ptr() for g in G]
            if ptrs == gp:
                copies = [j for j, m in enumerate(mode) if m == COPIED] if COPIED in mode \
                    else None
                return (None, copies, False, dirty) if copies or dirty else None
        if not self.n_views:
            r = self._direct(G, dirty)
            if r is not _VIEW:
                return r
        return self._changes(G, dirty)

    def _direct(self, G, dirty):
        """_changes in one loop that applies as it goes, for when no view is
        read in place: the state is restored and _VIEW returned as soon as
        a view could be (its overlaps need the two phases of _changes), or
        the index of a refused gradient."""
        last, gp, mode, act, tids, own = (self.last, self.gp, self.mode, self.active,
                                          self.tids, self.own)
        saved = last[:], gp[:], bytes(mode), bytes(act)
        strided = torch.strided
        zero_copy = self.zero_copy
        copies, mt, mp = [], [], []
        mask = False
        for j, (g, old, reg, pptr, numel, stride) in enumerate(
                zip(G, last, self.regs, self.pptrs, self.numels, self.strides)):
            if g is old:
                if g is None:
                    continue
                ptr = g.data_ptr()
                if ptr == gp[j]:
                    if mode[j] == COPIED:
                        copies.append(j)
                    continue
            elif g is None:
                ptr = 0
            elif g.layout is not strided:
                self._restore(saved)
                return j  # refused: the caller names it
            else:
                ptr = g.data_ptr()
            if g is None or g is reg:
                m = OWN
            elif zero_copy and ptr != pptr and (numel <= 1 or g.stride() == stride):
                if g._base is not None:
                    self._restore(saved)
                    return _VIEW
                m = IN_PLACE
            else:
                m = COPIED
            t = tids[j]
            was = mode[j]
            if m == IN_PLACE:
                if was != IN_PLACE or gp[j] != ptr:
                    mt.append(t)
                    mp.append(ptr)
            elif was == IN_PLACE:  # our own memory again
                mt.append(t)
                mp.append(own[j])
            if m == COPIED:
                copies.append(j)
            mode[j] = m
            last[j] = g
            gp[j] = ptr
            on = g is not None
            if act[t] != on:
                act[t] = on
                mask = True
        moved = (array("i", mt).tobytes(), array("Q", mp).tobytes()) if mt else None
        if moved is None and not copies and not mask and not dirty:
            return None
        return moved, (sorted(copies) or None), mask, dirty

    def _restore(self, saved):
        last, gp, mode, act = saved
        self.last[:] = last
        self.gp[:] = gp
        self.mode[:] = mode
        self.active[:] = act

    def _changes(self, G, dirty):
        last, gp, mode = self.last, self.gp, self.mode
        strided = torch.strided
        zero_copy = self.zero_copy
        # 1. what each gradient becomes (nothing changes before all are checked)
        news = []   # (j, g, ptr, new mode, is view)
        add = news.append
        copies = []
        cand_views = False
        for j, (g, old, reg, pptr, numel, stride) in enumerate(
                zip(G, last, self.regs, self.pptrs, self.numels, self.strides)):
            if g is old:
                if g is None:
                    continue
                ptr = g.data_ptr()
                if ptr == gp[j]:
                    if mode[j] == COPIED:
                        copies.append(j)
                    continue
            elif g is None:
                add((j, None, 0, OWN, False))
                continue
            elif g.layout is not strided:
                return j  # refused: the caller names it
            else:
                ptr = g.data_ptr()
            if g is reg:
                add((j, g, ptr, OWN, False))
            elif zero_copy and ptr != pptr and (numel <= 1 or g.stride() == stride):
                view = g._base is not None
                add((j, g, ptr, IN_PLACE, view))
                cand_views = cand_views or view
            else:
                add((j, g, ptr, COPIED, False))
        if not news:
            return (None, copies or None, False, dirty) if copies or dirty else None
        if cand_views or (self.n_views and any(n[3] == IN_PLACE for n in news)):
            news = self._no_overlaps(news)
        # 2. applied
        act, tids, own, views = self.active, self.tids, self.own, self.views
        mt, mp = [], []
        mask = False
        for j, g, ptr, m, view in news:
            t = tids[j]
            old = mode[j]
            if m == IN_PLACE:
                if old != IN_PLACE or gp[j] != ptr:
                    mt.append(t)
                    mp.append(ptr)
            elif old == IN_PLACE:  # our own memory again
                mt.append(t)
                mp.append(own[j])
            if m == COPIED:
                copies.append(j)
            if views[j] != view:
                self.n_views += 1 if view else -1
                views[j] = view
            mode[j] = m
            last[j] = g
            gp[j] = ptr
            on = g is not None
            if act[t] != on:
                act[t] = on
                mask = True
        moved = (array("i", mt).tobytes(), array("Q", mp).tobytes()) if mt else None
        return moved, (sorted(copies) or None), mask, dirty

    def _no_overlaps(self, news):
        """A candidate read in place that overlaps another gradient read in
        place (or, for a view, a param) is copied instead."""
        size = self.gbytes
        changed = {n[0] for n in news}
        # (start, end, j): every gradient read in place after this step
        spans = [(self.gp[j], self.gp[j] + size[j], j) for j, m in enumerate(self.mode)
                 if m == IN_PLACE and size[j] and j not in changed]
        spans += [(ptr, ptr + size[j], j) for j, g, ptr, m, view in news
                  if m == IN_PLACE and size[j]]
        spans.sort()
        bad = set()
        end = None  # the furthest end of the spans before
        for i, (a, b, j) in enumerate(spans):
            if (end is not None and a < end) or (i + 1 < len(spans) and b > spans[i + 1][0]):
                bad.add(j)
            end = b if end is None else max(end, b)
        out = []
        for n in news:
            j, g, ptr, m, view = n
            if m == IN_PLACE and size[j] and (
                    j in bad or (view and self._over_param(ptr, ptr + size[j]))):
                n = (j, g, ptr, COPIED, False)
            out.append(n)
        return out

    def _over_param(self, a, b):
        i = bisect.bisect_right(self.starts, a) - 1
        if i >= 0 and self.ends[i] > a:
            return True
        return i + 1 < len(self.starts) and self.starts[i + 1] < b

    # ---- zero_grad and inspection ----------------------------------------------------
    def drop(self):
        """zero_grad(set_to_none=True): every p.grad None, and no gradient
        kept alive by the optimizer (the runtime keeps the addresses of
        those read in place until the next step registers others)."""
        for p in self.params:
            if p.grad is not None:
                p.grad = None
        self.last = [_UNSET] * len(self.params)

    def forget(self):
        """Every gradient as never seen (p.grad untouched): the next
        ``sync()`` reports each param's gradient again, and the mask where
        ``active`` differs from it (the caller put back the mask the runtime
        kept when pushing this one's change failed). The memory handed over
        stays as it is: a gradient read in place at the same address is not
        handed over again."""
        self.last = [_UNSET] * len(self.params)

    def in_place(self):
        """{tensor id: address} of the gradients the runtime reads in place."""
        return {self.tids[j]: self.gp[j] for j, m in enumerate(self.mode) if m == IN_PLACE}

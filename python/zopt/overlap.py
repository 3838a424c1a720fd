"""Offloaded steps overlapped with backward (``zopt.Optimizer(...,
overlap=True)``; docs/USAGE.md "Overlapping an offloaded step with
backward", docs/GPU.md "Bucket readiness and speculation").

An offloaded step (params and grads on the GPU; master, moments and the
update on the CPU) normally starts at ``step()``. With ``overlap=True`` the
binding marks each gradient bucket ready (``zopt_optimizer_grad_bucket_ready``)
as soon as backward has produced every gradient in it: the runtime copies
the bucket's grads to the host and computes its norm partials and a
speculative update on its own thread while backward goes on. ``step()``
validates (commit / recompute / discard), bit-identical to the serial step.

How (the model is zopt.streaming):

* a hook on each param's AccumulateGrad node marks the param's gradient
  final for this backward; a bucket whose every param (that requires
  grad) is final is marked at once, in the order the hooks run. At W
  ranks each bucket's job reduces it across the ranks, so the ranks must
  mark in the same order: there the buckets are marked in ascending
  order, each once it and the ones before it are final (as gradient
  streaming reduces them), whatever order the ranks' backward produce
  them in;
* before a bucket is marked, its params' gradients are registered
  (``zopt_optimizer_set_grad_memory``, accepted between marks for tensors
  of buckets not marked yet): ``p.grad`` in place when the runtime can read
  it there (the step's grad dtype, the param's device and layout), else
  copied into the optimizer's own gradient memory; f32 gradients of 16-bit
  params: ``p.main_grad`` in place (a ``p.grad`` left first added into it,
  as step() does; the accumulation hooks run before ours);
* at the end of backward (an autograd engine callback) the buckets left
  are marked. At 1 rank a param without a gradient leaves its buckets to
  ``step()`` (which raises, naming it, unless it got one by then). At W
  ranks a param without a gradient on this rank is marked with zeros (the
  optimizer's own gradient memory, zeroed) and ``step()`` drops it from
  this rank's mask (``zopt_optimizer_set_active``, accepted between the
  marks for dropping only): the step agrees the ranks' masks again, so the
  param is updated with the other ranks' gradients (this rank's zeros), or
  left alone when no rank has one: the serial step's result, bit for bit.
  (Before, the other ranks waited for its bucket's reduction until the
  communicator's timeout.) ``step()`` marks whatever no backward did,
  then steps;
* the hyperparameters and the active mask are pushed before the first
  mark of a step (the runtime refuses changes after it: change
  ``param_groups`` before backward);
* ``opt.no_sync()``: micro-batches accumulate in ``p.grad`` (the hooks do
  nothing); the backward outside it marks.

One backward per step outside ``no_sync()``: a gradient arriving for a
marked bucket raises. ``zero_grad()`` after a mark raises (the copies read
that memory). ``opt.pipeline_stats()`` reports the last pipelined step.
"""
from __future__ import annotations

import ctypes

from . import _early, _grads, _lib
from ._dtypes import torch_of
from ._marks import BucketMarks
from ._lib import Status, ZoptError, check

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["OffloadOverlap", "OUTCOMES"]

OUTCOMES = {0: "none", 1: "commit", 2: "recompute", 3: "discard"}


def _refuse(code, msg):
    raise ZoptError(code, f"overlap=True: {msg}")


class OffloadOverlap(BucketMarks):
    """The overlap state of the optimizer's one part (``opt._overlap``,
    ``part.overlap``); the hook-driven cycle is zopt._marks'."""

    def __init__(self, part, budget=None, streaming=False, model=None):
        s = part.step
        if torch is None:
            _refuse(Status.UNSUPPORTED, "needs torch (backward hooks)")
        if streaming:
            _refuse(Status.UNSUPPORTED, "with grad_streaming=True: streaming is for "
                    "CPU-updated steps, the overlap for offloaded ones")
        if s.gpu or not s.on_device:
            _refuse(Status.UNSUPPORTED,
                    f"step '{s.name}' is {'a GPU step' if s.gpu else 'a CPU step'}; the "
                    "overlap is implemented for offloaded steps (params and grads on the "
                    "GPU, the update on the CPU: placement='offload'; with its GPU "
                    "fraction, gpu_fraction=f, the GPU class steps at step())")
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            _refuse(Status.INVALID_ARGUMENT,
                    f"speculation_budget={budget!r}: bytes (an int >= 0), or None for "
                    "every bucket")
        for e in part.entries:
            self.check_entry(e)
        super().__init__(part)
        self.stats["zeroed"] = 0  # W ranks: params marked with zeros (none here)
        self.main = s.f32_grads  # gradients from p.main_grad (f32)
        self.budget = budget
        # params back early: per-bucket waits from the model's forward pre-hooks
        self.early = _early.EarlyParams(part, model) if model is not None else None
        self._idle()

    @staticmethod
    def check_entry(e):
        if not e.auto or not e.torch:
            _refuse(Status.INVALID_ARGUMENT,
                    f"{e.name} is a (param, grad) pair or a numpy array: the overlap reads "
                    "torch params' .grad (pass the params alone)")

    # ---- setup (after every finalize) -------------------------------------------
    def attach(self, h):
        """After finalize (build and every rebuild): the buckets' tensors,
        the budget, the hooks of params not hooked yet. The runtime reads
        every gradient from our own memory again (Part.after_layout)."""
        c = self._part()
        if not c.offload:
            _refuse(Status.UNSUPPORTED,
                    f"step '{c.step.name}' runs on the CPU here (its params are not CUDA "
                    "tensors): the overlap needs an offloaded step over CUDA params")
        L = c.lib
        self.read_buckets(h)
        self._gdtype = torch_of(c.step.grad_dtype)
        self._contig = [e.param.is_contiguous() for e in c.entries]
        if self.budget is not None:
            check(L.zopt_optimizer_set_speculation_budget(h, ctypes.c_uint64(self.budget)),
                  "zopt_optimizer_set_speculation_budget")
        if self.early is not None:
            self.early.attach(h, self.t_buckets)
        self._hook_new()
        self._idle()

    def set_budget(self, budget):
        """The speculation budget in bytes (None: every bucket), between steps."""
        c = self._part()
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            _refuse(Status.INVALID_ARGUMENT, f"speculation budget {budget!r}: bytes (an int >= 0)")
        check(c.lib.zopt_optimizer_set_speculation_budget(
            c.handle(), ctypes.c_uint64(2 ** 64 - 1 if budget is None else budget)),
            "zopt_optimizer_set_speculation_budget")
        self.budget = budget

    # ---- the cycle between two steps ----------------------------------------------
    def _idle(self):
        self.started = False
        self.marked = None   # per bucket
        self.nmarked = 0
        self.final = None    # per tensor: its gradient final for this step
        self.missing = None  # per bucket: tensors not final yet
        self.given = None    # per tensor: registered for this step
        self.next = 0        # W ranks: the first bucket not marked (marked in order)
        self.zeroed = set()  # W ranks: tensors marked with zeros (no gradient here)

    def _start(self, from_hook):
        """The first hook (or step()) since the last step: the param checks,
        the hyperparameters and the active mask pushed (nothing may change
        them after the first mark), then each tensor's readiness."""
        c = self._part()
        o = c.owner()
        ents = c.entries
        if self.main:  # a user's main_grad that the step cannot read: before any change
            for t, e in enumerate(ents):
                mg = getattr(e.param, "main_grad", None)
                if mg is not None and mg is not e.grad:
                    _grads.check_main_grad(c, t, mg)
        c.check_params()
        o._push_hypers()
        T = len(ents)
        has = self._has_grad
        if from_hook:  # every param that requires grad gets one in this backward
            act = [1 if e.param.requires_grad or has(e) else 0 for e in ents]
        else:
            act = [1 if has(e) else 0 for e in ents]
        act = bytes(a if ents[t].numel else 1 for t, a in enumerate(act))
        if act != bytes(c.active):
            c.active[:] = act
            _grads.push_mask(c)
        c.mask_all = 0 not in c.active
        c.active_elems = sum(e.numel for t, e in enumerate(ents) if c.active[t])
        # a param that requires grad but has no hook yet (frozen when the hooks
        # were last added, unfrozen since: hooked after this step) is final at
        # the end of backward only (its bucket marked there, with the
        # gradient backward accumulated); before, it was left inactive and
        # its gradient silently dropped for this step (finding O2)
        self.final = [not (c.active[t] and ents[t].numel) or not (
            from_hook and ents[t].param.requires_grad) for t in range(T)]
        self.missing = [sum(1 for t in ts if not self.final[t]) for ts in self.b_tensors]
        self.marked = [False] * self.nb
        self.given = [False] * T
        self.next = 0
        self.zeroed = set()
        self.started = True
        if from_hook:
            self._queue_backward_end()

    def _backward_end(self):
        if self.started:
            self._mark_all(where="at_backward_end", strict=False)

    def _grad_final(self, c, t):
        """Tensor t's gradient is final for this step: its buckets whose
        every tensor is are marked."""
        if any(self.marked[b] for b in self.t_buckets[t]):
            raise ZoptError(Status.BAD_STATE,
                            f"overlap: {c.entries[t].name} got a gradient after its bucket was "
                            "marked ready (a second backward since the last step()): "
                            "accumulate micro-batches inside opt.no_sync() and run the last "
                            "backward outside it, then step()")
        if self.final[t]:
            return
        self.final[t] = True
        ordered = c.world_size > 1
        for b in self.t_buckets[t]:
            self.missing[b] -= 1
            if self.missing[b] == 0 and not self.marked[b] and not ordered:
                self._mark(b, "in_backward")
        while ordered and self.next < self.nb and self.missing[self.next] == 0:
            if not self.marked[self.next]:
                self._mark(self.next, "in_backward")
            self.next += 1

    def _mark_all(self, where, strict):
        """Marks the buckets left whose active params have gradients
        (strict: every one, else a clear error naming a param without)."""
        c = self._part()
        ents = c.entries
        for b in range(self.nb):
            if self.marked[b]:
                continue
            lacking = [t for t in self.b_tensors[b]
                       if c.active[t] and ents[t].numel and not self._has_grad(ents[t])
                       and t not in self.zeroed]
            if lacking and not strict and c.world_size > 1 and \
                    all(ents[t].grad is not None for t in lacking):
                self.zeroed.update(lacking)  # zeros from this rank, dropped from its mask at step()
                lacking = []
            if lacking:
                if not strict:
                    continue
                e = ents[lacking[0]]
                raise ZoptError(Status.BAD_STATE,
                                f"overlap: {e.name} has no gradient, but its bucket's "
                                "neighbours were marked ready this step, which fixed the set "
                                "of params the step updates: give it a gradient and call "
                                "step() again (params that get none should not require "
                                "grad)")
            self._mark(b, where)

    def _has_grad(self, e):
        p = e.param
        return p.grad is not None or (self.main and getattr(p, "main_grad", None) is not None)

    def _grad_ptr(self, t, e):
        """Tensor t's gradient for the runtime: p.grad in place when the
        runtime can read it there, else copied into our own memory."""
        if self.main:
            return self._main_ptr(t, e)
        g = e.param.grad
        if g is None:
            return e.gptr or None, None  # inactive: its old registration
        if g.is_sparse:
            raise ZoptError(Status.UNSUPPORTED, f"{e.name} has a sparse gradient")
        if (g.dtype == self._gdtype and g.device == e.param.device and g.data_ptr() != e.pptr
                and (e.numel <= 1 or tuple(g.stride()) == e.stride
                     or (g.is_contiguous() and self._contig[t]))):
            return g.data_ptr(), g
        with torch.no_grad():
            e.grad.copy_(g)
        return e.gptr, None

    def _main_ptr(self, t, e):
        """f32 gradients of 16-bit params: a p.grad left (accumulation by
        hand, or no hook) added into p.main_grad first, as step() does
        (zopt._grads.take_grads); then p.main_grad, in place (our own
        buffer's view, or a user's, checked at the cycle's start)."""
        p = e.param
        if p.grad is not None:
            with torch.no_grad():
                _grads.accumulate(p, p.grad, e.grad, e)
        mg = getattr(p, "main_grad", None)
        if mg is None:
            return e.gptr or None, None  # inactive: its old registration
        if mg is e.grad:
            return e.gptr, None
        c = self._part()
        _grads.check_main_grad(c, t, mg)  # (attached during backward)
        return mg.data_ptr(), mg

    def _mark(self, b, where):
        c = self._part()
        ents = c.entries
        tids, ptrs, held = [], [], []
        for t in self.b_tensors[b]:
            if self.given[t] or not ents[t].numel:
                continue
            if t in self.zeroed:  # no gradient on this rank: zeros
                with torch.no_grad():
                    ents[t].grad.zero_()
                ptr, g = ents[t].gptr, None
            else:
                ptr, g = self._grad_ptr(t, ents[t])
            tids.append(t)
            ptrs.append(ptr)
            held.append(g)
        h = c.handle()
        if tids:
            c.set_grad_memory(tids, ptrs)
            for t, ptr, g in zip(tids, ptrs, held):
                self.given[t] = True
                if g is None:
                    c.foreign.pop(t, None)
                else:
                    c.foreign[t] = (g, ptr)  # kept alive while the runtime reads it
        check(c.lib.zopt_optimizer_grad_bucket_ready(h, b), "zopt_optimizer_grad_bucket_ready")
        self.marked[b] = True
        self.nmarked += 1
        self.stats[where] += 1

    # ---- step() ---------------------------------------------------------------------
    def before_step(self, others=False):
        """In step(), instead of the per-step gradient pass: the buckets no
        backward marked. False when there is nothing to step (no marks and
        no gradient, and ``others`` false: no other class of the optimizer,
        the GPU fraction's, has a gradient either)."""
        self._error = None  # (a backward aborted by another error before its end)
        c = self._part()
        if not self.started:
            if c.world_size == 1 and not others and not any(map(self._has_grad, c.entries)):
                return False  # (at W ranks the step is collective: every rank steps)
            self._start(from_hook=False)
        self._mark_all(where="at_step", strict=True)
        if self.zeroed:
            self._drop_zeroed(c)
        return True

    def _drop_zeroed(self, c):
        """W ranks: the params marked with zeros at the end of backward
        (no gradient on this rank) leave this rank's mask; the step agrees
        the ranks' masks again (zopt_optimizer_set_active waits for the
        bucket jobs first)."""
        ents = c.entries
        late = [ents[t].name for t in sorted(self.zeroed) if self._has_grad(ents[t])]
        if late:
            raise ZoptError(Status.BAD_STATE, (
                f"overlap: {late[0]} got a gradient after the end of the backward that gave it "
                "none; its bucket was marked ready then with zeros from this rank (rank "
                f"{c.rank}): give every gradient in backward (or before the backward's end)"))
        for t in self.zeroed:
            c.active[t] = 0
        _grads.push_mask(c)
        c.mask_all = 0 not in c.active
        c.active_elems = sum(e.numel for t, e in enumerate(ents) if c.active[t])
        self.stats["zeroed"] += len(self.zeroed)

    @staticmethod
    def check_step(st, what):
        """A failed native step (status st) raised. (At W ranks the buckets
        are marked in ascending order, so their reductions agree.)"""
        check(st, what)

    def after_step(self):
        self._idle()
        self._hook_new()
        if self.early is not None:
            self.early.after_step(self.nb)

    def check_zero_grad(self):
        self._error = None
        if self.nmarked:
            raise ZoptError(Status.BAD_STATE,
                            "overlap: zero_grad() after buckets of this step were marked ready "
                            "(their gradients are being copied to the host): call step() first "
                            "(or accumulate inside opt.no_sync())")

    @staticmethod
    def refuse_clip():
        _refuse(Status.UNSUPPORTED,
                "clip_grad_norm_: the buckets marked during backward already computed their "
                "norm partials; clip with the step's own clipping (exact: a clipped step is "
                "recomputed)")

    @staticmethod
    def stats_of(ov):
        """Optimizer.pipeline_stats()."""
        if ov is None:
            raise ZoptError(Status.BAD_STATE, "pipeline_stats(): the optimizer was made "
                            "without overlap=True (no pipelined steps)")
        return ov.pipeline_stats()

    def pipeline_stats(self):
        c = self._part()
        s = _lib.PipelineStats()
        s.size = ctypes.sizeof(s)
        check(c.lib.zopt_optimizer_get_pipeline_stats(c.handle(), ctypes.byref(s)),
              "zopt_optimizer_get_pipeline_stats")
        out = {f: getattr(s, f) for f, _ in s._fields_ if f not in ("size", "reserved", "reserved2")}
        out["outcome"] = OUTCOMES.get(s.outcome, str(s.outcome))
        return out

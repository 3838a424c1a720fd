"""Gradient streaming of zopt.Optimizer (``grad_streaming=True``): ZeRO-2/3
gradient memory from the Python binding.

Without it torch keeps every ``p.grad`` until ``step()`` and the step reads
them whole, so each rank holds the full gradients although only its shards
are ever updated. With it the binding hands the gradients to the runtime
bucket by bucket *during backward* (``zopt_optimizer_reduce_bucket_async``:
the runtime's own thread packs the bucket, exchanges it and folds this
rank's shard in rank order into a shard buffer of its own, bit-identical to
the non-streamed step, while backward goes on) and drops each ``p.grad`` as
soon as every bucket it lies in has been reduced (``bucket_done``, polled at
each hook). One bucket is in flight at a time (double buffering: handing
the next one over waits for it), so what a rank holds beyond its reduced
shards is the gradients of two buckets and of a tensor spanning them. The
end of backward waits for the last bucket (as DDP's), so backward returns
with its gradients reduced and freed; any call into the optimizer waits
for buckets in flight, and a failed exchange is raised there.

How:

* a hook on each param's AccumulateGrad node (torch 1.13 has no
  ``register_post_accumulate_grad_hook``) marks the param's gradient ready
  for this backward;
* the buckets are reduced in ONE fixed order on every rank (ascending
  bucket index: the layout puts each group's tensors in reverse add order,
  the order backward produces them), each as soon as it and every bucket
  before it in the order are ready, so the collectives match across ranks
  however each rank's backward runs;
* at the end of every backward (an autograd engine callback) the buckets
  left are reduced, with what ``p.grad`` holds then (None: no gradient on
  this rank), so a param unused on one rank delays nothing past its
  backward; ``step()`` reduces whatever no backward did (no backward at
  all, or gradients set by hand) and steps;
* a tensor spanning buckets is given in all of them or in none (decided
  at its first bucket, its gradient kept until its last one);
* ``opt.no_sync()``: micro-batches accumulate in ``p.grad`` (the hooks do
  nothing); the first backward outside it streams, as with DDP.

One backward per step outside ``no_sync()``: a gradient arriving for a
bucket already reduced raises (it would be lost). Reading ``p.grad``
between backward and ``step()`` (``clip_grad_norm_``, a gradient logger)
sees None for what was reduced: clip with the step's own ``clip=``.
"""
from __future__ import annotations

import collections
import ctypes

import numpy as np

from . import _lib
from ._dtypes import torch_of
from ._marks import BucketMarks
from ._lib import Status, ZoptError, check

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["GradStreamer"]


def _refuse(code, msg):
    raise ZoptError(code, f"grad_streaming=True: {msg}")


class GradStreamer(BucketMarks):
    """The streaming state of one parameter class (a zopt._part.Part: the
    optimizer's only part; ``opt._streamer``); the hook-driven cycle is
    zopt._marks'."""

    def __init__(self, opt):
        s = opt.step
        if torch is None:
            _refuse(Status.UNSUPPORTED, "needs torch (backward hooks)")
        if s.gpu or s.on_device:
            _refuse(Status.UNSUPPORTED,
                    f"step '{s.name}' is {'a GPU step' if s.gpu else 'offloaded'}; "
                    "gradient streaming is implemented for CPU-updated steps from host "
                    "gradients")
        if s.zero_stage not in (2, 3):
            _refuse(Status.UNSUPPORTED,
                    f"step '{s.name}' has zero_stage = {s.zero_stage}: only ZeRO-2 and ZeRO-3 "
                    "steps reduce the gradients into shards (stages 0 and 1 need every "
                    "rank's full gradient); compile the step with zero_stage=2 or 3")
        if s.f32_grads:
            _refuse(Status.UNSUPPORTED,
                    f"step '{s.name}' has f32 gradients of {s.param_dtype.name} params "
                    "(p.main_grad); streaming is implemented for gradients in the param's "
                    "dtype (p.grad)")
        self.check_entries(opt.entries)
        super().__init__(opt)
        self._gdtype = None  # the step's grad dtype (torch), set in attach
        self.lost = False
        self._idle()

    @staticmethod
    def check_entries(entries):
        """Streamed gradients are torch CPU params' .grad."""
        for e in entries:
            if not e.auto or not e.torch:
                _refuse(Status.INVALID_ARGUMENT,
                        f"{e.name} is a (param, grad) pair or a numpy array: streamed "
                        "gradients come from torch params' .grad (pass the params alone)")
            if e.cuda:
                _refuse(Status.UNSUPPORTED, f"{e.name} is on {e.param.device}: streaming "
                        "is implemented for CPU params")

    # ---- setup (after every finalize) -----------------------------------------
    def configure(self, h):
        """Before finalize: the runtime holds the reduced shards itself."""
        o = self._part()
        check(o.lib.zopt_optimizer_set_grad_streaming(h, 1), "set_grad_streaming")

    def attach(self, h):
        """After finalize (build and every rebuild): the buckets' tensors,
        the fixed reduction order and the hooks of params not hooked yet."""
        o = self._part()
        if self.started and self.pos > 0:
            self.lost = True  # reduced shards of this step died with the old optimizer
        self.read_buckets(h)
        nb, b_tensors = self.nb, self.b_tensors
        T = len(o.entries)
        self.order = list(range(nb))  # the same on every rank
        pos_of = {b: i for i, b in enumerate(self.order)}
        first = [nb] * T
        last = [-1] * T
        for b, ts in enumerate(b_tensors):
            for t in ts:
                first[t] = min(first[t], pos_of[b])
                last[t] = max(last[t], pos_of[b])
        self.first_pos, self.last_pos = first, last
        self.numels = np.array([e.numel for e in o.entries], dtype=np.int64)
        self._gdtype = torch_of(o.step.grad_dtype)
        self._contig = [e.param.is_contiguous() for e in o.entries]
        self._hook_new()
        self._idle(keep_lost=True)

    # ---- the cycle between two steps -------------------------------------------
    def _idle(self, keep_lost=False):
        self.started = False
        self.pos = 0            # next position in self.order to reduce
        self.reduced = False    # any bucket reduced since the last step
        self.given = None       # per tensor: None undecided, True / False
        self.held = None        # per tensor: the gradient handed over (alive until its last bucket is done)
        # buckets handed over to the background thread, in order: (bucket,
        # the tensors whose last bucket it is)
        self.pending = collections.deque()
        self.ready = None
        self.missing = None
        if not keep_lost:
            self.lost = False

    def _start(self, from_hook):
        """The first streamed backward hook (or step()) since the last step:
        the param checks (a collective rebuild for params given new memory:
        every rank does it before its first reduction), then the readiness
        of every tensor. Params that do not require grad (frozen) have
        nothing to wait for; one without a hook yet, until backward ends."""
        o = self._part()
        o.check_params()
        T = len(o.entries)
        self.given = [None] * T
        self.held = [None] * T
        ents = o.entries
        # a param that requires grad but has no hook yet (frozen when the hooks
        # were last added, unfrozen since: hooked after this step) is ready at
        # the end of backward only; taken as ready at once, its bucket was
        # reduced before backward gave it a gradient and the step left it
        # alone without a word (finding O5, as O2 of zopt.overlap)
        self.ready = [not e.param.requires_grad for e in ents]
        self.missing = [sum(1 for t in ts if not self.ready[t]) for ts in self.b_tensors]
        self.started = True
        if from_hook:
            self._queue_backward_end()

    def _backward_end(self):
        if self.started and self.pos < self.nb:
            self._advance(final=True, where="at_backward_end")
        self.wait()  # as DDP: backward returns with its gradients reduced

    def _grad_final(self, o, t):
        """Tensor t's gradient is final for this step: the buckets reduced
        in order while the next one is ready."""
        if self.first_pos[t] < self.pos:
            e = o.entries[t]
            raise ZoptError(Status.BAD_STATE,
                            f"grad_streaming: {e.name} got a gradient after its bucket was "
                            "reduced (a second backward since the last step()): accumulate "
                            "micro-batches inside opt.no_sync() and run the last backward "
                            "outside it, then step()")
        if self.ready[t]:
            return
        self.ready[t] = True
        for b in self.t_buckets[t]:
            self.missing[b] -= 1
        self._advance(final=False, where="in_backward")

    def _advance(self, final, where):
        """Reduces the buckets in order while the next one is ready (all of
        them with final=True)."""
        order, missing = self.order, self.missing
        while self.pos < self.nb:
            b = order[self.pos]
            if not final and missing[b] > 0:
                return
            self._reduce(b)
            self.stats[where] += 1

    def _grad_ptr(self, t, e):
        """Tensor t's gradient for the runtime (decided at its first
        bucket): its element 0 in the param's memory order and the step's
        grad dtype (else a copy of that form), or None."""
        if self.given[t] is None:
            g = e.param.grad
            if g is not None:
                if g.is_sparse:
                    raise ZoptError(Status.UNSUPPORTED, f"{e.name} has a sparse gradient")
                if g.dtype != self._gdtype or g.device.type != "cpu" or not (
                        e.numel <= 1 or tuple(g.stride()) == e.stride
                        or (g.is_contiguous() and self._contig[t])):
                    c = torch.empty_strided(e.shape, e.stride, dtype=self._gdtype)
                    with torch.no_grad():
                        c.copy_(g)
                    g = c
            self.given[t] = g is not None
            self.held[t] = g
        g = self.held[t]
        return g.data_ptr() if g is not None else None

    # Buckets in flight at most (double buffering): handing one over waits
    # for the older ones beyond this, so a rank's live gradients stay within
    # these buckets, the one backward is filling and a tensor spanning them.
    MAX_IN_FLIGHT = 1

    def _reduce(self, b):
        o = self._part()
        if len(self.pending) >= self.MAX_IN_FLIGHT:
            self._release(wait=True)
        ents = o.entries
        ts = self.b_tensors[b]
        n = len(ts)
        keep, ptrs = _lib.c_array(ctypes.c_void_p, [self._grad_ptr(t, ents[t]) for t in ts])
        check(o.lib.zopt_optimizer_reduce_bucket_async(o.h, b, ptrs, n),
              "zopt_optimizer_reduce_bucket_async")
        self.reduced = True
        at = self.pos
        self.pos += 1
        # the tensors whose gradient is no longer read once b is done
        self.pending.append((b, [t for t in ts if self.last_pos[t] == at]))
        self._release(wait=False)

    def _release(self, wait):
        """Drops the gradients of the handed-over buckets that are done (all
        of them with wait=True, after waiting: raises a failed exchange)."""
        if not self.pending:
            return
        o = self._part()
        if wait:
            st = o.lib.zopt_optimizer_wait_buckets(o.h)
            if st:
                self.pending.clear()  # the step fails; the gradients stay p.grad
                self.lost = True
                check(st, "zopt_optimizer_wait_buckets")
        ents = o.entries
        done = ctypes.c_int()
        while self.pending:
            b, ts = self.pending[0]
            if not wait:
                check(o.lib.zopt_optimizer_bucket_done(o.h, b, ctypes.byref(done)),
                      "zopt_optimizer_bucket_done")
                if not done.value:
                    return
            self.pending.popleft()
            for t in ts:  # every bucket of t reduced: its gradient is no longer read
                if self.given[t]:
                    ents[t].param.grad = None
                self.held[t] = None

    def wait(self):
        """Before any other call into the native optimizer: the buckets in
        flight finished (their gradients dropped)."""
        if self.pending:
            self._release(wait=True)

    # ---- step() -------------------------------------------------------------------
    def before_step(self):
        """In step(), instead of the gradient sync: the param checks, the
        buckets no backward reduced (in order, from p.grad), and the mask
        the binding reports (the part's active mask)."""
        self._error = None  # (a backward aborted by another error before its end)
        o = self._part()
        self.wait()  # the exchanges in flight (a failure is raised here)
        if self.started:
            # in-place writes since: the master refreshed; params given new
            # memory: registered in place, the reduced shards kept (a new
            # native optimizer or one grown by a group loses them: attach)
            o.check_params()
        if self.lost:
            self._idle()
            raise ZoptError(Status.BAD_STATE,
                            "grad_streaming: the native optimizer was rebuilt (a param group "
                            "added, or params that swapped storage) after this step's "
                            "gradients were reduced; they are lost: run the backward again")
        ents = o.entries
        if not self.started:
            if o.world_size == 1 and all(e.param.grad is None for e in ents):
                o.active[:] = bytes(len(ents))  # nothing to do (step() returns early)
                return
            self._start(from_hook=False)
        self._advance(final=True, where="at_step")
        self.wait()
        # An empty param is in no bucket: whether it has a gradient (torch
        # steps it then, its count advances) goes to the runtime in the
        # mask, which is read for empty tensors only (R4)
        act = bytes(1 if (g or (not ents[t].numel and ents[t].param.grad is not None)) else 0
                    for t, g in enumerate(self.given))
        empty = [t for t, e in enumerate(ents) if not e.numel]
        o.active[:] = act
        if empty and (len(o.pushed) != len(act) or any(act[t] != o.pushed[t] for t in empty)):
            o.push_mask()
        o.mask_all = 0 not in o.active
        o.active_elems = int(np.dot(np.frombuffer(act, dtype=np.uint8).astype(np.int64),
                                     self.numels)) if act else 0

    def after_step(self):
        """After the runtime's step: the next step's cycle (new params that
        require grad now get their hooks). A p.grad written again after its
        buckets were reduced (DDP's reducer copies its averaged gradients
        back at the end of backward) is dropped: the step consumed it."""
        o = self._part()
        if self.given is not None:
            for t, g in enumerate(self.given):
                if g and o.entries[t].param.grad is not None:
                    o.entries[t].param.grad = None
        self._idle()
        self._hook_new()

    def check_zero_grad(self):
        self._error = None
        if self.reduced:
            raise ZoptError(Status.BAD_STATE,
                            "grad_streaming: zero_grad() after this step's gradients were "
                            "(partly) reduced by backward; they cannot be taken back: call "
                            "step() first (or accumulate inside opt.no_sync())")

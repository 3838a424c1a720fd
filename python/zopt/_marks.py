"""Bucket marks driven by autograd hooks across one backward: what gradient
streaming (zopt.streaming, ``grad_streaming=True``) and the offload overlap
(zopt.overlap, ``overlap=True``) share.

Both hand the layout's gradient buckets to the runtime while backward runs,
each as its params' gradients become final. :class:`BucketMarks` is the
cycle between two steps that they have in common:

* the buckets and their tensors (``zopt_optimizer_num_buckets`` /
  ``_bucket_tensors``), read after every finalize (:meth:`read_buckets`);
* a hook on the AccumulateGrad node of each param that requires grad
  (zopt._grads.hook_grads_ready) calls :meth:`_on_grad`: it does nothing
  inside ``no_sync()`` (micro-batches accumulate), for a closed optimizer
  or for a param no longer the hooked tensor's; the first hook of a cycle
  starts it (:meth:`_start`, the subclass's, with ``from_hook=True``, which
  queues :meth:`_queue_backward_end`); then the subclass's
  :meth:`_grad_final` takes the tensor's gradient;
* at the end of that backward (an autograd engine callback) the
  subclass's :meth:`_backward_end` hands over what is left;
* the counters of where buckets were handed over (``stats``: during
  backward, at its end, at ``step()``);
* an error found in a hook (a refused ``main_grad``, a gradient for a
  bucket already handed over) is raised by backward at its end, from an
  engine callback, not from the hook: the rest of that backward's hooks do
  nothing (nothing more is handed over, nor at its end). Raised from the
  hook, it would abort backward with tasks of the graph left in the
  calling thread's ready queue (torch 1.13's engine keeps the CPU queue in
  a thread_local), which keeps the graph and its saved tensors alive until
  the thread's TLS destructors run at process exit, after the interpreter
  finalized: freeing a tensor that still holds its Python object then
  waits for the GIL forever (the process hangs at exit; a later backward
  on the same thread would have drained the queue).

Subclasses define ``started`` (a cycle is under way), ``_start``,
``_grad_final`` and ``_backward_end``.
"""
from __future__ import annotations

import contextlib
import ctypes
import weakref

from . import _grads, _lib
from ._lib import check

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["BucketMarks"]


class BucketMarks:
    """The hook-driven cycle of one parameter class (a zopt._part.Part)."""

    started = False

    def __init__(self, part):
        self._part = weakref.ref(part)
        self._hooked = {}   # id(param) -> tensor id at registration (for the hooks)
        self._depth = 0     # no_sync() nesting
        self.nb = 0
        self.b_tensors = []  # per bucket: its tensors
        self.t_buckets = []  # per tensor: its buckets
        # buckets handed over from the hooks during backward, at the end of
        # a backward, and at step()
        self.stats = dict(in_backward=0, at_backward_end=0, at_step=0)
        self._error = None  # an error of this backward's hooks, raised at its end

    def read_buckets(self, h):
        """After finalize (build and every rebuild): the buckets' tensors
        and each tensor's buckets (a tensor may span several)."""
        c = self._part()
        L = c.lib
        n = ctypes.c_int()
        check(L.zopt_optimizer_num_buckets(h, ctypes.byref(n)), "zopt_optimizer_num_buckets")
        nb = n.value
        T = len(c.entries)
        cap = max(T, 1)
        keep, ids = _lib.c_array(ctypes.c_int, [0] * cap)
        b_tensors = []
        for b in range(nb):
            check(L.zopt_optimizer_bucket_tensors(h, b, ids, cap, ctypes.byref(n)),
                  "zopt_optimizer_bucket_tensors")
            b_tensors.append(keep[:n.value].tolist())
        self.nb, self.b_tensors = nb, b_tensors
        self.t_buckets = [[] for _ in range(T)]
        for b, ts in enumerate(b_tensors):
            for t in ts:
                self.t_buckets[t].append(b)

    def _hook_new(self):
        """Hooks on the AccumulateGrad nodes of params that require grad and
        are not hooked yet (zopt._grads.hook_grads_ready)."""
        _grads.hook_grads_ready(self._part(), self, self._hooked)

    def _on_grad(self, key):
        """A hooked param's gradient was accumulated by backward."""
        if self._depth:
            return  # no_sync(): accumulate only
        c = self._part()
        if c is None or c.h is None:
            return
        t = self._hooked.get(key)
        if t is None or t >= len(c.entries) or id(c.entries[t].param) != key:
            return
        if self._error is not None:
            return  # this backward failed: raised at its end
        try:
            if not self.started:
                self._start(from_hook=True)
            self._grad_final(c, t)
        except BaseException as e:
            self._error = e
            self._queue_raise()

    def _queue_backward_end(self):
        """From the first hook's _start: _backward_end once this backward
        has run every node (an autograd engine callback)."""
        ref = weakref.ref(self)

        def at_end():
            s = ref()
            if s is not None and s._error is None:
                s._backward_end()
        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    def _queue_raise(self):
        """The hooks' error, raised by backward once it has run every node
        (an engine callback: nothing of the graph is left queued)."""
        ref = weakref.ref(self)

        def at_end():
            s = ref()
            if s is not None and s._error is not None:
                e, s._error = s._error, None
                raise e
        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    @contextlib.contextmanager
    def no_sync(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

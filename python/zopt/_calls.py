"""One call at a time per optimizer (docs/USAGE.md "Threads").

The runtime takes one C call at a time per native optimizer and refuses a
call from another thread while one runs (zopt.h "Threading"); the binding
keeps Python-side tables too (the gradient registrations, the masks, the
native handle, which a step may replace), so it holds a per-optimizer lock
around each public call: a call made while another thread's call runs on
the optimizer raises ZoptError (BAD_STATE, a RuntimeError as torch raises
for misuse) naming the running call and changes nothing; calls nested on
the thread that holds it (a closure's zero_grad inside step) pass;
close() waits for the running call, then frees.
"""
from __future__ import annotations

import functools
import threading

from ._lib import Status, ZoptError


class CallLock:
    """The lock of one optimizer and the name of the call holding it."""

    __slots__ = ("_lock", "_depth", "running")

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self.running = None  # the outermost call holding it, or None

    def enter(self, name):
        if not self._lock.acquire(blocking=False):
            raise ZoptError(
                Status.BAD_STATE,
                f"{name}(): another call ({self.running or '?'}) is running on this optimizer "
                "on another thread: one optimizer takes one call at a time (step it from one "
                "thread, or serialize the calls with a lock of your own)")
        if self._depth == 0:
            self.running = name
        self._depth += 1

    def leave(self):
        self._depth -= 1
        if self._depth == 0:
            self.running = None
        self._lock.release()

    def wait(self):
        """Context manager: blocks until no other thread's call runs, and
        holds the lock meanwhile (close())."""
        return _Waiting(self)


class _Waiting:
    __slots__ = ("c",)

    def __init__(self, c):
        self.c = c

    def __enter__(self):
        self.c._lock.acquire()
        if self.c._depth == 0:
            self.c.running = "close"
        self.c._depth += 1

    def __exit__(self, *exc):
        self.c.leave()


def lock_of(opt):
    """The optimizer's CallLock (made by Optimizer.__new__; created here for
    an object made without it, e.g. by copy)."""
    c = opt.__dict__.get("_calls")
    if c is None:
        c = opt.__dict__.setdefault("_calls", CallLock())
    return c


def exclusive(name):
    """Decorator of a public method: holds the optimizer's lock for the call
    (raises ZoptError BAD_STATE while another thread's call holds it)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kw):
            c = lock_of(self)
            c.enter(name)
            try:
                return fn(self, *args, **kw)
            finally:
                c.leave()
        return wrapper
    return deco

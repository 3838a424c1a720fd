"""Collective methods of the optimizers: a communicator error inside one
says which call every rank must make.

At world size > 1, ``state_dict()``, ``load_state_dict()``, ``save()``,
``load()`` and ``gather_params()`` are collective: every rank calls them,
in the same order relative to its other collective calls (``step()`` and
these). A rank that calls one alone (``if rank == 0:
torch.save(opt.state_dict(), ...)``) meets its peers at another call: the
runtime's signature check fails on every rank, naming what each rank
called (docs/COMM.md). Where every rank is at the start of a call (it has
changed nothing yet) the runtime fails the call on every rank without
poisoning the communicator, so the ranks can go on once they call it
together.

``with collective_errors(opt, "state_dict"):`` around a method's
collective work (a with-statement, not a decorator: warnings raised inside
keep pointing at the user's line).
"""
from __future__ import annotations

import contextlib

from ._lib import Status, ZoptError

_MARK = "is collective at world size"


@contextlib.contextmanager
def collective_errors(opt, name):
    """A ZoptError of status COMM raised in the block at world size > 1
    gets the sentence that every rank must call ``name()`` (once: an inner
    block's sentence is kept)."""
    try:
        yield
    except ZoptError as e:
        world = getattr(opt, "world_size", 1) or 1
        if e.code != Status.COMM or world <= 1 or _MARK in e.message:
            raise
        raise ZoptError(Status.COMM, f"{name}() {_MARK} {world}: every rank must call it "
                        "(collectively, in the same order relative to its other collective "
                        "calls: step(), state_dict(), load_state_dict(), save(), load(), "
                        f"gather_params()). {e.message}") from None

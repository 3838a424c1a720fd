"""Params back early (``zopt.Optimizer(..., overlap=True, model=model)``;
docs/USAGE.md section 5, docs/GPU.md "Params back early").

An offloaded step copies the updated params back to the GPU bucket by
bucket in forward order on the optimizer's own copy stream, each bucket
followed by its event. By default the step makes the optimizer's stream (torch's current
stream) wait for every copy. With a ``model`` the binding knows which
module reads which params, so it sets the per-bucket mode
(``zopt_optimizer_set_param_wait(PER_BUCKET)``) and each module's forward
pre-hook waits (``zopt_optimizer_wait_params`` on torch's current stream)
for the buckets of its own params (``recurse=False``) not waited for yet
in this step: the first layers start while the last buckets are still
being copied.

Params of the optimizer that no module of ``model`` owns are waited for
right after ``step()``, on torch's current stream (the binding cannot know
when they are read). ``state_dict()`` of any hooked module (``model`` or
one of its modules owning params) waits for every bucket not waited for
yet, by a state-dict hook. Any other read of a param outside its own
module's forward before that module runs (a tied weight read by an
earlier module, a metric over ``model.parameters()``) needs
``opt.wait_params()`` first. Without a ``model`` (or with ``early_params=False``) the
default mode stays: everything after ``step()`` sees every param.
"""
from __future__ import annotations

import ctypes
import warnings
import weakref

from . import comm as _comm
from ._lib import PARAM_WAIT_PER_BUCKET, Status, ZoptError, check

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["EarlyParams", "model_of"]


def model_of(overlap, model, early_params):
    """The model whose forward hooks wait per bucket, or None (the default
    mode): ``early_params`` None (on when a model is given), True (a model
    needed) or False; both options belong to ``overlap=True``."""
    if early_params not in (None, True, False):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"early_params={early_params!r}: True, False or None (on with a model)")
    if (model is not None or early_params) and not overlap:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "model= and early_params= are options of overlap=True (params back "
                        "early, waited for per bucket by the model's forward hooks)")
    if early_params and model is None:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "early_params=True needs model= (the modules whose forward reads the "
                        "params: the binding cannot tell when a param is read otherwise)")
    return None if early_params is False else model


# Every live EarlyParams: at interpreter exit each part's tail is joined
# (join_at_exit) before the communicators are released.
_LIVE = weakref.WeakSet()


def _join_all_at_exit():
    for e in list(_LIVE):
        e.join_at_exit()


_comm.before_release(_join_all_at_exit)


class EarlyParams:
    """The forward pre-hooks of one offloaded part (``overlap.early``)."""

    def __init__(self, part, model):
        if torch is None or not isinstance(model, torch.nn.Module):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"model={type(model).__name__}: a torch.nn.Module (the modules "
                            "whose forward reads the optimizer's params)")
        self._part = weakref.ref(part)
        self._model = weakref.ref(model)
        self._hooked = {}      # id(module) -> the module's buckets (this layout)
        self._pending = set()  # buckets not waited for since the last step
        self._outside = []     # buckets with params no module owns
        self.waits = []        # per step: the buckets the hooks waited for, in order
        _LIVE.add(self)

    def attach(self, h, t_buckets):
        """After every finalize (``overlap.attach``): the per-bucket mode, each
        module's buckets, hooks on modules not hooked yet."""
        c = self._part()
        model = self._model()
        if model is None:
            raise ZoptError(Status.BAD_STATE, "early params: the model was freed")
        check(c.lib.zopt_optimizer_set_param_wait(h, PARAM_WAIT_PER_BUCKET),
              "zopt_optimizer_set_param_wait")
        tid = {id(e.param): t for t, e in enumerate(c.entries)}
        owned = set()
        ref = weakref.ref(self)
        for m in model.modules():
            ts = [tid[id(p)] for p in m.parameters(recurse=False) if id(p) in tid]
            owned.update(ts)
            bs = sorted({b for t in ts for b in t_buckets[t]}, reverse=True)
            if not bs:
                self._hooked.pop(id(m), None)
                continue
            if id(m) not in self._hooked:
                def pre_hook(module, _args):
                    s = ref()
                    if s is not None and s._pending:
                        s._wait(s._hooked.get(id(module), ()))
                c.acc_hooks.append((m, m.register_forward_pre_hook(pre_hook)))
                # model.state_dict() (or a submodule's) holds the device
                # params themselves: it waits for every bucket first, so a
                # checkpoint of the model right after step() is this step's.
                def sd_hook(module, _sd, _prefix, _meta):
                    s = ref()
                    if s is not None and s._pending:
                        s.wait_all()
                c.acc_hooks.append((m, m._register_state_dict_hook(sd_hook)))
            self._hooked[id(m)] = bs
        self._outside = sorted({b for t, e in enumerate(c.entries) if t not in owned
                                for b in t_buckets[t]}, reverse=True)
        self._pending = set()  # a new native optimizer: no copies yet

    def _wait(self, buckets):
        c = self._part()
        h = c.h
        s = torch.cuda.current_stream(c.device).cuda_stream
        for b in buckets:
            if b in self._pending:
                check(c.lib.zopt_optimizer_wait_params(h, b, ctypes.c_void_p(s or None)),
                      "zopt_optimizer_wait_params")
                self._pending.discard(b)
                self.waits[-1].append(b)

    def after_step(self, nb):
        """After a step: every bucket pending; those no module owns waited
        for at once."""
        self._pending = set(range(nb))
        self.waits.append([])
        del self.waits[:-8]  # the last steps only
        self._wait(self._outside)

    def join_at_exit(self):
        """At interpreter exit (comm.before_release): waits for the last
        step's tail, which may still run a collective on the pipeline
        thread (at W ranks: its buckets' ALL_GATHERs, whose callbacks need
        the interpreter); a failure of it (a peer died or stalled: within
        the communicator's timeout) is reported as a RuntimeWarning."""
        c = self._part()
        if c is None or getattr(c, "h", None) is None or not self._pending:
            return
        self._pending = set()
        mode = ctypes.c_int()  # a getter: every call but wait_params joins the tail first
        try:
            check(c.lib.zopt_optimizer_get_param_wait(c.h, ctypes.byref(mode)),
                  "zopt_optimizer_get_param_wait")
        except ZoptError as e:
            warnings.warn(f"zopt: at exit, the last step's tail failed: {e}", RuntimeWarning)

    def wait_all(self):
        """``opt.wait_params()``: every bucket not waited for yet."""
        self._wait(sorted(self._pending, reverse=True))

"""Ranks from PyTorch: the communicator an optimizer makes from
``process_group=``, and the checks of a multi-rank optimizer against the
ways a DDP training script goes wrong when ported to zopt:

* a ``DistributedDataParallel`` wrapper kept around the model (zopt reduces
  the gradients itself: DDP would reduce them a second time, and write them
  back into ``p.grad`` after ``grad_streaming=True`` freed them);
* gradients rescaled in place between backward and ``step()``
  (``torch.nn.utils.clip_grad_norm_`` clips each rank by its own, local,
  unreduced norm).

``opt.clip_grad_norm_`` (:mod:`zopt._clip`) is the zopt way to clip.
"""
from __future__ import annotations

import weakref

from .comm import TorchComm, seconds
from ._grads import accumulate_node
from ._lib import Status, ZoptError
from ._warnings import warn_user

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["make_comm", "RankChecks"]


def make_comm(process_group, comm, timeout):
    """(comm, owned) for ``process_group=`` / ``comm=`` / ``timeout=``: a
    TorchComm on a gloo group of its own over the process group's ranks
    (made and owned here), or the caller's comm with the timeout set."""
    timeout = seconds(timeout)
    if process_group is not None and comm is not None:
        raise ZoptError(Status.INVALID_ARGUMENT, "give process_group= or comm=, not both")
    if process_group is not None:
        return TorchComm(process_group, timeout=timeout), True
    if comm is not None and timeout is not None:
        comm.set_timeout(timeout)
    return comm, False


_DDP_TEXT = (
    "zopt.Optimizer at {W} ranks: the model runs forward through torch.nn.parallel."
    "DistributedDataParallel ({cls}, over {n} of this optimizer's params). zopt reduces the "
    "gradients across the ranks itself, on a process group of its own: under DDP every "
    "gradient is reduced twice{extra}. Unwrap the model: build it without DDP (or pass "
    "model.module to the training loop and model.module.parameters() to zopt.Optimizer); "
    "zopt's result is then bit-identical to one process on the summed gradients")


class RankChecks:
    """The checks of one multi-rank optimizer (``opt._rank_checks``).

    * A DDP wrapper: until the first ``step()`` a global module forward
      pre-hook (``register_module_forward_pre_hook``: one call per module
      forward, removed at the first step) looks for a
      ``DistributedDataParallel`` forward over this optimizer's params; the
      first step warns. (Scanning the garbage collector's objects instead
      would touch tensors torch keeps half-alive: "Deallocating Tensor that
      still has live PyObject references".) A model wrapped after the first
      step is not seen.
    * Gradients changed in place between backward and ``step()``
      (non-streamed steps): a hook after each param's gradient accumulation
      records the gradient's version counter; ``step()`` compares and warns
      once. A per-rank clipper that only *reads* gradients (its norm is
      then wrong but nothing changes) cannot be seen: no hook reports reads;
      under ``grad_streaming=True`` the gradients are gone (None) before any
      clipper runs, so ``torch.nn.utils.clip_grad_norm_`` sees none and
      returns 0 (docs/USAGE.md says to use ``opt.clip_grad_norm_``)."""

    def __init__(self, opt):
        self.world = opt.world_size
        self.streaming = opt._streamer is not None
        self.ddp = None           # (DDP module's class name, params of ours it holds)
        self.ddp_warned = False
        self.rescale_warned = False
        self.versions = {}   # id(param) -> (id(grad), grad._version) after its last accumulation
        self._fwd = None
        try:
            DDP = torch.nn.parallel.DistributedDataParallel
            register = torch.nn.modules.module.register_module_forward_pre_hook
        except AttributeError:  # pragma: no cover - torch without distributed
            return
        ref = weakref.ref(opt)
        me = weakref.ref(self)
        seen = set()

        def pre_forward(module, args):
            if not issubclass(type(module), DDP) or id(module) in seen:
                return None
            seen.add(id(module))
            o, c = ref(), me()
            if o is None or c is None or c.ddp is not None:
                return None
            ids = {id(e.param) for e in o._entries}
            n = sum(1 for p in module.module.parameters() if id(p) in ids)
            if n:
                c.ddp = (type(module).__name__, n)
            return None
        self._fwd = register(pre_forward)

    def remove(self):
        if self._fwd is not None:
            self._fwd.remove()
            self._fwd = None

    # ---- DDP -------------------------------------------------------------------
    def _warn_ddp(self):
        if self.ddp is None or self.ddp_warned:
            return
        self.ddp_warned = True
        extra = (" and DDP writes its averaged gradients back into p.grad after "
                 "grad_streaming=True freed them (zopt drops them at step())"
                 if self.streaming else "")
        warn_user(_DDP_TEXT.format(W=self.world, cls=self.ddp[0], n=self.ddp[1],
                                       extra=extra), UserWarning)

    # ---- gradients rescaled in place ----------------------------------------------
    def add_hooks(self, c, entries):
        """Hooks on the AccumulateGrad nodes of the torch params among
        ``entries`` of part c (kept in its acc_hooks: removed with the
        optimizer); not for streamed steps (p.grad is freed during backward)
        or f32 gradients (p.main_grad is the gradient)."""
        if self.streaming or c.main:
            return
        for e in entries:
            p = e.param
            if not e.auto or not e.torch or not p.requires_grad or not p.is_leaf:
                continue
            node = accumulate_node(p)
            c.acc_hooks.append((node, node.register_hook(self.hook_for(p))))

    def hook_for(self, p):
        """A hook for p's AccumulateGrad node: records p.grad's version."""
        key = id(p)
        vers = self.versions

        def hook(*_):
            g = p.grad
            if g is not None:
                vers[key] = (id(g), g._version)
        return hook

    def before_step(self, opt):
        """At step() (non-streamed): warns once when a gradient was changed in
        place after backward accumulated it (a per-rank clipper, a DDP
        wrapper averaging it, a manual rescale)."""
        if self._fwd is not None:  # the forwards before the first step were seen
            self.remove()
        self._warn_ddp()
        vers = self.versions
        if not vers:
            return
        changed = []
        for e in opt._entries:
            p = e.param
            rec = vers.get(id(p))
            g = getattr(p, "grad", None)
            if rec is None or g is None:
                continue
            if rec[0] == id(g) and g._version != rec[1]:
                changed.append(e.name)
        vers.clear()
        if not changed or self.rescale_warned or self.ddp is not None:
            return
        self.rescale_warned = True
        warn_user(
            f"zopt.Optimizer at {self.world} ranks: the gradients of {len(changed)} param(s) "
            f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}) were changed in "
            "place between backward and step() (e.g. torch.nn.utils.clip_grad_norm_, which "
            "clips each rank's own gradient by its local, unreduced norm, so every rank clips "
            "by a different coefficient). zopt reduces the gradients across the ranks in "
            "step(): clip with opt.clip_grad_norm_(max_norm) instead (it returns the global "
            "norm over all ranks and clips inside the step), or compile the step with "
            "clip=max_norm", UserWarning)

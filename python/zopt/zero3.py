"""ZeRO-3 module hooks: params gathered just before a module needs them,
released right after.

Under a ZeRO-3 step (the description's ``zero_stage = 3``) the runtime
holds the params sharded across the ranks; the model's parameter tensors
are only a window onto them. :func:`zero3_hooks` keeps that window open
only while a module runs:

* forward pre-hook: ``opt.gather_params(module's params)`` (collective);
* forward hook: the module's params are released (their storage freed,
  shapes kept); a hook on the module's outputs gathers them again when
  backward reaches the module;
* a hook on each param's gradient releases it once its gradient is
  computed (backward is done with it);
* ``opt.step()`` updates the shards and releases whatever is still held.

    opt = zopt.Optimizer(step, model.parameters(), process_group=pg)
    hooks = zopt.zero3_hooks(model, opt)
    for x, y in data:
        loss = loss_fn(model(x), y); loss.backward()
        opt.step(); opt.zero_grad()
    opt.gather_params()       # the full params, e.g. to save the model
    hooks.remove()

Every gather is a collective: all ranks must run the same modules in the
same order (as with FSDP). A module whose output is a view of one of its
params keeps that param until the step. Outside forward/backward the params
are released: call ``opt.gather_params()`` before reading or writing them
(``model.state_dict()``, ``load_state_dict``), then step or
``opt.release_params()``.
"""
from __future__ import annotations

import weakref

from ._lib import Status, ZoptError
from ._torch_compat import storage_ptr

try:
    import torch
except ImportError:  # pragma: no cover - the binding works without torch
    torch = None

__all__ = ["zero3_hooks"]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _shares_storage(a, b):
    try:
        return a.numel() and b.numel() and \
            storage_ptr(a) == storage_ptr(b)
    except RuntimeError:
        return False


class Zero3Hooks:
    """The hooks of :func:`zero3_hooks`; ``remove()`` takes them off (and
    gathers the params back into the model)."""

    def __init__(self, opt, handles):
        self.opt = opt
        self.handles = handles

    def remove(self, gather=True):
        for h in self.handles:
            h.remove()
        self.handles = []
        if gather:
            self.opt.gather_params()
        self.opt._zero3_mode = "step"


def zero3_hooks(module, opt):
    """Registers ZeRO-3 gather/release hooks on every submodule of
    ``module`` that owns params of ``opt`` (a ZeRO-3 zopt.Optimizer);
    releases the params now. Returns a :class:`Zero3Hooks`."""
    opt._zero3_only("zero3_hooks")
    tid_map = opt._tid_map
    handles = []
    # The hooks live on the module and its params, which the optimizer
    # references: a weak reference keeps that from being a cycle (freed in
    # whatever thread the garbage collector happens to run).
    ref = weakref.ref(opt)

    def gather(ps):
        o = ref()
        if o is not None:
            o.gather_params(ps)

    def release(ps):
        o = ref()
        if o is not None:
            o.release_params(ps)
    for m in module.modules():
        ps = [p for p in m.parameters(recurse=False) if id(p) in tid_map]
        if not ps:
            continue

        def pre(mod, inputs, ps=ps):
            gather(ps)

        def post(mod, inputs, output, ps=ps):
            outs = list(_tensors(output))
            keep = {id(p) for p in ps if any(_shares_storage(o, p) for o in outs)}
            need = [o for o in outs if o.requires_grad]
            if need and torch.is_grad_enabled():
                fired = [False]

                def regather(grad, ps=ps, fired=fired):
                    if not fired[0]:
                        fired[0] = True
                        gather(ps)
                    return None
                for o in need:
                    o.register_hook(regather)
            release([p for p in ps if id(p) not in keep])

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
        for p in ps:
            if p.requires_grad:
                handles.append(p.register_hook(lambda g, p=p: release([p])))
    if not handles:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "zero3_hooks: the module has no params of this optimizer")
    opt._zero3_mode = "hooks"
    opt._reset_watch()
    opt.release_params()
    return Zero3Hooks(opt, handles)

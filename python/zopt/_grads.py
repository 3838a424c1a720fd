"""Gradient memory of one parameter class (a part, zopt._part.Part).

The runtime reads gradients from memory registered when the native
optimizer is built (docs/USAGE.md section 3 is the user's view):

* Torch params given alone get memory of ours: one flat buffer per dtype
  and device, one view per param strided like it, never attached to a
  param before it has a gradient (:func:`alloc_grads`).
* Each step, which params have a gradient and where it lives
  (:func:`sync_grads`, one pass of zopt._scan's rules, in C++ where the
  extension zopt._fast is loaded): a fresh ``p.grad`` tensor of a CPU
  step, or of a GPU or offloaded step over CUDA params (inside a CUDA
  graph capture too: the runtime writes its device table into the graph;
  an offloaded step's copy to the host reads it there), is handed to the
  runtime in place (``zopt_optimizer_set_grad_memory``); what the rules
  exclude is copied into our memory;
  params without one are masked off (``zopt_optimizer_set_active``, pushed
  when the set the pass finds changes: :func:`push_mask`; GPU steps too,
  never inside a CUDA graph capture).
* f32 gradients of bf16/f16 params (``p.main_grad``, :func:`sync_main`):
  ``p.grad`` accumulated into it, by hooks after each backward or by hand.
* ``zero_grad`` as torch's, one fill per buffer.
"""
from __future__ import annotations

import operator
import weakref

from . import _ext
from ._dtypes import is_torch, torch, torch_of
from ._lib import Status, ZoptError
from ._params import UNSET

_is = operator.is_


def alloc_grads(c, entries):
    """The gradient memory of torch params given alone: one flat buffer
    per (dtype, device), one view per param strided like it (64-byte
    aligned), in the step's gradient dtype. Never attached to a param
    before it has a gradient (as ``p.grad``, or for f32 gradients of
    bf16/f16 params as ``p.main_grad``)."""
    by = {}
    gdt = torch_of(c.step.grad_dtype) if torch is not None else None
    for e in entries:
        if e.auto:
            by.setdefault((gdt, str(e.param.device)), []).append(e)
    for (dtype, dev), es in by.items():
        esz = torch.empty((), dtype=dtype).element_size()
        q = max(1, 64 // esz)
        offs, total = [], 0
        for e in es:
            offs.append(total)
            total += (e.numel + q - 1) // q * q
        flat = torch.zeros(max(total, 1), dtype=dtype, device=dev)
        c.grad_flats.append(flat)
        for e, o in zip(es, offs):
            v = flat[o:o + e.numel]
            e.grad = v.as_strided(e.shape, e.stride) if e.numel else v.view(e.shape)
            e.gptr = e.grad.data_ptr() if e.numel else 0


def make_scan(c):
    """The per-step pass over the part's torch params given alone
    (zopt._scan; the extension's when it is loaded), after every native
    build: its baselines of the param checks are the part's. Parts with
    f32 gradients (p.main_grad) have none (sync_main)."""
    c.scan = None
    if c.main or not c.a_params:
        return
    ents = c.entries
    es = [ents[t] for t in c.a_tids]
    spans = sorted((e.pptr, e.pptr + e.nbytes) for e in ents if e.numel and e.pptr)
    cls = _ext.scan_class(c.a_params)
    c.scan = cls(c.a_params, c.a_tids, c.a_regs, [e.gptr or 0 for e in es],
                 [e.pptr or 0 for e in es], [e.numel for e in es], [e.gbytes for e in es],
                 [e.stride or () for e in es], c.active, spans, c.grad_zero_copy,
                 c.one_pass, c.watch)
    if c.one_pass:
        c.scan.rebase(c.tp_ptrs, c.tp_vers if c.watch else None)
        c.tp_synced = True


def own_again(c):
    """The runtime reads every gradient from the optimizer's own memory
    again, as a new native optimizer does: those the per-step pass
    (``c.scan.in_place()``) or sync_main (``c.foreign``: a user's
    main_grad) handed over in place. Before the tables and the pass are
    made anew over registrations changed in place (Part.after_layout):
    a new pass knows of no gradient read in place, and would otherwise
    leave the runtime reading one it no longer keeps alive."""
    tids = set(c.foreign)
    if c.scan is not None:
        tids.update(c.scan.in_place())
    if tids:
        tids = sorted(tids)
        c.set_grad_memory(tids, [c.entries[t].gptr or None for t in tids])
    c.foreign = {}
    c.scan = None


def sync_grads(c):
    """Which params have a gradient, and where the runtime reads it (the
    rules: zopt/_scan.py); for a part whose params are all given alone,
    in the same pass, whether a param's storage or version moved (the
    return value: True when check_params must look). A gradient the
    rules copy is copied into the optimizer's own memory here, at every
    step; p.grad stays the user's tensor either way."""
    r = c.scan.sync()
    if r is None:
        return False
    if type(r) is int:
        refuse(c, r)
    moved, copies, mask, dirty = r
    try:
        if moved is not None:
            c.set_grad_memory_packed(*moved)
        if copies:
            _copy_grads(c, copies)
    except BaseException:  # refused before the mask was pushed: it stays as the
        c.active[:] = c.pushed  # runtime has it, and the next step looks at every
        c.scan.forget()  # gradient again (it would take this mask as pushed)
        raise
    if mask:
        push_mask(c)
    return dirty


def _copy_grads(c, copies):
    """The copied gradients into the optimizer's own memory. A gradient of
    another shape than the param's registration (p.data = a tensor of
    another shape, and p.grad with it) is refused as the param is."""
    ps, regs = c.a_params, c.a_regs
    for j in copies:
        if ps[j].grad.shape != regs[j].shape:
            c.check_params()  # raises, naming the param and both shapes
            e = c.entries[c.a_tids[j]]
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name} has a gradient of shape {tuple(ps[j].grad.shape)}; "
                            f"the optimizer's is {tuple(regs[j].shape)}")
    with torch.no_grad():
        for j in copies:
            regs[j].copy_(ps[j].grad)


def refuse(c, j):
    e = c.entries[c.a_tids[j]]
    g = c.a_params[j].grad
    what = "a sparse gradient" if g.is_sparse else f"a gradient of layout {g.layout}"
    raise ZoptError(Status.UNSUPPORTED, f"{e.name} has {what}")


# ---- f32 gradients of bf16/f16 params (p.main_grad) ------------------------------
def sync_main(c):
    """sync_grads for steps with f32 gradients of 16-bit params (after
    take_grads: what is left in p.grad accumulated into p.main_grad):
    which params have a main_grad and where it lives. Our own buffer
    views are registered at build; a main_grad the user attached is
    registered in place (one zopt_optimizer_set_grad_memory for all that
    changed; GPU and offloaded steps too: the runtime rewrites the
    device's pointer table, or copies to the host from there), or copied
    each step where it is not CUDA memory the step can read
    (``c.main_copied``). A refused main_grad changes nothing (the mask
    and the registrations stay; the next step looks at every one again)."""
    ps = c.a_params
    mgs = [getattr(p, "main_grad", None) for p in ps]
    last = c.a_last
    copied = c.main_copied
    for t, (g, ptr) in list(c.foreign.items()):
        if g.data_ptr() != ptr:  # the same tensor given other memory
            last[c.a_index[t]] = UNSET
    if not copied and all(map(_is, mgs, last)):
        return
    act, tids, regs = c.active, c.a_tids, c.a_regs
    changed = False
    moved = []  # (tensor id, its main_grad or None: our own view again)
    act0 = bytes(act)
    try:
        with torch.no_grad():
            for j, g in enumerate(mgs):
                if g is last[j] and not (copied and g is not None and g is not regs[j]):
                    continue
                t = tids[j]
                if g is None:
                    if act[t]:
                        act[t] = 0
                        changed = True
                    last[j] = None
                    continue
                reg = regs[j]
                if g is not reg:
                    check_main_grad(c, t, g)
                    if copied:
                        reg.copy_(g)
                    else:
                        moved.append((t, g))
                elif t in c.foreign:
                    moved.append((t, None))
                if not act[t]:
                    act[t] = 1
                    changed = True
                last[j] = g
        if moved:  # one call for every main_grad that moved
            register_grads(c, moved)
    except BaseException:  # nothing changed: the next step looks again
        act[:] = act0
        last[:] = [UNSET] * len(last)
        raise
    if changed:
        push_mask(c)


def push_mask(c):
    """The changed active mask (``c.active``) to the runtime. GPU steps:
    refused inside a CUDA graph capture, where the device's mask cannot
    change (ZoptError BAD_STATE naming the params). If it fails, the mask
    and the per-param tables are put back as the runtime has them, so the
    next step sees the change again; nothing was updated."""
    try:
        if c.step.gpu and c.capturing():
            _refuse_in_capture(c)
        c.push_mask()
    except BaseException:
        c.active[:] = c.pushed
        if c.scan is not None:  # (the gradients' memory it handed over stays handed)
            c.scan.forget()
        if c.main:
            c.a_last[:] = [UNSET] * len(c.a_last)
        raise


def _refuse_in_capture(c):
    act, had, ents = c.active, c.pushed, c.entries
    lost = [ents[t].name for t in range(len(act)) if had[t] and not act[t]]
    got = [ents[t].name for t in range(len(act)) if act[t] and not had[t]]

    def names(ns):
        return ", ".join(ns[:4]) + (", ..." if len(ns) > 4 else "")
    what = "; ".join(x for x in (f"{names(lost)} without a gradient now" if lost else "",
                                 f"{names(got)} with one again" if got else "") if x)
    raise ZoptError(
        Status.BAD_STATE,
        f"step() inside a CUDA graph capture (torch.cuda.graph): the set of params with "
        f"a gradient changed ({what}). Step '{c.step.name}' updates the params its active "
        "mask names, which lives in a device table; writing it synchronizes the stream, "
        "which a capture cannot record. Capture steps whose params have gradients as at the "
        "step before the capture (e.g. run a warm-up step with the same gradients first, "
        "or zero_grad(set_to_none=False) to keep every gradient). Nothing was updated")


def check_main_grad(c, t, g):
    e = c.entries[t]
    p = e.param
    what = None
    if not is_torch(g):
        what = f"is a {type(g).__name__}, not a torch tensor"
    elif g.dtype != torch.float32:
        what = f"has dtype {g.dtype}; it must be torch.float32"
    elif tuple(g.shape) != e.shape:
        what = f"has shape {tuple(g.shape)}, the param {e.shape}"
    elif g.device != p.device:
        what = f"is on {g.device}, the param on {p.device}"
    elif g.is_sparse:
        what = "is sparse"
    elif e.numel > 1 and tuple(g.stride()) != e.stride and not (
            g.is_contiguous() and p.is_contiguous()):
        what = (f"has strides {tuple(g.stride())}, the param {e.stride}: it must have "
                "the param's memory layout")
    if what is not None:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{e.name}: its main_grad (the f32 gradient of step "
                        f"'{c.step.name}') {what}")


def register_grads(c, moved):
    """The runtime reads each (tensor id, g) of ``moved``'s gradient from g
    (a user's main_grad) or, with g None, from our own buffer view again:
    one zopt_optimizer_set_grad_memory call (all or none applied)."""
    ents = c.entries
    tids = [t for t, _ in moved]
    ptrs = [((g.data_ptr() if g is not None else ents[t].gptr) if ents[t].numel else None)
            for t, g in moved]
    names = ", ".join(ents[t].name for t in tids[:4]) + (", ..." if len(tids) > 4 else "")
    c.set_grad_memory(tids, ptrs, f"zopt_optimizer_set_grad_memory(the main_grad of {names})")
    for t, g in moved:
        if g is None:
            c.foreign.pop(t, None)
        else:
            c.foreign[t] = (g, g.data_ptr())  # kept alive while the runtime reads it


def take_grads(c):
    """Every ``p.grad`` (the last backward's, in the param's dtype) added
    into ``p.main_grad`` in f32, ``p.grad`` set to None."""
    regs = c.a_regs
    with torch.no_grad():
        for j, p in enumerate(c.a_params):
            g = p.grad
            if g is not None:
                accumulate(p, g, regs[j], c.entries[c.a_tids[j]])


def accumulate(p, g, reg, e):
    """p.main_grad += p.grad (f32); p.grad = None."""
    if g.is_sparse:
        raise ZoptError(Status.UNSUPPORTED, f"{e.name} has a sparse gradient")
    mg = getattr(p, "main_grad", None)
    if mg is None:
        reg.copy_(g)
        p.main_grad = reg
    else:
        if tuple(mg.shape) != e.shape:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: its main_grad has shape {tuple(mg.shape)}, "
                            f"the param {e.shape}")
        mg.add_(g)
    p.grad = None


def accumulate_node(p):
    """p's AccumulateGrad node, where backward adds its gradient (torch 1.13
    has no register_post_accumulate_grad_hook)."""
    with torch.enable_grad():
        return p.expand_as(p).grad_fn.next_functions[0][0]


def hook_grads_ready(c, owner, hooked):
    """Hooks that call ``owner._on_grad(id(p))`` once backward has added the
    gradient of each param of part c that requires grad and is not in
    ``hooked`` yet ({id(p): tensor index}, filled here); kept in
    c.acc_hooks (removed with the optimizer). Gradient streaming
    (zopt.streaming) and the offload overlap (zopt.overlap) mark buckets
    from them."""
    ref = weakref.ref(owner)
    for t, e in enumerate(c.entries):
        p = e.param
        if id(p) in hooked or not p.requires_grad or not p.is_leaf:
            continue
        node = accumulate_node(p)

        def hook(*_, key=id(p)):
            s = ref()
            if s is not None:
                s._on_grad(key)
        c.acc_hooks.append((node, node.register_hook(hook)))
        hooked[id(p)] = t


def add_acc_hooks(c, entries):
    """grad_accumulation="hooks": after backward accumulates a param's
    gradient (torch's AccumulateGrad node; torch 1.13 has no
    register_post_accumulate_grad_hook), add it into the f32 main_grad
    and free p.grad, as DeepSpeed's bf16 optimizer does. (At several
    ranks the checks of zopt._ranks hook them too.)"""
    if c.rank_checks is not None:
        c.rank_checks.add_hooks(c, entries)
    if not c.main or c.grad_accumulation != "hooks" or torch is None:
        return
    ref = weakref.ref(c)
    for e in entries:
        p = e.param
        if not e.auto or not p.requires_grad or not p.is_leaf:
            continue  # (a non-leaf's p.grad is taken at step())
        node = accumulate_node(p)

        def hook(*_, e=e, p=p):
            o = ref()
            if o is None or o.h is None:
                return
            g = p.grad
            if g is not None:
                with torch.no_grad():
                    accumulate(p, g, e.grad, e)
        c.acc_hooks.append((node, node.register_hook(hook)))


def remove_acc_hooks(c):
    for _, h in c.acc_hooks:
        h.remove()
    c.acc_hooks = []


# ---- zero_grad -------------------------------------------------------------------
def zero_grad(c, set_to_none):
    """torch's zero_grad over the part's params: the zopt-owned gradient
    memory is zeroed with one fill per buffer; explicit (param, grad)
    pairs are always zeroed."""
    ps = c.a_params
    if ps and c.main:
        # f32 gradients: p.grad is only ever pending accumulation;
        # our main_grad views are dropped or zeroed, a user's main_grad
        # is zeroed (it is the user's: never detached).
        if not set_to_none:
            for f in c.grad_flats:
                f.zero_()
        for p, r in zip(ps, c.a_regs):
            p.grad = None
            mg = getattr(p, "main_grad", None)
            if mg is None:
                continue
            if mg is r:
                if set_to_none:
                    p.main_grad = None
            else:
                mg.zero_()
    elif ps:
        # Gradient tensors read in place (sync_grads): with set_to_none,
        # no longer kept alive (freed as torch frees them; the next step()
        # registers what backward makes before the runtime reads any).
        # Without, every p.grad is zeroed in place and stays p.grad, as
        # torch does (the user may hold it): the next backward
        # accumulates where the runtime already reads (or copies from).
        if set_to_none:
            c.scan.drop()
        else:
            for f in c.grad_flats:
                f.zero_()
            zs = []
            for p, r in zip(ps, c.a_regs):
                g = p.grad
                if g is not None and g is not r:
                    if g.grad_fn is not None:
                        g.detach_()
                    elif g.requires_grad:
                        g.requires_grad_(False)
                    zs.append(g)
            if zs:  # as torch.optim's zero_grad: in place, one call
                with torch.no_grad():
                    if hasattr(torch, "_foreach_zero_"):
                        torch._foreach_zero_(zs)
                    else:
                        for g in zs:
                            g.zero_()
    for e in c.entries:
        if not e.auto:
            if is_torch(e.grad):
                e.grad.zero_()
            else:
                e.grad[...] = 0

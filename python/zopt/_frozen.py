"""GPU steps' frozen params: left out of the native optimizer, joining it
when they are trained (docs/GPU.md "What the Python binding does",
docs/USAGE.md section 3).

A GPU step skips a param without a gradient as a CPU step does: the
binding pushes the runtime's per-tensor active mask (zopt._grads) and
every tensor counts its own steps on the device. What is left here is
memory: a torch param given alone with ``requires_grad=False`` (and no
gradient) when the native optimizer is built is **left out**, an empty
slot (``add_tensor`` with 0 elements: tensor ids stay the params'
indices), masked off (:func:`exclude_frozen`). Held inactive instead, it
would cost its states and a gradient buffer in device memory for as long
as it stays frozen (12 bytes per element for AdamW with an f32 master):
most of the memory of a model whose base weights are frozen (LoRA,
frozen embeddings), which torch.optim never allocates for them. The price
is a rebuild when one is unfrozen (``zopt_optimizer_add_tensors`` refuses
GPU steps): :func:`include_unfrozen` moves every state into a new native
optimizer in memory (zopt._rebuild) where the param is held in its own
param group's native group with zero states and step 0 (its first step
is t = 1, as torch's lazily created state).

Checkpoint files saved by the binding before the mask, whose unfrozen
params sat in extra native groups ("cohorts", one count per group), still
load (:func:`legacy_groups`, :func:`load_legacy`): each tensor keeps its
own count, each param group the largest count of its native groups.

Functions take the part ``c`` (zopt._part.Part) first.
"""
from __future__ import annotations

import ctypes
import os
import struct

import numpy as np

from . import _ckpt, _gpu, _grads, _params, _rebuild, _stateio
from ._dtypes import NP_OF
from ._lib import EXPORT_NO_CHECKSUMS, EXPORT_WHOLE, GROUP_MAXIMIZE, HYPER_NAMES, DType, StateKind, \
    Status, ZoptError, check


def exclude_frozen(c, new):
    """GPU steps: the new entries (the last ``len(new)`` ones) that are
    frozen (a torch param given alone with requires_grad=False and no
    gradient) are left out of the native optimizer. Returns the entries
    that are held."""
    base = len(c.entries) - len(new)
    held = []
    for i, e in enumerate(new):
        if e.frozen:
            c.excluded.add(base + i)
        else:
            held.append(e)
    return held


def include_unfrozen(c):
    """GPU steps: params left out that now have a gradient (unfrozen:
    ``requires_grad_(True)`` and a backward) join the native optimizer,
    rebuilt keeping every state, with zero states and step 0 in their
    param group's native group. Refused inside a CUDA graph capture (a
    new native optimizer allocates and copies). Returns whether any
    joined; a failure leaves the old native optimizer."""
    ents = c.entries
    new = [t for t in sorted(c.excluded) if _params.has_grad(ents[t].param)]
    if not new:
        return False
    if c.capturing():
        names = [ents[t].name for t in new]
        raise ZoptError(
            Status.BAD_STATE,
            f"step(): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} got a "
            "gradient inside a CUDA graph capture (torch.cuda.graph), but did not require "
            f"grad when the optimizer was built: step '{c.step.name}' left them out, and "
            "they join by a new native optimizer (device buffers allocated and filled), "
            "which a capture cannot record. Give them a gradient at a step before "
            "capturing. Nothing was updated")
    for t in new:  # checked as any param is (dtype, layout, memory)
        e = ents[t]
        e.name = e.name.split(" (shape ")[0] + (
            f" (shape {tuple(e.param.shape)}, {str(e.param.dtype).replace('torch.', '')})")
        _params.layout(c.step, e)
    c.prepare()
    snap = _rebuild.snapshot(c)
    _params.pre_rebuild(c)
    old_ex, old_h = set(c.excluded), c.h
    n_flats = len(c.grad_flats)
    try:
        c.excluded.difference_update(new)
        for t in new:
            ents[t].frozen = False
        _params.check_overlaps(c)
        _grads.alloc_grads(c, [ents[t] for t in new])
        c.build()
        # the new ones: not in snap, so fresh. The hyperparameters the old
        # native optimizer had, not param_groups': an edit not pushed yet is
        # pushed (or refused: overlap=True between the marks and step())
        # after this, in step(); restored from param_groups, a refused edit
        # stayed in this class's new native optimizer (finding O4)
        _rebuild.restore(c, snap, groups=snapshot_groups(c, snap))
    except BaseException:
        c.excluded = old_ex
        del c.grad_flats[n_flats:]
        for t in new:
            ents[t].frozen, ents[t].grad, ents[t].gptr = True, None, None
        if c.h is not old_h:  # built without its states: the old registrations again
            c.build()
            _rebuild.restore(c, snap)
        raise
    _grads.add_acc_hooks(c, [ents[t] for t in new])
    c.rebuilds += 1
    return True


def snapshot_groups(c, snap):
    """The param groups' hyperparameters and flags as the snapshot's native
    optimizer had them (the pushed values); a group it lacks: param_groups'."""
    s, img = c.step, snap["image"]
    out = []
    for gid, g in enumerate(c.groups):
        if gid >= len(img.groups) or gid >= snap["native_G"]:
            out.append(g)
            continue
        _, hyp, fl = img.groups[gid]
        d = {HYPER_NAMES[k]: v for k, v in hyp.items() if HYPER_NAMES.get(k) in s.hypers}
        d["maximize"] = bool(fl & GROUP_MAXIMIZE)
        out.append(d)
    return out


def check_held(c, t, what):
    """A param left out (GPU steps) has no states to read or write."""
    if t in c.excluded:
        raise ZoptError(
            Status.INVALID_ARGUMENT,
            f"{what}: {c.entries[t].name} is left out of the optimizer's native "
            f"state: step '{c.step.name}' updates on the GPU and the param did not "
            "require grad when the optimizer was built, so it has no states (as torch's "
            "opt.state[p] is empty for a param never stepped). It gets fresh states when "
            "it is trained: requires_grad_(True) and a gradient at a step")


def check_file_slots(c, path):
    """load() of a GPU step's file whose tensors differ from c's only in
    which params are left out (frozen when either optimizer was built: an
    empty slot on one side, the param's elements on the other) is refused
    naming them and what loads instead (the runtime's own message, "tensor
    t has 0 elements", said neither; finding O1 of the overlap fuzzer).
    Any other difference is the runtime's to judge."""
    if not c.step.gpu:
        return
    try:
        head = _ckpt.read_tensors(path)
    except (OSError, ValueError, struct.error):
        return
    if head is None or head[1] != 1 or len(head[2]) != len(c.entries):
        return
    saved = head[2]
    mine = [0 if t in c.excluded else e.numel for t, e in enumerate(c.entries)]
    diff = [t for t, (a, b) in enumerate(zip(saved, mine)) if a != b]
    if not diff or any({saved[t], mine[t]} != {0, c.entries[t].numel} for t in diff):
        return
    ours = [c.entries[t].name for t in diff if t in c.excluded]
    theirs = [c.entries[t].name for t in diff if t not in c.excluded]
    what = []
    if ours:
        what.append(f"this optimizer left out {', '.join(ours)} (it did not require grad "
                    "when the optimizer was built) but the file holds its states")
    if theirs:
        what.append(f"the file was saved with {', '.join(theirs)} left out (it did not "
                    "require grad when that optimizer was built) but this optimizer holds it")
    raise ZoptError(
        Status.CHECKPOINT,
        f"load({path}): step '{c.step.name}' updates on the GPU, where a param frozen when "
        f"the optimizer is built has no states (an empty slot): {'; '.join(what)}. "
        "Nothing was loaded. Build the optimizer with the same params frozen as the one "
        "that saved it, or load opt.state_dict() with load_state_dict() instead (a param "
        "left out there drops its states, one the state_dict lacks starts afresh)")


# ---- files saved with extra native groups (before the GPU mask) ----------------------
def legacy_groups(c, path):
    """The native group of each tensor in a checkpoint file saved with
    extra native groups after the param groups' (the binding's GPU
    "cohorts"), each holding tensors of one param group: (param group of
    each extra group, native group of each tensor); None for any other
    file (the runtime's load judges it)."""
    try:
        t = _ckpt.read_tensor_table(path)
    except (OSError, ValueError, struct.error):
        return None
    if t is None:
        return None
    _name, world, ngroups, table = t
    G = c.native_G
    if world != 1 or c.world_size != 1 or ngroups <= G or len(table) != len(c.entries):
        return None
    gid_of = [None] * (ngroups - G)
    tgroup = []
    for e, (fg, _) in zip(c.entries, table):
        if fg >= G:
            k = fg - G
            if gid_of[k] not in (None, e.group):
                return None
            gid_of[k] = e.group
        elif fg != e.group:
            return None
        tgroup.append(fg)
    if None in gid_of:
        return None
    return gid_of, tgroup


def load_legacy(c, path, flags, groups):
    """load() of a file :func:`legacy_groups` recognized: the runtime loads
    (and checks) it into a temporary native optimizer of the file's groups
    (the states' memory twice meanwhile), whose whole export goes into c's
    native optimizer in one staged import: every tensor its own count and
    states, each param group its hyperparameters and flags and the largest
    count of its native groups, the scaler and the seed. Nothing changes
    if anything is refused."""
    gid_of, tgroup = groups
    L, s = c.lib, c.step
    h = ctypes.c_void_p()
    check(L.zopt_optimizer_create(s._h, ctypes.byref(h)), "zopt_optimizer_create")
    try:
        if c.streams:
            _gpu.use_stream(L, h, c.device)
        if s.gpu and c.dev_alloc is not None:
            check(_gpu.set_device_allocator(L, h, c.dev_alloc),
                  "zopt_optimizer_set_device_allocator")
        for _ in range(c.native_G + len(gid_of)):
            check(L.zopt_optimizer_add_group(h, ctypes.byref(ctypes.c_int())),
                  "zopt_optimizer_add_group")
        for t, e in enumerate(c.entries):
            held = t not in c.excluded and e.numel
            check(L.zopt_optimizer_add_tensor(
                h, tgroup[t], ctypes.c_void_p(e.pptr if held else None),
                ctypes.c_void_p(e.gptr if held else None), e.numel if held else 0,
                int(s.param_dtype), ctypes.byref(ctypes.c_int())),
                f"zopt_optimizer_add_tensor({e.name})")
        check(L.zopt_optimizer_finalize(h), "zopt_optimizer_finalize")
        check(L.zopt_optimizer_load_ex(h, os.fspath(path).encode(), flags), f"load({path})")
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(L.zopt_optimizer_export_state(h, ctypes.byref(buf), ctypes.byref(size),
                                            EXPORT_WHOLE | EXPORT_NO_CHECKSUMS),
              "zopt_optimizer_export_state")
        img = _ckpt.parse(np.asarray(_stateio.StateBuffer(L, buf.value, size.value)),
                          f"load({path})")
    finally:
        L.zopt_optimizer_free(h)
    G = c.native_G
    kinds = [StateKind(k) for k, _ in img.kinds]
    data = {}
    for ki, (k, dt) in enumerate(img.kinds):
        for t in range(len(c.entries)):
            if t not in c.excluded:
                a = img.state(ki, t)
                data[(kinds[ki], t)] = np.empty(0, dtype=NP_OF[DType(dt)]) if a is None else a
    counts = [cnt for cnt, _, _ in img.groups]
    gsteps = [max([counts[g]] + [counts[G + k] for k, x in enumerate(gid_of) if x == g])
              for g in range(G)]
    groups = []
    for g in range(G):
        _, hyp, fl = img.groups[g]
        d = {HYPER_NAMES[k]: v for k, v in hyp.items() if HYPER_NAMES.get(k) in s.hypers}
        d["maximize"] = bool(fl & GROUP_MAXIMIZE)
        groups.append(d)
    snap = dict(kinds=kinds, data=data, steps=img.tensors["steps"].tolist(),
                group_steps=gsteps, native_steps=gsteps, native_G=G,
                scaler=(img.scale, img.good_steps, img.scaler_cfg), seed=img.seed)
    _rebuild.restore(c, snap, groups=groups, what=f"load({path})")

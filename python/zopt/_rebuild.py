"""A part's native optimizer changed with every state kept, through the
runtime's state in memory (docs/CHECKPOINT.md "In memory"): no file, and
no checkpoint written by the binding (the runtime's writer is the format's
only one).

* :func:`snapshot`: the whole state exported
  (``zopt_optimizer_export_state``, ZOPT_EXPORT_WHOLE) and read in memory
  (zopt._ckpt: numpy views of the image).
* :func:`restore`: one staged import (``zopt_optimizer_import_begin`` ...
  ``_commit``) of a snapshot, or of the states ``load_state_dict`` gives,
  into the current native optimizer, whose tensors may be more or fewer
  than the snapshot's: checked whole, then applied, or nothing.
* :func:`grow`: new entries (``add_param_group``) through
  ``zopt_optimizer_add_tensors`` (CPU and offloaded steps: rebuilt in
  place); otherwise (GPU steps, or a refusal of it) :func:`rebuild`:
  export -> a new native optimizer -> staged import (which also undoes a
  grow).
* :func:`register_moved`: params whose storage moved (``p.data = new``):
  ``zopt_optimizer_set_tensor_memory`` (every backend), else (a refusal)
  export -> new native -> import.

GPU steps' frozen params (left out, joining when unfrozen) are
zopt._frozen's. Functions take the part ``c`` (zopt._part.Part) first.
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import _ckpt, _hypers, _params
from ._dtypes import NP_OF, STATE_NP_DTYPES, TORCH_KEY
from ._lib import GROUP_MAXIMIZE, DType, StateKind, Status, ZoptError, check


# ---- snapshots and restores -----------------------------------------------------
def snapshot(c):
    """Everything the native optimizer holds, exported and read in memory:
    dict(kinds, data {(kind, tensor): numpy view}, steps (per tensor),
    group_steps (per param group), native_steps, native_G, scaler
    (scale, good_steps, config), seed, image). Collective at world size
    > 1 (the sharded states are gathered)."""
    img = _ckpt.parse(c.export_whole(), f"the state of step '{c.step.name}'")
    kinds = [StateKind(k) for k, _ in img.kinds]
    ex = c.excluded
    T = len(img.tensors)  # (the registrations may have more already)
    data = {}
    for ki, (k, dt) in enumerate(img.kinds):
        empty = np.empty(0, dtype=NP_OF[DType(dt)])
        for t in range(T):
            if t in ex:  # no states (GPU steps' frozen params)
                continue
            a = img.state(ki, t)
            data[(kinds[ki], t)] = empty if a is None else a
    steps = img.tensors["steps"].tolist()
    for t in ex:  # left out (GPU steps): never stepped
        if t < T:
            steps[t] = 0
    native = [g[0] for g in img.groups]
    return dict(kinds=kinds, data=data, steps=steps, group_steps=native,
                native_steps=native, native_G=c.native_G,
                scaler=c.scaler_state(),  # (the image's, read through the getters)
                seed=img.seed, image=img)


def restore(c, snap, groups=None, what="restore"):
    """Imports a snapshot (or what load_state_dict made of a state_dict:
    the same keys) into c's native optimizer in one staged import, with
    the hyperparameters and flags of ``groups`` (default: the optimizer's
    param groups): the snapshot's tensors that c has (by index) get their
    states and counts, the others start as at finalize. Nothing changes if
    anything is refused."""
    s = c.step
    if groups is None:
        groups = c.groups
    ents, ex = c.entries, c.excluded
    T, G = len(ents), len(groups)
    steps = (list(snap["steps"]) + [0] * T)[:T]
    for t in ex:  # left out (GPU steps): no states, never stepped
        steps[t] = 0
    gsteps = list(snap["group_steps"]) + [0] * G
    # Native groups, one per param group: a snapshot's own counts where it
    # has them.
    native, nG = snap.get("native_steps"), snap.get("native_G", 0)
    counts = [native[g] if native is not None and g < nG else gsteps[g] for g in range(G)]
    scale, good, cfg = snap["scaler"]
    with c.begin_import() as imp:
        for (k, t), a in snap["data"].items():
            if t >= T or t in ex or not ents[t].numel:
                continue
            imp.put(t, k, STATE_NP_DTYPES[a.dtype], a,
                    f"{what}: {ents[t].name}: '{TORCH_KEY.get(k, k)}'")
        for t, n in enumerate(steps):
            if n:
                imp.tensor_step(t, n)
        for gid, g in enumerate(groups):
            imp.group(gid, counts[gid], GROUP_MAXIMIZE if _hypers.maximize(g) else 0)
            for name, v in _hypers.slots(g, s.hypers).items():
                if name not in s.hypers:  # plain SGD's momentum 0 (rule_only_keys)
                    continue
                imp.hyper(gid, name, v, f"{what}: param group {gid}: {name}={v!r}")
        imp.scaler(cfg, scale, good)
        imp.seed(snap["seed"])
        imp.commit(what)
    c.scaler_cfg = dict(cfg)  # (for the native optimizers built later)
    c.seed_value = snap["seed"]
    _params.reset_watch(c)


def rebuild(c, snap=None):
    """A new native optimizer over the registered tensors and groups with
    every state of the old one (``snap``: a snapshot taken of it before the
    registrations changed; default: taken now)."""
    if snap is None:
        snap = snapshot(c)
    _params.pre_rebuild(c)
    c.build()
    restore(c, snap)
    c.rebuilds += 1


# ---- tensors added, moved ---------------------------------------------------------
_IN_PLACE_REFUSALS = (Status.UNSUPPORTED, Status.BAD_STATE)


def grow(c, new_groups, tids, undo):
    """Param groups ``c.groups[-new_groups:]`` and the registered entries
    ``tids`` (the last ones) into c's native optimizer, every state kept:
    ``zopt_optimizer_add_tensors`` where the runtime does it in place (CPU
    and offloaded steps), else a rebuild (export -> new native -> import).
    ``undo[id(c)]`` is set, before the native optimizer changes, to the
    snapshot that puts it back (:func:`rebuild` over the old
    registrations), or None: its old states stay in the grown native
    optimizer (snapshot it before its registrations go back)."""
    if not c.step.gpu:
        if c.step.zero3:
            registered_current(c, set(tids))
        try:
            c.add_tensors(new_groups, tids)
        except ZoptError as e:
            if e.code not in _IN_PLACE_REFUSALS:
                raise
        else:
            undo[id(c)] = None
            G = len(c.groups)
            for gid in range(G - new_groups, G):
                c.push_group(c.h, gid, gid, c.groups[gid])
            c.after_layout()
            c.rebuilds += 1
            return
    undo[id(c)] = snap = snapshot(c)
    rebuild(c, snap)


def registered_current(c, tids):
    """ZeRO-3, before tensors are added: the runtime refuses a new param at
    memory registered for another one, and the registered memory of a
    released param (freed) or of one gathered into new storage may be
    handed out again (R6): the released params gathered (as for a
    rebuild; collective, as add_param_group), the moved ones registered."""
    old = [t for t in range(len(c.entries)) if t not in tids]
    released = sorted(t for t in c.released if t in old)
    if released:
        c.gather_params(released)
    moved = [t for t in old if c.entries[t].dense is None
             and _params.moved_from_registered(c, t)]
    if moved:  # (the binding's tables: made anew once the tensors are added)
        _set_memory(c, moved)


def _set_memory(c, tids):
    """zopt_optimizer_set_tensor_memory of tids to their current storage
    (with our own gradient memory). Where one's storage is memory still
    registered for another (two params that swapped storage; memory the
    allocator handed out again, which differs between ranks: R6, R8),
    each goes to scratch memory of its own first (never read), so that no
    call is refused: a refusal's rebuild on one rank only would leave the
    ranks' collectives apart."""
    L, h = c.lib, c.handle()
    ents = c.entries

    def register(t, ptr):
        e = ents[t]
        check(L.zopt_optimizer_set_tensor_memory(h, int(t), ctypes.c_void_p(ptr),
                                                 ctypes.c_void_p(e.gptr or None)),
              f"zopt_optimizer_set_tensor_memory({e.name})")
        e.pptr = ptr
    new = {t: ents[t].param.data_ptr() for t in tids}
    held = {}
    for u, e in enumerate(ents):
        if e.numel and e.pptr:
            held.setdefault(e.pptr, set()).add(u)
    if any(held.get(p, set()) - {t} for t, p in new.items()):
        keep = []  # (scratch the allocator put where a freed param is registered: kept, not used)
        for t in tids:
            x = _scratch_like(ents[t].param)
            while x.data_ptr() in held:
                keep.append(x)
                x = _scratch_like(ents[t].param)
            keep.append(x)
            register(t, x.data_ptr())
    for t in tids:
        register(t, new[t])


def _scratch_like(p):
    """Memory of p's size and dtype on its device (where _set_memory parks
    a registration)."""
    return p.detach().new_empty(p.shape)


def register_moved(c, tids):
    """Moved params: their new storage registered
    (``zopt_optimizer_set_tensor_memory``, GPU steps too: the runtime
    rewrites the device's pointer table; a refusal: the native optimizer
    rebuilt around it), every state kept. Under ZeRO-3 too, although the
    runtime never reads the registered param memory after finalize (the
    binding passes the current storage everywhere): left registered, the
    old storage, once another param's or gradient's, was refused as
    registered (finding S2), and a rank whose param the allocator put
    back into its registered storage refreshed it otherwise (another
    collective) than the others (S3)."""
    tids = [t for t in tids if c.entries[t].dense is None]
    if not tids:  # strided params: their registered copies did not move
        return
    try:
        _move_in_place(c, tids)
    except ZoptError as e:  # (two params that swapped storage, ...)
        if e.code not in _IN_PLACE_REFUSALS + (Status.INVALID_ARGUMENT,):
            raise
    else:
        c.rebuilds += 1
        return
    snap = snapshot(c)  # (the states: none of them moved)
    for t in tids:
        c.entries[t].pptr = c.entries[t].param.data_ptr()
    rebuild(c, snap)


def _move_in_place(c, tids):
    """set_tensor_memory of each moved param with our own gradient memory,
    then the per-step tables made anew (Part.after_layout: every gradient
    read in place, moved or not, is ours again until the next step hands
    it over, checked against the params' new memory)."""
    try:
        _set_memory(c, tids)
    finally:  # (also before a refusal's rebuild: the tables match the runtime)
        c.after_layout(same_tensors=True)

"""Rebuilding a part's native optimizer with every state kept, and the GPU
steps' frozen params and cohorts: what the runtime cannot do in place yet.

What replaces this module (issue 17, item 3; in the runtime, after this
binding's split): an in-memory state export/import and tensors added to a
finalized optimizer. Until then:

* **Rebuilds through a temporary checkpoint.** A native optimizer's groups
  and tensors are fixed at finalize, and the C API cannot set a tensor's
  states before finalize nor every count afterwards (GPU steps count per
  group), so ``add_param_group``, a param whose storage moved (``p.data =
  new``) and ``load_state_dict`` read everything the native optimizer
  holds (:func:`snapshot`), build a new one and load a one-rank checkpoint
  file the binding writes (:func:`restore`, zopt._ckpt's writer;
  ``zopt_optimizer_load_ex`` checks the whole file before it changes
  anything). The swap: ``snapshot`` -> the runtime's export, ``restore`` ->
  its import, and the rebuilds -> tensors added in place.
* **GPU cohorts.** GPU kernels have no per-tensor skip (active mask) yet:
  a torch param that does not require grad when the optimizer is built is
  left out (an empty slot, :func:`exclude_frozen`), joins once it has a
  gradient (:func:`include_unfrozen`, a rebuild) with fresh states, in an
  extra native group of its own when its group has stepped (a *cohort*:
  GPU steps count steps per group). A held param without a gradient
  refuses the step. The swap: the runtime's per-tensor mask on the GPU.

Functions take the part ``c`` (zopt._part.Part) first.
"""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np

from . import _ckpt, _grads, _hypers, _params
from ._dtypes import NP_DTYPES, NP_OF, convert_bits
from ._lib import DType, HYPER_BY_NAME, StateKind, Status, ZoptError, check


# ---- snapshots and restores -----------------------------------------------------
def ckpt_kinds(c):
    kinds = list(c.step.owned_states)
    if c.step.zero3:
        kinds.append(StateKind.PARAM)
    return kinds


def snapshot(c):
    """Everything the native optimizer holds (states raw, step counts,
    scaler, seed); collective at world size > 1 for sharded states."""
    c.handle()
    kinds = ckpt_kinds(c)
    data = {}
    for t, e in enumerate(c.entries):
        if t in c.excluded:  # no states (GPU steps' frozen params)
            continue
        for k in kinds:
            data[(k, t)] = c.read_raw(t, k) if e.numel else \
                np.empty(0, dtype=NP_OF[c.step.state_dtype(k)])
    native = c.native_steps()
    G = c.native_G
    return dict(kinds=kinds, data=data,
                steps=[c.tensor_step(t) for t in range(len(c.entries))],
                group_steps=[max([native[g]] + [native[G + k] for k, x in
                                                enumerate(c.cohort_gid) if x == g])
                             for g in range(G)],
                native_steps=native, native_G=G,
                scaler=c.scaler_state(), seed=c.get_seed())


def restore(c, snap, groups=None, flags=0, file_kinds=None):
    """Loads a snapshot (old tensors; new ones start fresh) with the
    hyperparameters and flags of ``groups`` (default: the optimizer's
    param groups) through a checkpoint file the binding writes (the only
    way to set every count and the scaler's state through the C API)."""
    s = c.step
    if groups is None:
        groups = c.groups
    kinds = list(file_kinds if file_kinds is not None else snap["kinds"])
    dts = {}
    for (k, t), a in snap["data"].items():
        dts.setdefault(k, NP_DTYPES[a.dtype])
    kind_dt = [(k, dts.get(k, s.state_dtype(k) or DType.F32)) for k in kinds]
    kidx = {k: i for i, (k, _) in enumerate(kind_dt)}
    data = {}
    for (k, t), a in snap["data"].items():
        if k not in kidx:
            continue
        want = NP_OF[kind_dt[kidx[k]][1]]
        if a.dtype != want:
            a = convert_bits(a, NP_DTYPES[a.dtype], kind_dt[kidx[k]][1])
        data[(kidx[k], t)] = a
    steps = list(snap["steps"]) + [0] * (len(c.entries) - len(snap["steps"]))
    ex = c.excluded
    for t in ex:  # left out (GPU steps): no states, never stepped
        steps[t] = 0
    data = {key: a for key, a in data.items() if key[1] not in ex}
    gsteps = list(snap["group_steps"])
    gsteps += [0] * (len(groups) - len(gsteps))
    # Native groups: the param groups' (a snapshot's own counts where it
    # has them), then the extra groups of GPU steps (those the snapshot
    # had keep their counts; a new one starts at its tensors' steps).
    native, nG = snap.get("native_steps"), snap.get("native_G", 0)
    G = len(groups)
    counts = [native[g] if native is not None and g < nG else gsteps[g] for g in range(G)]
    for k in range(len(c.cohort_gid)):
        if native is not None and nG + k < len(native):
            counts.append(native[nG + k])
        else:
            counts.append(max([steps[t] for t, x in c.cohort_of.items() if x == k]
                              or [0]))
    ngroups = []
    for ng, gid in enumerate(list(range(G)) + list(c.cohort_gid)):
        g = groups[gid]
        ngroups.append((counts[ng], [(int(HYPER_BY_NAME[n]), v)
                                     for n, v in _hypers.slots(g, s.hypers).items()],
                        _ckpt.GROUP_MAXIMIZE if g.get("maximize") else 0))
    cohort = c.cohort_of
    tensors = [(e.group if t not in cohort else G + cohort[t],
                0 if t in ex else e.numel, steps[t]) for t, e in enumerate(c.entries)]
    scale, good, cfg = snap["scaler"]
    scaler = (scale, good, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"],
              cfg["growth_interval"], cfg["min_scale"], cfg["dynamic"])
    with tempfile.TemporaryDirectory(prefix="zopt-load-") as d:
        path = os.path.join(d, "state.zckpt")
        _ckpt.write(path, name=s.name, desc_checksum=s.checksum, scaler=scaler,
                    seed=snap["seed"], kinds=[(int(k), int(dt)) for k, dt in kind_dt],
                    groups=ngroups, tensors=tensors, data=data)
        check(c.lib.zopt_optimizer_load_ex(c.handle(), path.encode(), flags),
              "load_state_dict")
    c.scaler_cfg = dict(cfg)
    c.seed_value = snap["seed"]
    for gid, g in enumerate(groups):  # the files may not carry the flag: the groups do
        c.set_maximize(gid, _hypers.maximize(g))
    _params.reset_watch(c)


# ---- rebuilds ---------------------------------------------------------------------
def register_moved(c, tids):
    """Moved params: under ZeRO-3 nothing to register (the runtime never
    reads the registered param memory after finalize; the binding
    passes the current storage everywhere). Otherwise the runtime
    writes params in place: the native optimizer is rebuilt around the
    new storage, every state kept."""
    if c.step.zero3:
        return
    tids = [t for t in tids if c.entries[t].dense is None]
    if not tids:  # strided params: their registered copies did not move
        return
    snap = snapshot(c)
    for t in tids:
        c.entries[t].pptr = c.entries[t].param.data_ptr()
    c.build()
    restore(c, snap)
    c.rebuilds += 1


def regroup(c, cohorts):
    """Rebuilds the native optimizer with other extra native groups
    (cohort_gid, cohort_of); returns what :func:`undo_regroup` needs
    to put the old one back (a snapshot of every state)."""
    snap = snapshot(c)
    _params.pre_rebuild(c)
    old = (c.cohort_gid, c.cohort_of)
    c.cohort_gid, c.cohort_of = list(cohorts[0]), dict(cohorts[1])
    try:
        c.build()
    except BaseException:
        c.cohort_gid, c.cohort_of = old
        raise
    c.rebuilds += 1
    return snap, old


def undo_regroup(c, snap, old):
    c.cohort_gid, c.cohort_of = old
    c.build()
    restore(c, snap)
    c.rebuilds += 1


# ---- GPU steps: frozen params left out, joining when trained ----------------------
def exclude_frozen(c, new):
    """GPU steps: the new entries (the last ``len(new)`` ones) that are
    frozen (a torch param given alone with requires_grad=False and no
    gradient) are left out of the native optimizer: GPU kernels have
    no per-tensor skip, so a param the runtime holds must have a
    gradient at every step. Returns the entries that are held."""
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
    rebuilt keeping every state. They start like torch's lazily created
    state: zero states, step 0 (in a native group of their own when
    their param group has stepped already: GPU steps count steps per
    group)."""
    ents = c.entries
    new = [t for t in sorted(c.excluded) if _params.has_grad(ents[t].param)]
    if not new:
        return False
    for t in new:  # checked as any param is (dtype, layout, memory)
        e = ents[t]
        e.name = e.name.split(" (shape ")[0] + (
            f" (shape {tuple(e.param.shape)}, {str(e.param.dtype).replace('torch.', '')})")
        _params.layout(c.step, e)
    c.prepare()
    snap = snapshot(c)
    _params.pre_rebuild(c)
    old = (set(c.excluded), list(c.cohort_gid), dict(c.cohort_of))
    n_flats = len(c.grad_flats)
    try:
        c.excluded.difference_update(new)
        for e in (ents[t] for t in new):
            e.frozen = False
        _params.check_overlaps(c)
        by_group = {}
        for t in new:
            by_group.setdefault(ents[t].group, []).append(t)
        for gid, ts in by_group.items():
            if snap["native_steps"][gid]:  # the group has stepped: a group of their own
                k = len(c.cohort_gid)
                c.cohort_gid.append(gid)
                for t in ts:
                    c.cohort_of[t] = k
        _grads.alloc_grads(c, [ents[t] for t in new])
        c.build()
    except BaseException:
        c.excluded, c.cohort_gid, c.cohort_of = old
        del c.grad_flats[n_flats:]
        for t in new:
            ents[t].frozen, ents[t].grad, ents[t].gptr = True, None, None
        raise
    restore(c, snap)
    _grads.add_acc_hooks(c, [ents[t] for t in new])
    c.rebuilds += 1
    return True


def cohorts_by_steps(c, steps, gsteps):
    """GPU steps (one step count per native group): the extra native
    groups that give every held tensor its own count ``steps[t]``: a
    tensor whose count is not its param group's ``gsteps[g]`` goes to
    the extra group of (g, count). Returns (cohort_gid, cohort_of)."""
    gid_of, cohort_of, key_of = [], {}, {}
    for t, e in enumerate(c.entries):
        if t in c.excluded or steps[t] == gsteps[e.group]:
            continue
        k = key_of.setdefault((e.group, steps[t]), len(gid_of))
        if k == len(gid_of):
            gid_of.append(e.group)
        cohort_of[t] = k
    return gid_of, cohort_of


def partition(cohort_of):
    by = {}
    for t, k in cohort_of.items():
        by.setdefault(k, set()).add(t)
    return {frozenset(ts) for ts in by.values()}


def file_cohorts(c, path):
    """GPU steps: the extra native groups of a checkpoint file written by
    save() (params that joined after the optimizer was built, each such
    group a native group after the param groups'), as (cohort_gid,
    cohort_of) for this part's tensors; None if the file does not
    say or does not fit (the runtime's load then names the mismatch)."""
    try:
        t = _ckpt.read_tensor_table(path)
    except (OSError, ValueError, struct.error):
        return None
    if t is None:
        return None
    _name, _world, ngroups, table = t
    tgroup = [g for g, _ in table]
    G = c.native_G
    if len(tgroup) != len(c.entries) or ngroups < G:
        return None
    gid_of = [None] * (ngroups - G)
    cohort_of = {}
    for t, (e, fg) in enumerate(zip(c.entries, tgroup)):
        if fg < G:
            if fg != e.group:
                return None
            continue
        k = fg - G
        if k >= len(gid_of) or gid_of[k] not in (None, e.group):
            return None
        gid_of[k] = e.group
        cohort_of[t] = k
    if None in gid_of:
        return None
    return gid_of, cohort_of


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


def refuse_missing_grads(c):
    miss = c.gpu_missing
    names = [c.entries[t].name for t in miss[:4]]
    raise ZoptError(
        Status.UNSUPPORTED,
        f"step(): {', '.join(names)}{', ...' if len(miss) > 4 else ''} "
        f"({len(miss)} of {len(c.entries)} params) require grad but have no gradient "
        f"at this step. Step '{c.step.name}' updates on the GPU, whose kernels have "
        "no per-tensor skip yet: every param the optimizer holds needs a gradient at "
        "every step (torch.optim would leave these alone). For params that are never "
        "trained, set requires_grad=False before building the optimizer: they are then "
        "left out (and join with fresh states once unfrozen and given a gradient). "
        "Otherwise let backward reach them, or use a CPU or offloaded step. Nothing was "
        "updated")

"""GPU steps: frozen params left out of the native optimizer, and *cohorts*
(extra native groups) that emulate a per-tensor skip the GPU kernels lack.

What replaces this module (issue 17, item 3): the GPU backend's per-tensor
active mask and per-tensor step counts (branch ``control``). Then a frozen
param is held like any other (masked off while it has no gradient) and
every tensor counts its own steps: this module goes, and with it the
``excluded`` / ``cohort_gid`` / ``cohort_of`` tables of zopt._native.Native.
Until then:

* A torch param that does not require grad when the optimizer is built is
  left out (an empty slot, :func:`exclude_frozen`), and joins once it has a
  gradient (:func:`include_unfrozen`: a rebuild, zopt._rebuild) with fresh
  states, in an extra native group of its own when its group has stepped
  (a cohort: GPU steps count steps per group). A held param without a
  gradient refuses the step (:func:`refuse_missing_grads`).
* A load whose params have other counts than their group's regroups them
  into cohorts first (:func:`cohorts_by_steps`, :func:`file_cohorts`,
  :func:`regroup`; :func:`undo_regroup` puts the old native optimizer back).

Functions take the part ``c`` (zopt._part.Part) first.
"""
from __future__ import annotations

import struct

from . import _ckpt, _grads, _params, _rebuild
from ._lib import Status, ZoptError


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
    snap = _rebuild.snapshot(c)
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
    _rebuild.restore(c, snap)
    _grads.add_acc_hooks(c, [ents[t] for t in new])
    c.rebuilds += 1
    return True


# ---- loads: params of other counts in groups of their own ------------------------
def regroup(c, cohorts):
    """Rebuilds the native optimizer with other extra native groups
    (cohort_gid, cohort_of), without states (the caller's load brings
    them); returns what :func:`undo_regroup` needs to put the old one
    back (a snapshot of every state)."""
    snap = _rebuild.snapshot(c)
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
    _rebuild.restore(c, snap)
    c.rebuilds += 1


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


# ---- refusals ------------------------------------------------------------------------
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

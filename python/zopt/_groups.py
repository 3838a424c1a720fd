"""The param groups of a zopt.Optimizer and the parts (parameter classes)
their params go to: a group checked and its params made entries of their
class's part (zopt._classes routes them), the global tables (tensor index
-> part and index in it), and ``add_param_group`` after construction: the
group and its tensors added to every class's native optimizer, keeping its
states (zopt._rebuild.grow; a class seen for the first time gets a part),
all of it undone if one fails.

Functions take the optimizer first.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import (_classes, _frozen, _gpu, _grads, _hypers, _params, _placement, _rebuild, _strided,
               _torch_compat)
from . import _warnings
from ._dtypes import is_torch
from ._lib import Status, ZoptError, ZoptValueError
from ._part import Part
from ._policy import name_matches


def part_of(opt, cls):
    """The part of class cls (a new one, not built yet, if it has none)."""
    c = opt.parts.get(cls)
    if c is None:
        st = dict(opt._settings)
        built = [x for x in opt._parts if x.h is not None]
        if built:  # a class joining later: the others' seed and scaler
            st.update(seed=built[0].get_seed(), scaler_cfg=built[0].scaler_config_now())
        c = Part(opt, cls, opt._steps[cls], zero3_mode=opt._zero3_gather,
                 grad_accumulation=opt._grad_accumulation, comm=opt._comm, **st)
        c.rank_checks = opt._rank_checks
        opt._parts.append(c)
        opt._parts.sort(key=lambda x: _classes.CLASS_ORDER.index(x.cls))
        opt.parts[cls] = c
    return c


def register(c, new):
    """Part c's new entries (already in c.entries) checked and given
    gradient memory (GPU steps: frozen ones left out)."""
    held = _frozen.exclude_frozen(c, new)
    _params.check_overlaps(c)
    if c.overlap is not None:
        for e in held:
            c.overlap.check_entry(e)
    if c.streamer is None:
        _grads.alloc_grads(c, held)
    else:
        c.streamer.check_entries(held)


def extend(c, new):
    """Part c's new entries (already in c.entries) registered: a new
    native optimizer over them (no states restored here)."""
    register(c, new)
    c.build()


def route(opt):
    """The global tables: tensor index -> (part, local index), in
    param_groups order (each part's local order is the same order
    restricted to its class); params of different classes must not
    share memory either."""
    opt.parts = {c.cls: c for c in opt._parts}
    counters = {id(c): 0 for c in opt._parts}
    opt._entries, opt._where, opt._tid_map = [], [], {}
    opt._global_of = {id(c): [] for c in opt._parts}
    for g in opt.param_groups:
        for p in g["params"]:
            c = opt.parts[opt._class_of[id(p)]]
            lt = counters[id(c)]
            counters[id(c)] += 1
            opt._global_of[id(c)].append(len(opt._entries))
            opt._tid_map[id(p)] = len(opt._entries)
            opt._where.append((c, lt))
            opt._entries.append(c.entries[lt])
    if len(opt._parts) > 1:
        _strided.check_spans([e for c in opt._parts for e in _params.held_entries(c)])
    c0 = opt._parts[0]
    opt.rank, opt.world_size = c0.rank, c0.world_size
    opt._harr_key = None


def new_group(opt, g):
    """A param group checked, its entries made: (group, {class:
    [entries]}). Changes nothing."""
    if not isinstance(g, dict):
        raise ZoptError(Status.INVALID_ARGUMENT, "param group must be a dict")
    if "params" not in g:
        raise ZoptError(Status.INVALID_ARGUMENT, "param group without 'params'")
    ps = g["params"]
    if is_torch(ps) or isinstance(ps, np.ndarray):
        ps = [ps]
    elif isinstance(ps, set):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "params must be an ordered collection (a list), not a set")
    ps, names = _torch_compat.split_named(ps)  # model.named_parameters() (torch >= 2.5)
    gid = len(opt.param_groups)
    extra = {k: v for k, v in g.items() if k != "params"}
    if names is not None:
        extra["param_names"] = names
    for st in opt._steps.values():
        _hypers.check_rule_flags(st, extra, f"param group {gid}")
    hyp = opt.step_obj.hypers
    bad = [k for k in _hypers.slots(extra, hyp)
           if k not in hyp and k not in _hypers.rule_only_keys(opt.step_obj)]
    if bad:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"param group {gid}: {opt._who()} no hyperparameter "
                        f"{', '.join(sorted(set(bad)))}")
    group = dict(opt.defaults)
    group.update(extra)
    group = _hypers.complete_group(opt.step_obj, group)
    _hypers.slots(group, hyp)  # validates (betas, bias_correction)
    for st in opt._steps.values():  # with the optimizer's defaults (momentum=0)
        _hypers.check_rule_flags(st, group, f"param group {gid}")
    if opt._mapped:
        pol = opt._keep32
        if pol is not None and pol.names and names is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"param group {gid}: the precision policy keeps the params named "
                            f"{', '.join(pol.names)} at 32-bit moments, but this group's params "
                            "have no names: give (name, param) pairs (model.named_parameters())")
        classes = [_classes.classify(opt._steps, gid, i, p, names[i] if names else None, pol,
                                     opt._gpu_split) for i, p in enumerate(ps)]
    else:
        classes = [next(iter(opt._steps))] * len(ps)
    seen = {id(e.param) for c in opt._parts for e in c.entries}
    new, params = {}, []
    for i, (p, cls) in enumerate(zip(ps, classes)):
        e = _params.make_entry(opt._steps[cls], gid, i, p)
        if id(e.param) in seen:
            raise ZoptValueError(f"{e.name} appears twice in the optimizer's params "
                                 "(as torch.optim: some parameters appear in more than "
                                 "one parameter group)")
        seen.add(id(e.param))
        new.setdefault(cls, []).append(e)
        params.append(e.param)
    group["params"] = params
    if opt.step_obj.gpu:
        group = _gpu.GpuGroup(opt, group)
    return group, new


@contextlib.contextmanager
def gpu_split(opt, groups):
    """The GPU fraction (``opt._gpu_fraction``): ``opt._gpu_split`` over the
    elements of every param of ``groups`` (the constructor's) while they
    are added; yields them with their params listed (an iterator is read
    once, here). What new_group refuses is left to it. Afterwards the
    router sends every param to the offloaded class (add_param_group's:
    their gradients arrive first)."""
    if opt._gpu_fraction is None:
        yield groups
        return
    out, total = [], 0
    for g in groups:
        if isinstance(g, dict) and "params" in g:
            ps = g["params"]
            if is_torch(ps) or isinstance(ps, np.ndarray):
                ps = [ps]
            elif not isinstance(ps, (list, tuple, set)):
                ps = list(ps)
                g = dict(g, params=ps)
            if not isinstance(ps, set):
                try:
                    items = _torch_compat.split_named(list(ps))[0]
                except ValueError:  # new_group says so
                    items = []
                for p in items:
                    try:
                        x = _params.split_item(p)[0]
                    except ZoptError:
                        continue
                    total += int(x.numel()) if is_torch(x) else int(getattr(x, "size", 0))
        out.append(g)
    opt._gpu_split = _placement.GpuSplit(opt._gpu_fraction, total)
    try:
        yield out
    finally:
        opt._gpu_split.closed = True


def check_keep32_names(opt):
    """A precision-policy name pattern that matches no param of the optimizer
    is most likely a typo that leaves an embedding at narrow moments: warned
    (not refused: add_param_group may bring the param later)."""
    pol = opt._keep32
    if pol is None or not pol.names:
        return
    names = [n for g in opt.param_groups for n in g.get("param_names", ())]
    for pat in pol.names:
        if not any(name_matches(n, pat) for n in names):
            _warnings.warn_user(f"keep32 names: the pattern {pat!r} matches no param name "
                                "of this optimizer; the params it was meant for (e.g. "
                                "embeddings) get the narrow moments. Names are those of "
                                "model.named_parameters(), e.g. 'embed.weight' or '*embed*'")


def append_group(opt, group, new):
    opt.param_groups.append(group)
    for cls, es in new.items():
        part_of(opt, cls).entries.extend(es)
        for e in es:
            opt._class_of[id(e.param)] = cls


def add_group(opt, param_group):
    """``add_param_group`` after construction: the group and its tensors
    added to every class's native optimizer, keeping every state (the new
    group's params start fresh); a new class gets its part, with the
    others' seed and loss scaler state; all of it undone if one fails.
    The other groups' edits not pushed yet are checked first and pushed
    once it has succeeded: a refusal changes nothing."""
    opt._pushed.check_all(opt.param_groups, opt._parts, opt._steps.values(), dry=True)
    group, new = new_group(opt, param_group)
    n_groups, old_parts = len(opt.param_groups), list(opt._parts)
    sizes = {id(c): (len(c.entries), len(c.grad_flats), len(c.acc_hooks),
                     set(c.excluded)) for c in old_parts}
    for c in old_parts:
        c.prepare()
    append_group(opt, group, new)
    created = [c for c in opt._parts if c not in old_parts]  # classes seen first now
    undo = {}  # id(part) -> its snapshot before zopt._rebuild.grow, or None
    try:
        for c in old_parts:  # each keeps its states; an empty group where it has none
            n0 = sizes[id(c)][0]
            es = c.entries[n0:]
            register(c, es)
            _rebuild.grow(c, 1, list(range(n0, len(c.entries))), undo)
            _grads.add_acc_hooks(c, es)
        for c in created:  # the others' seed (at its creation) and scaler state
            extend(c, c.entries)
            if c.step.loss_scaled:
                scale, good, _ = old_parts[0].scaler_state()
                c.set_scaler_state(scale, good)
            _grads.add_acc_hooks(c, c.entries)
        route(opt)
    except BaseException:
        for c in created:
            c.free()
            opt._parts.remove(c)
        grown = [c for c in old_parts if id(c) in undo]
        # the states of the grown native optimizers, before their registrations go
        snaps = {id(c): undo[id(c)] if undo[id(c)] is not None else _rebuild.snapshot(c)
                 for c in grown}
        del opt.param_groups[n_groups:]
        for c in old_parts:
            n_ent, n_fl, n_hooks, ex = sizes[id(c)]
            for _, h in c.acc_hooks[n_hooks:]:
                h.remove()
            del c.acc_hooks[n_hooks:]
            del c.entries[n_ent:]
            del c.grad_flats[n_fl:]
            c.excluded = ex
        for c in grown:  # (the rebuild imports the groups' edits not pushed yet)
            _rebuild.rebuild(c, snaps[id(c)])
            opt._pushed.repush(c)
        for es in new.values():
            for e in es:
                opt._class_of.pop(id(e.param), None)
        route(opt)
        raise
    opt._pushed.added(opt.param_groups)
    opt._push_hypers()  # the other groups' edits since the last step

"""Checkpoints of a zopt.Optimizer: torch's ``state_dict()`` /
``load_state_dict()`` layout over every parameter class, and the runtime's
checkpoint files (``save()`` / ``load()``; the format: docs/CHECKPOINT.md).

The user-facing semantics (what the dicts hold, rule changes, the master
and the model agreeing after a load) are docs/USAGE.md's, sections 4 and
"Checkpoints". Everything goes through the runtime's state in memory
(zopt._rebuild): ``state_dict()`` reads an exported image, and
``load_state_dict()`` checks the whole state_dict in Python, then gives
each part's states to one staged import (no file). The functions named
``part_*`` work on one part (a parameter class, zopt._part.Part); the
others on the optimizer, over its parts: a failed load of one part puts
the parts loaded before it back.
"""
from __future__ import annotations

import ctypes
import os
import struct

import numpy as np

from . import _ckpt, _frozen, _hypers, _lib, _params, _rebuild, _state
from ._collective import collective_errors
from ._dtypes import (KIND_OF_KEY, NP_DTYPES, TORCH_KEY, f32_of_bits, remainder_join,
                      remainder_split, torch)
from ._lib import HYPER_BY_NAME, DType, StateKind, Status, ZoptError, check
from ._native import scaler_config
from ._warnings import warn_user


class MasterWeightsWarning(UserWarning):
    """``load_state_dict()`` / ``load()`` of an optimizer state with a
    master replaced params whose values disagreed with it (the optimizer
    checkpoint's master weights won over the model's current ones)."""


def warn_master_replaced(what, changed, total):
    warn_user(
        f"zopt: {what}: the optimizer state's master weights disagree with the model's "
        f"current weights in {changed} of {total} params; those params now hold the "
        "optimizer checkpoint's master weights (rounded), replacing the model's values. "
        "To keep the model's weights instead, load them after the optimizer state "
        "(model.load_state_dict after opt.load_state_dict): the master is then made "
        "again from them.", MasterWeightsWarning)


# ---- state_dict ---------------------------------------------------------------------
# a q8 moment's per-block absmax (abi.h "q8 moments"): not a torch key
Q8_ABSMAX = (StateKind.EXP_AVG_ABSMAX, StateKind.EXP_AVG_SQ_ABSMAX)


def part_states(c):
    """({tensor: {'step': ..., key: tensor}} of the tensors that stepped,
    the snapshot they come from) of part c: the states of contiguous
    params are views of the runtime's export (one buffer, freed with the
    last of them), the others copies strided like their params."""
    snap = _rebuild.snapshot(c)
    s = c.step
    state = {}
    for t, e in enumerate(c.entries):
        if snap["steps"][t] == 0:
            m = _restarted_master(c, t, snap)
            if m is not None:
                state[t] = m
            continue
        d = {"step": torch.tensor(float(snap["steps"][t])) if torch is not None
             else snap["steps"][t]}
        for k in snap["kinds"]:
            if (k, t) not in snap["data"] or k == StateKind.PARAM or k in Q8_ABSMAX:
                continue
            if s.state_dtype(k) == DType.Q8:
                # a q8 moment (abi.h "q8 moments"): torch's layout holds the
                # f32 moment, decoded by the runtime (codes x block absmax;
                # a collective gather at world size > 1, as the export)
                d[TORCH_KEY[k]] = _state.user_tensor(e, c.read_f32(t, k), DType.F32)
                continue
            if k == StateKind.MASTER and s.remainder_master:
                # torch's layout holds the whole f32 master: rebuilt from
                # the param (its high half) and the remainder
                hi = _params.current_bits(c, t, snap["data"])
                d["master"] = _state.user_tensor(
                    e, remainder_join(hi, snap["data"][(k, t)]), DType.F32)
                continue
            d[TORCH_KEY[k]] = _state.user_tensor(e, snap["data"][(k, t)],
                                                 s.state_dtype(k), share=True)
        state[t] = d
    return state, snap


def _restarted_master(c, t, snap):
    """SGD's momentum restart (zopt._hypers: counts 0, so that the buffer
    starts as buf = g) leaves a param that stepped with its count 0 but its
    f32 master: exported as torch's SGD state of a param without a buffer
    ({'momentum_buffer': None}), with the master, when the master holds
    more than the param (else nothing is lost: the master is made from it)."""
    s = c.step
    if not s.has_master or not _hypers.momentum_buffered(s) \
            or (StateKind.MASTER, t) not in snap["data"] or s.remainder_master:
        return None
    e = c.entries[t]
    m = f32_of_bits(snap["data"][(StateKind.MASTER, t)], DType.F32)
    if np.array_equal(m, f32_of_bits(_params.current_bits(c, t, snap["data"]), s.param_dtype)):
        return None
    z = torch.tensor(0.0) if torch is not None else 0
    return {"step": z, "master": _state.user_tensor(e, m, DType.F32), "momentum_buffer": None}


def state_dict(opt):
    """torch's layout over every class (global indices in param_groups
    order); collective at world size > 1."""
    opt._prepare()
    opt._push_hypers()
    with collective_errors(opt, "state_dict"):
        got = [part_states(c) for c in opt._parts]
    state = {}
    for c, (st, _) in zip(opt._parts, got):
        glob = opt._global_of[id(c)]
        for lt, d in st.items():
            state[glob[lt]] = d
    s = opt.step_obj
    groups, start = [], 0
    for gid, g in enumerate(opt.param_groups):
        if _hypers.momentum_buffered(s) and opt._pushed.fresh[gid] \
                and _hypers.as_number(g.get("momentum")) == 0:
            # stepped at momentum 0 only: torch's SGD holds no buffer (the
            # runtime's is the last gradient); loaded, it starts afresh
            for pid in range(start, start + len(g["params"])):
                if pid in state:
                    state[pid]["momentum_buffer"] = None
        packed = {k: (tuple(v) if isinstance(v, tuple) else v)
                  for k, v in g.items() if k != "params"}
        if s.adam_like:
            packed.setdefault("amsgrad", StateKind.MAX_EXP_AVG_SQ in s.state_flags)
        nest = s.nesterov if "momentum" in s.hypers else None
        if nest is not None:  # torch.optim.SGD reads a missing key as False
            packed.setdefault("nesterov", nest)
        if s.plain_sgd:  # torch.optim.SGD's keys of its momentum-0 rule
            for k, v in (("momentum", 0.0), ("dampening", 0.0), ("nesterov", False)):
                packed.setdefault(k, v)
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(packed)
    snaps = [snap for _, snap in got]
    names = [[TORCH_KEY[k] for k in snap["kinds"] if k != StateKind.PARAM and k not in Q8_ABSMAX]
             for snap in snaps]
    kinds = []
    for ks in names:
        kinds += [k for k in ks if k not in kinds]
    scale, good, cfg = snaps[0]["scaler"]
    z = {
        "format": "zopt-torch-state-dict-1",
        "step_name": "+".join(c.step.name for c in opt._parts),
        "states": kinds,
        "group_steps": [max(snap["group_steps"][g] for snap in snaps)
                        for g in range(len(groups))],
        "loss_scaler": dict(scale=scale, good_steps=good, **cfg),
        "seed": snaps[0]["seed"],
        "world_size": opt.world_size,
    }
    if opt._mapped:  # a step per class: what each class holds
        z["classes"] = [{"class": c.cls, "step_name": c.step.name, "states": ks,
                         "group_steps": snap["group_steps"],
                         "params": list(opt._global_of[id(c)])}
                        for c, ks, snap in zip(opt._parts, names, snaps)]
    return {"state": dict(sorted(state.items())), "param_groups": groups, "zopt": z}


# ---- load_state_dict -----------------------------------------------------------------
def load_state_dict(opt, sd, allow_rule_change):
    """Loads torch's layout into every class; nothing changes if anything is
    refused."""
    if sd.get("format") == "zopt-state-dict-1":  # the first binding's
        if opt._mapped:
            raise ZoptError(Status.CHECKPOINT, "the first binding's state_dict format holds "
                            "one class's runtime checkpoint; load it into that class's "
                            "own optimizer")
        opt._prepare()
        with collective_errors(opt, "load_state_dict"):
            c = opt._parts[0]
            pending = _load_legacy(c, sd)
            _after_file_loads(opt)
            finish_master_loads([(c, pending)], "load_state_dict")
        return
    if "state" not in sd or "param_groups" not in sd:
        raise ZoptError(Status.CHECKPOINT,
                        "not an optimizer state_dict (no 'state' / 'param_groups')")
    saved = sd["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ZoptError(Status.CHECKPOINT,
                        f"state_dict has {len(saved)} param groups, the optimizer "
                        f"{len(opt.param_groups)}")
    for gid, (a, b) in enumerate(zip(saved, opt.param_groups)):
        if len(a["params"]) != len(b["params"]):
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict's param group {gid} has {len(a['params'])} "
                            f"params, the optimizer's {len(b['params'])}")
    listed = {pid for a in saved for pid in a["params"]}
    for pid in sd["state"]:
        if pid not in listed:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict has state for param {pid!r}, which no group lists")
    subs = _split(opt, sd) if opt._mapped else [sd]
    opt._prepare()
    with collective_errors(opt, "load_state_dict"):
        # every part's share checked before any changes
        plans = [part_plan_state_dict(c, sub, opt.param_groups, allow_rule_change)
                 for c, sub in zip(opt._parts, subs)]
        _apply_to_parts(opt, part_apply_plan, plans)
        opt._set_groups(plans[0]["groups"])
        opt._pushed.loaded(opt.param_groups, opt._parts)
        finish_master_loads([(c, p["pending"]) for c, p in zip(opt._parts, plans)],
                            "load_state_dict")


def _split(opt, sd):
    """A state_dict over every class -> one per part (its params' entries,
    its own group step counts where the state_dict has them)."""
    saved = sd["param_groups"]
    z = sd.get("zopt", {}) or {}
    info = {ci.get("class"): ci for ci in z.get("classes", [])}
    subs = []
    for c in opt._parts:
        groups, state = [], {}
        for a, g in zip(saved, opt.param_groups):
            pids = [pid for pid, p in zip(a["params"], g["params"])
                    if opt._class_of[id(p)] == c.cls]
            groups.append(dict({k: v for k, v in a.items() if k != "params"}, params=pids))
            for pid in pids:
                if pid in sd["state"]:
                    state[pid] = sd["state"][pid]
        subz = {k: v for k, v in z.items() if k not in ("classes", "group_steps")}
        if c.cls in info:
            subz["group_steps"] = info[c.cls].get("group_steps")
            subz["step_name"] = info[c.cls].get("step_name", z.get("step_name"))
        elif not info and "group_steps" in z:
            subz["group_steps"] = z["group_steps"]
        subs.append(dict(state=state, param_groups=groups, zopt=subz))
    return subs


def _apply_to_parts(opt, fn, args):
    """fn(part, arg) for every part in order; if one fails, the parts
    done before it are restored from snapshots taken first (one part:
    its own load changes nothing when it fails)."""
    parts = opt._parts
    snaps = [_rebuild.snapshot(c) for c in parts] if len(parts) > 1 else None
    done = []
    try:
        for c, a in zip(parts, args):
            fn(c, a)
            done.append(c)
    except BaseException:
        for c in done:
            _rebuild.restore(c, snaps[parts.index(c)])
        raise


def part_plan_state_dict(c, sd, groups, allow_rule_change=False):
    """What loading torch's layout (one part's share) into part c is,
    checked, without changing it: dict(snap: the states, counts, scaler and
    seed as zopt._rebuild.restore takes them; groups: the new param groups;
    pending: the params' update after the load, for finish_master_loads;
    dropped: states of GPU steps' frozen params, not loaded)."""
    s = c.step
    saved = sd["param_groups"]
    counts = [0] * len(groups)
    for e in c.entries:
        counts[e.group] += 1
    if len(saved) != len(groups):
        raise ZoptError(Status.CHECKPOINT,
                        f"state_dict has {len(saved)} param groups, the optimizer "
                        f"{len(groups)}")
    for gid, (a, n) in enumerate(zip(saved, counts)):
        if len(a["params"]) != n:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict's param group {gid} has {len(a['params'])} "
                            f"params, the optimizer's {n}")
    id_map = {}
    t = 0
    for a in saved:
        for pid in a["params"]:
            id_map[pid] = t
            t += 1
    # What the state_dict's rule is.
    problems = []
    new_groups = []
    for gid, g in enumerate(saved):
        ng = {k: v for k, v in g.items() if k != "params"}
        for key in list(ng):
            slot_names = ["beta1", "beta2"] if key == "betas" else [key]
            if key in HYPER_BY_NAME or key == "betas":
                missing = [n for n in slot_names if n not in s.hypers]
                if missing:
                    # torch's SGD with momentum 0 into plain SGD: the
                    # same rule (dampening is unused without momentum)
                    if not (s.plain_sgd and key in ("momentum", "dampening")
                            and not ng.get("momentum")):
                        problems.append(f"group {gid} has the hyperparameter '{key}'")
                    del ng[key]
        ng["params"] = groups[gid]["params"]
        merged = dict(groups[gid])
        merged.update(ng)
        # torch's rule flags (amsgrad, nesterov, decoupled_weight_decay, a
        # momentum 0 / not 0) against the step's rule: zopt._hypers
        for key, text in _hypers.rule_flag_problems(s, merged):
            problems.append(f"group {gid} has {text}")
            if key in groups[gid]:  # allowed: the step's rule, as the group has it now
                merged[key] = groups[gid][key]
            else:
                merged.pop(key, None)
        if _hypers.momentum_buffered(s) and _hypers.as_number(merged.get("momentum")) == 0 \
                and any((sd["state"].get(pid) or {}).get("momentum_buffer") is not None
                        for pid in g["params"]):
            problems.append(_hypers.held_buffers_text(f"group {gid}", s))
            merged["momentum"] = groups[gid]["momentum"]
        new_groups.append(_hypers.complete_group(s, merged))
    # States by torch's keys. A key whose value is None (torch's SGD:
    # momentum_buffer None for momentum 0, or a param never stepped with
    # momentum) is a state not made yet: neither extra nor lacking; the
    # param starts it afresh, as torch would.
    present, named = set(), set()
    for pid, st in sd["state"].items():
        if pid not in id_map:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict has state for param {pid!r}, which no group lists")
        for key, v in st.items():
            if key == "step":
                continue
            k = KIND_OF_KEY.get(key)
            if k is None:
                if v is not None:
                    problems.append(f"it has the state '{key}'")
            elif k != StateKind.PARAM:
                named.add(k)
                if v is not None:
                    present.add(k)
    mine = set(s.owned_states) - set(Q8_ABSMAX)  # (a q8 absmax: part of its moment)
    extra = present - mine
    lacking = (mine - named - {StateKind.MASTER}) if sd["state"] else set()
    for k in sorted(extra):
        problems.append(f"it has the state '{TORCH_KEY[k]}'")
    for k in sorted(lacking):
        problems.append(f"it lacks the state '{TORCH_KEY[k]}'")
    if problems and not allow_rule_change:
        z = sd.get("zopt", {})
        who = f"step '{z['step_name']}'" if "step_name" in z else "another optimizer"
        raise ZoptError(Status.CHECKPOINT,
                        f"the state_dict was written by {who} with another update rule "
                        f"than step '{s.name}': " + "; ".join(dict.fromkeys(problems))
                        + ". Loading it would change the math; pass "
                        "allow_rule_change=True to load it anyway (missing states "
                        "start at zero, extra ones are dropped)")
    # The snapshot to load.
    # every state the step has (a q8 moment: its f32 values, which the
    # runtime encodes, codes and absmax)
    kinds = [k for k in s.owned_states if k not in Q8_ABSMAX]
    if s.zero3:
        kinds.append(StateKind.PARAM)
    data = {}
    steps = [0] * len(c.entries)
    dropped = []  # GPU steps: states of params left out (frozen)
    for pid, st in sd["state"].items():
        t = id_map[pid]
        e = c.entries[t]
        if t in c.excluded:
            if any(v is not None for v in st.values()):
                dropped.append(e.name)
            continue
        steps[t] = loaded_step(s, e, st, kinds)
        for key, v in st.items():
            k = KIND_OF_KEY.get(key)
            if k is None or v is None or k not in kinds or not e.numel:
                continue
            flat, dt = _state.flat_from_user(e, v, key)
            data[(k, t)] = flat
    if s.zero3:  # the held params: the model's params as they are now
        if c.released:
            c.gather_params(sorted(c.released))
        for t, e in enumerate(c.entries):
            if e.numel:
                data[(StateKind.PARAM, t)] = _params.memory_order(e, e.param) \
                    if e.torch else np.ascontiguousarray(e.param).reshape(-1)
    # The params that are not a rounding of their loaded master: set to
    # round(master) after the load (ZeRO-3: the held params, loaded so).
    mtids = sorted(t for (k, t) in data if k == StateKind.MASTER)
    if s.remainder_master:
        fixes = _split_remainder_masters(c, data, mtids)
    else:
        fixes = _params.master_sync(
            c, {t: (data[(StateKind.MASTER, t)], NP_DTYPES[data[(StateKind.MASTER, t)].dtype])
                for t in mtids},
            params={t: data[(StateKind.PARAM, t)] for t in mtids} if s.zero3 else None)
    if s.zero3:
        for t, b in fixes.items():
            data[(StateKind.PARAM, t)] = b
    z = sd.get("zopt", {})
    gsteps = z.get("group_steps")
    if not gsteps or len(gsteps) != len(groups):
        gsteps = [max([steps[t] for t, e in enumerate(c.entries) if e.group == g] or [0])
                  for g in range(len(groups))]
    scale, good, cfg = c.scaler_state()
    if "loss_scaler" in z:
        ls = dict(z["loss_scaler"])
        scale, good = float(ls.pop("scale")), int(ls.pop("good_steps"))
        cfg = scaler_config(**ls)
    seed = int(z["seed"]) if "seed" in z else c.get_seed()
    snap = dict(kinds=kinds, data=data, steps=steps, group_steps=gsteps,
                scaler=(scale, good, cfg), seed=seed)
    return dict(snap=snap, groups=new_groups, pending=(fixes, mtids, set(fixes)),
                dropped=dropped)


def _split_remainder_masters(c, data, mtids):
    """A remainder step (docs/NUMERICS.md section 9) loading torch's
    layout: each master (an f32 tensor, or narrower: widened exactly) is
    split by the runtime into the param's bits (the master rounded to
    nearest, ties away) and the int16 remainder the step stores, in
    ``data`` in its place. Returns the params whose bits change, {t: bits}
    (ZeRO-3: the held params of ``data``)."""
    fixes = {}
    for t in mtids:
        m = data[(StateKind.MASTER, t)]
        hi, rem = remainder_split(f32_of_bits(m, NP_DTYPES[m.dtype]))
        data[(StateKind.MASTER, t)] = rem
        cur = _params.current_bits(c, t, data)
        if not np.array_equal(np.asarray(cur).view(np.uint16), hi):
            fixes[t] = hi
    return fixes


def part_apply_plan(c, plan):
    """A checked plan (part_plan_state_dict) into part c: one staged import
    (every tensor its own step count); nothing changes if the runtime
    refuses it."""
    s = c.step
    _rebuild.restore(c, plan["snap"], groups=plan["groups"], what="load_state_dict")
    c.state_epoch += 1
    dropped = plan["dropped"]
    if dropped:
        warn_user(
            f"zopt: load_state_dict: the state_dict has states for {len(dropped)} "
            f"param(s) that step '{s.name}' (updated on the GPU) left out of the "
            "optimizer because they did not require grad when it was built: "
            f"{', '.join(dropped[:4])}{', ...' if len(dropped) > 4 else ''}. They were "
            "not loaded: a param left out has no states, and starts afresh (zero "
            "states, step 0) if it is unfrozen and gets a gradient. To keep them, "
            "set requires_grad=True on those params before building the optimizer",
            UserWarning)


def loaded_step(s, e, st, kinds):
    """The step count of a param from its state_dict entry: 'step' (an
    int, a float or a one-element tensor, as torch 1.13 and 2.x store
    it). torch's SGD stores none: a param with a momentum buffer has
    stepped (count 1, so that the next step, t = 2, continues the buffer
    instead of starting it over with buf = g as at t = 1); one without
    (momentum_buffer None) starts afresh (0). Adam's bias correction
    needs the true count: its moments without a 'step' are refused."""
    stv = st.get("step")
    if stv is not None:
        try:
            return _state.step_value(stv, f"state_dict: {e.name}: 'step'")
        except ZoptError as err:
            raise ZoptError(Status.CHECKPOINT, err.message) from None
    held = [key for key, v in st.items()
            if v is not None and KIND_OF_KEY.get(key) in kinds]
    if not held:
        return 0
    if s.adam_like:
        raise ZoptError(Status.CHECKPOINT,
                        f"state_dict: {e.name} has {', '.join(held)} but no 'step': "
                        "Adam's bias correction needs the param's step count")
    return 1


# ---- the model and the master agree after a load ------------------------------------
def loaded_master_pending(c):
    """After the runtime loaded a checkpoint: (fixes, tensors with a
    master, tensors whose model params change) for finish_master_loads.
    ZeRO-3: the held params are fixed where they disagree with the master;
    the model's params (those not released), which the next gather
    replaces, are compared too."""
    s = c.step
    mdt = s.state_dtype(StateKind.MASTER)
    # A remainder master's high half is the param: they cannot disagree.
    if not s.has_master or mdt == DType.I16:
        return {}, [], set()
    tids = [t for t, e in enumerate(c.entries) if e.numel and t not in c.excluded]
    masters = {t: (c.read_raw(t, StateKind.MASTER), mdt) for t in tids}
    fixes = _params.master_sync(c, masters)
    changed = set(fixes)
    if s.zero3:
        shown = [t for t in tids if t not in c.released]
        changed |= set(_params.master_sync(
            c, {t: masters[t] for t in shown},
            params={t: _params.param_bits(c.entries[t]) for t in shown}))
    return fixes, tids, changed


def finish_master_loads(pending, what):
    """After every part loaded: round(master) into the params that
    disagreed with it, and one MasterWeightsWarning (at the user's line)
    if there were any."""
    changed = total = 0
    for c, (fixes, tids, ch) in pending:
        if not tids:
            continue
        _params.apply_master_sync(c, fixes, gather=tids)
        changed, total = changed + len(ch), total + len(tids)
    if changed:
        warn_master_replaced(what, changed, total)


# ---- runtime checkpoint files -----------------------------------------------------------
def part_path(path, cls, first):
    """The checkpoint file of class ``cls``: ``path`` for the first part,
    ``path.<cls>`` for the others."""
    path = os.fspath(path)
    return path if first else f"{path}.{cls}"


def checkpoint_files(opt, path):
    return {c.cls: part_path(path, c.cls, i == 0) for i, c in enumerate(opt._parts)}


def _linked_args(handles, files):
    """(what to keep alive, the parts' array, the paths' array) for
    zopt_optimizer_save_linked / _load_linked."""
    bufs = [ctypes.create_string_buffer(os.fspath(f).encode()) for f in files]
    kh, harr = _lib.c_array(ctypes.c_void_p, [h.value for h in handles])
    kp, parr = _lib.c_array(ctypes.c_void_p, [ctypes.addressof(b) for b in bufs])
    return (bufs, kh, kp), harr, parr


def save(opt, path):
    """One checkpoint: with several classes ONE linked save (one identity,
    one commit point: docs/CHECKPOINT.md "Linked saves"), so that a save
    that fails or dies part-way leaves the previous checkpoint of every
    class, or this one."""
    opt._prepare()
    opt._push_hypers()
    parts = opt._parts
    files = list(checkpoint_files(opt, path).values())
    with collective_errors(opt, "save"):
        if len(parts) == 1:
            c, f = parts[0], files[0]
            check(c.lib.zopt_optimizer_save(c.h, os.fspath(f).encode()), f"save({f})")
            return
        keep, harr, parr = _linked_args([c.h for c in parts], files)
        check(parts[0].lib.zopt_optimizer_save_linked(harr, len(parts), parr),
              f"save({os.fspath(path)})")
        del keep


def load(opt, path, allow_rule_change):
    files = checkpoint_files(opt, path)
    parts = opt._parts
    # Several classes: one linked load (the classes of one save, or none;
    # every class staged before any changes), unless a file needs
    # zopt._frozen.load_legacy (written before linked saves).
    linked = len(parts) > 1 and all(_frozen.legacy_groups(c, f) is None
                                    for c, f in zip(parts, files.values()))
    if opt._mapped:  # each file holds its class's tensors: checked before anything changes
        _check_files(opt, path, files, linked)
    opt._prepare()
    pending = []
    with collective_errors(opt, "load"):
        if linked:
            flags = _lib.LOAD_ALLOW_RULE_CHANGE if allow_rule_change else 0
            keep, harr, parr = _linked_args([c.handle() for c in parts], files.values())
            check(parts[0].lib.zopt_optimizer_load_linked(harr, len(parts), parr, flags),
                  f"load({os.fspath(path)})")
            del keep
            pending = [(c, _after_part_load(c)) for c in parts]
        else:
            _apply_to_parts(opt, lambda c, f: pending.append((c, part_load_file(
                c, f, allow_rule_change))), list(files.values()))
        _after_file_loads(opt)
        finish_master_loads(pending, "load")


def _check_files(opt, path, files, linked=False):
    for i, (c, f) in enumerate(zip(opt._parts, files.values())):
        if not os.path.exists(f):
            d, base = os.path.split(os.fspath(f))
            if linked and i > 0 and any(n.startswith(base + ".0-of-")
                                        for n in os.listdir(d or ".")):
                continue  # (a linked save that died before this rename: the runtime judges it)

            raise ZoptError(Status.IO, f"load({path}): class {c.cls!r} is read from {f}, "
                            "which does not exist (the files of this optimizer: "
                            + ", ".join(f"{k}: {v}" for k, v in files.items()) + ")")
        try:
            head = _ckpt.read_tensors(f)
        except (OSError, ValueError, struct.error) as e:
            raise ZoptError(Status.CHECKPOINT, f"load({path}): {f}: {e}") from None
        if head is None:
            continue  # another format: the runtime's loader judges it
        name, _, numels = head
        # (a GPU class's param left out, frozen when it was built: an empty
        # slot, as in its file; one left out on one side only: O1's refusal)
        mine = [0 if t in c.excluded else e.numel for t, e in enumerate(c.entries)]
        _frozen.check_file_slots(c, f)
        if numels != mine:
            raise ZoptError(
                Status.CHECKPOINT,
                f"load({path}): {f} holds {len(numels)} tensors of "
                f"{sum(numels)} elements (step '{name}'), but class {c.cls!r} has "
                f"{len(mine)} tensors of {sum(mine)} elements: it is not this "
                "class's checkpoint (another model, or another split into classes)")


def part_load_file(c, path, allow_rule_change=False, image=None):
    """The runtime's checkpoint file (or an ``image`` of one in memory,
    named ``path``) into part c (without the params' update: returns what
    it would be). A file saved with extra native groups (GPU steps'
    unfrozen params before the runtime's mask) loads through
    zopt._frozen.load_legacy."""
    flags = _lib.LOAD_ALLOW_RULE_CHANGE if allow_rule_change else 0
    legacy = _frozen.legacy_groups(c, path) if image is None else None
    if legacy is not None:
        c.handle()
        _frozen.load_legacy(c, path, flags, legacy)
    elif image is None:
        _frozen.check_file_slots(c, path)
        check(c.lib.zopt_optimizer_load_ex(c.handle(), os.fspath(path).encode(), flags),
              f"load({path})")
    else:
        c.import_image(image, flags, f"load({path})")
    return _after_part_load(c)


def _after_part_load(c):
    """Part c's binding state after the runtime loaded it; returns the
    params' update (loaded_master_pending)."""
    c.scaler_cfg = c.scaler_config_now()  # (for the native optimizers built later)
    c.seed_value = c.get_seed()
    _params.reset_watch(c)
    c.state_epoch += 1
    return loaded_master_pending(c)


def _after_file_loads(opt):
    """param_groups <- the hyperparameters the runtime loaded."""
    for gid in range(len(opt.param_groups)):
        opt._sync_group_from_c(gid)
    opt._pushed.loaded(opt.param_groups, opt._parts)


def _load_legacy(c, sd):
    blob = sd.get("checkpoint")
    if blob is None:
        raise ZoptError(Status.CHECKPOINT, "legacy zopt state_dict without its checkpoint")
    return part_load_file(c, "the state_dict's checkpoint",
                          image=np.frombuffer(bytes(blob), dtype=np.uint8))

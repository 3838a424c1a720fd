"""One optimizer over params of several dtypes: parameter classes stepped as
one (one global norm, one skip decision).

    classes = zopt.steps.adamw(clip=1.0, classes={"bf16": dict(master="f32"), "f32": {}})
    opt = zopt.Optimizer(classes, model.parameters(), lr=1e-3, weight_decay=0.01)

``zopt.Optimizer(step, ...)`` with ``step`` a mapping ``{dtype: Step or
step.so path}`` (keys: torch dtypes or "f32"/"bf16"/"f16") returns a
:class:`MixedOptimizer`. Each param goes to the class of its dtype (a dtype
without a class is an error naming the param and the classes). Each class
that has params is a *part*: a single-class ``zopt.Optimizer`` over that
class's params, built with every param group of the optimizer (empty where
a group has no param of the class), so group ids, hyperparameters,
schedulers and ``set_hyper`` are the same in every part. ``step()`` runs
``zopt_optimizer_step_linked`` over the parts: the sums of squares of all
parts' gradients make one global norm (clipping like
``torch.nn.utils.clip_grad_norm_`` over all params), one skip decision and
one loss-scaler update (docs/DISTRIBUTED.md, "linked steps"). The loss
scaler's configuration, the seed, the gradient divisor, the thread count,
the bucket size and the ranks (``process_group=`` / ``comm=``) go to every
part.

The parts run in the order bf16, f16, f32 (whatever the mapping's order),
so the norm's sum, and with it every result, does not depend on how the
mapping was written. Checkpoint files (``save``/``load``): the first part
writes ``path``, every other part ``path.<class>`` (``ckpt``,
``ckpt.f32``; at W ranks each is a set of rank files). Loading checks that
each file holds its class's tensors, loads every part and, if one fails,
puts the parts loaded before it back as they were.

Everything else is the single-class optimizer's behaviour, per part: params
without gradients left alone (per part ``set_active``), master refreshes on
writes into params, f32 gradients of bf16 params (``p.main_grad``), ZeRO-3
gather and release, ``state[p]`` (read and written through by the class's
part); ``state_dict()`` is torch's layout over all params (global indices in
param_groups order) both ways. ``load_state_dict()`` / ``load()`` of a state
with a master set params that disagree with their master to round(master),
as for one class, once every part has loaded, with one warning.
"""
from __future__ import annotations

import ctypes
import os
import struct
import time

from . import _ckpt, _lib, _torch_compat
from ._collective import collective_errors
from ._calls import exclusive as _exclusive, lock_of as _lock_of
from ._lib import DType, Status, ZoptError, check, lib, DTYPE_NAMES, STATE_NAMES
from ._strided import check_spans
from .optimizer import (Optimizer, Step, _StateView, _frozen, _groups_arg, _is_torch,
                        _maximize, _slots, _torch_dtypes, _warn_master_replaced, torch)
from .steps import dtype_name

import numpy as np

CLASS_ORDER = ("bf16", "f16", "f32")
_DT_OF = {"f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16}
_NAME_OF = {v: k for k, v in _DT_OF.items()}
_NP_CLASS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
             np.dtype(np.uint16): "bf16"}


def _class_key(k):
    try:
        return dtype_name(k, "step")
    except ZoptError:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"step mapping: key {k!r} is not a dtype; the keys name the "
                        "parameter classes: torch dtypes or 'f32', 'bf16', 'f16'") from None


def part_path(path, cls, first):
    """The checkpoint file of class ``cls``: ``path`` for the first part,
    ``path.<cls>`` for the others."""
    path = os.fspath(path)
    return path if first else f"{path}.{cls}"


class MixedOptimizer(Optimizer):
    """A ``zopt.Optimizer`` over params of several dtypes, one native
    optimizer (part) per class, stepped as one. Built by
    ``zopt.Optimizer(mapping, params, ...)`` (same keyword arguments); see
    the module's documentation. ``parts``: ``{class: single-class
    zopt.Optimizer}`` (for inspection: step through this optimizer)."""

    def __init__(self, step, params, *, lr=None, betas=None, eps=None,
                 weight_decay=None, momentum=None, dampening=None,
                 bias_correction=None, maximize=None, num_threads=None, loss_scaler=None,
                 seed=None, process_group=None, comm=None, grad_divisor=None,
                 bucket_elems=None, zero3_gather="step", grad_accumulation="hooks",
                 device_allocator=None, timeout=None):
        self._parts = []   # [(class, Optimizer)] in CLASS_ORDER
        self._h = None     # no native optimizer of its own
        self._closed = False
        self._own_comm = False
        self._comm = None
        self._lib = lib()
        steps = {}
        if not step:
            raise ZoptError(Status.INVALID_ARGUMENT, "step mapping is empty: give "
                            "{dtype: Step or path}, e.g. zopt.steps.adamw(classes=...)")
        for k, v in step.items():
            c = _class_key(k)
            if c in steps:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"step mapping: two keys name the class {c!r}")
            st = v if isinstance(v, Step) else Step(v)
            if st.param_dtype != _DT_OF[c]:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"step mapping: the step for class {c!r} ('{st.name}') has "
                                f"{DTYPE_NAMES[st.param_dtype]} params, not {c}")
            steps[c] = st
        self.steps = {c: steps[c] for c in CLASS_ORDER if c in steps}
        first_c, first = next(iter(self.steps.items()))
        for c, st in self.steps.items():
            what = None
            if set(st.hypers) != set(first.hypers):
                what = (f"hyperparameter slots ({', '.join(st.hypers)} vs "
                        f"{', '.join(first.hypers)}): the classes share param_groups")
            elif st.clipped != first.clipped or st.max_norm != first.max_norm:
                what = (f"clipping (max_norm {st.max_norm} vs {first.max_norm}): the "
                        "classes share one global norm")
            elif st.loss_scaled != first.loss_scaled:
                what = ("loss scaling: the classes share one loss scaler and skip "
                        "decision")
            elif st.gpu:
                what = ("placement: linked steps run CPU-updated steps (all-CPU or "
                        "offloaded); this step updates on the GPU")
            if what is not None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"step mapping: class {c!r} ('{st.name}') and class "
                                f"{first_c!r} ('{first.name}') differ in {what}")
        self.step_obj = first  # the shared hyperparameter slots
        self._num_threads = num_threads
        self._bucket_elems = bucket_elems
        self._grad_divisor = grad_divisor
        self._seed = seed
        self._scaler_cfg = None
        self._zero3_gather = zero3_gather
        self._grad_accumulation = grad_accumulation
        self._device_allocator = device_allocator  # GPU steps only: unused by linked parts
        self._metrics_hooks = []
        self.last_metrics = None
        self.last_result = None
        self.last_grad_norm = float("nan")
        self.last_skipped = False
        self.last_loss_scale = 1.0
        self.last_loss = None
        self.steps_taken = 0
        if zero3_gather not in ("step", "manual", "hooks"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"zero3_gather={zero3_gather!r}: 'step', 'manual' or 'hooks'")
        if grad_accumulation not in ("hooks", "manual"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"grad_accumulation={grad_accumulation!r}: 'hooks' or 'manual'")
        from .comm import seconds
        timeout = seconds(timeout)
        if process_group is not None and comm is not None:
            raise ZoptError(Status.INVALID_ARGUMENT, "give process_group= or comm=, not both")
        if loss_scaler is not None:
            self._scaler_cfg = self._scaler_config(**loss_scaler)
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  momentum=momentum, dampening=dampening, bias_correction=bias_correction,
                  maximize=maximize)
        self._given = {k: v for k, v in kw.items() if v is not None}
        bad = [k for k in _slots(self._given, first.hypers) if k not in first.hypers]
        if bad:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"the steps have no hyperparameter {', '.join(sorted(set(bad)))} "
                            f"(their slots: {', '.join(first.hypers)})")
        self.defaults = self._complete_group(self._given)
        _torch_compat.init_base(self)
        self.param_groups = []
        self._items = []        # per group: the user's entries (tensors or pairs)
        self._class_of = {}     # id(param) -> class
        self._state_view = _StateView(self)
        self._res = _lib.StepResult()
        self._res_ref = ctypes.byref(self._res)
        self._harr_key = None
        groups = _groups_arg(params)
        if not groups:
            raise ZoptError(Status.INVALID_ARGUMENT, "optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        try:
            for g in groups:
                self._add_group_py(g)
            from ._ranks import make_comm
            self._comm, self._own_comm = make_comm(process_group, comm, timeout)
            for c in self.steps:
                if any(self._class_of[id(p)] == c for g in self.param_groups
                       for p in g["params"]):
                    self._parts.append((c, self._new_part(c)))
            self._after_parts_changed()
        except BaseException:
            self._free()
            raise

    # ---- groups, classes and parts -----------------------------------------------
    def _classify(self, gid, i, p):
        """The class of a user entry (a torch param or a (param, grad) pair)."""
        name = f"param_groups[{gid}]['params'][{i}]"
        if isinstance(p, (tuple, list)):
            if len(p) != 2:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                "a tensor entry must be a param or a (param, grad) pair")
            param = p[0]
        elif _is_torch(p):
            param = p
        elif isinstance(p, np.ndarray):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "numpy params need their gradient: pass (param, grad) pairs")
        else:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"unsupported parameter type {type(p).__name__}")
        if _is_torch(param):
            name += f" (shape {tuple(param.shape)}, {str(param.dtype).replace('torch.', '')})"
            dt = _torch_dtypes().get(param.dtype)
            c = _NAME_OF.get(dt)
        elif isinstance(param, np.ndarray):
            name += f" (numpy {param.dtype}, shape {param.shape})"
            c = _NP_CLASS.get(param.dtype)
        else:
            raise ZoptError(Status.INVALID_ARGUMENT, f"{name}: expected a numpy array or "
                            f"torch tensor, got {type(param).__name__}")
        if c is None or c not in self.steps:
            have = ", ".join(f"{k} ('{s.name}')" for k, s in self.steps.items())
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{name}: no parameter class for its dtype"
                            + (f" {c}" if c else "") + f"; the step mapping's classes: {have}")
        return param, c

    def _add_group_py(self, g):
        """Validates a param group and appends it (all classes); returns the
        classes it has params of."""
        if not isinstance(g, dict):
            raise ZoptError(Status.INVALID_ARGUMENT, "param group must be a dict")
        if "params" not in g:
            raise ZoptError(Status.INVALID_ARGUMENT, "param group without 'params'")
        ps = g["params"]
        if _is_torch(ps) or isinstance(ps, np.ndarray):
            ps = [ps]
        elif isinstance(ps, set):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "params must be an ordered collection (a list), not a set")
        ps, names = _torch_compat.split_named(ps)  # model.named_parameters() (torch >= 2.5)
        gid = len(self.param_groups)
        extra = {k: v for k, v in g.items() if k != "params"}
        if names is not None:
            extra["param_names"] = names
        hyp = self.step_obj.hypers
        bad = [k for k in _slots(extra, hyp) if k not in hyp]
        if bad:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"param group {gid}: the steps have no hyperparameter "
                            f"{', '.join(sorted(set(bad)))}")
        group = dict(self.defaults)
        group.update(extra)
        group = self._complete_group(group)
        _slots(group, hyp)  # validates (betas, bias_correction)
        params, classes, seen = [], {}, set()
        for i, p in enumerate(ps):
            param, c = self._classify(gid, i, p)
            if id(param) in self._class_of or id(param) in seen:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"param_groups[{gid}]['params'][{i}] appears twice in the "
                                "optimizer's params")
            seen.add(id(param))
            params.append(param)
            classes[id(param)] = c
        group["params"] = params
        self.param_groups.append(group)
        self._items.append(ps)
        self._class_of.update(classes)
        return set(classes.values())

    def _part_groups(self, c):
        """Every group, with only class c's entries; and their global
        positions (for the names in error messages)."""
        groups, names = [], {}
        for gid, (g, items) in enumerate(zip(self.param_groups, self._items)):
            pos = [i for i, p in enumerate(g["params"]) if self._class_of[id(p)] == c]
            sub = {k: v for k, v in g.items() if k != "params"}
            sub["params"] = [items[i] for i in pos]
            groups.append(sub)
            names[gid] = pos
        return groups, names

    def _part_kwargs(self):
        kw = dict(self._given)
        kw.update(num_threads=self._num_threads, loss_scaler=self._scaler_cfg,
                  seed=self._seed, comm=self._comm, grad_divisor=self._grad_divisor,
                  bucket_elems=self._bucket_elems, zero3_gather=self._zero3_gather,
                  grad_accumulation=self._grad_accumulation,
                  device_allocator=self._device_allocator)
        return kw

    def _new_part(self, c):
        """A single-class optimizer over class c's params (collective at
        world size > 1, like any optimizer's construction)."""
        groups, names = self._part_groups(c)
        o = Optimizer.__new__(Optimizer, self.steps[c])
        o._index_names = names
        o.__init__(self.steps[c], groups, **self._part_kwargs())
        return o

    def _after_parts_changed(self):
        """The global tables: tensor index -> (part, local index), in
        param_groups order (each part's local order is the same order
        restricted to its class)."""
        self._plist = [o for _, o in self._parts]
        self.parts = dict(self._parts)
        by_c = {c: o for c, o in self._parts}
        counters = {c: 0 for c in by_c}
        self._entries, self._where, self._tid_map = [], [], {}
        self._global_of = {id(o): [] for o in self._plist}
        for g in self.param_groups:
            for p in g["params"]:
                c = self._class_of[id(p)]
                o = by_c[c]
                lt = counters[c]
                counters[c] += 1
                e = o._entries[lt]
                assert e.param is p
                self._global_of[id(o)].append(len(self._entries))
                self._tid_map[id(p)] = len(self._entries)
                self._where.append((o, lt))
                self._entries.append(e)
        self._check_overlaps()
        o0 = self._plist[0]
        self.rank, self.world_size = o0.rank, o0.world_size
        self._on_cuda = any(o._on_cuda for o in self._plist)
        self._group_params = [tuple(g["params"]) for g in self.param_groups]
        self._pushed_raw = [self._raw_hypers(g) for g in self.param_groups]
        self._harr_key = None

    def _check_overlaps(self):
        """Params of different classes must not share memory either."""
        check_spans([e for o in self._plist for t, e in enumerate(o._entries)
                      if e.numel and t not in o._released])

    def _route(self, p):
        """(part, local tensor index) of a param or a global tensor index."""
        return self._where[self._tid(p)]

    def _check_open(self):
        if self._closed:
            raise ZoptError(Status.BAD_STATE, "the optimizer is closed")
        if self._begun:
            raise ZoptError(Status.BAD_STATE, "clip_grad_norm_ began this step (the gradients "
                            "are reduced and the norm computed): call step() first")

    _handle = _check_open

    def _free(self):
        for _, o in getattr(self, "_parts", ()):
            o.close()
        self._closed = True
        if getattr(self, "_own_comm", False) and getattr(self, "_comm", None) is not None:
            self._comm.close()
            self._comm = None

    def close(self):
        """Frees every part's native optimizer (and a communicator it made);
        waits for a call running on another thread first."""
        with _lock_of(self).wait():
            self._free()

    @property
    def refreshes(self):
        return sum(o.refreshes for o in self._plist)

    @property
    def rebuilds(self):
        return sum(o.rebuilds for o in self._plist)

    # ---- hyperparameters ------------------------------------------------------------
    def _push_group_hypers(self):
        """param_groups edits (schedulers, by hand) copied into every
        part's groups; the parts push what changed to their runtimes."""
        groups = self.param_groups
        if len(groups) != len(self._pushed_raw):
            raise ZoptError(Status.BAD_STATE,
                            "param_groups changed length: add groups with add_param_group()")
        keys = self._hyper_keys()
        for gid, g in enumerate(groups):
            self._check_group_params(gid, g)
            if "amsgrad" in g or "differentiable" in g:
                for o in self._plist:
                    o._check_rule_flags(g, f"param_groups[{gid}]")
            raw = tuple(_frozen(g.get(k)) for k in keys)
            if raw == self._pushed_raw[gid]:
                continue
            _slots(g, self.step_obj.hypers)  # refused before any part changes
            _maximize(g)
            vals = {k: v for k, v in g.items() if k != "params"}
            for o in self._plist:
                o.param_groups[gid].update(vals)
            self._pushed_raw[gid] = raw
        for o in self._plist:
            o._push_hypers()

    @_exclusive("get_hyper")
    def get_hyper(self, gid, name):
        self._check_open()
        return self._plist[0].get_hyper(gid, name)

    @_exclusive("set_hyper")
    def set_hyper(self, gid, name, value):
        """Sets one slot now in every part (and mirrors it into param_groups)."""
        self._check_open()
        for o in self._plist:
            o.set_hyper(gid, name, value)
        self._sync_groups_from_parts([gid])

    def _sync_groups_from_parts(self, gids=None):
        src = self._plist[0].param_groups
        for gid in (range(len(self.param_groups)) if gids is None else gids):
            g = self.param_groups[gid]
            params = g["params"]
            g.clear()
            g.update({k: v for k, v in src[gid].items() if k != "params"})
            g["params"] = params
            self._pushed_raw[gid] = self._raw_hypers(g)
            for o in self._plist[1:]:
                o.param_groups[gid].update({k: v for k, v in g.items() if k != "params"})

    @property
    @_exclusive("grad_divisor")
    def grad_divisor(self):
        self._check_open()
        return self._plist[0].grad_divisor

    @grad_divisor.setter
    @_exclusive("grad_divisor")
    def grad_divisor(self, d):
        self._check_open()
        for o in self._plist:
            o.grad_divisor = d
        self._grad_divisor = float(d)

    # ---- stepping --------------------------------------------------------------------
    @_exclusive("step")
    def step(self, closure=None):
        """One step of every class as one (zopt_optimizer_step_linked): one
        global norm over all params' gradients, one clip coefficient, one
        skip decision; returns the closure's loss. ``last_grad_norm`` /
        ``last_skipped`` / ``last_loss_scale`` are the combined outcome.
        After clip_grad_norm_ it finishes the step that call began."""
        if self._begun:
            from ._clip import finish
            return finish(self, closure)
        loss = None
        if closure is not None:
            if torch is not None:
                with torch.enable_grad():
                    loss = closure()
            else:
                loss = closure()
        t0 = time.perf_counter()
        run = self._step_prologue()
        self.last_loss = loss
        if not run:
            self.last_grad_norm, self.last_skipped = float("nan"), False
            self._metrics(t0, None, None, no_grads=True)
            return loss
        self._run_native_step(t0)
        return loss

    def _step_prologue(self):
        """step() up to the linked step: every part's checks and gradients,
        the changed hyperparameters. False when there is nothing to run."""
        self._check_open()
        parts = self._plist
        for o in parts:
            if o._offload:  # offloaded parts: never inside a CUDA graph capture
                o._refuse_offload_capture()
        for o in parts:
            # offloaded parts: everything from here on (the parts' checks,
            # the pushes, the step) on torch's current stream
            o._handle()
            if o._rank_checks is not None:  # DDP, gradients rescaled in place
                o._rank_checks.before_step(o)
            o._pre_step()  # may rebuild a part's native optimizer
        self._push_group_hypers()
        return not (self.world_size == 1 and not any(1 in o._active for o in parts))

    def _run_native_step(self, t0):
        """The linked step (or the end of one clip_grad_norm_ began)."""
        parts = self._plist
        hs = tuple(o._h.value for o in parts)
        if hs != self._harr_key:
            self._harr_keep, self._harr = _lib.c_array(ctypes.c_void_p, hs)
            self._harr_key = hs
        t1 = time.perf_counter()
        st = self._lib.zopt_optimizer_step_linked(self._harr, len(hs), self._res_ref)
        t2 = time.perf_counter()
        if st:
            check(st, "zopt_optimizer_step_linked")
        r = self._res
        for o in parts:
            o._after_step(r)
        self.last_result = r
        self.last_grad_norm = r.grad_norm
        self.last_skipped = bool(r.skipped)
        self.last_loss_scale = r.loss_scale
        self.steps_taken += 1
        self._metrics(t0, t1, t2)

    @_exclusive("gpu_result")
    def gpu_result(self):
        raise ZoptError(Status.UNSUPPORTED, "linked steps run CPU-updated steps: the "
                        "outcome is in last_grad_norm / last_skipped")

    def _metrics(self, t0, t1, t2, no_grads=False):
        step_s = (t2 - t1) if t1 is not None else 0.0
        over = (t1 - t0) if t1 is not None else (time.perf_counter() - t0)
        W = max(self.world_size, 1)
        parts = self._plist
        elems = 0 if no_grads else sum(o._active_elems for o in parts) / W
        nbytes = 0 if no_grads else int(sum(o._active_elems * o._bytes_per_elem
                                            for o in parts) / W)
        loss = self.last_loss
        try:
            loss = float(loss) if loss is not None else None
        except (TypeError, ValueError):
            loss = None
        m = dict(step=self.steps_taken, grad_norm=float(self.last_grad_norm),
                 skipped=bool(self.last_skipped),
                 loss_scale=float(self.last_loss_scale) if not no_grads else float("nan"),
                 loss=loss, lr=[g.get("lr") for g in self.param_groups],
                 active_tensors=sum(len(o._active) - o._active.count(0) for o in parts),
                 updated_elems=int(elems), step_time_s=step_s, overhead_s=over,
                 bytes=nbytes, bytes_per_s=(nbytes / step_s if step_s > 0 else float("nan")),
                 refreshes=self.refreshes, rebuilds=self.rebuilds, no_grads=no_grads,
                 classes=[c for c, _ in self._parts])
        self.last_metrics = m
        for fn in list(self._metrics_hooks):
            fn(self, m)

    @_exclusive("zero_grad")
    def zero_grad(self, set_to_none=None):
        """torch's zero_grad, in every part (the default: the installed
        torch's, as Optimizer.zero_grad)."""
        if set_to_none is None:
            set_to_none = _torch_compat.zero_grad_default()
        for o in self._plist:
            o.zero_grad(set_to_none=set_to_none)

    @_exclusive("accumulate_grads")
    def accumulate_grads(self):
        """``accumulate_grads()`` of every part (f32 gradients of bf16/f16
        params: ``p.grad`` into ``p.main_grad``)."""
        for o in self._plist:
            o.accumulate_grads()

    # ---- add_param_group ----------------------------------------------------------------
    @_exclusive("add_param_group")
    def add_param_group(self, param_group):
        """Adds a group to every part (an empty one where it has no param of
        the class; a class seen for the first time gets its part, with the
        loss scaler's state of the others). Every part keeps its states; if
        a part fails, the parts already extended are put back."""
        self._check_open()
        self._push_group_hypers()  # edits made since the last step, into the parts
        n_groups = len(self.param_groups)
        n_items, old_classes = len(self._items), dict(self._class_of)
        classes = self._add_group_py(dict(param_group))
        new_gid = n_groups
        snaps, done, created = {}, [], []
        try:
            for o in self._plist:
                o._prepare()
                snaps[id(o)] = (o._snapshot(), len(o._entries), len(o._grad_flats),
                                len(o._acc_hooks))
            self._seed = self._plist[0].seed
            for c, o in self._parts:
                groups, names = self._part_groups(c)
                o._index_names = names
                o.add_param_group(groups[new_gid])
                done.append(o)
            scale, good, cfg = self._plist[0]._scaler_state()
            for c in self.steps:
                if c in classes and c not in self.parts:
                    o = self._new_part(c)
                    created.append(o)
                    self._equalize_scaler(o, scale, good, cfg)
                    self._parts.append((c, o))
            self._parts.sort(key=lambda co: CLASS_ORDER.index(co[0]))
            self._after_parts_changed()
        except BaseException:
            for o in created:
                o.close()
            self._parts = [(c, o) for c, o in self._parts if o not in created]
            for o in done:
                snap, n_ent, n_fl, n_hooks = snaps[id(o)]
                for _, h in o._acc_hooks[n_hooks:]:
                    h.remove()
                del o._acc_hooks[n_hooks:]
                del o.param_groups[n_groups:]
                del o._entries[n_ent:]
                del o._grad_flats[n_fl:]
                o._build_native()
                o._restore(snap)
                o.rebuilds += 1
            del self.param_groups[n_groups:]
            del self._items[n_items:]
            self._class_of = old_classes
            self._after_parts_changed()
            raise

    def _equalize_scaler(self, o, scale, good, cfg):
        """A part made after the others: their loss scaler's state (the
        linked step requires the parts to agree)."""
        if not o.step_obj.loss_scaled:
            return
        o.configure_loss_scaler(**cfg)
        check(self._lib.zopt_optimizer_set_loss_scaler_state(o._h, float(scale), int(good)),
              "zopt_optimizer_set_loss_scaler_state")

    # ---- state ---------------------------------------------------------------------------
    def _tensor_step(self, t):
        o, lt = self._where[t]
        return o._tensor_step(lt)

    def _param_state(self, t):
        o, lt = self._where[t]
        return o._param_state(lt)

    # state[p] reads and writes, by the class's part (which keeps the
    # tensors it lent, written back at its next call)
    def _state_keys(self, t):
        o, lt = self._where[t]
        return o._state_keys(lt)

    def _state_get(self, t, key):
        o, lt = self._where[t]
        return o._state_get(lt, key)

    def _state_set(self, t, values):
        o, lt = self._where[t]
        return o._state_set(lt, values)

    def _state_assign(self, t, values):
        o, lt = self._where[t]
        return o._state_assign(lt, values)

    def _state_values(self, t, values):
        o, lt = self._where[t]
        return o._state_values(lt, values)

    @_exclusive("step_count")
    def step_count(self, gid=0):
        """Steps in which any tensor of group ``gid`` was updated, the most
        over the classes (each class counts its own tensors' steps)."""
        self._check_open()
        return max(o.step_count(gid) for o in self._plist)

    @_exclusive("read_state")
    def read_state(self, tensor_idx, kind):
        o, lt = self._route(tensor_idx)
        return o.read_state(lt, kind)

    @_exclusive("write_state")
    def write_state(self, tensor_idx, kind, values):
        o, lt = self._route(tensor_idx)
        return o.write_state(lt, kind, values)

    @_exclusive("read_state_raw")
    def read_state_raw(self, tensor_idx, kind):
        o, lt = self._route(tensor_idx)
        return o.read_state_raw(lt, kind)

    @_exclusive("refresh_master")
    def refresh_master(self, params=None):
        self._check_open()
        if params is None:
            for o in self._plist:
                o.refresh_master()
            return
        by = {}
        for p in params:
            o, lt = self._route(p)
            by.setdefault(id(o), (o, []))[1].append(lt)
        for o, lts in by.values():
            o.refresh_master(lts)

    @_exclusive("memory_info")
    def memory_info(self):
        """The parts' memory_info summed (``world_size``, ``rank`` as
        they are), and ``classes``: each part's own."""
        self._check_open()
        infos = {c: o.memory_info() for c, o in self._parts}
        first = next(iter(infos.values()))
        out = {k: (v if k in ("world_size", "rank") else sum(i[k] for i in infos.values()))
               for k, v in first.items()}
        out["classes"] = infos
        return out

    # ---- loss scaling, seed ------------------------------------------------------------
    @_exclusive("configure_loss_scaler")
    def configure_loss_scaler(self, **kw):
        c = self._scaler_config(**kw)
        for o in self._plist:
            o.configure_loss_scaler(**kw)
        self._scaler_cfg = c

    @property
    @_exclusive("loss_scale")
    def loss_scale(self):
        self._check_open()
        return self._plist[0].loss_scale

    def _scaler_state(self):
        return self._plist[0]._scaler_state()

    @_exclusive("set_seed")
    def set_seed(self, seed):
        for o in self._plist:
            o.set_seed(seed)
        self._seed = int(seed) & (2**64 - 1)

    @property
    @_exclusive("seed")
    def seed(self):
        self._check_open()
        return self._plist[0].seed

    # ---- torch's state_dict over all classes ----------------------------------------------
    @_exclusive("state_dict")
    def state_dict(self):
        """torch's layout over all params (indices in param_groups order,
        as torch numbers them), so it loads into ``torch.optim.AdamW`` & co.;
        ``'zopt'`` adds the classes (each with its step, states, per-group
        step counts and params). Collective at world size > 1."""
        self._check_open()
        self._push_group_hypers()
        sds = [o.state_dict() for o in self._plist]
        state = {}
        for o, sd in zip(self._plist, sds):
            glob = self._global_of[id(o)]
            for lt, st in sd["state"].items():
                state[glob[lt]] = st
        groups, start = [], 0
        for gid, g in enumerate(self.param_groups):
            packed = {k: v for k, v in sds[0]["param_groups"][gid].items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        z0 = sds[0]["zopt"]
        kinds = []
        for sd in sds:
            kinds += [k for k in sd["zopt"]["states"] if k not in kinds]
        return {
            "state": dict(sorted(state.items())),
            "param_groups": groups,
            "zopt": {
                "format": "zopt-torch-state-dict-1",
                "step_name": "+".join(sd["zopt"]["step_name"] for sd in sds),
                "states": kinds,
                "group_steps": [max(sd["zopt"]["group_steps"][g] for sd in sds)
                                for g in range(len(groups))],
                "loss_scaler": z0["loss_scaler"],
                "seed": z0["seed"],
                "world_size": self.world_size,
                "classes": [{"class": c, "step_name": sd["zopt"]["step_name"],
                             "states": sd["zopt"]["states"],
                             "group_steps": sd["zopt"]["group_steps"],
                             "params": list(self._global_of[id(o)])}
                            for (c, o), sd in zip(self._parts, sds)],
            },
        }

    @_exclusive("load_state_dict")
    def load_state_dict(self, state_dict, allow_rule_change=False):
        """Loads torch's layout (zopt's own, of one or several classes, or a
        torch optimizer's) into every class; the rules are checked per class
        as for one class. Nothing changes if anything is refused: the classes
        loaded before a refusal are put back."""
        self._check_open()
        sd = state_dict
        if sd.get("format") == "zopt-state-dict-1":
            raise ZoptError(Status.CHECKPOINT, "the first binding's state_dict format holds "
                            "one class's runtime checkpoint; load it into that class's "
                            "own optimizer")
        if "state" not in sd or "param_groups" not in sd:
            raise ZoptError(Status.CHECKPOINT,
                            "not an optimizer state_dict (no 'state' / 'param_groups')")
        saved = sd["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict has {len(saved)} param groups, the optimizer "
                            f"{len(self.param_groups)}")
        for gid, (a, b) in enumerate(zip(saved, self.param_groups)):
            if len(a["params"]) != len(b["params"]):
                raise ZoptError(Status.CHECKPOINT,
                                f"state_dict's param group {gid} has {len(a['params'])} "
                                f"params, the optimizer's {len(b['params'])}")
        listed = {pid for a in saved for pid in a["params"]}
        for pid in sd["state"]:
            if pid not in listed:
                raise ZoptError(Status.CHECKPOINT,
                                f"state_dict has state for param {pid!r}, which no group lists")
        z = sd.get("zopt", {}) or {}
        info = {ci.get("class"): ci for ci in z.get("classes", [])}
        subs = []
        for c, o in self._parts:
            groups, state = [], {}
            for gid, (a, g) in enumerate(zip(saved, self.param_groups)):
                pids = [pid for pid, p in zip(a["params"], g["params"])
                        if self._class_of[id(p)] == c]
                groups.append(dict({k: v for k, v in a.items() if k != "params"},
                                   params=pids))
                for pid in pids:
                    if pid in sd["state"]:
                        state[pid] = sd["state"][pid]
            subz = {k: v for k, v in z.items() if k not in ("classes", "group_steps")}
            if c in info:
                subz["group_steps"] = info[c].get("group_steps")
                subz["step_name"] = info[c].get("step_name", z.get("step_name"))
            elif not info and "group_steps" in z:
                subz["group_steps"] = z["group_steps"]
            subs.append(dict(state=state, param_groups=groups, zopt=subz))
        pending = []
        with collective_errors(self, "load_state_dict"):
            self._apply_to_parts(lambda o, sub: pending.append((o, o._load_state_dict(
                sub, allow_rule_change=allow_rule_change))), subs)
            self._finish_master_loads(pending, "load_state_dict")

    def _finish_master_loads(self, pending, what):
        """After every part loaded: the params that disagree with their
        loaded master set to round(master) (the single-class policy), one
        warning for all classes."""
        changed = total = 0
        for o, p in pending:
            c, n = o._finish_master_load(p, what, warn=False)
            changed, total = changed + c, total + n
        if changed:
            _warn_master_replaced(what, changed, total)

    def _apply_to_parts(self, fn, args):
        """fn(part, arg) for every part in order; if one fails, the parts
        done before it are restored from snapshots taken first."""
        for o in self._plist:
            o._prepare()
        snaps = [(o._snapshot(), [dict(g) for g in o.param_groups]) for o in self._plist]
        done = []
        try:
            for o, a in zip(self._plist, args):
                fn(o, a)
                done.append(o)
        except BaseException:
            for o in done:
                snap, groups = snaps[self._plist.index(o)]
                for g, old in zip(o.param_groups, groups):
                    g.clear()
                    g.update(old)
                o._restore(snap)
                o._pushed = [_slots(g, o.step_obj.hypers) for g in o.param_groups]
                o._pushed_raw = [o._raw_hypers(g) for g in o.param_groups]
            raise
        self._sync_groups_from_parts()

    # ---- checkpoint files ------------------------------------------------------------------
    def checkpoint_files(self, path):
        """{class: file} of a checkpoint at ``path``: ``path`` for the first
        part (in the order bf16, f16, f32), ``path.<class>`` for the others
        (each the rank-0 file of its set at several ranks)."""
        return {c: part_path(path, c, i == 0) for i, (c, _) in enumerate(self._parts)}

    @_exclusive("save")
    def save(self, path):
        """Writes every part's runtime checkpoint (collective at several
        ranks): ``path`` for the first class, ``path.<class>`` for the
        others (:meth:`checkpoint_files`)."""
        self._check_open()
        self._push_group_hypers()
        for (c, o), f in zip(self._parts, self.checkpoint_files(path).values()):
            o.save(f)

    @_exclusive("load")
    def load(self, path, allow_rule_change=False):
        """Loads every part's checkpoint file (:meth:`checkpoint_files`).
        Each file must hold its class's tensors (checked before anything
        changes); if a part's load fails, the parts loaded before it are
        restored, so a failed load changes nothing."""
        self._check_open()
        files = self.checkpoint_files(path)
        for (c, o), f in zip(self._parts, files.values()):
            if not os.path.exists(f):
                raise ZoptError(Status.IO, f"load({path}): class {c!r} is read from {f}, "
                                "which does not exist (the files of this optimizer: "
                                + ", ".join(f"{k}: {v}" for k, v in files.items()) + ")")
            try:
                head = _ckpt.read_tensors(f)
            except (OSError, ValueError, struct.error) as e:
                raise ZoptError(Status.CHECKPOINT, f"load({path}): {f}: {e}") from None
            if head is None:
                continue  # another format: the runtime's loader judges it
            name, _, numels = head
            mine = [e.numel for e in o._entries]
            if numels != mine:
                raise ZoptError(
                    Status.CHECKPOINT,
                    f"load({path}): {f} holds {len(numels)} tensors of "
                    f"{sum(numels)} elements (step '{name}'), but class {c!r} has "
                    f"{len(mine)} tensors of {sum(mine)} elements: it is not this "
                    "class's checkpoint (another model, or another split into classes)")
        pending = []
        with collective_errors(self, "load"):
            self._apply_to_parts(lambda o, f: pending.append((o, o._load_file(
                f, allow_rule_change=allow_rule_change))), list(files.values()))
            self._finish_master_loads(pending, "load")

    # ---- ZeRO-3 ------------------------------------------------------------------------------
    def _zero3_only(self, what):
        if not any(o.step_obj.zero3 for o in self._plist):
            raise ZoptError(Status.BAD_STATE,
                            f"{what}: no class's step is ZeRO-3 (their params are the "
                            "model's own memory, always current)")

    def _by_part(self, params):
        """params -> [(part, [its params])] in part order."""
        if params is None:
            return [(o, None) for o in self._plist]
        by = {id(o): [] for o in self._plist}
        for p in params:
            o, _ = self._route(p)
            by[id(o)].append(p)
        return [(o, by[id(o)]) for o in self._plist if by[id(o)]]

    @_exclusive("gather_params")
    def gather_params(self, params=None):
        """ZeRO-3: the full params into the model, per class (collective)."""
        self._check_open()
        for o, ps in self._by_part(params):
            o.gather_params(ps)

    @_exclusive("release_params")
    def release_params(self, params=None):
        self._zero3_only("release_params")
        for o, ps in self._by_part(params):
            if o.step_obj.zero3:
                o.release_params(ps)

    @property
    def released_params(self):
        return [p for o in self._plist for p in o.released_params]

    @property
    def _zero3_mode(self):
        return self._zero3_gather

    @_zero3_mode.setter
    def _zero3_mode(self, mode):
        self._zero3_gather = mode
        for o in self._plist:
            o._zero3_mode = mode

    def _reset_watch(self):
        for o in self._plist:
            o._reset_watch()

    def _prepare(self):
        self._check_open()
        for o in self._plist:
            o._prepare()

    # ---- repr -------------------------------------------------------------------------------
    def __repr__(self):
        n = sum(e.numel for e in getattr(self, "_entries", []))
        cls = []
        for c, o in self._parts:
            s = o.step_obj
            cls.append(f"{c}: {s.name} ["
                       + ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in s.states)
                       + f"] {len(o._entries)} tensors")
        missing = [c for c in self.steps if c not in getattr(self, "parts", {})]
        head = (f"zopt.Optimizer(classes {{{'; '.join(cls)}}}"
                + (f" (no params yet: {', '.join(missing)})" if missing else "")
                + f"; {len(getattr(self, '_entries', []))} tensors, {n} elements, "
                f"rank {getattr(self, 'rank', 0)} of {getattr(self, 'world_size', 1)}, "
                f"steps taken {self.steps_taken}" + (", closed" if self._closed else "") + ")")
        lines = [head]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i} ({len(group['params'])} tensors)")
            for key in sorted(group):
                if key != "params":
                    lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines)


_torch_compat.patch_class(MixedOptimizer)

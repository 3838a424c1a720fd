"""zopt.Optimizer: a torch.optim.Optimizer over compiled zopt steps.

docs/USAGE.md is the manual (what every argument, call and key means);
this module is the torch surface. ``zopt.Optimizer`` subclasses
``torch.optim.Optimizer`` when torch is importable (``object`` otherwise,
for numpy-only use) and holds what torch's base class holds (``defaults``,
``param_groups``, hooks: zopt._torch_compat). The runtime holds the states,
one native optimizer per *parameter class* (a :class:`zopt._part.Part`):
one class for a :class:`Step`, one per key for a mapping ``{dtype: step}``,
stepped together with one norm and one skip decision
(``zopt_optimizer_step_linked``). The layers below, each a module:

* zopt._classes: which class a param belongs to;
* zopt._part (zopt._native, _params, _grads, _rebuild, _frozen): one
  class's native optimizer, registered params and gradient memory;
* zopt._state: ``opt.state[p]`` (torch's keys, written through);
* zopt._checkpoint: ``state_dict`` / ``load_state_dict`` / ``save`` / ``load``;
* zopt._hypers: param groups <-> hyperparameter slots, torch's rule flags
  (checked against the descriptor's rule flags, zopt.Step.nesterov ...);
* zopt.streaming (``grad_streaming=True``), zopt._clip
  (``clip_grad_norm_``), zopt._ranks (checks at several ranks).
"""
from __future__ import annotations

import collections.abc
import contextlib
import ctypes
import time

import numpy as np

from . import (_checkpoint, _classes, _clip, _frozen, _gpu, _grads, _groups, _hypers, _lib,
               _native, _options, _params, _placement, _stats, _strided, _torch_compat)
from ._checkpoint import MasterWeightsWarning  # noqa: F401 (zopt.optimizer.MasterWeightsWarning)
from ._dtypes import TORCH_KEY, kind as _kind, torch
from ._lib import STATE_NAMES, Status, ZoptError, check
from ._native import exclusive as _exclusive, lock_of as _lock_of, scaler_config
from ._ranks import RankChecks, make_comm
from ._state import StateView
from ._step import Step
from .overlap import OffloadOverlap
from .streaming import GradStreamer

_Base = torch.optim.Optimizer if torch is not None else object

__all__ = ["Optimizer", "MixedOptimizer", "Step", "MasterWeightsWarning"]


class Optimizer(_Base):
    """A ``torch.optim.Optimizer`` running a compiled zopt step.

    ``step``: a :class:`Step` (or the path of a step.so), or a mapping
    ``{dtype: Step or path}`` (``zopt.steps.<rule>(..., classes=...)``
    returns one) for params of several dtypes, each routed to the step of
    its dtype and stepped as one. ``params``: as torch's (tensors, or
    dicts with ``'params'`` and per-group hyperparameters); besides torch
    tensors, ``(param, grad)`` pairs of numpy arrays or torch tensors.
    Hyperparameters not given take the step's defaults.

    Keyword arguments and behaviour, in docs/USAGE.md: hyperparameters and
    groups (section 2), gradients and ``p.grad`` (section 3), writes into
    params and the master (section 4), ``state[p]`` and checkpoints,
    several dtypes, threads; ranks (``process_group=``, ``comm=``,
    ``grad_divisor``, ``bucket_elems``, ``zero3_gather``,
    ``grad_streaming``, ``timeout``): docs/DISTRIBUTED.md; f32 gradients of
    bf16/f16 params (``grad_accumulation``, ``p.main_grad``):
    docs/USAGE.md section 3; GPU and offloaded steps (streams,
    ``device_allocator``, CUDA graphs, frozen params): docs/GPU.md.
    """

    _parts = ()
    _mapped = False
    _streamer = None      # grad_streaming=True: a zopt.streaming.GradStreamer
    _overlap = None       # overlap=True: a zopt.overlap.OffloadOverlap
    _rank_checks = None   # world size > 1: a zopt._ranks.RankChecks
    _begun = False        # clip_grad_norm_ began the step (zopt._clip)
    _closed = False
    _state_view = None

    def __new__(cls, step=None, params=None, **kw):
        if cls is Optimizer and isinstance(step, collections.abc.Mapping):
            _classes.check_mapping_options(step, kw)  # overlap, grad_streaming
            return super().__new__(MixedOptimizer)
        return super().__new__(cls)

    def __init__(self, step, params, *, lr=None, betas=None, eps=None,
                 weight_decay=None, momentum=None, dampening=None,
                 bias_correction=None, maximize=None, num_threads=None, loss_scaler=None,
                 seed=None, process_group=None, comm=None, grad_divisor=None,
                 bucket_elems=None, zero3_gather="step", grad_accumulation="hooks",
                 device_allocator=None, grad_streaming=False, timeout=None, overlap=False,
                 speculation_budget=None, model=None, early_params=None):
        self._parts, self.parts = [], {}
        self._lib = _native.lib()
        self._mapped = isinstance(step, collections.abc.Mapping)
        self._steps = _classes.steps_of(step, self._mapped)
        self._keep32 = _classes.policy_of(step, self._steps)
        self._gpu_fraction, self._gpu_split = _classes.gpu_fraction_of(step, self._steps), None
        s = self.step_obj = next(iter(self._steps.values()))  # the shared slots
        early_model = _options.check(device_allocator, zero3_gather, grad_accumulation, overlap,
                                     speculation_budget, model, early_params)
        self._zero3_gather = zero3_gather
        self._grad_accumulation = grad_accumulation
        self._settings = dict(num_threads=num_threads, bucket_elems=bucket_elems,
                              grad_divisor=grad_divisor, seed=seed,
                              scaler_cfg=None, device_allocator=device_allocator)
        self._metrics_hooks = []
        self.last_metrics = self.last_result = self.last_loss = None
        self.last_grad_norm = float("nan")
        self.last_skipped = False
        self.last_loss_scale = 1.0
        self.steps_taken = 0
        self._mute_groups = False
        self._entries, self._where, self._tid_map, self._class_of = [], [], {}, {}
        self._global_of = {}
        self._harr_key = None
        self._own_comm = False
        self._comm, self._own_comm = make_comm(process_group, comm, timeout)
        if loss_scaler is not None:
            self._settings["scaler_cfg"] = scaler_config(**loss_scaler)
        given = {k: v for k, v in dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
            dampening=dampening, bias_correction=bias_correction,
            maximize=maximize).items() if v is not None}
        bad = [k for k in _hypers.slots(given, s.hypers) if k not in s.hypers]
        if bad:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{self._who()} no hyperparameter {', '.join(sorted(set(bad)))} "
                            f"({'their' if self._mapped else 'its'} slots: "
                            f"{', '.join(s.hypers)})")
        groups = _hypers.groups_arg(params)
        if not groups:
            raise ZoptError(Status.INVALID_ARGUMENT, "optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = _hypers.complete_group(s, given)
        for st in self._steps.values():  # torch's ValueError of SGD(nesterov=True, ...)
            _hypers.check_nesterov_defaults(st, defaults)
        self.defaults = defaults
        _torch_compat.init_base(self)  # hook dicts, the step wrapper (torch 1.13 and 2.x)
        self.param_groups = []
        try:
            if not self._mapped:  # the one class exists even without params
                _groups.part_of(self, next(iter(self._steps)))
            with _groups.gpu_split(self, groups) as groups:  # gpu_fraction: routed in add order
                for g in groups:
                    _groups.append_group(self, *_groups.new_group(self, g))
            _groups.check_keep32_names(self)
            for c in self._parts:
                if grad_streaming:  # no grad memory of ours: the runtime holds the shards
                    c.streamer = self._streamer = GradStreamer(c)
                if overlap and not c.step.gpu:  # offloaded: buckets marked during backward
                    c.overlap = self._overlap = OffloadOverlap(c, speculation_budget,
                                                               grad_streaming, early_model)
                _groups.extend(c, c.entries)
            _groups.route(self)
            if self.world_size > 1 and torch is not None:  # DDP, per-rank clippers
                self._rank_checks = RankChecks(self)
            for c in self._parts:
                c.rank_checks = self._rank_checks
                _grads.add_acc_hooks(c, c.entries)
            self._pushed = _hypers.Pushed(s, self.param_groups)
        except BaseException:
            self._free()
            raise
        self._state_view = StateView(self)

    def _who(self):
        return "the steps have" if self._mapped else f"step '{self.step_obj.name}' has"

    def _iter_entries(self):
        for c, lt in self._where:
            yield c, lt, c.entries[lt]

    def _tid(self, p):
        if isinstance(p, (int, np.integer)):
            self._tensor(int(p))
            return int(p)
        t = self._tid_map.get(id(p))
        if t is None:
            raise ZoptError(Status.INVALID_ARGUMENT, "not a param of this optimizer")
        return t

    def _tensor(self, tensor_idx):
        if not (0 <= int(tensor_idx) < len(self._entries)):
            raise ZoptError(Status.INVALID_ARGUMENT, f"no tensor {tensor_idx} "
                            f"(the optimizer has {len(self._entries)})")
        return self._entries[int(tensor_idx)]

    def _route(self, p):
        """(part, its index) of a param or a tensor index."""
        return self._where[self._tid(p)]

    def _by_part(self, params):
        """params (or None: all) -> [(part, its indices)] in part order."""
        if params is None:
            return [(c, list(range(len(c.entries)))) for c in self._parts]
        by = {id(c): set() for c in self._parts}
        for p in params:
            c, lt = self._route(p)
            by[id(c)].add(lt)
        return [(c, sorted(by[id(c)])) for c in self._parts if by[id(c)]]

    # ---- the native optimizers ---------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise ZoptError(Status.BAD_STATE, "the optimizer is closed")
        if self._begun:
            raise ZoptError(Status.BAD_STATE, "clip_grad_norm_ began this step (the gradients "
                            "are reduced and the norm computed): call step() first")

    def _handle(self):
        """The native optimizer of a one-class optimizer (tests, zopt._clip)."""
        self._check_open()
        return self._parts[0].handle()

    @property
    def _h(self):
        return self._parts[0].h if self._parts else None

    def _prepare(self):
        """Checks before anything reads or writes the native optimizers."""
        self._check_open()
        for c in self._parts:
            c.prepare()

    def _reset_watch(self):
        for c in self._parts:
            _params.reset_watch(c)

    def _free(self):
        for c in self._parts:
            c.free()
        if self._rank_checks is not None:
            self._rank_checks.remove()
        self._closed = True
        if getattr(self, "_own_comm", False) and getattr(self, "_comm", None) is not None:
            self._comm.close()
            self._comm = None

    def close(self):
        """Frees the native optimizers (and a communicator it made); waits
        for a call running on another thread first."""
        with _lock_of(self).wait():
            self._free()

    def __del__(self):
        try:
            self._free()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __getstate__(self):
        raise TypeError("a zopt.Optimizer cannot be pickled (it owns native memory); "
                        "pickle opt.state_dict() instead")

    @property
    def refreshes(self):
        """Master refreshes (writes into params seen), all classes."""
        return sum(c.refreshes for c in self._parts)

    @property
    def rebuilds(self):
        """Native optimizers rebuilt (moved storage, add_param_group, ...)."""
        return sum(c.rebuilds for c in self._parts)

    # ---- torch.optim.Optimizer surface -------------------------------------------------
    @_exclusive("add_param_group")
    def add_param_group(self, param_group):
        """Adds a group like torch. Every class's native optimizer (whose
        groups are fixed at finalize) is rebuilt with it, keeping every
        state, step count, the loss scaler and the seed; a class seen for
        the first time gets its part. A refusal changes nothing (the other
        groups' edits are pushed after it; every rank must call it)."""
        self._check_open()
        _groups.add_group(self, param_group)

    @property
    def state(self):
        """param -> its states under torch's keys, read from the runtime and
        written through (zopt._state; docs/USAGE.md). Reading it at world
        size > 1 gathers sharded states (collective); writes are local."""
        return self._state_view

    @state.setter
    def state(self, value):
        # torch's __init__ assigns a defaultdict (ignored: the states live
        # in the runtime); later an assignment replaces the states
        # (opt.state = {} resets them all).
        view = self.__dict__.get("_state_view")
        if view is None or value is view:
            return
        view.replace(value)

    @_exclusive("zero_grad")
    def zero_grad(self, set_to_none=None):
        """Like torch: zeros the gradients or sets them to None; the default
        is the installed torch's (False on torch 1.13, True from 2.0).
        docs/USAGE.md section 3."""
        if self._begun:  # the begun step reads the gradient memory still
            raise ZoptError(Status.BAD_STATE, "zero_grad() after clip_grad_norm_: the step it "
                            "began reads these gradients: call step() first")
        if set_to_none is None:
            set_to_none = _torch_compat.zero_grad_default()
        if self._streamer is not None:
            self._streamer.check_zero_grad()
        if self._overlap is not None:
            self._overlap.check_zero_grad()
        for c in self._parts:
            _grads.zero_grad(c, set_to_none)

    @_exclusive("accumulate_grads")
    def accumulate_grads(self):
        """Steps with f32 gradients of bf16/f16 params: every ``p.grad``
        added into ``p.main_grad`` (f32), ``p.grad`` set to None
        (``grad_accumulation="manual"``: after each micro-batch's backward;
        docs/USAGE.md section 3). Other steps: nothing."""
        for c in self._parts:
            c.take_grads()

    def __repr__(self):
        return _stats.describe(self)

    # ---- hyperparameters (zopt._hypers.Pushed: what reached the runtimes) -----------
    def _hyper_keys(self):
        return self._pushed.keys

    def _push_hypers(self):
        """param_groups edits (schedulers, by hand) -> every class's runtime."""
        self._pushed.push_all(self.param_groups, self._parts, self._steps.values())

    def _group_assigned(self, group):
        """A hyperparameter assigned in a param group of a GPU step
        (_gpu.GpuGroup): pushed now, on torch's current stream, since graph
        replays read the device's table and no step() comes between them."""
        pushed = self.__dict__.get("_pushed")
        if self._mute_groups or self._closed or pushed is None:
            return
        for gid, g in enumerate(self.param_groups):
            if g is group:
                if gid < len(pushed.raw):
                    pushed.push_group(gid, group, self._parts)
                return

    @_exclusive("get_hyper")
    def get_hyper(self, gid, name):
        self._check_open()
        return self._parts[0].get_hyper(gid, name)

    @_exclusive("get_group_flags")
    def get_group_flags(self, gid):
        """The runtime's ZOPT_GROUP_* flags of param group gid (bit 0:
        maximize, pushed from param_groups at each step)."""
        self._check_open()
        return self._parts[0].get_group_flags(gid)

    @_exclusive("set_hyper")
    def set_hyper(self, gid, name, value):
        """Sets one slot now in every class (and mirrors it into param_groups;
        the group's other edits stay, pushed at the next step)."""
        self._check_open()
        if name == "bias_correction":
            value = _hypers.bool_hyper(name, value)
        if name in ("momentum", "dampening") and 0 <= gid < len(self.param_groups):
            trial = dict(self.param_groups[gid], **{name: value})  # another SGD rule?
            for st in self._steps.values():
                _hypers.check_rule_flags(st, trial, f"set_hyper: param group {gid}")
        for c in self._parts:
            c.set_hyper(gid, name, value)
        self._sync_group_from_c(gid, name)  # the group's other edits stay, pushed at step()

    def _sync_group_from_c(self, gid, name=None):
        """param_groups[gid] (or its slot name) and the pushed cache <- the
        runtime's values."""
        self._mute_groups = True  # the runtime's own values: nothing to push
        try:
            if name is not None:
                self._pushed.read_one(gid, self.param_groups[gid], self._parts[0], name)
            else:
                self._pushed.read_back(gid, self.param_groups[gid], self._parts[0])
        finally:
            self._mute_groups = False

    def _set_groups(self, new_groups):
        """param_groups' dicts (kept) <- new_groups' values (after a load)."""
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)
        self._pushed.reset(self.param_groups)

    @property
    @_exclusive("grad_divisor")
    def grad_divisor(self):
        """The divisor D of the gradients (grad / (loss scale * D)): the
        world size by default (the mean over ranks, as DDP); set W * A to
        also average A accumulated micro-batches, 1 to sum."""
        self._check_open()
        return self._parts[0].grad_divisor_value

    @grad_divisor.setter
    @_exclusive("grad_divisor")
    def grad_divisor(self, d):
        self._check_open()
        for c in self._parts:
            c.set_grad_divisor(d)

    # ---- stepping ----------------------------------------------------------------------
    @_exclusive("step")
    def step(self, closure=None):
        """One optimizer step over the params that have a gradient (every
        class, one global norm and skip decision); returns the closure's
        loss, like torch. The outcome: ``last_grad_norm`` (NaN without a
        norm reduction), ``last_skipped``, ``last_loss_scale``,
        ``last_metrics``. With no gradient at all (world size 1) nothing
        changes and the runtime is not called. After
        :meth:`clip_grad_norm_` it finishes the step that call began."""
        if self._begun:
            return _clip.finish(self, closure)
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
            _stats.record_metrics(self, t0, None, None, no_grads=True)
            return loss
        self._run_native_step(t0)
        return loss

    def _step_prologue(self):
        """step() up to the runtime's step: the checks, the gradients, the
        changed hyperparameters. False when there is nothing to run (world
        size 1 and no gradient)."""
        self._check_open()
        parts = self._parts
        for c in parts:
            if c.offload and c.capturing():  # never inside a CUDA graph capture
                _gpu.refuse_offload_capture(c.step)
        # GPU and offloaded steps: from here on every call (the pushes of
        # changed hyperparameters, the step) runs on torch's current stream;
        # a GPU step only enqueues there (read its outcome with gpu_result()).
        for c in parts:
            c.handle()
        if self._rank_checks is not None:
            self._rank_checks.before_step(self)  # DDP, gradients rescaled in place
        if self._overlap is not None:
            others = [c for c in parts if c.overlap is None]  # a GPU fraction's class
            for c in others:
                c.pre_step()
            if not self._overlap.before_step(any(1 in c.active for c in others)):
                return False  # the buckets no backward marked; nothing to step
        elif self._streamer is None:
            for c in parts:
                c.pre_step()  # may rebuild a part's native optimizer
        else:
            # The hyperparameters first: a value refused (ValueError) must
            # come before the reduction of gradients set by hand, which
            # cannot be undone (R3, docs/TESTING.md "The ranks fuzzer").
            self._push_hypers()
            self._streamer.before_step()  # the buckets no backward reduced
        if self._streamer is None or self._overlap is not None:
            self._push_hypers()
        return self.world_size > 1 or any(1 in c.active for c in parts) or (
            self._streamer is not None and self._streamer.reduced)

    def _run_native_step(self, t0):
        """The runtime's step (one class: zopt_optimizer_step; several:
        zopt_optimizer_step_linked), or the end of one clip_grad_norm_
        began, and what follows it."""
        parts = self._parts
        if len(parts) == 1:
            c = parts[0]
            t1 = time.perf_counter()
            st = c.step_fn(c.h, c.res_ref)
            t2 = time.perf_counter()
            r, what = c.res, "zopt_optimizer_step"
        else:
            hs = tuple(c.h.value for c in parts)
            if hs != self._harr_key:
                self._harr_keep, self._harr = _lib.c_array(ctypes.c_void_p, hs)
                self._harr_key = hs
                self._res = _lib.StepResult()
                self._res_ref = ctypes.byref(self._res)
            t1 = time.perf_counter()
            st = self._lib.zopt_optimizer_step_linked(self._harr, len(hs), self._res_ref)
            t2 = time.perf_counter()
            r, what = self._res, "zopt_optimizer_step_linked"
        if st:  # (overlap: with what a failure means)
            (check if self._overlap is None else self._overlap.check_step)(st, what)
        if self._streamer is not None:
            self._streamer.after_step()
        if self._overlap is not None:
            self._overlap.after_step()
        for c in parts:
            c.after_step(r)
        self.last_result = r
        self.last_grad_norm = r.grad_norm
        self.last_skipped = bool(r.skipped)
        self.last_loss_scale = r.loss_scale
        self.steps_taken += 1
        _stats.record_metrics(self, t0, t1, t2)

    @_exclusive("clip_grad_norm_")
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ the zopt way, between backward and
        ``step()``: returns the global norm of the gradients over all ranks
        after their reduction (a 0-d tensor) and clips this step at
        ``max_norm``; zopt._clip and docs/DISTRIBUTED.md."""
        if self._overlap is not None:
            self._overlap.refuse_clip()
        return _clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def no_sync(self):
        """A context manager, like DDP's: with ``grad_streaming=True`` the
        backward passes inside it only accumulate into ``p.grad``; without
        streaming it does nothing (zopt.streaming)."""
        if self._overlap is not None:
            return self._overlap.no_sync()
        if self._streamer is None:
            return contextlib.nullcontext()
        return self._streamer.no_sync()

    @_exclusive("wait_params")
    def wait_params(self):
        """``overlap=True`` with a ``model``: torch's current stream waits for
        every param not waited for since ``step()`` (before reading params
        outside their modules' forward; docs/USAGE.md section 5)."""
        self._check_open()
        ov = self._overlap
        if ov is not None and ov.early is not None:
            ov.early.wait_all()

    @_exclusive("pipeline_stats")
    def pipeline_stats(self):
        """``overlap=True``: the last pipelined step's figures (zopt_pipeline_stats:
        outcome 'commit' / 'recompute' / 'discard', buckets, speculated,
        committed, recomputed, late, steps, overlapped_seconds,
        exposed_seconds; docs/USAGE.md) and ``gpu_fraction``."""
        self._check_open()
        return dict(OffloadOverlap.stats_of(self._overlap), gpu_fraction=self.gpu_fraction)

    @property
    def gpu_fraction(self):
        """The share of the params' elements whose step runs on the GPU
        (``gpu_fraction=f``: about f; _placement.share)."""
        return _placement.share(self._parts)

    def step_result(self):
        """(grad_norm, skipped) of the last step."""
        return self.last_grad_norm, self.last_skipped

    @_exclusive("gpu_result")
    def gpu_result(self):
        """(grad_norm, skipped, loss_scale) of the last GPU step: waits for
        that step (wherever it ran: a graph replay too) on torch's current
        stream and reads the device-side result."""
        if self._mapped:
            raise ZoptError(Status.UNSUPPORTED, "linked steps run CPU-updated steps: the "
                            "outcome is in last_grad_norm / last_skipped")
        self._check_open()
        c = self._parts[0]
        r = _lib.StepResult()
        check(c.lib.zopt_optimizer_gpu_result(c.handle(), ctypes.byref(r)),
              "zopt_optimizer_gpu_result")
        return float(r.grad_norm), bool(r.skipped), float(r.loss_scale)

    # ---- metrics -----------------------------------------------------------------------
    def register_metrics_hook(self, fn):
        """``fn(optimizer, metrics)`` after every step(); returns a handle
        with ``remove()``. The keys of ``metrics`` (also
        ``opt.last_metrics``): docs/USAGE.md section 9."""
        self._metrics_hooks.append(fn)
        return _RemovableHandle(self._metrics_hooks, fn)

    @property
    def metrics(self):
        return self.last_metrics

    # ---- seed, step counts, loss scaling --------------------------------------------------
    @_exclusive("set_seed")
    def set_seed(self, seed):
        """Seed of stochastic rounding (steps with a bf16 state declared
        `rounding stochastic`): same seed, same bits on any thread count."""
        self._check_open()
        for c in self._parts:
            c.set_seed(seed)

    @property
    @_exclusive("seed")
    def seed(self):
        self._check_open()
        return self._parts[0].get_seed()

    @_exclusive("step_count")
    def step_count(self, gid=0):
        """Steps in which any tensor of group ``gid`` was updated (the most
        over the classes: each counts its own tensors' steps)."""
        self._check_open()
        return max(c.group_step_count(gid) for c in self._parts)

    @_exclusive("tensor_step")
    def tensor_step(self, p):
        """The steps param ``p`` (a param or a tensor index) took (torch's
        state[p]['step'])."""
        self._check_open()
        c, lt = self._route(p)
        return c.tensor_step(lt)

    @_exclusive("configure_loss_scaler")
    def configure_loss_scaler(self, **kw):
        """(Re)starts the loss scaler (init_scale, growth_factor,
        backoff_factor, growth_interval, min_scale, dynamic)."""
        cfg = scaler_config(**kw)
        self._check_open()
        for c in self._parts:
            c.configure_scaler(c.handle(), cfg)
            c.scaler_cfg = cfg

    @property
    @_exclusive("loss_scale")
    def loss_scale(self):
        """The scale S the next step's gradients must be multiplied by."""
        self._check_open()
        return self._parts[0].get_loss_scale()

    # ---- state access ------------------------------------------------------------------
    @property
    def num_tensors(self):
        return len(self._entries)

    @_exclusive("read_state")
    def read_state(self, tensor_idx, kind):
        """State ``kind`` ('exp_avg', StateKind.MASTER, ...) of a tensor (an
        index or a param) as a float32 numpy array (flat, memory order)."""
        k = _kind(kind)
        c, lt = self._route(tensor_idx)
        _frozen.check_held(c, lt, "read_state")
        self._check_open()
        c.prepare()
        return c.read_f32(lt, k)

    @_exclusive("write_state")
    def write_state(self, tensor_idx, kind, values):
        """Writes a state from float32 values (rounded to its storage dtype).
        Writing the master also writes round(master) into the param where it
        is not already a rounding of it (as ``opt.state[p]['master'] = ...``
        does), so model and master agree."""
        k = _kind(kind)
        c, lt = self._route(tensor_idx)
        _frozen.check_held(c, lt, "write_state")
        self._check_open()
        _params.write_f32(c, lt, k, values)
        c.outdate([lt], (TORCH_KEY.get(k),))

    @_exclusive("read_state_raw")
    def read_state_raw(self, tensor_idx, kind):
        """Storage-exact copy of a state (uint16 for bf16, float16, float32)."""
        k = _kind(kind)
        c, lt = self._route(tensor_idx)
        _frozen.check_held(c, lt, "read_state_raw")
        self._check_open()
        c.prepare()
        if c.step.state_dtype(k) is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"the step has no state {STATE_NAMES[k]}")
        return c.read_raw(lt, k)

    @_exclusive("memory_info")
    def memory_info(self):
        """The runtime's memory (zopt_memory_info; keys: docs/USAGE.md). With
        a step per class: summed over the classes (``world_size``, ``rank``
        as they are), and ``classes``: each class's own."""
        self._check_open()
        infos = {c.cls: c.memory_info() for c in self._parts}
        if not self._mapped:
            return next(iter(infos.values()))
        first = next(iter(infos.values()))
        out = {k: (v if k in ("world_size", "rank") else sum(i[k] for i in infos.values()))
               for k, v in first.items()}
        out["classes"] = infos
        return out

    @_exclusive("step_stats")
    def step_stats(self):
        """Where the last step's host time went: an offloaded step's copies,
        its CPU update, the whole (zopt_step_stats; keys: docs/USAGE.md)."""
        return _stats.step_stats(self)

    @_exclusive("refresh_master")
    def refresh_master(self, params=None):
        """Makes the master (and ZeRO-3's held params) again the params'
        current values, for ``params`` (params or tensor indices; default
        all): after writes the optimizer cannot see (docs/USAGE.md section 4)."""
        self._check_open()
        for c, lts in self._by_part(params):
            c.handle()
            lts = [t for t in lts if t not in c.released]
            if c.strided:  # the registered copies read the params' current values
                _strided.copy_in(c.entries, c.strided)
            _params.refresh(c, lts)

    # ---- checkpoints (zopt._checkpoint) --------------------------------------------------
    @_exclusive("state_dict")
    def state_dict(self):
        """torch's layout (``{'state': {index: {'step', 'exp_avg', ...}},
        'param_groups': [...]}``, indices in param_groups order) plus
        ``'zopt'``: the loss scaler, the seed, per-group step counts, the
        steps' names and states (and, for a step per class, each class's).
        Loads into ``torch.optim.AdamW`` & co. and back. docs/USAGE.md,
        "Checkpoints"; collective at world size > 1."""
        return _checkpoint.state_dict(self)

    @_exclusive("load_state_dict")
    def load_state_dict(self, state_dict, allow_rule_change=False):
        """Loads torch's layout: zopt's own or a torch optimizer's. Another
        update rule is refused unless ``allow_rule_change``; nothing changes
        if anything is refused. With a master, model and master agree right
        after the call (a :class:`MasterWeightsWarning` when params were
        replaced). docs/USAGE.md section 4 and "Checkpoints"."""
        self._check_open()
        _checkpoint.load_state_dict(self, state_dict, allow_rule_change)

    def checkpoint_files(self, path):
        """{class: file} of a checkpoint at ``path``: ``path`` for the first
        class (in the order bf16, f16, f32), ``path.<class>`` for the others
        (each the rank-0 file of its set at several ranks)."""
        return _checkpoint.checkpoint_files(self, path)

    @_exclusive("save")
    def save(self, path):
        """Writes the runtime's checkpoint (:meth:`checkpoint_files`; one
        commit point over every class: docs/CHECKPOINT.md); collective."""
        _checkpoint.save(self, path)

    @_exclusive("load")
    def load(self, path, allow_rule_change=False):
        """Loads a runtime checkpoint (:meth:`checkpoint_files`); another
        update rule is refused unless ``allow_rule_change``, a mixed set of
        class files too; a failed load changes nothing. Params and master agree afterwards as with
        :meth:`load_state_dict`."""
        self._check_open()
        _checkpoint.load(self, path, allow_rule_change)

    # ---- ZeRO-3 ----------------------------------------------------------------------------
    @property
    def _zero3_mode(self):
        return self._zero3_gather

    @_zero3_mode.setter
    def _zero3_mode(self, mode):
        self._zero3_gather = mode
        for c in self._parts:
            c.zero3_mode = mode

    def _zero3_only(self, what):
        if not any(c.step.zero3 for c in self._parts):
            raise ZoptError(Status.BAD_STATE,
                            f"{what}: no class's step is ZeRO-3 (their params are the "
                            "model's own memory, always current)" if self._mapped else
                            f"{what}: step '{self.step_obj.name}' is not ZeRO-3 (its params "
                            "are the model's own memory, always current)")

    @_exclusive("gather_params")
    def gather_params(self, params=None):
        """ZeRO-3: writes the current full params (``params``, default all)
        into the model's parameter storage, re-allocating released storage.
        Collective: every rank calls it with the same params. For other
        steps the params are always current and this does nothing."""
        self._check_open()
        for c, lts in self._by_part(params):
            c.gather_params(lts)

    @_exclusive("release_params")
    def release_params(self, params=None):
        """ZeRO-3: frees the storage of ``params`` (default all) while
        keeping their shape; :meth:`gather_params` brings them back. A param
        that shares its storage with other tensors is kept. Local."""
        self._zero3_only("release_params")
        for c, lts in self._by_part(params):
            if c.step.zero3:
                _params.release(c, lts)

    @property
    def released_params(self):
        return [c.entries[t].param for c in self._parts for t in sorted(c.released)]


class _RemovableHandle:
    def __init__(self, hooks, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class MixedOptimizer(Optimizer):
    """The class of an optimizer built from a step mapping (``zopt.Optimizer(
    {dtype: step}, ...)``): a name kept for compatibility; everything is
    :class:`Optimizer`'s."""


_torch_compat.patch_class(Optimizer)

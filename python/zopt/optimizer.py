"""zopt.Step and zopt.Optimizer: a torch.optim.Optimizer over the C API.

``zopt.Optimizer`` subclasses ``torch.optim.Optimizer`` when torch is
importable (and ``object`` otherwise, for numpy-only use). The runtime
(``zopt_optimizer``, "the native optimizer") holds the states; this class
keeps torch's view of them: ``param_groups`` with the tensors and
hyperparameters (edited by hand or by any ``torch.optim.lr_scheduler``),
``state[p]`` (the per-param states under torch's keys: copies, written
through to the runtime),
``state_dict()`` / ``load_state_dict()`` in torch's layout, ``zero_grad``,
``step(closure)``. See docs/USAGE.md for the semantics in full; the
non-obvious parts:

Gradients. The runtime reads gradients from memory registered when the
native optimizer is built. For a torch param given alone (the usual case)
the binding allocates that memory itself (one flat buffer per dtype and
device, one view per param, strided like the param) and never attaches it
to a param that has no gradient: a param whose ``.grad`` is None at
``step()`` (frozen, unused, or after ``zero_grad(set_to_none=True)``) is
left alone exactly like torch (no decay, no moment update, its step count
does not advance), through ``zopt_optimizer_set_active``. GPU steps have
no such skip (their kernels update every tensor they hold, counting steps
per group): a torch param that does not require grad when the optimizer is
built is left out of the native optimizer (no memory; ``state[p]`` stays
empty; never written), and joins it once it has a gradient at a step
(unfrozen), with zero states and step 0 like torch's lazily made state (in
a native group of its own, so its step count is its own); a held param
without a gradient at a step is an error naming it. A ``.grad`` that
is another tensor (e.g. fresh from backward) is copied into the param's
view, and the view becomes ``p.grad`` (same values), so later backwards
accumulate into it in place and ``zero_grad()`` is one fill per buffer.

User writes into params. For steps whose weight the runtime holds (an f32
master of bf16/f16 params; ZeRO-3's sharded params) a write into the
params after the optimizer was built would be lost at the next step. Before
each step the binding checks, per param: ``p._version`` (bumped by
in-place ops on the param itself: ``model.load_state_dict``, ``p.copy_()``
under ``no_grad``), ``p.data_ptr()`` (``p.data = new``: the native
optimizer is rebuilt around the new storage, states kept) and a few
sampled elements against what the last step wrote (``p.data.copy_()``,
numpy writes); a change makes the master again the params
(``zopt_optimizer_refresh_master``). Writes that miss every sampled element
(a slice through ``p.data``) need ``opt.refresh_master()``. The other way
round, ``load_state_dict()`` / ``load()`` of a state with a master write
round(master) into params that disagree with it (a MasterWeightsWarning):
model and master agree after every load.
"""
from __future__ import annotations

import collections.abc
import contextlib
import ctypes
import math
import operator
import os
import tempfile
import time
import weakref

import numpy as np

from . import _ckpt, _dtypes, _lib, _strided, _torch_compat
from ._calls import exclusive as _exclusive, lock_of as _lock_of
from ._collective import collective_errors
from ._lib import (DType, StateKind, Status, ZoptError, check, lib, DTYPE_ITEMSIZE,
                   DTYPE_NAMES, HYPER_BY_NAME, STATE_NAMES)
from ._watch import Sampler
from ._warnings import warn_user
# Moved out (issue 17): dtypes and storage bits, the loaded step, group
# hyperparameters, GPU streams and allocator; the names this module and
# zopt.mixed use.
from ._dtypes import (KIND_OF_KEY, NP_DTYPES as _NP_DTYPES, NP_OF as _NP_OF,  # noqa: F401
                      PLACE_GPU as _PLACE_GPU, TORCH_KEY, f32_of_bits as _f32_of_bits,
                      from_bits as _from_bits, is_rounding_of as _is_rounding_of,
                      is_torch as _is_torch, kind as _kind, np_bits as _np_bits,
                      round_bits as _round_bits, torch_dtypes as _torch_dtypes,
                      torch_of as _torch_of)
from ._gpu import (DeviceAllocatorC as _DeviceAllocatorC, GpuGroup as _GpuGroup,  # noqa: F401
                   TorchAllocator as _TorchAllocator,
                   set_device_allocator as _set_device_allocator)
from ._hypers import (bool_hyper as _bool_hyper, frozen as _frozen,  # noqa: F401
                      groups_arg as _groups_arg, maximize as _maximize, slots as _slots)
from ._step import Step  # noqa: F401

try:  # torch is optional
    import torch
    _Base = torch.optim.Optimizer
except Exception:  # pragma: no cover
    torch = None
    _Base = object

_UNSET = object()
_is = operator.is_
_version_of = operator.attrgetter("_version")
_grad_of = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr if torch is not None else None


def _ptrs_of(grads):
    """data_ptr() of each gradient, 0 for None."""
    try:
        return list(map(_data_ptr, grads))  # the usual case: every param has one
    except TypeError:
        return [0 if g is None else g.data_ptr() for g in grads]


_dense = _strided.dense


def _untrained(p):
    """A torch param that is not trained now: requires_grad=False and no
    gradient (``.grad``, or an f32 ``.main_grad``)."""
    return (not p.requires_grad and p.grad is None
            and getattr(p, "main_grad", None) is None)


def _has_grad(p):
    return p.grad is not None or getattr(p, "main_grad", None) is not None


def _file_tensor_groups(path):
    """(native groups, [native group of each tensor]) from the header of a
    world-size-1 checkpoint file (format 2, _ckpt.read_tensor_table); None
    for another format or a file that cannot be read."""
    import struct
    try:
        t = _ckpt.read_tensor_table(path)
    except (OSError, ValueError, struct.error):
        return None
    if t is None:
        return None
    _name, _world, ngroups, table = t
    return ngroups, [g for g, _ in table]


class MasterWeightsWarning(UserWarning):
    """``load_state_dict()`` / ``load()`` of an optimizer state with a
    master replaced params whose values disagreed with it (the optimizer
    checkpoint's master weights won over the model's current ones)."""


def _warn_master_replaced(what, changed, total):
    warn_user(
        f"zopt: {what}: the optimizer state's master weights disagree with the model's "
        f"current weights in {changed} of {total} params; those params now hold the "
        "optimizer checkpoint's master weights (rounded), replacing the model's values. "
        "To keep the model's weights instead, load them after the optimizer state "
        "(model.load_state_dict after opt.load_state_dict): the master is then made "
        "again from them.", MasterWeightsWarning)


class _Lent:
    """A state tensor handed out by ``opt.state[p]`` (or assigned to it):
    in-place changes to it are written back while it is current. Held
    strongly until the optimizer's next call (``opt.state[p]['exp_avg']
    .zero_()`` drops the tensor at once), weakly after."""
    __slots__ = ("ref", "strong", "ver", "t", "key", "steps", "epoch", "stale")

    def __init__(self, x, t, key, steps, epoch):
        self.ref, self.strong, self.ver = weakref.ref(x), x, x._version
        self.t, self.key = t, key
        self.steps, self.epoch, self.stale = steps, epoch, False


# ---- hyperparameters of a group ------------------------------------------

# ---- GPU steps: streams, hyperparameter pushes, torch's allocator ---------

class _RemovableHandle:
    def __init__(self, hooks, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class _Entry:
    """One registered tensor."""
    __slots__ = ("param", "grad", "auto", "torch", "cuda", "numel", "group",
                 "pptr", "gptr", "nbytes", "gbytes", "shape", "stride", "name",
                 "frozen", "dense")

    def __repr__(self):
        return f"<{self.name}>"


class _ParamState(collections.abc.MutableMapping):
    """``opt.state[p]``: the states of one param under torch's keys, read
    from the runtime at each access (CPU copies, in each state's storage
    dtype, strided like the param) and written through to it:

    * ``state[p][key] = value`` writes the runtime's state at once (a
      tensor or array of the param's shape, any float dtype: converted to
      the state's storage dtype; ``'step'``: a count). A torch tensor
      assigned stays tied to the state like one read from it (below).
    * In-place changes (``state[p]['exp_avg'].zero_()``) to a tensor read
      from (or assigned to) a state are written back at the optimizer's
      next call (``step()``, a state read, ``state_dict()``, ``save()``,
      ...), as long as the runtime has not changed that state since
      (a step, a load, another write of it); a change made to such an
      outdated copy is not written back, and a warning says so when it is
      seen (within a step).
    * Writing ``'master'`` also writes round(master) into the param, so
      model and master agree.

    ``{}`` (no keys) before the param's first step, as in torch; an
    assignment works then too. ``dict(state[p])``, ``copy.deepcopy`` and
    pickling give a plain dict of copies."""

    __slots__ = ("_ref", "_t")

    def __init__(self, opt, t):
        self._ref = weakref.ref(opt)
        self._t = t

    @property
    def _opt(self):
        o = self._ref()
        if o is None:
            raise ZoptError(Status.BAD_STATE, "the optimizer of this state was freed")
        return o

    def __getitem__(self, key):
        return self._opt._state_get(self._t, key)

    def __setitem__(self, key, value):
        self._opt._state_set(self._t, {key: value})

    def __delitem__(self, key):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"del opt.state[p][{key!r}]: the runtime keeps every state of the "
                        "step; assign new values (opt.state[p][key] = t), or reset the "
                        "param with opt.state[p] = {} (or del opt.state[p])")

    def __contains__(self, key):
        return key in self._opt._state_keys(self._t)

    def __iter__(self):
        return iter(self._opt._state_keys(self._t))

    def __len__(self):
        return len(self._opt._state_keys(self._t))

    def update(self, *args, **kw):
        """Writes every entry, all checked before any is written."""
        self._opt._state_set(self._t, dict(*args, **kw))

    def clear(self):
        """Resets the param's states (as ``opt.state[p] = {}``)."""
        self._opt._state_assign(self._t, {})

    def copy(self):
        return dict(self.items())

    def __copy__(self):
        return dict(self.items())

    def __deepcopy__(self, memo):
        import copy
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def __repr__(self):
        return repr(dict(self.items()))


class _StateView(collections.abc.MutableMapping):
    """``opt.state``: param -> :class:`_ParamState` (its states under torch's
    keys, written through to the runtime). ``opt.state[p] = mapping``
    replaces the param's states: the mapping's entries are written, every
    other state is reset (moments zero, step 0, the master made from the
    param), all checked before anything is written; ``opt.state[p] = {}``
    and ``del opt.state[p]`` reset the param, as in torch (its next step
    starts afresh)."""

    def __init__(self, opt):
        self._ref = weakref.ref(opt)  # no cycle: the optimizer is freed by refcount

    @property
    def _opt(self):
        return self._ref()

    def _tid_of(self, p):
        t = self._opt._tid_map.get(id(p))
        if t is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "opt.state[p]: p is not a param of this optimizer")
        return t

    def __getitem__(self, p):
        t = self._opt._tid_map.get(id(p))
        if t is None:
            return {}
        return _ParamState(self._opt, t)

    def __setitem__(self, p, value):
        if not isinstance(value, collections.abc.Mapping):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"opt.state[p] = {type(value).__name__}: assign a mapping of "
                            "states ({'step': ..., 'exp_avg': ...}; {} resets the param)")
        self._opt._state_assign(self._tid_of(p), dict(value))

    def __delitem__(self, p):
        self._opt._state_assign(self._tid_of(p), {})

    def __contains__(self, p):
        t = self._opt._tid_map.get(id(p))
        return t is not None and self._opt._tensor_step(t) > 0

    def _with_state(self):
        return [e.param for t, e in enumerate(self._opt._entries)
                if self._opt._tensor_step(t) > 0]

    def __iter__(self):
        return iter(self._with_state())

    def __len__(self):
        return len(self._with_state())

    def clear(self):
        """Resets every param's states (``opt.state = {}`` does the same)."""
        for p in self._with_state():
            del self[p]

    def _replace(self, value):
        """``opt.state = mapping``: every param's states replaced, as by
        ``opt.state[p] = mapping.get(p, {})`` (all checked first)."""
        opt = self._opt
        if not isinstance(value, collections.abc.Mapping):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"opt.state = {type(value).__name__}: assign a mapping "
                            "{param: {state: value}} ({} resets every param)")
        given = {}
        for p, v in value.items():
            if not isinstance(v, collections.abc.Mapping):
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"opt.state = ...: a param's states are a "
                                f"{type(v).__name__}, not a mapping")
            given[self._tid_of(p)] = dict(v)
        for t in given:  # refused before anything is written
            opt._state_values(t, given[t])
        for t in range(len(opt._entries)):
            if t in given or opt._tensor_step(t) > 0:
                opt._state_assign(t, given.get(t, {}))

    def __repr__(self):
        return f"<zopt state of {len(self)} params (read from and written to the runtime)>"


class Optimizer(_Base):
    """A ``torch.optim.Optimizer`` running a compiled zopt step.

    ``step``: a :class:`Step` or the path of a step.so. ``params``: like
    torch: an iterable of tensors or of dicts (param groups) with
    ``'params'`` and per-group hyperparameters ``lr``, ``betas=(beta1,
    beta2)``, ``eps``, ``weight_decay``, ``momentum``, ``dampening``,
    ``bias_correction`` (bool). Besides torch tensors (whose ``.grad`` is
    the gradient), a tensor entry may be a ``(param, grad)`` pair of numpy
    arrays or torch tensors (the grad memory is the user's and is always
    read). dtypes must be the step's param dtype; bf16 numpy arrays are
    uint16 bit patterns (zopt.bf16). Hyperparameters not given take the
    step's defaults; a hyperparameter the step has no slot for is an error.

    Ranks: ``process_group=`` (a torch.distributed ProcessGroup, e.g. gloo)
    or ``comm=`` (a :class:`zopt.comm.Comm`) runs the step across the
    group's ranks (ZeRO per the step's description); ``grad_divisor``
    (default: the world size, i.e. the mean over ranks) and
    ``bucket_elems`` as in zopt.h. ``zero3_gather``: for ZeRO-3 steps,
    "step" (default) gathers the params into the model after every step;
    "manual" leaves that to :meth:`gather_params`; :func:`zopt.zero3_hooks`
    sets "hooks" (gathered per module, released after use and after the
    step). ``grad_streaming=True`` (ZeRO-2/3 CPU steps, torch CPU params):
    backward hooks hand the gradients to the runtime bucket by bucket and
    free each ``p.grad`` once reduced (:mod:`zopt.streaming`); ``p.grad``
    is None after ``step()``; accumulate micro-batches inside
    :meth:`no_sync`.

    Gradients accumulated in f32 (a step built with ``grad="f32"`` for
    bf16/f16 params: DeepSpeed's bf16 layout, Megatron's ``main_grad``):
    torch keeps ``p.grad`` in the param's dtype, so a param's f32 gradient
    is ``p.main_grad`` (Megatron-Core's convention: an f32 tensor of the
    param's shape). A ``main_grad`` the user or a framework attached is read
    in place; without one the optimizer accumulates ``p.grad`` into an f32
    buffer of its own, exposed as ``p.main_grad``, and sets ``p.grad`` to
    None: ``grad_accumulation="hooks"`` (default) does it in a hook after
    each backward's gradient of the param is computed (DeepSpeed's way: no
    micro-batch ever accumulates in bf16), ``"manual"`` when you call
    :meth:`accumulate_grads` (after each micro-batch's backward) and at
    ``step()`` for what is left.

    ``step`` may also be a mapping ``{dtype: Step or path}`` (keys: torch
    dtypes or "f32"/"bf16"/"f16"; ``zopt.steps.<rule>(..., classes=...)``
    returns one): params of several dtypes, each routed to the step of its
    dtype, stepped as one (:class:`zopt.mixed.MixedOptimizer`: one global
    norm, one skip decision).

    GPU and offloaded steps (docs/GPU.md, "What the Python binding does"):
    the native optimizer is created with the params' device current; every
    call that enqueues or reads runs on torch's current stream of that
    device (``zopt_optimizer_set_stream`` before it), so reads after a CUDA
    graph replay are ordered after it. For GPU steps a hyperparameter
    assigned in ``param_groups`` (an lr scheduler) is written to the device
    at once, outside captures (each graph replay uses the value set before
    it); assigning a changed value inside a capture raises. An offloaded
    step cannot be captured: ``step()`` inside ``torch.cuda.graph`` raises.
    ``device_allocator``: where a GPU step's buffers come from: ``"torch"``
    (the default when torch has CUDA: torch's caching allocator, one pool
    with torch's tensors) or ``"driver"`` (``cuMemAlloc``, outside torch's
    cache: finalize can fail with out of memory while torch holds cached
    blocks; ``torch.cuda.empty_cache()`` returns them).

    Frozen params of GPU steps (no per-tensor skip on the GPU yet): params
    given alone with ``requires_grad=False`` (and no gradient) when the
    native optimizer is built are left out of it (kept in ``param_groups``;
    ``state[p]`` empty; never written; any dtype). One that later has a
    gradient at ``step()`` (``requires_grad_(True)`` and a backward) joins
    it: the native optimizer is rebuilt keeping every state, and the param
    starts with zero states and step 0, as torch's lazily created state.
    A param that requires grad but has no gradient at a step raises a
    ZoptError naming it (nothing is updated); CPU and offloaded steps skip
    such params as torch does.
    """

    # GPU steps' frozen params (see __init__); empty for other steps
    _excluded = frozenset()
    _cohort_gid = ()
    _cohort_of = {}
    _gpu_missing = ()
    _native_G = 0

    _streamer = None  # grad_streaming=True: a zopt.streaming.GradStreamer
    _rank_checks = None  # world size > 1: a zopt._ranks.RankChecks
    _begun = False  # clip_grad_norm_ began the step (zopt._clip)

    def __new__(cls, step=None, params=None, **kw):
        if cls is Optimizer and isinstance(step, collections.abc.Mapping):
            if kw.get("grad_streaming"):
                raise ZoptError(Status.UNSUPPORTED, "grad_streaming=True: not for a step per "
                                "dtype (a mapping); streaming is implemented for one step")
            from .mixed import MixedOptimizer
            return super().__new__(MixedOptimizer)
        return super().__new__(cls)

    def __init__(self, step, params, *, lr=None, betas=None, eps=None,
                 weight_decay=None, momentum=None, dampening=None,
                 bias_correction=None, maximize=None, num_threads=None, loss_scaler=None,
                 seed=None, process_group=None, comm=None, grad_divisor=None,
                 bucket_elems=None, zero3_gather="step", grad_accumulation="hooks",
                 device_allocator=None, grad_streaming=False, timeout=None):
        self._h = None
        self._streams = False   # GPU/offloaded: torch's current stream before each call
        self._offload = False   # offloaded step (refused inside a graph capture)
        self._mute_groups = False
        if not isinstance(step, Step):
            step = Step(step)
        self.step_obj = step
        self._lib = lib()
        if device_allocator not in (None, "torch", "driver"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"device_allocator={device_allocator!r}: 'torch' (torch's caching "
                            "allocator) or 'driver' (cuMemAlloc)")
        self._device_allocator = device_allocator
        self._dev_alloc = None
        self._num_threads = num_threads
        self._bucket_elems = bucket_elems
        self._grad_divisor = grad_divisor
        self._seed = seed
        self._scaler_cfg = None
        self._metrics_hooks = []
        self.last_metrics = None
        self.last_result = None
        self.last_grad_norm = float("nan")
        self.last_skipped = False
        self.last_loss_scale = 1.0
        self.last_loss = None
        self.steps_taken = 0
        self.refreshes = 0
        self.rebuilds = 0
        if zero3_gather not in ("step", "manual", "hooks"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"zero3_gather={zero3_gather!r}: 'step', 'manual' or 'hooks'")
        self._zero3_mode = zero3_gather
        self._released = set()  # ZeRO-3: tensor ids whose storage is freed
        # GPU steps (no per-tensor skip on the device): tensor ids left out
        # of the native optimizer (frozen when registered: an empty slot
        # there, no memory, never read or written), and the extra native
        # groups of params that joined later (their own step count).
        self._excluded = set()
        self._cohort_gid = []   # per extra native group: its param group
        self._cohort_of = {}    # tensor id -> its extra native group
        self._gpu_missing = []  # tensor ids held without a gradient now
        if grad_accumulation not in ("hooks", "manual"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"grad_accumulation={grad_accumulation!r}: 'hooks' or 'manual'")
        self._grad_accumulation = grad_accumulation
        self._main = step.f32_grads  # gradients from p.main_grad (f32)
        self._acc_hooks = []    # (AccumulateGrad node, hook handle) per param
        # tensor id -> (the user's tensor or None, its pointer): the runtime
        # reads this tensor's gradient from user memory (a main_grad, or a
        # fresh p.grad registered without a copy), not from our own buffer
        self._foreign = {}
        # Communicator (ranks): process_group= gets a gloo group of its own
        self._own_comm = False
        self._comm = None
        from ._ranks import make_comm
        self._comm, self._own_comm = make_comm(process_group, comm, timeout)
        # Defaults: every slot of the step, from the keywords or the step.
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                  momentum=momentum, dampening=dampening,
                  bias_correction=bias_correction, maximize=maximize)
        given = {k: v for k, v in kw.items() if v is not None}
        bad = [k for k in _slots(given, step.hypers) if k not in step.hypers]
        if bad:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"step '{step.name}' has no hyperparameter "
                            f"{', '.join(sorted(set(bad)))} (its slots: "
                            f"{', '.join(step.hypers)})")
        self.defaults = self._complete_group(given)
        _torch_compat.init_base(self)  # hook dicts, the step wrapper (torch 1.13 and 2.x)
        self.param_groups = []
        self._entries = []
        self._grad_flats = []
        self._state_view = _StateView(self)
        groups = _groups_arg(params)
        if not groups:
            raise ZoptError(Status.INVALID_ARGUMENT, "optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        try:
            new = []
            for g in groups:
                new += self._add_group_py(g)
            new = self._exclude_frozen(new)
            self._check_overlaps()
            if grad_streaming:  # no grad memory of ours: the runtime holds the shards
                from .streaming import GradStreamer
                self._streamer = GradStreamer(self)
            else:
                self._alloc_grads(new)
            if loss_scaler is not None:
                self._scaler_cfg = self._scaler_config(**loss_scaler)
            self._build_native()
            if self.world_size > 1 and torch is not None:  # DDP, per-rank clippers
                from ._ranks import RankChecks
                self._rank_checks = RankChecks(self)
            self._add_acc_hooks(new)
        except BaseException:
            self._free()
            raise

    # ---- groups and tensors (Python side) ----------------------------------
    def _complete_group(self, g):
        """A group's hyperparameters with every slot of the step filled in
        (the step's defaults), as torch keys ('betas' a pair)."""
        hyp = self.step_obj.hypers
        out = dict(g)
        if "beta1" in hyp or "beta2" in hyp:
            if "betas" not in out:
                b1 = out.pop("beta1", hyp.get("beta1", (0.0,))[0])
                b2 = out.pop("beta2", hyp.get("beta2", (0.0,))[0])
                out["betas"] = (float(b1), float(b2))
            else:
                out["betas"] = tuple(float(b) for b in out["betas"])
        for name, (dflt, _, _, _) in hyp.items():
            if name in ("beta1", "beta2") or name in out:
                continue
            out[name] = bool(dflt) if name == "bias_correction" else float(dflt)
        if "bias_correction" in out:
            out["bias_correction"] = bool(_bool_hyper("bias_correction", out["bias_correction"]))
        out["maximize"] = _maximize(out)  # torch's per-group flag (a runtime group flag)
        return out

    def _add_group_py(self, g):
        """Validates a param group, appends it to param_groups and its
        tensors to the entries; returns the new entries."""
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
        extra = {k: v for k, v in g.items() if k != "params"}
        if names is not None:
            extra["param_names"] = names
        self._check_rule_flags(extra, f"param group {len(self.param_groups)}")
        bad = [k for k in _slots(extra, self.step_obj.hypers) if k not in self.step_obj.hypers]
        if bad:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"param group {len(self.param_groups)}: step "
                            f"'{self.step_obj.name}' has no hyperparameter "
                            f"{', '.join(sorted(set(bad)))}")
        group = dict(self.defaults)
        group.update(extra)
        group = self._complete_group(group)
        _slots(group, self.step_obj.hypers)  # validates (betas, bias_correction)
        gid = len(self.param_groups)
        new = []
        seen = {id(e.param) for e in self._entries}
        names = getattr(self, "_index_names", None)  # a class of a MixedOptimizer
        for i, p in enumerate(ps):
            e = self._entry(gid, names[gid][i] if names else i, p)
            if id(e.param) in seen:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name} appears twice in the optimizer's params")
            seen.add(id(e.param))
            new.append(e)
        group["params"] = [e.param for e in new]
        if self.step_obj.gpu:
            group = _GpuGroup(self, group)
        self.param_groups.append(group)
        self._entries.extend(new)
        return new

    def _entry(self, gid, i, p):
        e = _Entry()
        e.group = gid
        e.dense = None  # a strided param's registered dense copy (_layout)
        if isinstance(p, (tuple, list)):
            if len(p) != 2:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                "a tensor entry must be a param or a (param, grad) pair")
            param, grad = p
            e.auto = False
        elif _is_torch(p):
            param, grad = p, None
            e.auto = True
        elif isinstance(p, np.ndarray):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "numpy params need their gradient: pass (param, grad) pairs")
        else:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"unsupported parameter type {type(p).__name__}")
        e.param, e.grad = param, grad
        e.torch = _is_torch(param)
        e.name = f"param_groups[{gid}]['params'][{i}]"
        if e.torch:
            e.name += f" (shape {tuple(param.shape)}, {str(param.dtype).replace('torch.', '')})"
            if not e.auto and not _is_torch(grad):
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name}: a torch param's grad must be a torch tensor")
            if e.auto and not (param.is_leaf or param.retains_grad):
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name}: can't optimize a non-leaf tensor")
        # GPU steps: a torch param that does not require grad (and has no
        # gradient) is left out of the native optimizer (_exclude_frozen);
        # it is checked like any param when it joins (_include_unfrozen).
        e.frozen = self.step_obj.gpu and e.auto and e.torch and _untrained(param)
        if e.frozen:
            try:
                self._layout(e)
            except ZoptError:  # another dtype, not dense, ...: never read while left out
                e.pptr, e.numel, e.nbytes, e.gbytes = 0, param.numel(), 0, 0
                e.cuda = param.device.type == "cuda"
                e.shape, e.stride = tuple(param.shape), tuple(param.stride())
        else:
            self._layout(e)
        if not e.auto:
            numel, gwant = e.numel, self.step_obj.grad_dtype
            gptr, gn, gdt = self._buffer(grad, e.name + "'s grad")
            if gn != numel:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{e.name}: param has {numel} "
                                f"elements but its grad has {gn}")
            if gdt != gwant:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name}: grad dtype {DTYPE_NAMES.get(gdt)}, but the "
                                f"step's gradients are {DTYPE_NAMES.get(gwant)} (step "
                                f"'{self.step_obj.name}')")
            if e.torch and _is_torch(grad) and grad.stride() != param.stride() \
                    and numel > 1 and not (param.is_contiguous() and grad.is_contiguous()):
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name}: param and grad have other memory layouts "
                                f"(strides {param.stride()} vs {grad.stride()})")
            e.gptr = gptr
        else:
            e.gptr = None
        return e

    def _layout(self, e):
        """e's param memory, size and layout, checked against the step. A
        strided (non-dense) torch param gets a dense copy, registered in its
        place (zopt/_strided.py); its gradient and states are contiguous."""
        want = self.step_obj.param_dtype
        param = e.param
        e.dense = None
        why = None
        if e.torch and param.numel() and not _dense(param):
            why = _strided.unsupported(self.step_obj, e)
            if why is None:
                e.dense = _strided.make_copy(param)
        pptr, numel, dt = self._buffer(param if e.dense is None else e.dense, e.name,
                                       strided_why=why)
        if dt != want:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: dtype {DTYPE_NAMES.get(dt)} does not match the "
                            f"step's param dtype {DTYPE_NAMES.get(want)} (step "
                            f"'{self.step_obj.name}')")
        e.pptr, e.numel = pptr, numel
        e.nbytes = numel * DTYPE_ITEMSIZE[dt]
        e.cuda = e.torch and param.device.type == "cuda"
        e.shape = tuple(param.shape)
        e.stride = tuple((param if e.dense is None else e.dense).stride()) if e.torch else None
        e.gbytes = numel * DTYPE_ITEMSIZE[self.step_obj.grad_dtype]

    @staticmethod
    def _buffer(x, what, strided_why=None):
        """(data pointer, numel, zopt dtype) of a numpy array / torch tensor
        (``strided_why``: why a strided param cannot be stepped here)."""
        if _is_torch(x):
            if x.device.type not in ("cpu", "cuda"):
                raise ZoptError(Status.UNSUPPORTED, f"{what} is on {x.device}; "
                                "only CPU and CUDA tensors are supported")
            if x.is_sparse:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is sparse")
            dt = _torch_dtypes().get(x.dtype)
            if dt is None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: dtype {x.dtype} is not f32/bf16/f16")
            if x.numel() and not _dense(x):
                why = f" ({strided_why})" if strided_why else ""
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what} is not dense in memory (strides {tuple(x.stride())} "
                                f"for shape {tuple(x.shape)}: a strided or expanded view), "
                                f"which this optimizer cannot step{why}; "
                                "pass a tensor that owns its memory, e.g. "
                                "`p.data = p.data.contiguous()` before building the optimizer")
            return (x.data_ptr() if x.numel() else 0), x.numel(), dt
        if isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is not C-contiguous")
            if not x.flags.writeable:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is read-only")
            dt = _NP_DTYPES.get(x.dtype)
            if dt is None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: dtype {x.dtype} is not float32, float16 or "
                                "uint16 (bf16 bit patterns)")
            return (x.ctypes.data if x.size else 0), x.size, dt
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{what}: expected a numpy array or torch tensor, got "
                        f"{type(x).__name__}")

    def _check_overlaps(self):
        """Params (and explicit grads) must not share memory: two views of
        one storage would be updated twice per step."""
        _strided.check_spans([e for t, e in enumerate(self._entries)
                      if e.numel and t not in self._released and t not in self._excluded])

    def _alloc_grads(self, entries):
        """The gradient memory of torch params given alone: one flat buffer
        per (dtype, device), one view per param strided like it (64-byte
        aligned), in the step's gradient dtype. Never attached to a param
        before it has a gradient (as ``p.grad``, or for f32 gradients of
        bf16/f16 params as ``p.main_grad``)."""
        by = {}
        gdt = _torch_of(self.step_obj.grad_dtype) if torch is not None else None
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
            self._grad_flats.append(flat)
            for e, o in zip(es, offs):
                v = flat[o:o + e.numel]
                e.grad = v.as_strided(e.shape, e.stride) if e.numel else v.view(e.shape)
                e.gptr = e.grad.data_ptr() if e.numel else 0

    # ---- GPU steps: frozen params left out, joining when trained -------------
    def _exclude_frozen(self, new):
        """GPU steps: the new entries (the last ``len(new)`` ones) that are
        frozen (a torch param given alone with requires_grad=False and no
        gradient) are left out of the native optimizer: GPU kernels have
        no per-tensor skip, so a param the runtime holds must have a
        gradient at every step. Returns the entries that are held."""
        base = len(self._entries) - len(new)
        held = []
        for i, e in enumerate(new):
            if e.frozen:
                self._excluded.add(base + i)
            else:
                held.append(e)
        return held

    def _include_unfrozen(self):
        """GPU steps: params left out that now have a gradient (unfrozen:
        ``requires_grad_(True)`` and a backward) join the native optimizer,
        rebuilt keeping every state. They start like torch's lazily created
        state: zero states, step 0 (in a native group of their own when
        their param group has stepped already: GPU steps count steps per
        group)."""
        ents = self._entries
        new = [t for t in sorted(self._excluded) if _has_grad(ents[t].param)]
        if not new:
            return False
        for t in new:  # checked as any param is (dtype, layout, memory)
            e = ents[t]
            e.name = e.name.split(" (shape ")[0] + (
                f" (shape {tuple(e.param.shape)}, {str(e.param.dtype).replace('torch.', '')})")
            self._layout(e)
        self._prepare()
        snap = self._snapshot()
        self._pre_rebuild()
        old = (set(self._excluded), list(self._cohort_gid), dict(self._cohort_of))
        n_flats = len(self._grad_flats)
        try:
            self._excluded.difference_update(new)
            for e in (ents[t] for t in new):
                e.frozen = False
            self._check_overlaps()
            by_group = {}
            for t in new:
                by_group.setdefault(ents[t].group, []).append(t)
            for gid, ts in by_group.items():
                if snap["native_steps"][gid]:  # the group has stepped: a group of their own
                    c = len(self._cohort_gid)
                    self._cohort_gid.append(gid)
                    for t in ts:
                        self._cohort_of[t] = c
            self._alloc_grads([ents[t] for t in new])
            self._build_native()
        except BaseException:
            self._excluded, self._cohort_gid, self._cohort_of = old
            del self._grad_flats[n_flats:]
            for t in new:
                ents[t].frozen, ents[t].grad, ents[t].gptr = True, None, None
            raise
        self._restore(snap)
        self._add_acc_hooks([ents[t] for t in new])
        self.rebuilds += 1
        return True

    def _ngroup(self, t):
        """The native group of tensor t: its param group's, or the extra one
        it joined in (GPU steps, _include_unfrozen)."""
        c = self._cohort_of.get(t)
        return self._entries[t].group if c is None else self._native_G + c

    def _native_gids(self, gid):
        """The native groups of param group gid."""
        if not self._cohort_gid:
            return (gid,)
        return (gid,) + tuple(self._native_G + c for c, g in enumerate(self._cohort_gid)
                              if g == gid)

    def _cohorts_by_steps(self, steps, gsteps):
        """GPU steps (one step count per native group): the extra native
        groups that give every held tensor its own count ``steps[t]``: a
        tensor whose count is not its param group's ``gsteps[g]`` goes to
        the extra group of (g, count). Returns (cohort_gid, cohort_of)."""
        gid_of, cohort_of, key_of = [], {}, {}
        for t, e in enumerate(self._entries):
            if t in self._excluded or steps[t] == gsteps[e.group]:
                continue
            c = key_of.setdefault((e.group, steps[t]), len(gid_of))
            if c == len(gid_of):
                gid_of.append(e.group)
            cohort_of[t] = c
        return gid_of, cohort_of

    @staticmethod
    def _partition(cohort_of):
        by = {}
        for t, c in cohort_of.items():
            by.setdefault(c, set()).add(t)
        return {frozenset(ts) for ts in by.values()}

    def _regroup(self, cohorts):
        """Rebuilds the native optimizer with other extra native groups
        (cohort_gid, cohort_of); returns what :meth:`_undo_regroup` needs
        to put the old one back (a snapshot of every state)."""
        snap = self._snapshot()
        self._pre_rebuild()
        old = (self._cohort_gid, self._cohort_of)
        self._cohort_gid, self._cohort_of = list(cohorts[0]), dict(cohorts[1])
        try:
            self._build_native()
        except BaseException:
            self._cohort_gid, self._cohort_of = old
            raise
        self.rebuilds += 1
        return snap, old

    def _undo_regroup(self, snap, old):
        self._cohort_gid, self._cohort_of = old
        self._build_native()
        self._restore(snap)
        self.rebuilds += 1

    def _check_held(self, t, what):
        if t in self._excluded:
            raise ZoptError(
                Status.INVALID_ARGUMENT,
                f"{what}: {self._entries[t].name} is left out of the optimizer's native "
                f"state: step '{self.step_obj.name}' updates on the GPU and the param did not "
                "require grad when the optimizer was built, so it has no states (as torch's "
                "opt.state[p] is empty for a param never stepped). It gets fresh states when "
                "it is trained: requires_grad_(True) and a gradient at a step")

    # ---- the native optimizer ----------------------------------------------
    def _build_native(self):
        """Creates and finalizes a native optimizer over the current groups
        and tensors (collective at world size > 1); frees the old one."""
        devs = [e.param.device for e in self._entries if e.cuda]
        self._device = devs[0] if devs else None  # the params' device (torch)
        self._on_cuda = bool(devs) or self.step_obj.on_device
        self._streams = self._on_cuda and torch is not None and torch.cuda.is_available()
        self._offload = self._streams and not self.step_obj.gpu
        with self._device_current():
            self._create_native()

    def _device_current(self):
        """``torch.cuda.device(params' device)``: the runtime takes the
        context current at create (PyTorch's, of that device)."""
        if self._device is not None:  # the device of the first CUDA param
            return torch.cuda.device(self._device)
        return contextlib.nullcontext()

    def _create_native(self):
        L = self._lib
        h = ctypes.c_void_p()
        check(L.zopt_optimizer_create(self.step_obj._h, ctypes.byref(h)),
              "zopt_optimizer_create")
        try:
            if self._streams:
                # finalize's copies and INIT (which reads the params) and
                # torch's allocator: on the current stream
                self._use_stream(h)
            if self.step_obj.gpu:
                self._attach_allocator(h)
            if self._num_threads is not None:
                check(L.zopt_optimizer_set_num_threads(h, int(self._num_threads)),
                      "set_num_threads")
            if self._comm is not None:
                check(L.zopt_optimizer_set_comm(h, self._comm._handle()),
                      "zopt_optimizer_set_comm")
            if self._bucket_elems is not None:
                check(L.zopt_optimizer_set_bucket_elems(h, int(self._bucket_elems)),
                      "set_bucket_elems")
            if self._streamer is not None:
                self._streamer.configure(h)
            if self._grad_divisor is not None:
                check(L.zopt_optimizer_set_grad_divisor(h, float(self._grad_divisor)),
                      "set_grad_divisor")
            # native groups: one per param group, then the extra groups of
            # params that joined a GPU step later (_include_unfrozen)
            G = len(self.param_groups)
            for ng, gid in enumerate(list(range(G)) + list(self._cohort_gid)):
                g = ctypes.c_int()
                check(L.zopt_optimizer_add_group(h, ctypes.byref(g)), "zopt_optimizer_add_group")
                for name, val in _slots(self.param_groups[gid], self.step_obj.hypers).items():
                    _lib.check_value(
                        L.zopt_optimizer_set_hyper(h, ng, name.encode(), float(val)),
                        f"param group {gid}: {name}={val!r}")
                if _maximize(self.param_groups[gid]):
                    check(L.zopt_optimizer_set_group_flags(h, ng, _lib.GROUP_MAXIMIZE),
                          f"param group {gid}: maximize=True")
            excluded = self._excluded
            for t, e in enumerate(self._entries):
                tid = ctypes.c_int()
                if t in excluded:  # an empty slot: tensor ids stay param indices
                    pptr = gptr = numel = 0
                else:
                    pptr, gptr, numel = e.pptr, e.gptr, e.numel
                c = self._cohort_of.get(t)
                check(L.zopt_optimizer_add_tensor(
                    h, e.group if c is None else G + c, ctypes.c_void_p(pptr or None),
                    ctypes.c_void_p(gptr or None), numel, int(self.step_obj.param_dtype),
                    ctypes.byref(tid)),
                    f"zopt_optimizer_add_tensor({e.name})")
            if self._scaler_cfg is not None:
                self._configure_scaler(h, self._scaler_cfg)
            if self._seed is not None:
                check(L.zopt_optimizer_set_seed(h, int(self._seed) & (2**64 - 1)), "set_seed")
            st = L.zopt_optimizer_finalize(h)
            if st and self._dev_alloc is not None and self._dev_alloc.error is not None:
                err = self._dev_alloc.error
                self._dev_alloc.error = None
                try:
                    check(st, "zopt_optimizer_finalize")
                except ZoptError as e:
                    raise ZoptError(e.code, f"{e.message}; torch's caching allocator: "
                                    f"{type(err).__name__}: {err}") from None
            check(st, "zopt_optimizer_finalize")
        except BaseException:
            L.zopt_optimizer_free(h)
            raise
        old, self._h = self._h, h
        self._native_G = G
        if old is not None and old.value:
            L.zopt_optimizer_free(old)
        r, w = ctypes.c_int(), ctypes.c_int()
        check(L.zopt_optimizer_get_world(h, ctypes.byref(r), ctypes.byref(w)), "get_world")
        self.rank, self.world_size = r.value, w.value
        self._pushed = [_slots(g, self.step_obj.hypers) for g in self.param_groups]
        self._pushed_max = [_maximize(g) for g in self.param_groups]
        self._pushed_raw = [self._raw_hypers(g) for g in self.param_groups]
        self._group_params = [tuple(g["params"]) for g in self.param_groups]
        T = len(self._entries)
        self._active = bytearray(b"\x01" * T)
        # the mask's address for set_active (a c_char over the bytearray:
        # no ctypes array type, which would be left behind as garbage)
        self._active_c = ctypes.c_char.from_buffer(self._active if T else bytearray(1))
        self._active_addr = ctypes.addressof(self._active_c)
        self._mask_all = True
        self._gpu_missing = []
        self._step_fn = L.zopt_optimizer_step
        self._res = _lib.StepResult()
        self._res_ref = ctypes.byref(self._res)
        # Bytes the update moves per updated element (for the metrics):
        # each state read and/or written once, as the descriptor says.
        bpe = 0
        for k, dt, _ in self.step_obj.states:
            acc = self.step_obj.state_access.get(k, 3)
            bpe += DTYPE_ITEMSIZE[dt] * ((acc & 1) + ((acc >> 1) & 1))
        self._bytes_per_elem = bpe
        self._numels = np.array([e.numel for e in self._entries], dtype=np.int64)
        self._active_elems = int(self._numels.sum())
        self._rebuild_lists()
        if self._streamer is not None:
            self._streamer.attach(h)

    def _rebuild_lists(self):
        """The per-step fast-path tables."""
        ents = self._entries
        self._tid_map = {id(e.param): t for t, e in enumerate(ents)}
        self._a_tids = [t for t, e in enumerate(ents) if e.auto]
        self._a_params = [ents[t].param for t in self._a_tids]
        self._a_regs = [ents[t].grad for t in self._a_tids]
        self._a_last = [_UNSET] * len(self._a_tids)
        self._a_index = {t: j for j, t in enumerate(self._a_tids)}
        self._tp_tids = [t for t, e in enumerate(ents) if e.torch]
        self._tp_params = [ents[t].param for t in self._tp_tids]
        self._tp_index = {t: j for j, t in enumerate(self._tp_tids)}
        self._tp_ptrs = self._current_ptrs()
        self._strided = [t for t, e in enumerate(ents) if e.dense is not None]
        self._watch = self.step_obj.has_master or self.step_obj.zero3
        self._one_pass = bool(self._a_tids) and self._a_tids == self._tp_tids \
            and not self._main
        self._foreign = {}  # the new native optimizer has our own grad memory
        # Per param: the data_ptr() its p.grad had when last seen (0: none),
        # so that a p.grad that kept its object but got other memory
        # (p.grad.data = ..., Module._apply, share_memory()) is seen; and
        # the p.grad tensors copied into our memory each step (views, other
        # strides, GPU steps): they stay the user's p.grad.
        self._a_gp = [0] * len(self._a_tids)
        self._copied = {}
        # Fresh gradient tensors are registered in place (no copy) on CPU
        # steps; GPU and offloaded steps keep device tables or stage copies.
        self._grad_zero_copy = not self.step_obj.gpu and not any(e.cuda for e in ents) \
            and not self._main
        self._reset_watch()

    def _current_ptrs(self):
        return list(map(_data_ptr, self._tp_params))

    def _reset_watch(self):
        """The baselines of the write detection: now (after the optimizer
        wrote the params, loaded or refreshed)."""
        self._tp_vers = list(map(_version_of, self._tp_params))
        self._sampler = None
        if not self._watch or self._zero3_mode == "hooks":
            return  # hooks: params come and go per module (versions only)
        es = DTYPE_ITEMSIZE[self.step_obj.param_dtype]
        ent = []
        for t, e in enumerate(self._entries):
            if e.cuda or t in self._released or not e.numel or t in self._excluded:
                continue
            ptr = e.dense.data_ptr() if e.dense is not None else \
                e.param.data_ptr() if e.torch else e.param.ctypes.data
            ent.append((t, ptr, e.numel))
        s = Sampler(es, ent)
        if not s.empty:
            s.snapshot()
            self._sampler = s

    def _attach_allocator(self, h):
        """GPU steps: torch's caching allocator for finalize's buffers
        (device_allocator="torch", the default when torch has CUDA)."""
        want = self._device_allocator
        if want == "driver":
            return
        have = torch is not None and torch.cuda.is_available()
        if not have:
            if want == "torch":
                raise ZoptError(Status.UNSUPPORTED, "device_allocator='torch': this torch "
                                "has no CUDA (torch.cuda.is_available() is False)")
            return
        if self._dev_alloc is None:
            dev = self._device
            self._dev_alloc = _TorchAllocator(dev.index if dev is not None else None)
        check(_set_device_allocator(self._lib, h, self._dev_alloc),
              "zopt_optimizer_set_device_allocator")

    def _use_stream(self, h=None):
        """GPU and offloaded steps: torch's current stream (of the params'
        device) becomes the optimizer's stream, before every call that
        enqueues or reads (zopt_optimizer_set_stream; the runtime orders
        the new stream after its own last work, a graph replay included)."""
        s = torch.cuda.current_stream(self._device).cuda_stream
        check(self._lib.zopt_optimizer_set_stream(self._h if h is None else h,
                                                  ctypes.c_void_p(s or None)),
              "zopt_optimizer_set_stream")

    def _capturing(self):
        """Is torch's current stream of the params' device capturing a CUDA
        graph (torch.cuda.graph)?"""
        if not self._streams:
            return False
        with self._device_current():
            return bool(torch.cuda.is_current_stream_capturing())

    def _free(self):
        self._remove_acc_hooks()
        if self._rank_checks is not None:
            self._rank_checks.remove()
        h = getattr(self, "_h", None)
        comm = getattr(self, "_comm", None)
        if comm is not None and h is not None and h.value:
            comm._drain()  # operations of a failed collective still writing our scratch
        if h is not None and h.value:
            self._lib.zopt_optimizer_free(h)
        self._h = None
        if getattr(self, "_own_comm", False) and getattr(self, "_comm", None) is not None:
            self._comm.close()
            self._comm = None

    def _handle(self):
        """The native optimizer, for a call that uses it now (GPU and
        offloaded steps: on torch's current stream)."""
        if self._h is None:
            raise ZoptError(Status.BAD_STATE, "the optimizer is closed")
        if self._begun:
            raise ZoptError(Status.BAD_STATE, "clip_grad_norm_ began this step (the gradients "
                            "are reduced and the norm computed): call step() first")
        if self._streams:
            self._use_stream()
        if self._streamer is not None:
            self._streamer.wait()  # gradient buckets in flight
        return self._h

    def close(self):
        """Frees the native optimizer (and a communicator it made); waits
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

    # ---- torch.optim.Optimizer surface --------------------------------------
    @property
    def state(self):
        """param -> {'step', 'exp_avg', ...}: the runtime's states under
        torch's keys (plus 'master' for steps with a master), read as CPU
        copies and written through (``state[p][key] = t``, in-place changes
        of what was read, ``state[p] = {...}``; :class:`_ParamState`).
        Reading it at world size > 1 gathers sharded states (collective);
        writes are local: every rank writes the same values."""
        return self._state_view

    @state.setter
    def state(self, value):
        # torch's own code assigns it only in Optimizer.__init__ and
        # __setstate__, neither of which runs here (the states live in C):
        # an assignment replaces the states (opt.state = {} resets them all).
        view = getattr(self, "_state_view", None)
        if view is None or value is view:
            return
        view._replace(value)

    @_exclusive("add_param_group")
    def add_param_group(self, param_group):
        """Adds a group like torch. The native optimizer (whose groups are
        fixed at finalize) is rebuilt with the new group, keeping every
        state, step count, the loss scaler and the seed of the others (at
        world size > 1 every rank must call it)."""
        if getattr(self, "_h", None) is None and not self.param_groups:
            raise ZoptError(Status.BAD_STATE, "the optimizer is not built")
        self._prepare()
        snap = self._snapshot()
        self._pre_rebuild()
        n_groups, n_entries = len(self.param_groups), len(self._entries)
        n_flats = len(self._grad_flats)
        try:
            new = self._add_group_py(dict(param_group))
            held = self._exclude_frozen(new)
            self._check_overlaps()
            if self._streamer is None:
                self._alloc_grads(held)
            else:
                self._streamer.check_entries(held)
            self._build_native()
        except BaseException:
            del self.param_groups[n_groups:]
            del self._entries[n_entries:]
            del self._grad_flats[n_flats:]
            self._excluded.difference_update([t for t in self._excluded if t >= n_entries])
            raise
        self._restore(snap)
        self._add_acc_hooks(new)
        self.rebuilds += 1

    @_exclusive("zero_grad")
    def zero_grad(self, set_to_none=None):
        """Like torch: zeros the gradients or sets them to None
        (set_to_none=True); the default is the installed torch's (False on
        torch 1.13, True from torch 2.0). The zopt-owned gradient memory of the
        params is zeroed with one fill per buffer; explicit (param, grad)
        pairs are always zeroed. With grad_streaming a reduced (freed)
        gradient is already None: nothing to zero."""
        if self._begun:  # the begun step reads the gradient memory still
            raise ZoptError(Status.BAD_STATE, "zero_grad() after clip_grad_norm_: the step it "
                            "began reads these gradients: call step() first")
        if set_to_none is None:
            set_to_none = _torch_compat.zero_grad_default()
        if self._streamer is not None:
            self._streamer.check_zero_grad()
        ps = self._a_params
        if ps and self._main:
            # f32 gradients: p.grad is only ever pending accumulation;
            # our main_grad views are dropped or zeroed, a user's main_grad
            # is zeroed (it is the user's: never detached).
            if not set_to_none:
                for f in self._grad_flats:
                    f.zero_()
            for p, r in zip(ps, self._a_regs):
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
            grads = [p.grad for p in ps]
            regs = self._a_regs
            # Gradient tensors the runtime reads in place (_sync_grads): with
            # set_to_none, no longer kept alive (freed as torch frees them;
            # the next step() registers what backward makes before the
            # runtime reads any). Without, every p.grad is zeroed in place
            # and stays p.grad, as torch does (the user may hold it): the
            # next backward accumulates where the runtime already reads (or
            # copies from).
            foreign = self._foreign
            if foreign and set_to_none:
                last, index = self._a_last, self._a_index
                for t, (g, _) in list(foreign.items()):
                    last[index[t]] = _UNSET
                    foreign[t] = (None, foreign[t][1])
            if set_to_none:
                for p, g in zip(ps, grads):
                    if g is not None:
                        p.grad = None
            else:
                for f in self._grad_flats:
                    f.zero_()
                zs = []
                for g, r in zip(grads, regs):
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
        for e in self._entries:
            if not e.auto:
                if _is_torch(e.grad):
                    e.grad.zero_()
                else:
                    e.grad[...] = 0

    def __repr__(self):
        s = self.step_obj
        n = int(self._numels.sum()) if hasattr(self, "_numels") else 0
        head = (f"zopt.Optimizer(step={s.name}, "
                + ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in s.states)
                + f"; isa={'gpu' if s.gpu else s.isa.name}, "
                f"{len(self._entries)} tensors, {n} elements, "
                f"rank {getattr(self, 'rank', 0)} of {getattr(self, 'world_size', 1)}, "
                f"zero_stage={s.zero_stage}, steps taken {self.steps_taken}"
                + (", closed" if self._h is None else "") + ")")
        lines = [head]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i} ({len(group['params'])} tensors)")
            for key in sorted(group):
                if key != "params":
                    lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines)

    # ---- per-step checks ------------------------------------------------------
    def _pre_step(self):
        """Every per-param check of a step in one pass over the params when
        every torch param is given alone (the usual case): each param's
        metadata is brought into the caches once."""
        if self._excluded:  # GPU steps: frozen params that got a gradient join
            self._include_unfrozen()
        ps = self._a_params
        if not self._one_pass:
            rb = self.rebuilds
            sync = self._sync_main if self._main else self._sync_grads
            if ps:
                sync()
            self._check_params()
            if ps and self.rebuilds != rb:  # a rebuilt native optimizer: its mask is new
                sync()
            return
        G, P = [], []
        ga, pa = G.append, P.append
        if self._watch:
            V = []
            va = V.append
            for p in ps:
                ga(p.grad)
                pa(p.data_ptr())
                va(p._version)
        else:
            V = None
            for p in ps:
                ga(p.grad)
                pa(p.data_ptr())
        self._sync_grads(G)
        rb = self.rebuilds
        self._check_params(P, V)
        if self.rebuilds != rb:  # p.data = new: a new native optimizer, all active
            self._sync_grads()

    def _sync_grads(self, grads=None):
        """Which params have a gradient, and where the runtime reads it.
        Fast path: every p.grad is the object it was last step. A new
        gradient tensor (zero_grad(set_to_none=True) and a backward) of a
        CPU step is handed to the runtime in place, without a copy
        (zopt_optimizer_set_grad_memory, one call for all that changed)
        when it has the param's memory layout and is not a view; otherwise
        (GPU and offloaded steps, views, other strides) it is copied into
        the optimizer's own gradient memory at every step; p.grad stays the
        user's tensor either way (the user may hold it and write into it),
        and a p.grad given other memory under the same object (p.grad.data
        = ..., Module._apply) is seen by its data_ptr()."""
        ps = self._a_params
        if grads is None:
            grads = list(map(_grad_of, ps))
        last = self._a_last
        foreign = self._foreign
        copied = self._copied
        regs = self._a_regs
        gp = self._a_gp
        if all(map(_is, grads, last)):
            ptrs = _ptrs_of(grads)
            if ptrs == gp:
                if copied:  # the user's tensors may have changed since
                    with torch.no_grad():
                        for j, g in copied.items():
                            regs[j].copy_(g)
                return
            # A p.grad that kept its object but got other memory. (Never one
            # of our own views: those are not handed out as p.grad.)
            for j, (q, want) in enumerate(zip(ptrs, gp)):
                if q != want:
                    last[j] = _UNSET
        act = self._active
        tids = self._a_tids
        ents = self._entries
        zero_copy = self._grad_zero_copy
        moved_t, moved_p = [], []
        changed = False
        with torch.no_grad():
            for j, g in enumerate(grads):
                if g is last[j]:
                    if j in copied:
                        regs[j].copy_(g)
                    continue
                t = tids[j]
                if g is None:
                    if act[t]:
                        act[t] = 0
                        changed = True
                    last[j] = None
                    gp[j] = 0
                    copied.pop(j, None)
                    if t in foreign:
                        # our own memory again, not the dropped p.grad: at
                        # W > 1 the reduced gradient of a param another
                        # rank updates lands in this rank's registered memory
                        del foreign[t]
                        moved_t.append(t)
                        moved_p.append(ents[t].gptr)
                    continue
                reg = regs[j]
                copy = False
                if g is not reg:
                    # torch guarantees p.grad's shape, dtype and device
                    if g.is_sparse:
                        raise ZoptError(Status.UNSUPPORTED,
                                        f"{ents[t].name} has a sparse gradient")
                    e = ents[t]
                    ptr = g.data_ptr()
                    if zero_copy and g._base is None and ptr != e.pptr and (
                            e.numel <= 1 or g.stride() == e.stride):
                        moved_t.append(t)
                        moved_p.append(ptr)
                        foreign[t] = (g, ptr)
                        copied.pop(j, None)
                    else:
                        # copied into our memory now and at every step; it
                        # stays p.grad (the user may hold it and write it)
                        reg.copy_(g)
                        copied[j] = g
                        copy = True
                else:
                    copied.pop(j, None)
                if (g is reg or copy) and t in foreign:  # back to our own memory
                    del foreign[t]
                    moved_t.append(t)
                    moved_p.append(ents[t].gptr)
                if not act[t]:
                    act[t] = 1
                    changed = True
                last[j] = g
                gp[j] = g.data_ptr()
        if moved_t:
            self._set_grad_memory(moved_t, moved_p)
        if changed:
            self._push_mask()

    # ---- f32 gradients of bf16/f16 params (p.main_grad) ----------------------
    def _sync_main(self):
        """_sync_grads for steps with f32 gradients of 16-bit params: what is
        left in p.grad accumulated into p.main_grad, then which params have
        a main_grad and where it lives. Our own buffer views are registered
        at build; a main_grad the user attached is registered in place
        (zopt_optimizer_set_tensor_memory), or copied each step for GPU
        steps (which keep device pointer tables)."""
        self._take_grads()
        ps = self._a_params
        mgs = [getattr(p, "main_grad", None) for p in ps]
        last = self._a_last
        gpu = self.step_obj.gpu
        for t, (g, ptr) in list(self._foreign.items()):
            if g.data_ptr() != ptr:  # the same tensor given other memory
                last[self._a_index[t]] = _UNSET
        if not gpu and all(map(_is, mgs, last)):
            return
        act, tids, regs = self._active, self._a_tids, self._a_regs
        changed = False
        with torch.no_grad():
            for j, g in enumerate(mgs):
                if g is last[j] and not (gpu and g is not None and g is not regs[j]):
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
                    self._check_main_grad(t, g)
                    if gpu:
                        reg.copy_(g)
                    else:
                        self._register_grad(t, g)
                elif t in self._foreign:
                    self._register_grad(t, None)
                if not act[t]:
                    act[t] = 1
                    changed = True
                last[j] = g
        if changed:
            self._push_mask()

    def _check_main_grad(self, t, g):
        e = self._entries[t]
        p = e.param
        what = None
        if not _is_torch(g):
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
                            f"'{self.step_obj.name}') {what}")

    def _set_grad_memory(self, tids, ptrs, what="zopt_optimizer_set_grad_memory"):
        """The runtime reads tensor tids[i]'s gradient at ptrs[i] (None:
        no memory) from the next step on; one call for all of them."""
        n = len(tids)
        ta, tp = _lib.c_array(ctypes.c_int32, tids)  # (ta, pa: alive across the call)
        pa, pp = _lib.c_array(ctypes.c_void_p, ptrs)
        check(self._lib.zopt_optimizer_set_grad_memory(self._h, n, ta.ctypes.data,
                                                       pa.ctypes.data), what)

    def _register_grad(self, t, g):
        """The runtime reads tensor t's gradient from g (a user's main_grad)
        or, with g None, from our own buffer view again."""
        e = self._entries[t]
        ptr = (g.data_ptr() if g is not None else e.gptr) if e.numel else None
        self._set_grad_memory([t], [ptr], f"zopt_optimizer_set_grad_memory({e.name}'s main_grad)")
        if g is None:
            self._foreign.pop(t, None)
        else:
            self._foreign[t] = (g, g.data_ptr())  # kept alive while the runtime reads it

    @_exclusive("accumulate_grads")
    def accumulate_grads(self):
        """Steps with f32 gradients of bf16/f16 params: adds every ``p.grad``
        (the last backward's, in the param's dtype) into ``p.main_grad`` in
        f32 and sets ``p.grad`` to None. With ``grad_accumulation="manual"``
        call it after each micro-batch's backward (``step()`` also takes what
        is left); the default hooks do it during backward. For other steps it
        does nothing."""
        self._take_grads()

    def _take_grads(self):
        if not self._main or not self._a_params:
            return
        if self._excluded:  # GPU steps: a frozen param's p.grad: it joins first
            self._include_unfrozen()
        regs = self._a_regs
        with torch.no_grad():
            for j, p in enumerate(self._a_params):
                g = p.grad
                if g is not None:
                    self._accumulate(p, g, regs[j], self._entries[self._a_tids[j]])

    @staticmethod
    def _accumulate(p, g, reg, e):
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

    def _add_acc_hooks(self, entries):
        """grad_accumulation="hooks": after backward accumulates a param's
        gradient (torch's AccumulateGrad node; torch 1.13 has no
        register_post_accumulate_grad_hook), add it into the f32 main_grad
        and free p.grad, as DeepSpeed's bf16 optimizer does. (At several
        ranks the checks of zopt._ranks hook them too.)"""
        if self._rank_checks is not None:
            self._rank_checks.add_hooks(self, entries)
        if not self._main or self._grad_accumulation != "hooks" or torch is None:
            return
        ref = weakref.ref(self)
        for e in entries:
            p = e.param
            if not e.auto or not p.requires_grad or not p.is_leaf:
                continue  # (a non-leaf's p.grad is taken at step())
            with torch.enable_grad():
                node = p.expand_as(p).grad_fn.next_functions[0][0]

            def hook(*_, e=e, p=p):
                o = ref()
                if o is None or o._h is None:
                    return
                g = p.grad
                if g is not None:
                    with torch.no_grad():
                        o._accumulate(p, g, e.grad, e)
            self._acc_hooks.append((node, node.register_hook(hook)))

    def _remove_acc_hooks(self):
        for _, h in getattr(self, "_acc_hooks", ()):
            h.remove()
        self._acc_hooks = []

    def _push_mask(self):
        act = self._active
        all_on = 0 not in act
        if self.step_obj.gpu:
            # No mask on the GPU (no per-tensor skip): the params left out
            # are empty slots there; a held param without a gradient
            # refuses the step (step(): _refuse_missing_grads).
            ex = self._excluded
            self._gpu_missing = [] if all_on else \
                [t for t, a in enumerate(act) if not a and t not in ex]
            self._mask_all = all_on
            self._active_elems = int(np.dot(np.frombuffer(act, dtype=np.uint8).astype(np.int64),
                                            self._numels)) if len(act) else 0
            return
        if all_on:
            check(self._lib.zopt_optimizer_set_active(self._h, None, 0), "set_active")
        else:
            check(self._lib.zopt_optimizer_set_active(self._h, self._active_addr, len(act)),
                  "set_active")
        self._mask_all = all_on
        self._active_elems = int(np.dot(np.frombuffer(act, dtype=np.uint8).astype(np.int64),
                                        self._numels)) if len(act) else 0

    def _check_params(self, ptrs=None, vers=None):
        """Moved storages (p.data = ...) and writes into params the runtime
        would not see (version counters, sampled elements): the moved
        storages re-registered, the master made again from what changed.
        First, in-place changes to state tensors lent by ``opt.state[p]``
        are written back."""
        if self._lent:
            self._flush_lent()
        moved = []
        if self._tp_params:
            if ptrs is None:
                ptrs = self._current_ptrs()
            if ptrs != self._tp_ptrs:
                moved = self._moved(ptrs)
        if self._strided:  # the registered dense copies <- the strided params
            _strided.copy_in(self._entries, self._strided)
        if not self._watch and not moved:
            return
        changed = set()
        if self._watch:
            if self._tp_params:
                if vers is None:
                    vers = list(map(_version_of, self._tp_params))
                if vers != self._tp_vers:
                    for t, a, b in zip(self._tp_tids, vers, self._tp_vers):
                        if a != b and t not in self._released:
                            changed.add(t)
                    self._tp_vers = vers
            if self._sampler is not None:  # never reads a moved (maybe freed) storage
                changed.update(self._sampler.changed(skip=moved))
        if moved:
            self._register_moved(moved)
            changed.update(moved)
        if changed:
            self._refresh(sorted(changed))

    def _moved(self, ptrs):
        """The non-empty params whose storage is not the one last seen
        (validated: same shape, dtype, device and strides)."""
        moved = []
        for t, a, b in zip(self._tp_tids, ptrs, self._tp_ptrs):
            e = self._entries[t]
            if a == b or not e.numel or t in self._excluded:
                continue  # (a param left out is checked when it joins)
            p = e.param
            if t in self._released:
                raise ZoptError(Status.BAD_STATE,
                                f"{e.name} was released (ZeRO-3) and then given new "
                                "memory by someone else: gather it with "
                                "opt.gather_params() instead")
            what = None
            if tuple(p.shape) != e.shape:
                what = f"shape {tuple(p.shape)} (was {e.shape})"
            elif _torch_dtypes().get(p.dtype) != self.step_obj.param_dtype:
                what = f"dtype {p.dtype}"
            elif (p.device.type == "cuda") != e.cuda:
                what = f"device {p.device}"
            elif e.dense is not None:  # stepped through its dense copy: any layout
                if _strided.overlapping(p):
                    what = f"strides {tuple(p.stride())} (overlapping elements)"
            elif tuple(p.stride()) != e.stride:
                what = f"strides {tuple(p.stride())} (was {e.stride})"
            if what is not None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{e.name} was replaced (p.data = ...) by a tensor of another "
                                f"{what}: the optimizer's states no longer fit it; build a "
                                "new optimizer for the changed model")
            moved.append(t)
        self._tp_ptrs = ptrs
        if moved:
            self._check_overlaps()
        return moved

    def _register_moved(self, tids):
        """Moved params: under ZeRO-3 nothing to register (the runtime never
        reads the registered param memory after finalize; the binding
        passes the current storage everywhere). Otherwise the runtime
        writes params in place: the native optimizer is rebuilt around the
        new storage, every state kept."""
        if self.step_obj.zero3:
            return
        tids = [t for t in tids if self._entries[t].dense is None]
        if not tids:  # strided params: their registered copies did not move
            return
        snap = self._snapshot()
        for t in tids:
            self._entries[t].pptr = self._entries[t].param.data_ptr()
        self._build_native()
        self._restore(snap)
        self.rebuilds += 1

    def _pre_rebuild(self):
        """Before a new native optimizer registers the params: ZeRO-3's
        released params gathered (finalize reads them), every param's
        current storage the one to register."""
        if self.step_obj.zero3 and self._released:
            self.gather_params([self._entries[t].param for t in sorted(self._released)])
        for e in self._entries:
            if e.torch and e.numel and e.dense is None:
                e.pptr = e.param.data_ptr()

    def _refresh(self, tids):
        """Master (and ZeRO-3's held params) := the user's params, for tids."""
        if self._excluded:  # left out (GPU steps): no master
            tids = [t for t in tids if t not in self._excluded]
        if not self._watch or not tids:
            return
        L = self._lib
        zero3 = self.step_obj.zero3
        run = []
        for t in sorted(set(tids)) + [None]:
            if t is not None and zero3 and self._moved_from_registered(t):
                self._refresh_by_write(t)
                continue
            if t is not None and run and t == run[-1] + 1:
                run.append(t)
                continue
            if run:
                check(L.zopt_optimizer_refresh_master(self._h, run[0], len(run)),
                      "zopt_optimizer_refresh_master")
            run = [t] if t is not None else []
        self.refreshes += len(set(tids))
        self._reset_watch()
        self._outdate(tids, ("master",))

    def _moved_from_registered(self, t):
        e = self._entries[t]
        if not e.torch or not e.numel:
            return False
        return e.param.data_ptr() != e.pptr

    def _refresh_by_write(self, t):
        """ZeRO-3, a param whose storage is not the registered one: its held
        shard (and master) written from the current storage (each rank
        writes what it holds; no communication)."""
        e = self._entries[t]
        self._write_raw(t, StateKind.PARAM, self._memory_order(e, e.param))
        if self.step_obj.has_master:
            self.write_state(t, StateKind.MASTER,
                             self._memory_order(e, e.param.detach().float()))

    def _prepare(self):
        """Checks before anything reads or writes the native optimizer."""
        self._handle()
        self._check_params()

    # ---- hyperparameters ----------------------------------------------------
    def _raw_hypers(self, group):
        return tuple(_frozen(group.get(k)) for k in self._hyper_keys())

    def _hyper_keys(self):
        ks = getattr(self, "_hkeys", None)
        if ks is None:
            hyp = self.step_obj.hypers
            ks = [k for k in ("lr", "betas", "beta1", "beta2", "eps", "weight_decay",
                              "momentum", "dampening", "bias_correction")
                  if k in hyp or (k == "betas" and "beta1" in hyp)] + ["maximize"]
            self._hkeys = ks
        return ks

    def _check_rule_flags(self, group, where):
        """torch.optim's per-group amsgrad flag changes the update rule,
        which is compiled into a zopt step: a group that asks for another
        rule is refused, never silently stepped with the compiled one;
        differentiable=True is refused (the step runs outside autograd).
        (maximize is a runtime group flag: pushed like a hyperparameter.)"""
        if group.get("differentiable"):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{where} has differentiable=True: a zopt step runs in the "
                            "runtime, outside autograd (no graph through the update)")
        a = group.get("amsgrad")
        if a is not None:
            s = self.step_obj
            mine = s.adam_like and StateKind.MAX_EXP_AVG_SQ in s.state_flags
            if bool(a) != mine:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{where} has amsgrad={a!r}, but step '{s.name}' is compiled "
                                f"{'with' if mine else 'without'} AMSGrad (a state max_exp_avg_sq"
                                f"{'' if mine else ', zopt.steps.adam(amsgrad=True)'}): the rule "
                                "is fixed when the step is compiled")

    def _push_hypers(self):
        groups = self.param_groups
        if len(groups) != len(self._pushed):
            raise ZoptError(Status.BAD_STATE,
                            "param_groups changed length: add groups with add_param_group()")
        for gid, group in enumerate(groups):
            self._check_group_params(gid, group)
            if "amsgrad" in group or "differentiable" in group:
                self._check_rule_flags(group, f"param_groups[{gid}]")
            self._push_group(gid, group)

    def _check_group_params(self, gid, group):
        """param_groups[gid]['params'] holds the tensors it was built with."""
        ps, built = group["params"], self._group_params[gid]
        if len(ps) != len(built) or not all(map(_is, ps, built)):
            raise ZoptError(Status.BAD_STATE,
                            f"param_groups[{gid}]['params'] was edited: the optimizer's "
                            "tensors are fixed; add params with add_param_group()")

    def _push_group(self, gid, group):
        """The hyperparameters of param_groups[gid] that changed since they
        were last pushed -> the runtime (zopt_optimizer_set_hyper)."""
        raw = tuple(_frozen(group.get(k)) for k in self._hyper_keys())
        if raw == self._pushed_raw[gid]:
            return
        slots = _slots(group, self.step_obj.hypers)
        maximize = _maximize(group)
        pushed = self._pushed[gid]
        for name, val in slots.items():
            if pushed.get(name) != val:
                self._set_hyper(gid, name, val)
                pushed[name] = val
        if maximize != self._pushed_max[gid]:
            self._set_maximize(gid, maximize)
        self._pushed_raw[gid] = raw

    def _group_assigned(self, group):
        """A hyperparameter assigned in a param group of a GPU step
        (_GpuGroup): pushed now, on torch's current stream, since graph
        replays read the device's table and no step() comes between them."""
        if self._mute_groups or self._h is None or getattr(self, "_pushed", None) is None:
            return
        for gid, g in enumerate(self.param_groups):
            if g is group:
                if gid < len(self._pushed):
                    self._push_group(gid, group)
                return

    def _set_hyper(self, gid, name, value):
        if self.step_obj.gpu and self._capturing():
            raise ZoptError(
                Status.BAD_STATE,
                f"param_groups[{gid}]: {name} = {value!r} inside a CUDA graph capture "
                "(torch.cuda.graph): a GPU step reads its hyperparameters from a device "
                "table at run time, and a value written during the capture would be baked "
                "into the graph. Set it before capturing, or between replays (e.g. the lr "
                "scheduler's step() after graph.replay()): each replay uses the value set "
                "before it")
        h = self._handle()
        for ng in self._native_gids(gid):
            _lib.check_value(
                self._lib.zopt_optimizer_set_hyper(h, ng, name.encode(), float(value)),
                f"set_hyper(group {gid}, {name}={value!r})")

    def _set_maximize(self, gid, on):
        """torch's ``maximize`` of param group gid -> the runtime's group
        flag (every native group of it; the gradient's sign). GPU steps:
        written into the device's table at once, never inside a capture."""
        if self.step_obj.gpu and self._capturing():
            raise ZoptError(
                Status.BAD_STATE,
                f"param_groups[{gid}]: maximize = {on!r} inside a CUDA graph capture "
                "(torch.cuda.graph): the flag is the sign of the group's gradient scale in "
                "the device's table, which a capture cannot change. Set it before capturing "
                "or between replays")
        h = self._handle()
        for ng in self._native_gids(gid):
            check(self._lib.zopt_optimizer_set_group_flags(
                h, ng, _lib.GROUP_MAXIMIZE if on else 0),
                f"param_groups[{gid}]: maximize={on}")
        self._pushed_max[gid] = on

    def _push_flags(self):
        """Every group's maximize flag, after a load or rebuild (the
        runtime's checkpoint files may not carry it; param_groups are the
        truth)."""
        self._pushed_max = [None] * len(self.param_groups)
        for gid, g in enumerate(self.param_groups):
            self._set_maximize(gid, _maximize(g))

    @_exclusive("get_hyper")
    def get_hyper(self, gid, name):
        v = ctypes.c_double()
        check(self._lib.zopt_optimizer_get_hyper(self._handle(), gid, name.encode(),
                                                 ctypes.byref(v)),
              f"get_hyper(group {gid}, {name})")
        return v.value

    @_exclusive("get_group_flags")
    def get_group_flags(self, gid):
        """The runtime's ZOPT_GROUP_* flags of param group gid (bit 0:
        maximize, pushed from param_groups at each step)."""
        fl = ctypes.c_uint32()
        check(self._lib.zopt_optimizer_get_group_flags(self._handle(), gid, ctypes.byref(fl)),
              f"get_group_flags(group {gid})")
        return fl.value

    @_exclusive("set_hyper")
    def set_hyper(self, gid, name, value):
        """Sets one slot now (and mirrors it into param_groups)."""
        if name == "bias_correction":
            value = _bool_hyper(name, value)
        self._set_hyper(gid, name, value)
        self._sync_group_from_c(gid)

    def _sync_group_from_c(self, gid):
        """param_groups[gid] and the pushed cache <- the runtime's values."""
        group = self.param_groups[gid]
        vals = {name: self.get_hyper(gid, name) for name in self.step_obj.hypers}
        flags = self.get_group_flags(gid)
        self._mute_groups = True  # the runtime's own values: nothing to push
        try:
            for name, v in vals.items():
                if name in ("beta1", "beta2"):
                    continue
                group[name] = bool(v) if name == "bias_correction" else v
            if "beta1" in vals or "beta2" in vals:
                group["betas"] = (vals.get("beta1"), vals.get("beta2"))
            group["maximize"] = bool(flags & _lib.GROUP_MAXIMIZE)
        finally:
            self._mute_groups = False
        self._pushed[gid] = _slots(group, self.step_obj.hypers)
        self._pushed_max[gid] = group["maximize"]
        self._pushed_raw[gid] = self._raw_hypers(group)

    @property
    @_exclusive("grad_divisor")
    def grad_divisor(self):
        """The divisor D of the gradients (grad / (loss scale * D)): the
        world size by default (the mean over ranks, as DDP); set W * A to
        also average A accumulated micro-batches, 1 to sum."""
        v = ctypes.c_double()
        check(self._lib.zopt_optimizer_get_grad_divisor(self._handle(), ctypes.byref(v)),
              "get_grad_divisor")
        return v.value

    @grad_divisor.setter
    @_exclusive("grad_divisor")
    def grad_divisor(self, d):
        check(self._lib.zopt_optimizer_set_grad_divisor(self._handle(), float(d)),
              "set_grad_divisor")
        self._grad_divisor = float(d)

    # ---- stepping --------------------------------------------------------------
    @_exclusive("step")
    def step(self, closure=None):
        """One optimizer step over the params that have a gradient; returns
        the closure's loss (None without a closure), like torch. The
        outcome is in ``last_grad_norm`` (NaN without a norm reduction),
        ``last_skipped`` (non-finite gradients skipped the step),
        ``last_loss_scale`` and ``last_metrics``. With no gradient at all
        (world size 1) nothing changes and the runtime is not called. After
        :meth:`clip_grad_norm_` it finishes the step that call began."""
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
        """step() up to the runtime's step: the checks, the gradients, the
        changed hyperparameters. False when there is nothing to run (world
        size 1 and no gradient)."""
        if self._offload:
            self._refuse_offload_capture()
        # GPU and offloaded steps: from here on every call (the pushes of
        # changed hyperparameters, the step) runs on torch's current stream;
        # a GPU step only enqueues there (read its outcome with gpu_result()).
        self._handle()
        if self._rank_checks is not None:
            self._rank_checks.before_step(self)  # DDP, gradients rescaled in place
        if self._streamer is None:
            self._pre_step()  # may rebuild the native optimizer
        else:
            self._streamer.before_step()  # the buckets no backward reduced
        self._push_hypers()
        if self.world_size == 1 and 1 not in self._active and not (
                self._streamer is not None and self._streamer.reduced):
            return False
        if self._gpu_missing:
            self._refuse_missing_grads()
        return True

    def _run_native_step(self, t0):
        """The runtime's step (or the end of one clip_grad_norm_ began) and
        what follows it."""
        t1 = time.perf_counter()
        st = self._step_fn(self._h, self._res_ref)
        t2 = time.perf_counter()
        if st:
            check(st, "zopt_optimizer_step")
        if self._streamer is not None:
            self._streamer.after_step()
        self._after_step(self._res)
        self._metrics(t0, t1, t2)

    @_exclusive("clip_grad_norm_")
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ the zopt way, between backward and
        ``step()``: returns the global norm of the gradients over all ranks
        after their reduction (the norm the step clips by; a 0-d tensor) and
        clips this step at ``max_norm``. For steps compiled with clipping
        (any max_norm); :mod:`zopt._clip`. Collective at several ranks."""
        from ._clip import clip_grad_norm_
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def _refuse_missing_grads(self):
        miss = self._gpu_missing
        names = [self._entries[t].name for t in miss[:4]]
        raise ZoptError(
            Status.UNSUPPORTED,
            f"step(): {', '.join(names)}{', ...' if len(miss) > 4 else ''} "
            f"({len(miss)} of {len(self._entries)} params) require grad but have no gradient "
            f"at this step. Step '{self.step_obj.name}' updates on the GPU, whose kernels have "
            "no per-tensor skip yet: every param the optimizer holds needs a gradient at "
            "every step (torch.optim would leave these alone). For params that are never "
            "trained, set requires_grad=False before building the optimizer: they are then "
            "left out (and join with fresh states once unfrozen and given a gradient). "
            "Otherwise let backward reach them, or use a CPU or offloaded step. Nothing was "
            "updated")

    def no_sync(self):
        """A context manager, like DDP's: with ``grad_streaming=True`` the
        backward passes inside it only accumulate into ``p.grad`` (nothing
        is reduced); the first backward outside it streams the gradients
        (accumulated micro-batches included) to the runtime. Without
        streaming gradients always just accumulate: it does nothing."""
        if self._streamer is None:
            return contextlib.nullcontext()
        return self._streamer.no_sync()

    def _refuse_offload_capture(self):
        if self._capturing():
            raise ZoptError(
                Status.UNSUPPORTED,
                f"step() of an offloaded optimizer (step '{self.step_obj.name}': params and "
                "grads on the GPU, the update on the CPU) inside a CUDA graph capture "
                "(torch.cuda.graph): the step copies the grads to the host, waits for them "
                "and updates on the CPU, which a graph cannot hold. Call step() outside the "
                "captured region (or use a step whose states are on the GPU)")

    def _after_step(self, r):
        """After the runtime's step (r: its result): the outcome, ZeRO-3's
        gather and the write-check baselines."""
        self.last_result = r
        self.last_grad_norm = r.grad_norm
        self.last_skipped = bool(r.skipped)
        self.last_loss_scale = r.loss_scale
        self.steps_taken += 1
        if self._strided and not r.skipped:  # the updated copies -> the strided params
            _strided.copy_out(self._entries, self._strided)
        if self.step_obj.zero3:
            self._after_zero3_step()
        elif self._sampler is not None:
            self._sampler.snapshot()

    def step_result(self):
        """(grad_norm, skipped) of the last step."""
        return self.last_grad_norm, self.last_skipped

    @_exclusive("gpu_result")
    def gpu_result(self):
        """(grad_norm, skipped, loss_scale) of the last GPU step: waits for
        that step (wherever it ran: a graph replay too) on torch's current
        stream and reads the device-side result."""
        r = _lib.StepResult()
        check(self._lib.zopt_optimizer_gpu_result(self._handle(), ctypes.byref(r)),
              "zopt_optimizer_gpu_result")
        return float(r.grad_norm), bool(r.skipped), float(r.loss_scale)

    # ---- metrics ------------------------------------------------------------------
    def register_metrics_hook(self, fn):
        """``fn(optimizer, metrics)`` after every step(); returns a handle
        with ``remove()``. ``metrics`` (also ``opt.last_metrics``) holds:
        step (steps taken), grad_norm (NaN without a norm reduction),
        skipped, loss_scale (the scale this step's gradients carried),
        loss (the closure's, as a float, or None), lr (per group),
        active_tensors, updated_elems (this rank's share), step_time_s (the
        runtime's step), overhead_s (the binding's checks before it),
        bytes (the memory the update moved: each state read and/or written
        once per updated element, as the step's descriptor says; collectives
        and the norm pass not counted) and bytes_per_s, refreshes / rebuilds (cumulative counts of master
        refreshes and native rebuilds), no_grads (no param had a gradient:
        nothing ran)."""
        self._metrics_hooks.append(fn)
        return _RemovableHandle(self._metrics_hooks, fn)

    @property
    def metrics(self):
        return self.last_metrics

    def _metrics(self, t0, t1, t2, no_grads=False):
        step_s = (t2 - t1) if t1 is not None else 0.0
        over = (t1 - t0) if t1 is not None else (time.perf_counter() - t0)
        elems = 0 if no_grads else self._active_elems / max(self.world_size, 1)
        nbytes = int(elems * self._bytes_per_elem)
        loss = self.last_loss
        try:
            loss = float(loss) if loss is not None else None
        except (TypeError, ValueError):
            loss = None
        m = dict(step=self.steps_taken, grad_norm=float(self.last_grad_norm),
                 skipped=bool(self.last_skipped),
                 loss_scale=float(self.last_loss_scale) if not no_grads else float("nan"),
                 loss=loss, lr=[g.get("lr") for g in self.param_groups],
                 active_tensors=(len(self._active) - self._active.count(0)),
                 updated_elems=int(elems), step_time_s=step_s, overhead_s=over,
                 bytes=nbytes, bytes_per_s=(nbytes / step_s if step_s > 0 else float("nan")),
                 refreshes=self.refreshes, rebuilds=self.rebuilds, no_grads=no_grads)
        self.last_metrics = m
        for fn in list(self._metrics_hooks):
            fn(self, m)

    # ---- seed, step counts -----------------------------------------------------------
    @_exclusive("set_seed")
    def set_seed(self, seed):
        """Seed of stochastic rounding (steps with a bf16 state declared
        `rounding stochastic`): same seed, same bits on any thread count."""
        check(self._lib.zopt_optimizer_set_seed(self._handle(), int(seed) & (2**64 - 1)),
              "set_seed")
        self._seed = int(seed) & (2**64 - 1)

    @property
    @_exclusive("seed")
    def seed(self):
        s = ctypes.c_uint64()
        check(self._lib.zopt_optimizer_get_seed(self._handle(), ctypes.byref(s)), "get_seed")
        return s.value

    @_exclusive("step_count")
    def step_count(self, gid=0):
        """Steps in which any tensor of group ``gid`` was updated."""
        if self._cohort_gid and 0 <= gid < self._native_G:
            return max(self._native_step_count(ng) for ng in self._native_gids(gid))
        return self._native_step_count(gid)

    def _native_step_count(self, ng):
        c = ctypes.c_int64()
        check(self._lib.zopt_optimizer_get_step_count(self._handle(), ng, ctypes.byref(c)),
              "get_step_count")
        return c.value

    def _native_steps(self):
        """The step count of every native group (param groups, then the
        extra groups of GPU steps)."""
        return [self._native_step_count(ng)
                for ng in range(self._native_G + len(self._cohort_gid))]

    def _tensor_step(self, t):
        if t in self._excluded:  # left out (GPU step): never stepped
            return 0
        c = ctypes.c_int64()
        check(self._lib.zopt_optimizer_get_tensor_step(self._handle(), int(t), ctypes.byref(c)),
              "get_tensor_step")
        return c.value

    @_exclusive("tensor_step")
    def tensor_step(self, p):
        """The steps param ``p`` (a param or a tensor index) took (torch's
        state[p]['step'])."""
        return self._tensor_step(self._tid(p))

    def _tid(self, p):
        if isinstance(p, (int, np.integer)):
            self._tensor(int(p))
            return int(p)
        t = self._tid_map.get(id(p))
        if t is None:
            raise ZoptError(Status.INVALID_ARGUMENT, "not a param of this optimizer")
        return t

    # ---- loss scaling ------------------------------------------------------------------
    @staticmethod
    def _scaler_config(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=2000, min_scale=1.0, dynamic=True):
        return dict(init_scale=float(init_scale), growth_factor=float(growth_factor),
                    backoff_factor=float(backoff_factor), growth_interval=int(growth_interval),
                    min_scale=float(min_scale), dynamic=bool(dynamic))

    def _configure_scaler(self, h, c):
        cfg = _lib.LossScalerConfig(c["init_scale"], c["growth_factor"], c["backoff_factor"],
                                    c["growth_interval"], c["min_scale"],
                                    1 if c["dynamic"] else 0)
        check(self._lib.zopt_optimizer_configure_loss_scaler(h, ctypes.byref(cfg)),
              "configure_loss_scaler")

    @_exclusive("configure_loss_scaler")
    def configure_loss_scaler(self, **kw):
        """(Re)starts the loss scaler (init_scale, growth_factor,
        backoff_factor, growth_interval, min_scale, dynamic)."""
        c = self._scaler_config(**kw)
        self._configure_scaler(self._handle(), c)
        self._scaler_cfg = c

    @property
    @_exclusive("loss_scale")
    def loss_scale(self):
        """The scale S the next step's gradients must be multiplied by."""
        s = ctypes.c_double()
        check(self._lib.zopt_optimizer_get_loss_scale(self._handle(), ctypes.byref(s)),
              "get_loss_scale")
        return s.value

    def _scaler_state(self):
        """(scale, good_steps, config) of the runtime's scaler: the scale
        and good-step count read from the runtime, which owns them (GPU
        steps: from the device); the configuration is the one this binding
        gave it (the C API has no getter for it). A step without loss
        scaling reports its configured initial scale."""
        cfg = self._scaler_cfg or self._scaler_config()
        scale, good = ctypes.c_double(), ctypes.c_int64()
        check(self._lib.zopt_optimizer_get_loss_scaler_state(
            self._handle(), ctypes.byref(scale), ctypes.byref(good)),
            "zopt_optimizer_get_loss_scaler_state")
        return (scale.value if self.step_obj.loss_scaled else cfg["init_scale"]), good.value, cfg

    # ---- state access -------------------------------------------------------------------
    @property
    def num_tensors(self):
        return len(self._entries)

    def _tensor(self, tensor_idx):
        if not (0 <= int(tensor_idx) < len(self._entries)):
            raise ZoptError(Status.INVALID_ARGUMENT, f"no tensor {tensor_idx} "
                            f"(the optimizer has {len(self._entries)})")
        return self._entries[int(tensor_idx)]

    @_exclusive("read_state")
    def read_state(self, tensor_idx, kind):
        """State ``kind`` ('exp_avg', StateKind.MASTER, ...) of a tensor (an
        index or a param) as a float32 numpy array (flat, memory order)."""
        k = _kind(kind)
        t = self._tid(tensor_idx)
        self._check_held(t, "read_state")
        self._prepare()
        n = self._entries[t].numel
        out = np.empty(n, dtype=np.float32)
        check(self._lib.zopt_optimizer_read_state_f32(
            self._h, t, int(k), ctypes.c_void_p(out.ctypes.data if n else None), n),
            f"read_state({t}, {STATE_NAMES[k]})")
        return out

    @_exclusive("write_state")
    def write_state(self, tensor_idx, kind, values):
        """Writes a state from float32 values (rounded to its storage dtype).
        Writing the master also writes round(master) into the param where it
        is not already a rounding of it (as ``opt.state[p]['master'] = ...``
        does), so model and master agree."""
        k = _kind(kind)
        t = self._tid(tensor_idx)
        self._check_held(t, "write_state")
        n = self._entries[t].numel
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
        if a.size != n:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"write_state: {a.size} values for a tensor of {n}")
        check(self._lib.zopt_optimizer_write_state_f32(
            self._handle(), t, int(k), ctypes.c_void_p(a.ctypes.data if n else None), n),
            f"write_state({t}, {STATE_NAMES[k]})")
        if k == StateKind.PARAM:
            if self._entries[t].dense is not None:
                _strided.copy_out(self._entries, [t])
            self._reset_watch()
        if k == StateKind.MASTER and n:
            m = self._read_raw(t, StateKind.MASTER)
            self._apply_master_sync(
                self._master_sync({t: (m, self.step_obj.state_dtype(k))}), gather=[t])
        self._outdate([t], (TORCH_KEY.get(k),))

    @_exclusive("read_state_raw")
    def read_state_raw(self, tensor_idx, kind):
        """Storage-exact copy of a state (uint16 for bf16, float16, float32)."""
        k = _kind(kind)
        t = self._tid(tensor_idx)
        self._check_held(t, "read_state_raw")
        self._prepare()
        if self.step_obj.state_dtype(k) is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"the step has no state {STATE_NAMES[k]}")
        return self._read_raw(t, k)

    def _read_raw(self, t, k):
        dt = self.step_obj.state_dtype(k)
        n = self._entries[t].numel
        out = np.empty(n, dtype=_NP_OF[dt])
        check(self._lib.zopt_optimizer_read_state_raw(
            self._h, t, int(k), ctypes.c_void_p(out.ctypes.data if n else None),
            out.nbytes), f"read_state_raw({t}, {STATE_NAMES[k]})")
        return out

    def _write_raw(self, t, k, arr):
        a = np.ascontiguousarray(arr)
        check(self._lib.zopt_optimizer_write_state_raw(
            self._h, t, int(k), ctypes.c_void_p(a.ctypes.data if a.size else None),
            a.nbytes), f"write_state_raw({t}, {STATE_NAMES[k]})")
        if k == StateKind.PARAM and self._entries[t].dense is not None:
            _strided.copy_out(self._entries, [t])

    @_exclusive("memory_info")
    def memory_info(self):
        m = _lib.MemoryInfo()
        check(self._lib.zopt_optimizer_memory_info(self._handle(), ctypes.byref(m)),
              "memory_info")
        return {f: getattr(m, f) for f, _ in _lib.MemoryInfo._fields_}

    @_exclusive("refresh_master")
    def refresh_master(self, params=None):
        """Makes the master (and ZeRO-3's held params) again the params'
        current values, for ``params`` (params or tensor indices; default
        all): after writes the optimizer cannot see (a slice written
        through ``p.data``, memory written from C)."""
        self._handle()
        tids = range(len(self._entries)) if params is None else [self._tid(p) for p in params]
        tids = [t for t in tids if t not in self._released]
        if self._strided:  # the registered copies read the params' current values
            _strided.copy_in(self._entries, self._strided)
        self._refresh(list(tids))

    # ---- memory layout helpers -----------------------------------------------------------
    def _memory_order(self, e, x):
        """numpy storage bits of tensor x in the memory order of entry e's
        param (x has e's shape; any layout)."""
        if e.torch:
            x = x.detach().to("cpu")
            if e.stride is not None and e.numel and tuple(x.stride()) != e.stride:
                y = torch.empty_strided(e.shape, e.stride, dtype=x.dtype)
                y.copy_(x)
                x = y
            if e.numel:
                x = x.as_strided((e.numel,), (1,))
            return _np_bits(x)
        return np.ascontiguousarray(x).reshape(-1)

    def _user_tensor(self, e, flat, dt):
        """A state (numpy storage bits, memory order) as the user sees it:
        a CPU torch tensor shaped (and strided) like the param; for numpy
        params (or without torch) a numpy array (bf16 widened to f32)."""
        if torch is not None:
            src = _from_bits(flat, dt)
            if e.torch:
                out = torch.empty_strided(e.shape, e.stride, dtype=src.dtype)
                if e.numel:
                    out.as_strided((e.numel,), (1,)).copy_(src)
                return out
            return src.clone().reshape(e.shape)
        if dt == DType.BF16:
            from . import bf16
            return bf16.to_f32(flat).reshape(e.shape)
        return flat.copy().reshape(e.shape)

    def _flat_from_user(self, e, v, key):
        """A state value from a state_dict -> numpy array in the param's
        memory order (f32, bf16 bits or f16)."""
        if _is_torch(v):
            v = v.detach().to("cpu")
            if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                v = v.float()
            if v.numel() != e.numel or (tuple(v.shape) != e.shape and v.dim() > 1):
                raise ZoptError(Status.CHECKPOINT,
                                f"state_dict: {e.name}: '{key}' has shape {tuple(v.shape)}")
            v = v.reshape(e.shape)
            if e.torch:
                return self._memory_order(e, v), _torch_dtypes()[v.dtype]
            return _np_bits(v.contiguous()), _torch_dtypes()[v.dtype]
        a = np.asarray(v)
        if a.size != e.numel:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict: {e.name}: '{key}' has {a.size} values")
        if a.dtype not in (np.float32, np.float16, np.uint16):
            a = a.astype(np.float32)
        if e.torch and torch is not None and a.dtype != np.uint16:
            return self._memory_order(e, torch.from_numpy(
                np.ascontiguousarray(a).reshape(e.shape))), _NP_DTYPES[a.dtype]
        return np.ascontiguousarray(a).reshape(-1), _NP_DTYPES[a.dtype]

    def _param_state(self, t):
        """state[p] of tensor t: {} before its first step."""
        self._prepare()
        steps = self._tensor_step(t)
        if steps == 0:
            return {}
        e = self._entries[t]
        d = {"step": torch.tensor(float(steps)) if torch is not None else steps}
        for k in self.step_obj.owned_states:
            d[TORCH_KEY[k]] = self._user_tensor(e, self._read_raw(t, k),
                                                self.step_obj.state_dtype(k))
        return d

    # ---- opt.state[p]: read from and written through to the runtime ------------------------
    _lent = ()          # [_Lent]: tensors handed out by state[p] (a list once one is)
    _state_epoch = 0    # bumped when a load replaces every state

    def _state_keys(self, t):
        """The keys of state[p] of tensor t: none before its first step."""
        if self._tensor_step(t) == 0:
            return []
        return ["step"] + [TORCH_KEY[k] for k in self.step_obj.owned_states]

    def _state_get(self, t, key):
        """state[p][key] of tensor t: a CPU copy, lent (in-place changes
        written back while it is current)."""
        self._prepare()  # (writes back what was changed in place so far)
        s = self.step_obj
        k = KIND_OF_KEY.get(key) if isinstance(key, str) and key != "step" else None
        if self._tensor_step(t) == 0 or (key != "step" and k not in s.owned_states):
            raise KeyError(key)
        if key == "step":
            steps = self._tensor_step(t)
            v = torch.tensor(float(steps)) if torch is not None else steps
        else:
            v = self._user_tensor(self._entries[t], self._read_raw(t, k), s.state_dtype(k))
        self._lend(t, key, v)
        return v

    def _state_set(self, t, values):
        """state[p][key] = value (for each entry; all checked first)."""
        self._prepare()
        vals = self._state_values(t, values)
        self._write_values(t, vals)
        self._outdate([t], set(vals))
        for key, v in values.items():
            self._lend(t, key, v, assigned=True)

    def _state_assign(self, t, values):
        """state[p] = values: the entries written, every other state reset
        (moments zero, step 0, the master made from the param)."""
        if t in self._excluded and not values:  # left out: nothing to reset
            return
        self._prepare()
        vals = self._state_values(t, values)
        s = self.step_obj
        e = self._entries[t]
        fresh = {} if "step" in vals else {"step": 0}
        for k in s.owned_states:
            if TORCH_KEY[k] not in vals and k != StateKind.MASTER:
                fresh[TORCH_KEY[k]] = np.zeros(e.numel, dtype=_NP_OF[s.state_dtype(k)])
        self._write_values(t, fresh)
        if s.has_master and "master" not in vals and e.numel:
            if s.zero3:  # from the held param (the model's may be released)
                held = self._read_raw(t, StateKind.PARAM)
                self._write_raw(t, StateKind.MASTER, _dtypes.convert_bits(
                    held, s.param_dtype, s.state_dtype(StateKind.MASTER)))
            else:
                self._refresh([t])
        self._write_values(t, vals)
        self._outdate([t])
        for key, v in values.items():
            self._lend(t, key, v, assigned=True)

    def _state_values(self, t, values):
        """Checks {key: value} for tensor t's states -> {key: storage bits in
        the param's memory order (numpy), or the step count for 'step'}."""
        e = self._entries[t]
        s = self.step_obj
        out = {}
        if values:
            self._check_held(t, "opt.state[p] = ...")
        for key, v in values.items():
            what = f"opt.state[p][{key!r}] of {e.name}"
            if key == "step":
                out[key] = self._step_value(v, what)
                continue
            k = KIND_OF_KEY.get(key) if isinstance(key, str) else None
            if k is None or k not in s.owned_states:
                known = ["step"] + [TORCH_KEY[q] for q in s.owned_states]
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: step '{s.name}' has no state {key!r}; its states: "
                                + ", ".join(map(repr, known)))
            out[key] = self._state_bits(e, v, s.state_dtype(k), what)
        return out

    @staticmethod
    def _step_value(v, what):
        if _is_torch(v) or isinstance(v, np.ndarray):
            n = v.numel() if _is_torch(v) else v.size
            if n != 1:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: a step count is one number, got {n} values")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: a step count (a number or a one-element tensor), "
                            f"got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f) or f < 0 or f != int(f):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what} = {v!r}: a step count is a whole number >= 0")
        return int(f)

    def _state_bits(self, e, v, dt, what):
        """A state value (torch tensor or numpy array of the param's shape,
        any float dtype) -> storage bits of dtype dt, param memory order."""
        if _is_torch(v):
            if v.is_sparse or v.is_complex() or not v.is_floating_point():
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: a {v.dtype} tensor; states take floating-point "
                                f"values (stored as {DTYPE_NAMES[dt]})")
            if tuple(v.shape) != e.shape:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: shape {tuple(v.shape)}, the param's is {e.shape}")
            x = v.detach().to("cpu", _torch_of(dt))
            return self._memory_order(e, x) if e.torch else _np_bits(x.contiguous())
        if isinstance(v, np.ndarray):
            if v.dtype.kind != "f":
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: a numpy {v.dtype} array; states take floating-point "
                                f"values (stored as {DTYPE_NAMES[dt]}; for bf16 bit patterns "
                                "pass zopt.bf16.to_f32(bits))")
            if tuple(v.shape) != e.shape:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what}: shape {tuple(v.shape)}, the param's is {e.shape}")
            a = np.ascontiguousarray(v, dtype=np.float32)
            if e.torch and torch is not None:
                return self._memory_order(e, torch.from_numpy(a).to(_torch_of(dt)))
            return _round_bits(a.reshape(-1), dt)
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{what}: a {type(v).__name__}; states take a tensor (or numpy "
                        f"array) of the param's shape {e.shape}")

    def _write_values(self, t, vals):
        """Checked values (_state_values) into the runtime; a master also
        into the param, rounded (ZeRO-3: the held param), so they agree."""
        s = self.step_obj
        for key, v in vals.items():
            if key == "step":
                check(self._lib.zopt_optimizer_set_tensor_step(self._handle(), int(t), int(v)),
                      f"zopt_optimizer_set_tensor_step({self._entries[t].name})")
                continue
            k = KIND_OF_KEY[key]
            if self._entries[t].numel:
                self._write_raw(t, k, v)
            if k == StateKind.MASTER:
                self._apply_master_sync(
                    self._master_sync({t: (v, s.state_dtype(k))}), gather=[t])

    def _lend(self, t, key, v, assigned=False):
        if not _is_torch(v):
            return
        if not isinstance(self._lent, list):
            self._lent = []
        if assigned:  # v may be a tensor lent before (state[p]['step'] += 1)
            self._lent = [r for r in self._lent
                          if not (r.t == t and r.key == key and r.ref() is v)]
        self._lent.append(_Lent(v, t, key, self.steps_taken, self._state_epoch))

    def _outdate(self, tids, keys=None):
        """Lent tensors of (tids, keys) no longer hold the runtime's state."""
        tids = set(tids)
        for r in self._lent:
            if r.t in tids and (keys is None or r.key in keys):
                r.stale = True

    def _flush_lent(self):
        """In-place changes to lent state tensors: written back where the
        tensor is still current (the runtime has not changed that state
        since), warned about where it is outdated. Dead tensors dropped, and
        outdated ones a step after they became so."""
        lent, self._lent = self._lent, []
        keep, lost = [], []
        try:
            for i, r in enumerate(lent):
                x = r.ref()
                r.strong = None
                if x is None:
                    continue
                current = (not r.stale and r.steps == self.steps_taken
                           and r.epoch == self._state_epoch)
                if x._version == r.ver:
                    if current or self.steps_taken - r.steps <= 1:
                        keep.append(r)
                    continue
                if not current:
                    lost.append(f"{self._entries[r.t].name}[{r.key!r}]")
                    continue
                try:
                    self._write_values(r.t, self._state_values(r.t, {r.key: x}))
                except ZoptError as err:
                    lost.append(f"{self._entries[r.t].name}[{r.key!r}] ({err.message})")
                    continue
                r.ver = x._version
                keep.append(r)
        except BaseException:
            keep += lent[i + 1:]
            raise
        finally:
            self._lent = keep + self._lent
        if lost:
            warn_user(
                f"zopt: in-place changes to {len(lost)} state tensor(s) read from "
                f"opt.state[p] were not written back: {', '.join(lost[:4])}"
                + (", ..." if len(lost) > 4 else "")
                + ". They are copies, and the optimizer had changed those states since "
                "they were read (a step, a load or another write). Read the state again "
                "after each step, or assign it: opt.state[p][key] = tensor",
                RuntimeWarning)

    # ---- model and master agree after a load ----------------------------------------------
    def _param_bits(self, e):
        """A param's storage bits in memory order (a copy)."""
        if e.torch:
            return self._memory_order(e, e.param)
        return np.ascontiguousarray(e.param).reshape(-1).copy()

    def _master_sync(self, masters, params=None):
        """masters {t: (flat master bits in memory order, dtype)} -> {t:
        round(master) in the param dtype} for the tensors whose param is not
        a rounding of its master (``params`` {t: bits} or, by default, the
        model's params; ZeRO-3: the runtime's held params)."""
        s = self.step_obj
        pdt = s.param_dtype
        fixes = {}
        for t, (m, mdt) in masters.items():
            e = self._entries[t]
            if not e.numel:
                continue
            if params is not None:
                cur = params[t]
            elif s.zero3:
                cur = self._read_raw(t, StateKind.PARAM)
            else:
                cur = self._param_bits(e)
            mf = _f32_of_bits(np.ascontiguousarray(m).reshape(-1), mdt)
            if not _is_rounding_of(cur, pdt, mf).all():
                fixes[t] = _round_bits(mf, pdt)
        return fixes

    def _apply_master_sync(self, fixes, gather=None):
        """Writes fixes {t: param bits} into the params (ZeRO-3: the held
        params, then, with zero3_gather="step", gathers ``gather`` into the
        model: a collective, the same tensors on every rank) and resets the
        write checks' baselines to them."""
        s = self.step_obj
        if s.zero3:
            for t, b in fixes.items():
                self._write_raw(t, StateKind.PARAM, b)
            if self._zero3_mode == "step":
                tids = sorted(fixes) if gather is None else sorted(set(gather))
                if tids:
                    self._gather(tids)
            return
        if not fixes:
            return
        for t, b in fixes.items():
            e = self._entries[t]
            if e.torch:
                src = _from_bits(b, s.param_dtype).to(e.param.device)
                with torch.no_grad():
                    if e.dense is not None:  # a strided param and its registered copy
                        e.dense.view(-1).copy_(src)
                        e.param.data.copy_(e.dense)
                    else:
                        e.param.data.as_strided((e.numel,), (1,)).copy_(src)
            else:
                e.param.reshape(-1)[...] = np.ascontiguousarray(b).view(e.param.dtype)
        # new baselines for the written params only: a write into another
        # param not yet seen by the checks is still found
        if self._sampler is not None:
            self._sampler.snapshot(list(fixes))
        for t in fixes:
            j = self._tp_index.get(t)
            if j is not None:
                self._tp_vers[j] = self._tp_params[j]._version

    def _finish_master_load(self, pending, what, warn=True):
        """After a load: round(master) into the params that disagreed with
        it, and (``warn``) a warning if there were any (at the user's line,
        _warnings.warn_user). Returns (changed, with a master)."""
        fixes, tids, changed = pending
        if not tids:
            return 0, 0
        self._apply_master_sync(fixes, gather=tids)
        if changed and warn:
            _warn_master_replaced(what, len(changed), len(tids))
        return len(changed), len(tids)

    def _loaded_master_pending(self):
        """After the runtime loaded a checkpoint: (fixes, tensors with a
        master, tensors whose model params change) for
        :meth:`_finish_master_load`. ZeRO-3: the held params are fixed
        where they disagree with the master; the model's params (those not
        released), which the next gather replaces, are compared too."""
        s = self.step_obj
        if not s.has_master:
            return {}, [], set()
        tids = [t for t, e in enumerate(self._entries) if e.numel and t not in self._excluded]
        mdt = s.state_dtype(StateKind.MASTER)
        masters = {t: (self._read_raw(t, StateKind.MASTER), mdt) for t in tids}
        fixes = self._master_sync(masters)
        changed = set(fixes)
        if s.zero3:
            shown = [t for t in tids if t not in self._released]
            changed |= set(self._master_sync(
                {t: masters[t] for t in shown},
                params={t: self._param_bits(self._entries[t]) for t in shown}))
        return fixes, tids, changed

    # ---- snapshots and restores ------------------------------------------------------------
    def _ckpt_kinds(self):
        kinds = list(self.step_obj.owned_states)
        if self.step_obj.zero3:
            kinds.append(StateKind.PARAM)
        return kinds

    def _snapshot(self):
        """Everything the native optimizer holds (states raw, step counts,
        scaler, seed); collective at world size > 1 for sharded states."""
        self._handle()
        kinds = self._ckpt_kinds()
        data = {}
        for t, e in enumerate(self._entries):
            if t in self._excluded:  # no states (GPU steps' frozen params)
                continue
            for k in kinds:
                data[(k, t)] = self._read_raw(t, k) if e.numel else \
                    np.empty(0, dtype=_NP_OF[self.step_obj.state_dtype(k)])
        native = self._native_steps()
        G = self._native_G
        return dict(kinds=kinds, data=data,
                    steps=[self._tensor_step(t) for t in range(len(self._entries))],
                    group_steps=[max([native[g]] + [native[G + c] for c, x in
                                                    enumerate(self._cohort_gid) if x == g])
                                 for g in range(G)],
                    native_steps=native, native_G=G,
                    scaler=self._scaler_state(), seed=self.seed)

    def _restore(self, snap, flags=0, file_kinds=None):
        """Loads a snapshot (old tensors; new ones start fresh) through a
        checkpoint file the binding writes (the only way to set step counts
        and the scaler's state through the C API)."""
        s = self.step_obj
        kinds = list(file_kinds if file_kinds is not None else snap["kinds"])
        dts = {}
        for (k, t), a in snap["data"].items():
            dts.setdefault(k, _NP_DTYPES[a.dtype])
        kind_dt = [(k, dts.get(k, s.state_dtype(k) or DType.F32)) for k in kinds]
        kidx = {k: i for i, (k, _) in enumerate(kind_dt)}
        data = {}
        for (k, t), a in snap["data"].items():
            if k not in kidx:
                continue
            want = _NP_OF[kind_dt[kidx[k]][1]]
            if a.dtype != want:
                a = _dtypes.convert_bits(a, _NP_DTYPES[a.dtype], kind_dt[kidx[k]][1])
            data[(kidx[k], t)] = a
        steps = list(snap["steps"]) + [0] * (len(self._entries) - len(snap["steps"]))
        ex = self._excluded
        for t in ex:  # left out (GPU steps): no states, never stepped
            steps[t] = 0
        data = {key: a for key, a in data.items() if key[1] not in ex}
        gsteps = list(snap["group_steps"])
        gsteps += [0] * (len(self.param_groups) - len(gsteps))
        # Native groups: the param groups' (a snapshot's own counts where it
        # has them), then the extra groups of GPU steps (those the snapshot
        # had keep their counts; a new one starts at its tensors' steps).
        native, nG = snap.get("native_steps"), snap.get("native_G", 0)
        G = len(self.param_groups)
        counts = [native[g] if native is not None and g < nG else gsteps[g] for g in range(G)]
        for c in range(len(self._cohort_gid)):
            if native is not None and nG + c < len(native):
                counts.append(native[nG + c])
            else:
                counts.append(max([steps[t] for t, x in self._cohort_of.items() if x == c]
                                  or [0]))
        groups = []
        for ng, gid in enumerate(list(range(G)) + list(self._cohort_gid)):
            g = self.param_groups[gid]
            groups.append((counts[ng], [(int(HYPER_BY_NAME[n]), v)
                                        for n, v in _slots(g, s.hypers).items()],
                           _ckpt.GROUP_MAXIMIZE if g.get("maximize") else 0))
        cohort = self._cohort_of
        tensors = [(e.group if t not in cohort else G + cohort[t],
                    0 if t in ex else e.numel, steps[t]) for t, e in enumerate(self._entries)]
        scale, good, cfg = snap["scaler"]
        scaler = (scale, good, cfg["init_scale"], cfg["growth_factor"], cfg["backoff_factor"],
                  cfg["growth_interval"], cfg["min_scale"], cfg["dynamic"])
        with tempfile.TemporaryDirectory(prefix="zopt-load-") as d:
            path = os.path.join(d, "state.zckpt")
            _ckpt.write(path, name=s.name, desc_checksum=s.checksum, scaler=scaler,
                        seed=snap["seed"], kinds=[(int(k), int(dt)) for k, dt in kind_dt],
                        groups=groups, tensors=tensors, data=data)
            check(self._lib.zopt_optimizer_load_ex(self._handle(), path.encode(), flags),
                  "load_state_dict")
        self._scaler_cfg = dict(cfg)
        self._seed = snap["seed"]
        self._push_flags()
        self._reset_watch()

    # ---- checkpoints ------------------------------------------------------------------------
    @_exclusive("save")
    def save(self, path):
        """Writes a runtime checkpoint (zopt_optimizer_save; collective at
        world size > 1, each rank writing its file)."""
        self._prepare()
        self._push_hypers()
        with collective_errors(self, "save"):
            check(self._lib.zopt_optimizer_save(self._h, os.fspath(path).encode()),
                  f"save({path})")

    @_exclusive("load")
    def load(self, path, allow_rule_change=False):
        """Loads a runtime checkpoint (zopt_optimizer_load_ex); a checkpoint
        of another update rule is refused unless ``allow_rule_change``.
        param_groups are refreshed from the runtime afterwards. Steps with a
        master: as :meth:`load_state_dict`, params that are not a rounding
        of the loaded master are set to round(master) at once, with a
        :class:`MasterWeightsWarning` (load the model first for a resume;
        a model loaded after this call wins)."""
        with collective_errors(self, "load"):
            self._finish_master_load(self._load_file(path, allow_rule_change), "load")

    def _load_file(self, path, allow_rule_change=False):
        """load() without the params' update: returns what it would be."""
        self._prepare()
        flags = _lib.LOAD_ALLOW_RULE_CHANGE if allow_rule_change else 0
        regrouped = None
        if self.step_obj.gpu:  # the file's extra native groups (params that joined later)
            cohorts = self._file_cohorts(path)
            if cohorts is not None and cohorts != (self._cohort_gid, self._cohort_of):
                regrouped = self._regroup(cohorts)
        try:
            check(self._lib.zopt_optimizer_load_ex(self._handle(), os.fspath(path).encode(),
                                                   flags), f"load({path})")
        except BaseException:
            if regrouped is not None:
                self._undo_regroup(*regrouped)
            raise
        for gid in range(len(self.param_groups)):
            self._sync_group_from_c(gid)
        try:  # the scaler's configuration: the file's (no C getter for it)
            self._scaler_cfg = _ckpt.read_scaler(path)[2]
        except (OSError, ValueError):
            pass
        s = ctypes.c_uint64()
        check(self._lib.zopt_optimizer_get_seed(self._h, ctypes.byref(s)), "get_seed")
        self._seed = s.value
        self._reset_watch()
        self._state_epoch += 1
        return self._loaded_master_pending()

    @_exclusive("state_dict")
    def state_dict(self):
        """torch's layout: ``{'state': {index: {'step': tensor, 'exp_avg':
        tensor, ...}}, 'param_groups': [{..., 'params': [indices]}]}`` plus
        ``'zopt'``: the loss scaler, the seed, per-group step counts, the
        step's name and states. State tensors are CPU copies in the state's
        storage dtype, shaped (and strided) like their param; a step with a
        master adds 'master' (ZeRO-3's held params are not in it: they are
        the model's, after ``gather_params()``). It loads into ``torch.optim.AdamW`` & co. (which ignore the extras) and
        back. Collective at world size > 1."""
        self._prepare()
        self._push_hypers()
        with collective_errors(self, "state_dict"):
            snap = self._snapshot()
        s = self.step_obj
        state = {}
        for t, e in enumerate(self._entries):
            if snap["steps"][t] == 0:
                continue
            d = {"step": torch.tensor(float(snap["steps"][t])) if torch is not None
                 else snap["steps"][t]}
            for k in snap["kinds"]:
                if (k, t) in snap["data"] and k != StateKind.PARAM:
                    d[TORCH_KEY[k]] = self._user_tensor(e, snap["data"][(k, t)],
                                                        s.state_dtype(k))
            state[t] = d
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: (tuple(v) if isinstance(v, tuple) else v)
                      for k, v in g.items() if k != "params"}
            if s.adam_like:
                packed.setdefault("amsgrad", StateKind.MAX_EXP_AVG_SQ in s.state_flags)
            if s.plain_sgd:  # torch.optim.SGD's keys of its momentum-0 rule
                for k, v in (("momentum", 0.0), ("dampening", 0.0), ("nesterov", False)):
                    packed.setdefault(k, v)
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        scale, good, cfg = snap["scaler"]
        return {
            "state": state,
            "param_groups": groups,
            "zopt": {
                "format": "zopt-torch-state-dict-1",
                "step_name": s.name,
                "states": [TORCH_KEY[k] for k in snap["kinds"] if k != StateKind.PARAM],
                "group_steps": snap["group_steps"],
                "loss_scaler": dict(scale=scale, good_steps=good, **cfg),
                "seed": snap["seed"],
                "world_size": self.world_size,
            },
        }

    @_exclusive("load_state_dict")
    def load_state_dict(self, state_dict, allow_rule_change=False):
        """Loads a state_dict in torch's layout: zopt's own, or a torch
        optimizer's (``torch.optim.AdamW(...).state_dict()``): per-param
        states by torch's keys, 'step' per param, the groups'
        hyperparameters. A state_dict of another update rule (other states
        or hyperparameters, e.g. SGD's momentum_buffer into AdamW, amsgrad
        on/off) is refused unless ``allow_rule_change`` (then missing states
        start at zero and extra ones are dropped), like the runtime's
        ZOPT_LOAD_ALLOW_RULE_CHANGE. Nothing changes if anything is refused.

        Steps with a master (bf16/f16 params with an f32 master; docs/USAGE.md
        section 4): model and master agree right after the call. Without a
        'master' (torch's state_dict) the master is made from the params as
        they are now. With one, each param that is not a rounding of its
        loaded master (the model holds other weights than the run that
        wrote the state_dict) is set to round(master) at once, and a
        :class:`MasterWeightsWarning` says how many were; a matching model
        (loaded first: a resume) is left as it is, without a warning. To
        keep the model's weights, load them after this call: the master is
        then made again from them (section 4)."""
        with collective_errors(self, "load_state_dict"):
            self._finish_master_load(self._load_state_dict(state_dict, allow_rule_change),
                                     "load_state_dict")

    def _load_state_dict(self, state_dict, allow_rule_change=False):
        """load_state_dict() without the params' update: returns what it
        would be, for :meth:`_finish_master_load`."""
        sd = state_dict
        if sd.get("format") == "zopt-state-dict-1":  # the first binding's
            return self._load_legacy(sd)
        if "state" not in sd or "param_groups" not in sd:
            raise ZoptError(Status.CHECKPOINT,
                            "not an optimizer state_dict (no 'state' / 'param_groups')")
        self._prepare()
        s = self.step_obj
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
            if s.adam_like and "amsgrad" in ng:
                mine = StateKind.MAX_EXP_AVG_SQ in s.state_flags
                if bool(ng["amsgrad"]) != mine:
                    problems.append(f"group {gid} has amsgrad={ng['amsgrad']} (the step: {mine})")
                    ng["amsgrad"] = mine
            ng["params"] = self.param_groups[gid]["params"]
            merged = dict(self.param_groups[gid])
            merged.update(ng)
            new_groups.append(self._complete_group(merged))
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
        mine = set(s.owned_states)
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
        kinds = [k for k in s.owned_states]  # every state the step has
        if s.zero3:
            kinds.append(StateKind.PARAM)
        data = {}
        steps = [0] * len(self._entries)
        dropped = []  # GPU steps: states of params left out (frozen)
        for pid, st in sd["state"].items():
            t = id_map[pid]
            e = self._entries[t]
            if t in self._excluded:
                if any(v is not None for v in st.values()):
                    dropped.append(e.name)
                continue
            steps[t] = self._loaded_step(e, st, kinds)
            for key, v in st.items():
                k = KIND_OF_KEY.get(key)
                if k is None or v is None or k not in kinds or not e.numel:
                    continue
                flat, dt = self._flat_from_user(e, v, key)
                data[(k, t)] = flat
        if s.zero3:  # the held params: the model's params as they are now
            self.gather_params([e.param for t, e in enumerate(self._entries)
                                if t in self._released])
            for t, e in enumerate(self._entries):
                if e.numel:
                    data[(StateKind.PARAM, t)] = self._memory_order(e, e.param) \
                        if e.torch else np.ascontiguousarray(e.param).reshape(-1)
        # The params that are not a rounding of their loaded master: set to
        # round(master) after the load (ZeRO-3: the held params, loaded so).
        mtids = sorted(t for (k, t) in data if k == StateKind.MASTER)
        fixes = self._master_sync(
            {t: (data[(StateKind.MASTER, t)], _NP_DTYPES[data[(StateKind.MASTER, t)].dtype])
             for t in mtids},
            params={t: data[(StateKind.PARAM, t)] for t in mtids} if s.zero3 else None)
        if s.zero3:
            for t, b in fixes.items():
                data[(StateKind.PARAM, t)] = b
        z = sd.get("zopt", {})
        gsteps = z.get("group_steps")
        if not gsteps or len(gsteps) != len(self.param_groups):
            gsteps = [max([steps[t] for t, e in enumerate(self._entries) if e.group == g] or [0])
                      for g in range(len(self.param_groups))]
        scale, good, cfg = self._scaler_state()
        if "loss_scaler" in z:
            ls = dict(z["loss_scaler"])
            scale, good = float(ls.pop("scale")), int(ls.pop("good_steps"))
            cfg = self._scaler_config(**ls)
        seed = int(z["seed"]) if "seed" in z else self.seed
        snap = dict(kinds=kinds, data=data, steps=steps, group_steps=gsteps,
                    scaler=(scale, good, cfg), seed=seed)
        regrouped = None
        if s.gpu:  # one count per native group: params of other counts in groups of their own
            cohorts = self._cohorts_by_steps(steps, gsteps)
            if self._partition(cohorts[1]) != self._partition(self._cohort_of):
                regrouped = self._regroup(cohorts)
        old_groups = self.param_groups
        self.param_groups = new_groups
        try:
            self._restore(snap, flags=_lib.LOAD_ALLOW_RULE_CHANGE if allow_rule_change else 0)
        except BaseException:
            self.param_groups = old_groups
            if regrouped is not None:
                self._undo_regroup(*regrouped)
            raise
        for g, new in zip(old_groups, new_groups):  # keep the dict objects
            g.clear()
            g.update(new)
        self.param_groups = old_groups
        self._pushed = [_slots(g, s.hypers) for g in self.param_groups]
        self._pushed_raw = [self._raw_hypers(g) for g in self.param_groups]
        self._state_epoch += 1
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
        return fixes, mtids, set(fixes)

    def _loaded_step(self, e, st, kinds):
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
                return self._step_value(stv, f"state_dict: {e.name}: 'step'")
            except ZoptError as err:
                raise ZoptError(Status.CHECKPOINT, err.message) from None
        held = [key for key, v in st.items()
                if v is not None and KIND_OF_KEY.get(key) in kinds]
        if not held:
            return 0
        if self.step_obj.adam_like:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict: {e.name} has {', '.join(held)} but no 'step': "
                            "Adam's bias correction needs the param's step count")
        return 1

    def _file_cohorts(self, path):
        """GPU steps: the extra native groups of a checkpoint file written by
        save() (params that joined after the optimizer was built, each such
        group a native group after the param groups'), as (cohort_gid,
        cohort_of) for this optimizer's tensors; None if the file does not
        say or does not fit (the runtime's load then names the mismatch)."""
        groups = _file_tensor_groups(path)
        if groups is None:
            return None
        ngroups, tgroup = groups
        G = len(self.param_groups)
        if len(tgroup) != len(self._entries) or ngroups < G:
            return None
        gid_of = [None] * (ngroups - G)
        cohort_of = {}
        for t, (e, fg) in enumerate(zip(self._entries, tgroup)):
            if fg < G:
                if fg != e.group:
                    return None
                continue
            c = fg - G
            if c >= len(gid_of) or gid_of[c] not in (None, e.group):
                return None
            gid_of[c] = e.group
            cohort_of[t] = c
        if None in gid_of:
            return None
        return gid_of, cohort_of

    def _load_legacy(self, sd):
        blob = sd.get("checkpoint")
        if blob is None:
            raise ZoptError(Status.CHECKPOINT, "legacy zopt state_dict without its checkpoint")
        with tempfile.TemporaryDirectory(prefix="zopt-sd-") as d:
            p = os.path.join(d, "ckpt")
            with open(p, "wb") as f:
                f.write(blob)
            return self._load_file(p)

    # ---- ZeRO-3 --------------------------------------------------------------------------
    def _zero3_only(self, what):
        if not self.step_obj.zero3:
            raise ZoptError(Status.BAD_STATE,
                            f"{what}: step '{self.step_obj.name}' is not ZeRO-3 (its params "
                            "are the model's own memory, always current)")

    def _tids_of(self, params):
        if params is None:
            return list(range(len(self._entries)))
        return sorted({self._tid(p) for p in params})

    @_exclusive("gather_params")
    def gather_params(self, params=None):
        """ZeRO-3: writes the current full params (``params``, default all)
        into the model's parameter storage, re-allocating released storage.
        Collective: every rank calls it with the same params. For other
        steps the params are always current and this does nothing."""
        h = self._handle()
        if not self.step_obj.zero3:
            return
        tids = self._tids_of(params)
        self._check_some(tids)  # user writes into held params are not lost
        with collective_errors(self, "gather_params"):
            self._gather(tids)

    def _gather(self, tids):
        h = self._h
        for t in tids:
            if t in self._released:
                e = self._entries[t]
                _torch_compat.storage_resize_(e.param.data, e.numel * e.param.element_size())
                self._released.discard(t)
        run = []
        for t in tids + [None]:
            if t is not None and run and t == run[-1] + 1:
                run.append(t)
                continue
            if run:
                dst, _ = _lib.c_array(ctypes.c_void_p, [
                    self._entries[u].param.data_ptr() if self._entries[u].numel else None
                    for u in run])
                check(self._lib.zopt_optimizer_gather_params(h, run[0], len(run),
                                                             dst.ctypes.data),
                      "zopt_optimizer_gather_params")
            run = [t] if t is not None else []
        self._seen(tids)

    def _check_some(self, tids):
        """The per-step write check (storage, version) on a few tensors."""
        changed = []
        for t in tids:
            j = self._tp_index.get(t)
            if j is None or t in self._released:
                continue
            p = self._tp_params[j]
            if p.data_ptr() != self._tp_ptrs[j] or p._version != self._tp_vers[j]:
                changed.append(t)
        if changed:
            self._check_params()

    def _seen(self, tids):
        """The storage and version of tids are the binding's own doing (a
        gather or release): the new baselines of the per-step checks."""
        for t in tids:
            j = self._tp_index.get(t)
            if j is not None:
                p = self._tp_params[j]
                self._tp_ptrs[j] = p.data_ptr()
                self._tp_vers[j] = p._version
        if self._zero3_mode != "hooks":
            self._reset_watch()

    @_exclusive("release_params")
    def release_params(self, params=None):
        """ZeRO-3: frees the storage of ``params`` (default all) while
        keeping their shape (``storage().resize_(0)``); the runtime holds
        them, :meth:`gather_params` brings them back. A param that shares
        its storage with other tensors is kept. Local (no communication)."""
        self._zero3_only("release_params")
        done = []
        for t in self._tids_of(params):
            e = self._entries[t]
            if t in self._released or not e.numel or e.cuda or not e.torch:
                continue
            data = e.param.data
            if _torch_compat.storage_nbytes(data) != e.numel * data.element_size() or \
                    data.storage_offset() != 0:
                continue
            try:
                _torch_compat.storage_resize_(data, 0)
            except RuntimeError:  # shared with numpy (.numpy()): kept
                continue
            self._released.add(t)
            done.append(t)
        self._seen(done)

    @property
    def released_params(self):
        return [self._entries[t].param for t in sorted(self._released)]

    def _after_zero3_step(self):
        if self._zero3_mode == "step":
            self._gather(list(range(len(self._entries))))
        elif self._zero3_mode == "hooks":  # the model's copies are stale now
            stale = [t for t in range(len(self._entries)) if t not in self._released]
            if stale:
                self.release_params([self._entries[t].param for t in stale])
        # "manual": the model keeps the old values until gather_params()

_torch_compat.patch_class(Optimizer)

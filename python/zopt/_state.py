"""``opt.state``: torch's per-param state view over the runtime's states
(docs/USAGE.md, "opt.state[p]").

``opt.state[p]`` is a :class:`ParamState`: the states of one param under
torch's keys (``'step'``, ``'exp_avg'``, ..., plus ``'master'`` for steps
with a master), read from the runtime at each access (CPU copies, in each
state's storage dtype, strided like the param) and written through to it.
Tensors handed out (or assigned) are *lent*: in-place changes to them are
written back at the optimizer's next call while the runtime has not
changed that state since. The functions below take the part ``c`` and the
tensor's index in it.
"""
from __future__ import annotations

import collections.abc
import copy
import math
import weakref

import numpy as np

from . import _frozen, _params
from ._dtypes import (KIND_OF_KEY, NP_DTYPES, NP_OF, TORCH_KEY, convert_bits, from_bits,
                      is_torch, np_bits, round_bits, torch, torch_dtypes, torch_of)
from ._lib import DType, DTYPE_NAMES, StateKind, Status, ZoptError
from ._warnings import warn_user
from . import bf16


class Lent:
    """A state tensor handed out by ``opt.state[p]`` (or assigned to it):
    in-place changes to it are written back while it is current. Held
    strongly until the optimizer's next call (``opt.state[p]['exp_avg']
    .zero_()`` drops the tensor at once), weakly after."""
    __slots__ = ("ref", "strong", "ver", "t", "key", "steps", "epoch", "stale")

    def __init__(self, x, t, key, steps, epoch):
        self.ref, self.strong, self.ver = weakref.ref(x), x, x._version
        self.t, self.key = t, key
        self.steps, self.epoch, self.stale = steps, epoch, False


class ParamState(collections.abc.MutableMapping):
    """``opt.state[p]``: the states of one param under torch's keys, read
    from the runtime at each access and written through to it:

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

    def _where(self):
        o = self._ref()
        if o is None:
            raise ZoptError(Status.BAD_STATE, "the optimizer of this state was freed")
        return o._where[self._t]

    def __getitem__(self, key):
        return state_get(*self._where(), key)

    def __setitem__(self, key, value):
        state_set(*self._where(), {key: value})

    def __delitem__(self, key):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"del opt.state[p][{key!r}]: the runtime keeps every state of the "
                        "step; assign new values (opt.state[p][key] = t), or reset the "
                        "param with opt.state[p] = {} (or del opt.state[p])")

    def __contains__(self, key):
        return key in state_keys(*self._where())

    def __iter__(self):
        return iter(state_keys(*self._where()))

    def __len__(self):
        return len(state_keys(*self._where()))

    def update(self, *args, **kw):
        """Writes every entry, all checked before any is written."""
        state_set(*self._where(), dict(*args, **kw))

    def clear(self):
        """Resets the param's states (as ``opt.state[p] = {}``)."""
        state_assign(*self._where(), {})

    def copy(self):
        return dict(self.items())

    def __copy__(self):
        return dict(self.items())

    def __deepcopy__(self, memo):
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def __repr__(self):
        return repr(dict(self.items()))


class StateView(collections.abc.MutableMapping):
    """``opt.state``: param -> :class:`ParamState` (its states under torch's
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

    def _where_of(self, p):
        t = self._opt._tid_map.get(id(p))
        if t is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "opt.state[p]: p is not a param of this optimizer")
        return self._opt._where[t]

    def __getitem__(self, p):
        t = self._opt._tid_map.get(id(p))
        if t is None:
            return {}
        return ParamState(self._opt, t)

    def __setitem__(self, p, value):
        if not isinstance(value, collections.abc.Mapping):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"opt.state[p] = {type(value).__name__}: assign a mapping of "
                            "states ({'step': ..., 'exp_avg': ...}; {} resets the param)")
        state_assign(*self._where_of(p), dict(value))

    def __delitem__(self, p):
        state_assign(*self._where_of(p), {})

    def __contains__(self, p):
        opt = self._opt
        t = opt._tid_map.get(id(p))
        if t is None:
            return False
        return has_state(*opt._where[t])

    def _with_state(self):
        return [e.param for c, lt, e in self._opt._iter_entries() if has_state(c, lt)]

    def __iter__(self):
        return iter(self._with_state())

    def __len__(self):
        return len(self._with_state())

    def clear(self):
        """Resets every param's states (``opt.state = {}`` does the same)."""
        for p in self._with_state():
            del self[p]

    def replace(self, value):
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
            t = opt._tid_map.get(id(p))
            if t is None:
                self._where_of(p)  # raises: not a param of this optimizer
            given[t] = dict(v)
        for t in given:  # refused before anything is written
            state_values(*opt._where[t], given[t])
        for t, (c, lt, e) in enumerate(opt._iter_entries()):
            if t in given or has_state(c, lt):
                state_assign(c, lt, given.get(t, {}))

    def __repr__(self):
        return f"<zopt state of {len(self)} params (read from and written to the runtime)>"


# ---- conversions between the user's values and storage bits ---------------------
def user_tensor(e, flat, dt, share=False):
    """A state (numpy storage bits, memory order) as the user sees it:
    a CPU torch tensor shaped (and strided) like the param; for numpy
    params (or without torch) a numpy array (bf16 widened to f32).
    ``share``: a contiguous param's state is a view of ``flat`` (no copy;
    it keeps ``flat``'s memory alive)."""
    if torch is not None:
        src = from_bits(flat, dt)
        if share and e.torch and e.stride == _contiguous(e.shape):
            return src.view(e.shape)
        if e.torch:
            out = torch.empty_strided(e.shape, e.stride, dtype=src.dtype)
            if e.numel:
                out.as_strided((e.numel,), (1,)).copy_(src)
            return out
        return src.clone().reshape(e.shape)
    if dt == DType.BF16:
        return bf16.to_f32(flat).reshape(e.shape)
    return flat.copy().reshape(e.shape)


def _contiguous(shape):
    st, n = [], 1
    for d in reversed(shape):
        st.append(n)
        n *= d
    return tuple(reversed(st))


def flat_from_user(e, v, key):
    """A state value from a state_dict -> numpy array in the param's
    memory order (f32, bf16 bits or f16), and its dtype."""
    if is_torch(v):
        v = v.detach().to("cpu")
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            v = v.float()
        if v.numel() != e.numel or (tuple(v.shape) != e.shape and v.dim() > 1):
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict: {e.name}: '{key}' has shape {tuple(v.shape)}")
        v = v.reshape(e.shape)
        if e.torch:
            return _params.memory_order(e, v), torch_dtypes()[v.dtype]
        return np_bits(v.contiguous()), torch_dtypes()[v.dtype]
    a = np.asarray(v)
    if a.size != e.numel:
        raise ZoptError(Status.CHECKPOINT,
                        f"state_dict: {e.name}: '{key}' has {a.size} values")
    if a.dtype not in (np.float32, np.float16, np.uint16):
        a = a.astype(np.float32)
    if e.torch and torch is not None and a.dtype != np.uint16:
        return _params.memory_order(e, torch.from_numpy(
            np.ascontiguousarray(a).reshape(e.shape))), NP_DTYPES[a.dtype]
    return np.ascontiguousarray(a).reshape(-1), NP_DTYPES[a.dtype]


def step_value(v, what):
    """A step count given by the user (a number or a one-element tensor)."""
    if is_torch(v) or isinstance(v, np.ndarray):
        n = v.numel() if is_torch(v) else v.size
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


def state_bits(e, v, dt, what):
    """A state value (torch tensor or numpy array of the param's shape,
    any float dtype) -> storage bits of dtype dt, param memory order."""
    if is_torch(v):
        if v.is_sparse or v.is_complex() or not v.is_floating_point():
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: a {v.dtype} tensor; states take floating-point "
                            f"values (stored as {DTYPE_NAMES[dt]})")
        if tuple(v.shape) != e.shape:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: shape {tuple(v.shape)}, the param's is {e.shape}")
        x = v.detach().to("cpu", torch_of(dt))
        return _params.memory_order(e, x) if e.torch else np_bits(x.contiguous())
    if isinstance(v, np.ndarray):
        if v.dtype.kind != "f":
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: a numpy {v.dtype} array; states take floating-point "
                            f"values (stored as {DTYPE_NAMES[dt]}; for bf16 bit patterns "
                            "pass zopt.bf16.to_f32(bits))")
        if tuple(v.shape) != e.shape:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: shape {tuple(v.shape)}, the param's is {e.shape}")
        a = bf16.contiguous(v, np.float32)
        if e.torch and torch is not None:
            return _params.memory_order(e, torch.from_numpy(a).to(torch_of(dt)))
        return round_bits(a.reshape(-1), dt)
    raise ZoptError(Status.INVALID_ARGUMENT,
                    f"{what}: a {type(v).__name__}; states take a tensor (or numpy "
                    f"array) of the param's shape {e.shape}")


# ---- state[p] of tensor t of part c ------------------------------------------------
def shown_states(s):
    """The states state[p] shows: a remainder master (docs/NUMERICS.md §9)
    is the param plus an int16 remainder, no tensor of its own: not shown;
    nor is a q8 moment's per-block absmax (part of its moment, shown f32)."""
    return [k for k in s.owned_states
            if not (k == StateKind.MASTER and s.state_dtype(k) == DType.I16)
            and k not in (StateKind.EXP_AVG_ABSMAX, StateKind.EXP_AVG_SQ_ABSMAX)]


def shown_dtype(s, k):
    """The dtype state[p] shows state k in: a q8 moment (docs/NUMERICS.md
    §10) as its f32 values, decoded / encoded by the runtime."""
    dt = s.state_dtype(k)
    return DType.F32 if dt == DType.Q8 else dt


def state_keys(c, t):
    """The keys of state[p] of tensor t: none before its first step; after
    SGD's momentum restart reset its count (zopt._hypers; it had no
    gradient since), torch's {'momentum_buffer': None} (and its master)."""
    if c.tensor_step(t) == 0:
        if t not in c.restarted:
            return []
        return ["momentum_buffer"] + ["master" for k in shown_states(c.step)
                                      if k == StateKind.MASTER]
    return ["step"] + [TORCH_KEY[k] for k in shown_states(c.step)]


def has_state(c, t):
    """``p in opt.state`` of tensor t (as torch: stepped once)."""
    return c.tensor_step(t) > 0 or t in c.restarted


def state_get(c, t, key):
    """state[p][key] of tensor t: a CPU copy, lent (in-place changes
    written back while it is current)."""
    c.prepare()  # (writes back what was changed in place so far)
    s = c.step
    k = KIND_OF_KEY.get(key) if isinstance(key, str) and key != "step" else None
    if c.tensor_step(t) == 0 and key not in state_keys(c, t) \
            or (key != "step" and k not in shown_states(s)):
        raise KeyError(key)
    if c.tensor_step(t) == 0 and key == "momentum_buffer":
        return None  # (restarted: torch's SGD holds no buffer)
    if key == "step":
        steps = c.tensor_step(t)
        v = torch.tensor(float(steps)) if torch is not None else steps
    else:
        raw = c.read_f32(t, k) if s.state_dtype(k) == DType.Q8 else c.read_raw(t, k)
        v = user_tensor(c.entries[t], raw, shown_dtype(s, k))
    lend(c, t, key, v)
    return v


def state_set(c, t, values):
    """state[p][key] = value (for each entry; all checked first)."""
    c.prepare()
    vals = state_values(c, t, values)
    c.restarted.discard(t)
    write_values(c, t, vals)
    outdate(c, [t], set(vals))
    for key, v in values.items():
        lend(c, t, key, v, assigned=True)


def state_assign(c, t, values):
    """state[p] = values: the entries written, every other state reset
    (moments zero, step 0, the master made from the param)."""
    if t in c.excluded and not values:  # left out: nothing to reset
        return
    c.prepare()
    vals = state_values(c, t, values)
    c.restarted.discard(t)
    s = c.step
    e = c.entries[t]
    fresh = {} if "step" in vals else {"step": 0}
    for k in shown_states(s):
        if TORCH_KEY[k] not in vals and k != StateKind.MASTER:
            fresh[TORCH_KEY[k]] = np.zeros(e.numel, dtype=NP_OF[shown_dtype(s, k)])
    write_values(c, t, fresh)
    if s.has_master and "master" not in vals and e.numel:
        if s.zero3 and s.state_dtype(StateKind.MASTER) == DType.I16:
            # a remainder master (the param's low half): made from the
            # param, it is zero (R5: convert_bits has no int16)
            c.write_raw(t, StateKind.MASTER, np.zeros(e.numel, dtype=np.int16))
        elif s.zero3:  # from the held param (the model's may be released)
            held = c.read_raw(t, StateKind.PARAM)
            c.write_raw(t, StateKind.MASTER, convert_bits(
                held, s.param_dtype, s.state_dtype(StateKind.MASTER)))
        else:
            _params.refresh(c, [t])
    write_values(c, t, vals)
    outdate(c, [t])
    for key, v in values.items():
        lend(c, t, key, v, assigned=True)


def state_values(c, t, values):
    """Checks {key: value} for tensor t's states -> {key: storage bits in
    the param's memory order (numpy), or the step count for 'step'}."""
    e = c.entries[t]
    s = c.step
    out = {}
    if values:
        _frozen.check_held(c, t, "opt.state[p] = ...")
    for key, v in values.items():
        what = f"opt.state[p][{key!r}] of {e.name}"
        if key == "step":
            out[key] = step_value(v, what)
            continue
        k = KIND_OF_KEY.get(key) if isinstance(key, str) else None
        if k is None or k not in shown_states(s):
            known = ["step"] + [TORCH_KEY[q] for q in shown_states(s)]
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: step '{s.name}' has no state {key!r}; its states: "
                            + ", ".join(map(repr, known)))
        out[key] = state_bits(e, v, shown_dtype(s, k), what)
    return out


def write_values(c, t, vals):
    """Checked values (state_values) into the runtime; a master also
    into the param, rounded (ZeRO-3: the held param), so they agree."""
    s = c.step
    for key, v in vals.items():
        if key == "step":
            c.set_tensor_step(t, v)
            continue
        k = KIND_OF_KEY[key]
        if c.entries[t].numel and s.state_dtype(k) == DType.Q8:  # encoded by the runtime
            c.write_f32(t, k, np.ascontiguousarray(v, dtype=np.float32).reshape(-1))
        elif c.entries[t].numel:
            c.write_raw(t, k, v)
        if k == StateKind.MASTER:
            _params.apply_master_sync(
                c, _params.master_sync(c, {t: (v, s.state_dtype(k))}), gather=[t])


# ---- lent tensors ------------------------------------------------------------------
def lend(c, t, key, v, assigned=False):
    if not is_torch(v):
        return
    if not isinstance(c.lent, list):
        c.lent = []
    if assigned:  # v may be a tensor lent before (state[p]['step'] += 1)
        c.lent = [r for r in c.lent
                  if not (r.t == t and r.key == key and r.ref() is v)]
    c.lent.append(Lent(v, t, key, c.steps_taken, c.state_epoch))


def outdate(c, tids, keys=None):
    """Lent tensors of (tids, keys) no longer hold the runtime's state."""
    tids = set(tids)
    for r in c.lent:
        if r.t in tids and (keys is None or r.key in keys):
            r.stale = True


def flush_lent(c):
    """In-place changes to lent state tensors: written back where the
    tensor is still current (the runtime has not changed that state
    since), warned about where it is outdated. Dead tensors dropped, and
    outdated ones a step after they became so."""
    lent, c.lent = c.lent, []
    keep, lost = [], []
    try:
        for i, r in enumerate(lent):
            x = r.ref()
            r.strong = None
            if x is None:
                continue
            current = (not r.stale and r.steps == c.steps_taken
                       and r.epoch == c.state_epoch)
            if x._version == r.ver:
                if current or c.steps_taken - r.steps <= 1:
                    keep.append(r)
                continue
            if not current:
                lost.append(f"{c.entries[r.t].name}[{r.key!r}]")
                continue
            try:
                write_values(c, r.t, state_values(c, r.t, {r.key: x}))
            except ZoptError as err:
                lost.append(f"{c.entries[r.t].name}[{r.key!r}] ({err.message})")
                continue
            r.ver = x._version
            keep.append(r)
    except BaseException:
        keep += lent[i + 1:]
        raise
    finally:
        c.lent = keep + c.lent
    if lost:
        warn_user(
            f"zopt: in-place changes to {len(lost)} state tensor(s) read from "
            f"opt.state[p] were not written back: {', '.join(lost[:4])}"
            + (", ..." if len(lost) > 4 else "")
            + ". They are copies, and the optimizer had changed those states since "
            "they were read (a step, a load or another write). Read the state again "
            "after each step, or assign it: opt.state[p][key] = tensor",
            RuntimeWarning)

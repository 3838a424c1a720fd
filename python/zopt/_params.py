"""Param registration of one parameter class (a part, zopt._part.Part): its
tensors as the runtime sees them, and the checks that keep them current.

* Entries: each param (a torch tensor given alone, or a ``(param, grad)``
  pair of numpy arrays / torch tensors) checked against the step (dtype,
  device, layout) and registered by its memory; a strided torch param
  through a dense copy (zopt/_strided.py).
* Moved storage (``p.data = new``: the native optimizer is rebuilt around
  the new storage, states kept) and writes into params the runtime would
  not see (version counters, sampled elements: zopt/_watch.py), which make
  the master again the params (``zopt_optimizer_refresh_master``). The
  semantics are docs/USAGE.md section 4's.
* Model and master agree: round(master) written into params that are not a
  rounding of it (after a load, a master written by hand).
* ZeRO-3: the model's params gathered from the runtime's shards, released.

Functions take the part ``c`` first; a function here calls methods of the
part (never a module above this one).
"""
from __future__ import annotations

import operator

import numpy as np

from . import _strided, _torch_compat
from ._dtypes import (NP_DTYPES, f32_of_bits, from_bits, is_rounding_of, is_torch, np_bits,
                      round_bits, torch, torch_dtypes)
from ._lib import DTYPE_ITEMSIZE, DTYPE_NAMES, DType, StateKind, Status, ZoptError
from ._watch import Sampler

UNSET = object()
_version_of = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr if torch is not None else None


class Entry:
    """One registered tensor."""
    __slots__ = ("param", "grad", "auto", "torch", "cuda", "numel", "group",
                 "pptr", "gptr", "nbytes", "gbytes", "shape", "stride", "name",
                 "frozen", "dense")

    def __repr__(self):
        return f"<{self.name}>"


def untrained(p):
    """A torch param that is not trained now: requires_grad=False and no
    gradient (``.grad``, or an f32 ``.main_grad``)."""
    return (not p.requires_grad and p.grad is None
            and getattr(p, "main_grad", None) is None)


def has_grad(p):
    return p.grad is not None or getattr(p, "main_grad", None) is not None


# ---- entries -------------------------------------------------------------------
def split_item(p):
    """``(param, grad, auto)`` of user item ``p``: a (param, grad) pair as
    given (auto False), a torch param with its gradient read from ``p.grad``
    (grad None, auto True); anything else refused."""
    if isinstance(p, (tuple, list)):
        if len(p) != 2:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "a tensor entry must be a param or a (param, grad) pair")
        return p[0], p[1], False
    if is_torch(p):
        return p, None, True
    if isinstance(p, np.ndarray):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        "numpy params need their gradient: pass (param, grad) pairs")
    raise ZoptError(Status.INVALID_ARGUMENT, f"unsupported parameter type {type(p).__name__}")


def make_entry(step, gid, i, p):
    """The entry of user item ``p`` (a tensor or a (param, grad) pair), named
    ``param_groups[gid]['params'][i]``, checked against ``step``."""
    e = Entry()
    e.group = gid
    e.dense = None  # a strided param's registered dense copy (layout)
    param, grad, e.auto = split_item(p)
    e.param, e.grad = param, grad
    e.torch = is_torch(param)
    e.name = f"param_groups[{gid}]['params'][{i}]"
    if e.torch:
        e.name += f" (shape {tuple(param.shape)}, {str(param.dtype).replace('torch.', '')})"
        if not e.auto and not is_torch(grad):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: a torch param's grad must be a torch tensor")
        if e.auto and not (param.is_leaf or param.retains_grad):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: can't optimize a non-leaf tensor")
    # GPU steps: a torch param that does not require grad (and has no
    # gradient) is left out of the native optimizer (zopt._frozen); it is
    # checked like any param when it joins.
    e.frozen = step.gpu and e.auto and e.torch and untrained(param)
    if e.frozen:
        try:
            layout(step, e)
        except ZoptError:  # another dtype, not dense, ...: never read while left out
            e.pptr, e.numel, e.nbytes, e.gbytes = 0, param.numel(), 0, 0
            e.cuda = param.device.type == "cuda"
            e.shape, e.stride = tuple(param.shape), tuple(param.stride())
    else:
        layout(step, e)
    if not e.auto:
        numel, gwant = e.numel, step.grad_dtype
        gptr, gn, gdt = buffer(grad, e.name + "'s grad")
        if gn != numel:
            raise ZoptError(Status.INVALID_ARGUMENT, f"{e.name}: param has {numel} "
                            f"elements but its grad has {gn}")
        if gdt != gwant:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: grad dtype {DTYPE_NAMES.get(gdt)}, but the "
                            f"step's gradients are {DTYPE_NAMES.get(gwant)} (step "
                            f"'{step.name}')")
        if e.torch and is_torch(grad) and grad.stride() != param.stride() \
                and numel > 1 and not (param.is_contiguous() and grad.is_contiguous()):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{e.name}: param and grad have other memory layouts "
                            f"(strides {param.stride()} vs {grad.stride()})")
        e.gptr = gptr
    else:
        e.gptr = None
    return e


def layout(step, e):
    """e's param memory, size and layout, checked against the step. A
    strided (non-dense) torch param gets a dense copy, registered in its
    place (zopt/_strided.py); its gradient and states are contiguous."""
    want = step.param_dtype
    param = e.param
    e.dense = None
    why = None
    if e.torch and param.numel() and not _strided.dense(param):
        why = _strided.unsupported(step, e)
        if why is None:
            e.dense = _strided.make_copy(param)
    pptr, numel, dt = buffer(param if e.dense is None else e.dense, e.name, strided_why=why)
    if dt != want:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{e.name}: dtype {DTYPE_NAMES.get(dt)} does not match the "
                        f"step's param dtype {DTYPE_NAMES.get(want)} (step "
                        f"'{step.name}')")
    e.pptr, e.numel = pptr, numel
    e.nbytes = numel * DTYPE_ITEMSIZE[dt]
    e.cuda = e.torch and param.device.type == "cuda"
    e.shape = tuple(param.shape)
    e.stride = tuple((param if e.dense is None else e.dense).stride()) if e.torch else None
    e.gbytes = numel * DTYPE_ITEMSIZE[step.grad_dtype]


def buffer(x, what, strided_why=None):
    """(data pointer, numel, zopt dtype) of a numpy array / torch tensor
    (``strided_why``: why a strided param cannot be stepped here)."""
    if is_torch(x):
        if x.device.type not in ("cpu", "cuda"):
            raise ZoptError(Status.UNSUPPORTED, f"{what} is on {x.device}; "
                            "only CPU and CUDA tensors are supported")
        if x.is_sparse:
            raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is sparse")
        dt = torch_dtypes().get(x.dtype)
        if dt is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: dtype {x.dtype} is not f32/bf16/f16")
        if x.numel() and not _strided.dense(x):
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
        dt = NP_DTYPES.get(x.dtype)
        if dt is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{what}: dtype {x.dtype} is not float32, float16 or "
                            "uint16 (bf16 bit patterns)")
        return (x.ctypes.data if x.size else 0), x.size, dt
    raise ZoptError(Status.INVALID_ARGUMENT,
                    f"{what}: expected a numpy array or torch tensor, got "
                    f"{type(x).__name__}")


def held_entries(c):
    """The entries whose memory the runtime holds now (not released, not
    left out), for the overlap checks."""
    return [e for t, e in enumerate(c.entries)
            if e.numel and t not in c.released and t not in c.excluded]


def check_overlaps(c):
    """Params (and explicit grads) must not share memory: two views of
    one storage would be updated twice per step."""
    _strided.check_spans(held_entries(c))


# ---- the per-step tables and the write checks -----------------------------------
def rebuild_lists(c):
    """The per-step fast-path tables (after every native build)."""
    ents = c.entries
    step = c.step
    c.a_tids = [t for t, e in enumerate(ents) if e.auto]
    c.a_params = [ents[t].param for t in c.a_tids]
    c.a_regs = [ents[t].grad for t in c.a_tids]
    c.a_index = {t: j for j, t in enumerate(c.a_tids)}
    c.tp_tids = [t for t, e in enumerate(ents) if e.torch]
    c.tp_params = [ents[t].param for t in c.tp_tids]
    c.tp_index = {t: j for j, t in enumerate(c.tp_tids)}
    c.tp_ptrs = current_ptrs(c)
    c.strided = [t for t, e in enumerate(ents) if e.dense is not None]
    c.watch = step.has_master or step.zero3
    c.one_pass = bool(c.a_tids) and c.a_tids == c.tp_tids and not c.main
    # f32 gradients (p.main_grad, zopt._grads.sync_main): per param, the
    # main_grad when last seen, and the tensors whose gradient the runtime
    # reads from user memory. (Other parts: zopt._scan, made after this.)
    c.a_last = [UNSET] * len(c.a_tids)
    c.foreign = {}  # the new native optimizer has our own grad memory
    # Fresh gradient tensors are registered in place (no copy) on CPU steps
    # and on GPU and offloaded steps over CUDA params (torch keeps p.grad on
    # its param's device; the CUDA backend rewrites its device pointer
    # table, the offload backend's copy to the host reads the tensor's
    # current gradient). Their main_grad likewise (sync_main), else copied.
    on_device = device_grads(ents)
    where = on_device if step.on_device else not any(e.cuda for e in ents)
    c.grad_zero_copy = where and not c.main
    c.main_copied = step.on_device and not on_device
    reset_watch(c)


def device_grads(ents):
    """Whether the gradients of these params are CUDA memory a GPU step's
    kernels (or an offloaded step's copies to the host) can read where
    they are: every torch param is a CUDA tensor.
    (The tests' stand-ins for CUDA memory patch it.)"""
    return all(e.cuda for e in ents if e.torch)


def current_ptrs(c):
    return list(map(_data_ptr, c.tp_params))


def versions(c):
    return list(map(_version_of, c.tp_params))


def baselines_changed(c):
    """tp_ptrs / tp_vers were set here: the part's zopt._scan pass, which
    compares against copies of them, is given them again before it is
    trusted (Part.pre_step)."""
    c.tp_synced = False


def reset_watch(c):
    """The baselines of the write detection: now (after the optimizer
    wrote the params, loaded or refreshed)."""
    c.tp_vers = versions(c)
    baselines_changed(c)
    c.sampler = None
    if not c.watch or c.zero3_mode == "hooks":
        return  # hooks: params come and go per module (versions only)
    es = DTYPE_ITEMSIZE[c.step.param_dtype]
    ent = []
    for t, e in enumerate(c.entries):
        if e.cuda or t in c.released or not e.numel or t in c.excluded:
            continue
        ptr = e.dense.data_ptr() if e.dense is not None else \
            e.param.data_ptr() if e.torch else e.param.ctypes.data
        ent.append((t, ptr, e.numel))
    s = Sampler(es, ent)
    if not s.empty:
        s.snapshot()
        c.sampler = s


def detect_changes(c, same=False):
    """Moved storages (p.data = ...) and writes into params the runtime
    would not see (version counters, sampled elements). Returns (moved,
    changed): the tensors whose storage moved (checked: same shape, dtype,
    device, strides) and those whose master must be made again from the
    params. The strided params' dense copies are brought up to date.
    ``same``: the step's pass (zopt._scan) found every data pointer and
    version equal to the baselines."""
    moved = []
    if c.tp_params and not same:
        ptrs = current_ptrs(c)
        if ptrs != c.tp_ptrs:
            moved = moved_params(c, ptrs)
    if c.strided:  # the registered dense copies <- the strided params
        _strided.copy_in(c.entries, c.strided)
    if not c.watch and not moved:
        return moved, ()
    changed = set()
    if c.watch:
        if c.tp_params and not same:
            vers = versions(c)
            if vers != c.tp_vers:
                for t, a, b in zip(c.tp_tids, vers, c.tp_vers):
                    if a != b and t not in c.released:
                        changed.add(t)
                c.tp_vers = vers
                baselines_changed(c)
        if c.sampler is not None:  # never reads a moved (maybe freed) storage
            changed.update(c.sampler.changed(skip=moved))
    return moved, changed


def moved_params(c, ptrs):
    """The non-empty params whose storage is not the one last seen
    (validated: same shape, dtype, device and strides)."""
    moved = []
    for t, a, b in zip(c.tp_tids, ptrs, c.tp_ptrs):
        e = c.entries[t]
        if a == b or t in c.excluded:
            continue  # (a param left out is checked when it joins)
        p = e.param
        if not e.numel and tuple(p.shape) == e.shape:
            continue  # (an empty param: no memory registered; another shape is refused)
        if t in c.released:
            raise ZoptError(Status.BAD_STATE,
                            f"{e.name} was released (ZeRO-3) and then given new "
                            "memory by someone else: gather it with "
                            "opt.gather_params() instead")
        what = None
        if tuple(p.shape) != e.shape:
            what = f"shape {tuple(p.shape)} (was {e.shape})"
        elif torch_dtypes().get(p.dtype) != c.step.param_dtype:
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
    if moved:  # before the baselines: a refused move changes nothing (the storage
        check_overlaps(c)  # given back later is not a move, its master kept)
    c.tp_ptrs = ptrs
    baselines_changed(c)
    return moved


def pre_rebuild(c):
    """Before a new native optimizer registers the params: ZeRO-3's
    released params gathered (finalize reads them), every param's
    current storage the one to register."""
    if c.step.zero3 and c.released:
        c.gather_params(sorted(c.released))
    for e in c.entries:
        if e.torch and e.numel and e.dense is None:
            e.pptr = e.param.data_ptr()


# ---- the master made again from the params ---------------------------------------
def refresh(c, tids):
    """Master (and ZeRO-3's held params) := the user's params, for tids."""
    if c.excluded:  # left out (GPU steps): no master
        tids = [t for t in tids if t not in c.excluded]
    if not c.watch or not tids:
        return
    runs = []
    for t in sorted(set(tids)):
        if c.step.zero3 and moved_from_registered(c, t):
            refresh_by_write(c, t)
        else:
            runs.append(t)
    c.refresh_runs(runs)
    c.refreshes += len(set(tids))
    reset_watch(c)
    c.outdate(tids, ("master",))


def moved_from_registered(c, t):
    e = c.entries[t]
    if not e.torch or not e.numel:
        return False
    return e.param.data_ptr() != e.pptr


def refresh_by_write(c, t):
    """ZeRO-3, a param whose storage is not the registered one: its held
    shard (and master) written from the current storage (each rank
    writes what it holds; no communication)."""
    e = c.entries[t]
    c.write_raw(t, StateKind.PARAM, memory_order(e, e.param))
    if c.step.has_master and c.step.state_dtype(StateKind.MASTER) == DType.I16:
        # A remainder master (docs/NUMERICS.md §9) of the param: 0.
        c.write_raw(t, StateKind.MASTER, np.zeros(e.numel, dtype=np.int16))
    elif c.step.has_master:
        write_f32(c, t, StateKind.MASTER, memory_order(e, e.param.detach().float()))


def write_f32(c, t, k, values):
    """Writes state k of tensor t from float32 values (rounded to its
    storage dtype). Writing the master also writes round(master) into the
    param where it is not already a rounding of it, so model and master
    agree."""
    n = c.entries[t].numel
    a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
    if a.size != n:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"write_state: {a.size} values for a tensor of {n}")
    c.write_f32(t, k, a)
    if k == StateKind.PARAM:
        if c.entries[t].dense is not None:
            _strided.copy_out(c.entries, [t])
        reset_watch(c)
    if k == StateKind.MASTER and n:
        m = c.read_raw(t, StateKind.MASTER)
        apply_master_sync(c, master_sync(c, {t: (m, c.step.state_dtype(k))}), gather=[t])


# ---- model and master agree ----------------------------------------------------------
def memory_order(e, x):
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
        return np_bits(x)
    return np.ascontiguousarray(x).reshape(-1)


def param_bits(e):
    """A param's storage bits in memory order (a copy)."""
    if e.torch:
        return memory_order(e, e.param)
    return np.ascontiguousarray(e.param).reshape(-1).copy()


def current_bits(c, t, held=None):
    """The bits of part c's param t as the step sees them: under ZeRO-3 the
    runtime's held param (from ``held``, {(kind, t): bits} of a snapshot or
    a plan, else read from the runtime), otherwise the model's param."""
    if c.step.zero3:
        return held[(StateKind.PARAM, t)] if held is not None else c.read_raw(t, StateKind.PARAM)
    return param_bits(c.entries[t])


def master_sync(c, masters, params=None):
    """masters {t: (flat master bits in memory order, dtype)} -> {t:
    round(master) in the param dtype} for the tensors whose param is not
    a rounding of its master (``params`` {t: bits} or, by default, the
    model's params; ZeRO-3: the runtime's held params)."""
    s = c.step
    pdt = s.param_dtype
    fixes = {}
    for t, (m, mdt) in masters.items():
        e = c.entries[t]
        if not e.numel:
            continue
        cur = params[t] if params is not None else current_bits(c, t)
        mf = f32_of_bits(np.ascontiguousarray(m).reshape(-1), mdt)
        if not is_rounding_of(cur, pdt, mf).all():
            fixes[t] = round_bits(mf, pdt)
    return fixes


def apply_master_sync(c, fixes, gather=None):
    """Writes fixes {t: param bits} into the params (ZeRO-3: the held
    params, then, with zero3_gather="step", gathers ``gather`` into the
    model: a collective, the same tensors on every rank) and resets the
    write checks' baselines to them."""
    s = c.step
    if s.zero3:
        for t, b in fixes.items():
            c.write_raw(t, StateKind.PARAM, b)
        if c.zero3_mode == "step":
            tids = sorted(fixes) if gather is None else sorted(set(gather))
            if tids:
                gather_into(c, tids)
        return
    if not fixes:
        return
    for t, b in fixes.items():
        e = c.entries[t]
        if e.torch:
            src = from_bits(b, s.param_dtype).to(e.param.device)
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
    if c.sampler is not None:
        c.sampler.snapshot(list(fixes))
    for t in fixes:
        j = c.tp_index.get(t)
        if j is not None:
            c.tp_vers[j] = c.tp_params[j]._version
    baselines_changed(c)


# ---- ZeRO-3: the model's params from the runtime's shards ---------------------------
def gather_into(c, tids):
    """The current full params of tids into the model's storage (released
    storage re-allocated); collective under ZeRO-3."""
    for t in tids:
        if t in c.released:
            e = c.entries[t]
            _torch_compat.storage_resize_(e.param.data, e.numel * e.param.element_size())
            c.released.discard(t)
    c.gather_runs(tids)
    seen(c, tids)


def changed_some(c, tids):
    """The per-step write check (storage, version) on a few tensors: did any
    change?"""
    for t in tids:
        j = c.tp_index.get(t)
        if j is None or t in c.released:
            continue
        p = c.tp_params[j]
        if p.data_ptr() != c.tp_ptrs[j] or p._version != c.tp_vers[j]:
            return True
    return False


def seen(c, tids):
    """The storage and version of tids are the binding's own doing (a
    gather or release): the new baselines of the per-step checks."""
    for t in tids:
        j = c.tp_index.get(t)
        if j is not None:
            p = c.tp_params[j]
            c.tp_ptrs[j] = p.data_ptr()
            c.tp_vers[j] = p._version
    baselines_changed(c)
    if c.zero3_mode != "hooks":
        reset_watch(c)


def release(c, tids):
    """ZeRO-3: frees the storage of tids while keeping their shape; a param
    that shares its storage with other tensors is kept. Local."""
    done = []
    for t in tids:
        e = c.entries[t]
        if t in c.released or not e.numel or e.cuda or not e.torch:
            continue
        data = e.param.data
        if _torch_compat.storage_nbytes(data) != e.numel * data.element_size() or \
                data.storage_offset() != 0:
            continue
        try:
            _torch_compat.storage_resize_(data, 0)
        except RuntimeError:  # shared with numpy (.numpy()): kept
            continue
        c.released.add(t)
        done.append(t)
    seen(c, done)


def after_zero3_step(c):
    """After a ZeRO-3 step: the model's params per zero3_gather."""
    if c.zero3_mode == "step":
        gather_into(c, list(range(len(c.entries))))
    elif c.zero3_mode == "hooks":  # the model's copies are stale now
        stale = [t for t in range(len(c.entries)) if t not in c.released]
        if stale:
            release(c, stale)
    # "manual": the model keeps the old values until gather_params()

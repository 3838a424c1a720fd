"""zopt.Step and zopt.Optimizer: a PyTorch-style front end over the C API."""
from __future__ import annotations

import ctypes
import math
import os
import tempfile

import numpy as np

from . import _lib
from ._lib import (DType, HyperKind, StateKind, Status, ZoptError, check, lib,
                   DTYPE_NAMES, HYPER_NAMES, STATE_BY_NAME, STATE_NAMES)

try:  # torch is optional
    import torch
except Exception:  # pragma: no cover
    torch = None

_NP_DTYPES = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16,
              np.dtype(np.uint16): DType.BF16}
_NP_OF = {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}


def _torch_dtypes():
    return {torch.float32: DType.F32, torch.float16: DType.F16,
            torch.bfloat16: DType.BF16}


def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _kind(kind):
    if isinstance(kind, str):
        try:
            return STATE_BY_NAME[kind]
        except KeyError:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"unknown state kind {kind!r}; known: "
                            f"{sorted(STATE_BY_NAME)}") from None
    return StateKind(int(kind))


class Step:
    """A compiled step loaded from a step.so (zopt_step_load)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._lib = lib()
        h = ctypes.c_void_p()
        check(self._lib.zopt_step_load(self.path.encode(), ctypes.byref(h)),
              f"zopt_step_load({self.path})")
        self._h = h
        d = self._lib.zopt_step_get_descriptor(h).contents
        self.name = d.name.decode()
        self.flags = int(d.flags)
        self.zero_stage = int(d.zero_stage)
        self.align = int(d.align)
        self.max_norm = float(d.max_norm) if self.flags & _lib.FLAG_CLIP else None
        self.states = []  # (kind, dtype, placement) in descriptor order
        for i in range(d.num_states):
            s = d.states[i]
            self.states.append((StateKind(s.kind), DType(s.dtype), int(s.placement)))
        self.hypers = {}  # name -> (default, min, max, max_exclusive)
        for i in range(d.num_hypers):
            hd = d.hypers[i]
            self.hypers[HYPER_NAMES[HyperKind(hd.kind)]] = (
                hd.default_value, hd.min_value, hd.max_value, bool(hd.max_exclusive))
        isa = self._lib.zopt_step_isa(h)
        # A GPU step has no CPU update kernel (its ISA reads -1).
        self.isa = _lib.Isa(isa) if isa >= 0 else None

    @property
    def loss_scaled(self):
        return bool(self.flags & _lib.FLAG_LOSS_SCALE)

    @property
    def clipped(self):
        return bool(self.flags & _lib.FLAG_CLIP)

    def state_dtype(self, kind):
        kind = _kind(kind)
        for k, dt, _ in self.states:
            if k == kind:
                return dt
        return None

    @property
    def param_dtype(self):
        return self.state_dtype(StateKind.PARAM)

    @property
    def owned_states(self):
        """State kinds the runtime owns (everything but PARAM and GRAD)."""
        return [k for k, _, _ in self.states
                if k not in (StateKind.PARAM, StateKind.GRAD)]

    def __repr__(self):
        st = ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in self.states)
        return f"<zopt.Step {self.name} [{st}] hypers={list(self.hypers)}>"

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and h.value:
            self._lib.zopt_step_free(h)
            self._h = None


# Group dict keys -> C hyper slots. 'betas' is a pair.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening",
               "bias_correction")


def _group_to_slots(group, step_hypers, explicit_only_known=False):
    """Flattens the hyper keys of a group dict to {slot name: float}."""
    out = {}
    for key, val in group.items():
        if key == "params" or val is None:
            continue
        if key == "betas":
            b = tuple(val)
            if len(b) != 2:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"betas must be a pair, got {val!r}")
            out["beta1"], out["beta2"] = float(b[0]), float(b[1])
        elif key == "bias_correction":
            out[key] = 1.0 if bool(val) else 0.0
        elif key in HYPER_NAMES.values():
            out[key] = float(val)
        # other keys (e.g. 'name', 'initial_lr' of torch schedulers) are
        # carried along and ignored.
    return out


class Optimizer:
    """PyTorch-style optimizer running a compiled zopt step.

    ``params``: a list of tensors, or a list of dicts (param groups), each
    with ``'params'`` and optional per-group hyperparameters ``lr``,
    ``betas=(beta1, beta2)``, ``eps``, ``weight_decay``, ``momentum``,
    ``dampening``, ``bias_correction`` (bool). A tensor is either a torch CPU
    tensor whose ``.grad`` holds the gradient (zeros are allocated when it
    is None), or a ``(param, grad)`` pair of numpy arrays (or torch tensors).
    dtypes must match the step's param/grad dtype; bf16 numpy arrays are
    uint16 bit patterns (see zopt.bf16). Arrays must be C-contiguous and
    stay alive (the optimizer keeps references). Hyperparameters not given
    take the step's defaults. ``param_groups`` may be edited between steps;
    changed values are pushed to the runtime before the next step.
    """

    def __init__(self, step, params, *, lr=None, betas=None, eps=None,
                 weight_decay=None, momentum=None, dampening=None,
                 bias_correction=None, num_threads=None, loss_scaler=None,
                 seed=None):
        if not isinstance(step, Step):
            step = Step(step)
        self.step_obj = step
        self._lib = lib()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, dampening=dampening,
                        bias_correction=bias_correction)
        self.defaults = {k: v for k, v in defaults.items() if v is not None}
        params = list(params)
        if not params:
            raise ZoptError(Status.INVALID_ARGUMENT, "optimizer got an empty "
                            "parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        h = ctypes.c_void_p()
        check(self._lib.zopt_optimizer_create(step._h, ctypes.byref(h)),
              "zopt_optimizer_create")
        self._h = h
        self._keep = []       # user memory kept alive
        self._tensors = []    # per tensor: dict(param, grad, torch, gptr, pptr, numel)
        self.param_groups = []
        self._pushed = []     # per group: {slot: value} last pushed
        try:
            if num_threads is not None:
                check(self._lib.zopt_optimizer_set_num_threads(h, int(num_threads)),
                      "set_num_threads")
            for g in params:
                self._add_group(g)
            if loss_scaler is not None:
                self.configure_loss_scaler(**loss_scaler)
            if seed is not None:
                self.set_seed(seed)
            check(self._lib.zopt_optimizer_finalize(h), "zopt_optimizer_finalize")
        except BaseException:
            self._free()
            raise

    # ---- construction ----------------------------------------------------
    def _add_group(self, g):
        if "params" not in g:
            raise ZoptError(Status.INVALID_ARGUMENT, "param group without 'params'")
        gid = ctypes.c_int()
        check(self._lib.zopt_optimizer_add_group(self._h, ctypes.byref(gid)),
              "zopt_optimizer_add_group")
        gid = gid.value
        group = dict(self.defaults)
        group.update({k: v for k, v in g.items() if k != "params"})
        for name, val in _group_to_slots(group, self.step_obj.hypers).items():
            self._set_hyper(gid, name, val)
        ps = g["params"]
        if _is_torch(ps) or isinstance(ps, np.ndarray):
            ps = [ps]
        ids = []
        for p in list(ps):
            ids.append(self._add_tensor(gid, p))
        group["params"] = ids
        self.param_groups.append(group)
        self._pushed.append({})
        self._sync_group_from_c(gid)

    def _add_tensor(self, gid, p):
        want = self.step_obj.param_dtype
        if isinstance(p, (tuple, list)):
            if len(p) != 2:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                "a tensor entry must be a param or a (param, grad) pair")
            param, grad = p
            is_torch_param = False
        elif _is_torch(p):
            param = p
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            is_torch_param = True
        elif isinstance(p, np.ndarray):
            raise ZoptError(Status.INVALID_ARGUMENT,
                            "numpy params need their gradient: pass (param, grad) pairs")
        else:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"unsupported parameter type {type(p).__name__}")
        pinfo = self._buffer(param, "param")
        ginfo = self._buffer(grad, "grad")
        if pinfo[1] != ginfo[1]:
            raise ZoptError(Status.INVALID_ARGUMENT, f"param has {pinfo[1]} "
                            f"elements but its grad has {ginfo[1]}")
        if pinfo[2] != ginfo[2]:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"param dtype {DTYPE_NAMES.get(pinfo[2])} but grad "
                            f"dtype {DTYPE_NAMES.get(ginfo[2])}")
        tid = ctypes.c_int()
        check(self._lib.zopt_optimizer_add_tensor(
            self._h, gid, ctypes.c_void_p(pinfo[0]), ctypes.c_void_p(ginfo[0]),
            pinfo[1], int(pinfo[2]), ctypes.byref(tid)),
            f"zopt_optimizer_add_tensor(group {gid}, expected dtype "
            f"{DTYPE_NAMES.get(want, want)})")
        self._keep.extend([param, grad])
        self._tensors.append(dict(param=param, grad=grad, torch=is_torch_param,
                                  pptr=pinfo[0], gptr=ginfo[0], numel=pinfo[1],
                                  dtype=pinfo[2]))
        return tid.value

    @staticmethod
    def _buffer(x, what):
        """(data pointer, numel, zopt dtype) of a numpy array / torch tensor."""
        if _is_torch(x):
            if x.device.type not in ("cpu", "cuda"):
                raise ZoptError(Status.UNSUPPORTED, f"{what} is on {x.device}; "
                                "only CPU and CUDA tensors are supported")
            if not x.is_contiguous():
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is not contiguous")
            dt = _torch_dtypes().get(x.dtype)
            if dt is None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what} dtype {x.dtype} is not f32/bf16/f16")
            return x.data_ptr(), x.numel(), dt
        if isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is not C-contiguous")
            if not x.flags.writeable:
                raise ZoptError(Status.INVALID_ARGUMENT, f"{what} is read-only")
            dt = _NP_DTYPES.get(x.dtype)
            if dt is None:
                raise ZoptError(Status.INVALID_ARGUMENT,
                                f"{what} dtype {x.dtype} is not float32, float16 or "
                                "uint16 (bf16 bit patterns)")
            return x.ctypes.data, x.size, dt
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{what}: expected a numpy array or torch tensor, got "
                        f"{type(x).__name__}")

    # ---- hyperparameters -------------------------------------------------
    def _set_hyper(self, gid, name, value):
        check(self._lib.zopt_optimizer_set_hyper(self._h, gid, name.encode(),
                                                 float(value)),
              f"set_hyper(group {gid}, {name}={value!r})")

    def get_hyper(self, gid, name):
        v = ctypes.c_double()
        check(self._lib.zopt_optimizer_get_hyper(self._h, gid, name.encode(),
                                                 ctypes.byref(v)),
              f"get_hyper(group {gid}, {name})")
        return v.value

    def set_hyper(self, gid, name, value):
        """Sets one slot now (and mirrors it into param_groups)."""
        self._set_hyper(gid, name, value)
        self._sync_group_from_c(gid)

    def _sync_group_from_c(self, gid):
        """param_groups[gid] and the pushed cache <- the runtime's values."""
        group = self.param_groups[gid]
        vals = {name: self.get_hyper(gid, name) for name in self.step_obj.hypers}
        for name, v in vals.items():
            if name in ("beta1", "beta2"):
                continue
            group[name] = bool(v) if name == "bias_correction" else v
        if "beta1" in vals or "beta2" in vals:
            group["betas"] = (vals.get("beta1"), vals.get("beta2"))
        self._pushed[gid] = _group_to_slots(group, self.step_obj.hypers)

    def _push_hypers(self):
        for gid, group in enumerate(self.param_groups):
            slots = _group_to_slots(group, self.step_obj.hypers)
            pushed = self._pushed[gid]
            for name, val in slots.items():
                if pushed.get(name) != val:
                    self._set_hyper(gid, name, val)
                    pushed[name] = val

    # ---- stepping --------------------------------------------------------
    def _refresh_grads(self):
        for t in self._tensors:
            if not t["torch"]:
                continue
            p = t["param"]
            if p.data_ptr() != t["pptr"]:
                raise ZoptError(Status.BAD_STATE, "a parameter's storage moved "
                                "since it was registered (p.data was replaced)")
            g = p.grad
            if g is None:
                t["grad"].zero_()
                p.grad = t["grad"]
            elif g.data_ptr() != t["gptr"]:
                t["grad"].copy_(g)
                p.grad = t["grad"]

    def zero_grad(self, set_to_none=False):
        """Zeros every registered gradient in place (set_to_none is ignored:
        the runtime reads the registered memory)."""
        for t in self._tensors:
            g = t["grad"]
            if _is_torch(g):
                g.zero_()
            else:
                g[...] = 0

    def step(self, closure=None):
        """One optimizer step. Returns (grad_norm, skipped)."""
        loss = None
        if closure is not None:
            if torch is not None:
                with torch.enable_grad():
                    loss = closure()
            else:
                loss = closure()
        self._refresh_grads()
        self._push_hypers()
        if self._on_cuda():
            # GPU steps only enqueue on PyTorch's current stream (no host
            # sync; the step returns (nan, False): read the outcome with
            # gpu_result()).
            check(self._lib.zopt_optimizer_set_stream(
                self._h, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
                "zopt_optimizer_set_stream")
        r = _lib.StepResult()
        check(self._lib.zopt_optimizer_step(self._h, ctypes.byref(r)),
              "zopt_optimizer_step")
        self.last_result = r
        self.last_loss = loss
        return float(r.grad_norm), bool(r.skipped)

    def _on_cuda(self):
        return any(_is_torch(t["param"]) and t["param"].device.type == "cuda"
                   for t in self._tensors)

    def gpu_result(self):
        """(grad_norm, skipped, loss_scale) of the last GPU step: waits for
        the stream and reads the device-side result."""
        r = _lib.StepResult()
        check(self._lib.zopt_optimizer_gpu_result(self._h, ctypes.byref(r)),
              "zopt_optimizer_gpu_result")
        return float(r.grad_norm), bool(r.skipped), float(r.loss_scale)

    def set_seed(self, seed):
        """Seed of stochastic rounding (steps with a bf16 state declared
        `rounding stochastic`): same seed, same bits on any thread count."""
        check(self._lib.zopt_optimizer_set_seed(self._h, int(seed) & (2**64 - 1)),
              "set_seed")

    @property
    def seed(self):
        s = ctypes.c_uint64()
        check(self._lib.zopt_optimizer_get_seed(self._h, ctypes.byref(s)), "get_seed")
        return s.value

    def step_count(self, gid=0):
        c = ctypes.c_int64()
        check(self._lib.zopt_optimizer_get_step_count(self._h, gid, ctypes.byref(c)),
              "get_step_count")
        return c.value

    # ---- loss scaling ----------------------------------------------------
    def configure_loss_scaler(self, init_scale=65536.0, growth_factor=2.0,
                              backoff_factor=0.5, growth_interval=2000,
                              min_scale=1.0, dynamic=True):
        cfg = _lib.LossScalerConfig(float(init_scale), float(growth_factor),
                                    float(backoff_factor), int(growth_interval),
                                    float(min_scale), 1 if dynamic else 0)
        check(self._lib.zopt_optimizer_configure_loss_scaler(self._h,
                                                             ctypes.byref(cfg)),
              "configure_loss_scaler")
        self._scaler_cfg = dict(init_scale=init_scale, growth_factor=growth_factor,
                                backoff_factor=backoff_factor,
                                growth_interval=growth_interval,
                                min_scale=min_scale, dynamic=dynamic)

    @property
    def loss_scale(self):
        """The scale S the next step's gradients must be multiplied by."""
        s = ctypes.c_double()
        check(self._lib.zopt_optimizer_get_loss_scale(self._h, ctypes.byref(s)),
              "get_loss_scale")
        return s.value

    # ---- state access ----------------------------------------------------
    @property
    def num_tensors(self):
        return len(self._tensors)

    def _tensor(self, tensor_idx):
        if not (0 <= int(tensor_idx) < len(self._tensors)):
            raise ZoptError(Status.INVALID_ARGUMENT, f"no tensor {tensor_idx} "
                            f"(the optimizer has {len(self._tensors)})")
        return self._tensors[int(tensor_idx)]

    def read_state(self, tensor_idx, kind):
        """State ``kind`` ('exp_avg', StateKind.MASTER, ...) of a tensor as a
        float32 numpy array (flat)."""
        k = _kind(kind)
        self._tensor(tensor_idx)
        n = self._tensors[tensor_idx]["numel"]
        out = np.empty(n, dtype=np.float32)
        check(self._lib.zopt_optimizer_read_state_f32(
            self._h, tensor_idx, int(k), ctypes.c_void_p(out.ctypes.data), n),
            f"read_state({tensor_idx}, {STATE_NAMES[k]})")
        return out

    def write_state(self, tensor_idx, kind, values):
        k = _kind(kind)
        n = self._tensor(tensor_idx)["numel"]
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
        if a.size != n:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"write_state: {a.size} values for a tensor of {n}")
        check(self._lib.zopt_optimizer_write_state_f32(
            self._h, tensor_idx, int(k), ctypes.c_void_p(a.ctypes.data), n),
            f"write_state({tensor_idx}, {STATE_NAMES[k]})")

    def read_state_raw(self, tensor_idx, kind):
        """Storage-exact copy of a state (uint16 for bf16, float16, float32)."""
        k = _kind(kind)
        dt = self.step_obj.state_dtype(k)
        if dt is None:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"the step has no state {STATE_NAMES[k]}")
        n = self._tensor(tensor_idx)["numel"]
        out = np.empty(n, dtype=_NP_OF[dt])
        check(self._lib.zopt_optimizer_read_state_raw(
            self._h, tensor_idx, int(k), ctypes.c_void_p(out.ctypes.data),
            out.nbytes), f"read_state_raw({tensor_idx}, {STATE_NAMES[k]})")
        return out

    def memory_info(self):
        m = _lib.MemoryInfo()
        check(self._lib.zopt_optimizer_memory_info(self._h, ctypes.byref(m)),
              "memory_info")
        return dict(bytes_cpu=m.bytes_cpu, bytes_gpu=m.bytes_gpu,
                    num_params=m.num_params)

    # ---- checkpoints -----------------------------------------------------
    def save(self, path):
        """Writes a runtime checkpoint (zopt_optimizer_save)."""
        self._push_hypers()
        check(self._lib.zopt_optimizer_save(self._h, os.fspath(path).encode()),
              f"save({path})")

    def load(self, path):
        """Loads a runtime checkpoint (zopt_optimizer_load); param_groups are
        refreshed from the runtime afterwards."""
        check(self._lib.zopt_optimizer_load(self._h, os.fspath(path).encode()),
              f"load({path})")
        for gid in range(len(self.param_groups)):
            self._sync_group_from_c(gid)

    def state_dict(self):
        """A picklable snapshot: per-tensor states as float32 numpy arrays,
        per-group step counts and hyperparameters, the loss scale, and the
        runtime checkpoint bytes (which carry what the C API cannot set
        directly: step counts and the loss scaler's internal state)."""
        self._push_hypers()
        state = {}
        for t in range(self.num_tensors):
            state[t] = {STATE_NAMES[k]: self.read_state(t, k)
                        for k in self.step_obj.owned_states}
        groups = []
        for g in self.param_groups:
            groups.append({k: (list(v) if k == "params" else
                               (tuple(v) if isinstance(v, tuple) else v))
                           for k, v in g.items()})
        with tempfile.TemporaryDirectory(prefix="zopt-sd-") as d:
            p = os.path.join(d, "ckpt")
            self.save(p)
            with open(p, "rb") as f:
                blob = f.read()
        return {
            "format": "zopt-state-dict-1",
            "step_name": self.step_obj.name,
            "state": state,
            "step_count": [self.step_count(i) for i in range(len(self.param_groups))],
            "param_groups": groups,
            "loss_scale": self.loss_scale if self.step_obj.loss_scaled else None,
            "checkpoint": blob,
        }

    def load_state_dict(self, sd):
        """Restores a state_dict(). The runtime checkpoint it carries is
        loaded first (step counts, loss scaler, states); the float32 state
        arrays and the hyperparameters are then written over it, so edits to
        them take effect. Without the checkpoint blob, step counts must
        already match (the C API has no setter for them)."""
        if sd.get("format") != "zopt-state-dict-1":
            raise ZoptError(Status.CHECKPOINT, "not a zopt state_dict")
        if len(sd["param_groups"]) != len(self.param_groups):
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict has {len(sd['param_groups'])} groups, "
                            f"optimizer has {len(self.param_groups)}")
        if len(sd["state"]) != self.num_tensors:
            raise ZoptError(Status.CHECKPOINT,
                            f"state_dict has {len(sd['state'])} tensors, "
                            f"optimizer has {self.num_tensors}")
        blob = sd.get("checkpoint")
        if blob is not None:
            with tempfile.TemporaryDirectory(prefix="zopt-sd-") as d:
                p = os.path.join(d, "ckpt")
                with open(p, "wb") as f:
                    f.write(blob)
                self.load(p)
        else:
            for gid, c in enumerate(sd["step_count"]):
                if self.step_count(gid) != c:
                    raise ZoptError(Status.UNSUPPORTED,
                                    "cannot restore step counts without the "
                                    "checkpoint blob")
        for t, kinds in sd["state"].items():
            for name, arr in kinds.items():
                self.write_state(int(t), name, arr)
        for gid, g in enumerate(sd["param_groups"]):
            mine = self.param_groups[gid]
            for k, v in g.items():
                if k != "params":
                    mine[k] = v
        self._push_hypers()

    # ---- teardown --------------------------------------------------------
    def _free(self):
        h = getattr(self, "_h", None)
        if h is not None and h.value:
            self._lib.zopt_optimizer_free(h)
        self._h = None

    def close(self):
        self._free()

    def __del__(self):
        self._free()

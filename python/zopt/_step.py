"""zopt.Step: a compiled step loaded from its step.so (``zopt_step_load``),
and what its descriptor says (states, dtypes, placements, hyperparameter
slots, flags). docs/ABI.md describes the descriptor."""
from __future__ import annotations

import ctypes
import os

from . import _dtypes, _lib
from ._lib import DType, HyperKind, StateKind, check, lib, DTYPE_NAMES, HYPER_NAMES, STATE_NAMES


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
        self.checksum = int(d.checksum)
        self.max_norm = float(d.max_norm) if self.flags & _lib.FLAG_CLIP else None
        self.states = []  # (kind, dtype, placement) in descriptor order
        self.state_flags = {}
        self.state_access = {}  # kind -> 1 read, 2 written, 3 both (abi.h)
        for i in range(d.num_states):
            s = d.states[i]
            self.states.append((StateKind(s.kind), DType(s.dtype), int(s.placement)))
            self.state_flags[StateKind(s.kind)] = int(s.flags)
            self.state_access[StateKind(s.kind)] = int(s.access)
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

    @property
    def nesterov(self):
        """Whether the step's SGD momentum is Nesterov's (torch.optim.SGD's
        ``nesterov``), as the descriptor states it (ZOPT_FLAG_NESTEROV); a
        step without a momentum buffer is not. None: the descriptor does not
        say (a step.so compiled before ZOPT_FLAG_RULE_STATED)."""
        if self.flags & _lib.FLAG_RULE_STATED or StateKind.MOMENTUM_BUFFER not in self.state_flags:
            return bool(self.flags & _lib.FLAG_NESTEROV)
        return None

    @property
    def decoupled_decay(self):
        """Whether the step's weight decay is decoupled (AdamW, Lion:
        ZOPT_FLAG_DECOUPLED_DECAY) rather than L2 or none; None: the
        descriptor does not say (compiled before ZOPT_FLAG_RULE_STATED)."""
        if self.flags & _lib.FLAG_RULE_STATED:
            return bool(self.flags & _lib.FLAG_DECOUPLED_DECAY)
        return None

    def state_dtype(self, kind):
        kind = _dtypes.kind(kind)
        for k, dt, _ in self.states:
            if k == kind:
                return dt
        return None

    @property
    def param_dtype(self):
        return self.state_dtype(StateKind.PARAM)

    @property
    def grad_dtype(self):
        return self.state_dtype(StateKind.GRAD)

    @property
    def f32_grads(self):
        """True if the gradients are f32 for bf16/f16 params (accumulated
        in f32: DeepSpeed's bf16 layout, Megatron's main_grad)."""
        return self.grad_dtype != self.param_dtype

    @property
    def gpu(self):
        """True if the update runs on the GPU (no CPU kernel:
        zopt_step_isa is ZOPT_ISA_NONE)."""
        return self.isa is None or self.isa == _lib.Isa.NONE

    @property
    def on_device(self):
        """True if the params live on the GPU: a GPU step, or an offloaded
        one (param/grad on the GPU, the states and the update on the CPU)."""
        return any(k == StateKind.PARAM and pl == _dtypes.PLACE_GPU for k, _, pl in self.states)

    @property
    def offloaded(self):
        """True for ZeRO-Offload steps: params on the GPU, update on the CPU."""
        return self.on_device and not self.gpu

    @property
    def owned_states(self):
        """State kinds the runtime owns (everything but PARAM and GRAD)."""
        return [k for k, _, _ in self.states
                if k not in (StateKind.PARAM, StateKind.GRAD)]

    @property
    def zero3(self):
        """True if the runtime holds the params, sharded (ZeRO-3)."""
        return bool(self.state_flags.get(StateKind.PARAM, 0) & _lib.STATE_PARTITIONED)

    @property
    def has_master(self):
        return StateKind.MASTER in self.state_flags

    @property
    def remainder_master(self):
        """The f32 master is kept as a remainder beside the bf16 param
        (docs/NUMERICS.md section 9): its storage dtype is I16."""
        return self.has_master and self.state_dtype(StateKind.MASTER) == DType.I16

    @property
    def adam_like(self):
        return "eps" in self.hypers and StateKind.EXP_AVG_SQ in self.state_flags

    @property
    def plain_sgd(self):
        """SGD without momentum (torch.optim.SGD with momentum 0): an lr, no
        moment slots, no states but a master."""
        return "lr" in self.hypers and not {"beta1", "eps", "momentum"} & set(self.hypers) \
            and not set(self.owned_states) - {StateKind.MASTER}

    def __repr__(self):
        st = ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in self.states)
        return f"<zopt.Step {self.name} [{st}] hypers={list(self.hypers)}>"

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and h.value:
            self._lib.zopt_step_free(h)
            self._h = None

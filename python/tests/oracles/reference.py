"""float64 reference of the zopt numerics contract (docs/NUMERICS.md): a test
oracle, kept beside the tests (not part of the installed zopt package).

The math is done in float64. What the reference models of the hardware is
only *storage*: after every step each stored state is rounded to its
storage dtype (f32 -> float32, f16 -> numpy float16 (RNE), bf16 -> RNE by bit
manipulation of the float64), and with an f32 master the low-precision
param is the rounded (stored) master. ``round_storage=False`` turns that off
(a pure float64 model, used to check the reference itself against torch in
float64).

Rules: "adam" (L2: g += wd*p), "adamw" (decoupled: p *= 1 - lr*wd), both
with amsgrad and per-group bias_correction; "sgd" (torch.optim.SGD, buffer =
g at t = 1, dampening, nesterov; momentum_buffer=False for plain SGD);
"lion". Loss scaling: g = g_scaled / S, any non-finite unscaled gradient
skips the whole step (no state change, step counts stay) and the dynamic
scaler backs off. Global-norm clipping over all tensors of all groups:
c = max_norm / (n + 1e-6), applied if c < 1.
"""
from __future__ import annotations

import math

import numpy as np

from zopt import bf16 as _bf16
from zopt.describe import layout_types


def round_to(x, dtype):
    """float64 values rounded to storage dtype ('f32', 'bf16', 'f16')."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "f32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return _bf16.round_f64(x)
    raise ValueError(dtype)


HYPER_DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                      momentum=0.0, dampening=0.0, bias_correction=1.0)


class LossScaler:
    """Dynamic loss scaler: back off on a skipped step, grow after
    growth_interval consecutive good steps (torch GradScaler semantics)."""

    def __init__(self, init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, min_scale=1.0, dynamic=True):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.dynamic = dynamic
        self.good = 0

    def update(self, skipped):
        if not self.dynamic:
            return
        if skipped:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good = 0
        else:
            self.good += 1
            if self.good >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good = 0


class Reference:
    """Reference optimizer over float64 numpy arrays.

    groups: list of dicts with 'params' (list of arrays: the initial
    *stored* param values) and hyperparameters by slot name (lr, beta1,
    beta2, eps, weight_decay, momentum, dampening, bias_correction) or
    'betas'. Hyperparameters may be changed between steps through
    ``self.groups[i][name]``.
    """

    def __init__(self, rule, groups, amsgrad=False, nesterov=False,
                 momentum_buffer=True, layout="f32", state_dtype=None, clip=None,
                 round_storage=True, loss_scaler=None):
        self.rule = rule
        self.amsgrad = amsgrad
        self.nesterov = nesterov
        self.momentum_buffer = momentum_buffer
        self.clip = clip
        self.round_storage = round_storage
        pg, wt, st, ls = layout_types(layout, state_dtype)
        self.param_dtype, self.master_dtype, self.state_dtype = pg, wt, st
        self.weight_dtype = wt if wt is not None else pg
        self.scaler = LossScaler(**(loss_scaler or {})) if ls else None
        self.groups = []
        self.tensors = []  # dicts: group, w, p, m, v, vm, buf
        for gi, g in enumerate(groups):
            hg = dict(HYPER_DEFAULTS)
            for k, v in g.items():
                if k == "params":
                    continue
                if k == "betas":
                    hg["beta1"], hg["beta2"] = float(v[0]), float(v[1])
                else:
                    hg[k] = float(v)
            hg["step"] = 0
            self.groups.append(hg)
            for p in g["params"]:
                p = np.array(p, dtype=np.float64).reshape(-1)
                z = np.zeros_like(p)
                self.tensors.append(dict(group=gi, w=p.copy(), p=p.copy(),
                                         m=z.copy(), v=z.copy(), vm=z.copy(),
                                         buf=z.copy()))
        self.history = []  # per step: dict(norm, clip_coef, skipped, scale)

    def _r(self, x, dtype):
        return round_to(x, dtype) if self.round_storage else x

    def set_hyper(self, group, name, value):
        if name == "betas":
            self.groups[group]["beta1"], self.groups[group]["beta2"] = map(float, value)
        else:
            self.groups[group][name] = float(value)

    def step(self, grads):
        """grads: one array per tensor (registration order) holding the
        values the runtime reads (loss-scaled when the layout scales).
        Returns (grad_norm, skipped, clip_coef)."""
        gs = [np.asarray(g, dtype=np.float64).reshape(-1) for g in grads]
        assert len(gs) == len(self.tensors)
        S = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            gs = [g / S for g in gs]
        sumsq = math.fsum(float(np.dot(g, g)) for g in gs) if gs else 0.0
        finite = all(np.isfinite(g).all() for g in gs)
        norm = math.sqrt(sumsq) if finite else float("inf")
        if self.scaler is not None and not finite:
            self.scaler.update(True)
            rec = dict(norm=float("nan"), clip_coef=1.0, skipped=True, scale=S)
            self.history.append(rec)
            return rec["norm"], True, 1.0
        coef = 1.0
        if self.clip is not None:
            c = self.clip / (norm + 1e-6)
            if c < 1.0:
                coef = c
                gs = [g * c for g in gs]
        for hg in self.groups:
            hg["step"] += 1
        for t, g in zip(self.tensors, gs):
            t["_graw"] = g
            self._update(t, g, self.groups[t["group"]])
        if self.scaler is not None:
            self.scaler.update(False)
        self.history.append(dict(norm=norm, clip_coef=coef, skipped=False, scale=S))
        return norm, False, coef

    def _update(self, t, g, h):
        lr, wd = h["lr"], h["weight_decay"]
        step = h["step"]
        w = t["w"]
        if self.rule in ("adam", "adamw"):
            b1, b2, eps = h["beta1"], h["beta2"], h["eps"]
            if self.rule == "adam":
                g = g + wd * w
            else:
                w = w * (1.0 - lr * wd)
            m = b1 * t["m"] + (1.0 - b1) * g
            v = b2 * t["v"] + (1.0 - b2) * g * g
            vv = v
            if self.amsgrad:
                vv = np.maximum(t["vm"], v)
                t["vm"] = self._r(vv, self.state_dtype)
            if h["bias_correction"] != 0.0:
                bc1 = 1.0 - b1 ** step
                bc2 = 1.0 - b2 ** step
            else:
                bc1 = bc2 = 1.0
            den = np.sqrt(vv) / math.sqrt(bc2) + eps
            w = w - (lr / bc1) * m / den
            # First-order estimate of how far an implementation computing in
            # fp32 may land from this float64 result (t["sens"], accumulated
            # over steps): the fp32 unit roundoff u32 of the gradient / L2
            # term and of the moment updates, propagated through
            # lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps). It is large only where
            # the problem is ill-conditioned: the L2-decayed gradient or m
            # cancelled to near zero, with sqrt(v) comparable to eps.
            # (Storage rounding is not in it: tests bound it in ULPs.)
            u32 = 2.0 ** -24
            dg = u32 * (np.abs(t["_graw"]) + np.abs(wd * t["w"]))
            dm = u32 * (np.abs(b1 * t["m"]) + np.abs((1 - b1) * g)) + (1 - b1) * dg
            dv = u32 * np.abs(vv) + (1 - b2) * 2 * np.abs(g) * dg
            ds = dv / (2 * np.maximum(np.sqrt(vv), 1e-300) * math.sqrt(bc2))
            ds = np.minimum(ds, np.sqrt(dv / bc2))
            sens = (lr / bc1) * (dm / den + np.abs(m) * ds / den ** 2)
            t["sens"] = t.get("sens", 0.0) + sens
            t["m"] = self._r(m, self.state_dtype)
            t["v"] = self._r(v, self.state_dtype)
        elif self.rule == "sgd":
            mu, damp = h["momentum"], h["dampening"]
            g = g + wd * w
            d = g
            if self.momentum_buffer:
                if step == 1:
                    buf = g.copy()
                else:
                    buf = mu * t["buf"] + (1.0 - damp) * g
                d = g + mu * buf if self.nesterov else buf
                t["buf"] = self._r(buf, self.state_dtype)
            w = w - lr * d
        elif self.rule == "lion":
            b1, b2 = h["beta1"], h["beta2"]
            w = w * (1.0 - lr * wd)
            c = b1 * t["m"] + (1.0 - b1) * g
            # sign() is discontinuous at 0: where the exact c is within
            # float32 noise of 0 (exact cancellation happens with bf16 data,
            # e.g. 0.9*(-3*2^-7) + 0.1*(27*2^-7)), fp32 and float64 may pick
            # different signs. Such elements are flagged, cumulatively.
            amb = np.abs(c) <= 1e-6 * (np.abs(b1 * t["m"]) + np.abs((1.0 - b1) * g))
            t["ambiguous"] = t.get("ambiguous", np.zeros(c.shape, bool)) | amb
            w = w - lr * np.sign(c)
            t["m"] = self._r(b2 * t["m"] + (1.0 - b2) * g, self.state_dtype)
        else:
            raise ValueError(self.rule)
        t["w"] = self._r(w, self.weight_dtype)
        t["p"] = self._r(t["w"], self.param_dtype)

    # accessors -------------------------------------------------------------
    def ambiguous(self, i):
        """Elements of tensor i whose Lion sign was ambiguous at some step."""
        t = self.tensors[i]
        return t.get("ambiguous", np.zeros(t["w"].shape, bool))

    def sensitivity(self, i):
        """Accumulated first-order error estimate of tensor i's weight (Adam;
        zeros for other rules)."""
        t = self.tensors[i]
        return np.broadcast_to(t.get("sens", 0.0), t["w"].shape)

    def param(self, i):
        """The stored param (low precision copy of the master if any)."""
        return self.tensors[i]["p"]

    def state(self, i, kind):
        """kind: 'master', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq',
        'momentum_buffer', 'param'."""
        key = {"master": "w", "exp_avg": "m", "exp_avg_sq": "v",
               "max_exp_avg_sq": "vm", "momentum_buffer": "buf",
               "param": "p"}[kind]
        return self.tensors[i][key]

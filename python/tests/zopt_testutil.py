"""Helpers of the zopt Python tests: data, tolerances, runners."""
import math

import numpy as np

import zopt
from zopt import bf16
from zopt.describe import layout_types
from oracles.reference import Reference, round_to

NP_OF = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}



def assert_within(a, r, err, bound, what, extra=""):
    """Raises with the worst offender when any |a - r| = err exceeds bound
    (NaN counts as exceeding)."""
    bad = ~(err <= bound)
    if bad.any():
        i = int(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)))
        tail = extra(i) if callable(extra) else extra
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.size} elements off; worst [{i}] "
            f"zopt={a[i]!r} ref={r[i]!r} err={err[i]:.3g} bound={bound[i]:.3g}{tail}")

def to_storage(x64, dtype):
    """float64 values -> numpy storage array of dtype (RNE)."""
    if dtype == "bf16":
        return bf16.from_f32(np.asarray(round_to(x64, "bf16"), dtype=np.float32))
    return np.asarray(x64, dtype=NP_OF[dtype])


def from_storage(a, dtype):
    """numpy storage array -> float64 values."""
    if dtype == "bf16":
        return bf16.to_f32(a).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


def never_zero(rng, n, scale=1.0, floor=0.1):
    x = rng.standard_normal(n)
    return np.sign(x + 1e-300) * (floor + np.abs(x)) * scale


def ulp(x, dtype):
    """ULP of the storage dtype at |x| (normal range)."""
    mant = {"f32": 23, "bf16": 7, "f16": 10}[dtype]
    tiny = {"f32": 2.0 ** -126, "bf16": 2.0 ** -126, "f16": 2.0 ** -14}[dtype]
    ax = np.maximum(np.abs(x), tiny)
    return 2.0 ** (np.floor(np.log2(ax)) - mant)


def check_f32(actual, ref, what, rtol=1e-6, floor=None, atol_frac=0.0):
    """|a - r| <= rtol * max(|r|, floor) + atol_frac * max|r|.

    floor defaults to 0.1 * max|r| of the tensor: values that cancelled to
    near zero are judged against the tensor's scale, not their own."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    r = np.asarray(ref, dtype=np.float64).reshape(-1)
    mx = float(np.max(np.abs(r))) if r.size else 0.0
    if floor is None:
        floor = 0.1 * mx
    bound = rtol * np.maximum(np.abs(r), floor) + atol_frac * mx
    err = np.abs(a - r)
    assert_within(a, r, err, bound, what)


def check_storage(actual, ref, dtype, what, k_ulp=2, atol_frac=1e-6,
                  max_mismatch_frac=0.30, atol=0.0):
    """Values stored in a narrow dtype: within k_ulp ULPs of the storage
    dtype (at the larger magnitude) plus atol_frac * max|r| (the fp32
    computation error before the rounding, which dominates for values that
    cancelled to near zero), and at most max_mismatch_frac of the elements
    not bit-identical to the reference's own rounding."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    r = np.asarray(ref, dtype=np.float64).reshape(-1)
    mx = float(np.max(np.abs(r))) if r.size else 0.0
    bound = k_ulp * ulp(np.maximum(np.abs(a), np.abs(r)), dtype) + atol_frac * mx + atol
    err = np.abs(a - r)
    assert_within(a, r, err, bound, f"{what} ({dtype}, {k_ulp} ulp)")
    mism = int(np.count_nonzero(a != r))
    # small tensors: allow one element
    if mism > max(1, max_mismatch_frac * a.size):
        raise AssertionError(f"{what} ({dtype}): {mism}/{a.size} elements not "
                             "bit-identical to the reference's rounding")


def check_param(actual, ref, dtype, what):
    """Params (O(1) by construction): f32 -> 1e-6 relative with an absolute
    floor of 1e-6 (values that crossed zero); narrow -> check_storage."""
    if dtype == "f32":
        check_f32(actual, ref, what, rtol=1e-6, floor=1.0)
    else:
        check_storage(actual, ref, dtype, what)


class ParamChecker:
    """Params/master step after step:
      f32:    |a - r| <= 1e-6 * max(|r|, 1) + 4 * sens
      narrow: 2 ULP at max(|a|, |r|) + 2 ULP at the element's running max
              |r| (a 1-ULP rounding difference made while the value was
              larger persists when it shrinks) + 4 * sens
    sens is the reference's first-order propagation of fp32/storage unit
    roundoff through the Adam update (Reference.sensitivity): it only
    matters for ill-conditioned elements (gradient + L2 term or m cancelled
    to near zero, sqrt(v) comparable to eps)."""

    def __init__(self):
        self.runmax = {}

    def check(self, key, actual, ref, dtype, what, sens=0.0):
        a = np.asarray(actual, dtype=np.float64).reshape(-1)
        r = np.asarray(ref, dtype=np.float64).reshape(-1)
        sens = np.broadcast_to(np.asarray(sens, dtype=np.float64), r.shape)
        rm = np.maximum(self.runmax.get(key, 0.0), np.abs(r))
        self.runmax[key] = rm
        if dtype == "f32":
            bound = 1e-6 * np.maximum(np.abs(r), 1.0) + 4 * sens
        else:
            bound = (2 * ulp(np.maximum(np.abs(a), np.abs(r)), dtype)
                     + 2 * ulp(rm, dtype) + 4 * sens)
        err = np.abs(a - r)
        assert_within(a, r, err, bound, f"{what} ({dtype})",
                      lambda i: f" (sens {sens[i]:.3g})")


class StateChecker:
    """Checks optimizer states step after step. Moments and buffers are
    EMAs that can cancel: an element can be small now while the terms it was
    computed from were large. The absolute part of the bound is therefore
    taken at the running max |ref| of the tensor's state over the steps so
    far (the scale of the terms), not the current value:
      f32:    |a - r| <= 1e-5 |r| + 1e-6 * runmax
      narrow: 2 ULP at max(|a|, |r|) + 2 ULP at runmax (1-ULP tie
              difference in an earlier stored value carried through a
              cancelling EMA) and <= 10% of the elements not bit-identical.
    """

    def __init__(self):
        self.runmax = {}

    def check(self, key, actual, ref, dtype, what, extra=0.0):
        """extra: elementwise absolute allowance added to the bound (the
        parity tests pass 4 * sens * (1 + |g|): a weight that legitimately
        differs by up to its ill-conditioning estimate feeds the L2 term of
        the next moments)."""
        r = np.asarray(ref, dtype=np.float64).reshape(-1)
        extra = np.broadcast_to(np.asarray(extra, dtype=np.float64), r.shape)
        m = max(self.runmax.get(key, 0.0), float(np.max(np.abs(r))) if r.size else 0.0)
        self.runmax[key] = m
        if dtype == "f32":
            a = np.asarray(actual, dtype=np.float64).reshape(-1)
            bound = 1e-5 * np.abs(r) + 1e-6 * m + extra
            err = np.abs(a - r)
            assert_within(a, r, err, bound, what)
        else:
            check_storage(actual, ref, dtype, what, atol_frac=0.0,
                          atol=2 * float(ulp(m, dtype)) + extra)


class Problem:
    """Random tensors in groups for one layout: numpy storage arrays for
    zopt, float64 copies for the reference."""

    def __init__(self, seed, layout, sizes_per_group, state_dtype=None):
        self.state_dtype = state_dtype
        self.rng = np.random.default_rng(seed)
        self.layout = layout
        self.pg, self.wt, self.st, self.loss_scaled = layout_types(layout, state_dtype)
        self.sizes = sizes_per_group
        self.params = []   # storage arrays (zopt reads/writes them)
        self.grads = []
        self.group_of = []
        for gi, sizes in enumerate(sizes_per_group):
            for n in sizes:
                p = to_storage(never_zero(self.rng, n), self.pg)
                self.params.append(p)
                self.grads.append(np.zeros(n, dtype=NP_OF[self.pg]))
                self.group_of.append(gi)

    def params64(self):
        return [from_storage(p, self.pg) for p in self.params]

    def group_params(self):
        """[[(param, grad), ...] per group]"""
        out = [[] for _ in self.sizes]
        for p, g, gi in zip(self.params, self.grads, self.group_of):
            out[gi].append((p, g))
        return out

    def set_grads(self, scale, loss_scale=1.0):
        """Fills the grad arrays with fresh never-zero values * scale (times
        the loss scale when the layout scales); returns the float64 values
        the runtime will read."""
        out = []
        for g in self.grads:
            x = never_zero(self.rng, g.size, scale, floor=0.05)
            if self.loss_scaled:
                x = x * loss_scale
            g[...] = to_storage(x, self.pg)
            out.append(from_storage(g, self.pg))
        return out

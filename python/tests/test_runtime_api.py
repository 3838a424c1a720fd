"""C API calls a binding uses to keep the runtime in step with the framework:
moving a tensor's memory after finalize, restoring counts and the loss
scaler without a checkpoint file (zopt.h)."""
import ctypes
import threading

import numpy as np
import pytest

import zopt
from zopt import _lib
from zopt.comm import Comm

F32_STEP = dict(rule="adamw", layout="f32")


def _opt(steps, arrays, **kw):
    return zopt.Optimizer(steps(**F32_STEP), [(p, g) for p, g in arrays], lr=1e-2, weight_decay=0.1, **kw)


def _arrays(seed, sizes=(1000, 17)):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32))
            for n in sizes]


def test_set_tensor_memory_keeps_states(steps):
    a, b = _arrays(1), _arrays(1)
    oa, ob = _opt(steps, a), _opt(steps, b)
    oa.step(), ob.step()
    # Move tensor 0 of `b` to new memory holding the same values.
    p2, g2 = b[0][0].copy(), b[0][1].copy()
    L = _lib.lib()
    _lib.check(L.zopt_optimizer_set_tensor_memory(ob._handle(), 0, ctypes.c_void_p(p2.ctypes.data),
                                                  ctypes.c_void_p(g2.ctypes.data)), "set_tensor_memory")
    b[0][0][:] = 7.0  # the old memory is no longer the optimizer's
    for k in range(3):
        rng = np.random.default_rng(10 + k)
        g = rng.standard_normal(1000).astype(np.float32)
        a[0][1][:] = g
        g2[:] = g
        oa.step(), ob.step()
    np.testing.assert_array_equal(a[0][0], p2)  # bit-identical: the states stayed
    assert np.all(b[0][0] == 7.0)
    np.testing.assert_array_equal(oa.read_state(0, "exp_avg"), ob.read_state(0, "exp_avg"))


def test_null_grad_needs_inactive(steps):
    a = _arrays(2)
    o = _opt(steps, a)
    L, h = _lib.lib(), o._handle()
    _lib.check(L.zopt_optimizer_set_tensor_memory(h, 1, ctypes.c_void_p(a[1][0].ctypes.data), None), "set")
    res = _lib.StepResult()
    st = L.zopt_optimizer_step(h, ctypes.byref(res))
    assert st == _lib.Status.INVALID_ARGUMENT
    assert b"no gradient memory" in L.zopt_last_error()
    mask = (ctypes.c_uint8 * 2)(1, 0)
    _lib.check(L.zopt_optimizer_set_active(h, mask, 2), "set_active")
    before = a[1][0].copy()
    _lib.check(L.zopt_optimizer_step(h, ctypes.byref(res)), "step")
    np.testing.assert_array_equal(a[1][0], before)  # left alone


def test_null_grad_where_another_rank_updates(steps):
    """Two ranks (threads): rank 1 has no gradient memory for tensor 1 while
    rank 0 has a gradient for it: both ranks fail, naming rank 1."""
    comms = Comm.loopback(2, timeout=10)
    step = steps(**F32_STEP)
    errors = [None, None]

    def rank(r):
        arr = _arrays(3)
        o = zopt.Optimizer(step, [(p, g) for p, g in arr], lr=1e-2, comm=comms[r])
        L, h = _lib.lib(), o._handle()
        if r == 1:
            _lib.check(L.zopt_optimizer_set_tensor_memory(h, 1, ctypes.c_void_p(arr[1][0].ctypes.data), None), "s")
            mask = (ctypes.c_uint8 * 2)(1, 0)
            _lib.check(L.zopt_optimizer_set_active(h, mask, 2), "set_active")
        res = _lib.StepResult()
        st = L.zopt_optimizer_step(h, ctypes.byref(res))
        errors[r] = (st, L.zopt_last_error().decode())

    th = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
    for st, msg in errors:
        assert st == _lib.Status.INVALID_ARGUMENT and "rank 1" in msg, msg


def test_counts_and_scaler_setters(steps):
    a = _arrays(4)
    o = zopt.Optimizer(steps(**F32_STEP), [(p, g) for p, g in a], lr=1e-3)
    L, h = _lib.lib(), o._handle()
    _lib.check(L.zopt_optimizer_set_tensor_step(h, 1, 41), "set_tensor_step")
    c = ctypes.c_int64()
    _lib.check(L.zopt_optimizer_get_tensor_step(h, 1, ctypes.byref(c)), "get")
    assert c.value == 41
    _lib.check(L.zopt_optimizer_set_step_count(h, 0, 9), "set_step_count")
    _lib.check(L.zopt_optimizer_get_step_count(h, 0, ctypes.byref(c)), "get")
    assert c.value == 9
    _lib.check(L.zopt_optimizer_set_loss_scaler_state(h, 512.0, 3), "set scaler")
    s, g = ctypes.c_double(), ctypes.c_int64()
    _lib.check(L.zopt_optimizer_get_loss_scaler_state(h, ctypes.byref(s), ctypes.byref(g)), "get scaler")
    assert (s.value, g.value) == (512.0, 3)
    assert L.zopt_optimizer_set_loss_scaler_state(h, float("nan"), 0) == _lib.Status.INVALID_ARGUMENT
    assert L.zopt_optimizer_set_tensor_step(h, 5, 1) == _lib.Status.INVALID_ARGUMENT
    # The tensor's own count drives its bias correction: step 42 next.
    o.step()
    _lib.check(L.zopt_optimizer_get_tensor_step(h, 1, ctypes.byref(c)), "get")
    assert c.value == 42


# ---- zopt_optimizer_step_linked -----------------------------------------


def _linked(opts, result=None):
    L = _lib.lib()
    arr = (ctypes.c_void_p * len(opts))(*[o._handle() for o in opts])
    return L.zopt_optimizer_step_linked(arr, len(opts), ctypes.byref(result) if result is not None else None)


def test_linked_step_one_norm_over_parts(steps):
    """Two parts stepped as one: the norm is float64's over both parts'
    gradients and both parts clip with it. SGD with momentum is linear in
    the gradient, so each part's params show the clip coefficient: with a
    per-part norm they would be ~1.4x off the float64 reference, which
    clips every tensor with the combined norm."""
    from oracles.reference import Reference
    step = steps(rule="sgd", layout="f32", clip=1.0)
    a, b = _arrays(5, (1000, 17)), _arrays(6, (300, 4099))
    ref = Reference("sgd", [dict(params=[p.copy() for p, _ in a + b], lr=1e-2, momentum=0.9)],
                    layout="f32", clip=1.0)
    kw = dict(lr=1e-2, momentum=0.9)
    oa = zopt.Optimizer(step, [(p, g) for p, g in a], **kw)
    ob = zopt.Optimizer(step, [(p, g) for p, g in b], **kw)
    for k in range(3):
        rng = np.random.default_rng(100 + k)
        for _, g in a + b:
            g[:] = (rng.standard_normal(g.size) * 0.5).astype(np.float32)  # norm ~25: clipped
        res = _lib.StepResult()
        _lib.check(_linked([oa, ob], res), "step_linked")
        want_norm, skipped, coef = ref.step([g for _, g in a + b])
        assert not skipped and coef < 0.1
        assert abs(res.grad_norm - want_norm) <= 1e-9 * want_norm
        for i, (p, _) in enumerate(a + b):
            want = ref.param(i)
            np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)


def test_linked_step_errors(steps):
    clip1 = steps(rule="adamw", layout="f32", clip=1.0)
    clip2 = steps(rule="adamw", layout="f32", clip=2.0)
    noclip = steps(rule="adamw", layout="f32")
    a, b, c = _arrays(7), _arrays(8), _arrays(9)
    oa = zopt.Optimizer(clip1, [(p, g) for p, g in a], lr=1e-2)
    ob = zopt.Optimizer(clip2, [(p, g) for p, g in b], lr=1e-2)
    oc = zopt.Optimizer(noclip, [(p, g) for p, g in c], lr=1e-2)
    L = _lib.lib()
    before = [p.copy() for p, _ in a + b]
    for parts, needle in (([oa, ob], b"max_norm"), ([oa, oc], b"clipping"), ([oa, oa], b"same optimizer")):
        assert _linked(parts) == _lib.Status.INVALID_ARGUMENT
        assert needle in L.zopt_last_error(), L.zopt_last_error()
    # Nothing ran: every param as it was.
    for (p, _), x in zip(a + b, before):
        np.testing.assert_array_equal(p, x)
    assert L.zopt_optimizer_step_linked(None, 2, None) == _lib.Status.INVALID_ARGUMENT


# ---- gradient streaming (zopt_optimizer_reduce_bucket) -------------------


def _buckets(L, h):
    nb = ctypes.c_int()
    _lib.check(L.zopt_optimizer_num_buckets(h, ctypes.byref(nb)), "num_buckets")
    out = []
    for b in range(nb.value):
        n = ctypes.c_int()
        _lib.check(L.zopt_optimizer_bucket_tensors(h, b, None, 0, ctypes.byref(n)), "bucket_tensors")
        ids = (ctypes.c_int * max(n.value, 1))()
        _lib.check(L.zopt_optimizer_bucket_tensors(h, b, ids, n.value, ctypes.byref(n)), "bucket_tensors")
        out.append(list(ids[:n.value]))
    return out


def test_grad_streaming_matches_and_refuses_misuse(steps):
    """Streamed gradients give the same bits as registered gradient memory;
    a step with a bucket not reduced, a bucket reduced twice, a tensor given
    a gradient in one of its buckets only and set_active are refused with
    nothing changed."""
    step = steps(rule="adamw", layout="f32", clip=1.0, attributes={"zero_stage": 2})
    L = _lib.lib()
    sizes = (70000, 17, 40000, 5)
    a, b = _arrays(11, sizes), _arrays(11, sizes)

    def make(arrs, stream):
        h = ctypes.c_void_p()
        _lib.check(L.zopt_optimizer_create(step._h, ctypes.byref(h)), "create")
        if stream:
            _lib.check(L.zopt_optimizer_set_grad_streaming(h, 1), "set_grad_streaming")
        gid = ctypes.c_int()
        _lib.check(L.zopt_optimizer_add_group(h, ctypes.byref(gid)), "add_group")
        tid = ctypes.c_int()
        for p, g in arrs:
            _lib.check(L.zopt_optimizer_add_tensor(h, 0, ctypes.c_void_p(p.ctypes.data),
                                                   None if stream else ctypes.c_void_p(g.ctypes.data),
                                                   p.size, int(_lib.DType.F32), ctypes.byref(tid)), "add_tensor")
        _lib.check(L.zopt_optimizer_set_bucket_elems(h, 32768), "set_bucket_elems")
        _lib.check(L.zopt_optimizer_set_hyper(h, 0, b"lr", 1e-2), "set_hyper")
        _lib.check(L.zopt_optimizer_finalize(h), "finalize")
        return h

    ha, hb = make(a, False), make(b, True)
    try:
        buckets = _buckets(L, hb)
        assert len(buckets) >= 3 and any(len(ids) > 1 for ids in buckets)
        res = _lib.StepResult()

        def reduce(bk, ids, give=None):
            ptrs = (ctypes.c_void_p * max(len(ids), 1))(
                *[b[t][1].ctypes.data if (give is None or give(t)) else None for t in ids])
            return L.zopt_optimizer_reduce_bucket(hb, bk, ptrs, len(ids))

        for k in range(2):
            _lib.check(L.zopt_optimizer_step(ha, ctypes.byref(res)), "step")
            for bk in reversed(range(len(buckets))):
                _lib.check(reduce(bk, buckets[bk]), "reduce_bucket")
            _lib.check(L.zopt_optimizer_step(hb, ctypes.byref(res)), "step")
            for (pa, _), (pb, _) in zip(a, b):
                np.testing.assert_array_equal(pa, pb)
        before = [p.copy() for p, _ in b]
        # A bucket not reduced: refused, nothing changes.
        for bk in range(1, len(buckets)):
            _lib.check(reduce(bk, buckets[bk]), "reduce_bucket")
        assert L.zopt_optimizer_step(hb, ctypes.byref(res)) == _lib.Status.BAD_STATE
        assert b"bucket 0" in L.zopt_last_error() and b"not reduced" in L.zopt_last_error()
        # Reduced twice: refused.
        assert reduce(1, buckets[1]) == _lib.Status.BAD_STATE
        assert b"already reduced" in L.zopt_last_error()
        # Wrong count; set_active accepted (docs/ABI.md: with streamed gradients
        # only the entries of tensors without elements are read, R4).
        assert L.zopt_optimizer_reduce_bucket(hb, 0, None, 0) == _lib.Status.INVALID_ARGUMENT
        mask = (ctypes.c_uint8 * len(sizes))(*([1] * len(sizes)))
        assert L.zopt_optimizer_set_active(hb, mask, len(sizes)) == _lib.Status.OK
        for (p, _), x in zip(b, before):
            np.testing.assert_array_equal(p, x)
        # A tensor spanning buckets given a gradient in one only.
        span = next(t for t in range(len(sizes)) if sum(t in ids for ids in buckets) > 1)
        first = next(i for i, ids in enumerate(buckets) if span in ids)
        _lib.check(reduce(0, buckets[0]), "reduce_bucket")  # completes the step's buckets
        _lib.check(L.zopt_optimizer_step(hb, ctypes.byref(res)), "step")
        _lib.check(reduce(first, buckets[first]), "reduce_bucket")
        nxt = next(i for i, ids in enumerate(buckets) if span in ids and i != first)
        assert reduce(nxt, buckets[nxt], give=lambda t: t != span) == _lib.Status.INVALID_ARGUMENT
        assert b"earlier bucket" in L.zopt_last_error()
    finally:
        L.zopt_optimizer_free(ha)
        L.zopt_optimizer_free(hb)


def test_load_validate_only(steps, tmp_path):
    """ZOPT_LOAD_VALIDATE_ONLY runs every check and applies nothing: a good
    checkpoint passes with the state unchanged, a corrupt one fails."""
    a = _arrays(21)
    o = _opt(steps, a)
    o.step()
    path = str(tmp_path / "ck")
    o.save(path)
    m0 = o.read_state(0, "exp_avg").copy()
    o.step()  # the state moves on from the checkpoint
    m1, p1 = o.read_state(0, "exp_avg").copy(), a[0][0].copy()
    assert not np.array_equal(m0, m1)
    L, h = _lib.lib(), o._handle()
    VALIDATE = 2
    _lib.check(L.zopt_optimizer_load_ex(h, path.encode(), VALIDATE), "load_ex validate")
    np.testing.assert_array_equal(o.read_state(0, "exp_avg"), m1)
    np.testing.assert_array_equal(a[0][0], p1)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) - 5] ^= 0xFF  # a data byte: its piece checksum fails
    bad = str(tmp_path / "bad")
    open(bad, "wb").write(bytes(raw))
    assert L.zopt_optimizer_load_ex(h, bad.encode(), VALIDATE) == _lib.Status.CHECKPOINT
    assert L.zopt_optimizer_load_ex(h, path.encode(), 4) == _lib.Status.INVALID_ARGUMENT
    _lib.check(L.zopt_optimizer_load_ex(h, path.encode(), 0), "load_ex")
    np.testing.assert_array_equal(o.read_state(0, "exp_avg"), m0)


def test_set_grad_memory_batch(steps):
    """zopt_optimizer_set_grad_memory: n tensors' gradients from new memory
    in one call (as set_tensor_memory for each); an entry out of range or a
    grad that is its param's memory refuses the whole call, changing
    nothing."""
    a, b = _arrays(5), _arrays(5)
    oa, ob = _opt(steps, a), _opt(steps, b)
    L, h = _lib.lib(), ob._handle()
    g0, g1 = b[0][1].copy(), b[1][1].copy()
    T = (ctypes.c_int32 * 2)
    V = (ctypes.c_void_p * 2)
    # refused: tensor 2 does not exist; tensor 1's grad would be its param
    assert L.zopt_optimizer_set_grad_memory(h, 2, T(0, 2), V(g0.ctypes.data, g1.ctypes.data)) \
        == _lib.Status.INVALID_ARGUMENT
    assert b"tensor id 2 out of range" in L.zopt_last_error()
    assert L.zopt_optimizer_set_grad_memory(h, 2, T(0, 1), V(g0.ctypes.data, b[1][0].ctypes.data)) \
        == _lib.Status.INVALID_ARGUMENT
    assert L.zopt_optimizer_set_grad_memory(h, -1, None, None) == _lib.Status.INVALID_ARGUMENT
    assert L.zopt_optimizer_set_grad_memory(h, 2, None, None) == _lib.Status.INVALID_ARGUMENT
    b[0][1][:] = np.nan  # still read: the refused calls changed nothing
    oa.step(), ob.step()
    assert np.isnan(b[0][0]).all() and np.isfinite(b[1][0]).all()
    # A fresh pair of optimizers: the new memory is read, the old is not.
    a, b = _arrays(6), _arrays(6)
    oa, ob = _opt(steps, a), _opt(steps, b)
    L, h = _lib.lib(), ob._handle()
    g0, g1 = b[0][1].copy(), b[1][1].copy()
    _lib.check(L.zopt_optimizer_set_grad_memory(h, 2, T(0, 1), V(g0.ctypes.data, g1.ctypes.data)),
               "set_grad_memory")
    b[0][1][:] = np.nan
    b[1][1][:] = np.nan
    for _ in range(3):
        oa.step(), ob.step()
    for (pa, _), (pb, _) in zip(a, b):
        np.testing.assert_array_equal(pa, pb)

"""Skipped steps under f16 loss scaling, checkpoint and state_dict round
trips (bit-exact resume)."""
import math
import os
import pickle

import numpy as np
import pytest
import torch

import zopt
from oracles.reference import Reference
from zopt_testutil import Problem, check_param, from_storage

SIZES = [[1, 17, 1000], [33]]
HYP = [dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
       dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
            bias_correction=False)]


def make(steps, layout, amsgrad=False, clip=None, rule="adamw", seed=3,
         scaler=None):
    step = steps(rule=rule, amsgrad=amsgrad, layout=layout, clip=clip)
    prob = Problem(seed, layout, SIZES)
    if prob.loss_scaled and scaler is None:
        scaler = dict(init_scale=1024.0)
    groups = [dict(params=gp, **HYP[i]) for i, gp in enumerate(prob.group_params())]
    opt = zopt.Optimizer(step, groups, loss_scaler=scaler)
    return step, prob, opt


def snapshot(opt, prob):
    """Everything a step can change, storage-exact."""
    snap = {"params": [p.copy() for p in prob.params],
            "counts": [opt.step_count(g) for g in range(len(SIZES))],
            "scale": opt.loss_scale if prob.loss_scaled else None}
    for t in range(opt.num_tensors):
        for k in opt.step_obj.owned_states:
            snap[(t, int(k))] = opt.read_state_raw(t, k)
    return snap


def assert_same(a, b, what):
    assert a["counts"] == b["counts"], what
    assert a["scale"] == b["scale"], what
    for x, y in zip(a["params"], b["params"]):
        assert x.tobytes() == y.tobytes(), f"{what}: param bits differ"
    for k in a:
        if isinstance(k, tuple):
            assert a[k].tobytes() == b[k].tobytes(), f"{what}: state {k} bits differ"


def test_skipped_step_f16_loss_scale(steps):
    step, prob, opt = make(steps, "f16_loss_scale", clip=5.0)
    p64 = prob.params64()
    ref = Reference("adamw", [dict(params=[p64[i] for i, g in enumerate(prob.group_of)
                                           if g == gi], **HYP[gi])
                              for gi in range(len(SIZES))],
                    layout="f16_loss_scale", clip=5.0,
                    loss_scaler=dict(init_scale=1024.0))
    scales = [1.0, 0.05, 1.0, 0.5, 0.05, 1.0]
    for s, sc in enumerate(scales):
        S = opt.loss_scale
        assert S == ref.scaler.scale
        g64 = prob.set_grads(sc, loss_scale=S)
        if s == 2:  # inject an inf into one gradient
            prob.grads[2][5] = np.float16(np.inf)
            g64[2][5] = np.inf
            before = snapshot(opt, prob)
        opt.step()
        norm, skipped = opt.step_result()
        rnorm, rskipped, _ = ref.step(g64)
        assert skipped == rskipped == (s == 2), s
        assert opt.last_result.loss_scale == S
        if s == 2:
            assert_same(before, {**snapshot(opt, prob), "scale": S},
                        "skipped step changed state")
            assert opt.loss_scale == S * 0.5, "scale did not back off"
            assert opt.step_count(0) == 2 and opt.step_count(1) == 2
        else:
            assert norm == pytest.approx(rnorm, rel=1e-6)
        for i in range(len(prob.params)):
            check_param(from_storage(prob.params[i], "f16"), ref.param(i), "f16",
                        f"step {s} tensor {i} param")
            check_param(opt.read_state(i, "master"), ref.state(i, "master"), "f32",
                        f"step {s} tensor {i} master")
    assert opt.step_count(0) == len(scales) - 1


def test_nan_grad_skips_too(steps):
    step, prob, opt = make(steps, "f16_loss_scale")
    prob.set_grads(1.0, loss_scale=opt.loss_scale)
    opt.step()
    prob.set_grads(1.0, loss_scale=opt.loss_scale)
    prob.grads[0][0] = np.float16(np.nan)
    before = snapshot(opt, prob)
    S = opt.loss_scale
    opt.step()
    norm, skipped = opt.step_result()
    assert skipped
    assert_same(before, {**snapshot(opt, prob), "scale": S}, "NaN skip")


def test_overflowing_scaled_grad_skips(steps):
    # a grad whose scaled value overflows f16 to inf (the realistic case)
    step, prob, opt = make(steps, "f16_loss_scale",
                           scaler=dict(init_scale=65536.0))
    assert opt.loss_scale == 65536.0
    prob.set_grads(0.01, loss_scale=opt.loss_scale)
    with np.errstate(over="ignore"):
        prob.grads[3][0] = np.float16(70000.0)  # -> inf in f16
    assert np.isinf(prob.grads[3][0])
    opt.step()
    assert opt.last_skipped and opt.loss_scale == 32768.0


LAYOUT_CASES = [("f32", False, None), ("bf16", True, 5.0),
                ("bf16_master", False, 5.0), ("f16_loss_scale", True, None)]


def _run(opt, prob, k, seed):
    """k steps with deterministic grads (depend on seed and step only)."""
    for s in range(k):
        rng = np.random.default_rng(seed * 100 + s)
        S = opt.loss_scale if prob.loss_scaled else 1.0
        prob.rng = rng
        prob.set_grads(1.0 if s % 2 else 0.05, loss_scale=S)
        opt.param_groups[0]["lr"] = 0.01 * (1 + 0.1 * s)
        opt.step()


@pytest.mark.parametrize("layout,amsgrad,clip", LAYOUT_CASES)
def test_checkpoint_resume_bit_exact(steps, tmp_path, layout, amsgrad, clip):
    step, prob, opt = make(steps, layout, amsgrad, clip)
    _run(opt, prob, 3, seed=1)
    ck = str(tmp_path / "opt.zckpt")
    opt.save(ck)
    assert os.path.exists(ck) and not os.path.exists(ck + ".tmp")
    saved_params = [p.copy() for p in prob.params]
    lr0 = opt.param_groups[0]["lr"]
    _run(opt, prob, 4, seed=2)
    first = snapshot(opt, prob)
    # restore: the user restores the model params, zopt the optimizer
    for p, s in zip(prob.params, saved_params):
        p[...] = s
    opt.load(ck)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr0)
    assert opt.step_count(0) == 3
    _run(opt, prob, 4, seed=2)
    assert_same(first, snapshot(opt, prob), "resume from checkpoint")


@pytest.mark.parametrize("layout,amsgrad,clip", LAYOUT_CASES[:2])
def test_checkpoint_into_fresh_optimizer(steps, tmp_path, layout, amsgrad, clip):
    step, prob, opt = make(steps, layout, amsgrad, clip)
    _run(opt, prob, 3, seed=1)
    ck = str(tmp_path / "opt.zckpt")
    opt.save(ck)
    saved_params = [p.copy() for p in prob.params]
    _run(opt, prob, 3, seed=2)
    first = snapshot(opt, prob)
    # a second optimizer over other memory with the same shapes
    _, prob2, opt2 = make(steps, layout, amsgrad, clip, seed=99)
    for p, s in zip(prob2.params, saved_params):
        p[...] = s
    opt2.load(ck)
    _run(opt2, prob2, 3, seed=2)
    assert_same(first, snapshot(opt2, prob2), "fresh optimizer from checkpoint")


def test_checkpoint_mismatch_leaves_state(steps, tmp_path):
    step, prob, opt = make(steps, "f32")
    _run(opt, prob, 2, seed=1)
    ck = str(tmp_path / "a.zckpt")
    opt.save(ck)
    # different tensor sizes
    step2 = steps(rule="adamw", layout="f32")
    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal(5).astype(np.float32), np.zeros(5, np.float32))]
    other = zopt.Optimizer(step2, pairs)
    other.step()
    before = other.read_state(0, "exp_avg").copy()
    with pytest.raises(zopt.ZoptError) as e:
        other.load(ck)
    assert e.value.code == zopt.Status.CHECKPOINT
    np.testing.assert_array_equal(other.read_state(0, "exp_avg"), before)
    # truncated / corrupt files
    data = open(ck, "rb").read()
    bad = str(tmp_path / "bad.zckpt")
    for blob in (data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 0xFF]),
                 b"garbage"):
        open(bad, "wb").write(blob)
        snap = snapshot(opt, prob)
        with pytest.raises(zopt.ZoptError) as e:
            opt.load(bad)
        assert e.value.code in (zopt.Status.CHECKPOINT, zopt.Status.IO)
        assert_same(snap, snapshot(opt, prob), "failed load changed state")
    with pytest.raises(zopt.ZoptError) as e:
        opt.load(str(tmp_path / "missing.zckpt"))
    assert e.value.code == zopt.Status.IO


@pytest.mark.parametrize("layout,amsgrad,clip", LAYOUT_CASES)
def test_state_dict_round_trip(steps, layout, amsgrad, clip):
    step, prob, opt = make(steps, layout, amsgrad, clip)
    _run(opt, prob, 3, seed=1)
    sd = pickle.loads(pickle.dumps(opt.state_dict()))
    # torch's layout: per param 'step' and the states in their storage dtype
    assert sd["zopt"]["group_steps"] == [3, 3]
    want = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    for t in range(opt.num_tensors):
        st = sd["state"][t]
        assert float(st["step"]) == 3.0
        for k in opt.step_obj.owned_states:
            arr = st[zopt.optimizer.TORCH_KEY[k]]
            assert arr.dtype == want[zopt._lib.DTYPE_NAMES[step.state_dtype(k)]]
            assert arr.numel() == prob.params[t].size
    saved_params = [p.copy() for p in prob.params]
    _run(opt, prob, 4, seed=2)
    first = snapshot(opt, prob)
    for p, s in zip(prob.params, saved_params):
        p[...] = s
    opt.load_state_dict(sd)
    assert opt.step_count(0) == 3
    _run(opt, prob, 4, seed=2)
    assert_same(first, snapshot(opt, prob), "resume from state_dict")


def test_state_dict_edit_takes_effect(steps):
    step, prob, opt = make(steps, "f32")
    _run(opt, prob, 2, seed=1)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"][:] = 0.25
    sd["param_groups"][1]["lr"] = 0.125
    opt.load_state_dict(sd)
    np.testing.assert_array_equal(opt.read_state(0, "exp_avg"), 0.25)
    assert opt.get_hyper(1, "lr") == 0.125


@pytest.mark.parametrize("layout,clip", [("bf16_master", 5.0), ("f32", None)])
def test_threads_bit_identical(steps, layout, clip):
    """1 thread and 2 threads give the same bits (norm reduction included)."""
    outs = []
    for nt in (1, 2):
        step = steps(rule="adamw", layout=layout, clip=clip)
        prob = Problem(5, layout, [[1, 17, 100000]])
        opt = zopt.Optimizer(step, [dict(params=prob.group_params()[0], lr=0.01)],
                             num_threads=nt)
        norms = []
        for s in range(3):
            prob.set_grads(1.0)
            opt.step()
            norms.append(opt.last_grad_norm)
        outs.append((snapshot_one(opt, prob), norms))
    (a, na), (b, nb) = outs
    assert [x.tobytes() for x in a] == [x.tobytes() for x in b]
    assert np.array_equal(np.array(na), np.array(nb), equal_nan=True)


def snapshot_one(opt, prob):
    out = [p.copy() for p in prob.params]
    for t in range(opt.num_tensors):
        for k in opt.step_obj.owned_states:
            out.append(opt.read_state_raw(t, k))
    return out


def test_checkpoint_writer_checksums_and_pieces(steps):
    """oracles.ckptfmt: the side-by-side FNV equals the sequential one for
    chunks of any length; a state_dict of tensors cut into several pieces
    (larger than _ckpt.PIECE_BYTES) loads back bit for bit; the runtime's
    whole export has the checksums the oracle computes, and the one the
    binding reads (ZOPT_EXPORT_NO_CHECKSUMS) the same bytes but the
    header's flag, the pieces' checksums (0) and the save identity."""
    from oracles import ckptfmt as _ckpt
    rng = np.random.default_rng(4)
    chunks = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 7, 64, 1000, 3)]
    assert _ckpt.fnv1a64_many(chunks) == [_ckpt.fnv1a64(c.tobytes()) for c in chunks]
    step = steps(rule="adamw", layout="bf16_master")
    n = _ckpt.PIECE_BYTES * 3 // 4 + 17  # > 2 pieces of f32 states
    p = zopt.bf16.from_f32(rng.standard_normal(n).astype(np.float32))
    g = np.zeros(n, np.uint16)
    opt = zopt.Optimizer(step, [(p, g), (p[:0].copy(), g[:0].copy())], lr=0.01)
    for s in range(2):
        g[...] = zopt.bf16.from_f32(rng.standard_normal(n).astype(np.float32))
        opt.step()
    sd = opt.state_dict()
    before = {k: opt.read_state_raw(0, k) for k in ("master", "exp_avg", "exp_avg_sq")}
    for k in before:
        opt.write_state(0, k, np.zeros(n, np.float32))
    opt.load_state_dict(sd)
    for k, v in before.items():
        assert opt.read_state_raw(0, k).tobytes() == v.tobytes(), k
    assert opt.tensor_step(0) == 2 and opt.tensor_step(1) == 2
    import ctypes
    import struct
    from zopt import _lib, _stateio
    c = opt._parts[0]
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    _lib.check(c.lib.zopt_optimizer_export_state(c.h, ctypes.byref(buf), ctypes.byref(size),
                                                 _lib.EXPORT_WHOLE))
    hashed = np.asarray(_stateio.StateBuffer(c.lib, buf.value, size.value))
    assert _ckpt.check_image(hashed) == 3  # 3 states of tensor 0
    plain = c.export_whole()  # the binding's
    H = struct.unpack_from("<Q", hashed, 16)[0]
    pieces = zopt._ckpt.parse(plain).pieces
    assert struct.unpack_from("<I", plain, 12)[0] == 1 and not pieces["fnv"].any()
    assert plain.size == hashed.size and np.array_equal(plain[H + 8:], hashed[H + 8:])


def test_checkpoint_readers_formats_2_and_3(steps, tmp_path):
    """zopt._ckpt reads the header of a runtime checkpoint (format 3: a
    save identity after world/rank) and of the same save in format 2 (as
    runtimes before format 3 wrote it) alike: tensor table, loss scaler,
    seed; the runtime loads both into the same states; the files the
    runtime exports (what state_dict reads) are format 3, each with its
    own identity."""
    import struct
    from zopt import _ckpt
    from oracles.ckptfmt import fnv1a64
    rng = np.random.default_rng(5)
    step = steps(rule="adamw", layout="f32")
    ps = [rng.standard_normal(n).astype(np.float32) for n in (5, 300)]
    gs = [np.zeros_like(p) for p in ps]
    opt = zopt.Optimizer(step, [{"params": [(ps[0], gs[0])]},
                                {"params": [(ps[1], gs[1])], "lr": 0.003}], lr=0.01, seed=77)
    for _ in range(2):
        for g in gs:
            g[...] = rng.standard_normal(g.size)
        opt.step()
    v3 = tmp_path / "ck"
    opt.save(v3)
    b = v3.read_bytes()
    assert b[:8] == b"ZOPTCKP2" and struct.unpack_from("<I", b, 8)[0] == 3
    H = struct.unpack_from("<Q", b, 16)[0]
    v2b = bytearray(b[:104] + b[120:H])  # without the 16-byte identity
    struct.pack_into("<I", v2b, 8, 2)
    struct.pack_into("<Q", v2b, 16, H - 16)
    v2b += struct.pack("<Q", fnv1a64(v2b))
    v2b += bytes(H + 8 - len(v2b)) + b[H + 8:]  # the data where they were
    v2 = tmp_path / "ck2"
    v2.write_bytes(bytes(v2b))
    want_table = (step.name, 1, 2, [(0, 5), (1, 300)])
    assert _ckpt.read_tensor_table(v3) == _ckpt.read_tensor_table(v2) == want_table
    scale, good, cfg, seed = _ckpt.read_scaler(v3)
    assert _ckpt.read_scaler(v2) == (scale, good, cfg, seed) and seed == 77
    fresh = zopt.Optimizer(step, [{"params": [(ps[0].copy(), gs[0].copy())]},
                                  {"params": [(ps[1].copy(), gs[1].copy())]}], lr=0.01)
    for f in (v3, v2):
        fresh.load(f)
        for t in range(2):
            for k in ("exp_avg", "exp_avg_sq"):
                a, c = opt.read_state_raw(t, k), fresh.read_state_raw(t, k)
                assert a.tobytes() == c.tobytes() and np.any(a != 0), (f, t, k)
        assert fresh.param_groups[1]["lr"] == 0.003 and fresh.seed == 77
    # The runtime's whole export (what state_dict() reads): format 3, one
    # rank, each export its own identity; read in memory as files are.
    opt.param_groups[0]["maximize"] = True
    opt._push_hypers()
    ids = []
    for i in range(2):
        w = opt._parts[0].export_whole()
        assert struct.unpack_from("<I", w, 8)[0] == 3
        assert struct.unpack_from("<II", w, 96) == (1, 0)  # world 1, rank 0
        ids.append(w[104:120].tobytes())
        img = _ckpt.parse(w)
        assert img.name == step.name and img.seed == 77 and len(img.kinds) == 2
        assert [(g[0], g[2]) for g in img.groups] == [(2, _ckpt.GROUP_MAXIMIZE), (2, 0)]
        assert img.tensors["numel"].tolist() == [5, 300]
        assert img.state(0, 1).tobytes() == opt.read_state_raw(1, img.kinds[0][0]).tobytes()
    assert ids[0] != ids[1]


def test_loss_scaler_state_is_read_from_the_runtime(steps):
    """The loss scaler's scale and good-step count are the runtime's, read
    through zopt_optimizer_get_loss_scaler_state (issue 17: the binding no
    longer mirrors the count): what the runtime counts, and what is set
    through the C API, is what state_dict() reports and carries over."""
    step, prob, opt = make(steps, "f16_loss_scale",
                           scaler=dict(init_scale=1024.0, growth_interval=3))
    for _ in range(2):
        prob.set_grads(0.01, loss_scale=opt.loss_scale)
        opt.step()
    ls = opt.state_dict()["zopt"]["loss_scaler"]
    assert (ls["scale"], ls["good_steps"]) == (1024.0, 2)
    L = zopt._lib.lib()
    zopt._lib.check(L.zopt_optimizer_set_loss_scaler_state(opt._handle(), 2048.0, 1))
    sd = opt.state_dict()
    assert (sd["zopt"]["loss_scaler"]["scale"], sd["zopt"]["loss_scaler"]["good_steps"]) \
        == (2048.0, 1)
    _, _, o2 = make(steps, "f16_loss_scale", scaler=dict(init_scale=8.0))
    with pytest.warns(zopt.optimizer.MasterWeightsWarning):  # o2's params: the first ones
        o2.load_state_dict(sd)
    got = o2.state_dict()["zopt"]["loss_scaler"]
    assert (got["scale"], got["good_steps"], got["growth_interval"]) == (2048.0, 1, 3)
    prob.set_grads(0.01, loss_scale=opt.loss_scale)
    opt.step()  # the runtime's third good step since 2048: unchanged; the next grows
    prob.set_grads(0.01, loss_scale=opt.loss_scale)
    opt.step()
    assert opt.loss_scale == 4096.0
    assert opt.state_dict()["zopt"]["loss_scaler"]["good_steps"] == 0

"""zopt.Optimizer as a torch.optim.Optimizer, beside torch.optim.AdamW:
params without gradients left alone, user writes into bf16 params never
lost, bad hyperparameters and params refused, add_param_group, state[p],
zero_grad, closures, every lr_scheduler, state_dict both ways, metrics.
(About 940 lines: one section per torch.optim surface, all on the helpers
and fixtures above, which test_rule_flags.py imports; a new surface goes
into a file of its own, as torch's rule flags did.)"""
import collections.abc
import contextlib
import copy
import math
import os
import pickle
import warnings

import numpy as np
import pytest
import torch

import zopt
from zopt import bf16

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return m.to(dtype)


def batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g).to(dtype), torch.randn(16, 3, generator=g).to(dtype)


def train_step(model, opt, i, dtype=torch.float32):
    x, y = batch(i, dtype)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    opt.step()
    return loss.item()


def close(a, b, rtol=2e-5, atol=1e-6):
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.detach().float().numpy(), q.detach().float().numpy(),
                                   rtol=rtol, atol=atol)


def bits(t):
    t = t.detach()
    return t.view(torch.int16).clone() if t.dtype == torch.bfloat16 else t.clone()


def same_bits(a, b):
    return all(torch.equal(bits(p), bits(q)) for p, q in zip(a, b))


@pytest.fixture
def adamw_f32(steps):
    return steps(rule="adamw", layout="f32")


@pytest.fixture
def adamw_bf16(steps):
    return steps(rule="adamw", layout="bf16_master")


# ---- params without gradients ---------------------------------------------

def test_frozen_unused_and_none_grads_left_alone(adamw_f32):
    """A requires_grad=False weight, a param unused in the graph and params
    whose grad is None: no decay, no moment update, no step count (torch's
    semantics); the others match torch.optim.AdamW."""
    def build():
        m = mlp()
        m.extra = torch.nn.Parameter(torch.ones(4))  # never used
        m[0].weight.requires_grad_(False)            # frozen
        return m
    mz, mt = build(), build()
    oz = zopt.Optimizer(adamw_f32, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    frozen0, extra0 = mz[0].weight.detach().clone(), mz.extra.detach().clone()
    for i in range(3):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    assert torch.equal(mz[0].weight, frozen0) and torch.equal(mz.extra, extra0)
    assert mz[0].weight.grad is None and mz.extra.grad is None  # never allocated
    assert oz.state[mz.extra] == {} and oz.tensor_step(mz.extra) == 0
    assert oz.tensor_step(mz[2].weight) == 3
    close(mz.parameters(), mt.parameters())
    # Only the last layer gets gradients for two steps: the others keep
    # their states and step counts; bias corrections use each param's own
    # count, as torch's per-param state['step'].
    for i in range(3, 5):
        for m, o in ((mz, oz), (mt, ot)):
            o.zero_grad(set_to_none=True)
            x, y = batch(i)
            with torch.no_grad():
                h = m[1](m[0](x))
            torch.nn.functional.mse_loss(m[2](h), y).backward()
            o.step()
    assert oz.tensor_step(mz[0].bias) == 3 and oz.tensor_step(mz[2].bias) == 5
    assert float(oz.state[mz[0].bias]["step"]) == float(ot.state[mt[0].bias]["step"]) == 3
    close(mz.parameters(), mt.parameters())
    close([oz.state[mz[0].bias]["exp_avg"]], [ot.state[mt[0].bias]["exp_avg"]])
    # Every grad None: nothing changes (params, states, counts).
    oz.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in mz.parameters()]
    sd = oz.state_dict()
    oz.step()
    assert same_bits(mz.parameters(), before)
    assert oz.last_metrics["no_grads"]
    sd2 = oz.state_dict()
    for t in sd["state"]:
        for k in sd["state"][t]:
            assert torch.equal(sd["state"][t][k], sd2["state"][t][k])


def test_grad_none_zero_and_foreign_tensors(adamw_f32):
    """p.grad None (skipped), zeros (a real zero gradient: decayed, counted,
    as torch) and a tensor assigned by hand (copied in) in one step."""
    ps = [torch.nn.Parameter(torch.full((5,), 1.0 + i)) for i in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    oz = zopt.Optimizer(adamw_f32, ps, lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(qs, lr=LR, weight_decay=WD, foreach=False)
    for s in range(3):
        for P in (ps, qs):
            P[0].grad = None
            P[1].grad = torch.zeros(5)
            P[2].grad = torch.arange(5.0) * (s + 1)
        oz.step()
        ot.step()
    close(ps, qs, rtol=1e-6)
    assert torch.equal(ps[0].detach(), torch.full((5,), 1.0))
    assert [oz.tensor_step(p) for p in ps] == [0, 3, 3]
    assert torch.equal(ps[2].grad, torch.arange(5.0) * 3)  # same values kept


def test_none_grad_left_alone_after_a_rebuild(adamw_bf16):
    """p.data = new storage rebuilds the native optimizer inside step(); a
    param whose grad is None in that step is still left alone (the new
    native optimizer's mask is set again: it starts with every tensor
    active)."""
    a = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    o = zopt.Optimizer(adamw_bf16, [a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.ones(4, dtype=torch.bfloat16)
    b.grad = torch.ones(4, dtype=torch.bfloat16)
    o.step()
    b.grad = None
    before = b.detach().clone()
    a.data = a.data.clone()  # a new storage: rebuilt in the next step()
    o.step()
    assert o.rebuilds == 1 and o.tensor_step(a) == 2
    assert o.tensor_step(b) == 1 and torch.equal(b.detach(), before)


# ---- user writes into bf16 params (master layouts) ---------------------------

def _bf16_pair(step, seed=0):
    m = mlp(seed, torch.bfloat16)
    o = zopt.Optimizer(step, m.parameters(), lr=LR, weight_decay=WD)
    return m, o


def _master_is_params(o, m):
    """The master holds exactly the (widened) bf16 params."""
    for t, p in enumerate(m.parameters()):
        np.testing.assert_array_equal(o.read_state(t, "master"),
                                      p.detach().float().reshape(-1).numpy())


@pytest.mark.parametrize("path", ["load_state_dict", "data_copy", "nograd_copy", "data_assign",
                                  "mul_"])
def test_bf16_master_never_loses_user_weights(adamw_bf16, path):
    m, o = _bf16_pair(adamw_bf16)
    for i in range(2):
        train_step(m, o, i, torch.bfloat16)
    pre = mlp(5, torch.bfloat16)  # "pretrained" weights
    if path == "load_state_dict":
        m.load_state_dict(pre.state_dict())
    elif path == "data_copy":  # no version bump: found by the sampled check
        for p, q in zip(m.parameters(), pre.parameters()):
            p.data.copy_(q.data)
    elif path == "nograd_copy":
        with torch.no_grad():
            for p, q in zip(m.parameters(), pre.parameters()):
                p.copy_(q)
    elif path == "data_assign":  # new storage: re-registered (rebuild)
        exp = [o.read_state(t, "exp_avg").copy() for t in range(o.num_tensors)]
        for p, q in zip(m.parameters(), pre.parameters()):
            p.data = q.data.clone()
        # any call finds the moved storage: the native optimizer is rebuilt
        # around it, states kept
        got = [o.read_state(t, "exp_avg") for t in range(o.num_tensors)]
        for a, b in zip(got, exp):
            np.testing.assert_array_equal(a, b)
        assert o.rebuilds == 1
    elif path == "mul_":
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.5)
    want = [p.detach().clone() for p in m.parameters()]
    # lr 0 and no decay: the step must keep the written weights exactly
    for g in o.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(m, o, 5, torch.bfloat16)
    assert same_bits(m.parameters(), want), f"{path}: the step lost the written weights"
    assert o.refreshes >= 1
    _master_is_params(o, m)
    for g in o.param_groups:  # and training goes on from them
        g["lr"], g["weight_decay"] = LR, WD
    train_step(m, o, 6, torch.bfloat16)
    assert not same_bits(m.parameters(), want)


def test_bf16_numpy_write_and_explicit_refresh(adamw_bf16):
    rng = np.random.default_rng(1)
    p = bf16.from_f32(rng.standard_normal(300).astype(np.float32))
    g = bf16.from_f32(rng.standard_normal(300).astype(np.float32) * 0.1)
    o = zopt.Optimizer(adamw_bf16, [(p, g)], lr=0.0)
    o.step()
    new = bf16.from_f32(rng.standard_normal(300).astype(np.float32))
    p[...] = new  # a numpy write: sampled
    o.step()
    np.testing.assert_array_equal(p, new)
    np.testing.assert_array_equal(o.read_state(0, "master"), bf16.to_f32(new))
    # A write that misses the sampled elements needs refresh_master().
    p[100:110] = bf16.from_f32(np.full(10, 3.0, np.float32))
    o.refresh_master()
    o.step()
    assert np.all(bf16.to_f32(p[100:110]) == 3.0)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_optimizer_state_dict_resume_bf16(adamw_bf16):
    """model then optimizer state_dict: a bit-exact resume (the loaded
    master is kept, nothing warned); optimizer then model: the model's
    weights win (the load is detected, the master remade from them)."""
    m, o = _bf16_pair(adamw_bf16)
    for i in range(3):
        train_step(m, o, i, torch.bfloat16)
    msd, osd = copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())
    for i in range(3, 6):
        train_step(m, o, i, torch.bfloat16)
    first = [p.detach().clone() for p in m.parameters()]
    m2, o2 = _bf16_pair(adamw_bf16, seed=9)
    m2.load_state_dict(msd)
    with no_warnings():
        o2.load_state_dict(osd)
    assert same_bits(m2.parameters(), list(msd.values()))
    for i in range(3, 6):
        train_step(m2, o2, i, torch.bfloat16)
    assert same_bits(m2.parameters(), first)
    # the other order: the optimizer state first (its master written into
    # the params, warned), then other weights into the model: they win
    m3, o3 = _bf16_pair(adamw_bf16, seed=9)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning):
        o3.load_state_dict(osd)
    pre = mlp(5, torch.bfloat16).state_dict()
    m3.load_state_dict(pre)
    for g in o3.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(m3, o3, 0, torch.bfloat16)
    assert same_bits(m3.parameters(), list(pre.values()))
    _master_is_params(o3, m3)


def test_optimizer_state_dict_of_another_run_bf16(adamw_bf16, tmp_path):
    """An optimizer state (with its master) loaded into an optimizer whose
    model holds other weights: the params are set to round(master) at once
    (model and master agree before any step), with a warning counting them;
    params that already agree are left alone. The same for opt.load()."""
    m, o = _bf16_pair(adamw_bf16)
    for i in range(3):
        train_step(m, o, i, torch.bfloat16)
    msd, osd = copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())
    masters = [osd["state"][t]["master"] for t in range(4)]
    o.save(tmp_path / "ck")
    m2, o2 = _bf16_pair(adamw_bf16, seed=9)
    with torch.no_grad():  # one param already holds the run's weights
        m2[0].bias.copy_(m[0].bias)
    o2.step()  # (the write above is taken into the master)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning,
                      match=r"in 3 of 4 params.*load them after the optimizer state") as rec:
        o2.load_state_dict(osd)
    # the warning names the user's line, never one of zopt's own frames
    assert [w.filename for w in rec] == [__file__]
    # at once: each param is its loaded master, rounded (the run's weights)
    assert same_bits(m2.parameters(), list(msd.values()))
    for t, p in enumerate(m2.parameters()):
        assert torch.equal(p.detach(), masters[t].to(torch.bfloat16))
        np.testing.assert_array_equal(o2.read_state(t, "master"),
                                      masters[t].reshape(-1).numpy())
    # and the next steps go on from there exactly as the run does
    m.load_state_dict(msd)
    o.load_state_dict(osd)
    for i in range(3, 5):
        train_step(m, o, i, torch.bfloat16)
        train_step(m2, o2, i, torch.bfloat16)
    assert same_bits(m2.parameters(), m.parameters())
    # opt.load() of the runtime's checkpoint: the same policy
    m3, o3 = _bf16_pair(adamw_bf16, seed=9)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning, match="load: .* 4 of 4") as rec:
        o3.load(tmp_path / "ck")
    assert [w.filename for w in rec] == [__file__]
    assert same_bits(m3.parameters(), list(msd.values()))
    m4, o4 = _bf16_pair(adamw_bf16, seed=9)
    m4.load_state_dict(msd)
    with no_warnings():
        o4.load(tmp_path / "ck")
    assert same_bits(m4.parameters(), list(msd.values()))


@pytest.mark.parametrize("how", ["load_state_dict", "load"])
def test_zero3_master_of_another_run(steps, tmp_path, how):
    """ZeRO-3 (the runtime holds the params) at one rank: the same policy;
    with zero3_gather="step" the model holds round(master) at once."""
    z3 = steps(rule="adamw", layout="bf16_master", attributes={"zero_stage": 3})
    m, o = _bf16_pair(z3)
    for i in range(3):
        train_step(m, o, i, torch.bfloat16)
    msd, osd = copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())
    o.save(tmp_path / "ck")

    def load(opt):
        if how == "load":
            opt.load(tmp_path / "ck")
        else:
            opt.load_state_dict(osd)
    m2, o2 = _bf16_pair(z3, seed=9)
    m2.load_state_dict(msd)
    with no_warnings():
        load(o2)
    m3, o3 = _bf16_pair(z3, seed=9)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning, match=f"{how}: .* 4 of 4"):
        load(o3)
    assert same_bits(m3.parameters(), list(msd.values()))
    for i in range(3, 5):
        train_step(m2, o2, i, torch.bfloat16)
        train_step(m3, o3, i, torch.bfloat16)
    assert same_bits(m3.parameters(), m2.parameters())


def test_a_param_that_is_a_rounding_of_its_master_is_kept():
    """Stochastic rounding may write either neighbour of the master into a
    bf16 param: both count as agreeing (nothing rewritten, no warning);
    anything else does not."""
    from zopt._dtypes import is_rounding_of as _is_rounding_of
    from zopt._lib import DType
    m = np.array([1.0 + 0.75 * 2 ** -7, 1.0 + 0.25 * 2 ** -7, 1.0, -3.0, 1.0 + 0.75 * 2 ** -7,
                  float("nan"), 0.0], np.float32)
    p = bf16.from_f32(np.array([1.0, 1.0, 1.0, -3.0, 1.0 - 2 ** -8, float("nan"), -0.0],
                               np.float32))
    np.testing.assert_array_equal(_is_rounding_of(p, DType.BF16, m),
                                  [True, True, True, True, False, True, True])
    p[2] = bf16.from_f32(np.float32(1.0 + 2 ** -7))  # 1.0 is exact: only 1.0 agrees
    assert not _is_rounding_of(p, DType.BF16, m)[2]
    h = np.array([1.0, 1.0 + 2 ** -10, 2.0], np.float16)
    mh = np.array([1.0 + 0.5 * 2 ** -10, 1.0 + 0.5 * 2 ** -10, 2.5], np.float32)
    np.testing.assert_array_equal(_is_rounding_of(h, DType.F16, mh), [True, True, False])


@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 2)])
def test_bit_conversions_keep_the_shape(shape):
    """zopt.bf16's and zopt._dtypes' conversions return an array of their
    input's shape: a scalar (0-d) in, a scalar out. np.ascontiguousarray
    alone made it a 1-element array, which numpy >= 2.5 refuses as a
    scalar (``p[i] = from_f32(x)``: "setting an array element with a
    sequence"; ``float(...)``)."""
    from zopt._dtypes import f32_of_bits, from_bits, is_rounding_of, round_bits
    from zopt._lib import DType
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    if not shape:
        x = np.float32(x)
    b = bf16.from_f32(x)
    outs = [b, bf16.to_f32(b), bf16.round_f64(np.float64(x) if not shape else x.astype(np.float64)),
            bf16.from_f32_stochastic(x, np.zeros(shape, np.uint32)),
            round_bits(x, DType.BF16), round_bits(x, DType.F16), round_bits(x, DType.F32),
            is_rounding_of(b, DType.BF16, x)]
    for o in outs:
        assert np.shape(o) == shape, [np.shape(o) for o in outs]
    for dt, bits in ((DType.BF16, b), (DType.F16, round_bits(x, DType.F16)), (DType.F32, x)):
        assert tuple(from_bits(bits, dt).shape) == shape
    np.testing.assert_array_equal(bf16.to_f32(b), f32_of_bits(b, DType.BF16))
    want = torch.tensor(np.asarray(x)).to(torch.bfloat16).float().numpy()  # torch's rounding
    np.testing.assert_array_equal(bf16.to_f32(b), want)
    p = np.zeros(4, np.uint16)
    p[1] = bf16.from_f32(np.float32(1.5))  # a scalar into one element
    assert bf16.to_f32(p)[1] == 1.5


# ---- bad input -------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), 2.0, 0.5, "yes", -1])
def test_bias_correction_must_be_bool(adamw_f32, bad):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(zopt.ZoptError, match="bias_correction"):
        zopt.Optimizer(adamw_f32, [p], bias_correction=bad)
    with pytest.raises(zopt.ZoptError, match="bias_correction"):
        zopt.Optimizer(adamw_f32, [dict(params=[p], bias_correction=bad)])
    o = zopt.Optimizer(adamw_f32, [p])
    with pytest.raises(zopt.ZoptError, match="bias_correction"):
        o.set_hyper(0, "bias_correction", bad)
    o.param_groups[0]["bias_correction"] = bad
    p.grad = torch.ones(3)
    with pytest.raises(zopt.ZoptError, match="bias_correction"):
        o.step()
    assert o.get_hyper(0, "bias_correction") == 1.0
    for ok in (False, 0, 0.0, np.bool_(False)):
        o.param_groups[0]["bias_correction"] = ok
        o.step()
        assert o.get_hyper(0, "bias_correction") == 0.0


def test_empty_tensors(adamw_bf16):
    ps = [torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16)),
          torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)),
          torch.nn.Parameter(torch.empty(3, 0, dtype=torch.bfloat16))]
    o = zopt.Optimizer(adamw_bf16, ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    o.step()
    assert o.tensor_step(ps[0]) == 1 and float(ps[1][0]) < 1.0
    sd = o.state_dict()
    assert sd["state"][0]["exp_avg"].shape == (0,)
    o.load_state_dict(sd)
    o.step()


def test_overlapping_views_refused(adamw_f32):
    base = torch.zeros(10)
    a = torch.nn.Parameter(base[:6])
    b = torch.nn.Parameter(base[4:])
    c = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(zopt.ZoptError) as e:
        zopt.Optimizer(adamw_f32, [c, a, b])
    msg = str(e.value)
    assert "['params'][1]" in msg and "['params'][2]" in msg and "overlap" in msg
    with pytest.raises(zopt.ZoptError, match="twice"):
        zopt.Optimizer(adamw_f32, [c, c])
    # disjoint views of one storage are fine
    zopt.Optimizer(adamw_f32, [torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[6:])])


def test_non_contiguous_params(adamw_f32):
    """channels_last and transposed params are dense: supported (states
    strided like the param); an expanded view (elements sharing memory) is
    refused, naming the param and the fix. (Strided views: test_torch_compat.py.)"""
    torch.manual_seed(3)
    w = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    t = torch.randn(7, 5).t()
    pz = [torch.nn.Parameter(w.clone(memory_format=torch.preserve_format)),
          torch.nn.Parameter(t.clone().t().contiguous().t())]
    assert not pz[0].is_contiguous() and not pz[1].is_contiguous()
    pt = [torch.nn.Parameter(p.detach().clone()) for p in pz]
    oz = zopt.Optimizer(adamw_f32, pz, lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(pt, lr=LR, weight_decay=WD, foreach=False)
    for s in range(3):
        for P, O in ((pz, oz), (pt, ot)):
            O.zero_grad()
            (P[0].square().sum() * 0.5 + (P[1] * torch.arange(35.0).view(5, 7)).sum()).backward()
            O.step()
    close(pz, pt, rtol=1e-6)
    st = oz.state[pz[0]]
    assert st["exp_avg"].stride() == pz[0].stride()
    close([st["exp_avg"]], [ot.state[pt[0]]["exp_avg"]], rtol=1e-6)
    bad = torch.nn.Parameter(torch.zeros(4, 1).expand(4, 3))
    with pytest.raises(zopt.ZoptError) as e:
        zopt.Optimizer(adamw_f32, [pz[0], bad])
    assert "['params'][1]" in str(e.value) and "contiguous()" in str(e.value)


# ---- writes through opt.state[p] ---------------------------------------------------

def _side_by_side(step, steps=2):
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(step, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(steps):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    return mz, oz, mt, ot


def test_state_writes_reach_the_runtime_as_in_torch(adamw_f32):
    """What torch users do to optimizer.state, done to zopt and to
    torch.optim.AdamW side by side: both go on alike."""
    mz, oz, mt, ot = _side_by_side(adamw_f32)
    pz, pt = list(mz.parameters()), list(mt.parameters())
    # in place on what state[p] returned (written back at the next call)
    oz.state[pz[0]]["exp_avg"].zero_()
    ot.state[pt[0]]["exp_avg"].zero_()
    assert not oz.state[pz[0]]["exp_avg"].any()       # a read sees it
    assert not oz.read_state(pz[0], "exp_avg").any()
    sz, st = oz.state[pz[1]], ot.state[pt[1]]
    sz["exp_avg_sq"].mul_(4.0)
    st["exp_avg_sq"].mul_(4.0)
    # item assignment, also of a tensor changed in place afterwards
    buf = torch.full_like(pz[2], 0.01)
    oz.state[pz[2]]["exp_avg"] = buf
    ot.state[pt[2]]["exp_avg"] = buf.clone()
    buf.mul_(2.0)
    ot.state[pt[2]]["exp_avg"].mul_(2.0)
    oz.state[pz[3]]["step"] = 7
    ot.state[pt[3]]["step"] = torch.tensor(7.0)
    oz.state[pz[3]]["step"] += 1                     # a tensor, then assigned
    ot.state[pt[3]]["step"] += 1
    assert oz.tensor_step(pz[3]) == 8
    for i in range(2, 4):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(pz, pt)
    for p, q in zip(pz, pt):
        close([oz.state[p]["exp_avg"], oz.state[p]["exp_avg_sq"]],
              [ot.state[q]["exp_avg"], ot.state[q]["exp_avg_sq"]])
        assert float(oz.state[p]["step"]) == float(ot.state[q]["step"])
    # the state_dict sees the writes too
    oz.state[pz[1]]["exp_avg"].fill_(3.0)
    assert torch.all(oz.state_dict()["state"][1]["exp_avg"] == 3.0)


def test_state_replaced_or_reset_as_in_torch(adamw_f32):
    """opt.state[p] = {} (and del, clear, opt.state = {}) resets the param:
    its next step starts afresh, as torch's; a full mapping replaces it."""
    mz, oz, mt, ot = _side_by_side(adamw_f32)
    pz, pt = list(mz.parameters()), list(mt.parameters())
    saved = {k: v.clone() for k, v in oz.state[pz[1]].items()}
    oz.state[pz[0]] = {}
    ot.state[pt[0]] = {}
    assert pz[0] not in oz.state and oz.state[pz[0]] == {} and oz.tensor_step(pz[0]) == 0
    assert not oz.read_state(pz[0], "exp_avg").any()
    del oz.state[pz[1]]
    del ot.state[pt[1]]
    assert len(oz.state) == 2
    for i in range(2, 4):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(pz, pt)
    oz.state[pz[1]] = saved                          # torch's ZeroRedundancyOptimizer does this
    for k, v in saved.items():
        assert torch.equal(oz.state[pz[1]][k], v)
    oz.state[pz[2]].update(exp_avg=torch.ones_like(pz[2]), step=torch.tensor(9.0))
    assert oz.tensor_step(pz[2]) == 9 and torch.all(oz.state[pz[2]]["exp_avg"] == 1)
    oz.state = {}                                    # every param reset
    assert len(oz.state) == 0 and all(oz.tensor_step(p) == 0 for p in pz)
    train_step(mz, oz, 5)
    oz.state.clear()
    assert len(oz.state) == 0
    oz.state = oz.state                              # a no-op


def test_state_copies_and_refusals(adamw_f32):
    m, o, _, _ = _side_by_side(adamw_f32, steps=1)
    p = m[0].weight
    st = o.state[p]
    assert isinstance(st, collections.abc.MutableMapping) and list(st) == list(dict(st))
    assert type(copy.deepcopy(st)) is dict and type(st.copy()) is dict
    assert type(pickle.loads(pickle.dumps(st))) is dict
    with pytest.raises(zopt.ZoptError, match=r"no state 'exp_avgg'; its states: 'step', "
                                             r"'exp_avg', 'exp_avg_sq'"):
        st["exp_avgg"] = torch.zeros_like(p)
    with pytest.raises(KeyError):
        st["momentum_buffer"]
    with pytest.raises(zopt.ZoptError, match=r"shape \(3, 8\), the param's is \(8, 6\)"):
        st["exp_avg"] = torch.zeros(3, 8)
    with pytest.raises(zopt.ZoptError, match="torch.int64 tensor"):
        st["exp_avg"] = torch.zeros(8, 6, dtype=torch.long)
    with pytest.raises(zopt.ZoptError, match="a float"):
        st["exp_avg"] = 0.0
    with pytest.raises(zopt.ZoptError, match="whole number"):
        st["step"] = 1.5
    with pytest.raises(zopt.ZoptError, match="assign a mapping"):
        o.state[p] = 5
    with pytest.raises(zopt.ZoptError, match="not a param of this optimizer"):
        o.state[torch.nn.Parameter(torch.zeros(2))] = {}
    with pytest.raises(zopt.ZoptError, match="del opt.state"):
        del st["exp_avg"]
    # a refused mapping writes nothing
    before = o.read_state(p, "exp_avg").copy()
    with pytest.raises(zopt.ZoptError, match="shape"):
        o.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros(2)}
    np.testing.assert_array_equal(o.read_state(p, "exp_avg"), before)
    # other float dtypes are converted to the state's (f32 here); numpy too
    st["exp_avg"] = torch.full((8, 6), 0.5, dtype=torch.bfloat16)
    assert st["exp_avg"].dtype == torch.float32 and torch.all(st["exp_avg"] == 0.5)
    st["exp_avg"] = np.full((8, 6), 0.25)
    assert torch.all(st["exp_avg"] == 0.25)
    # a copy changed in place after a step is outdated: not written back, warned
    old = o.state[p]["exp_avg"]
    train_step(m, o, 3)
    now = o.read_state(p, "exp_avg").copy()
    old.zero_()
    with pytest.warns(RuntimeWarning, match=r"not written back: param_groups\[0\]\['params'\]"
                                            r"\[0\].*\['exp_avg'\]"):
        train_step(m, o, 4)
    assert o.read_state(p, "exp_avg").any()
    assert not np.array_equal(o.read_state(p, "exp_avg"), now)  # stepped from `now`, not 0


def test_state_master_writes_the_param(adamw_bf16):
    """bf16 params with an f32 master: writing the master through state[p]
    also writes round(master) into the param (model and master agree);
    resetting the param's state makes the master from the param."""
    m, o = _bf16_pair(adamw_bf16)
    for i in range(2):
        train_step(m, o, i, torch.bfloat16)
    p = m[0].weight
    w = torch.randn(p.shape) * 0.1
    o.state[p]["master"] = w
    assert torch.equal(o.state[p]["master"], w)
    assert torch.equal(p.detach(), w.to(torch.bfloat16))
    o.state[p]["master"].mul_(2.0)           # in place: written back, param too
    assert torch.equal(o.state[p]["master"], w * 2)
    assert torch.equal(p.detach(), (w * 2).to(torch.bfloat16))
    with torch.no_grad():
        p.mul_(0.5)                          # a user write, then a reset
    o.state[p] = {}
    np.testing.assert_array_equal(o.read_state(p, "master"), p.detach().float().reshape(-1))
    assert o.state[p] == {} and o.tensor_step(p) == 0
    for g in o.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    want = [q.detach().clone() for q in m.parameters()]
    train_step(m, o, 5, torch.bfloat16)
    assert same_bits(m.parameters(), want)


def test_write_state_master_writes_the_param(adamw_bf16):
    """The low-level write_state(p, 'master', ...) keeps model and master in
    agreement as state[p]['master'] = ... does: the param becomes
    round(master), and the next step runs from the written master."""
    m, o = _bf16_pair(adamw_bf16)
    train_step(m, o, 0, torch.bfloat16)
    p = m[0].weight
    w = torch.randn(p.shape) * 0.1
    o.write_state(p, "master", w.numpy().reshape(-1))
    np.testing.assert_array_equal(o.read_state(p, "master"), w.numpy().reshape(-1))
    assert torch.equal(p.detach(), w.to(torch.bfloat16))
    for g in o.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(m, o, 1, torch.bfloat16)     # lr 0: the param stays round(master)
    assert torch.equal(p.detach(), w.to(torch.bfloat16))


# ---- the torch.optim.Optimizer surface -------------------------------------------

def test_optimizer_surface(adamw_f32):
    m = mlp()
    o = zopt.Optimizer(adamw_f32, m.parameters(), lr=LR)
    assert isinstance(o, torch.optim.Optimizer)
    assert all(a is b for a, b in zip(o.param_groups[0]["params"], m.parameters()))
    assert o.defaults["betas"] == pytest.approx(BETAS) and o.defaults["lr"] == LR
    x, y = batch(0)

    def closure():
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss
    loss = o.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert math.isnan(o.last_grad_norm) and o.last_skipped is False
    assert set(o.state[m[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert o.state[m[0].weight]["exp_avg"].shape == m[0].weight.shape
    assert len(o.state) == 4 and m[0].weight in o.state
    r = repr(o)
    assert "adamw_f32" in r and "Parameter Group 0" in r and "lr: 0.01" in r
    # zero_grad honours set_to_none (its default: test_torch2.py)
    o.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    o.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(o)


def test_add_param_group_keeps_states(adamw_f32):
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(adamw_f32, mz[0].parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt[0].parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(2):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    oz.add_param_group(dict(params=mz[2].parameters(), lr=2 * LR))
    ot.add_param_group(dict(params=mt[2].parameters(), lr=2 * LR))
    assert oz.rebuilds == 1 and oz.tensor_step(mz[0].weight) == 2
    assert oz.param_groups[1]["lr"] == 2 * LR and oz.param_groups[1]["betas"] == BETAS
    for i in range(2, 5):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())
    assert oz.tensor_step(mz[0].weight) == 5 and oz.tensor_step(mz[2].weight) == 3
    with pytest.raises(zopt.ZoptError):  # a param already in a group
        oz.add_param_group(dict(params=[mz[0].weight]))
    assert len(oz.param_groups) == 2
    train_step(mz, oz, 9)
    oz.param_groups[1]["params"].append(torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(zopt.ZoptError, match="add_param_group"):
        oz.step()


# ---- schedulers ---------------------------------------------------------------------

SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=10, cycle_momentum=True, base_momentum=0.8,
        max_momentum=0.95),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(
        o, factor=0.5, patience=0),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)], milestones=[3]),
}


@pytest.mark.filterwarnings("ignore:The epoch parameter")  # torch's own SequentialLR
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers(adamw_f32, name):
    mz, mt = mlp(), mlp()
    groups = lambda m: [dict(params=m[0].parameters()), dict(params=m[2].parameters(), lr=LR / 2)]
    oz = zopt.Optimizer(adamw_f32, groups(mz), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(groups(mt), lr=LR, weight_decay=WD, foreach=False)
    sz, st = SCHEDULERS[name](oz), SCHEDULERS[name](ot)
    for i in range(10):
        lz, lt = train_step(mz, oz, i), train_step(mt, ot, i)
        for gz, gt in zip(oz.param_groups, ot.param_groups):
            assert gz["lr"] == gt["lr"]
            assert gz["betas"] == pytest.approx(gt["betas"], abs=0)
        for gid, gz in enumerate(oz.param_groups):  # pushed to the runtime
            assert oz.get_hyper(gid, "lr") == gz["lr"]
            assert oz.get_hyper(gid, "beta1") == gz["betas"][0]
        close(mz.parameters(), mt.parameters(), rtol=1e-4)
        if name == "ReduceLROnPlateau":
            sz.step(1.0)  # a plateau: halves every step
            st.step(1.0)
        else:
            sz.step()
            st.step()
    if name != "ReduceLROnPlateau":
        # what the scheduler records of optimizer.step() through its wrapper
        # around the instance's step: torch 1.13 counts the calls in
        # optimizer._step_count; torch 2 sets optimizer._opt_called
        seen = [a for a in ("_step_count", "_opt_called") if hasattr(ot, a)]
        assert seen, "torch's scheduler recorded no optimizer.step() call"
        for a in seen:
            assert getattr(oz, a) == getattr(ot, a), a
        if hasattr(ot, "_step_count"):
            assert ot._step_count == 10
        if hasattr(ot, "_opt_called"):
            assert ot._opt_called is True
    if name == "OneCycleLR":
        assert oz.get_hyper(0, "beta1") != 0.9


# ---- state_dict both ways -------------------------------------------------------------

def test_torch_adamw_state_dict_into_zopt(adamw_f32):
    mt = mlp()
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(3):
        train_step(mt, ot, i)
    mz = copy.deepcopy(mt)
    for p in mz.parameters():
        p.grad = None
    oz = zopt.Optimizer(adamw_f32, mz.parameters(), lr=1.0)
    oz.load_state_dict(ot.state_dict())
    assert oz.param_groups[0]["lr"] == LR and oz.get_hyper(0, "lr") == LR
    for (p, q) in zip(mz.parameters(), mt.parameters()):
        assert oz.tensor_step(p) == 3
        assert torch.equal(oz.state[p]["exp_avg"], ot.state[q]["exp_avg"])
        assert torch.equal(oz.state[p]["exp_avg_sq"], ot.state[q]["exp_avg_sq"])
    for i in range(3, 8):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
        close(mz.parameters(), mt.parameters(), rtol=1e-5)


def test_zopt_state_dict_into_torch_adamw(adamw_f32):
    mz = mlp()
    oz = zopt.Optimizer(adamw_f32, mz.parameters(), lr=LR, weight_decay=WD)
    for i in range(3):
        train_step(mz, oz, i)
    mt = copy.deepcopy(mz)
    for p in mt.parameters():
        p.grad = None
    ot = torch.optim.AdamW(mt.parameters(), lr=1.0, foreach=False)
    ot.load_state_dict(oz.state_dict())
    assert ot.param_groups[0]["lr"] == LR and ot.param_groups[0]["amsgrad"] is False
    for p, q in zip(mz.parameters(), mt.parameters()):
        assert torch.equal(oz.state[p]["exp_avg_sq"], ot.state[q]["exp_avg_sq"])
        assert float(ot.state[q]["step"]) == 3
    for i in range(3, 8):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
        close(mz.parameters(), mt.parameters(), rtol=1e-5)


def test_other_rule_state_dict_refused(steps, adamw_f32):
    m = mlp()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train_step(m, sgd, 0)
    o = zopt.Optimizer(adamw_f32, m.parameters(), lr=LR)
    train_step(m, o, 0)
    before = o.state_dict()
    with pytest.raises(zopt.ZoptError) as e:
        o.load_state_dict(sgd.state_dict())
    msg = str(e.value)
    assert "momentum_buffer" in msg and "allow_rule_change=True" in msg, msg
    after = o.state_dict()  # unchanged
    assert torch.equal(before["state"][0]["exp_avg"], after["state"][0]["exp_avg"])
    o.load_state_dict(sgd.state_dict(), allow_rule_change=True)
    assert not o.read_state(m[0].weight, "exp_avg").any()  # missing states: zero
    assert o.tensor_step(m[0].weight) == 0  # torch's SGD keeps no 'step'
    # amsgrad on/off is another rule too
    ams = torch.optim.AdamW(m.parameters(), lr=LR, amsgrad=True)
    train_step(m, ams, 1)
    with pytest.raises(zopt.ZoptError, match="max_exp_avg_sq|amsgrad"):
        o.load_state_dict(ams.state_dict())
    # zopt: a checkpoint of another rule (runtime file)
    sgd_step = steps(rule="sgd", layout="f32")
    os_ = zopt.Optimizer(sgd_step, m.parameters(), lr=0.1)
    train_step(m, os_, 2)
    with pytest.raises(zopt.ZoptError, match="allow_rule_change"):
        o.load_state_dict(os_.state_dict())


# ---- metrics ---------------------------------------------------------------------

def test_metrics_hook(adamw_f32):
    m = mlp()
    o = zopt.Optimizer(adamw_f32, m.parameters(), lr=LR)
    seen = []
    h = o.register_metrics_hook(lambda opt, mt: seen.append(dict(mt)))
    train_step(m, o, 0)
    train_step(m, o, 1)
    h.remove()
    train_step(m, o, 2)
    assert len(seen) == 2 and o.last_metrics["step"] == 3
    mt = seen[-1]
    assert mt["step"] == 2 and mt["lr"] == [LR] and mt["skipped"] is False
    assert mt["active_tensors"] == 4 and mt["updated_elems"] == sum(p.numel() for p in m.parameters())
    assert mt["step_time_s"] > 0 and mt["bytes"] == mt["updated_elems"] * 28
    assert mt["bytes_per_s"] > 0 and mt["overhead_s"] >= 0


def test_csv_logger_and_example(adamw_f32, tmp_path):
    import subprocess
    import sys
    from zopt.metrics import CSVLogger, read_csv
    m = mlp()
    o = zopt.Optimizer(adamw_f32, [dict(params=m[0].parameters()),
                                   dict(params=m[2].parameters(), lr=LR / 2)], lr=LR)
    with CSVLogger(str(tmp_path / "m.csv")) as log:
        o.register_metrics_hook(log)
        for i in range(3):
            train_step(m, o, i)
    cols = read_csv(str(tmp_path / "m.csv"))
    assert cols["step"] == [1.0, 2.0, 3.0] and cols["lr1"] == [LR / 2] * 3
    assert cols["skipped"] == [0.0] * 3 and all(v > 0 for v in cols["bytes_per_s"])
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    r = subprocess.run([sys.executable, os.path.join(repo, "examples", "log_metrics.py"),
                        "--out", str(tmp_path / "run"), "--steps", "60"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert len(read_csv(str(tmp_path / "run" / "metrics.csv"))["step"]) == 60
    # The plot (scripts/setup-deps.sh installs matplotlib): a PNG, non-trivial.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the CSV was checked, not the plot")
    png = tmp_path / "run" / "metrics.png"
    assert "plot: " + str(png) in r.stdout, r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000


def test_train_side_by_side_with_torch(adamw_f32):
    """One run through what a training script does, zopt beside
    torch.optim.AdamW step by step: two param groups (no decay on biases
    and LayerNorm), OneCycleLR with momentum cycling, 2 accumulated
    micro-batches per step, a frozen layer, pretrained weights loaded in the
    middle, and a state_dict round trip into fresh optimizers (zopt's into
    torch's and torch's into zopt's)."""
    def build():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                                torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 3))
        m[3].requires_grad_(False)  # frozen
        return m

    def groups(m):
        decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
        return [dict(params=decay, weight_decay=WD), dict(params=rest, weight_decay=0.0)]

    def sched(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=12,
                                                   base_momentum=0.85, max_momentum=0.95)
    mz, mt = build(), build()
    oz = zopt.Optimizer(adamw_f32, groups(mz), lr=LR)
    ot = torch.optim.AdamW(groups(mt), lr=LR, foreach=False)
    sz, st = sched(oz), sched(ot)
    pre = build()
    with torch.no_grad():
        for p in pre.parameters():
            p.add_(0.1)
    for s in range(12):
        if s == 4:  # pretrained weights into both models
            mz.load_state_dict(pre.state_dict())
            mt.load_state_dict(pre.state_dict())
        if s == 7:  # state_dict round trip, crossed over
            zsd, tsd = oz.state_dict(), ot.state_dict()
            oz2 = zopt.Optimizer(adamw_f32, groups(mz), lr=LR)
            ot2 = torch.optim.AdamW(groups(mt), lr=LR, foreach=False)
            oz2.load_state_dict(tsd)
            ot2.load_state_dict(zsd)
            for a, b in zip(oz2.param_groups, ot2.param_groups):
                assert a["lr"] == b["lr"] and a["betas"] == pytest.approx(b["betas"], abs=0)
            oz, ot = oz2, ot2
            sz.optimizer, st.optimizer = oz, ot
        losses = []
        for m, o in ((mz, oz), (mt, ot)):
            o.zero_grad()
            total = 0.0
            for k in range(2):  # accumulation
                x, y = batch(10 * s + k)
                loss = torch.nn.functional.mse_loss(m(x), y) / 2
                loss.backward()
                total += loss.item()
            o.step()
            losses.append(total)
        assert losses[0] == pytest.approx(losses[1], rel=1e-4), s
        close(mz.parameters(), mt.parameters(), rtol=1e-4, atol=1e-6)
        assert torch.equal(mz[3].weight, pre[3].weight if s >= 4 else build()[3].weight)
        sz.step()
        st.step()
    assert oz.tensor_step(mz[3].weight) == 0


# ---- the group's params -----------------------------------------------------

def test_group_params_replaced_refused(adamw_f32):
    """A param in param_groups[g]['params'] replaced by another tensor (same
    count): torch would update the new one; refused rather than silently
    updating the old one."""
    m = mlp()
    o = zopt.Optimizer(adamw_f32, m.parameters(), lr=LR)
    train_step(m, o, 0)
    other = torch.nn.Parameter(torch.zeros_like(o.param_groups[0]["params"][0]))
    o.param_groups[0]["params"][0] = other
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[0\]\['params'\] was edited"):
        train_step(m, o, 1)


def test_adamw_default_weight_decay_is_torchs():
    """zopt.steps.adamw() as a drop-in for torch.optim.AdamW: without a
    weight_decay anywhere the step decays by torch's default, 0.01 (it used
    to be 0: no decay, silently)."""
    step = zopt.steps.adamw()
    assert step.hypers["weight_decay"][0] == pytest.approx(0.01)
    m1, m2 = mlp(), mlp()
    o1 = zopt.Optimizer(step, m1.parameters(), lr=LR)
    o2 = torch.optim.AdamW(m2.parameters(), lr=LR)
    assert o1.defaults["weight_decay"] == pytest.approx(o2.defaults["weight_decay"])
    for i in range(3):
        train_step(m1, o1, i)
        train_step(m2, o2, i)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert zopt.steps.adam().hypers["weight_decay"][0] == 0.0   # torch.optim.Adam's

"""Checks of the pieces that need no zopt binaries: the float64 reference
against torch 1.13 in float64 (the contract says 1e-13 relative over 10
steps), the bf16 helpers and the description generator."""
import numpy as np
import pytest
import torch

from zopt import bf16
from zopt.describe import describe
from oracles.reference import Reference, round_to

SIZES = [1, 17, 1000]


def _torch_run(opt_cls, groups_kw, params0, grads, lrs, clip, **kw):
    ps = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params0]
    groups, k = [], 0
    for gkw, n in groups_kw:
        groups.append(dict(params=ps[k:k + n], **gkw))
        k += n
    opt = opt_cls(groups, **kw)
    for s, gl in enumerate(grads):
        for p, g in zip(ps, gl):
            p.grad = torch.tensor(g, dtype=torch.float64)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        for gi, g in enumerate(opt.param_groups):
            g["lr"] = lrs[s][gi]
        opt.step()
    return [p.detach().numpy() for p in ps], opt


def _data(seed, steps=10):
    rng = np.random.default_rng(seed)
    params0 = [rng.standard_normal(n) + 0.5 for n in SIZES]
    grads = [[rng.standard_normal(n) * (1.0 if s % 2 else 0.05) for n in SIZES]
             for s in range(steps)]
    return params0, grads


@pytest.mark.parametrize("rule", ["adam", "adamw"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("clip", [None, 5.0])
def test_reference_adam_matches_torch_f64(rule, amsgrad, clip):
    params0, grads = _data(1)
    hyp = [dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
           dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)]
    lrs = [[0.01 * (1 + 0.3 * s), 0.02 / (1 + s)] for s in range(10)]
    cls = torch.optim.Adam if rule == "adam" else torch.optim.AdamW
    tp, _ = _torch_run(cls, [(dict(hyp[0]), 2), (dict(hyp[1]), 1)], params0, grads,
                       lrs, clip, amsgrad=amsgrad, foreach=False)
    ref = Reference(rule, [dict(params=params0[:2], **hyp[0]),
                           dict(params=params0[2:], **hyp[1])],
                    amsgrad=amsgrad, clip=clip, round_storage=False)
    clipped = []
    for s, gl in enumerate(grads):
        ref.groups[0]["lr"], ref.groups[1]["lr"] = lrs[s]
        _, _, c = ref.step(gl)
        clipped.append(c < 1)
    if clip is not None:
        assert any(clipped) and not all(clipped)
    for i in range(3):
        np.testing.assert_allclose(ref.param(i), tp[i], rtol=1e-13, atol=0)


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (False, 0.3), (True, 0.0)])
def test_reference_sgd_matches_torch_f64(nesterov, dampening):
    params0, grads = _data(2)
    lrs = [[0.05 + 0.01 * s] for s in range(10)]
    tp, _ = _torch_run(torch.optim.SGD, [(dict(), 3)], params0, grads, lrs, None,
                       lr=0.1, momentum=0.9, dampening=dampening,
                       weight_decay=0.01, nesterov=nesterov, foreach=False)
    ref = Reference("sgd", [dict(params=params0, momentum=0.9, dampening=dampening,
                                 weight_decay=0.01)],
                    nesterov=nesterov, round_storage=False)
    for s, gl in enumerate(grads):
        ref.groups[0]["lr"] = lrs[s][0]
        ref.step(gl)
    for i in range(3):
        np.testing.assert_allclose(ref.param(i), tp[i], rtol=1e-13, atol=1e-15)


def test_reference_lion_by_hand():
    p0 = np.array([1.0, -2.0, 0.5])
    ref = Reference("lion", [dict(params=[p0], lr=0.1, beta1=0.9, beta2=0.99,
                                  weight_decay=0.5)], round_storage=False)
    g1 = np.array([0.3, -0.2, 0.1])
    ref.step([g1])
    p1 = p0 * (1 - 0.05) - 0.1 * np.sign(0.1 * g1)
    np.testing.assert_array_equal(ref.param(0), p1)
    np.testing.assert_allclose(ref.state(0, "exp_avg"), 0.01 * g1, rtol=1e-15)
    g2 = np.array([-0.3, 0.2, -0.1])
    ref.step([g2])
    c = 0.9 * 0.01 * g1 + 0.1 * g2
    np.testing.assert_allclose(ref.param(0), p1 * 0.95 - 0.1 * np.sign(c), rtol=1e-15)


def test_loss_scale_skip_and_backoff_reference():
    p0 = np.array([1.0, 2.0])
    ref = Reference("adamw", [dict(params=[p0], lr=0.1)], layout="f16_loss_scale",
                    loss_scaler=dict(init_scale=1024.0))
    ref.step([np.array([1024.0, -512.0])])
    snap = [dict((k, v.copy()) for k, v in t.items() if k != "group")
            for t in ref.tensors]
    _, skipped, _ = ref.step([np.array([np.inf, 1.0])])
    assert skipped and ref.scaler.scale == 512.0 and ref.groups[0]["step"] == 1
    for t, s in zip(ref.tensors, snap):
        for k, v in s.items():
            np.testing.assert_array_equal(t[k], v)


def test_bf16_helpers():
    x = np.array([1.0, 1.0078125, 1.005859375, 1.00390625, 1.01171875,
                  -3.14159, 0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-40],
                 dtype=np.float32)
    u = bf16.from_f32(x)
    assert u.dtype == np.uint16
    back = bf16.to_f32(u)
    # exact values stay; ties go to even: 1 + 2^-8 -> 1, 1 + 3*2^-8 -> 1 + 2^-6;
    # 1 + 1.5*2^-8 is above the tie -> 1 + 2^-7
    assert back[0] == 1.0 and back[1] == 1.0078125
    assert back[3] == 1.0 and back[4] == 1.015625 and back[2] == 1.0078125
    assert np.isinf(back[8]) and back[8] > 0 and np.isinf(back[9]) and back[9] < 0
    assert np.isinf(back[10])  # 3.4e38 rounds past the largest bf16
    assert np.signbit(back[7]) and back[7] == 0
    nan = bf16.from_f32(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(bf16.to_f32(nan)).all()
    # agrees with torch's bf16 conversion (RNE) on random data
    r = np.random.default_rng(0).standard_normal(100000).astype(np.float32) * 1e3
    t = torch.from_numpy(r).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16.from_f32(r), t)
    # the float64 rounding agrees with torch on f32-representable values
    np.testing.assert_array_equal(round_to(r.astype(np.float64), "bf16"),
                                  bf16.to_f32(t).astype(np.float64))


def test_bf16_round_f64_is_single_rounding():
    # 1 + 2^-8 + 2^-30 is just above a bf16 tie: a single rounding goes up,
    # the f32 detour would tie to even (down).
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -30])
    assert round_to(x, "bf16")[0] == 1 + 2.0 ** -7


def test_describe_matches_examples_structure():
    import os
    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    ex = open(os.path.join(root, "adamw_f32.mlir")).read()
    gen = describe("adamw", layout="f32", name="adamw_f32").replace("%w1", "%p1")

    def body(t):
        return [l.strip() for l in t.splitlines()
                if l.strip() and not l.strip().startswith("//")
                and not l.strip().startswith("zopt.step")]
    assert body(gen) == body(ex)

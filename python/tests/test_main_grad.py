"""f32 gradients of bf16 params (a step with grad="f32": DeepSpeed's bf16
layout with grad_accum_dtype fp32, Megatron-Core's main_grad). torch keeps
p.grad in the param's dtype, so the f32 gradient is p.main_grad: a
framework's (read in place), or the optimizer's own buffer into which it
accumulates p.grad after each backward (hooks) or at accumulate_grads().
The numerics: several bf16 micro-batch gradients summed in f32 give what a
float64 reference gives within f32 rounding, and bf16 accumulation would
fail that check by far."""
import numpy as np
import pytest
import torch

import zopt
from zopt import steps as S

BF, F32 = torch.bfloat16, torch.float32


def bits(t):
    t = t.detach()
    return t.view(torch.int16).clone() if t.dtype == BF else t.clone()


def assert_close(a, r, rtol, what):
    """|a - r| <= rtol * max(|r|, 0.1 max|r|), every element."""
    a = a.detach().double().reshape(-1)
    r = r.detach().double().reshape(-1)
    bound = rtol * torch.maximum(r.abs(), torch.tensor(0.1 * float(r.abs().max())))
    err = (a - r).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{a.numel()} elements off; worst "
                           f"{float((err / bound).max()):.3g} x the bound")


def max_rel(a, r):
    a, r = a.detach().double().reshape(-1), r.detach().double().reshape(-1)
    mx = float(r.abs().max())
    return float(((a - r).abs() / torch.maximum(r.abs(), torch.tensor(0.1 * mx))).max())


def _micro_grads(rng, shape, k):
    """k bf16 micro-batch gradients of widely different magnitudes: their
    sum in bf16 loses most of the small ones."""
    out = []
    for i in range(k):
        scale = 10.0 ** rng.uniform(-3, 0)
        out.append(torch.from_numpy((rng.standard_normal(shape) * scale)
                                    .astype(np.float32)).to(BF))
    return out


@pytest.mark.parametrize("how", ["hooks", "manual", "main_grad"])
def test_f32_gradient_accumulation(steps, how):
    """8 bf16 micro-batch gradients accumulated in f32 (hooks after each
    backward, accumulate_grads() after each, or a framework's p.main_grad):
    the step uses exactly their f32 sum (plain SGD: master -= lr * sum / 8,
    checked against float64 within f32 rounding), which bf16 accumulation
    would miss by far more than the tolerance."""
    st = steps.text(S.sgd.text(param="bf16", grad="f32", master="f32", momentum=0,
                               comments=False))
    assert st.f32_grads
    rng = np.random.default_rng(11)
    shape = (40, 25)
    w0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(BF)
    p = torch.nn.Parameter(w0.clone())
    mg = None
    if how == "main_grad":
        # Megatron-Core: an f32 buffer the framework accumulates into, in its
        # own hook on the param's AccumulateGrad node (registered first)
        p.main_grad = mg = torch.zeros(shape)
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def framework_hook(*_):
            with torch.no_grad():
                mg.add_(p.grad.float())
            p.grad = None
        acc.register_hook(framework_hook)
    opt = zopt.Optimizer(st, [p], lr=0.5, grad_divisor=8,
                         grad_accumulation="manual" if how == "manual" else "hooks")
    gs = _micro_grads(rng, shape, 8)
    f32_sum, bf16_sum = torch.zeros(shape), torch.zeros(shape, dtype=BF)
    for g in gs:
        f32_sum += g.float()
        bf16_sum += g
        # backward through p: d/dp sum(p * g) = g, computed in bf16
        (p * g).sum().backward()
        if how == "manual":
            assert p.grad is not None
            opt.accumulate_grads()
        assert p.grad is None and p.main_grad.dtype == F32
    assert torch.equal(p.main_grad, f32_sum)
    if how == "main_grad":
        assert p.main_grad is mg
    opt.step()
    want = w0.double() - 0.5 * f32_sum.double() / 8
    got = torch.from_numpy(opt.read_state(p, "master")).view(shape).double()
    assert_close(got, want, 1e-6, "master after the f32-accumulated step")
    wrong = w0.double() - 0.5 * bf16_sum.double() / 8
    assert max_rel(wrong, want) > 1e-3 > 100 * 1e-6, "bf16 accumulation must fail this test"
    assert torch.equal(bits(p), bits(got.float().to(BF)))
    # zero_grad: our buffer is dropped (None) or zeroed; a framework's is zeroed, kept
    opt.zero_grad(set_to_none=False)  # (torch 2's default is True)
    assert torch.equal(p.main_grad, torch.zeros(shape))
    opt.zero_grad(set_to_none=True)
    if how == "main_grad":
        assert p.main_grad is mg
    else:
        assert getattr(p, "main_grad", None) is None
        opt.step()   # no gradient: left alone
        assert opt.tensor_step(p) == 1


def test_main_grad_errors_and_foreign_memory(steps):
    st = steps.text(S.sgd.text(param="bf16", grad="f32", master="f32", momentum=0,
                               comments=False))
    p = torch.nn.Parameter(torch.ones(4, 3, dtype=BF))
    opt = zopt.Optimizer(st, [p], lr=1.0, grad_accumulation="manual")
    for bad, needle in ((torch.zeros(4, 3, dtype=BF), "float32"),
                        (torch.zeros(3, 4), r"shape \(3, 4\)"),
                        (torch.zeros(4, 6)[:, ::2], "memory layout")):
        p.main_grad = bad
        with pytest.raises(zopt.ZoptError, match=needle) as e:
            opt.step()
        assert "param_groups[0]['params'][0]" in str(e.value)
        assert opt.tensor_step(p) == 0
    # a user's main_grad is read where it is (no copy): later writes into it count
    mg = torch.zeros(4, 3)
    p.main_grad = mg
    mg.fill_(0.25)
    opt.step()
    assert torch.equal(p.detach().float(), torch.full((4, 3), 0.75))
    mg.fill_(0.5)
    opt.step()
    assert torch.equal(p.detach().float(), torch.full((4, 3), 0.25))
    # numpy pairs: the grad must have the step's gradient dtype
    from zopt import bf16 as B
    a = B.from_f32(np.ones(5, np.float32))
    with pytest.raises(zopt.ZoptError, match="grad dtype bf16.*f32"):
        zopt.Optimizer(st, [(a, B.from_f32(np.ones(5, np.float32)))])
    g = np.full(5, 0.5, np.float32)
    o = zopt.Optimizer(st, [(a, g)], lr=1.0)
    o.step()
    np.testing.assert_array_equal(B.to_f32(a), np.full(5, 0.5, np.float32))


def test_f16_params_with_f32_grads_loss_scaled(steps):
    """fp16 params with f32 gradients (DeepSpeed's fp16 with
    grad_accum_dtype fp32): loss scaling is on by default (the backward
    still computes f16 gradients); the step divides the f32 gradient by the
    scale, and an Inf in it skips the step and halves the scale."""
    st = steps.text(S.sgd.text(param="f16", grad="f32", master="f32", momentum=0,
                               comments=False))
    assert st.f32_grads and st.loss_scaled
    rng = np.random.default_rng(5)
    w0 = torch.from_numpy(rng.standard_normal(300).astype(np.float32)).half()
    p = torch.nn.Parameter(w0.clone())
    opt = zopt.Optimizer(st, [p], lr=0.25, loss_scaler=dict(init_scale=1024.0))
    g = torch.from_numpy(rng.standard_normal(300).astype(np.float32))
    for k in range(3):  # three micro-batches of f16 gradients, scaled by S
        (p * (g * opt.loss_scale / 3).half()).sum().backward()
    want = w0.double() - 0.25 * p.main_grad.double() / 1024.0
    opt.step()
    assert not opt.last_skipped
    assert_close(torch.from_numpy(opt.read_state(p, "master")).double(), want, 1e-6, "master")
    assert torch.equal(p.detach(), torch.from_numpy(opt.read_state(p, "master")).half())
    before = p.detach().clone()
    opt.zero_grad()
    (p * torch.full((300,), float("inf"), dtype=torch.half)).sum().backward()
    opt.step()
    assert opt.last_skipped and opt.loss_scale == 512.0
    assert torch.equal(p.detach(), before) and opt.tensor_step(p) == 1

"""SGD (momentum, dampening, nesterov, plain) and Lion against the float64
reference, SGD also against torch.optim.SGD (f32, foreach=False). Same
tolerances as test_adam_parity."""
import zlib

import numpy as np
import pytest
import torch

import zopt
from oracles.reference import Reference
from zopt_testutil import (Problem, StateChecker, check_f32, check_param,
                           from_storage)

STEPS = 10
SIZES = [[1, 17, 1000], [33]]
GRAD_SCALES = [1.0, 0.03, 0.5, 0.02, 1.0, 0.05, 0.3, 0.01, 1.0, 0.04]


def run_pair(step, rule, groups_hyp, layout, base_lr, seed, ref_kw, state_kinds,
             clip=None, torch_opt=None):
    prob = Problem(seed, layout, SIZES, ref_kw.get("state_dtype"))
    scaler = dict(init_scale=1024.0) if prob.loss_scaled else None
    opt = zopt.Optimizer(step, [dict(params=gp, lr=base_lr[i], **groups_hyp[i])
                                for i, gp in enumerate(prob.group_params())],
                         loss_scaler=scaler)
    p64 = prob.params64()
    ref = Reference(rule, [dict(params=[p64[i] for i, g in enumerate(prob.group_of)
                                        if g == gi], lr=base_lr[gi], **groups_hyp[gi])
                           for gi in range(len(SIZES))],
                    layout=layout, clip=clip, loss_scaler=scaler, **ref_kw)
    tparams = topt = None
    if torch_opt is not None:
        tparams = [torch.tensor(p.copy(), requires_grad=True) for p in prob.params]
        topt = torch_opt([dict(params=[tparams[i] for i, g in enumerate(prob.group_of)
                                       if g == gi], lr=base_lr[gi], **groups_hyp[gi])
                          for gi in range(len(SIZES))])
    clipped = []
    states_chk = StateChecker()
    n_amb = 0
    for s in range(STEPS):
        S = opt.loss_scale if prob.loss_scaled else 1.0
        g64 = prob.set_grads(GRAD_SCALES[s], loss_scale=S)
        for gi in range(len(SIZES)):
            lr = base_lr[gi] * (1 + 0.4 * np.cos(s))
            opt.param_groups[gi]["lr"] = lr
            ref.groups[gi]["lr"] = lr
        opt.step()
        _, _, coef = ref.step(g64)
        clipped.append(coef < 1)
        for i in range(len(prob.params)):
            tag = f"step {s} tensor {i}"
            pv = from_storage(prob.params[i], prob.pg)
            ok = ~ref.ambiguous(i)  # Lion: elements whose sign(c) was a tie
            n_amb += int((~ok).sum())
            check_param(pv[ok], ref.param(i)[ok], prob.pg, f"{tag} param")
            for k in state_kinds:
                dt = prob.wt if k == "master" else prob.st
                if k == "master":
                    check_param(opt.read_state(i, k)[ok], ref.state(i, k)[ok], dt,
                                f"{tag} {k}")
                else:
                    states_chk.check((i, k), opt.read_state(i, k), ref.state(i, k), dt,
                                     f"{tag} {k}")
        if topt is not None:
            for tp, g in zip(tparams, prob.grads):
                tp.grad = torch.from_numpy(g.copy())
            for gi in range(len(SIZES)):
                topt.param_groups[gi]["lr"] = opt.param_groups[gi]["lr"]
            topt.step()
            for i, tp in enumerate(tparams):
                check_param(prob.params[i], tp.detach().numpy(), "f32",
                            f"step {s} tensor {i} param vs torch")
                if "momentum_buffer" in state_kinds:
                    states_chk.check((i, "torch"), opt.read_state(i, "momentum_buffer"),
                                     topt.state[tp]["momentum_buffer"].numpy(), "f32",
                                     f"step {s} tensor {i} momentum_buffer vs torch")
    if clip is not None:
        assert any(clipped) and not all(clipped)
    assert n_amb <= 0.01 * STEPS * sum(map(sum, SIZES)), "too many ambiguous signs"
    return opt, ref


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (False, 0.25),
                                                (True, 0.0)],
                         ids=["momentum", "dampening", "nesterov"])
def test_sgd_f32_vs_reference_and_torch(steps, nesterov, dampening):
    step = steps(rule="sgd", nesterov=nesterov, layout="f32")
    hyp = [dict(momentum=0.9, dampening=dampening, weight_decay=0.01),
           dict(momentum=0.5, dampening=dampening, weight_decay=0.0)]
    run_pair(step, "sgd", hyp, "f32", [0.05, 0.1],
             zlib.crc32(repr(("sgd", nesterov, dampening)).encode()),
             dict(nesterov=nesterov), ["momentum_buffer"],
             torch_opt=lambda g: torch.optim.SGD(g, lr=0.1, nesterov=nesterov, momentum=0.9, dampening=dampening,
                                                 foreach=False))


def test_sgd_plain_f32(steps):
    step = steps(rule="sgd", momentum=False, layout="f32")
    hyp = [dict(weight_decay=0.01), dict(weight_decay=0.1)]
    run_pair(step, "sgd", hyp, "f32", [0.05, 0.1], 7, dict(momentum_buffer=False),
             [], torch_opt=lambda g: torch.optim.SGD(g, lr=0.1, foreach=False))


@pytest.mark.parametrize("layout", ["bf16_master", "bf16"])
def test_sgd_momentum_low_precision(steps, layout):
    step = steps(rule="sgd", nesterov=True, layout=layout, clip=5.0)
    hyp = [dict(momentum=0.9, dampening=0.0, weight_decay=0.01),
           dict(momentum=0.5, dampening=0.0, weight_decay=0.0)]
    kinds = ["momentum_buffer"] + (["master"] if layout == "bf16_master" else [])
    run_pair(step, "sgd", hyp, layout, [0.05, 0.1], 11, dict(nesterov=True), kinds,
             clip=5.0)


@pytest.mark.parametrize("layout,state_dtype,clip",
                         [("f32", None, None), ("f32", None, 5.0),
                          ("bf16_master", "bf16", None),  # examples/lion_bf16.mlir
                          ("bf16", None, 5.0)])
def test_lion(steps, layout, state_dtype, clip):
    step = steps(rule="lion", layout=layout, state_dtype=state_dtype, clip=clip)
    hyp = [dict(betas=(0.9, 0.99), weight_decay=0.1),
           dict(betas=(0.95, 0.98), weight_decay=0.0)]
    kinds = ["exp_avg"] + (["master"] if layout == "bf16_master" else [])
    run_pair(step, "lion", hyp, layout, [0.01, 0.02],
             zlib.crc32(repr(("lion", layout, state_dtype, clip)).encode()),
             dict(state_dtype=state_dtype), kinds, clip=clip)


def test_sgd_momentum_zero_is_plain_sgd(steps):
    """A momentum step run with momentum = 0 behaves like torch.optim.SGD
    with momentum = 0: no buffer, dampening ignored."""
    step = steps(rule="sgd", nesterov=False, layout="f32")
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(37).astype(np.float32)
    p, g = p0.copy(), np.zeros_like(p0)
    opt = zopt.Optimizer(step, [dict(params=[(p, g)], lr=0.1, momentum=0.0,
                                     dampening=0.25, weight_decay=0.0)])
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = torch.optim.SGD([tp], lr=0.1, momentum=0.0, dampening=0.25, foreach=False)
    for _ in range(3):
        gs = rng.standard_normal(37).astype(np.float32)
        g[:] = gs
        opt.step()
        tp.grad = torch.from_numpy(gs.copy())
        topt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7)

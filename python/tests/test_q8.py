"""q8 moments through the binding (docs/NUMERICS.md §10, abi.h "q8 moments").

zopt.steps.adamw(moments="q8") keeps exp_avg and exp_avg_sq block-quantized
(one code per element, one f32 absmax per 256). On a bf16 model with a
remainder master, against torch.optim.AdamW on the same f32 masters and
gradients over several steps, every element: the raw codes decoded with
the maps of NUMERICS §10 (built here in float64, as the reference does)
times their block's absmax are the state_dict's f32 moments bit for bit;
those are torch's moments within the quantization error of their block
(and v never decodes to 0); the params follow torch's within that error's
effect on the update. state_dict() and opt.state[p] show torch's keys and
shapes (f32 moments, no absmax); load_state_dict() encodes the f32 moments
by the runtime's rule (as assigning opt.state[p][key] does: the same codes
and absmax), close to the values. save()/load() resume bit for bit;
add_param_group after steps works (the runtime adds the tensors). The
builder refuses q8 where it is not offered.
"""
import copy

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import StateKind, Status, ZoptError

LR, WD = 1e-2, 0.01


def q8_map(signed):
    """bitsandbytes' create_dynamic_map(signed, 7, 8) in float64, rounded to
    f32 (NUMERICS §10 "The maps")."""
    out = []
    for i in range(7):
        f = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        step = 0.9 / (f - 1)
        b = [0.1 + k * step if k < f // 2 else 1.0 - (f - 1 - k) * step for k in range(f)]
        for k in range(f - 1):
            m = (b[k] + b[k + 1]) / 2.0
            out.append([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0][i] * m)
            if signed:
                out.append(-([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0][i] * m))
    out += [0.0, 1.0]
    return np.array(sorted(out), dtype=np.float64).astype(np.float32)


@pytest.fixture(scope="module")
def q8_step(zopt_bins):
    return zopt.steps.adamw(param="bf16", master="remainder", moments="q8")


def test_q8_steps_state_dict_and_refusals(q8_step, tmp_path):
    assert q8_step.state_dtype(StateKind.EXP_AVG) == zopt._lib.DType.Q8
    assert q8_step.state_dtype(StateKind.EXP_AVG_SQ_ABSMAX) == zopt._lib.DType.F32
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Linear(7, 1000)).to(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_(True) for p in m.parameters()]
    opt = zopt.Optimizer(q8_step, m.parameters(), lr=LR, weight_decay=WD)
    topt = torch.optim.AdamW(ref, lr=LR, weight_decay=WD)
    for k in range(3):
        torch.manual_seed(10 + k)
        for p, r in zip(m.parameters(), ref):
            g = (torch.rand_like(p, dtype=torch.float32) * 2 - 1 + 0.5 * torch.sign(
                torch.rand_like(p, dtype=torch.float32) - 0.5)).mul(1e-3).to(torch.bfloat16)
            p.grad = g
            r.grad = g.float()
        opt.step()
        topt.step()
    sd = opt.state_dict()
    signed, unsigned = q8_map(True), q8_map(False)
    for i, (p, r) in enumerate(zip(m.parameters(), ref)):
        st = sd["state"][i]
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "master", "step"]
        n = p.numel()
        nb = -(-n // 256)
        ts = topt.state[r]
        for key, kind, akind, mp in (("exp_avg", StateKind.EXP_AVG, StateKind.EXP_AVG_ABSMAX, signed),
                                     ("exp_avg_sq", StateKind.EXP_AVG_SQ,
                                      StateKind.EXP_AVG_SQ_ABSMAX, unsigned)):
            x = st[key]
            assert x.dtype == torch.float32 and x.shape == p.shape
            codes = opt.read_state_raw(i, kind)
            absmax = opt.read_state_raw(i, akind)
            assert codes.dtype == np.uint8 and codes.size == n and absmax.size == nb
            dec = mp[codes] * np.repeat(absmax, 256)[:n]
            assert np.array_equal(dec.view(np.uint32), x.numpy().reshape(-1).view(np.uint32))
            want = ts[key].detach().reshape(-1).numpy().astype(np.float64)
            blk = np.repeat(np.maximum.reduceat(np.abs(want), np.arange(0, n, 256)), 256)[:n]
            assert np.all(np.abs(dec - want) <= 0.03 * blk), key
            if key == "exp_avg_sq":
                assert np.all(dec > 0)  # the zero point: a nonzero v never decodes to 0
        # the update uses the unquantized moments; the error of the stored
        # ones moves the param by a small part of lr per step
        got = p.detach().float().reshape(-1)
        want = r.detach().reshape(-1)
        assert torch.all((got - want).abs() <= 2 ** -8 * want.abs() + 0.3 * LR * 3)
    # opt.state[p] shows the moments decoded (no absmax)
    w = next(m.parameters())
    assert sorted(opt.state[w]) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(opt.state[w]["exp_avg"], sd["state"][0]["exp_avg"])
    # load_state_dict encodes torch's f32 moments (the runtime's rule, as
    # opt.state[p][key] = value does): close to the values, every element
    m3 = copy.deepcopy(m)
    opt3 = zopt.Optimizer(q8_step, m3.parameters(), lr=LR, weight_decay=WD)
    opt3.load_state_dict(sd)
    m4 = copy.deepcopy(m)
    opt4 = zopt.Optimizer(q8_step, m4.parameters(), lr=LR, weight_decay=WD)
    for p in m4.parameters():
        p.grad = torch.zeros_like(p)
    opt4.step()  # (states exist after a first step)
    for i, p in enumerate(m4.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            opt4.state[p][key] = sd["state"][i][key]
    for i, p in enumerate(m3.parameters()):
        for key, kind, akind in (("exp_avg", StateKind.EXP_AVG, StateKind.EXP_AVG_ABSMAX),
                                 ("exp_avg_sq", StateKind.EXP_AVG_SQ, StateKind.EXP_AVG_SQ_ABSMAX)):
            for k in (kind, akind):
                assert np.array_equal(opt3.read_state_raw(i, k), opt4.read_state_raw(i, k))
            want = sd["state"][i][key].reshape(-1).double()
            got = opt3.state[p][key].reshape(-1).double()
            n = want.numel()
            blk = torch.from_numpy(np.repeat(np.maximum.reduceat(
                np.abs(want.numpy()), np.arange(0, n, 256)), 256)[:n])
            assert torch.all((got - want).abs() <= 0.01 * blk)
        assert int(opt3.state[p]["step"]) == 3
    # opt.save()/opt.load(): the runtime's checkpoint, codes and absmax as
    # they are: a second optimizer resumes bit for bit
    path = str(tmp_path / "q8.ckpt")
    opt.save(path)
    m2 = copy.deepcopy(m)
    opt2 = zopt.Optimizer(q8_step, m2.parameters(), lr=LR, weight_decay=WD)
    opt2.load(path)
    for k in range(2):
        torch.manual_seed(50 + k)
        for p, p2 in zip(m.parameters(), m2.parameters()):
            p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(torch.bfloat16)
            p2.grad = p.grad.clone()
        opt.step()
        opt2.step()
    for i, (p, p2) in enumerate(zip(m.parameters(), m2.parameters())):
        assert torch.equal(p, p2)
        for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.EXP_AVG_ABSMAX,
                     StateKind.EXP_AVG_SQ_ABSMAX, StateKind.MASTER):
            assert np.array_equal(opt.read_state_raw(i, kind), opt2.read_state_raw(i, kind))
    # a new param group after steps: the old codes and absmax kept
    before = [opt.read_state_raw(i, StateKind.EXP_AVG) for i in range(4)]
    extra = torch.nn.Parameter(torch.ones(300, dtype=torch.bfloat16))
    opt.add_param_group({"params": [extra]})
    for i in range(4):
        assert np.array_equal(opt.read_state_raw(i, StateKind.EXP_AVG), before[i])
    extra.grad = torch.full_like(extra, 1e-3)
    for p in m.parameters():
        p.grad = None
    opt.step()
    assert not torch.equal(extra, torch.ones_like(extra))
    for bad in (dict(amsgrad=True), dict(placement="gpu")):
        with pytest.raises(ZoptError, match="q8"):
            zopt.steps.adamw(param="bf16", moments="q8", **bad)
    # offloaded (issue 19's cell: param/grad on the GPU, a bf16 SR master and
    # the q8 moments on the CPU) the step builds and loads (its runs on the
    # stand-in driver: test/Integration/GPUHost/offload.test)
    off = zopt.steps.adamw(param="bf16", master="bf16", moments="q8", placement="offload",
                           rounding="stochastic", clip=1.0)
    assert off.offloaded and off.state_dtype(StateKind.EXP_AVG_SQ) == zopt._lib.DType.Q8
    with pytest.raises(ZoptError, match="q8"):
        zopt.steps.sgd(param="bf16", moments="q8", momentum=0.9)


def test_q8_on_the_gpu_behind_its_gate(monkeypatch):
    """q8 moments placed on the GPU: refused naming ZOPT_EXPERIMENTAL_GPU_Q8
    until a GPU has checked the kernels (docs/GPU.md "q8 moments on the
    GPU"); with the variable set to 1 the builder writes the description
    (every state on the GPU, the moments q8). The runtime side:
    test/Integration/GPUHost/q8-ptx.test."""
    kw = dict(param="bf16", master="remainder", moments="q8", placement="gpu", clip=1.0)
    for value in (None, "0", "yes"):
        if value is None:
            monkeypatch.delenv("ZOPT_EXPERIMENTAL_GPU_Q8", raising=False)
        else:
            monkeypatch.setenv("ZOPT_EXPERIMENTAL_GPU_Q8", value)
        with pytest.raises(ZoptError, match="ZOPT_EXPERIMENTAL_GPU_Q8=1") as e:
            zopt.steps.adamw.text(**kw)
        assert e.value.code == Status.INVALID_ARGUMENT and "moments" in str(e.value)
    monkeypatch.setenv("ZOPT_EXPERIMENTAL_GPU_Q8", "1")
    text = zopt.steps.adamw.text(**kw)
    assert "exp_avg : f32 on gpu q8" in text and "exp_avg_sq : f32 on gpu q8" in text
    assert "param : bf16 on gpu" in text and "on cpu" not in text

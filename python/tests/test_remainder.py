"""Remainder masters (docs/NUMERICS.md §9, abi.h "Remainder masters").

examples/adamw_bf16_remainder.mlir keeps the f32 master as the int16 low
half beside the bf16 param. Against its twin (the same step with a plain f32
master), on a bf16 model over several steps, every element, bit for bit:
the rebuilt master (zopt_optimizer_read_state_f32) equals the twin's f32
master, the param equals that master rounded to nearest with ties away, the
moments equal the twin's; the same for zopt.steps.adamw(master="remainder")
against master="f32". save()/load() resumes bit for bit. torch's
state_dict layout holds the whole f32 master (joined by the runtime), and
loading one splits it (the params become its high halves).
"""
import copy
import os

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import StateKind

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = open(os.path.join(REPO, "examples", "adamw_bf16_remainder.mlir")).read()
TWIN = SRC.replace(" on cpu remainder", " on cpu").replace("@adamw_bf16_remainder ", "@twin ")


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 33).to(torch.bfloat16)


def train(m, opt, steps, first=0):
    for i in range(first, first + steps):
        torch.manual_seed(100 + i)
        x = torch.randn(8, 64).to(torch.bfloat16)
        opt.zero_grad()
        m(x).float().square().mean().backward()
        opt.step()


def bits16(t):
    return t.detach().contiguous().view(torch.int16).numpy().astype(np.uint16).ravel()


def nearest_away(master):
    """§9's param of an f32 master (finite values)."""
    b = master.view(np.uint32)
    return ((b >> 16) + ((b >> 15) & 1)).astype(np.uint16)


# the example and its twin; zopt.steps' master="remainder" and master="f32"
SOURCES = {"example": (SRC, TWIN),
           "builder": (zopt.steps.adamw.text(param="bf16", master="remainder", clip=1.0),
                       zopt.steps.adamw.text(param="bf16", master="f32", clip=1.0))}


@pytest.mark.parametrize("source", list(SOURCES))
def test_remainder_equals_f32_master_twin(steps, source):
    src, twin = SOURCES[source]
    assert " on cpu remainder" in src and " on cpu remainder" not in twin
    ma, mb = model(), model()
    oa = zopt.Optimizer(steps.text(src), ma.parameters(), lr=1e-2, weight_decay=0.1)
    ob = zopt.Optimizer(steps.text(twin), mb.parameters(), lr=1e-2, weight_decay=0.1)
    ca = oa._parts[0]
    ties = 0
    for s in range(5):
        train(ma, oa, 1, s)
        train(mb, ob, 1, s)
        sb = ob.state_dict()["state"]
        for t, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
            want = sb[t]["master"].numpy().ravel()
            got = ca.read_f32(t, StateKind.MASTER)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            np.testing.assert_array_equal(bits16(pa), nearest_away(want))
            ties += int((bits16(pa) != bits16(pb)).sum())  # the twin's param is RNE
            for k, kind in (("exp_avg", StateKind.EXP_AVG), ("exp_avg_sq", StateKind.EXP_AVG_SQ)):
                np.testing.assert_array_equal(ca.read_f32(t, kind).view(np.uint32),
                                              sb[t][k].numpy().ravel().view(np.uint32))
    assert ties <= 2  # ties are one low half in 65,536


def test_remainder_save_load_resumes(steps, tmp_path):
    ma = model()
    oa = zopt.Optimizer(steps.text(SRC), ma.parameters(), lr=1e-2)
    train(ma, oa, 2)
    oa.save(tmp_path / "ck")
    saved = [p.detach().clone() for p in ma.parameters()]
    train(ma, oa, 2, 2)
    mb = model(seed=1)
    with torch.no_grad():
        for p, q in zip(mb.parameters(), saved):
            p.copy_(q)
    ob = zopt.Optimizer(steps.text(SRC), mb.parameters(), lr=1e-2)
    ob.load(tmp_path / "ck")
    train(mb, ob, 2, 2)
    for t, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
        np.testing.assert_array_equal(bits16(pa), bits16(pb))
        np.testing.assert_array_equal(oa._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32),
                                      ob._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32))


def _master_bits(sd, t):
    return sd["state"][t]["master"].detach().float().contiguous().numpy().ravel().view(np.uint32)


@pytest.mark.parametrize("zero", [0, 3])
def test_remainder_state_dict_round_trip(steps, zero):
    """torch's layout holds a remainder step's whole f32 master (the
    runtime's join of the param and the remainder): bit for bit the
    f32-master twin's, and the moments too. Loaded into a remainder
    optimizer over a model with other weights, the runtime's split sets
    every param to the master's high half (a MasterWeightsWarning counts
    them) and the two optimizers then train bit for bit alike; loaded
    into the f32-master twin, its master is the same bits."""
    src = SRC.replace("zero_stage = 0", f"zero_stage = {zero}")
    twin = TWIN.replace("zero_stage = 0", f"zero_stage = {zero}")
    ma, mb = model(), model()
    oa = zopt.Optimizer(steps.text(src), ma.parameters(), lr=1e-2, weight_decay=0.1)
    ob = zopt.Optimizer(steps.text(twin), mb.parameters(), lr=1e-2, weight_decay=0.1)
    train(ma, oa, 3)
    train(mb, ob, 3)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sorted(sa["state"][0]) == ["exp_avg", "exp_avg_sq", "master", "step"]
    for t in range(2):
        assert sa["state"][t]["master"].dtype == torch.float32
        np.testing.assert_array_equal(_master_bits(sa, t), _master_bits(sb, t))
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(sa["state"][t][k].numpy().view(np.uint32),
                                          sb["state"][t][k].numpy().view(np.uint32))
    # into a remainder optimizer whose model holds other weights
    mc = model(seed=5)
    oc = zopt.Optimizer(steps.text(src), mc.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning, match="in 2 of 2 params"):
        oc.load_state_dict(copy.deepcopy(sa))
    for pa, pc in zip(ma.parameters(), mc.parameters()):
        np.testing.assert_array_equal(bits16(pc), bits16(pa))
    train(ma, oa, 2, 3)
    train(mc, oc, 2, 3)
    for t, (pa, pc) in enumerate(zip(ma.parameters(), mc.parameters())):
        np.testing.assert_array_equal(bits16(pc), bits16(pa))
        np.testing.assert_array_equal(oc._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32),
                                      oa._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32))
    # the twin's f32 master into a remainder optimizer: the same master bits
    md = model(seed=6)
    od = zopt.Optimizer(steps.text(src), md.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning):
        od.load_state_dict(copy.deepcopy(sb))
    for t, p in enumerate(md.parameters()):
        want = _master_bits(sb, t)
        np.testing.assert_array_equal(od._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32), want)
        np.testing.assert_array_equal(bits16(p), nearest_away(want.view(np.float32)))


def test_remainder_state_dict_refused_load_changes_nothing(steps):
    """A state_dict the load refuses (a master of the wrong shape) leaves
    the params, masters and moments as they were."""
    m = model()
    opt = zopt.Optimizer(steps.text(SRC), m.parameters(), lr=1e-2)
    train(m, opt, 1)
    sd = opt.state_dict()
    train(m, opt, 1, 1)
    before = [bits16(p).copy() for p in m.parameters()]
    masters = [opt._parts[0].read_f32(t, StateKind.MASTER).copy() for t in range(2)]
    sd["state"][1]["master"] = torch.zeros(5)
    with pytest.raises(zopt.ZoptError, match="master"):
        opt.load_state_dict(sd)
    for t, (p, b) in enumerate(zip(m.parameters(), before)):
        np.testing.assert_array_equal(bits16(p), b)
        np.testing.assert_array_equal(opt._parts[0].read_f32(t, StateKind.MASTER).view(np.uint32),
                                      masters[t].view(np.uint32))


def test_remainder_state_view_hides_the_master(steps):
    """state[p] shows no 'master' (it is the param plus an int16
    remainder, no tensor of its own): reading it is a KeyError, writing
    it refused, the moments are there as usual."""
    m = model()
    opt = zopt.Optimizer(steps.text(SRC), m.parameters(), lr=1e-2)
    train(m, opt, 1)
    st = opt.state[m.weight]
    assert sorted(st.keys()) == ["exp_avg", "exp_avg_sq", "step"]
    with pytest.raises(KeyError):
        st["master"]
    before = opt._parts[0].read_f32(0, StateKind.MASTER).copy()
    with pytest.raises(zopt.ZoptError, match="has no state 'master'"):
        st["master"] = torch.zeros_like(m.weight, dtype=torch.float32)
    np.testing.assert_array_equal(opt._parts[0].read_f32(0, StateKind.MASTER).view(np.uint32),
                                  before.view(np.uint32))


def test_remainder_zero3_param_replaced(steps):
    """ZeRO-3: a param given new storage after a step makes its master
    again from it (the remainder 0), as for an f32 master."""
    src = SRC.replace("zero_stage = 0", "zero_stage = 3").replace("@adamw_bf16_remainder ", "@rz3 ")
    m = model()
    opt = zopt.Optimizer(steps.text(src), m.parameters(), lr=0.0, weight_decay=0.0)
    train(m, opt, 1)
    torch.manual_seed(7)
    new = torch.randn(33, 64).to(torch.bfloat16)
    m.weight.data = new.clone()
    train(m, opt, 1, 1)  # lr 0: the master stays what it was made from
    assert torch.equal(m.weight.detach(), new)
    np.testing.assert_array_equal(opt._parts[0].read_f32(0, StateKind.MASTER),
                                  new.float().numpy().ravel())


@pytest.mark.parametrize("kw, says", [
    (dict(param="f32"), "param='bf16'"),
    (dict(param="bf16", placement="offload"), "one placement"),
    (dict(param="bf16", rounding="stochastic"), "stochastically rounded param"),
])
def test_builder_remainder_refusals(kw, says):
    """zopt.steps' master="remainder" refuses what the verifier would, naming
    the builder argument: a non-bf16 param, param and master apart, a
    stochastically rounded param."""
    with pytest.raises(zopt.ZoptError, match=says):
        zopt.steps.adamw.text(master="remainder", **kw)

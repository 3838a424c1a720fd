"""Kahan-compensated bf16 params (docs/NUMERICS.md §11, abi.h
"Kahan-compensated params").

examples/adamw_bf16_kahan.mlir and zopt.steps.adamw(master="kahan") keep a
bf16 compensation beside each bf16 param. On a bf16 model over several
steps, every element, bit for bit:
  * the stored param and compensation are abi.h's store (mirrored here in
    numpy float32) of the f32 value the same rule computes for an f32 model
    holding the same weights, moments and gradients (the runtime's f32
    step: the rule's v is its new param);
  * the builder's step and the example train alike;
  * save()/load() and state_dict()/load_state_dict() resume bit for bit
    ("kahan_comp", optimi's key); a torch AdamW state_dict, which has no
    compensation, is refused unless allow_rule_change (then it starts at 0).
The builder's refusals name the argument.
"""
import os

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import StateKind

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = open(os.path.join(REPO, "examples", "adamw_bf16_kahan.mlir")).read()
BUILT = zopt.steps.adamw.text(param="bf16", master="kahan", clip=1.0)
F32 = zopt.steps.adamw.text(param="f32", clip=1.0)
HYP = dict(lr=1e-2, weight_decay=0.1)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 33).to(torch.bfloat16)


def grads(m, i):
    torch.manual_seed(100 + i)
    x = torch.randn(8, 64).to(torch.bfloat16)
    m.zero_grad()
    m(x).float().square().mean().backward()


def train(m, opt, steps, first=0):
    for i in range(first, first + steps):
        grads(m, i)
        opt.step()


def bits16(t):
    return t.detach().contiguous().view(torch.int16).numpy().astype(np.uint16).ravel()


def comp_bits(opt, t):
    return opt._parts[0].read_raw(t, StateKind.KAHAN_COMP).view(np.uint16).ravel()


def f32_of_bf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def bf16_rne(x):
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def kahan_store(p, c, v):
    """abi.h zopt_kahan_store, in numpy float32 (finite values)."""
    pf = f32_of_bf16(p)
    y = (v - pf) + f32_of_bf16(c)
    np_ = bf16_rne(pf + y)
    return np_, bf16_rne(y - (f32_of_bf16(np_) - pf))


@pytest.mark.parametrize("source", ["example", "builder"])
def test_kahan_store_of_the_rules_f32_value(steps, source):
    """Each step, an f32 model is given the Kahan model's weights and
    gradients (exact in f32); its new params are the rule's f32 values v
    (the moments need no copy: AdamW's do not depend on the weights), and
    the Kahan step's param and compensation are abi.h's store of v."""
    src = SRC if source == "example" else BUILT
    assert " kahan" in src
    mk = model()
    mf = model().float()
    ok = zopt.Optimizer(steps.text(src), mk.parameters(), **HYP)
    of = zopt.Optimizer(steps.text(F32), mf.parameters(), **HYP)
    moved = nonzero = 0
    for s in range(6):
        grads(mk, s)
        before = [(bits16(p), comp_bits(ok, t)) for t, p in enumerate(mk.parameters())]
        with torch.no_grad():
            for pk, pf in zip(mk.parameters(), mf.parameters()):
                pf.copy_(pk.float())
                pf.grad = pk.grad.float()
        ok.step()
        of.step()
        for t, (pk, pf) in enumerate(zip(mk.parameters(), mf.parameters())):
            p, c = before[t]
            v = pf.detach().numpy().ravel().astype(np.float32)
            want_p, want_c = kahan_store(p, c, v)
            np.testing.assert_array_equal(bits16(pk), want_p)
            np.testing.assert_array_equal(comp_bits(ok, t), want_c)
            moved += int((want_p != bf16_rne(v)).sum())  # the compensation decided the param
            nonzero += int((want_c & 0x7FFF != 0).sum())
    assert nonzero > 1000 and moved > 10  # the data exercised the compensation


def test_builder_equals_example(steps):
    ma, mb = model(), model()
    oa = zopt.Optimizer(steps.text(SRC), ma.parameters(), **HYP)
    ob = zopt.Optimizer(steps.text(BUILT), mb.parameters(), **HYP)
    train(ma, oa, 4)
    train(mb, ob, 4)
    for t, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
        np.testing.assert_array_equal(bits16(pa), bits16(pb))
        np.testing.assert_array_equal(comp_bits(oa, t), comp_bits(ob, t))
        for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
            np.testing.assert_array_equal(oa._parts[0].read_f32(t, kind).view(np.uint32),
                                          ob._parts[0].read_f32(t, kind).view(np.uint32))


def _resumed(steps, save, load):
    ma = model()
    oa = zopt.Optimizer(steps.text(SRC), ma.parameters(), **HYP)
    train(ma, oa, 2)
    saved_p = [p.detach().clone() for p in ma.parameters()]
    state = save(oa)
    train(ma, oa, 3, 2)
    mb = model(seed=1)
    with torch.no_grad():
        for p, q in zip(mb.parameters(), saved_p):
            p.copy_(q)
    ob = zopt.Optimizer(steps.text(SRC), mb.parameters(), **HYP)
    load(ob, state)
    train(mb, ob, 3, 2)
    for t, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
        np.testing.assert_array_equal(bits16(pa), bits16(pb))
        np.testing.assert_array_equal(comp_bits(oa, t), comp_bits(ob, t))


def test_save_load_resumes(steps, tmp_path):
    def save(o):
        o.save(tmp_path / "ck")
        return tmp_path / "ck"
    _resumed(steps, save, lambda o, path: o.load(path))


def test_state_dict_round_trip(steps):
    def save(o):
        sd = o.state_dict()
        c = sd["state"][0]["kahan_comp"]
        assert c.dtype == torch.bfloat16 and c.shape == (33, 64) and bool((c != 0).any())
        return sd
    _resumed(steps, save, lambda o, sd: o.load_state_dict(sd))


def test_torch_state_dict_without_compensation(steps):
    """torch's AdamW has no compensation: refused (the rule would change)
    with nothing changed; with allow_rule_change it starts at zero."""
    ma = model()
    oa = zopt.Optimizer(steps.text(SRC), ma.parameters(), **HYP)
    train(ma, oa, 2)
    sd = oa.state_dict()
    torch_sd = {"state": {k: {n: x for n, x in v.items() if n != "kahan_comp"}
                          for k, v in sd["state"].items()},
                "param_groups": sd["param_groups"]}
    mb = model()
    ob = zopt.Optimizer(steps.text(SRC), mb.parameters(), **HYP)
    train(mb, ob, 1)
    c0 = comp_bits(ob, 0).copy()
    with pytest.raises(zopt.ZoptError, match="lacks the state 'kahan_comp'"):
        ob.load_state_dict(torch_sd)
    np.testing.assert_array_equal(comp_bits(ob, 0), c0)
    ob.load_state_dict(torch_sd, allow_rule_change=True)
    assert not comp_bits(ob, 0).any()
    np.testing.assert_array_equal(ob._parts[0].read_f32(0, StateKind.EXP_AVG).view(np.uint32),
                                  oa._parts[0].read_f32(0, StateKind.EXP_AVG).view(np.uint32))


@pytest.mark.parametrize("kw, arg, text", [
    (dict(param="f32"), "master", "'kahan' compensates a bf16 param"),
    (dict(param="bf16", rounding={"param": "stochastic"}), "rounding",
     "does not combine with stochastic rounding"),
    (dict(param="bf16", placement="offload"), "master", "puts them apart"),
])
def test_builder_refusals(kw, arg, text):
    with pytest.raises(zopt.ZoptError, match=arg + ": .*" + text):
        zopt.steps.adamw.text(master="kahan", **kw)


def test_builder_text():
    assert "zopt.state param : bf16 on cpu kahan" in BUILT
    assert "zopt.state exp_avg : f32 on cpu" in BUILT and "master" not in BUILT.split("{", 1)[1]
    assert "read 14 (g, p+c, m, v), write 12 (p+c, m, v)" in BUILT

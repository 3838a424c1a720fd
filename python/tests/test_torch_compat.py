"""What torch.optim users rely on (issue 16 item 1 and "torch.optim
behaviours users rely on"), each against torch.optim itself on random
data, every element:

* torch's state_dict of every rule loads into zopt and training goes on as
  torch's does (SGD with and without momentum/nesterov, Adam, AdamW,
  amsgrad), whatever torch omits (SGD's 'step'), leaves None
  (momentum_buffer) or stores as a tensor/int/float ('step'); zopt's loads
  back into torch;
* maximize=True per group, with weight decay, switched between steps, in
  state_dict() both ways, for one step and a step per dtype;
* strided (non-dense) params stepped in place, their storages' other
  elements untouched;
* ValueError for invalid hyperparameters, TypeError for a bare tensor;
* no cyclic garbage left by an optimizer.
"""
import copy
import gc

import numpy as np
import pytest
import torch

import zopt

TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def params(seed, shapes=((5, 3), (7,), (2, 3, 4))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def grads(ps, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(p.shape, generator=g) for p in ps]


def set_grads(ps, gs, sign=1.0):
    for p, g in zip(ps, gs):
        p.grad = (g * sign).to(p.dtype)


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    """Every element, tight: a dropped buffer or a wrong step count is off
    by 1e-3 or more here."""
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.detach().float().numpy(), y.detach().float().numpy(),
                                   rtol=rtol, atol=atol)


# ---- torch's state_dict into zopt, and back ---------------------------------------

# name -> (torch rule, torch kwargs, steps() kwargs)
RULES = {
    "sgd_momentum": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
                     dict(rule="sgd")),
    "sgd_nesterov": ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                     dict(rule="sgd", nesterov=True)),
    "sgd_plain": ("sgd", dict(lr=0.1, weight_decay=0.01), dict(rule="sgd", momentum=False)),
    "adam": ("adam", dict(lr=0.01, weight_decay=0.01), dict(rule="adam")),
    "adamw": ("adamw", dict(lr=0.01, weight_decay=0.1), dict(rule="adamw")),
    "amsgrad": ("adam", dict(lr=0.01, amsgrad=True), dict(rule="adam", amsgrad=True)),
}


def _train_torch(rule, kw, n):
    ps = params(0)
    o = TORCH[rule](ps, foreach=False, **kw)
    for s in range(n):
        set_grads(ps, grads(ps, s))
        o.step()
    return ps, o


def _compare_states(oz, pz, ot, pt):
    for p, q in zip(pz, pt):
        for k, v in ot.state[q].items():
            if k == "step" or v is None:
                continue
            assert_same([oz.state[p][k]], [v])


@pytest.mark.parametrize("name", sorted(RULES))
def test_torch_state_dict_loads_and_trains_on(steps, name):
    """torch trains N steps; its state_dict loads into zopt (over a copy of
    the params); both take K more steps on the same random gradients: the
    same params and states, every element. torch's SGD stores no 'step': a
    param with a momentum buffer continues it (the first zopt step used to
    start it over, buf = g, 0.2-0.5 off after one step)."""
    rule, kw, skw = RULES[name]
    pt, ot = _train_torch(rule, kw, 3)
    sd = ot.state_dict()
    pz = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oz = zopt.Optimizer(steps(**skw), pz, lr=1.0)
    oz.load_state_dict(sd)
    assert oz.param_groups[0]["lr"] == kw["lr"]
    _compare_states(oz, pz, ot, pt)
    for s in range(3, 6):
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
        assert_same(pz, pt)
    _compare_states(oz, pz, ot, pt)


@pytest.mark.parametrize("name", sorted(RULES))
def test_zopt_state_dict_loads_into_torch(steps, name):
    """docs/USAGE.md section 7: zopt's state_dict loads into the torch
    optimizer of its rule, which then trains on as zopt does. Nesterov SGD
    too: zopt's groups carry the step's nesterov (torch reads a missing
    key as False), loaded into a torch SGD built without it."""
    rule, kw, skw = RULES[name]
    pz = params(0)
    oz = zopt.Optimizer(steps(**skw), pz, **{k: v for k, v in kw.items()
                                              if k not in ("nesterov", "amsgrad")})
    for s in range(3):
        set_grads(pz, grads(pz, s))
        oz.step()
    pt = [torch.nn.Parameter(p.detach().clone()) for p in pz]
    ot = TORCH[rule](pt, foreach=False, **dict(kw, lr=1.0, **(
        dict(nesterov=False, dampening=0.1) if "nesterov" in kw else {})))
    ot.load_state_dict(oz.state_dict())
    assert ot.param_groups[0]["lr"] == kw["lr"]
    for s in range(3, 6):
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
        assert_same(pz, pt)


@pytest.mark.parametrize("form", ["int", "float", "tensor", "tensor_f64", "numpy"])
def test_step_as_int_float_or_tensor(steps, form):
    """'step' as torch 1.13 and 2.x store it (a 0-d float tensor), or an
    int, a float, a numpy scalar: the same count, the same training."""
    rule, kw, skw = RULES["adamw"]
    pt, ot = _train_torch(rule, kw, 4)
    sd = copy.deepcopy(ot.state_dict())
    conv = {"int": int, "float": float, "tensor": lambda v: torch.tensor(float(v)),
            "tensor_f64": lambda v: torch.tensor(float(v), dtype=torch.float64),
            "numpy": np.int64}[form]
    for st in sd["state"].values():
        st["step"] = conv(st["step"].item())
    pz = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oz = zopt.Optimizer(steps(**skw), pz)
    oz.load_state_dict(sd)
    assert [oz.tensor_step(p) for p in pz] == [4, 4, 4]
    for s in range(4, 6):
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
    assert_same(pz, pt)


@pytest.mark.parametrize("then", [0.0, 0.9])
def test_none_momentum_buffer_starts_afresh(steps, then):
    """torch's SGD with momentum 0 stores momentum_buffer None. Into a zopt
    SGD step with a momentum slot: loaded (not refused as lacking the
    buffer), step count 0, so that the buffer starts as torch's does when
    the momentum is (then) turned on: buf = g at the first step."""
    pt, ot = _train_torch("sgd", dict(lr=0.1, momentum=0.0), 2)
    sd = ot.state_dict()
    assert all(st == {"momentum_buffer": None} for st in sd["state"].values())
    pz = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oz = zopt.Optimizer(steps(rule="sgd"), pz, lr=1.0, momentum=0.5)
    oz.load_state_dict(sd)
    assert oz.param_groups[0]["momentum"] == 0 and [oz.tensor_step(p) for p in pz] == [0] * 3
    ot.param_groups[0]["momentum"] = oz.param_groups[0]["momentum"] = then
    for s in range(2, 5):
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
        assert_same(pz, pt)
    if then:
        _compare_states(oz, pz, ot, pt)


def test_bad_step_values_refused(steps):
    """Adam's moments without a 'step' (bias correction needs it), a
    fractional or negative step: refused naming the param, nothing
    changed."""
    pt, ot = _train_torch("adam", dict(lr=0.01), 2)
    pz = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oz = zopt.Optimizer(steps(rule="adam"), pz, lr=0.01)
    set_grads(pz, grads(pz, 0))
    oz.step()
    before = oz.state_dict()
    for bad, words in ((None, "no 'step'"), (2.5, "whole number"), (-1, "whole number"),
                       (torch.ones(2), "one number")):
        sd = copy.deepcopy(ot.state_dict())
        if bad is None:
            del sd["state"][1]["step"]
        else:
            sd["state"][1]["step"] = bad
        with pytest.raises(zopt.ZoptError, match=words) as e:
            oz.load_state_dict(sd)
        assert e.value.code == zopt.Status.CHECKPOINT and "['params'][1]" in str(e.value)
        after = oz.state_dict()
        assert [oz.tensor_step(p) for p in pz] == [1, 1, 1]
        for i in before["state"]:
            assert torch.equal(before["state"][i]["exp_avg"], after["state"][i]["exp_avg"])


# ---- maximize -------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["sgd", "adam", "adamw"])
def test_maximize_as_torch(steps, rule):
    """Two groups, one maximizing, with weight decay: as torch's
    maximize=True (which negates the gradient before weight decay) over
    several steps; maximize switched on the other group between steps (in
    param_groups, as torch reads it); state_dict() carries it both ways."""
    kw = dict(lr=0.05, weight_decay=0.1)
    if rule == "sgd":
        kw["momentum"] = 0.9
    pt, pz = params(1), params(1)
    groups = lambda ps: [{"params": ps[:2], "maximize": True}, {"params": ps[2:]}]  # noqa: E731
    ot = TORCH[rule](groups(pt), foreach=False, **kw)
    oz = zopt.Optimizer(steps(rule=rule), groups(pz), **kw)
    assert [g["maximize"] for g in oz.param_groups] == [True, False]
    assert oz.defaults["maximize"] is False
    for s in range(5):
        if s == 3:
            ot.param_groups[1]["maximize"] = oz.param_groups[1]["maximize"] = True
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
        assert_same(pz, pt)
    # the flag is not ignored: without it the params differ by far more
    pn = params(1)
    on = zopt.Optimizer(steps(rule=rule), pn, **kw)
    for s in range(5):
        set_grads(pn, grads(pn, s))
        on.step()
    assert (pn[0] - pz[0]).abs().max() > 1e-2
    # state_dict: zopt -> torch and torch -> zopt keep the flags
    sd = oz.state_dict()
    assert [g["maximize"] for g in sd["param_groups"]] == [True, True]
    t2 = TORCH[rule]([{"params": [torch.nn.Parameter(p.detach().clone())
                                  for p in pt[:2]]},
                      {"params": [torch.nn.Parameter(p.detach().clone()) for p in pt[2:]]}],
                     foreach=False, **kw)
    t2.load_state_dict(sd)
    assert [g["maximize"] for g in t2.param_groups] == [True, True]
    ot.param_groups[0]["maximize"] = False
    z2 = zopt.Optimizer(steps(rule=rule), groups([torch.nn.Parameter(p.detach().clone())
                                                  for p in pz]), **kw)
    z2.load_state_dict(ot.state_dict())
    assert [g["maximize"] for g in z2.param_groups] == [False, True]
    assert [z2.get_group_flags(g) for g in range(2)] == [0, zopt._lib.GROUP_MAXIMIZE]


def test_maximize_refused_values_and_mixed_classes(steps):
    """maximize must be a bool (like bias_correction); a step per dtype
    (MixedOptimizer) maximizes every class: the same bits as minimizing
    with negated gradients."""
    p = torch.nn.Parameter(torch.ones(3))
    s = steps(rule="adamw")
    with pytest.raises(ValueError, match="maximize"):
        zopt.Optimizer(s, [p], maximize="yes")
    o = zopt.Optimizer(s, [p])
    o.param_groups[0]["maximize"] = 2
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="maximize"):
        o.step()
    assert torch.equal(p, torch.ones(3))  # nothing stepped
    classes = {"bf16": steps(rule="adamw", layout="bf16_master"), "f32": s}

    def model():
        torch.manual_seed(5)
        return [torch.nn.Parameter(torch.randn(6).bfloat16()), torch.nn.Parameter(torch.randn(4))]
    a, b = model(), model()
    oa = zopt.Optimizer(classes, a, lr=0.05, weight_decay=0.1, maximize=True)
    ob = zopt.Optimizer(classes, b, lr=0.05, weight_decay=0.1)
    assert oa.param_groups[0]["maximize"] is True and ob.param_groups[0]["maximize"] is False
    for st in range(3):
        gs = [torch.randn(6).bfloat16(), torch.randn(4)]
        set_grads(a, gs)
        set_grads(b, gs, sign=-1.0)
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert oa.state_dict()["param_groups"][0]["maximize"] is True


# ---- strided params --------------------------------------------------------------

def _strided_model(dtype=torch.float32):
    """Params that are strided views: interleaved columns of one storage, a
    sub-block, a transposed (dense) one; and the storages behind them."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 8, generator=g).to(dtype)
    block = torch.randn(5, 7, generator=g).to(dtype)
    ps = [torch.nn.Parameter(base[:, ::2]), torch.nn.Parameter(base[:, 1::2]),
          torch.nn.Parameter(block[1:, 2:]),
          torch.nn.Parameter(torch.randn(7, 5, generator=g).to(dtype).t())]
    return base, block, ps


@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_strided_params_as_torch(steps, rule):
    """torch.optim steps strided views in place; so does zopt (through a
    dense copy): the same params after several steps, the storages' other
    elements untouched, p._version unchanged (the runtime's writes never
    bump it), states and state_dict contiguous in the param's shape (as
    torch's zeros_like of such a param)."""
    kw = dict(lr=0.05, weight_decay=0.1) if rule == "adamw" else \
        dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    bt, kt, pt = _strided_model()
    bz, kz, pz = _strided_model()
    assert not pz[0].is_contiguous() and not pz[2].is_contiguous()
    ot = TORCH[rule](pt, foreach=False, **kw)
    oz = zopt.Optimizer(steps(rule=rule), pz, **kw)
    for s in range(4):
        for P, O in ((pt, ot), (pz, oz)):
            set_grads(P, grads(P, s))
            O.step()
        assert_same(pz, pt)
    assert_same([bz, kz], [bt, kt])  # every element of the storages
    assert torch.equal(kz[0], kt[0]) and torch.equal(kz[:, :2], kt[:, :2])
    assert [p._version for p in pz] == [0] * 4
    key = "exp_avg" if rule == "adamw" else "momentum_buffer"
    for p, q in zip(pz, pt):
        st = oz.state[p][key]
        assert st.shape == p.shape
        assert_same([st], [ot.state[q][key]])
    assert oz.state_dict()["state"][0][key].is_contiguous()
    # a state_dict round trip, then more steps
    oz.load_state_dict(oz.state_dict())
    for P, O in ((pt, ot), (pz, oz)):
        set_grads(P, grads(P, 9))
        O.step()
    assert_same(pz, pt)


def test_strided_params_bf16_master_and_writes(steps):
    """bf16 params with an f32 master: strided views step bit for bit like
    contiguous copies of them, also across a write into a strided param
    between steps (seen: the master is made again from it) and a
    state_dict that writes its master into the params."""
    s = steps(rule="adamw", layout="bf16_master")
    _, _, pz = _strided_model(torch.bfloat16)
    pc = [torch.nn.Parameter(p.detach().clone().contiguous()) for p in pz]
    oz, oc = (zopt.Optimizer(s, P, lr=0.05, weight_decay=0.1) for P in (pz, pc))
    for st in range(4):
        if st == 2:  # an in-place op (p._version) and a p.data write (sampled)
            with torch.no_grad():
                for P in (pz, pc):
                    P[2].mul_(0.5)
                    P[0].data.add_(1.0)
        for P, O in ((pz, oz), (pc, oc)):
            set_grads(P, grads(P, st))
            O.step()
        for x, y in zip(pz, pc):
            assert torch.equal(x, y), st
    sd = oc.state_dict()   # its master into pz (pz != master now)
    with torch.no_grad():
        for p in pz:
            p.zero_()
    with pytest.warns(zopt.optimizer.MasterWeightsWarning):
        oz.load_state_dict(sd)
    for x, y in zip(pz, pc):
        assert torch.equal(x, y)


def test_strided_params_refused_where_unsupported(steps):
    """Overlapping strided views (refused naming both), an expanded view,
    a strided (param, grad) pair, a ZeRO-3 step: refused with the reason."""
    s = steps(rule="adamw")
    w = torch.zeros(4, 8)
    a, b = torch.nn.Parameter(w[:, ::2]), torch.nn.Parameter(w[:, ::4])
    with pytest.raises(zopt.ZoptError, match="overlap") as e:
        zopt.Optimizer(s, [a, b])
    assert "['params'][0]" in str(e.value) and "['params'][1]" in str(e.value)
    with pytest.raises(zopt.ZoptError, match="elements overlap in memory"):
        zopt.Optimizer(s, [torch.nn.Parameter(torch.zeros(4, 1).expand(4, 3))])
    with pytest.raises(zopt.ZoptError, match=r"\(param, grad\) pair"):
        zopt.Optimizer(s, [(w[:, ::2], torch.zeros(4, 4))])
    z3 = steps(rule="adamw", attributes={"zero_stage": 3})
    with pytest.raises(zopt.ZoptError, match="ZeRO-3"):
        zopt.Optimizer(z3, [torch.nn.Parameter(w[:, 1::2])])


# ---- exception types ---------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(betas=(1.5, 0.9)), dict(betas=(0.9,)),
                                dict(eps=-1e-8), dict(weight_decay=-0.1),
                                dict(bias_correction=0.5)],
                         ids=lambda kw: next(iter(kw)))
def test_invalid_hyperparameters_raise_value_error(steps, kw):
    """ValueError as torch.optim raises (still a ZoptError, INVALID_ARGUMENT):
    at construction, in a param group, at add_param_group, at the step
    after an edit of param_groups, and from set_hyper; a refused step
    changes nothing."""
    s = steps(rule="adam")
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    name, val = next(iter(kw.items()))
    with pytest.raises(ValueError) as e:
        zopt.Optimizer(s, [p], **kw)
    assert isinstance(e.value, zopt.ZoptError) and e.value.code == zopt.Status.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        zopt.Optimizer(s, [{"params": [p], **kw}])
    o = zopt.Optimizer(s, [p], lr=0.1)
    with pytest.raises(ValueError):
        o.add_param_group({"params": [q], **kw})
    o.param_groups[0][name] = val
    p.grad = torch.ones(3)
    with pytest.raises(ValueError):
        o.step()
    assert torch.equal(p, torch.ones(3)) and o.tensor_step(p) == 0
    if name in ("lr", "eps", "weight_decay"):
        with pytest.raises(ValueError):
            o.set_hyper(0, name, val)
        with pytest.raises(ValueError):  # torch's type for the same value
            torch.optim.Adam([p], **kw)


def test_bare_tensor_params_raise_type_error(steps):
    """A bare tensor as params: torch's TypeError and text (iterating it
    would step its rows), for one step and a step per dtype."""
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError) as et:
        torch.optim.SGD(p, lr=0.1)
    for s in (steps(rule="adamw"), {"f32": steps(rule="adamw")}):
        with pytest.raises(TypeError) as ez:
            zopt.Optimizer(s, p)
        assert str(et.value) in str(ez.value) and "torch.FloatTensor" in str(ez.value)
        assert isinstance(ez.value, zopt.ZoptError)


def _assert_no_cyclic_garbage(run):
    """``run()`` twice: a warm-up (caches such as ctypes pointer types and
    torch's filled once), then with the collector off, after which a
    collection finds nothing."""
    run()
    gc.collect()
    gc.disable()
    try:
        run()
        assert gc.collect() == 0
    finally:
        gc.enable()


# ---- garbage -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["one", "mixed", "bf16_master"])
def test_no_cyclic_garbage(steps, kind):
    """Building, stepping (fresh gradient tensors every step, the master
    watch of bf16 params), reading state and state_dict, and deleting an
    optimizer leaves nothing for the cycle collector (each optimizer used to
    leave a ctypes array type: gc.collect() returned 6-7 per optimizer,
    more per step)."""
    if kind == "mixed":
        s = {"bf16": steps(rule="adamw", layout="bf16_master"), "f32": steps(rule="adamw")}
    else:
        s = steps(rule="adamw", layout="bf16_master" if kind == "bf16_master" else "f32")

    def run():
        ps = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(3, 4))]
        if kind != "one":
            ps.append(torch.nn.Parameter(torch.randn(5).bfloat16()))
        if kind == "bf16_master":
            ps = [torch.nn.Parameter(p.detach().bfloat16()) for p in ps]
        o = zopt.Optimizer(s, ps, lr=1e-3)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn_like(p)
            o.step()
        o.state_dict()
        o.state[ps[0]]["exp_avg"]
        del o, ps

    _assert_no_cyclic_garbage(run)


def test_comm_buffers_leave_no_cyclic_garbage():
    """The torch.distributed engine views the runtime's buffers as tensors
    at every collective, and loopback communicators are made in arrays:
    neither may leave ctypes array types (one per size) as cyclic garbage."""
    from zopt.comm import Comm, _TorchEngine
    buf = np.arange(4096, dtype=np.uint8)

    def run():
        for n in (1, 7, 100, 4096):
            t = _TorchEngine._bytes(buf.ctypes.data, n)
            assert t.numel() == n and int(t[-1]) == (n - 1) % 256
        for c in Comm.loopback(3):
            c.close()

    _assert_no_cyclic_garbage(run)

"""torch.optim's per-group rule flags against the compiled step (issue 16):
amsgrad, nesterov, decoupled_weight_decay and SGD's momentum select an
update rule, which a zopt step has compiled in and its descriptor states
(ZOPT_FLAG_NESTEROV, ZOPT_FLAG_DECOUPLED_DECAY; AMSGrad by its state): a
group asking for another rule is refused, on CPU, GPU and offloaded steps
alike (GPU: test_gpu_binding.py); the step's own rule trains as torch's.
Split from test_torch_optim.py, whose helpers it uses."""
import copy

import numpy as np
import pytest
import torch

import zopt
from test_torch_optim import LR, WD, adamw_f32, close, mlp, same_bits, train_step  # noqa: F401


def test_amsgrad_in_groups_refused(adamw_f32, steps):
    """amsgrad changes torch's update rule; a zopt step's rule is compiled,
    so a group asking for another one is refused (at build, at
    add_param_group, and when set in param_groups later), never stepped
    with the compiled rule as it used to be. (maximize is a runtime group
    flag: test_torch_compat.py.)"""
    m = mlp()
    ps = list(m.parameters())
    with pytest.raises(zopt.ZoptError, match="amsgrad=True.*compiled without AMSGrad"):
        zopt.Optimizer(adamw_f32, [{"params": ps, "amsgrad": True}], lr=LR)
    o = zopt.Optimizer(adamw_f32, [{"params": ps[:2], "amsgrad": False, "maximize": False}], lr=LR)
    with pytest.raises(zopt.ZoptError, match="param group 1 has amsgrad=True"):
        o.add_param_group({"params": ps[2:], "amsgrad": True})
    o.add_param_group({"params": ps[2:]})
    train_step(m, o, 0)
    o.param_groups[1]["amsgrad"] = True
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[1\] has amsgrad=True"):
        train_step(m, o, 1)
    o.param_groups[1]["amsgrad"] = False
    train_step(m, o, 1)
    ams = steps(rule="adam", amsgrad=True, layout="f32")
    with pytest.raises(zopt.ZoptError, match="amsgrad=False.*compiled with AMSGrad"):
        zopt.Optimizer(ams, [{"params": ps, "amsgrad": False}], lr=LR)
    zopt.Optimizer(ams, [{"params": ps, "amsgrad": True}], lr=LR)


def _sgd_pair(step, groups_kw, **kw):
    """zopt over the mlp's params and torch.optim.SGD over a copy, the
    same groups (weights, biases)."""
    mz, mt = mlp(), mlp()
    def groups(m):
        ps = list(m.parameters())
        return [dict(params=ps[0::2], **groups_kw[0]), dict(params=ps[1::2], **groups_kw[1])]
    oz = zopt.Optimizer(step, groups(mz), **kw)
    ot = torch.optim.SGD(groups(mt), foreach=False, **kw)
    return mz, mt, oz, ot


def _frozen_state(m, o):
    """Params, momentum buffers and step counts, to check that a refused
    step() changed nothing."""
    ps = list(m.parameters())
    return ([p.detach().clone() for p in ps],
            [o.read_state(p, "momentum_buffer").copy() for p in ps if o.tensor_step(p)],
            [o.tensor_step(p) for p in ps])


def _same_state(a, b):
    assert same_bits(a[0], b[0]) and a[2] == b[2]
    assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("nesterov", [False, True])
def test_nesterov_flag_matches_the_step_or_is_refused(steps, nesterov):
    """torch.optim.SGD reads param_groups[i]['nesterov'] at every step; a
    zopt step's Nesterov-or-not is compiled (its descriptor says it,
    ZOPT_FLAG_NESTEROV): the other value is refused at construction,
    add_param_group, step() after an edit (nothing changed) and
    load_state_dict, never stepped with the compiled rule as it used to
    be; the step's own value trains as torch's does, and zopt's
    state_dict carries it into torch."""
    step = steps(rule="sgd", nesterov=nesterov, layout="f32")
    same_kw, other = dict(nesterov=nesterov), dict(nesterov=not nesterov)
    ps = list(mlp().parameters())
    with pytest.raises(zopt.ZoptError, match=f"nesterov={not nesterov}.*compiled "
                       f"{'with' if nesterov else 'without'} Nesterov"):
        zopt.Optimizer(step, [dict(params=ps, **other)], lr=0.1, momentum=0.9)
    mz, mt, oz, ot = _sgd_pair(step, [same_kw, same_kw], lr=0.1, momentum=0.9)
    with pytest.raises(zopt.ZoptError, match="param group 2 has nesterov"):
        oz.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3))], **other))
    for i in range(2):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())
    oz.param_groups[1]["nesterov"] = not nesterov
    before = _frozen_state(mz, oz)
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[1\] has nesterov"):
        train_step(mz, oz, 2)
    _same_state(before, _frozen_state(mz, oz))
    oz.param_groups[1]["nesterov"] = nesterov
    for i in range(2, 4):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())
    sd = oz.state_dict()
    assert [g["nesterov"] for g in sd["param_groups"]] == [nesterov] * 2
    ps = list(mt.parameters())  # nesterov False unless the state_dict says
    t2 = torch.optim.SGD([dict(params=ps[0::2]), dict(params=ps[1::2])], lr=0.1, momentum=0.9)
    t2.load_state_dict(copy.deepcopy(sd))
    assert [g["nesterov"] for g in t2.param_groups] == [nesterov] * 2
    bad = copy.deepcopy(ot.state_dict())
    bad["param_groups"][0]["nesterov"] = not nesterov
    before = _frozen_state(mz, oz)
    with pytest.raises(zopt.ZoptError, match="group 0 has nesterov"):
        oz.load_state_dict(bad)
    _same_state(before, _frozen_state(mz, oz))


def test_nesterov_keywords_and_group_dampening(steps):
    """torch.optim.SGD(nesterov=True) refuses momentum <= 0 or a dampening
    at construction (ValueError), and so does zopt.Optimizer for a Nesterov
    step's keywords; a group's own values, and later edits, torch steps
    (no check there): so does zopt, as torch's, every step."""
    step = steps(rule="sgd", nesterov=True, layout="f32")
    ps = list(mlp().parameters())
    for kw in (dict(dampening=0.1), dict(momentum=0.0)):
        with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
            torch.optim.SGD(ps, lr=0.1, **dict(dict(momentum=0.9, nesterov=True), **kw))
        with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
            zopt.Optimizer(step, ps, lr=0.1, **dict(dict(momentum=0.9), **kw))
    nest = dict(nesterov=True)
    mz, mt, oz, ot = _sgd_pair(step, [dict(nest, dampening=0.25), nest], lr=0.1, momentum=0.9)
    for i in range(4):
        if i == 2:
            for o in (oz, ot):
                o.param_groups[1]["dampening"] = 0.5
        train_step(mz, oz, i)
        train_step(mt, ot, i)
        close(mz.parameters(), mt.parameters())


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_zero_then_on_as_torch(steps, nesterov):
    """torch.optim.SGD at momentum 0 keeps no buffer (plain SGD, any
    dampening) and starts one, buf = grad, at the first step with momentum
    != 0. A zopt step with a buffer: group 0 steps at momentum 0 (dampening
    0.3), then at 0.9, group 1 at 0.9 throughout; every step as torch's (the
    first zopt step at 0.9 used to continue a buffer made at momentum 0)."""
    step = steps(rule="sgd", nesterov=nesterov, layout="f32")
    g0 = dict(momentum=0.0, dampening=0.3, nesterov=nesterov)
    mz, mt, oz, ot = _sgd_pair(step, [g0, dict(momentum=0.9, nesterov=nesterov)], lr=0.1,
                               weight_decay=0.01)
    for i in range(6):
        if i == 3:
            for o in (oz, ot):
                o.param_groups[0]["momentum"] = 0.9
                o.param_groups[0]["dampening"] = 0.0
        train_step(mz, oz, i)
        train_step(mt, ot, i)
        close(mz.parameters(), mt.parameters())
    for p, q in zip(mz.parameters(), mt.parameters()):
        np.testing.assert_allclose(oz.state[p]["momentum_buffer"].numpy(),
                                   ot.state[q]["momentum_buffer"].numpy(), rtol=2e-5, atol=1e-6)


def test_momentum_zero_with_buffers_held_refused(steps):
    """Momentum set to 0 after steps with momentum: torch leaves the
    buffers unchanged while it is 0 and continues them afterwards, which
    the compiled step cannot (it would overwrite them): refused at step()
    and at load_state_dict, nothing changed; back at 0.9, on as torch."""
    step = steps(rule="sgd", layout="f32")
    mz, mt, oz, ot = _sgd_pair(step, [{}, {}], lr=0.1, momentum=0.9)
    for i in range(2):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    oz.param_groups[1]["momentum"] = 0
    before = _frozen_state(mz, oz)
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[1\] has momentum=0 while its "
                       "params hold momentum buffers"):
        train_step(mz, oz, 2)
    _same_state(before, _frozen_state(mz, oz))
    oz.param_groups[1]["momentum"] = 0.9
    sd = copy.deepcopy(ot.state_dict())
    sd["param_groups"][0]["momentum"] = 0.0
    with pytest.raises(zopt.ZoptError, match="group 0 has momentum=0 while"):
        oz.load_state_dict(sd)
    _same_state(before, _frozen_state(mz, oz))
    assert oz.param_groups[1]["momentum"] == 0.9
    for i in range(2, 4):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())


def test_plain_sgd_momentum_refused(steps):
    """A plain SGD step (no buffer): a momentum != 0 (which torch would
    follow with a buffer) is refused at step() after an edit, nothing
    changed (it used to be ignored), at construction and add_param_group;
    torch's plain groups (momentum 0, any dampening, nesterov False) are
    taken and stepped as torch's."""
    step = steps(rule="sgd", momentum=False, layout="f32")
    mz, mt, oz, ot = _sgd_pair(step, [{}, {}], lr=0.1)
    train_step(mz, oz, 0)
    oz.param_groups[0]["momentum"] = 0.9
    before = [p.detach().clone() for p in mz.parameters()]
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[0\] has momentum=0.9"):
        train_step(mz, oz, 1)
    assert same_bits(before, mz.parameters())
    ps = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(zopt.ZoptError, match="momentum=0.9, but step .* plain SGD"):
        zopt.Optimizer(step, [dict(params=ps, momentum=0.9)], lr=0.1)
    plain = dict(momentum=0.0, dampening=0.2, nesterov=False)
    mz, mt, oz, ot = _sgd_pair(step, [plain, {}], lr=0.1)
    with pytest.raises(zopt.ZoptError, match="param group 2 has momentum=0.5"):
        oz.add_param_group(dict(params=ps, momentum=0.5))
    for i in range(2):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())


def test_decoupled_weight_decay_flag(steps):
    """torch 2.x's Adam(decoupled_weight_decay=...) (AdamW's groups say
    True): a group whose value is not the step's rule (zopt.steps.adam: L2,
    adamw: decoupled) is refused at construction, step() after an edit
    (nothing changed) and load_state_dict; the step's own value trains as
    torch does."""
    adam, adamw = steps(rule="adam", layout="f32"), steps(rule="adamw", layout="f32")
    ps = list(mlp().parameters())
    with pytest.raises(zopt.ZoptError, match="decoupled_weight_decay=True.*L2 .Adam."):
        zopt.Optimizer(adam, [dict(params=ps, decoupled_weight_decay=True)], lr=LR)
    with pytest.raises(zopt.ZoptError, match="decoupled_weight_decay=False.*decoupled .AdamW."):
        zopt.Optimizer(adamw, [dict(params=ps, decoupled_weight_decay=False)], lr=LR)
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(adam, [dict(params=mz.parameters(), decoupled_weight_decay=False)],
                        lr=LR, weight_decay=WD)
    ot = torch.optim.Adam(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(3):
        train_step(mz, oz, i)
        train_step(mt, ot, i)
    close(mz.parameters(), mt.parameters())
    oz.param_groups[0]["decoupled_weight_decay"] = True
    before = [p.detach().clone() for p in mz.parameters()]
    with pytest.raises(zopt.ZoptError, match=r"param_groups\[0\] has decoupled_weight_decay"):
        train_step(mz, oz, 3)
    assert same_bits(before, mz.parameters()) and oz.tensor_step(0) == 3
    oz.param_groups[0]["decoupled_weight_decay"] = False
    sd = copy.deepcopy(ot.state_dict())
    sd["param_groups"][0]["decoupled_weight_decay"] = True
    with pytest.raises(zopt.ZoptError, match="group 0 has decoupled_weight_decay=True"):
        oz.load_state_dict(sd)
    assert same_bits(before, mz.parameters())

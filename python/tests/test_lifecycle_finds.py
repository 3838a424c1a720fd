"""What python/tests/test_lifecycle_fuzz.py found, minimized: each test
failed before its fix (a silently wrong result first, then refusals that
were not the documented error or changed state)."""
import pytest
import torch

import zopt
from test_lifecycle_fuzz import close, f64


@pytest.mark.parametrize("shape", [(2, 4, 7), (1, 7)])
def test_refused_replaced_param_leaves_the_mask(steps, scan_impl, shape):
    """p.data replaced by a tensor of another shape, and p.grad with it: the
    step is refused with the documented ZoptError (not torch's RuntimeError
    from copying the gradient), nothing changes, and a param whose gradient
    went None at that refused step is left alone at the next one (it was
    updated without a gradient: the pass had taken the new mask as pushed)."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(4, 7)), torch.nn.Parameter(torch.randn(5))
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), [p, q], lr=1e-2)
    p.grad, q.grad = torch.randn(4, 7), torch.randn(5)
    opt.step()
    q0, m0 = q.detach().clone(), opt.state[q]["exp_avg"].clone()
    q.grad = None
    old = p.data
    p.data = torch.randn(shape)
    p.grad = torch.randn(shape)
    with pytest.raises(Exception) as refused:
        opt.step()
    assert torch.equal(q, q0) and opt.tensor_step(q) == 1 and opt.tensor_step(p) == 1
    p.grad = None
    p.data = old
    p.grad = torch.randn(4, 7)
    opt.step()
    assert opt.tensor_step(p) == 2
    assert opt.tensor_step(q) == 1, "a param without a gradient was stepped"
    assert torch.equal(q, q0) and torch.equal(opt.state[q]["exp_avg"], m0)
    assert refused.type is zopt.ZoptError and "replaced" in str(refused.value) \
        and "another shape" in str(refused.value), refused.value
    opt.close()


def test_duplicate_param_is_torchs_value_error(steps):
    """add_param_group with a param already in the optimizer: ValueError, as
    torch.optim raises (zopt.ZoptValueError, also a ZoptError)."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), [p], lr=1e-2)
    with pytest.raises(ValueError, match="appears twice"):
        opt.add_param_group(dict(params=[p]))
    with pytest.raises(ValueError):
        torch.optim.AdamW([p]).add_param_group(dict(params=[p]))
    assert len(opt.param_groups) == 1
    opt.close()


def test_set_hyper_keeps_the_groups_other_edits(steps):
    """param_groups edited (maximize, lr) and then opt.set_hyper of another
    slot before the step: the edits are kept and stepped, as torch steps
    what param_groups says (set_hyper read the whole group back from the
    runtime, silently undoing them); an edit back to the value pushed before
    the set_hyper is pushed too."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    rp = torch.nn.Parameter(p.detach().double().clone())
    opt = zopt.Optimizer(steps(rule="sgd", nesterov=True), [p], lr=1e-2, momentum=0.5)
    ref = torch.optim.SGD([rp], lr=1e-2, momentum=0.5, nesterov=True)
    for k in range(4):
        g = torch.randn(5)
        p.grad, rp.grad = g.clone(), g.double()
        if k == 2:  # set_hyper, then param_groups back to the value pushed before it
            opt.set_hyper(0, "lr", 0.003)
            opt.param_groups[0]["lr"] = 0.1
        if k == 1:
            for o in (opt, ref):
                o.param_groups[0]["maximize"] = True
                o.param_groups[0]["lr"] = 0.1
            opt.set_hyper(0, "momentum", 0.9)
            ref.param_groups[0]["momentum"] = 0.9
            assert opt.param_groups[0]["maximize"] is True and opt.param_groups[0]["lr"] == 0.1
            assert opt.param_groups[0]["momentum"] == 0.9
        opt.step()
        ref.step()
        close(f64(p), f64(rp), f"step {k}")
        close(f64(opt.state[p]["momentum_buffer"]), f64(ref.state[rp]["momentum_buffer"]),
              f"step {k} momentum_buffer")
    opt.close()


def test_refused_overlap_keeps_the_master(steps, scan_impl):
    """p.data = q.data (two params on one storage) is refused at step();
    once p gets its own storage back, nothing has changed: its f32 master
    is kept (the refusal had taken q's storage as p's, so giving p its
    storage back looked like p.data = new and remade the master from the
    bf16 param, silently dropping its low bits)."""
    torch.manual_seed(0)
    p, q = (torch.nn.Parameter(torch.randn(6).bfloat16()) for _ in range(2))
    opt = zopt.Optimizer(steps(rule="adamw", layout="bf16_master"), [p, q], lr=1e-3)
    for _ in range(2):
        p.grad, q.grad = torch.randn(6).bfloat16(), torch.randn(6).bfloat16()
        opt.step()
    m0 = opt.state[p]["master"].clone()
    assert not torch.equal(m0, p.detach().float())  # the master holds more than the param
    old = p.data
    p.data = q.data
    with pytest.raises(zopt.ZoptError, match="overlap in memory"):
        opt.step()
    p.data = old
    assert torch.equal(opt.state[p]["master"], m0)
    assert opt.tensor_step(p) == 2 and opt.refreshes == 0
    opt.close()


def test_empty_param_replaced_by_another_shape_refused(steps):
    """An empty param (numel 0) given a tensor of another shape (p.data =
    ...) is refused as any param is (it was accepted and never stepped:
    the optimizer had registered no element for it)."""
    p, q = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.randn(5))
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), [p, q], lr=1e-2)
    p.grad, q.grad = torch.zeros(0), torch.randn(5)
    opt.step()
    q0 = q.detach().clone()
    p.data = torch.randn(3)
    p.grad = torch.randn(3)
    with pytest.raises(zopt.ZoptError, match=r"another shape \(3,\) \(was \(0,\)\)"):
        opt.step()
    assert torch.equal(q, q0) and opt.tensor_step(q) == 1
    opt.close()

def test_state_dict_of_a_momentum_zero_group_is_torchs(steps):
    """SGD with a buffer stepped at momentum 0 only: torch holds no buffer
    (momentum_buffer None) and starts one, buf = g, once the momentum is
    not 0. zopt's state_dict said the same (it exported the runtime's
    buffer, the last gradient: torch.optim.SGD loading it continued that
    buffer, silently off), and a zopt optimizer loading it starts the
    buffers afresh at the first step with momentum (it refused momentum 0
    as held buffers)."""
    torch.manual_seed(0)
    kw = dict(lr=0.1, momentum=0.0, dampening=0.5)
    p = torch.nn.Parameter(torch.randn(5))
    r = torch.nn.Parameter(p.detach().double().clone())
    opt = zopt.Optimizer(steps(rule="sgd"), [p], **kw)
    ref = torch.optim.SGD([r], **kw)
    grads = [torch.randn(5) for _ in range(5)]
    for g in grads[:2]:
        p.grad, r.grad = g.clone(), g.double()
        opt.step()
        ref.step()
    sd = opt.state_dict()
    assert sd["state"][0]["momentum_buffer"] is None
    t = torch.nn.Parameter(p.detach().double().clone())   # torch loads zopt's
    tor = torch.optim.SGD([t], **kw)
    tor.load_state_dict(sd)
    q = torch.nn.Parameter(p.detach().clone())             # and zopt loads it
    opt2 = zopt.Optimizer(steps(rule="sgd"), [q], **kw)
    opt2.load_state_dict(sd)
    for k, g in enumerate(grads[2:]):
        if k == 1:
            for o in (opt, ref, tor, opt2):
                o.param_groups[0]["momentum"] = 0.9
        for x in (p, r, t, q):
            x.grad = g.clone().to(x.dtype)
        for o in (opt, ref, tor, opt2):
            o.step()
        for x, what in ((p, "zopt"), (t, "torch loading zopt's"), (q, "zopt loading zopt's")):
            close(f64(x), f64(r), f"step {k}: {what}")
    opt.close()
    opt2.close()


def test_save_load_of_a_momentum_zero_group(steps, tmp_path):
    """The same through opt.save()/opt.load(): the file said "count 1, a
    buffer", so the loaded optimizer refused momentum 0 (held buffers) and,
    once the momentum was set, continued the last gradient as the buffer
    (silently off from torch and from the optimizer that saved). The live
    optimizer's counts are kept. (A group at momentum 0 in a loaded state
    holds no buffer torch keeps: every save and load refuses one that does.)"""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    r = torch.nn.Parameter(p.detach().double().clone())
    opt = zopt.Optimizer(steps(rule="sgd"), [p], lr=0.1, momentum=0.0)
    ref = torch.optim.SGD([r], lr=0.1, momentum=0.0)
    grads = [torch.randn(5) for _ in range(4)]
    p.grad, r.grad = grads[0].clone(), grads[0].double()
    opt.step()
    ref.step()
    opt.save(str(tmp_path / "ck"))
    assert opt.tensor_step(p) == 1
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = zopt.Optimizer(steps(rule="sgd"), [q], lr=0.1, momentum=0.0)
    opt2.load(str(tmp_path / "ck"))
    for k, g in enumerate(grads[1:]):
        if k == 1:
            for o in (opt, ref, opt2):
                o.param_groups[0]["momentum"] = 0.9
        for x in (p, r, q):
            x.grad = g.clone().to(x.dtype)
        for o in (opt, ref, opt2):
            o.step()
        close(f64(p), f64(r), f"step {k}: zopt")
        close(f64(q), f64(r), f"step {k}: zopt loaded from the file")
    opt.close()
    opt2.close()


def test_momentum_restart_keeps_the_master_through_state_dict(steps):
    """SGD's restart at the first step with momentum after steps at
    momentum 0 sets the group's counts to 0, also of a param without a
    gradient in that step; with count 0 it was exported as never stepped,
    and its f32 master was lost in a state_dict round trip (made again from
    the bf16 param). Now exported as torch's SGD state without a buffer,
    with the master."""
    torch.manual_seed(0)
    st = steps(rule="sgd", layout="bf16_master")
    p, q = (torch.nn.Parameter(torch.randn(4).bfloat16()) for _ in range(2))
    opt = zopt.Optimizer(st, [p, q], lr=0.01, momentum=0.0)
    for _ in range(3):
        p.grad, q.grad = torch.randn(4).bfloat16(), torch.randn(4).bfloat16()
        opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    p.grad, q.grad = None, torch.randn(4).bfloat16()
    opt.step()
    p2, q2 = (torch.nn.Parameter(x.detach().clone()) for x in (p, q))
    opt2 = zopt.Optimizer(st, [p2, q2], lr=0.01, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    for o, x in ((opt, p), (opt2, p2)):
        x.grad = torch.ones(4).bfloat16()
        o.step()
    assert torch.equal(opt.state[p]["master"], opt2.state[p2]["master"])
    opt.close()
    opt2.close()


def test_refused_add_param_group_pushes_nothing(steps):
    """L9: add_param_group pushed the groups' pending edits before it
    refused a duplicate param, the SGD momentum restart's count reset
    included (counts 0 after a refused call). A refusal changes nothing:
    counts, states and the pushed values stay; the edits are pushed by the
    next step, stepped as torch steps them."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))
    r = torch.nn.Parameter(p.detach().double().clone())
    opt = zopt.Optimizer(steps(rule="sgd"), [p], lr=0.1, momentum=0.0)
    ref = torch.optim.SGD([r], lr=0.1, momentum=0.0)
    grads = [torch.randn(5) for _ in range(4)]
    for g in grads[:2]:
        p.grad, r.grad = g.clone(), g.double()
        opt.step()
        ref.step()
    buf = opt.state[p]["momentum_buffer"].clone()
    for o in (opt, ref):
        o.param_groups[0].update(momentum=0.9, lr=0.05)
    with pytest.raises(ValueError, match="appears twice"):
        opt.add_param_group(dict(params=[q, p]))
    assert len(opt.param_groups) == 1 and opt.tensor_step(p) == 2
    assert opt.get_hyper(0, "lr") == pytest.approx(0.1)
    assert torch.equal(opt.state[p]["momentum_buffer"], buf)
    opt.add_param_group(dict(params=[q]))  # accepted: the edits pushed then
    ref.add_param_group(dict(params=[torch.nn.Parameter(q.detach().double())]))
    assert opt.get_hyper(0, "lr") == pytest.approx(0.05) and opt.tensor_step(p) == 0
    for k, g in enumerate(grads[2:]):
        p.grad, r.grad = g.clone(), g.double()
        opt.step()
        ref.step()
        close(f64(p), f64(r), f"step {k}")
    assert opt.tensor_step(p) == 2  # (restarted: buf = g at the first step with momentum)
    opt.close()


@pytest.mark.parametrize("layout", ["f32", "bf16_master"])
def test_state_view_after_a_momentum_restart_is_torchs(steps, layout):
    """L8's leftover: a param without a gradient at SGD's momentum restart
    (its count reset to 0) showed opt.state[p] == {} (and was not in
    opt.state), where torch.optim.SGD holds {'momentum_buffer': None}
    (zopt's master layouts: with its master, as state_dict exports it)."""
    torch.manual_seed(0)
    bf = layout == "bf16_master"
    dt = torch.bfloat16 if bf else torch.float32
    zs = [torch.nn.Parameter(torch.randn(4).to(dt)) for _ in range(2)]
    rs = [torch.nn.Parameter(z.detach().double().clone()) for z in zs]
    opt = zopt.Optimizer(steps(rule="sgd", layout=layout), zs, lr=0.01, momentum=0.0)
    ref = torch.optim.SGD(rs, lr=0.01, momentum=0.0)
    for k in range(3):
        grads = [torch.randn(4) for _ in zs] if k < 2 else [None, torch.randn(4)]
        if k == 2:
            for o in (opt, ref):
                o.param_groups[0]["momentum"] = 0.9
        for z, r, g in zip(zs, rs, grads):
            z.grad = None if g is None else g.to(dt)
            r.grad = None if g is None else g.to(dt).double()
        opt.step()
        ref.step()
    p, rp = zs[0], rs[0]
    assert ref.state[rp] == {"momentum_buffer": None}
    assert sorted(opt.state[p]) == (["master", "momentum_buffer"] if bf else ["momentum_buffer"])
    assert opt.state[p]["momentum_buffer"] is None and p in opt.state and len(opt.state) == 2
    if bf:
        assert torch.equal(opt.state[p]["master"], opt.state_dict()["state"][0]["master"])
    close(f64(opt.state[zs[1]]["momentum_buffer"]), ref.state[rs[1]]["momentum_buffer"], "q")
    opt.state[p] = {}  # reset: torch's {} too
    assert dict(opt.state[p]) == {} and p not in opt.state
    opt.close()


def test_refused_add_param_group_after_a_rebuild_keeps_the_pushed_values(steps, monkeypatch):
    """L9, the rebuild path (GPU steps; CPU where the runtime refuses the
    in-place add): undoing the add rebuilt the native optimizer with the
    groups' values not pushed yet; it holds the pushed ones again."""
    from zopt import _groups, _native
    p, q = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), [p], lr=1e-2)
    p.grad = torch.randn(5)
    opt.step()
    m = opt.state[p]["exp_avg"].clone()
    opt.param_groups[0]["lr"] = 0.5

    def no_in_place(*a, **k):
        raise zopt.ZoptError(zopt.Status.UNSUPPORTED, "no in-place add (test)")

    def fail(*a, **k):
        raise RuntimeError("refused (test)")
    monkeypatch.setattr(_native.Native, "add_tensors", no_in_place)
    monkeypatch.setattr(_groups._grads, "add_acc_hooks", fail)
    with pytest.raises(RuntimeError, match="test"):
        opt.add_param_group(dict(params=[q]))
    monkeypatch.undo()
    assert opt.get_hyper(0, "lr") == pytest.approx(1e-2) and opt.rebuilds == 2
    assert torch.equal(opt.state[p]["exp_avg"], m) and opt.tensor_step(p) == 1
    opt.close()

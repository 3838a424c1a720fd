"""zopt.Optimizer against the torch.optim.Optimizer surface that torch 2.x
changed (zopt/_torch_compat.py). Each test runs on the installed torch: the
regular suite's torch 1.13, and torch 2.x in the GPU window
(bench/gpu/run_gpu_bench.sh, stage 3). Where 1.13 lacks a feature the test
either drives zopt's code through the same dicts torch 2's methods fill, or
emulates the base class as torch 2 shapes it (a method renamed, a default
changed), so that it fails here without the fix too; tests of features that
only exist in torch 2 (step hooks, torch.compile) skip on 1.13."""
import inspect
import warnings

import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError

LR, WD = 1e-2, 0.1


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def backward(model, i):
    x, y = batch(i)
    torch.nn.functional.mse_loss(model(x), y).backward()


def same(a, b):
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(a, b))


def close_to_torch(mz, mt):
    for p, q in zip(mz.parameters(), mt.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_base_setup_as_torch_does_it(steps):
    """The per-instance attributes torch.optim.Optimizer.__init__ sets up
    (the hook dicts of torch 2) exist on a zopt optimizer, and its step is
    wrapped by torch's profiling wrapper as AdamW's is."""
    m = mlp()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), m.parameters(), lr=LR)
    ref = torch.optim.AdamW(mlp().parameters(), lr=LR)
    want = {k for k in vars(ref) if k.startswith("_optimizer_")}
    assert want <= set(vars(opt)), want - set(vars(opt))
    assert bool(getattr(type(opt).step, "hooked", False)) == bool(getattr(type(ref).step, "hooked", False))
    backward(m, 0)
    opt.step()  # through the wrapper (torch 2: it runs the step hooks)
    assert opt.step_count() == 1
    opt.close()


def test_step_wrapper_found_by_feature(steps, monkeypatch):
    """torch 2.1 renamed _hook_for_profile to _patch_step_function: zopt
    calls whichever the installed torch has (before: _hook_for_profile,
    an AttributeError at construction on torch >= 2.1)."""
    calls = []
    monkeypatch.delattr(torch.optim.Optimizer, "_hook_for_profile", raising=False)
    monkeypatch.setattr(torch.optim.Optimizer, "_patch_step_function",
                        lambda self: calls.append(type(self).__name__), raising=False)
    st = steps(rule="adamw", layout="f32")
    opt = zopt.Optimizer(st, mlp().parameters(), lr=LR)
    assert calls == ["Optimizer"]
    mixed = zopt.Optimizer({torch.float32: st}, mlp().parameters(), lr=LR)  # a step per dtype
    assert "MixedOptimizer" in calls
    opt.close()
    mixed.close()


@pytest.mark.skipif(not hasattr(torch.optim.Optimizer, "register_step_pre_hook"),
                    reason="torch < 2.0 has no optimizer step hooks")
def test_step_hooks(steps):
    """register_step_pre_hook / post_hook and the global ones run around
    zopt's step as around torch's, with the step's arguments."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    m = mlp()
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), m.parameters(), lr=LR)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o is opt, o.step_count())))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o is opt, o.step_count())))
    g1 = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("gpre", o is opt)))
    g2 = register_optimizer_step_post_hook(lambda o, a, k: seen.append(("gpost", o is opt)))
    try:
        backward(m, 0)
        opt.step()
    finally:
        for h in (h1, h2, g1, g2):
            h.remove()
    assert seen == [("gpre", True), ("pre", True, 0), ("post", True, 1), ("gpost", True)]
    backward(m, 1)
    opt.step()  # removed: not called again
    assert len(seen) == 4
    opt.close()


def _register(opt, kind, hook):
    """register_<kind>_hook where torch has it (2.1+); else into the dict
    that method fills (so the same code path runs on torch 1.13)."""
    method = getattr(opt, f"register_{kind}_hook", None)
    if method is not None:
        return method(hook)
    d = getattr(opt, f"_optimizer_{kind}_hooks")
    d[len(d)] = hook
    return None


def test_state_dict_hooks(steps):
    """state_dict pre/post hooks and load_state_dict pre/post hooks (torch
    2.1's register_*_hook) run as torch runs them: a post hook's returned
    dict is what state_dict returns, a load pre hook's returned dict is what
    is loaded."""
    st = steps(rule="adamw", layout="f32")
    m = mlp()
    opt = zopt.Optimizer(st, m.parameters(), lr=LR, weight_decay=WD)
    backward(m, 0)
    opt.step()
    seen = []
    _register(opt, "state_dict_pre", lambda o: seen.append("pre"))

    def post(o, sd):
        seen.append("post")
        sd = dict(sd)
        sd["extra"] = 42
        return sd
    _register(opt, "state_dict_post", post)
    sd = opt.state_dict()
    assert seen == ["pre", "post"] and sd["extra"] == 42
    m2 = mlp()
    o2 = zopt.Optimizer(st, m2.parameters(), lr=LR, weight_decay=WD)

    def load_pre(o, sd):
        seen.append("load_pre")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.5) for g in sd["param_groups"]]
        return sd
    _register(o2, "load_state_dict_pre", load_pre)
    _register(o2, "load_state_dict_post", lambda o: seen.append(("load_post", o.param_groups[0]["lr"])))
    o2.load_state_dict(sd)
    assert seen[2:] == ["load_pre", ("load_post", 0.5)]
    assert sd["param_groups"][0]["lr"] == LR  # the caller's dict is untouched
    assert o2.tensor_step(next(m2.parameters())) == 1
    opt.close()
    o2.close()


def test_zero_grad_default_follows_torch(steps, monkeypatch):
    """zero_grad()'s default is the installed torch's: set_to_none=False on
    torch 1.13, True from torch 2.0 (before: always False, so a zopt model
    kept zero gradients where torch 2's frees them)."""
    st = steps(rule="adamw", layout="f32")
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR)
    backward(mz, 0)
    backward(mt, 0)
    oz.zero_grad()
    ot.zero_grad()
    assert [p.grad is None for p in mz.parameters()] == [p.grad is None for p in mt.parameters()]
    # torch 2's base class (zero_grad(self, set_to_none: bool = True)) on this torch
    default = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    flipped = not default

    def zero_grad(self, set_to_none: bool = flipped):
        pass
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", zero_grad)
    backward(mz, 1)
    oz.zero_grad()
    assert all((p.grad is None) == flipped for p in mz.parameters())
    assert all(p.grad is None or not p.grad.any() for p in mz.parameters())
    oz.close()


def test_torch2_group_keys_load_and_differentiable_refused(steps):
    """A torch 2 AdamW state_dict carries foreach, fused, capturable,
    differentiable, maximize (and decoupled_weight_decay, param_names) in
    every group: zopt loads it and steps as torch does; differentiable=True
    is refused (the step runs outside autograd), as maximize=True is."""
    st = steps(rule="adamw", layout="f32")
    mz, mt = mlp(), mlp()
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(2):
        ot.zero_grad()
        backward(mt, i)
        ot.step()
    sd = ot.state_dict()
    for g in sd["param_groups"]:  # what torch 2.11 writes, on any torch
        for k, v in dict(foreach=False, fused=None, capturable=False, differentiable=False,
                         maximize=False, decoupled_weight_decay=True).items():
            g.setdefault(k, v)
    mz.load_state_dict(mt.state_dict())
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    oz.load_state_dict(sd)
    for i in range(2, 4):
        for o, m in ((oz, mz), (ot, mt)):
            o.zero_grad()
            backward(m, i)
            o.step()
    close_to_torch(mz, mt)
    assert oz.param_groups[0]["foreach"] is False  # carried along, ignored
    before = [p.detach().clone() for p in mz.parameters()]
    oz.param_groups[0]["differentiable"] = True
    backward(mz, 4)
    with pytest.raises(ZoptError, match="differentiable=True") as e:
        oz.step()
    assert e.value.code == Status.INVALID_ARGUMENT
    assert same(before, mz.parameters())
    oz.param_groups[0]["differentiable"] = False
    with pytest.raises(ZoptError, match="differentiable=True"):
        zopt.Optimizer(st, [{"params": list(mlp().parameters()), "differentiable": True}], lr=LR)
    oz.close()


def test_named_parameters(steps):
    """model.named_parameters() as params (torch >= 2.5): the names go into
    the group as 'param_names' (and the state_dict), the steps are those of
    the same params given unnamed, bit for bit; named and unnamed mixed is
    refused with torch's ValueError."""
    st = steps(rule="adamw", layout="f32")
    ma, mb = mlp(), mlp()
    oa = zopt.Optimizer(st, ma.named_parameters(), lr=LR, weight_decay=WD)
    ob = zopt.Optimizer(st, mb.parameters(), lr=LR, weight_decay=WD)
    assert oa.param_groups[0]["param_names"] == [n for n, _ in ma.named_parameters()]
    assert all(p is q for p, q in zip(oa.param_groups[0]["params"], ma.parameters()))
    for i in range(3):
        for o, m in ((oa, ma), (ob, mb)):
            o.zero_grad()
            backward(m, i)
            o.step()
    assert same(ma.parameters(), mb.parameters())
    assert oa.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    named = list(mlp().named_parameters())
    with pytest.raises(ValueError, match="with/without names"):
        zopt.Optimizer(st, [named[0], named[1][1]], lr=LR)
    oa.close()
    ob.close()


def test_lr_scheduler_wraps_step_like_torch(steps):
    """An LR scheduler built on a zopt optimizer (torch 2 wraps opt.step on
    the instance to see that it was called) follows torch's schedule, and
    warns as for torch's own optimizer: not at all in the right order."""
    st = steps(rule="adamw", layout="f32")
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        sz = torch.optim.lr_scheduler.StepLR(oz, step_size=2, gamma=0.5)
        stt = torch.optim.lr_scheduler.StepLR(ot, step_size=2, gamma=0.5)
        for i in range(5):
            for o, m, s in ((oz, mz, sz), (ot, mt, stt)):
                o.zero_grad()
                backward(m, i)
                o.step()
                s.step()
            assert oz.param_groups[0]["lr"] == ot.param_groups[0]["lr"]
    msgs = [str(w.message) for w in ws if "lr_scheduler" in str(w.message) or "optimizer.step" in str(w.message)]
    assert msgs == [], msgs
    close_to_torch(mz, mt)
    assert oz.param_groups[0]["lr"] == LR * 0.25
    oz.close()


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch < 2.0 has no torch.compile")
def test_torch_compile_graph_breaks_at_step(steps):
    """torch.compile over a training step that calls opt.step(): Dynamo does
    not trace into zopt's step (marked like torch's own state_dict and
    zero_grad): the step runs eagerly, bit-identical to an uncompiled run;
    with fullgraph=True compiling fails, it never runs a wrong step."""
    st = steps(rule="adamw", layout="f32")
    ma, mb = mlp(), mlp()
    oa = zopt.Optimizer(st, ma.parameters(), lr=LR, weight_decay=WD)
    ob = zopt.Optimizer(st, mb.parameters(), lr=LR, weight_decay=WD)

    def train(m, o, x, y):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()

    compiled = torch.compile(train, backend="eager")
    for i in range(3):
        x, y = batch(i)
        compiled(ma, oa, x, y)
        train(mb, ob, x, y)
    assert same(ma.parameters(), mb.parameters())
    assert oa.step_count() == ob.step_count() == 3
    before = [p.detach().clone() for p in ma.parameters()]
    strict = torch.compile(train, backend="eager", fullgraph=True)
    x, y = batch(3)
    try:
        strict(ma, oa, x, y)
    except Exception:  # noqa: BLE001 (torch._dynamo's error: unsupported / skipped)
        assert oa.step_count() == 3 and same(before, ma.parameters())
    else:  # it ran: then it ran the real step
        train(mb, ob, x, y)
        assert same(ma.parameters(), mb.parameters())
    oa.close()
    ob.close()


def _fake_torch_wrapper(how):
    """A wrapper like torch 2's around an optimizer's methods
    (torch._dynamo's disable wrapper in eval_frame.py, the step hooks'
    wrapper, _use_grad), defined in a module that is torch's: by its
    module name (a fake ``torch._dynamo.eval_frame`` at a path outside
    torch) or by its file (a file in the installed torch's folder)."""
    import os
    import types
    if how == "module name":
        name, path = "torch._dynamo._zopt_fake_eval_frame", "/nonexistent/torch/_dynamo/eval_frame.py"
    else:
        name, path = "_zopt_fake_wrapper", os.path.join(os.path.dirname(torch.__file__),
                                                          "_zopt_fake_wrapper.py")
    mod = types.ModuleType(name)
    mod.__file__ = path
    code = compile("def _fn(fn, *args, **kwargs):\n    return fn(*args, **kwargs)\n", path, "exec")
    exec(code, mod.__dict__)
    return mod._fn


@pytest.mark.parametrize("how", ["module name", "file"])
def test_warnings_name_the_user_not_torch_wrappers(steps, how):
    """torch 2 wraps load_state_dict (and step, zero_grad...) in
    torch._dynamo's disable wrapper: a warning zopt raises inside names
    the first frame outside zopt AND torch, the user's line (before: the
    wrapper's file, torch/_dynamo/eval_frame.py)."""
    st = steps(rule="adamw", layout="bf16_master")
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3).to(torch.bfloat16)
    opt = zopt.Optimizer(st, m.parameters(), lr=LR, weight_decay=WD)
    for i in range(2):
        opt.zero_grad()
        m(torch.randn(4, 6).to(torch.bfloat16)).float().square().mean().backward()
        opt.step()
    sd = opt.state_dict()
    torch.manual_seed(9)  # other weights: loading the state sets them (warned)
    m2 = torch.nn.Linear(6, 3).to(torch.bfloat16)
    opt2 = zopt.Optimizer(st, m2.parameters(), lr=LR, weight_decay=WD)
    wrapper = _fake_torch_wrapper(how)
    with pytest.warns(zopt.optimizer.MasterWeightsWarning) as rec:
        wrapper(opt2.load_state_dict, sd)
    assert [w.filename for w in rec] == [__file__]
    opt.close()
    opt2.close()


def test_lr_scheduler_sees_step_calls_as_torch(steps):
    """How a scheduler learns that optimizer.step() ran: torch 1.13 wraps
    the instance's step to count optimizer._step_count; torch 2 (2.2+)
    wraps it to set optimizer._opt_called (and no longer counts). Emulated
    here as torch 2.11's LRScheduler does it (on any torch), then with the
    installed torch's own schedulers: zopt's step goes through either
    wrapper, and the "lr_scheduler.step() before optimizer.step()" warning
    comes for a zopt optimizer exactly when it comes for torch's."""
    import functools
    import weakref
    st = steps(rule="adamw", layout="f32")
    mz, mt = mlp(), mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)

    def track(opt):  # torch 2.11 lr_scheduler.LRScheduler.__init__'s patch_track_step_called
        ref, func = weakref.ref(opt), opt.step.__func__

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            o = ref()
            o._opt_called = True
            return func.__get__(o, o.__class__)(*args, **kwargs)
        wrapper._wrapped_by_lr_sched = True
        opt.step = wrapper

    for o, m in ((oz, mz), (ot, mt)):
        track(o)
        backward(m, 0)
        o.step()
        assert o._opt_called is True
    assert oz.step_count() == 1
    close_to_torch(mz, mt)
    del oz.step, ot.step, oz._opt_called, ot._opt_called

    def warned(opt, first):
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            if first == "optimizer":
                opt.step()
            s.step()
        return [str(w.message)[:40] for w in ws if "lr_scheduler.step()" in str(w.message)]
    got = {first: (warned(oz, first), warned(ot, first)) for first in ("scheduler", "optimizer")}
    assert got["scheduler"][1] and not got["optimizer"][1], got  # torch's own: warned, not
    assert all(z == t for z, t in got.values()), got
    oz.close()


def test_gpu_step_inside_a_capture_meets_no_torch_capture_check(steps, gpu_env, monkeypatch):
    """torch 2's graph-capture health check (_accelerator_graph_capture_health_check,
    _cuda_graph_capture_health_check: capturable=False refused inside a
    capture) runs inside torch's own rules' step(), not in the base class's
    step wrapper that zopt's step() goes through: a zopt GPU step inside a
    (faked) capture, with CUDA (faked) present, never calls it; zopt's GPU
    steps capture, and zopt refuses what a capture cannot hold itself."""
    fc, rec, mode = gpu_env
    mode("gpu")

    def refuse(self):
        raise AssertionError("torch's capture health check was called on a zopt optimizer")
    for name in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        monkeypatch.setattr(torch.optim.Optimizer, name, refuse, raising=False)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    for p in ps:
        p.grad = torch.randn(5)
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=LR)
    opt.step()  # warm-up, outside
    n = len(rec.calls("zopt_optimizer_step"))
    fc.capturing = True
    opt.step()  # captured: enqueued, through torch's step wrapper
    fc.capturing = False
    assert len(rec.calls("zopt_optimizer_step")) == n + 1
    assert torch.cuda.is_available() and type(opt).step.hooked  # the fakes, torch's wrapper
    opt.close()

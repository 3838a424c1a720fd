"""zopt.Optimizer over params of several dtypes (parameter classes stepped as
one by zopt_optimizer_step_linked), beside torch: the torch reference keeps
f32 master copies of every param, clips them with
torch.nn.utils.clip_grad_norm_ over ALL params and steps torch.optim.AdamW /
SGD; the bf16 params are the rounded masters. Every element is checked every
step, with tolerances a per-class norm (instead of the global one) fails: the
tests also run that wrong formula and check that it is caught. Also: an Inf
in one class skips every class, frozen and None-grad params, schedulers,
state_dict both ways with torch.optim.AdamW, checkpoint files, add_param_group,
master refreshes, ZeRO-3 gather/release at one rank, and f32 gradients of the
bf16 class accumulated by the hooks (test_main_grad.py has the rest).
(Longer than ~800 lines: one reference model and its fixtures serve every
test of the several-class optimizer.)"""
import copy
import math
import os
import warnings

import numpy as np
import pytest
import torch

import zopt
from zopt import steps as S

BF, F32 = torch.bfloat16, torch.float32


def classes(steps, rule, **kw):
    """{class: Step} of zopt.steps.<rule>(..., classes=...), compiled through
    the test session's step cache."""
    texts = S.BUILDERS[rule].text(comments=False, **kw)
    return {c: steps.text(t) for c, t in texts.items()}


def bits(t):
    t = t.detach()
    return t.view(torch.int16).clone() if t.dtype == BF else t.clone()


def same_bits(a, b):
    return all(torch.equal(bits(p), bits(q)) for p, q in zip(a, b))


def master_of(opt, p):
    """The weight the update changes: the f32 master of a bf16 param, the
    param itself otherwise."""
    if p.dtype == BF:
        return torch.from_numpy(opt.read_state(p, "master")).view(p.shape) \
            if p.is_contiguous() else None
    return p.detach()


def assert_close(a, r, rtol, what, atol_frac=0.0):
    """|a - r| <= rtol * max(|r|, 0.1 max|r|) + atol_frac * max|r|, every element."""
    a = a.detach().double().reshape(-1)
    r = r.detach().double().reshape(-1)
    mx = float(r.abs().max()) if r.numel() else 0.0
    bound = rtol * torch.maximum(r.abs(), torch.tensor(0.1 * mx)) + atol_frac * mx
    err = (a - r).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err / bound.clamp_min(1e-300), torch.zeros_like(err))))
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} elements off; worst [{i}] "
                             f"got {a[i].item()!r} want {r[i].item()!r} (bound {bound[i].item():.3g})")
    return float((err / bound.clamp_min(1e-300)).max()) if a.numel() else 0.0


def max_rel(a, r):
    a, r = a.detach().double().reshape(-1), r.detach().double().reshape(-1)
    mx = float(r.abs().max())
    return float(((a - r).abs() / torch.maximum(r.abs(), torch.tensor(0.1 * mx))).max())


def rounded_like(master, p):
    """A bf16 param as the rounded master (RNE)."""
    return master.detach().to(p.dtype)


# ---- the global norm: SGD with momentum, where the clip coefficient shows ----

SHAPES = [("bf16", (64, 33)), ("f32", (33,)), ("bf16", (17, 64)), ("f32", (1000,)),
          ("bf16", (5,)), ("f32", (3, 7))]


def _random_params(rng, shapes=SHAPES):
    out = []
    for c, sh in shapes:
        x = torch.from_numpy(rng.standard_normal(sh).astype(np.float32))
        out.append(torch.nn.Parameter(x.to(BF if c == "bf16" else F32)))
    return out


def test_sgd_momentum_clips_by_one_global_norm(steps):
    """SGD with momentum is linear in the gradient, so a wrong clip
    coefficient shows directly in every element: zopt matches the torch
    reference (clip_grad_norm_ over all params, SGD on f32 masters) to
    ~1e-6, and a per-class norm would be off by thousands of times that."""
    cl = classes(steps, "sgd", clip=1.0, classes={"bf16": dict(master="f32"), "f32": {}})
    rng = np.random.default_rng(0)
    params = _random_params(rng)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    wrong = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    opt = zopt.Optimizer(cl, params, **kw)
    assert list(opt.parts) == ["bf16", "f32"] and type(opt).__name__ == "MixedOptimizer"
    ref = torch.optim.SGD(masters, **kw)
    wref = torch.optim.SGD(wrong, **kw)
    worst_wrong = 0.0
    for s, scale in enumerate([1.0, 0.3, 0.004, 2.0, 0.5, 0.01]):
        grads = [torch.from_numpy((rng.standard_normal(tuple(p.shape)) * scale)
                                  .astype(np.float32)).to(p.dtype) for p in params]
        for p, m, w, g in zip(params, masters, wrong, grads):
            p.grad = g.clone()
            m.grad = g.float()
            w.grad = g.float()
        norm = float(torch.nn.utils.clip_grad_norm_(masters, 1.0))
        for c in ("bf16", "f32"):  # the wrong formula: each class by its own norm
            torch.nn.utils.clip_grad_norm_([w for w, p in zip(wrong, params)
                                            if (p.dtype == BF) == (c == "bf16")], 1.0)
        ref.step()
        wref.step()
        opt.step()
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5), s
        assert not opt.last_skipped
        for i, (p, m, w) in enumerate(zip(params, masters, wrong)):
            got = master_of(opt, p)
            assert_close(got, m, 2e-6, f"step {s} param {i} ({p.dtype})")
            if p.dtype == BF:  # the param is the rounded master, exactly
                assert torch.equal(bits(p), bits(rounded_like(got, p)))
            worst_wrong = max(worst_wrong, max_rel(w, m))
    assert worst_wrong > 100 * 2e-6, "the per-class norm must fail this test's tolerance"


# ---- AdamW on a model with bf16 Linear layers and an f32 LayerNorm ------------

class Net(torch.nn.Module):
    """bf16 Linear -> f32 LayerNorm -> bf16 Linear (torch.autocast-like)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(12, 32).to(BF)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 4).to(BF)
        with torch.no_grad():  # LayerNorm's weight and bias away from 1 and 0
            self.norm.weight.add_(torch.randn(32) * 0.1)
            self.norm.bias.add_(torch.randn(32) * 0.1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x.to(BF))).float()
        return self.fc2(self.norm(h).to(BF)).float()


def batch(i, n=16):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 12, generator=g), torch.randn(n, 4, generator=g)


def loss_of(model, i):
    x, y = batch(i)
    return torch.nn.functional.mse_loss(model(x), y)


class TorchRef:
    """torch's mixed-precision recipe: f32 master copies of every param,
    clip_grad_norm_ over all of them, a torch optimizer on the masters, the
    model's params = the masters rounded (bf16 ones RNE)."""

    def __init__(self, model, opt_cls, clip, per_class=False, **kw):
        self.model = model
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = opt_cls(self.masters, **kw)
        self.of = {id(p): m for p, m in zip(self.params, self.masters)}
        self.clip = clip
        self.per_class = per_class
        self.norm = None

    def step(self, backward):
        """backward(model) runs the backward, or returns the gradients."""
        self.model.zero_grad(set_to_none=True)
        grads = backward(self.model)
        if grads is None:
            grads = [p.grad for p in self.params]
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else g.float()
        mine = {id(m) for g in self.opt.param_groups for m in g["params"]}
        stepped = [(m, p) for m, p in zip(self.masters, self.params)
                   if id(m) in mine and m.grad is not None]
        if self.clip is not None:
            if self.per_class:
                for dt in (BF, F32):
                    self.norm = torch.nn.utils.clip_grad_norm_(
                        [m for m, p in stepped if p.dtype == dt], self.clip)
            else:
                self.norm = float(torch.nn.utils.clip_grad_norm_(
                    [m for m, _ in stepped], self.clip))
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)


def check_against(opt, model, ref, what, rtol=1e-5):
    for i, (p, m) in enumerate(zip(model.parameters(), ref.masters)):
        assert_close(master_of(opt, p), m, rtol, f"{what}: param {i} ({p.dtype})")
        if p.dtype == BF:
            # rounded masters: bit-identical but where the two masters round
            # to neighbours (they differ in their last f32 bits)
            diff = (bits(p) != bits(rounded_like(m, p))).sum().item()
            assert diff <= max(1, p.numel() // 100), f"{what}: param {i}: {diff} bf16 values"


ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def test_adamw_model_side_by_side_with_torch(steps):
    """bf16 Linears with f32 masters and an f32 LayerNorm, clipped at a
    max_norm that is active every step: every element of every param (and
    the bf16 params as the rounded masters) beside the torch reference, for
    8 steps; the reference with a per-class norm drifts off."""
    cl = classes(steps, "adamw", clip=0.05, classes={"bf16": dict(master="f32"), "f32": {}})
    mz, mt, mw = Net(), Net(), Net()
    opt = zopt.Optimizer(cl, mz.parameters(), **ADAMW)
    ref = TorchRef(mt, torch.optim.AdamW, 0.05, foreach=False, **ADAMW)
    bad = TorchRef(mw, torch.optim.AdamW, 0.05, per_class=True, foreach=False, **ADAMW)
    worst_bad = 0.0
    for s in range(8):
        opt.zero_grad()
        loss_of(mz, s).backward()
        opt.step()
        ref.step(lambda m: loss_of(m, s).backward())
        bad.step(lambda m: loss_of(m, s).backward())
        assert ref.norm > 0.05 and opt.last_grad_norm == pytest.approx(ref.norm, rel=1e-4)
        check_against(opt, mz, ref, f"step {s}")
        worst_bad = max(worst_bad, max(max_rel(master_of(opt, p), m) / 1e-5
                                       for p, m in zip(mz.parameters(), bad.masters)))
    assert worst_bad > 10, "a per-class norm must fail this test's tolerance"
    # torch's state[p] layout, per class
    assert set(opt.state[mz.fc1.weight]) == {"step", "master", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[mz.norm.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    for p, m in zip(mz.parameters(), ref.masters):
        assert_close(opt.state[p]["exp_avg"].float(), ref.opt.state[m]["exp_avg"], 1e-4,
                     "exp_avg", atol_frac=1e-5)


# ---- an Inf in one class skips every class --------------------------------------

@pytest.mark.parametrize("layout", ["bf16_clip", "f16_loss_scale"])
def test_inf_in_one_class_skips_every_class(steps, layout):
    if layout == "bf16_clip":
        cl = classes(steps, "adamw", clip=1.0, classes={"bf16": dict(master="f32"), "f32": {}})
        dt = BF
    else:  # f16 params with an f32 master: loss scaling in every class
        cl = classes(steps, "adamw", classes={"f16": dict(master="f32"), "f32": {}})
        dt = torch.float16
    assert all(s.loss_scaled for s in cl.values()) == (layout != "bf16_clip")
    rng = np.random.default_rng(3)
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(n).astype(np.float32))
                                 .to(d)) for n, d in ((300, dt), (40, F32), (7, dt), (9, F32))]
    opt = zopt.Optimizer(cl, params, lr=1e-2,
                         loss_scaler=dict(init_scale=256.0, growth_interval=3))

    def grads(k, inf_at=None):
        S_ = opt.loss_scale
        for i, p in enumerate(params):
            g = torch.from_numpy(rng.standard_normal(p.numel()).astype(np.float32) * S_)
            if inf_at == i:
                g[5] = float("inf")
            p.grad = g.to(p.dtype)
    for k in range(2):
        grads(k)
        opt.step()
        assert not opt.last_skipped
    before = [p.detach().clone() for p in params]
    sd = opt.state_dict()
    scale = opt.loss_scale
    for bad in (1, 2):  # the Inf in the f32 class, then in the 16-bit class
        grads(9, inf_at=bad)
        opt.step()
        assert opt.last_skipped and not math.isfinite(opt.last_grad_norm)
        assert same_bits(params, before), "a skipped step changed a param"
        sd2 = opt.state_dict()
        for t in sd["state"]:
            for key, v in sd["state"][t].items():
                assert torch.equal(v, sd2["state"][t][key]), (bad, t, key)
        if layout != "bf16_clip":  # one scaler, backed off in every class
            scale /= 2
            assert [o.loss_scale for o in opt.parts.values()] == [scale, scale]
    assert [opt.tensor_step(p) for p in params] == [2] * 4
    grads(10)
    opt.step()
    assert not opt.last_skipped and not same_bits(params, before)


# ---- frozen and None-grad params, schedulers -------------------------------------

def test_frozen_and_none_grads_in_one_class_with_scheduler(steps):
    """A frozen bf16 Linear (requires_grad=False) and an f32 param without
    a gradient are left alone (no decay, no step count) while the rest
    trains beside torch; OneCycleLR (with beta1 cycling) over two groups
    reaches every class's runtime."""
    cl = classes(steps, "adamw", clip=0.5, classes={"bf16": dict(master="f32"), "f32": {}})

    def build():
        m = Net()
        m.fc2.weight.requires_grad_(False)
        m.unused = torch.nn.Parameter(torch.ones(5))  # f32, never in the graph
        return m

    def groups(m):
        return [dict(params=[m.fc1.weight, m.fc2.weight, m.norm.weight]),
                dict(params=[m.fc1.bias, m.norm.bias, m.fc2.bias, m.unused], weight_decay=0.0)]

    def sched(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=8,
                                                   base_momentum=0.85, max_momentum=0.95)
    mz, mt = build(), build()
    opt = zopt.Optimizer(cl, groups(mz), **ADAMW)
    ref = TorchRef(mt, torch.optim.AdamW, 0.5, foreach=False, **ADAMW)
    # the reference's groups mirror zopt's
    ref.opt = torch.optim.AdamW(
        [dict(params=[ref.of[id(p)] for p in g["params"]], weight_decay=g.get("weight_decay", 0.1))
         for g in groups(mt)], foreach=False, **dict(ADAMW, weight_decay=0.1))
    sz, st = sched(opt), sched(ref.opt)
    frozen0 = bits(mz.fc2.weight)
    for s in range(8):
        opt.zero_grad(set_to_none=True)
        loss_of(mz, s).backward()
        opt.step()
        ref.step(lambda m: loss_of(m, s).backward())
        check_against(opt, mz, ref, f"step {s}", rtol=2e-5)
        for o in opt.parts.values():
            for gid, g in enumerate(opt.param_groups):
                assert o.get_hyper(gid, "lr") == g["lr"] == ref.opt.param_groups[gid]["lr"]
                assert o.get_hyper(gid, "beta1") == g["betas"][0]
        sz.step()
        st.step()
    assert torch.equal(bits(mz.fc2.weight), frozen0) and torch.equal(mz.unused, torch.ones(5))
    assert opt.tensor_step(mz.fc2.weight) == 0 and opt.tensor_step(mz.unused) == 0
    assert opt.state[mz.unused] == {} and mz.unused not in opt.state
    assert opt.tensor_step(mz.fc1.weight) == 8 and len(opt.state) == 5
    assert opt.step_count(0) == 8


# ---- state_dict both ways, checkpoint files ---------------------------------------

def test_state_dict_both_ways_with_torch_adamw(steps):
    """zopt's state_dict (all classes, torch's indices) loads into
    torch.optim.AdamW over the f32 masters, and torch's into zopt; both go
    on training side by side."""
    cl = classes(steps, "adamw", clip=0.05, classes={"bf16": dict(master="f32"), "f32": {}})
    mz, mt = Net(), Net()
    opt = zopt.Optimizer(cl, mz.parameters(), **ADAMW)
    ref = TorchRef(mt, torch.optim.AdamW, 0.05, foreach=False, **ADAMW)
    for s in range(3):
        opt.zero_grad()
        loss_of(mz, s).backward()
        opt.step()
        ref.step(lambda m: loss_of(m, s).backward())
    zsd, tsd = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.opt.state_dict())
    assert [c["class"] for c in zsd["zopt"]["classes"]] == ["bf16", "f32"]
    assert sorted(zsd["state"]) == list(range(6))
    # zopt -> torch: a fresh AdamW over f32 masters of zopt's weights
    mt2 = copy.deepcopy(mz)
    ref2 = TorchRef(mt2, torch.optim.AdamW, 0.05, foreach=False, **dict(ADAMW, lr=1.0))
    for m, p in zip(ref2.masters, mz.parameters()):
        with torch.no_grad():
            m.copy_(master_of(opt, p))
    ref2.opt.load_state_dict(zsd)
    assert ref2.opt.param_groups[0]["lr"] == ADAMW["lr"]
    # torch -> zopt: a fresh mixed optimizer on the reference's model. torch's
    # state_dict has no master: zopt makes it from the (bf16) params, as a
    # fresh torch recipe (refb) does; both go on from there.
    mz2, mtb = copy.deepcopy(mt), copy.deepcopy(mt)
    opt2 = zopt.Optimizer(cl, mz2.parameters(), lr=1.0)
    opt2.load_state_dict(tsd)
    refb = TorchRef(mtb, torch.optim.AdamW, 0.05, foreach=False, **dict(ADAMW, lr=1.0))
    refb.opt.load_state_dict(tsd)
    assert opt2.param_groups[0]["lr"] == ADAMW["lr"]
    for o in opt2.parts.values():
        assert o.get_hyper(0, "lr") == ADAMW["lr"]
    for p, m in zip(mz2.parameters(), ref.masters):
        assert opt2.tensor_step(p) == 3
        assert torch.equal(opt2.state[p]["exp_avg"].float(), ref.opt.state[m]["exp_avg"])
        if p.dtype == BF:  # no master in torch's: made from the params
            assert torch.equal(opt2.state[p]["master"], p.detach().float())
    for s in range(3, 6):
        opt.zero_grad()
        loss_of(mz, s).backward()
        opt.step()
        ref2.step(lambda m: loss_of(m, s).backward())
        check_against(opt, mz, ref2, f"zopt vs torch loaded from zopt, step {s}")
        opt2.zero_grad()
        loss_of(mz2, s).backward()
        opt2.step()
        refb.step(lambda m: loss_of(m, s).backward())
        check_against(opt2, mz2, refb, f"zopt loaded from torch, step {s}")
    # a zopt state_dict round trip into a fresh zopt optimizer: bit-exact
    mz3 = copy.deepcopy(mz)
    opt3 = zopt.Optimizer(cl, mz3.parameters(), lr=1.0)
    opt3.load_state_dict(opt.state_dict())
    for s in range(6, 8):
        for m, o in ((mz, opt), (mz3, opt3)):
            o.zero_grad()
            loss_of(m, s).backward()
            o.step()
    assert same_bits(mz.parameters(), mz3.parameters())


def test_load_state_dict_failure_changes_nothing(steps):
    """The f32 class's part of a state_dict is bad (a state of the wrong
    shape): the bf16 class, loaded first, is put back."""
    cl = classes(steps, "adamw", classes={"bf16": dict(master="f32"), "f32": {}})
    m = Net()
    opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
    for s in range(2):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    for t in bad["state"]:
        bad["state"][t]["exp_avg"] = bad["state"][t]["exp_avg"] + 1.0  # would change all
    bad["state"][2]["exp_avg_sq"] = torch.zeros(7)  # the LayerNorm weight: 32 elements
    bad["param_groups"][0]["lr"] = 0.5
    with pytest.raises(zopt.ZoptError, match="exp_avg_sq"):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    for t in good["state"]:
        for k, v in good["state"][t].items():
            assert torch.equal(v, now["state"][t][k]), (t, k)
    assert opt.param_groups[0]["lr"] == ADAMW["lr"]
    assert all(o.get_hyper(0, "lr") == ADAMW["lr"] for o in opt.parts.values())
    # another rule is refused before anything changes
    sgd = torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(zopt.ZoptError, match="allow_rule_change"):
        opt.load_state_dict(sgd.state_dict())


def test_checkpoint_files_round_trip(steps, tmp_path):
    """save() writes `path` (the bf16 class) and `path.f32`; load() resumes
    bit-exactly; a missing or foreign class file is refused and a failed
    load changes nothing."""
    cl = classes(steps, "adamw", clip=0.05, classes={"bf16": dict(master="f32"), "f32": {}})
    m = Net()
    opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
    for s in range(3):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    path = str(tmp_path / "ck")
    opt.save(path)
    assert opt.checkpoint_files(path) == {"bf16": path, "f32": path + ".f32"}
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.f32"]
    weights = copy.deepcopy(m.state_dict())
    for s in range(3, 6):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    after = [p.detach().clone() for p in m.parameters()]
    sd_after = opt.state_dict()
    # a fresh optimizer: model weights first, then the optimizer's files
    m2 = Net(seed=7)
    m2.load_state_dict(weights)
    opt2 = zopt.Optimizer(cl, m2.parameters(), lr=1.0)
    opt2.load(path)
    assert opt2.param_groups[0]["lr"] == ADAMW["lr"] and opt2.tensor_step(m2.fc1.weight) == 3
    for s in range(3, 6):
        opt2.zero_grad()
        loss_of(m2, s).backward()
        opt2.step()
    assert same_bits(m2.parameters(), after)
    # refusals: nothing changes
    os.rename(path + ".f32", path + ".moved")
    with pytest.raises(zopt.ZoptError, match=r"ck\.f32.*does not exist"):
        opt.load(path)
    os.rename(path + ".moved", path + ".f32")
    other = str(tmp_path / "other")   # the f32 class's file where the bf16 class reads
    os.link(path + ".f32", other)
    os.link(path + ".f32", other + ".f32")
    with pytest.raises(zopt.ZoptError, match="not this class's checkpoint"):
        opt.load(other)
    with open(path + ".f32", "r+b") as f:  # a corrupt f32 file: the bf16 class is put back
        f.seek(200)
        f.write(b"\xff" * 8)
    with pytest.raises(zopt.ZoptError):
        opt.load(path)
    now = opt.state_dict()
    for t in sd_after["state"]:
        for k, v in sd_after["state"][t].items():
            assert torch.equal(v, now["state"][t][k]), (t, k)
    assert same_bits(m.parameters(), after)


# ---- add_param_group, writes into params, the surface ----------------------------

def test_add_param_group_new_class_and_surface(steps):
    cl = classes(steps, "adamw", clip=0.05, classes={"bf16": dict(master="f32"), "f32": {}})
    mz, mt = Net(), Net()
    bf = lambda m: [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]  # noqa: E731
    opt = zopt.Optimizer(cl, bf(mz), **ADAMW)
    assert list(opt.parts) == ["bf16"] and "no params yet: f32" in repr(opt)
    ref = TorchRef(mt, torch.optim.AdamW, 0.05, foreach=False, **ADAMW)
    ref.opt = torch.optim.AdamW([ref.of[id(p)] for p in bf(mt)], foreach=False, **ADAMW)
    for s in range(2):
        opt.zero_grad()
        loss_of(mz, s).backward()
        opt.step()
        ref.step(lambda m: loss_of(m, s).backward())
    opt.add_param_group(dict(params=list(mz.norm.parameters()), lr=2e-2))
    ref.opt.add_param_group(dict(params=[ref.of[id(p)] for p in mt.norm.parameters()],
                                 lr=2e-2))
    assert list(opt.parts) == ["bf16", "f32"] and len(opt.param_groups) == 2
    assert opt.tensor_step(mz.fc1.weight) == 2 and opt.tensor_step(mz.norm.weight) == 0
    # bf16 part got an empty group 1, the f32 part an empty group 0
    assert [len(g["params"]) for g in opt.parts["f32"].param_groups] == [0, 2]
    assert [len(g["params"]) for g in opt.parts["bf16"].param_groups] == [4, 0]
    for s in range(2, 5):
        opt.zero_grad()
        loss_of(mz, s).backward()
        opt.step()
        ref.step(lambda m: loss_of(m, s).backward())
        check_against(opt, mz, ref, f"step {s}")
    # the surface
    x, y = batch(9)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mz(x), y)
        loss.backward()
        return loss
    seen = []
    h = opt.register_metrics_hook(lambda o, m: seen.append(m))
    loss = opt.step(closure)
    h.remove()
    assert isinstance(loss, torch.Tensor) and seen[0]["loss"] == pytest.approx(loss.item())
    mt_ = seen[0]
    assert mt_["active_tensors"] == 6 and mt_["classes"] == ["bf16", "f32"]
    assert mt_["updated_elems"] == sum(p.numel() for p in mz.parameters())
    assert mt_["bytes"] == mt_["updated_elems"] * 28  # both classes: 28 bytes per element
    r = repr(opt)
    assert "bf16: adamw_bf16_wf32_sf32_clip" in r and "Parameter Group 1" in r
    info = opt.memory_info()
    assert info["num_params"] == sum(p.numel() for p in mz.parameters())
    assert set(info["classes"]) == {"bf16", "f32"}
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in mz.parameters())
    opt.step()  # no gradients at all: nothing happens
    assert opt.last_metrics["no_grads"]
    with pytest.raises(zopt.ZoptError, match="twice"):
        opt.add_param_group(dict(params=[mz.fc1.weight]))
    with pytest.raises(zopt.ZoptError, match=r"float16.*no parameter class"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]))
    assert len(opt.param_groups) == 2 and list(opt.parts) == ["bf16", "f32"]
    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(opt)
    opt.close()
    with pytest.raises(zopt.ZoptError, match="closed"):
        opt.step()


def test_user_writes_refresh_the_master_and_set_hyper(steps):
    cl = classes(steps, "adamw", classes={"bf16": dict(master="f32"), "f32": {}})
    m = Net()
    opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
    for s in range(2):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    m.load_state_dict(Net(seed=5).state_dict())   # pretrained weights, both classes
    want = [p.detach().clone() for p in m.parameters()]
    opt.set_hyper(0, "lr", 0.0)
    opt.set_hyper(0, "weight_decay", 0.0)
    assert opt.param_groups[0]["lr"] == 0.0
    assert all(o.get_hyper(0, "lr") == 0.0 for o in opt.parts.values())
    opt.zero_grad()
    loss_of(m, 3).backward()
    opt.step()
    assert same_bits(m.parameters(), want) and opt.refreshes >= 4
    assert torch.equal(opt.state[m.fc1.weight]["master"], m.fc1.weight.detach().float())


def test_mapping_errors(steps):
    cl = classes(steps, "adamw", classes={"bf16": dict(master="f32"), "f32": {}})
    clip = classes(steps, "adamw", clip=1.0, classes={"f32": {}})
    sgd = classes(steps, "sgd", classes={"f32": {}})
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3, dtype=BF))
    for mapping, needle in (
            ({"bf16": cl["bf16"], "f32": clip["f32"]}, "clipping"),
            ({"bf16": cl["bf16"], "f32": sgd["f32"]}, "hyperparameter slots"),
            ({"f32": cl["bf16"]}, "has bf16 params, not f32"),
            ({"int8": cl["f32"]}, "not a dtype"),
            ({torch.float32: cl["f32"], "float32": cl["f32"]}, "two keys"),
            ({}, "empty")):
        with pytest.raises(zopt.ZoptError, match=needle):
            zopt.Optimizer(mapping, [p, q])
    with pytest.raises(zopt.ZoptError, match=r"\['params'\]\[1\] \(shape \(2,\), float16\).*"
                                             r"bf16 \('adamw_bf16"):
        zopt.Optimizer(cl, [p, torch.nn.Parameter(torch.ones(2, dtype=torch.float16))])
    with pytest.raises(zopt.ZoptError, match="momentum"):
        zopt.Optimizer(cl, [p, q], momentum=0.9)
    # one class given as a mapping (here a step.so path) still works: a
    # MixedOptimizer of one part
    o = zopt.Optimizer({torch.float32: cl["f32"].path}, [p])
    p.grad = torch.ones(3)
    o.step()
    assert o.tensor_step(p) == 1


# ---- ZeRO-3 at one rank -----------------------------------------------------------------

@pytest.mark.parametrize("f32grad", [False, True])
def test_zero3_classes_gather_release_one_rank(steps, f32grad):
    """ZeRO-3 classes (the runtime holds the params) train bit-identically
    to the ZeRO-0 classes, gathered after every step or through
    zopt.zero3_hooks (per module, both classes), also with f32 gradients
    of the bf16 class (its hooks beside zero3_hooks')."""
    bf = dict(master="f32", grad="f32") if f32grad else dict(master="f32")
    kw = dict(clip=0.05, classes={"bf16": bf, "f32": {}})
    z0 = classes(steps, "adamw", **kw)
    z3 = classes(steps, "adamw", zero_stage=3, **kw)

    def run(cl, mode):
        m = Net()
        opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
        hooks = zopt.zero3_hooks(m, opt) if mode == "hooks" else None
        for s in range(3):
            opt.zero_grad()
            loss_of(m, s).backward()
            opt.step()
            if hooks is not None:
                assert len(opt.released_params) == 6
        opt.gather_params()
        if hooks is not None:
            hooks.remove()
        return m
    ref = run(z0, None)
    for mode in ("step", "hooks"):
        assert same_bits(run(z3, mode).parameters(), ref.parameters()), mode
    with pytest.raises(zopt.ZoptError, match="ZeRO-3"):
        zopt.Optimizer(z0, Net().parameters()).release_params()


# ---- f32 gradients of bf16 params in a mixed model ---------------------------------

def test_f32_grads_in_a_mixed_model_match_torch(steps):
    """bf16 Linears with f32 gradients and f32 masters, an f32 LayerNorm:
    two micro-batches per step accumulated in f32 by the hooks, clipped by
    the global norm; beside the torch reference that accumulates the same
    bf16 micro-batch gradients in f32."""
    cl = classes(steps, "adamw", clip=0.05,
                 classes={"bf16": dict(master="f32", grad="f32"), "f32": {}})
    assert cl["bf16"].f32_grads and not cl["f32"].f32_grads
    mz, mt = Net(), Net()
    opt = zopt.Optimizer(cl, mz.parameters(), **ADAMW)
    ref = TorchRef(mt, torch.optim.AdamW, 0.05, foreach=False, **ADAMW)

    def f32_sum(m, s):  # each micro-batch's gradient (bf16 for the Linears) summed in f32
        acc = [torch.zeros(p.shape) for p in m.parameters()]
        for k in range(2):
            m.zero_grad(set_to_none=True)
            loss_of(m, 10 * s + k).backward()
            for a, p in zip(acc, m.parameters()):
                a += p.grad.float()
        return acc
    for s in range(5):
        opt.zero_grad()
        for k in range(2):
            loss_of(mz, 10 * s + k).backward()
        assert mz.fc1.weight.grad is None and mz.fc1.weight.main_grad.dtype == F32
        assert mz.norm.weight.grad is not None   # the f32 class: torch's own .grad
        opt.step()
        ref.step(lambda m: f32_sum(m, s))
        assert opt.last_grad_norm == pytest.approx(ref.norm, rel=1e-4)
        check_against(opt, mz, ref, f"step {s}")


# ---- settings reach every class; a class added later joins the loss scaler -----------

def test_add_param_group_refused_by_a_class_brings_no_new_class(steps):
    """A group that an existing class refuses (its f32 param overlaps one the
    class holds) leaves no part behind for the class the group would have
    brought (bf16): the optimizer is as before and steps; the same group
    without the overlap then adds the class."""
    cl = classes(steps, "sgd", classes={"bf16": dict(master="f32"), "f32": {}})
    rng = np.random.default_rng(17)
    a, b = _random_params(rng, [("f32", (20,)), ("bf16", (8,))])
    opt = zopt.Optimizer(cl, [a], lr=0.1, momentum=0.9)
    overlap = torch.nn.Parameter(a.data[5:15])  # a view into the f32 param
    with pytest.raises(zopt.ZoptError, match="overlap"):
        opt.add_param_group(dict(params=[b, overlap]))
    assert list(opt.parts) == ["f32"] and len(opt.param_groups) == 1
    assert "no params yet: bf16" in repr(opt) and opt.rebuilds == 0
    g = torch.from_numpy(rng.standard_normal(20).astype(np.float32))
    a0 = a.detach().clone()
    a.grad = g.clone()
    opt.step()  # plain SGD's first step: p -= lr * g
    want = (a0.double() - 0.1 * g.double()).float()
    torch.testing.assert_close(a.detach(), want, rtol=1e-6, atol=1e-7)
    assert opt.tensor_step(a) == 1
    opt.add_param_group(dict(params=[b]))
    assert list(opt.parts) == ["bf16", "f32"] and opt.tensor_step(b) == 0


def test_settings_reach_every_class_and_a_new_class_joins_the_scaler(steps):
    cl = classes(steps, "adamw", classes={"f16": dict(master="f32"), "f32": {}})
    h = [torch.nn.Parameter(torch.ones(50, dtype=torch.float16)) for _ in range(2)]
    f = [torch.nn.Parameter(torch.ones(30)) for _ in range(2)]
    opt = zopt.Optimizer(cl, [h[0]], lr=1e-2, num_threads=1, seed=7, grad_divisor=3,
                         bucket_elems=65536, loss_scaler=dict(init_scale=2.0 ** 10,
                                                              growth_interval=2))
    assert list(opt.parts) == ["f16"]
    for k in range(4):  # good, good (x2), overflow (/2), good
        h[0].grad = torch.full((50,), float("inf") if k == 2 else 0.5,
                               dtype=torch.float16)
        opt.step()
    assert opt.loss_scale == 2.0 ** 10 and opt.state_dict()["zopt"]["loss_scaler"]["good_steps"] == 1
    opt.add_param_group(dict(params=[h[1], f[0], f[1]], lr=5e-3))
    assert list(opt.parts) == ["f16", "f32"]
    for o in opt.parts.values():   # every setting in every class, the new one too
        assert o.seed == 7 and o.grad_divisor == 3 and o.loss_scale == 2.0 ** 10
        assert o.num_threads == 1 and o.bucket_elems == 65536
        assert o.get_hyper(1, "lr") == 5e-3
    opt.set_seed(9)
    opt.grad_divisor = 1
    assert [(o.seed, o.grad_divisor) for o in opt.parts.values()] == [(9, 1), (9, 1)]
    for p in h + f:   # the linked step: the classes' scalers agree
        p.grad = torch.full(p.shape, 0.5 * opt.loss_scale, dtype=p.dtype)
    opt.step()
    assert not opt.last_skipped and opt.loss_scale == 2.0 ** 11  # grown in both
    assert [o.loss_scale for o in opt.parts.values()] == [2.0 ** 11] * 2
    assert opt.tensor_step(f[0]) == 1 and opt.tensor_step(h[0]) == 4


def test_a_class_without_gradients_in_a_step(steps):
    """Only the bf16 class has gradients: the f32 class is left alone (no
    decay, no step count), the norm is the bf16 class's, and the classes'
    scalers stay in step (the next linked step is accepted)."""
    cl = classes(steps, "sgd", clip=1.0, classes={"bf16": dict(master="f32"), "f32": {}})
    rng = np.random.default_rng(21)
    a, b = _random_params(rng, [("bf16", (10,)), ("f32", (7,))])
    b0 = b.detach().clone()
    opt = zopt.Optimizer(cl, [a, b], lr=0.1, momentum=0.9, weight_decay=0.5)
    ga = torch.from_numpy(rng.standard_normal(10).astype(np.float32)).to(BF)
    a.grad = ga.clone()
    opt.step()
    assert opt.last_grad_norm == pytest.approx(float(ga.double().norm()), rel=1e-12)
    assert torch.equal(b.detach(), b0) and opt.tensor_step(b) == 0
    assert opt.tensor_step(a) == 1 and opt.parts["f32"].step_count(0) == 0
    gb = torch.from_numpy(rng.standard_normal(7).astype(np.float32))
    a.grad, b.grad = ga.clone(), gb.clone()
    opt.step()
    want = math.sqrt(float(ga.double().square().sum() + gb.double().square().sum()))
    assert opt.last_grad_norm == pytest.approx(want, rel=1e-12)
    assert opt.tensor_step(b) == 1 and not torch.equal(b.detach(), b0)


def test_add_param_group_failure_puts_the_classes_back(steps):
    """The new group's f32 param overlaps an f32 param already in the
    optimizer: the f32 class refuses it after the bf16 class took its part
    of the group; the bf16 class is put back and training goes on as if
    nothing had been tried."""
    cl = classes(steps, "adamw", clip=0.5, classes={"bf16": dict(master="f32"), "f32": {}})
    rng = np.random.default_rng(8)
    base = torch.from_numpy(rng.standard_normal(40).astype(np.float32))

    def build():
        ps = _random_params(np.random.default_rng(9), [("bf16", (30,)), ("bf16", (6,))])
        return ps + [torch.nn.Parameter(base[:20].clone())]
    pa, pb = build(), build()
    oa = zopt.Optimizer(cl, pa[:1] + pa[2:], **ADAMW)
    ob = zopt.Optimizer(cl, pb[:1] + pb[2:], **ADAMW)
    gs = [[torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
           .to(p.dtype) for p in pa] for _ in range(4)]

    def step(ps, o, k):
        for p, g in zip(ps, gs[k]):
            p.grad = g.clone()
        o.step()
    step(pa, oa, 0)
    step(pb, ob, 0)
    overlap = torch.nn.Parameter(pa[2].data[5:15])   # a view into an f32 param
    with pytest.raises(zopt.ZoptError, match="overlap"):
        oa.add_param_group(dict(params=[pa[1], overlap]))
    assert len(oa.param_groups) == 1 and [len(o.param_groups) for o in oa.parts.values()] == [1, 1]
    assert oa.rebuilds == 2   # the bf16 class: extended, then put back
    for o in (oa, ob):
        o.add_param_group(dict(params=[pa[1] if o is oa else pb[1]], lr=5e-3))
    for k in (1, 2, 3):
        step(pa, oa, k)
        step(pb, ob, k)
    assert same_bits(pa, pb)
    sa, sb = oa.state_dict(), ob.state_dict()
    for t in sb["state"]:
        for key, v in sb["state"][t].items():
            assert torch.equal(sa["state"][t][key], v), (t, key)


# ---- model and master agree after loads; writes through state[p] ----------------------

def test_loaded_master_replaces_other_weights_in_every_class(steps, tmp_path):
    """The single-class policy over the classes: an optimizer state loaded
    into a model with other weights sets the params with a master (the
    bf16 class) to round(master) at once, one warning for all classes;
    a matching model is left alone without one; a model loaded afterwards
    wins; a refused load changes no param."""
    W = zopt.optimizer.MasterWeightsWarning
    cl = classes(steps, "adamw", classes={"bf16": dict(master="f32"), "f32": {}})
    m = Net()
    opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
    for s in range(2):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    msd, osd = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    opt.save(tmp_path / "ck")
    # a matching model (a resume): nothing changes, nothing warned
    m2 = Net(seed=7)
    m2.load_state_dict(msd)
    opt2 = zopt.Optimizer(cl, m2.parameters(), **ADAMW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(osd)
        opt2.load(tmp_path / "ck")
    assert same_bits(m2.parameters(), msd.values())
    # other weights: a refused load changes no param ...
    m3 = Net(seed=7)
    before = [p.detach().clone() for p in m3.parameters()]
    opt3 = zopt.Optimizer(cl, m3.parameters(), **ADAMW)
    bad = copy.deepcopy(osd)
    bad["state"][2]["exp_avg_sq"] = torch.zeros(7)  # the f32 class's LayerNorm weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(zopt.ZoptError, match="exp_avg_sq"):
            opt3.load_state_dict(bad)
    assert same_bits(m3.parameters(), before)
    # ... a load sets the bf16 params to their masters (the f32 class's
    # params are its weights: the model's own, kept)
    with pytest.warns(W, match=r"load_state_dict: .* in 4 of 4 params") as rec:
        opt3.load_state_dict(osd)
    assert len(rec) == 1 and rec[0].filename == __file__  # the user's line
    for (k, v), p, b in zip(msd.items(), m3.parameters(), before):
        assert torch.equal(bits(p), bits(v if p.dtype == BF else b)), k
        if p.dtype == BF:
            assert torch.equal(p.detach().float(), opt3.state[p]["master"].to(BF).float())
    # the model loaded after the optimizer state wins
    pre = Net(seed=5).state_dict()
    m3.load_state_dict(pre)
    opt3.set_hyper(0, "lr", 0.0)
    opt3.set_hyper(0, "weight_decay", 0.0)
    opt3.zero_grad()
    loss_of(m3, 3).backward()
    opt3.step()
    assert same_bits(m3.parameters(), pre.values())
    assert torch.equal(opt3.state[m3.fc1.weight]["master"], m3.fc1.weight.detach().float())
    # load() of the checkpoint files: the same
    m4 = Net(seed=7)
    opt4 = zopt.Optimizer(cl, m4.parameters(), **ADAMW)
    with pytest.warns(W, match=r"load: .* in 4 of 4 params"):
        opt4.load(tmp_path / "ck")
    for (k, v), p in zip(msd.items(), m4.parameters()):
        if p.dtype == BF:
            assert torch.equal(bits(p), bits(v)), k


def test_state_writes_reach_every_class(steps):
    """state[p] of either class: in-place changes and item assignment
    reach the class's runtime, a reset starts the param afresh, a master
    written also writes the (bf16) param."""
    cl = classes(steps, "adamw", classes={"bf16": dict(master="f32"), "f32": {}})
    m = Net()
    opt = zopt.Optimizer(cl, m.parameters(), **ADAMW)
    for s in range(2):
        opt.zero_grad()
        loss_of(m, s).backward()
        opt.step()
    for p in (m.fc1.weight, m.norm.weight):
        opt.state[p]["exp_avg"].zero_()
        assert not opt.read_state(p, "exp_avg").any(), p.dtype
        opt.state[p]["exp_avg_sq"] = torch.ones(p.shape)
        assert np.all(opt.read_state(p, "exp_avg_sq") == 1), p.dtype
        opt.state[p]["step"] = 5
        assert opt.tensor_step(p) == 5
    with pytest.raises(zopt.ZoptError, match="no state 'master'"):
        opt.state[m.norm.weight]["master"] = torch.zeros(32)
    w = torch.randn(m.fc2.weight.shape)
    opt.state[m.fc2.weight]["master"] = w
    assert torch.equal(m.fc2.weight.detach(), w.to(BF))
    del opt.state[m.norm.bias]
    opt.state[m.fc1.bias] = {}
    assert m.norm.bias not in opt.state and m.fc1.bias not in opt.state and len(opt.state) == 4
    opt.state = {}
    assert len(opt.state) == 0

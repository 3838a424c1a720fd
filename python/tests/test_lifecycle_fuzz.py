"""Randomized differential test of zopt.Optimizer's lifecycle (CPU steps):
one seeded random sequence of user actions is applied to a zopt.Optimizer
and to torch.optim (AdamW / Adam / SGD with momentum, Nesterov or not) over
float64 copies of the params, and every param, gradient and state element
is compared after every action.

What test_property.py does not: that one mutates step *descriptions* and
checks the runtime against the interpreter; this one fixes a few rules and
fuzzes what a training script does to the optimizer between steps:
gradients fresh / accumulated / kept / None, own tensors, views of one flat
buffer, one tensor shared by two params, transposed; zero_grad both ways;
requires_grad toggled; hyperparameters (and maximize) edited in
param_groups or by set_hyper, an lr scheduler; add_param_group after steps
(new dtype classes, empty groups); p.data replaced, swapped between two
params, or written in place (with and without a version bump); state[p]
items written, changed in place, reset, its 'step' set; state_dict() into
a new zopt optimizer, into torch and back; save()/load() into a new
optimizer; a rollback to an earlier state_dict or file; step(closure);
opt.clip_grad_norm_ and the compiled clip; several groups; AMSGrad; empty,
transposed and strided-view params; bf16 params with an f32 master beside
f32 params (step classes); refusals (bad lr, another rule's state_dict, a
duplicate param, a param of another shape, two params on one storage,
zero_grad or step(closure) between clip_grad_norm_ and step()), which must
raise the documented error and change nothing (bit for bit). A third of
the actions are followed by the next one without a read in between.

Tolerance (f32 math against float64, <= ~60 steps): every element within
1e-5 relative of the reference, judged against max(|r|, 0.1 * the largest
|r| the tensor had so far) (an EMA that cancelled carries the roundoff of
the larger terms it was made of). An f32 step rounds each stored value once
(6e-8 relative) plus a few ulp in the update, so these runs stay below
~3e-6; a wrong formula (a bias correction one step late, a dropped clip, a
per-class norm, a stale lr, the decay's sign) moves params by >= lr * 1e-3
~ 1e-5 .. 1e-4 relative and moments by far more
(test_the_harness_catches_a_wrong_formula). bf16 params: the master as f32
above; the param is round(master) exactly (after a load that kept it as
the other neighbour of its master, docs/USAGE.md section 4, one of the
two, until it steps) and within one bf16 ulp of round(reference).

ZOPT_FUZZ_CASES=N (default 40: about 4 s) and ZOPT_FUZZ_SEED pick the
cases, ZOPT_FUZZ_ACTIONS (default 40) the actions per case; docs/TESTING.md
has a long run and what it found (python/tests/test_lifecycle_finds.py)."""
import copy
import os
import random

import numpy as np
import pytest
import torch

import zopt
from zopt import bf16

CASES = int(os.environ.get("ZOPT_FUZZ_CASES", "40"))
SEED = int(os.environ.get("ZOPT_FUZZ_SEED", "0"))
ACTIONS = int(os.environ.get("ZOPT_FUZZ_ACTIONS", "40"))
RTOL = 1e-5

_STEPS = {}


def build_step(rule, mixed, clip, amsgrad=False):
    key = (rule, mixed, clip, amsgrad)
    if key not in _STEPS:
        kw = {} if clip is None else dict(clip=clip)
        if amsgrad:
            kw["amsgrad"] = True
        if mixed:
            kw["classes"] = {"bf16": dict(master="f32"), "f32": {}}
        if rule in ("adamw", "adam"):
            _STEPS[key] = getattr(zopt.steps, rule)(**kw)
        else:
            _STEPS[key] = zopt.steps.sgd(nesterov=(rule == "nesterov"), **kw)
    return _STEPS[key]


TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
         "sgd": torch.optim.SGD, "nesterov": torch.optim.SGD}


def rand_hypers(r, rule):
    h = dict(lr=r.choice([1e-3, 3e-3, 1e-2, 3e-2]),
             weight_decay=r.choice([0.0, 0.01, 0.1, 0.5]))
    if rule in ("adamw", "adam"):
        h["betas"] = (r.choice([0.8, 0.9, 0.95]), r.choice([0.99, 0.999, 0.95]))
        h["eps"] = r.choice([1e-8, 1e-6, 1e-3])
    else:
        h["momentum"] = r.choice([0.5, 0.9, 0.99] + ([0.0] if rule == "sgd" else []))
        if rule == "sgd":
            h["dampening"] = r.choice([0.0, 0.1, 0.5])
    return h


def torch_kw(rule, h):
    kw = dict(h)
    if rule == "nesterov":
        kw["nesterov"] = True
    if rule != "nesterov" and rule != "sgd":
        kw["foreach"] = False
    return kw


def bf16_ulp(x):
    ax = np.maximum(np.abs(x), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(ax)) - 7)


def close(a, r, what, rtol=RTOL, scale=0.0):
    """|a - r| <= rtol * max(|r|, 0.1 * scale), scale at least max|r|:
    the tensor's largest magnitude so far (an EMA that cancelled to near
    zero carries the roundoff of the larger terms it was made of)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    r = np.asarray(r, dtype=np.float64).reshape(-1)
    if a.shape != r.shape:
        raise AssertionError(f"{what}: shape {a.shape} vs reference {r.shape}")
    if not r.size:
        return
    scale = max(scale, float(np.max(np.abs(r))))
    bound = rtol * np.maximum(np.abs(r), 0.1 * scale + 1e-30)
    err = np.abs(a - r)
    bad = ~(err <= bound)
    if bad.any():
        i = int(np.argmax(np.where(bad, err / bound, 0)))
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.size} elements off; worst [{i}] "
                             f"zopt={a[i]!r} ref={r[i]!r} err={err[i]:.3g} bound={bound[i]:.3g}")


def f64(t):
    return t.detach().to(torch.float64).numpy().copy()


class World:
    """The zopt optimizer and the float64 torch reference, side by side."""

    def __init__(self, seed, tmp="."):
        self.tmp = tmp
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        r = self.r
        self.rule = r.choice(["adamw", "adam", "sgd", "nesterov"])
        self.mixed = r.random() < 0.5
        self.clip = r.choice([None, None, 3.0, 1e9])
        self.amsgrad = self.rule in ("adamw", "adam") and r.random() < 0.25
        self.step_obj = build_step(self.rule, self.mixed, self.clip, self.amsgrad)
        self.zp, self.rp = [], []          # zopt params, reference (f64) params
        self.log = [f"rule={self.rule} amsgrad={self.amsgrad} mixed={self.mixed} "
                    f"clip={self.clip}"]
        self.saved = None                  # an earlier state_dict of both, to go back to
        groups, rgroups = [], []
        for _ in range(r.randint(1, 3)):
            zs, rs = self.new_params()
            h = rand_hypers(r, self.rule)
            groups.append(dict(params=zs, **h))
            rgroups.append(dict(params=rs, **h))
        self.defaults = rand_hypers(r, self.rule)
        self.opt = zopt.Optimizer(self.step_obj, groups, **self.defaults)
        self.ref = TORCH[self.rule](rgroups, **torch_kw(self.rule, self.defaults),
                                    **(dict(amsgrad=True) if self.amsgrad else {}))
        self.sched = None
        self.runmax = {}
        self.illcond = {}   # id(param) -> elements Adam's L2 term cancelled (not checked)
        self.loose = set()  # params a load may have kept as the other neighbour of
        # their master (USAGE.md section 4), until they step again

    def new_params(self):
        zs, rs = [], []
        for _ in range(self.r.randint(1, 3)):
            shape = self.r.choice([(1,), (5,), (33,), (4, 7), (3, 2, 5), (70,), (0,)])
            dt = torch.bfloat16 if self.mixed and self.r.random() < 0.5 else torch.float32
            x = (torch.randn(shape, generator=self.g) + 0.5).to(dt)
            layout = self.r.choice(["dense"] * 4 + ["transposed", "strided"])
            if layout == "transposed" and len(shape) == 2:   # fills one block
                x = x.t().contiguous().t()
            elif layout == "strided" and len(shape) == 2:    # a view: stepped via a copy
                base = torch.zeros(shape[0], 2 * shape[1], dtype=dt)
                base[:, ::2] = x
                x = base[:, ::2]
            z = torch.nn.Parameter(x)
            rp = torch.nn.Parameter(z.detach().to(torch.float64).clone())
            self.zp.append(z)
            self.rp.append(rp)
            zs.append(z)
            rs.append(rp)
        return zs, rs

    def new_like(self, z):
        """Random values in z's layout (a replaced param keeps its strides)."""
        x = torch.empty_strided(z.shape, z.stride(), dtype=z.dtype)
        x.copy_((torch.randn(z.shape, generator=self.g) + 0.5).to(z.dtype))
        return x

    # ---- the actions ------------------------------------------------------

    def randn_like(self, p, scale):
        return (torch.randn(p.shape, generator=self.g) * scale).to(p.dtype)

    def a_grads(self):
        """New gradients for a random subset: fresh, accumulated, None."""
        scale = self.r.choice([0.01, 0.3, 1.0, 5.0])
        for z, rp in zip(self.zp, self.rp):
            how = self.r.choice(["fresh", "fresh", "acc", "acc", "keep", "none"])
            if how == "fresh":
                z.grad = self.randn_like(z, scale)
            elif how == "acc":
                if z.grad is None:
                    z.grad = self.randn_like(z, scale)
                else:
                    z.grad += self.randn_like(z, scale)
            elif how == "none":
                z.grad = None
        layout = self.r.choice(["own"] * 6 + ["flat", "alias", "transposed"])
        if layout == "flat":  # one flat buffer, every gradient a view of it (DeepSpeed's)
            have = [z for z in self.zp if z.grad is not None]
            by_dt = {}
            for z in have:
                by_dt.setdefault(z.dtype, []).append(z)
            for dt, zs in by_dt.items():
                flat = torch.empty(sum(z.numel() for z in zs) + 3, dtype=dt)
                off = 3
                for z in zs:
                    g = flat[off:off + z.numel()].view(z.shape)
                    g.copy_(z.grad)
                    z.grad = g
                    off += z.numel()
        elif layout == "alias":  # two params, one gradient tensor
            pairs = [(a, b) for a in self.zp for b in self.zp if a is not b and a.grad is not None
                     and a.shape == b.shape and a.dtype == b.dtype]
            if pairs:
                a, b = self.r.choice(pairs)
                b.grad = a.grad
        elif layout == "transposed":
            for z in self.zp:
                if z.grad is not None and z.dim() == 2:
                    z.grad = z.grad.t().contiguous().t()
        for z, rp in zip(self.zp, self.rp):
            rp.grad = None if z.grad is None else z.grad.detach().to(torch.float64).clone()
        return f"grads scale={scale} {layout}"

    def a_step(self):
        msg = self.a_grads()
        clip = self.clip
        if self.clip is not None and self.r.random() < 0.3:
            clip = self.r.choice([0.1, 1.0, 10.0])
            norm = self.opt.clip_grad_norm_(clip)
            ref_norm = self.ref_norm()
            close([float(norm)], [ref_norm], "clip_grad_norm_'s norm", rtol=1e-6)
            msg += f"; clip_grad_norm_({clip})"
            if self.r.random() < 0.2 and any(z.grad is not None for z in self.zp):
                # refused in between (BAD_STATE), nothing changes; without any
                # gradient clip_grad_norm_ begins nothing (returns 0)
                with pytest.raises(zopt.ZoptError, match="BAD_STATE|clip_grad_norm_"):
                    self.opt.zero_grad()
                msg += "; zero_grad refused"
        if clip != self.clip and self.r.random() < 0.3 and \
                any(z.grad is not None for z in self.zp):   # after clip_grad_norm_
            with pytest.raises(zopt.ZoptError, match="BAD_STATE"):
                self.opt.step(lambda: torch.tensor(3.5))
            msg += "; step(closure) refused"
        if clip == self.clip and self.r.random() < 0.2:
            loss = self.opt.step(lambda: torch.tensor(3.5))
            assert float(loss) == 3.5
            msg += "; step(closure)"
        else:
            self.opt.step()
            msg += "; step"
        self.ref_step(clip)
        return msg

    def ref_norm(self):
        gs = [rp.grad for rp in self.rp if rp.grad is not None]
        if not gs:
            return 0.0
        return float(torch.sqrt(sum((g * g).sum() for g in gs)))

    def ref_step(self, clip):
        saved = [None if rp.grad is None else rp.grad.clone() for rp in self.rp]
        if clip is not None:
            n = self.ref_norm()
            c = clip / (n + 1e-6)
            if c < 1:
                for rp in self.rp:
                    if rp.grad is not None:
                        rp.grad.mul_(c)
        if self.rule == "adam":  # L2: g + wd*p cancelled (g = -wd*p in bf16 values):
            for g, rg in zip(self.opt.param_groups, self.ref.param_groups):  # f32's wd*p
                for z, rp in zip(g["params"], rg["params"]):  # rounding / eps decides
                    if rp.grad is not None and rg["weight_decay"]:  # the update: counted,
                        wdp = rg["weight_decay"] * rp.detach()  # not checked
                        bad = (rp.grad + wdp).abs() <= 1e-5 * (rp.grad.abs() + wdp.abs())
                        if bad.any():
                            k = id(z)
                            self.illcond[k] = self.illcond.get(k, False) | bad.numpy()
        for g, rg in zip(self.opt.param_groups, self.ref.param_groups):
            for z, rp in zip(g["params"], rg["params"]):  # the scale of the terms an EMA
                if rp.grad is not None and rp.numel():     # of g (+ wd*p) is made of
                    sc = float(rp.grad.abs().max()) + rg["weight_decay"] * float(rp.abs().max())
                    for key in ("exp_avg", "momentum_buffer"):
                        k = (id(z), key)
                        self.runmax[k] = max(self.runmax.get(k, 0.0), sc)
                    if "betas" in rg:  # v's term ((1-b2)*(g + wd*p))*(g + wd*p): the f32
                        for key in ("exp_avg_sq", "max_exp_avg_sq"):  # sum's roundoff is
                            k = (id(z), key)  # relative to the terms (Adam's L2 nearly
                            self.runmax[k] = max(self.runmax.get(k, 0.0),  # cancelled)
                                                 (1 - rg["betas"][1]) * sc * sc)
        self.ref.step()
        for rp, s in zip(self.rp, saved):
            rp.grad = s
        self.loose -= {i for i, rp in enumerate(self.rp) if rp.grad is not None}

    def a_zero_grad(self):
        stn = self.r.random() < 0.5
        self.opt.zero_grad(set_to_none=stn)
        self.ref.zero_grad(set_to_none=stn)
        return f"zero_grad(set_to_none={stn})"

    def a_requires_grad(self):
        i = self.r.randrange(len(self.zp))
        z = self.zp[i]
        z.requires_grad_(not z.requires_grad)
        self.rp[i].requires_grad_(z.requires_grad)
        return f"param {i} requires_grad_({z.requires_grad})"

    def a_hypers(self):
        gi = self.r.randrange(len(self.opt.param_groups))
        h = rand_hypers(self.r, self.rule)
        h["maximize"] = self.r.random() < 0.5
        k = self.r.choice(sorted(h))
        if k != "maximize" and self.r.random() < 0.3:   # zopt's own setter, mirrored
            if k == "betas":
                j = self.r.randrange(2)
                v = h[k][j]
                self.opt.set_hyper(gi, f"beta{j + 1}", v)
                b = list(self.ref.param_groups[gi]["betas"])
                b[j] = v
                self.ref.param_groups[gi]["betas"] = tuple(b)
                assert tuple(self.opt.param_groups[gi]["betas"]) == tuple(b)
                return f"set_hyper({gi}, beta{j + 1}, {v})"
            self.opt.set_hyper(gi, k, h[k])
            self.ref.param_groups[gi][k] = h[k]
            assert self.opt.param_groups[gi][k] == h[k]
            return f"set_hyper({gi}, {k}, {h[k]})"
        self.opt.param_groups[gi][k] = h[k]
        self.ref.param_groups[gi][k] = h[k]
        return f"group {gi} {k}={h[k]}"

    def a_sched(self):
        if self.sched is None:
            gamma = self.r.choice([0.5, 0.9])
            self.sched = (torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma),
                          torch.optim.lr_scheduler.ExponentialLR(self.ref, gamma))
            return f"ExponentialLR({gamma})"
        for s in self.sched:
            s.step()
        return "sched.step()"

    def a_add_group(self):
        if len(self.zp) > 12:
            return None
        zs, rs = self.new_params() if self.r.random() < 0.9 else ([], [])  # (an empty group)
        h = rand_hypers(self.r, self.rule)
        try:
            self.opt.add_param_group(dict(params=zs, **h))
        except zopt.ZoptError:  # (refused: not added)
            del self.zp[len(self.zp) - len(zs):], self.rp[len(self.rp) - len(rs):]
            raise
        self.ref.add_param_group(dict(params=rs, **h))
        return f"add_param_group({len(zs)} params, {h})"

    def a_write_param(self):
        i = self.r.randrange(len(self.zp))
        z, rp = self.zp[i], self.rp[i]
        new = self.new_like(z)
        how = self.r.choice(["data=", "data.copy_", "no_grad copy_", "mul_", "swap"])
        if how == "swap":  # two params trade storage (the state stays with the param)
            js = [j for j, q in enumerate(self.zp)
                  if j != i and q.shape == z.shape and q.dtype == z.dtype
                  and q.stride() == z.stride()]
            if not js:
                return None
            j = self.r.choice(js)
            q, rq = self.zp[j], self.rp[j]
            z.data, q.data = q.data, z.data
            with torch.no_grad():
                if z.dtype == torch.bfloat16:  # the masters made from the params: the
                    # bf16 values the storage holds (rounding the reference's own
                    # master could land one ulp off where the two masters differ
                    # within the bound across a rounding boundary)
                    rp.copy_(z.detach().double())
                    rq.copy_(q.detach().double())
                else:
                    a, b = rp.detach().clone(), rq.detach().clone()
                    rp.copy_(b)
                    rq.copy_(a)
            self.opt.state[z]  # (seen now: a swap back unseen is no change at all)
            return f"params {i} and {j} swap storage"
        if how == "data=":
            z.data = new
        elif how == "data.copy_":
            z.data.copy_(new)
        elif how == "no_grad copy_":
            with torch.no_grad():
                z.copy_(new)
        else:
            with torch.no_grad():
                z.mul_(2.0)
        with torch.no_grad():
            rp.copy_(z.detach().to(torch.float64))
        return f"param {i} {how}"

    def fresh_opt(self):
        groups = [dict(params=list(g["params"])) for g in self.opt.param_groups]
        return zopt.Optimizer(self.step_obj, groups, **self.defaults)

    def replace_opt(self, new):
        self.opt.close()
        self.opt = new
        if self.sched is not None:
            gamma = self.sched[0].gamma
            self.sched = (torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma),
                          self.sched[1])

    def a_state_dict_new(self):
        sd = self.opt.state_dict()
        new = self.fresh_opt()
        new.load_state_dict(sd)
        self.replace_opt(new)
        return "state_dict -> new zopt optimizer"

    def a_zopt_into_torch(self):
        sd = self.opt.state_dict()
        self.ref.load_state_dict(sd)
        for st in self.ref.state.values():  # zopt's extras: torch keeps them, unused
            st.pop("master", None)
            if self.rule in ("sgd", "nesterov"):
                st.pop("step", None)
        return "zopt state_dict -> torch reference"

    def a_torch_into_zopt(self):
        sd = self.ref.state_dict()
        new = self.fresh_opt()
        new.load_state_dict(sd)
        self.replace_opt(new)
        with torch.no_grad():   # a master is made from the params as they are
            for z, rp in zip(self.zp, self.rp):
                if z.dtype == torch.bfloat16:
                    rp.copy_(z.detach().to(torch.float64))
        return "torch reference state_dict -> new zopt optimizer"

    def a_save_load(self, tmp):
        path = os.path.join(tmp, f"ckpt{self.r.randrange(10**9)}")
        self.opt.save(path)
        new = self.fresh_opt()
        new.load(path)
        self.replace_opt(new)
        return "save -> load into a new optimizer"

    def a_state(self):
        """What torch code does to optimizer.state, on both."""
        i = self.r.randrange(len(self.zp))
        z, rp = self.zp[i], self.rp[i]
        rst = self.ref.state.get(rp)
        if not rst or not self.opt.state[z]:
            return None
        keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq")
                if k in rst and rst[k] is not None]
        if not keys:
            return None
        how = self.r.choice(["set", "inplace", "reset", "del", "step"])
        k = self.r.choice(keys)
        if how == "set":
            t = torch.rand(z.shape, generator=self.g) + 0.1   # positive: exp_avg_sq too
            self.opt.state[z][k] = t
            rst[k] = t.to(torch.float64).clone()
        elif how == "inplace":
            self.opt.state[z][k].mul_(0.5)
            rst[k].mul_(0.5)
        elif how in ("reset", "del"):
            if how == "reset":
                self.opt.state[z] = {}
            else:
                del self.opt.state[z]
            del self.ref.state[rp]
            if self.mixed and z.dtype == torch.bfloat16:   # the master made from the param
                with torch.no_grad():
                    rp.copy_(z.detach().to(torch.float64))
            return f"param {i} state {how}"
        else:
            if "step" not in rst:
                return None
            n = self.r.randint(1, 30)
            self.opt.state[z]["step"] = n
            rst["step"] = torch.tensor(float(n))
            return f"param {i} state['step'] = {n}"
        return f"param {i} state {k} {how}"

    def a_keep(self):
        """An earlier state_dict of both, to load back later (a rollback)."""
        # (torch's state_dict holds its live state tensors: a copy)
        path = os.path.join(self.tmp, f"keep{self.r.randrange(10**9)}")
        self.opt.save(path)
        self.saved = (self.opt.state_dict(), copy.deepcopy(self.ref.state_dict()), path)
        return "keep state_dicts (and save)"

    def a_rollback(self):
        if self.saved is None:
            return None
        zsd, rsd, path = self.saved
        n = len(zsd["param_groups"])
        if n != len(self.opt.param_groups):  # groups added since: refused, nothing changes
            before = self.snapshot()
            with pytest.raises((ValueError, zopt.ZoptError)):
                if self.r.random() < 0.5:
                    self.opt.load(path)
                else:
                    self.opt.load_state_dict(zsd)
            self.same(before, self.snapshot())
            return "rollback refused (groups added since)"
        how = self.r.choice(["state_dict", "file"])
        if how == "file":
            self.opt.load(path)
        else:
            self.opt.load_state_dict(zsd)
        self.ref.load_state_dict(rsd)
        with torch.no_grad():
            for i, (z, rp) in enumerate(zip(self.zp, self.rp)):
                if z.dtype != torch.bfloat16:
                    continue
                st = zsd["state"].get(i)
                if st is not None and "master" in st:
                    # a master loaded is the weight: the param is a rounding of it
                    rp.copy_(st["master"].to(torch.float64))
                    self.loose.add(i)
                else:  # no state: reset, the master made from the param
                    rp.copy_(z.detach().to(torch.float64))
        return f"rollback: load an earlier {how}"

    # ---- refusals: the documented error, nothing changed -------------------

    def snapshot(self):
        out = []
        for z in self.zp:
            st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.opt.state[z].items()}
            out.append((z.detach().clone(), st, self.opt.tensor_step(z)))
        return out, [dict((k, v) for k, v in g.items() if k != "params")
                     for g in self.opt.param_groups]

    def same(self, a, b):
        (pa, ga), (pb, gb) = a, b
        assert ga == gb, "groups changed by a refused call"
        for i, ((x, sx, tx), (y, sy, ty)) in enumerate(zip(pa, pb)):
            assert tx == ty and torch.equal(x, y), f"param {i} changed by a refused call"
            assert sorted(sx) == sorted(sy)
            for k in sx:
                if sx[k] is None or sy[k] is None:  # SGD's momentum_buffer None (L8)
                    assert sx[k] is None and sy[k] is None, f"state {k} of param {i} changed by a refused call"
                    continue
                assert torch.equal(torch.as_tensor(sx[k]), torch.as_tensor(sy[k])), \
                    f"state {k} of param {i} changed by a refused call"

    def a_refuse(self):
        what = self.r.choice(["lr", "rule", "dup", "shape", "overlap"])
        before = self.snapshot()
        if what == "lr":
            gi = self.r.randrange(len(self.opt.param_groups))
            old = self.opt.param_groups[gi]["lr"]
            self.opt.param_groups[gi]["lr"] = -1.0
            try:
                if any(z.grad is not None for z in self.zp):
                    with pytest.raises(ValueError):
                        self.opt.step()
            finally:
                self.opt.param_groups[gi]["lr"] = old
        elif what == "rule":
            other = torch.optim.SGD if self.rule in ("adamw", "adam") else torch.optim.Adam
            ps = [torch.nn.Parameter(z.detach().float().clone()) for z in self.zp]
            kw = dict(lr=0.1, momentum=0.9) if other is torch.optim.SGD else dict(lr=0.1)
            o = other(ps, **kw)
            for p in ps:
                p.grad = torch.ones_like(p)
            o.step()
            sd = o.state_dict()
            sd["param_groups"] = [dict(sd["param_groups"][0], params=[])] + [
                dict(sd["param_groups"][0], params=[]) for _ in self.opt.param_groups[1:]]
            i = 0
            for g, zg in zip(sd["param_groups"], self.opt.param_groups):
                g["params"] = list(range(i, i + len(zg["params"])))
                i += len(zg["params"])
            with pytest.raises(zopt.ZoptError):
                self.opt.load_state_dict(sd)
        elif what == "overlap":  # two params on one storage: refused naming both
            js = [(i, j) for i, a in enumerate(self.zp) for j, b in enumerate(self.zp)
                  if i != j and a.shape == b.shape and a.dtype == b.dtype and a.numel()
                  and a.stride() == b.stride() and a.is_contiguous()]
            if not js or all(z.grad is None for z in self.zp):
                return None
            i, j = self.r.choice(js)
            old = self.zp[i].data
            self.zp[i].data = self.zp[j].data
            try:
                with pytest.raises(zopt.ZoptError, match="overlap|share|same"):
                    self.opt.step()
            finally:
                self.zp[i].data = old
        elif what == "dup":  # (L9: the pending momentum restart stays pending)
            with pytest.raises(ValueError, match="appears twice"):
                self.opt.add_param_group(dict(params=[self.zp[0]]))
        else:
            i = self.r.randrange(len(self.zp))
            z = self.zp[i]
            if z.grad is None:
                return None
            old = z.data
            z.data = torch.randn(z.numel() + 1).to(z.dtype)
            g = z.grad
            z.grad = None
            z.grad = torch.zeros_like(z.data)
            try:
                with pytest.raises(zopt.ZoptError):
                    self.opt.step()
            finally:
                z.grad = None
                z.data = old
                z.grad = g
        self.same(before, self.snapshot())
        return f"refused {what}"

    def held(self):
        """The groups at momentum 0 whose params hold buffers torch keeps."""
        return [gi for gi, (g, rg) in enumerate(zip(self.opt.param_groups, self.ref.param_groups))
                if g.get("momentum", 1) == 0 and any(
                    self.ref.state.get(rp, {}).get("momentum_buffer") is not None
                    for rp in rg["params"])]

    # ---- the check --------------------------------------------------------

    def close(self, i, key, a, r, what):
        k = (id(self.zp[i]), key)
        self.runmax[k] = max(self.runmax.get(k, 0.0), float(np.max(np.abs(r), initial=0.0)))
        bad = self.illcond.get(id(self.zp[i]))
        if bad is not None and np.shape(a) == bad.shape:
            a = np.where(bad, r, a)
        close(a, r, what, scale=self.runmax[k])
        return RTOL * np.maximum(np.abs(r), 0.1 * self.runmax[k])

    def check(self, where):
        for i, (z, rp) in enumerate(zip(self.zp, self.rp)):
            w = f"{where}: param {i} {tuple(z.shape)} {z.dtype}"
            st = self.opt.state[z]
            rst = self.ref.state.get(rp, {})
            if z.dtype == torch.bfloat16:
                zb, rv, mbound = f64(z), f64(rp), 0.0
                if "master" in st:
                    m = st["master"].to(torch.float32)
                    mbound = self.close(i, "master", f64(m), rv, w + " master")
                    mb = f64(m.to(torch.bfloat16))
                    if i in self.loose:
                        assert (np.abs(zb - f64(m)) < bf16_ulp(f64(m))).all(), \
                            f"{w}: param is not a rounding of its master"
                    else:
                        assert np.array_equal(zb, mb), f"{w}: param is not round(master)"
                rr = f64(rp.detach().to(torch.bfloat16))
                err = np.abs(zb - rr)  # (one ulp, or the master's bound near 0)
                bad = self.illcond.get(id(z))
                if bad is not None:
                    err = np.where(bad, 0.0, err)
                assert (err <= bf16_ulp(rr) + 2 * mbound + 1e-30).all(), \
                    f"{w}: param off by > 1 bf16 ulp"
            else:
                self.close(i, "param", f64(z), f64(rp), w)
            if (z.grad is None) != (rp.grad is None):
                raise AssertionError(f"{w}: grad None {z.grad is None} vs ref {rp.grad is None}")
            if z.grad is not None:
                assert np.array_equal(f64(z.grad), f64(rp.grad)), f"{w}: p.grad changed"
            rstep = int(rst["step"]) if "step" in rst else None
            if rstep is not None:
                assert self.opt.tensor_step(z) == rstep, \
                    f"{w}: step count {self.opt.tensor_step(z)} vs torch {rstep}"
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
                if k in rst and rst[k] is not None:
                    if k not in st:
                        raise AssertionError(f"{w}: no {k} in zopt's state {sorted(st)}")
                    self.close(i, k, f64(st[k]), f64(rst[k]), f"{w} {k}")
                elif not rst and st and self.opt.tensor_step(z):
                    raise AssertionError(f"{w}: zopt has state {sorted(st)}, torch none")


ACTION_WEIGHTS = [("a_step", 10), ("a_zero_grad", 2), ("a_requires_grad", 1),
                  ("a_hypers", 2), ("a_sched", 1), ("a_add_group", 1), ("a_write_param", 2),
                  ("a_state_dict_new", 1), ("a_zopt_into_torch", 1), ("a_torch_into_zopt", 1),
                  ("a_save_load", 1), ("a_refuse", 1), ("a_state", 2), ("a_keep", 1),
                  ("a_rollback", 1)]


def run_case(seed, tmp, actions=ACTIONS):
    w = World(seed, tmp)
    names = [n for n, k in ACTION_WEIGHTS for _ in range(k)]
    try:
        w.check("built")
        for n in range(actions):
            name = w.r.choice(names)
            fn = getattr(w, name)
            held = w.held()
            before = w.snapshot() if held else None
            try:
                msg = fn(tmp) if name == "a_save_load" else fn()
            except zopt.ZoptError as e:  # SGD: momentum 0 while torch would keep buffers:
                if not held or "hold momentum buffers" not in str(e):  # refused by every
                    raise  # call that pushes or loads it, nothing changed
                w.same(before, w.snapshot())
                for gi in held:
                    w.opt.param_groups[gi]["momentum"] = w.ref.param_groups[gi]["momentum"] = 0.9
                msg = f"{name} refused (momentum 0, buffers held: groups {held}); momentum 0.9"
            if msg is None:
                continue
            w.log.append(msg)
            if w.r.random() < 0.7 or n == actions - 1:  # (else the next action follows
                w.check(f"action {n} ({msg})")          # without a read in between)
    except BaseException as e:
        raise AssertionError(f"case seed {seed}:\n  " + "\n  ".join(w.log) + f"\n{e}") from e
    finally:
        w.opt.close()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@pytest.mark.filterwarnings("ignore::zopt.optimizer.MasterWeightsWarning")
@pytest.mark.parametrize("case", range(CASES))
def test_lifecycle_fuzz(case, tmp_path):
    run_case(SEED * 100003 + case, str(tmp_path))



def test_the_harness_catches_a_wrong_formula(monkeypatch, tmp_path):
    """The tolerance is tight enough to fail a wrong formula: the reference
    with its bias correction one step late fails every Adam case (the same
    run with the right one passes: test_lifecycle_fuzz)."""
    right = World.ref_step

    def late(self, clip):
        had = [st for st in self.ref.state.values() if "step" in st]
        for st in had:
            st["step"] += 1
        right(self, clip)
        for st in had:
            st["step"] -= 1
    monkeypatch.setattr(World, "ref_step", late)
    adam = [s for s in range(12) if World(s, str(tmp_path)).rule in ("adam", "adamw")][:3]
    assert adam
    for s in adam:
        with pytest.raises(AssertionError, match="off"):
            run_case(s, str(tmp_path))

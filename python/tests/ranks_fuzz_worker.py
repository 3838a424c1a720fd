"""One rank of test_ranks_fuzz.py: the seeded differential harness across
ranks. Every rank runs the same random sequence of user actions on a
zopt.Optimizer over a torch process group (W = 2, gloo) and on a ONE-rank
twin (a zopt.Optimizer of the same step at world size 1, in this process,
gradient divisor W) whose gradients are the rank-order f32 sum of the
ranks' gradients, rounded to the grad dtype (docs/DISTRIBUTED.md: W ranks
give that one-rank result bit for bit). After most actions every param,
every element of state_dict() (gathered), every step count and the step's
outcome must equal the twin's, bit for bit.

    ranks_fuzz_worker.py RANK WORLD PORT OUTDIR MODE SEED CASES ACTIONS

MODE: "fuzz" (CASES cases from SEED), "selftest" / "selftest-grad" (one
case whose twin gets one state bit flipped after its first step, or one
gradient bit at it: the harness must report it). Writes
OUTDIR/rank{R}.json: {"cases": n, "actions": n, "failure": None or text}.
"""
import datetime
import math
import os
import random
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..")))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zopt  # noqa: E402
from overlap_fakes import finish_rank  # noqa: E402

TIMEOUT = 10  # zopt's collectives (only a failure waits for it)
CHECK_ALL = os.environ.get("ZOPT_FUZZ_CHECK_ALL") == "1"  # (minimizing: after every action)
RULES = ["adamw", "adam", "sgd", "nesterov", "lion"]


def step_of(rule, stage, klass, clip, loss_scale, amsgrad):
    kw = dict(zero_stage=stage)
    if clip is not None:
        kw["clip"] = clip
    if loss_scale:
        kw["loss_scale"] = True
    if amsgrad:
        kw["amsgrad"] = True
    if klass == "bf16m":
        kw.update(param="bf16", master="f32")
    elif klass == "bf16sr":   # pure bf16, every state rounded stochastically
        kw.update(param="bf16", moments="bf16", rounding="stochastic")
    elif klass == "bf16rem":  # the f32 master as the int16 remainder
        kw.update(param="bf16", master="remainder")
    elif klass == "mixed":
        kw["classes"] = {"bf16": dict(master="f32"), "f32": {}}
    if rule in ("adamw", "adam"):
        return getattr(zopt.steps, rule)(**kw)
    if rule == "lion":
        return zopt.steps.lion(**kw)
    return zopt.steps.sgd(nesterov=(rule == "nesterov"), **kw)


def rand_hypers(r, rule):
    h = dict(lr=r.choice([1e-3, 3e-3, 1e-2, 3e-2]),
             weight_decay=r.choice([0.0, 0.01, 0.1, 0.5]))
    if rule in ("adamw", "adam"):
        h["betas"] = (r.choice([0.8, 0.9, 0.95]), r.choice([0.99, 0.999, 0.95]))
        h["eps"] = r.choice([1e-8, 1e-6, 1e-3])
    elif rule == "lion":
        h["betas"] = (r.choice([0.8, 0.9, 0.95]), r.choice([0.99, 0.999, 0.95]))
    else:
        h["momentum"] = r.choice([0.5, 0.9, 0.99] + ([0.0] if rule == "sgd" else []))
        if rule == "sgd":
            h["dampening"] = r.choice([0.0, 0.1, 0.5])
    return h


def bits(t):
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous().view(torch.int16)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def flip_low_bit(t):
    """A copy of t with the lowest bit of element 0 flipped."""
    t = t.detach().clone().contiguous()
    v = bits(t).view(-1)
    v[0] ^= 1
    return t


class Failed(AssertionError):
    pass


class Side:
    """One optimizer and its params: the W-rank one or the one-rank twin."""

    def __init__(self, name):
        self.name = name
        self.ps = []
        self.opt = None
        self.sched = None


class RankWorld:
    def __init__(self, seed, rank, world, tmp, perturb=False):
        self.seed, self.rank, self.world, self.tmp = seed, rank, world, tmp
        self.perturb = perturb
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        r = self.r
        self.rule = r.choice(RULES)
        self.stage = r.choice([0, 1, 2, 3])
        self.klass = r.choice(["f32", "f32", "bf16m", "mixed", "bf16sr", "bf16rem"])
        self.clip = r.choice([None, None, 3.0, 1e9])
        self.loss_scale = r.random() < 0.25
        self.amsgrad = self.rule in ("adamw", "adam") and r.random() < 0.25
        self.step_obj = step_of(self.rule, self.stage, self.klass, self.clip,
                                self.loss_scale, self.amsgrad)
        # settings that must not change a bit: each side its own
        self.opts = [dict(bucket_elems=r.choice([None, None, 1, 64, 300]),
                          num_threads=r.choice([None, 1, 2])) for _ in range(2)]
        if self.stage >= 2 and self.klass != "mixed" and r.random() < 0.3:
            self.opts[0]["grad_streaming"] = True
        self.log = [f"seed={seed} rule={self.rule} zero_stage={self.stage} class={self.klass} "
                    f"clip={self.clip} loss_scale={self.loss_scale} amsgrad={self.amsgrad} "
                    f"W=2 {self.opts[0]} twin {self.opts[1]}"]
        self.W, self.T = Side("W=2"), Side("twin")
        self.grads = []        # [param][rank] the ranks' gradients (None: none)
        self.consumed = []     # the param's p.grad was read by a step (undefined after it)
        self.nfile = 0
        self.kept = None
        groups = [[], []]
        for _ in range(r.randint(1, 3)):
            zs, ts = self.new_params()
            h = rand_hypers(r, self.rule)
            groups[0].append(dict(params=zs, **h))
            groups[1].append(dict(params=ts, **h))
        self.defaults = rand_hypers(r, self.rule)
        self.W.opt = self.build(self.W, groups[0])
        self.T.opt = self.build(self.T, groups[1])

    # ---- building ----------------------------------------------------------
    def build(self, side, groups):
        if side is self.W:
            return zopt.Optimizer(self.step_obj, groups, process_group=dist.group.WORLD,
                                  timeout=TIMEOUT, **self.opts[0], **self.defaults)
        return zopt.Optimizer(self.step_obj, groups, grad_divisor=self.world, **self.opts[1],
                              **self.defaults)

    def sides(self):
        return (self.W, self.T)

    def new_params(self):
        zs, ts = [], []
        for _ in range(self.r.randint(1, 3)):
            shape = self.r.choice([(1,), (5,), (33,), (4, 7), (3, 2, 5), (70,), (130,), (0,)])
            dt = torch.bfloat16 if (self.klass.startswith("bf16") or (
                self.klass == "mixed" and self.r.random() < 0.5)) else torch.float32
            x = (torch.randn(shape, generator=self.g) + 0.5).to(dt)
            if len(shape) == 2 and self.r.random() < 0.3:
                x = x.t().contiguous().t()        # transposed: fills one block
            z = torch.nn.Parameter(x.clone())
            t = torch.nn.Parameter(x.clone())
            self.W.ps.append(z)
            self.T.ps.append(t)
            self.grads.append([None] * self.world)
            self.consumed.append(False)
            zs.append(z)
            ts.append(t)
        return zs, ts

    # ---- gradients -----------------------------------------------------------
    def randn(self, p, scale):
        x = torch.randn(p.shape, generator=self.g)
        x = torch.sign(x + 1e-30) * (x.abs() + 0.05) * scale   # never zero
        return x.to(p.dtype)

    def set_grads(self, i):
        """Every side's p.grad of param i from self.grads[i]."""
        gs = self.grads[i]
        z, t = self.W.ps[i], self.T.ps[i]
        mine = gs[self.rank]
        z.grad = None if mine is None else mine.clone()
        have = [g for g in gs if g is not None]
        if not have:
            t.grad = None
        else:
            acc = have[0].float()
            for g in have[1:]:
                acc = acc + g.float()
            t.grad = acc.to(t.dtype)
        self.consumed[i] = False

    def a_grads(self, for_step=False):
        """New gradients: per param fresh (the same on every rank, or each
        its own), accumulated into the last ones, None on every rank or on
        one rank only, kept (unless a step consumed them). New ones only:
        sometimes from a backward on the W side (loss sum(p * g): p.grad is
        g exactly; under grad_streaming its hooks reduce the buckets, so
        only right before a step)."""
        self.bw_done = False
        scale = self.r.choice([0.01, 0.3, 1.0, 5.0])
        if self.loss_scale:
            scale *= float(self.T.opt.loss_scale)
        hows = []
        for i, z in enumerate(self.W.ps):
            how = self.r.choice(["fresh", "fresh", "same", "acc", "keep", "none", "one"])
            if how in ("acc", "keep") and (self.consumed[i] or all(
                    g is None for g in self.grads[i])):
                how = "fresh"
            hows.append(how)
            if how == "keep":
                continue
            gs = self.grads[i]
            if how == "fresh":
                gs[:] = [self.randn(z, scale) for _ in range(self.world)]
            elif how == "same":
                g = self.randn(z, scale)
                gs[:] = [g.clone() for _ in range(self.world)]
            elif how == "acc":   # p.grad += ... on each rank that has one (bf16 rounding)
                gs[:] = [None if g is None else g + self.randn(z, scale) for g in gs]
            elif how == "none":
                gs[:] = [None] * self.world
            else:
                k = self.r.randrange(self.world)
                gs[:] = [None if q == k else self.randn(z, scale) for q in range(self.world)]
            self.set_grads(i)
        if (for_step or not self.opts[0].get("grad_streaming")) and self.r.random() < 0.3 \
                and all(h in ("fresh", "same", "one", "none") for h in hows):
            for z in self.W.ps:
                z.grad = None
            terms = [(z * self.grads[i][self.rank]).sum() for i, z in enumerate(self.W.ps)
                     if self.grads[i][self.rank] is not None]
            if terms:
                sum(terms).backward()
            self.bw_done = True
            return f"grads scale={scale:g} {hows} by backward"
        return f"grads scale={scale:g} {hows}"

    # ---- the actions ------------------------------------------------------------
    def both(self, fn):
        """fn(side) on the W-rank optimizer and on the twin: both must raise
        (the same exception type) or neither; returns the W side's error."""
        errs = []
        for s in self.sides():
            try:
                fn(s)
                errs.append(None)
            except (zopt.ZoptError, ValueError, TypeError, RuntimeError) as e:
                errs.append(e)
        a, b = errs
        if (a is None) != (b is None) or (a is not None and type(a) is not type(b)):
            raise Failed(f"W=2 raised {a!r}, the twin {b!r}")
        return a

    def a_step(self):
        msg = self.a_grads(for_step=True)
        if self.loss_scale and self.r.random() < 0.2 and not self.bw_done:
            i = self.r.randrange(len(self.W.ps))
            if self.W.ps[i].numel():
                k = self.r.randrange(self.world)
                g = self.grads[i][k]
                if g is None:
                    g = self.grads[i][k] = self.randn(self.W.ps[i], 1.0)
                g.view(-1)[self.r.randrange(g.numel())] = float("inf")
                self.set_grads(i)
                msg += f"; inf in param {i}'s grad on rank {k}"
        if self.perturb == "grad":
            self.perturb = False
            for t in self.T.ps:
                if t.grad is not None and t.numel():
                    t.grad = flip_low_bit(t.grad)
                    msg += "; (self-test) one twin gradient bit flipped"
                    break
        if self.clip is not None and self.r.random() < 0.3:
            c = self.r.choice([0.1, 1.0, 10.0])
            norms = []
            err = self.both(lambda s: norms.append(s.opt.clip_grad_norm_(c)))
            if err is not None:
                return msg + f"; clip_grad_norm_({c}) refused: {err}"
            if len(norms) == 2 and not same_bits(norms[0].reshape(1), norms[1].reshape(1)):
                raise Failed(f"clip_grad_norm_({c}): W=2 {float(norms[0])!r}, "
                             f"twin {float(norms[1])!r}")
            msg += f"; clip_grad_norm_({c})"
        if self.r.random() < 0.2 and "clip_grad_norm_" not in msg:  # (refused after it)
            err = self.both(lambda s: s.opt.step(lambda: torch.tensor(2.5)))
            msg += "; step(closure)"
        else:
            err = self.both(lambda s: s.opt.step())
        if err is not None and self.bw_done and self.opts[0].get("grad_streaming"):
            # a streamed backward's gradients are reduced: they cannot be
            # taken back nor replaced (USAGE.md section 8); fixed, step again
            if "hold momentum buffers" in str(err):
                self.momentum_back()
            err = self.both(lambda s: s.opt.step())
            msg += "; step again"
        for i in range(len(self.W.ps)):
            self.consumed[i] = True
        if err is None and self.opts[0].get("grad_streaming"):
            # p.grad is None after a streamed step (docs/USAGE.md section 8);
            # the twin's too, so that a kept zero_grad(False) means the same
            for i, z in enumerate(self.W.ps):
                if z.grad is not None and z.numel():
                    raise Failed(f"grad_streaming: param {i}'s p.grad is not None after step()")
                self.grads[i] = [None] * self.world
                self.set_grads(i)
        if err is not None:
            return msg + f"; step refused: {type(err).__name__}: {str(err)[:120]}"
        # (a step without a gradient, but for empty params: one rank runs
        # none, W ranks the runtime's, whose outcome differs: USAGE.md 3)
        ran = any(t.grad is not None and t.numel() for t in self.T.ps)
        for what in ("last_grad_norm", "last_skipped", "last_loss_scale") if ran else ():
            a, b = getattr(self.W.opt, what), getattr(self.T.opt, what)
            if not (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))):
                raise Failed(f"{what}: W=2 {a!r}, twin {b!r}")
        if self.perturb == "state":
            for t in self.T.ps:
                st = self.T.opt.state[t]
                ks = [k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 0
                      and k != "step"]
                if ks:
                    self.T.opt.state[t][ks[0]] = flip_low_bit(st[ks[0]])
                    self.perturb = False
                    msg += f"; (self-test) one bit of the twin's {ks[0]} flipped"
                    break
        return msg + ("; step (skipped)" if self.W.opt.last_skipped else "; step")

    def momentum_back(self):
        """SGD's momentum 0 over held buffers was refused (on both sides):
        momentum 0.9 again."""
        for s in self.sides():
            for g in s.opt.param_groups:
                if g.get("momentum", 1) == 0:
                    g["momentum"] = 0.9

    def a_zero_grad(self):
        stn = self.r.random() < 0.5
        self.both(lambda s: s.opt.zero_grad(set_to_none=stn))
        for i, z in enumerate(self.W.ps):
            if stn:
                self.grads[i] = [None] * self.world
            else:   # zeroed in place on every rank that has one
                self.grads[i] = [None if g is None else torch.zeros_like(g)
                                 for g in self.grads[i]]
            self.consumed[i] = False
        return f"zero_grad(set_to_none={stn})"

    def a_hypers(self):
        gi = self.r.randrange(len(self.W.opt.param_groups))
        h = rand_hypers(self.r, self.rule)
        h["maximize"] = self.r.random() < 0.3
        k = self.r.choice(sorted(h))
        if k != "maximize" and self.r.random() < 0.3:   # zopt's setter
            if k == "betas":
                j = self.r.randrange(2)
                v = h[k][j]
                self.both(lambda s: s.opt.set_hyper(gi, f"beta{j + 1}", v))
                return f"set_hyper({gi}, beta{j + 1}, {v})"
            self.both(lambda s: s.opt.set_hyper(gi, k, h[k]))
            return f"set_hyper({gi}, {k}, {h[k]})"
        for s in self.sides():
            s.opt.param_groups[gi][k] = h[k]
        return f"group {gi} {k}={h[k]}"

    def a_sched(self):
        if self.W.sched is None:
            gamma = self.r.choice([0.5, 0.9])
            for s in self.sides():
                s.sched = torch.optim.lr_scheduler.ExponentialLR(s.opt, gamma)
            return f"ExponentialLR({gamma})"
        for s in self.sides():
            s.sched.step()
        return "sched.step()"

    def a_add_group(self):
        if len(self.W.ps) > 12:
            return None
        n = len(self.W.ps)
        zs, ts = self.new_params() if self.r.random() < 0.9 else ([], [])
        h = rand_hypers(self.r, self.rule)
        new = {"W=2": zs, "twin": ts}
        err = self.both(lambda s: s.opt.add_param_group(dict(params=new[s.name], **h)))
        if err is not None:   # not added
            for s in self.sides():
                del s.ps[n:]
            del self.grads[n:], self.consumed[n:]
            return f"add_param_group refused: {err}"
        return f"add_param_group({len(zs)} params, {h})"

    def a_write_param(self):
        i = self.r.randrange(len(self.W.ps))
        z = self.W.ps[i]
        new = (torch.randn(z.shape, generator=self.g) + 0.5).to(z.dtype)
        how = self.r.choice(["data=", "data.copy_", "no_grad copy_", "mul_", "swap"])
        if how == "swap":  # two params trade storage (the states stay with the param)
            js = [j for j, q in enumerate(self.W.ps) if j != i and q.shape == z.shape
                  and q.dtype == z.dtype and q.stride() == z.stride()]
            if not js:
                return None
            j = self.r.choice(js)
            for s in self.sides():
                a, b = s.ps[i], s.ps[j]
                a.data, b.data = b.data, a.data
            return f"params {i} and {j} swap storage"
        for s in self.sides():
            p = s.ps[i]
            if how == "data=":
                x = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
                x.copy_(new)
                p.data = x
            elif how == "data.copy_":
                p.data.copy_(new)
            elif how == "no_grad copy_":
                with torch.no_grad():
                    p.copy_(new)
            else:
                with torch.no_grad():
                    p.mul_(2.0)
        return f"param {i} {how}"

    def a_settings(self):
        """Settings changed alike on both sides (the twin's divisor stays W
        times the ranks' over the one-rank sum)."""
        how = self.r.choice(["divisor", "seed", "scaler", "zero3"])
        if how == "divisor":
            a = self.r.choice([1, 2, 3])
            self.both(lambda s: setattr(s.opt, "grad_divisor", self.world * a))
            return f"grad_divisor = {self.world * a}"
        if how == "seed":
            n = self.r.randrange(1000)
            self.both(lambda s: s.opt.set_seed(n))
            return f"set_seed({n})"
        if how == "scaler":
            if not self.loss_scale:
                return None
            kw = dict(init_scale=self.r.choice([256.0, 65536.0]),
                      growth_interval=self.r.choice([1, 2, 5]))
            self.both(lambda s: s.opt.configure_loss_scaler(**kw))
            return f"configure_loss_scaler({kw})"
        if self.stage != 3:
            return None

        def fn(s):   # every param released, then gathered again
            s.opt.release_params()
            s.opt.gather_params()
        self.both(fn)
        return "release_params(); gather_params()"

    def fresh_opt(self, side):
        groups = [dict(params=list(g["params"])) for g in side.opt.param_groups]
        return self.build(side, groups)

    def replace_opt(self, side, new):
        side.opt.close()
        side.opt = new
        if side.sched is not None:
            side.sched = torch.optim.lr_scheduler.ExponentialLR(new, side.sched.gamma)

    def a_state_dict_new(self):
        cross = self.r.random() < 0.5
        sds = {s.name: s.opt.state_dict() for s in self.sides()}
        other = {"W=2": "twin", "twin": "W=2"}

        def fn(s):
            new = self.fresh_opt(s)
            new.load_state_dict(sds[other[s.name]] if cross else sds[s.name])
            self.replace_opt(s, new)
        self.both(fn)
        return "state_dict -> new optimizer" + (" (each the other's)" if cross else "")

    def path(self, what):
        self.nfile += 1
        return os.path.join(self.tmp, f"{what}{self.nfile}")

    def twin_file(self):
        """The twin saves on rank 0 (every rank's twin is the same); the
        ranks wait for the file."""
        path = self.path("twin")
        err = None
        if self.rank == 0:
            try:
                self.T.opt.save(path)
            except zopt.ZoptError as e:   # (SGD's momentum 0 over held buffers)
                err = str(e)
        errs = [None] * self.world      # every rank learns it: the same next action
        dist.all_gather_object(errs, err)
        if errs[0] is not None:
            raise RuntimeError(f"the twin's save was refused: {errs[0]}")
        return path

    def a_save_load(self):
        how = self.r.choice(["own", "W=2 -> W=1", "W=1 -> W=2"])
        if how == "own":
            paths = {"W=2": self.path("w"), "twin": self.path(f"t{self.rank}_")}

            def fn(s):
                s.opt.save(paths[s.name])
                new = self.fresh_opt(s)
                new.load(paths[s.name])
                self.replace_opt(s, new)
            self.both(fn)
            return "save -> load into a new optimizer (each its own)"
        if how == "W=2 -> W=1":
            path = self.path("w")
            self.W.opt.save(path)
        else:
            path = self.twin_file()

        def fn(s):
            new = self.fresh_opt(s)
            new.load(path)
            self.replace_opt(s, new)
        self.both(fn)
        return f"save {how}: both load it into a new optimizer"

    def a_state(self):
        i = self.r.randrange(len(self.W.ps))
        z, t = self.W.ps[i], self.T.ps[i]
        st = self.W.opt.state[z]
        ks = [k for k, v in st.items() if torch.is_tensor(v) and k != "step" and v is not None]
        if not ks:
            return None
        how = self.r.choice(["set", "inplace", "reset", "step"])
        k = self.r.choice(ks)
        if how == "set":
            v = torch.rand(z.shape, generator=self.g) + 0.1   # (a master: the param too)
            self.both(lambda s: s.opt.state[s.ps[i]].__setitem__(k, v.clone()))
        elif how == "inplace":
            def fn(s):
                s.opt.state[s.ps[i]][k].mul_(0.5)
            self.both(fn)
        elif how == "reset":
            def fn(s):
                s.opt.state[s.ps[i]] = {}
            self.both(fn)
            return f"param {i} state reset"
        else:
            n = self.r.randint(1, 30)
            self.both(lambda s: s.opt.state[s.ps[i]].__setitem__("step", n))
            return f"param {i} state['step'] = {n}"
        del t
        return f"param {i} state {k} {how}"

    def a_keep(self):
        pw = self.path("keepw")
        self.W.opt.save(pw)
        pt = self.twin_file()   # (rank 0's twin: a path every rank can load)
        self.kept = dict(W=self.W.opt.state_dict(), T=self.T.opt.state_dict(), pw=pw, pt=pt,
                         ngroups=len(self.W.opt.param_groups))
        return "keep state_dicts and saves"

    def a_rollback(self):
        if self.kept is None:
            return None
        k = self.kept
        how = self.r.choice(["state_dict", "own file", "the other's file"])
        src = {"state_dict": (lambda s: s.opt.load_state_dict(k["W"] if s is self.W else k["T"])),
               "own file": (lambda s: s.opt.load(k["pw"] if s is self.W else k["pt"])),
               "the other's file": (lambda s: s.opt.load(k["pt"] if s is self.W else k["pw"]))}
        err = self.both(src[how])
        if err is not None and len(self.W.opt.param_groups) == k["ngroups"]:
            raise Failed(f"rollback ({how}) refused: {err}")
        return f"rollback from {how}" + (" refused (groups added since)" if err else "")

    def a_refuse(self):
        what = self.r.choice(["lr", "dup"])
        if what == "lr":
            gi = self.r.randrange(len(self.W.opt.param_groups))
            if not any(t.grad is not None for t in self.T.ps):  # (on no rank: the
                return None   # same decision on every rank, never a rank's own p.grad)
            old = {}
            for s in self.sides():
                old[s.name] = s.opt.param_groups[gi]["lr"]
                s.opt.param_groups[gi]["lr"] = -1.0
            err = self.both(lambda s: s.opt.step())
            for s in self.sides():
                s.opt.param_groups[gi]["lr"] = old[s.name]
            if not isinstance(err, ValueError):
                raise Failed(f"a step at lr -1 gave {err!r}, not ValueError")
        else:
            err = self.both(lambda s: s.opt.add_param_group(dict(params=[s.ps[0]])))
            if not isinstance(err, ValueError):
                raise Failed(f"a duplicate param gave {err!r}, not ValueError")
        return f"refused {what}"

    # ---- the check ------------------------------------------------------------------
    def check(self, where):
        for i, (z, t) in enumerate(zip(self.W.ps, self.T.ps)):
            if not same_bits(z, t):
                d = (bits(z) != bits(t)).reshape(-1).nonzero()
                j = int(d[0]) if len(d) else -1
                raise Failed(f"{where}: param {i} {tuple(z.shape)} {z.dtype}: "
                             f"{len(d)}/{z.numel()} elements differ from the twin; "
                             f"[{j}] W=2 {z.reshape(-1)[j].item()!r} twin "
                             f"{t.reshape(-1)[j].item()!r}")
            a, b = self.W.opt.tensor_step(z), self.T.opt.tensor_step(t)
            if a != b:
                raise Failed(f"{where}: param {i} step count {a}, twin {b}")
        sw, st = self.W.opt.state_dict(), self.T.opt.state_dict()
        if sorted(sw["state"]) != sorted(st["state"]):
            raise Failed(f"{where}: state_dict params {sorted(sw['state'])}, "
                         f"twin {sorted(st['state'])}")
        for i in sw["state"]:
            a, b = sw["state"][i], st["state"][i]
            if sorted(a) != sorted(b):
                raise Failed(f"{where}: param {i}'s state keys {sorted(a)}, twin {sorted(b)}")
            for k in a:
                x, y = a[k], b[k]
                if torch.is_tensor(x) and torch.is_tensor(y):
                    ok = same_bits(x, y)
                else:
                    ok = x == y
                if not ok:
                    raise Failed(f"{where}: state_dict param {i} {k} differs from the twin:"
                                 f"\n W=2 {x}\n twin {y}")
        if sw["param_groups"] != st["param_groups"]:
            raise Failed(f"{where}: param_groups differ:\n W=2 {sw['param_groups']}\n "
                         f"twin {st['param_groups']}")
        zw = {k: v for k, v in sw["zopt"].items() if k != "world_size"}
        zt = {k: v for k, v in st["zopt"].items() if k != "world_size"}
        if zw != zt:
            raise Failed(f"{where}: state_dict's zopt extras differ:\n W=2 {zw}\n twin {zt}")

    def close(self):
        for s in self.sides():
            if s.opt is not None:
                s.opt.close()


ACTION_WEIGHTS = [("a_step", 10), ("a_grads", 2), ("a_zero_grad", 2), ("a_hypers", 2),
                  ("a_sched", 1), ("a_add_group", 1), ("a_write_param", 2),
                  ("a_state_dict_new", 1), ("a_save_load", 2), ("a_state", 2), ("a_keep", 1),
                  ("a_rollback", 1), ("a_refuse", 1), ("a_settings", 1)]


def agree(status):
    """Every rank's status of this action (a collective on the default
    group): the first rank's failure, or None."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, status)
    fails = [f"rank {r}: {s}" for r, s in enumerate(out) if s is not None]
    return "\n".join(fails) if fails else None


def run_case(seed, rank, world, tmp, actions, perturb=False):
    """Returns (actions run, failure text or None)."""
    os.makedirs(tmp, exist_ok=True)
    w = None
    names = [n for n, k in ACTION_WEIGHTS for _ in range(k)]
    done = 0
    try:
        w = RankWorld(seed, rank, world, tmp, perturb)
        w.check("built")
    except BaseException:
        status = traceback.format_exc()
    else:
        status = None
    fail = agree(status)
    for n in range(actions if fail is None else 0):
        name = w.r.choice(names)
        status = None
        try:
            msg = getattr(w, name)()
            if msg is not None:
                w.log.append(msg)
                if w.r.random() < 0.7 or n == actions - 1 or CHECK_ALL:
                    w.check(f"action {n} ({msg})")
                else:
                    w.log[-1] += " (not checked)"
            done += 1
        except BaseException as e:
            if "hold momentum buffers" in str(e):   # SGD at momentum 0 over held
                w.momentum_back()                    # buffers: refused on both sides
                w.log.append(f"{name} refused (momentum 0, buffers held); momentum 0.9")
            else:
                status = f"{type(e).__name__}: {e}\n" + traceback.format_exc()
        fail = agree(status)
        if fail is not None:
            break
    if fail is not None and w is not None:
        fail = "case:\n  " + "\n  ".join(w.log) + "\n" + fail
    try:
        if w is not None:
            w.close()
    except BaseException as e:   # (a poisoned communicator)
        fail = fail or f"close: {e}"
    return done, fail


def main():
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode, seed, cases, actions = sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import warnings
    warnings.filterwarnings("ignore")
    out = {"cases": 0, "actions": 0, "failure": None}
    perturb = {"selftest": "state", "selftest-grad": "grad"}.get(mode, False)
    for c in range(cases):
        s = seed * 100003 + c
        done, fail = run_case(s, rank, world, os.path.join(outdir, f"case{s}"), actions,
                              perturb)
        out["cases"] += 1
        out["actions"] += done
        if fail is not None:
            out["failure"] = fail
            break
        print(f"ok case {s} rank {rank}: {done} actions", flush=True)
    finish_rank(out, outdir, rank)


if __name__ == "__main__":
    main()

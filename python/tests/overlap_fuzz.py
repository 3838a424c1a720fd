"""The differential fuzzer of the overlapped / offloaded / GPU binding paths
(python/tests/test_overlap_fuzz.py runs it; docs/TESTING.md "The overlap
fuzzer"). A worker process run against the stand-in CUDA driver
(libzopt-fake-cuda.so, gpu_fakes.run_worker) applies ONE seeded random
sequence of training-script actions to several optimizers over copies of
one small model and compares every param and every state element BIT FOR
BIT after the actions (docs/USAGE.md promises bit-identity for each pair):

* ``overlap`` worlds: (A) an offloaded step with ``overlap=True`` (half
  the cases with ``model=``: the per-bucket tail, params back early),
  (B) the same offloaded step without overlap, (C) the same description's
  CPU step over host params;
* ``gpu`` worlds (ZOPT_FAKE_CUDA_TWIN: the GPU kernels run on the CPU
  twin's): (G) the GPU step over device params, (C) the CPU twin.

Actions: a backward through the model (random never-zero gradients, its
loss scaled to clip or not, an inf in one gradient: a skipped step, two
micro-batches accumulated, the last gradients kept or zeroed both ways), a
frozen param (requires_grad toggled), an lr / weight-decay edit, a
scheduler, a state_dict() round trip (into the same optimizer, a new one,
or crosswise between the copies), save()/load() into a new optimizer,
add_param_group of the model's extra param, p.data written in place or
replaced, a forward and model.state_dict() right after step() (they must
see this step's params: compared with the serial copy's), a backward
aborted by an exception, and refusals (a second backward, zero_grad,
clip_grad_norm_ and a param_groups edit between the marks and step(), a
bad lr): each must raise the documented error and change nothing.

Run: ``python overlap_fuzz.py <mode> <paths> <tmp>`` with ZOPT_CUDA_DRIVER,
ZOPT_FUZZ_CASES / ZOPT_FUZZ_SEED / ZOPT_FUZZ_ACTIONS in the environment;
prints one JSON line: the cases run and the first failure (its seed, the
actions' log, the error)."""
import contextlib
import ctypes
import json
import os
import random
import sys
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
from zopt._lib import ZoptError  # noqa: E402
from gpu_fakes import StandIn, cuda_params, device_tensors, grads_on_device  # noqa: E402
from overlap_fuzz_model import D, SHAPES, Fail, Net, bits, expect, plist, same_t  # noqa: E402
from overlap_fuzz_refusals import Refusals  # noqa: E402

CHECK_ALL = os.environ.get("ZOPT_FUZZ_CHECK_ALL") == "1"  # (the draws stay the same)
# test_the_harness_can_fail: the gradient of l2.bias 1% off in the copy under test
BREAK = os.environ.get("ZOPT_FUZZ_BREAK") == "1"
NOCHECK = os.environ.get("ZOPT_FUZZ_NOCHECK", "").split(",")  # action indices left unchecked


class World(Refusals):
    """The copies side by side: ``names``, ``nets``, ``opts``, the first
    the one under test (A or G), the last the reference (the CPU twin; B in
    the gpu_fraction world). The refusal and early-read actions are
    overlap_fuzz_refusals.Refusals'."""

    def __init__(self, mode, variants, seed, tmp, s, dev):
        self.mode, self.tmp, self.s, self.dev = mode, tmp, s, dev
        self.ov = mode in ("overlap", "fraction")  # the copy under test overlapped
        self.fake = s.fake
        r = self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.variant = r.choice(variants)
        v = self.variant
        self.dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[v["param"]]
        self.main = v.get("grad") == "f32" and v["param"] != "f32"
        self.scaled = v["param"] == "f16"
        self.per_bucket = self.ov and r.random() < 0.5
        # slow copies back (2 ms each): the per-bucket tail still running at the reads
        self.htod_us = 2000 if self.per_bucket and r.random() < 0.5 else 0
        self.fake.fake_cuda_set_htod_delay(self.htod_us)
        self.bucket_elems = r.choice([64, 128, 256, 1024])
        self.fraction = r.choice([0.2, 0.5, 0.8]) if mode == "fraction" else None
        # None: every bucket speculated; 0: none; else about one bucket's buffers
        self.budget = r.choice([None, None, 0, 16 * self.bucket_elems])
        self.log = [f"mode={mode} variant={v['name']} per_bucket={self.per_bucket} "
                    f"gpu_fraction={self.fraction} "
                    f"htod_us={self.htod_us} "
                    f"bucket_elems={self.bucket_elems} budget={self.budget}"]
        init = [(torch.randn(sh, generator=self.g) * 0.5 + 0.1).to(self.dtype) for sh in SHAPES]
        names = {"overlap": ["A", "B", "C"], "gpu": ["G", "C"], "fraction": ["A", "B"],
                 "stream": ["S", "N", "C"]}[mode]
        self.nets = []
        for name in names:
            on_dev = self.on_device(name)
            ts = [dev(sh, w, self.dtype) if on_dev else w.clone() for sh, w in zip(SHAPES, init)]
            self.nets.append(Net(ts))
        self.names = names
        self.inject = {"inf": None}  # the param index whose gradient gets an inf
        self.keep = []
        for name, net in zip(names, self.nets):
            self._grad_hooks(net, self.on_device(name) and not self.main, name in ("A", "G", "S"))
        self.sb = s.stream()  # B's torch stream (A's: the StandIn's first)
        self.with_extra = r.random() < 0.5  # else added later by add_param_group
        self.hyp = [self.rand_hypers(), self.rand_hypers()]
        self.split = r.choice([1, 2, 3])
        self.ngroups0 = 2  # the constructor's groups  # params [0:split) in group 0, the rest in group 1
        # a param frozen when the optimizers are built (GPU steps leave it out,
        # the overlap hooks it once it requires grad)
        self.frozen0 = r.randrange(4) if r.random() < 0.25 else None
        if self.frozen0 is not None:
            for net in self.nets:
                plist(net)[self.frozen0].requires_grad_(False)
            self.log[0] += f" frozen_at_build={self.frozen0}"
        self.opts = [self.make(k) for k in range(len(names))]
        self.sync_handles = []
        self._sync_hooks()
        self.sched = None
        self.ran = False
        self.note = ""  # what the action running did so far (a failure's log)

    # ---- construction -----------------------------------------------------------
    def on_device(self, name):
        """Copy ``name``'s params and gradients in (stand-in) device memory."""
        return name != "C"

    def make_kw(self, name):
        """Copy ``name``'s own options of zopt.Optimizer (the streaming world's)."""
        return {}

    def rand_hypers(self):
        r = self.r
        h = dict(lr=r.choice([1e-3, 1e-2, 3e-2]), weight_decay=r.choice([0.0, 0.01, 0.1]))
        if self.variant["rule"] in ("adamw", "adam"):
            h["betas"] = (r.choice([0.8, 0.9]), r.choice([0.99, 0.999]))
            h["eps"] = r.choice([1e-8, 1e-6])
        else:
            h["momentum"] = r.choice([0.5, 0.9])
        return h

    def params_of(self, k):
        net = self.nets[k]
        ps = [net.l1.weight, net.l1.bias, net.l2.weight, net.l2.bias]
        return ps + ([net.extra] if self.with_extra else [])

    def groups_of(self, k, hyp=None):
        ps = self.params_of(k)
        hyp = hyp or self.hyp
        return [dict(params=ps[:self.split], **hyp[0]), dict(params=ps[self.split:], **hyp[1])]

    def left_out(self, k):
        """ids of the params copy k's GPU step (or class) left out (frozen
        when it was built, not trained since)."""
        return {id(c.entries[t].param) for c in self.opts[k]._parts for t in c.excluded}

    def current_groups(self, k):
        """Copy k's groups as they are now (params added since included: the
        first ``self.ngroups0`` go to the constructor, make() adds the rest)."""
        keys = ("lr", "weight_decay", "betas", "eps", "momentum")
        return [dict(params=list(g["params"]), **{key: g[key] for key in keys if key in g})
                for g in self.opts[k].param_groups]

    def step_of(self, k):
        if self.mode == "fraction":  # the offloaded step and its GPU twin class, linked
            v = self.variant
            cl = zopt.steps.StepClasses({v["param"]: v["dev"], v["param"] + ":gpu": v["gpu"]})
            cl.gpu_fraction = self.fraction
            return cl
        return self.variant["cpu" if self.names[k] == "C" else "dev"]

    def make(self, k, groups=None):
        name = self.names[k]
        if self.on_device(name):  # a new optimizer reads the params on the host (the stand-in's
            # device memory) where a GPU's reads queue behind the stream's waits
            st = self.sb if name == "B" else self.s.cur["s"]
            assert self.fake.cuStreamSynchronize(ctypes.c_void_p(st)) == 0
        kw = dict(bucket_elems=self.bucket_elems)
        if self.scaled:
            kw["loss_scaler"] = dict(init_scale=1024.0, growth_interval=3)
        if name == "A":
            kw.update(overlap=True, speculation_budget=self.budget)
            if self.per_bucket:
                kw["model"] = self.nets[k]
        kw.update(self.make_kw(name))
        frozen = None
        if groups is not None and (name == "G" or self.mode == "fraction"):
            # a new optimizer with a GPU step (or class) that loads the old
            # one's states: built with the params the old one left out
            # (frozen when it was built, not trained since) frozen, the
            # others requiring grad (a param frozen at build is left out:
            # load_state_dict() drops its states, docs/GPU.md; load() refuses
            # a file whose left-out params differ, finding O1)
            left = self.left_out(k)
            ps = [p for g in groups for p in g["params"]]
            frozen = [(p, p.requires_grad) for p in ps]
            for p in ps:
                p.requires_grad_(id(p) not in left)
        groups = groups or self.groups_of(k)
        later = groups[self.ngroups0:]  # added by add_param_group (gpu_fraction routes
        groups = groups[:self.ngroups0]  # them to the offloaded class, as it did)
        try:
            with self.on(k):
                o = zopt.Optimizer(self.step_of(k), groups, **kw)
                for g in later:
                    o.add_param_group(g)
                return o
        finally:
            for p, w in frozen or ():
                p.requires_grad_(w)

    @contextlib.contextmanager
    def on(self, k):
        """B's calls on B's own torch stream (A's waits must not cover B)."""
        if self.names[k] != "B":
            yield
            return
        old, self.s.cur["s"] = self.s.cur["s"], self.sb
        try:
            yield
        finally:
            self.s.cur["s"] = old

    def _grad_hooks(self, net, to_device, under_test):
        """Before zopt's hooks: each new p.grad moved to fresh device memory
        (A, B, G), an inf at [1] of the chosen param's gradient."""
        dev = self.dev
        for i, p in enumerate(plist(net)):
            def hook(*_, p=p, i=i):
                if p.grad is None:
                    return
                gd = p.grad.detach()
                broken = BREAK and under_test and i == 3  # the self-test: 1% off
                if self.inject["inf"] == i or broken:
                    gd = gd.clone()
                    if broken:
                        gd.mul_(1.01)
                    if self.inject["inf"] == i:
                        gd.view(-1)[1] = float("inf")
                    if not to_device:
                        p.grad = gd
                if to_device:
                    p.grad = dev(tuple(p.shape), gd, gd.dtype)
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            self.keep.append((node, node.register_hook(hook)))

    def _sync_hooks(self):
        """A's modules: after the optimizer's own pre-hooks (waits on the
        current stream), the stream synchronized, as a kernel reading the
        params would (re-registered after every new optimizer of A)."""
        for h in self.sync_handles:
            h.remove()
        self.sync_handles = []
        if not self.ov:
            return
        fake, s = self.fake, self.s

        def sync(_m, _a):
            assert fake.cuStreamSynchronize(ctypes.c_void_p(s.cur["s"])) == 0
        for m in self.nets[0].modules():
            self.sync_handles.append(m.register_forward_pre_hook(sync))

    def replace(self, k, new):
        self.opts[k].close()
        self.opts[k] = new
        if k == 0:
            self._sync_hooks()
        if self.sched is not None:
            self.sched = None  # (a scheduler holds the old optimizer)

    def close(self):
        self.fake.fake_cuda_set_htod_delay(0)
        for o in self.opts:
            o.close()
        for _, h in self.keep:
            h.remove()

    # ---- the check --------------------------------------------------------------
    def settle(self):
        """Every optimizer's step done, every copy landed."""
        for k, o in enumerate(self.opts):
            with self.on(k):
                o.step_count()
        self.fake.fake_cuda_drain_all()

    def check(self, where):
        self.settle()
        ref = self.names[-1]
        sds = []
        for k, o in enumerate(self.opts):
            with self.on(k):
                sds.append(o.state_dict())
        self.fake.fake_cuda_drain_all()
        pc = [p for p in self.nets[-1].parameters()]
        for k in range(len(self.opts) - 1):
            n = self.names[k]
            for i, (p, q) in enumerate(zip(self.nets[k].parameters(), pc)):
                if not same_t(p, q):
                    raise Fail(f"{where}: {n} param {i} differs from {ref}'s: "
                               f"{p.detach().float().view(-1)[:4].tolist()} vs "
                               f"{q.detach().float().view(-1)[:4].tolist()}; "
                               + self.outcomes(k))
                expect(p.requires_grad == q.requires_grad, f"{where}: requires_grad")
            sa, sc = sds[k]["state"], sds[-1]["state"]
            expect(sorted(sa) == sorted(sc), f"{where}: {n} state keys {sorted(sa)} vs {sorted(sc)}")
            for i in sa:
                expect(sorted(sa[i]) == sorted(sc[i]), f"{where}: {n} state[{i}] {sorted(sa[i])} "
                       f"vs {sorted(sc[i])}")
                for key in sa[i]:
                    a, c = sa[i][key], sc[i][key]
                    ok = same_t(a, c) if torch.is_tensor(a) else a == c
                    if not ok and torch.is_tensor(a) and a.shape == c.shape:
                        bad = (bits(a) != bits(c)).view(-1).nonzero().view(-1)
                        j = int(bad[0]) if bad.numel() else 0
                        pk = self.params_in(k)[i].detach().view(-1)[j:j + 1].float().item()
                        pc_ = self.params_in(len(self.opts) - 1)[i].detach().view(-1)[j:j + 1]
                        raise Fail(f"{where}: {n} state[{i}][{key}] differs from {ref}'s at "
                                   f"{bad.numel()}/{a.numel()} elements, [{j}]: "
                                   f"{a.view(-1)[j].item()!r} vs {c.view(-1)[j].item()!r} "
                                   f"(params {pk!r}, {pc_.float().item()!r}); "
                                   + self.outcomes(k))
                    expect(ok, f"{where}: {n} state[{i}][{key}] differs from {ref}'s")
            ga = [{kk: v for kk, v in g.items() if kk != "params"} for g in sds[k]["param_groups"]]
            gc = [{kk: v for kk, v in g.items() if kk != "params"} for g in sds[-1]["param_groups"]]
            expect(ga == gc, f"{where}: {n} param_groups {ga} vs {gc}")
            o, oc = self.opts[k], self.opts[-1]
            with self.on(k):
                ts = [o.tensor_step(p) for p in self.params_in(k)]
                if n == "G" and not self.ran:
                    sk, ls = oc.last_skipped, (oc.loss_scale if self.scaled else None)
                elif n == "G":  # a GPU step's outcome: gpu_result() (last_skipped is not read back)
                    try:
                        _, sk, ls = o.gpu_result()
                        ls = ls if self.scaled else None
                    except ZoptError as e:  # (no step of this optimizer yet)
                        expect("no step has run" in str(e), f"gpu_result(): {e}")
                        sk, ls = oc.last_skipped, (oc.loss_scale if self.scaled else None)
                else:
                    sk, ls = o.last_skipped, (o.loss_scale if self.scaled else None)
            tc = [oc.tensor_step(p) for p in self.params_in(len(self.opts) - 1)]
            expect(ts == tc, f"{where}: {n} tensor steps {ts} vs {tc}")
            expect(sk == oc.last_skipped, f"{where}: {n} last_skipped {sk} vs {oc.last_skipped}")
            if self.scaled:
                expect(ls == oc.loss_scale, f"{where}: {n} loss scale {ls} vs {oc.loss_scale}")

    def outcomes(self, k):
        """Copy k's and the twin's last outcome and counts (a failure's message)."""
        o, oc = self.opts[k], self.opts[-1]
        try:
            got = o.gpu_result() if self.names[k] == "G" else (o.last_grad_norm, o.last_skipped)
        except ZoptError as e:
            got = str(e)
        cnt = [o.tensor_step(p) for p in self.params_in(k)]
        return (f"{self.names[k]}: {got} counts {cnt}; C: {(oc.last_grad_norm, oc.last_skipped)} "
                f"counts {[oc.tensor_step(p) for p in self.params_in(len(self.opts) - 1)]}")

    def params_in(self, k):
        return [p for g in self.opts[k].param_groups for p in g["params"]]

    def snapshot(self, k):
        """Everything a refused call must leave as it was (of copy k)."""
        self.settle()
        o = self.opts[k]
        with self.on(k):
            sd = o.state_dict()
            ts = [o.tensor_step(p) for p in self.params_in(k)]
        self.fake.fake_cuda_drain_all()
        ps = [p.detach().clone() for p in self.nets[k].parameters()]
        return ps, sd, ts, o.step_count()

    def same_snapshot(self, a, b, what):
        (pa, sa, ta, ca), (pb, sb, tb, cb) = a, b
        expect(all(same_t(x, y) for x, y in zip(pa, pb)), f"{what}: params changed")
        expect(ta == tb and ca == cb, f"{what}: counts changed {ta, ca} -> {tb, cb}")
        st_a, st_b = sa["state"], sb["state"]
        expect(sorted(st_a) == sorted(st_b) and all(
            sorted(st_a[i]) == sorted(st_b[i]) and all(
                same_t(st_a[i][key], st_b[i][key]) if torch.is_tensor(st_a[i][key])
                else st_a[i][key] == st_b[i][key] for key in st_a[i]) for i in st_a),
            f"{what}: state changed")

    # ---- gradients --------------------------------------------------------------
    def x(self, scale):
        return torch.randn(8, D, generator=self.g) * scale

    def ready(self, k, forward=False):
        """Before the host reads or writes copy k's device memory (a forward,
        zero_grad, a backward's accumulation): its stream synchronized (on
        a GPU those are kernels on that stream, after the step's; on the
        stand-in, host code). A's forward waits by its own pre-hooks (and
        ours, _sync_hooks) and its step returns once the gradients are on
        the host: nothing here."""
        n = self.names[k]
        if n in ("B", "G"):
            st = self.sb if n == "B" else self.s.cur["s"]
            assert self.fake.cuStreamSynchronize(ctypes.c_void_p(st)) == 0
        elif n == "A" and self.mode == "fraction" and not forward:  # its GPU class's
            assert self.fake.cuStreamSynchronize(ctypes.c_void_p(self.s.cur["s"])) == 0

    def loss(self, k, x):
        self.ready(k, forward=True)
        y = self.nets[k](x)
        loss = y.square().mean()
        if self.scaled:
            with self.on(k):
                loss = loss * self.opts[k].loss_scale
        return loss

    def backward_all(self, x, first_micro=False):
        """One backward on every copy (A's first micro-batch in no_sync())."""
        for k in range(len(self.opts)):
            if first_micro and self.names[k] in ("A", "S"):
                with self.opts[k].no_sync():
                    self.loss(k, x).backward()
            else:
                with self.on(k):
                    self.loss(k, x).backward()

    def unused_grads(self):
        """The extra param outside the optimizer: its gradient dropped."""
        if not self.with_extra:
            for net in self.nets:
                net.extra.grad = None

    def zero_grad(self, how):
        for k, o in enumerate(self.opts):
            self.ready(k)
            with self.on(k):
                if how == "none":
                    o.zero_grad(set_to_none=True)
                elif how == "zeros":
                    o.zero_grad(set_to_none=False)
        self.unused_grads()

    def step_all(self):
        # a step with no gradient runs nothing: last_skipped / gpu_result()
        # are compared after steps that ran
        self.ran = any(p.grad is not None or getattr(p, "main_grad", None) is not None
                       for p in self.params_in(len(self.opts) - 1))
        for k, o in enumerate(self.opts):
            with self.on(k):
                o.step()

    # ---- the actions ------------------------------------------------------------
    def a_train(self):
        r = self.r
        how = r.choice(["none", "none", "zeros", "keep"])
        self.zero_grad(how)
        scale = r.choice([0.05, 0.3, 1.0, 30.0])  # 30: clipping active (clip 1.0)
        msg = f"train zero_grad={how} x*{scale}"
        acc = r.random() < 0.25
        if acc:
            self.backward_all(self.x(scale), first_micro=True)
            msg += " +micro"
        inf = None
        cand = [i for i, p in enumerate(plist(self.nets[0]))
                if p.requires_grad and (i < 4 or self.with_extra)]
        if r.random() < 0.12 and cand:
            inf = r.choice(cand)
            msg += f" inf@{inf}"
        self.inject["inf"] = inf
        try:
            self.backward_all(self.x(scale))
        finally:
            self.inject["inf"] = None
        self.unused_grads()
        msg += self.between_backward_and_step()
        self.step_all()
        if self.ov and r.random() < 0.5:
            msg += self.read_right_after_step()
        return msg

    def between_backward_and_step(self):
        """a_train's calls between the backward and step(): the refusals
        after the marks (overlap) or the step's clip begun by hand (GPU)."""
        r = self.r
        if self.ov and r.random() < 0.3:
            return self.refusals_after_marks()
        if self.mode == "gpu" and r.random() < 0.3:
            return self.clip_by_hand()
        return ""

    def clip_by_hand(self):
        """The step's clip, begun by hand: every copy's norm the same."""
        mx = self.r.choice([0.1, 1.0, 10.0])
        norms = []
        for k, o in enumerate(self.opts):
            self.ready(k)
            norms.append(float(o.clip_grad_norm_(mx)))
        expect(norms[0] == norms[-1] or (np.isnan(norms[0]) and np.isnan(norms[-1])),
               f"clip_grad_norm_: {norms}")
        return f"; clip_grad_norm_({mx})"

    def a_frozen(self):
        ps = [plist(n) for n in self.nets]
        i = self.r.randrange(5 if self.with_extra else 4)
        want = not ps[0][i].requires_grad
        for q in ps:
            q[i].requires_grad_(want)
            if not want:
                q[i].grad = None
        return f"param {i} requires_grad_({want})"

    def a_hypers(self):
        gi = self.r.randrange(2)
        key = self.r.choice(["lr", "weight_decay"])
        v = self.r.choice([1e-3, 5e-3, 2e-2]) if key == "lr" else self.r.choice([0.0, 0.05, 0.2])
        for o in self.opts:
            o.param_groups[gi][key] = v
        return f"group {gi} {key} = {v}"

    def a_sched(self):
        if self.sched is None:
            self.sched = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)
                          for o in self.opts]
            return "scheduler StepLR(gamma=0.7)"
        for sc in self.sched:
            sc.step()
        return "scheduler step"

    def a_state_dict(self):
        how = self.r.choice(["same", "new", "cross"])
        sds = []
        for k, o in enumerate(self.opts):
            with self.on(k):
                sds.append(o.state_dict())
        for k in range(len(self.opts)):
            sd = sds[k]
            if how == "cross":  # the copies' state_dicts are the same: any other's
                sd = sds[(k + 1) % len(sds)]
            if how == "new":
                new = self.make(k, self.current_groups(k))
                with self.on(k):
                    new.load_state_dict(sd)
                self.replace(k, new)
            else:
                with self.on(k):
                    self.opts[k].load_state_dict(sd)
        return f"state_dict round trip ({how})"

    def a_save_load(self):
        tag = self.r.randrange(10 ** 9)
        for k, o in enumerate(self.opts):
            path = os.path.join(self.tmp, f"ck{tag}{self.names[k]}")
            with self.on(k):
                o.save(path)
            new = self.make(k, self.current_groups(k))
            with self.on(k):
                new.load(path)
            self.replace(k, new)
        return "save -> load into a new optimizer"

    def a_add_group(self):
        if self.with_extra:
            return None
        self.with_extra = True
        h = self.rand_hypers()
        for k, (o, net) in enumerate(zip(self.opts, self.nets)):
            net.extra.grad = None
            with self.on(k):
                o.add_param_group(dict(params=[net.extra], **h))
        return f"add_param_group(extra) {h}"

    def a_write(self):
        i = self.r.randrange(5)
        # (p.data = a new tensor is refused on the stand-in: its device
        # memory is in CPU tensors, "of another device" than a CUDA param's;
        # p.data.copy_ without a version bump is not detected on CUDA params,
        # documented: docs/USAGE.md section 4)
        how = "inplace"
        val = (torch.randn(SHAPES[i], generator=self.g) * 0.5).to(self.dtype)
        for k, net in enumerate(self.nets):
            p = plist(net)[i]
            with self.on(k):
                self.opts[k].step_count()
            self.fake.fake_cuda_drain_all()
            with torch.no_grad():  # a version bump
                p.copy_(val)
        return f"param {i} written {how}"

    def grad_dtype(self):
        return torch.float32 if self.main else self.dtype

    def give(self, k, p, gd):
        on_dev = self.on_device(self.names[k])
        t = self.dev(tuple(gd.shape), gd, gd.dtype) if on_dev else gd.clone()
        if self.main:
            p.main_grad = t
        else:
            p.grad = t

    def a_hand_grads(self):
        """Gradients set by hand, no backward: step() marks every bucket (A);
        a param that requires grad without one: (A) refused... so every one
        gets one here; the GPU and streaming worlds leave a random one without."""
        self.zero_grad("none")
        skip = self.r.randrange(5) if self.mode in ("gpu", "stream") else -1
        n = 0
        for i in range(5 if self.with_extra else 4):
            if i == skip:
                continue
            if not list(plist(self.nets[0]))[i].requires_grad:
                continue
            gd = (torch.randn(SHAPES[i], generator=self.g) * 0.05).to(self.grad_dtype())
            for k, net in enumerate(self.nets):
                self.give(k, plist(net)[i], gd)
            n += 1
        self.step_all()
        return f"grads by hand ({n} params, none for {skip}), step"

    def hand_grads_only(self):
        self.zero_grad("none")
        for i in range(5 if self.with_extra else 4):
            if not list(plist(self.nets[0]))[i].requires_grad:
                continue
            gd = (torch.randn(SHAPES[i], generator=self.g) * 0.05).to(self.grad_dtype())
            for k, net in enumerate(self.nets):
                self.give(k, plist(net)[i], gd)


ACTIONS_W = [("a_train", 10), ("a_frozen", 1), ("a_hypers", 2), ("a_sched", 1),
             ("a_state_dict", 2), ("a_save_load", 1), ("a_add_group", 1), ("a_write", 1),
             ("a_abort", 1), ("a_hand_grads", 1), ("a_bad_lr", 1)]


def run_case(mode, variants, seed, tmp, s, dev, actions, world=World):
    names = [n for n, k in ACTIONS_W for _ in range(k)]
    try:
        w = world(mode, variants, seed, tmp, s, dev)
    except BaseException as e:
        return dict(seed=seed, log=["(built)"], error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-3000:])
    n, name = "-", "check"
    try:
        w.check("built")
        for n in range(actions):
            w.note = ""
            name = w.r.choice(names)
            msg = getattr(w, name)()
            if msg is None:
                continue
            w.log.append(f"{n}: {msg}")
            if (w.r.random() < 0.7 or n == actions - 1 or CHECK_ALL) and str(n) not in NOCHECK:
                w.check(f"action {n} ({msg})")
                w.log[-1] += " [checked]"
    except BaseException as e:
        w.log.append(f"{n}: {name} raised (then: {w.note})")
        return dict(seed=seed, log=w.log, error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-3000:])
    finally:
        if os.environ.get("ZOPT_FUZZ_LOG") == "1":  # every case's actions, on stderr
            print("\n  ".join([f"seed {seed}:"] + w.log), file=sys.stderr, flush=True)
        try:
            w.close()
        except BaseException:
            pass
    return None


def variants_of(mode, paths):
    """paths: name=dev_path=cpu_path[=gpu_path] entries, ";"-separated; the
    name is rule:param[:f32grad][:clip]."""
    out = []
    for item in paths.split(";"):
        name, dp, cp, *gp = item.split("=")
        parts = name.split(":")
        out.append(dict(name=name, rule=parts[0], param=parts[1],
                        grad="f32" if "f32grad" in parts else None,
                        dev=zopt.Step(dp), cpu=zopt.Step(cp),
                        gpu=zopt.Step(gp[0]) if gp else None))
    return out


def main(mode, paths, tmp):
    world = World
    if mode == "stream":  # CPU params only: no stand-in driver (stream_fuzz.py;
        from stream_fuzz import NoDevice, StreamWorld, join_ranks  # ZOPT_FUZZ_RANK: gloo ranks)
        s, dev, world = NoDevice(), None, StreamWorld
        join_ranks()
    else:
        s = StandIn()
        cuda_params()
        dev = device_tensors(s.fake)
        grads_on_device(dev)
    cases = int(os.environ.get("ZOPT_FUZZ_CASES", "8"))
    seed0 = int(os.environ.get("ZOPT_FUZZ_SEED", "0"))
    actions = int(os.environ.get("ZOPT_FUZZ_ACTIONS", "25"))
    variants = variants_of(mode, paths)
    out = dict(cases=0, failures=[])
    only = [int(x) for x in os.environ.get("ZOPT_FUZZ_LIST", "").split(",") if x]
    for c in (only or range(cases)):  # (ZOPT_FUZZ_LIST: these case numbers only)
        f = run_case(mode, variants, seed0 * 100003 + c + int(os.environ.get("ZOPT_FUZZ_FIRST", "0")), tmp, s, dev, actions,
                     world)
        out["cases"] += 1
        if f is not None:
            out["failures"].append(f)
            if len(out["failures"]) >= int(os.environ.get("ZOPT_FUZZ_MAX_FAIL", "1")):
                break
    s.fake.fake_cuda_drain_all()
    out["bad_ranges"] = s.fake.fake_cuda_num_bad_ranges()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])

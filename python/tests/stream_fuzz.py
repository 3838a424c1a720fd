"""The overlap fuzzer's streaming world (python/tests/overlap_fuzz.py runs
it as mode ``stream``; docs/TESTING.md "The overlap fuzzer"): at one rank
or (ZOPT_FUZZ_RANK / _WORLD / _PORT: :func:`join_ranks`) at several gloo
ranks, (S) a CPU-updated ZeRO-2 / ZeRO-3 step with ``grad_streaming=True``
(gradients reduced into the runtime's shards from backward hooks, each
``p.grad`` freed once its buckets are reduced) against (N) the same step
without streaming and (C) the same rule at ZeRO-0 (the reference: a
ZeRO-2/3 fault that streaming shares is seen too), over copies of the
overlap fuzzer's model, bit for bit after the actions (params, states,
counts, skip, scale: World.check).

The overlap world's actions, and where streaming differs:

* the first of two micro-batches in ``no_sync()``; after every ``step()``
  each of S's ``p.grad`` must be None (docs/USAGE.md), and the others' are
  set to None as well (the copies go on from the same gradients);
* between the backward and ``step()``: a second backward and
  ``zero_grad`` (refused, BAD_STATE, nothing reduced changes), the step's
  clip begun by hand (``clip_grad_norm_``: the same norm), an lr / weight
  decay edit (taken by the step), a negative lr (refused at ``step()``,
  then the step with the lr back), the state read (``state_dict()``),
  params given new memory (``p.data = p.data.clone()``: registered in
  place, S's reduced gradients kept) and ``add_param_group`` (S's
  ``step()`` refuses, its reduced gradients lost; then S gets N's
  gradients by hand and both step);
* a param written in place or replaced (``p.data = new``) after a step;
* after a backward aborted by an exception (S's buckets partly reduced):
  ``zero_grad`` refused (BAD_STATE), then ``step()`` (the rest reduced).

* a backward with the loose param left out of the forward (at several
  ranks on rank 1 only), S's last backward inside ``no_sync()`` too (its
  buckets reduced at ``step()``), gradients by hand leaving one param out;
  l2.bias's storage handed on to the loose param (ZeRO-3: S2).

No stand-in driver: :class:`NoDevice` answers the World's stream calls."""
import datetime
import os

import torch

from zopt._lib import Status, ZoptError
from overlap_fuzz import World
from overlap_fuzz_model import D, SHAPES, Fail, expect, plist


class _NoFake:
    """The stand-in driver's calls the World makes, for CPU copies only."""

    def fake_cuda_set_htod_delay(self, _us):
        return 0

    def fake_cuda_drain_all(self):
        return 0

    def fake_cuda_num_bad_ranges(self):
        return 0

    def cuStreamSynchronize(self, _s):  # noqa: N802 (the driver's name)
        return 0


class NoDevice:
    """StandIn's place in the streaming world (no device memory)."""

    def __init__(self):
        self.fake = _NoFake()
        self.cur = {"s": 0}

    def stream(self):
        return 0


def _refused(fn, code, words, what):
    try:
        fn()
    except ZoptError as e:
        expect(e.code == code and words in str(e), f"{what}: {e}")
    else:
        raise Fail(f"{what} was not refused")


RANKS = {"pg": None, "rank": 0}


def join_ranks():
    """ZOPT_FUZZ_RANK / _WORLD / _PORT set (test_overlap_fuzz.py runs two):
    this process one gloo rank; every copy's optimizer over the world."""
    if "ZOPT_FUZZ_RANK" not in os.environ:
        return
    import torch.distributed as dist
    r, w = int(os.environ["ZOPT_FUZZ_RANK"]), int(os.environ["ZOPT_FUZZ_WORLD"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['ZOPT_FUZZ_PORT']}",
                            rank=r, world_size=w, timeout=datetime.timedelta(seconds=30))
    RANKS.update(pg=dist.group.WORLD, rank=r)


class StreamWorld(World):
    """S (streamed), N (not streamed), C (ZeRO-0): World's copies.
    At several ranks every rank draws the same actions and params (the
    World's generators) and its own batches (:meth:`x`); the loose param
    is left out of a backward on rank 1 only."""

    def __init__(self, *a):
        self.gx = None
        super().__init__(*a)
        self.gx = torch.Generator().manual_seed(1000003 * a[2] + RANKS["rank"])

    def on_device(self, name):
        return False

    def make_kw(self, name):
        kw = dict(grad_streaming=True) if name == "S" else {}
        if RANKS["pg"] is not None:
            kw["process_group"] = RANKS["pg"]
        return kw

    def x(self, scale):
        if RANKS["pg"] is None or self.gx is None:
            return super().x(scale)
        return torch.randn(8, D, generator=self.gx) * scale

    @property
    def streamer(self):
        return self.opts[0]._streamer

    def step_all(self):
        super().step_all()
        S = self.params_in(0)
        held = [i for i, p in enumerate(S) if p.grad is not None]
        expect(not held, f"S's p.grad not None after step() for params {held}")
        for k in range(1, len(self.opts)):  # the others from the same (no) gradients on
            for p in self.params_in(k):
                p.grad = None

    def backward_all(self, x, first_micro=False):
        """A streamed backward returns with every bucket reduced and each
        of S's p.grad freed (docs/USAGE.md); inside no_sync() they stay."""
        r = self.r
        unused = r.random() < 0.15 and any(  # extra left out of the forward: no gradient
            p.requires_grad for p in plist(self.nets[0])[:4])  # (a loss to backward)
        held_back = not first_micro and r.random() < 0.1  # S's in no_sync() too: reduced at step()
        self.note += " extra unused;" * unused + " S's backward in no_sync();" * held_back
        for net in self.nets:  # (at several ranks: on rank 1 only)
            net.use_extra = not unused or (RANKS["pg"] is not None and RANKS["rank"] != 1)
        ps = plist(self.nets[0])
        if not any(p.requires_grad for p in ps[:4] + ps[4:] * self.nets[0].use_extra):
            for net in self.nets:  # (every param frozen: no loss to backward)
                net.use_extra = True
            self.note += " every param frozen: no backward;"
            return
        try:
            if held_back:
                with self.opts[0].no_sync():
                    self.loss(0, x).backward()
                for k in range(1, len(self.opts)):
                    self.loss(k, x).backward()
            else:
                super().backward_all(x, first_micro)
        finally:
            for net in self.nets:
                net.use_extra = True
        if first_micro or held_back:
            return
        held = [i for i, p in enumerate(self.params_in(0)) if p.grad is not None]
        expect(not held, f"S's p.grad not None after a streamed backward for params {held}")

    def between_backward_and_step(self):
        r = self.r
        if r.random() >= 0.4:
            return ""
        what = r.choice(["second_backward", "zero_grad", "clip", "hyper", "bad_lr",
                         "state_dict", "new_memory", "add_group", "freeze", "write",
                         "load_state_dict"])
        S, st = self.opts[0], self.streamer
        self.note = f"{what} after backward"
        if what in ("second_backward", "zero_grad") and not st.reduced:
            return f" ({what}: nothing reduced)"
        if what == "second_backward":
            before = self.snapshot(0)
            _refused(lambda: self.loss(0, self.x(0.3)).backward(), Status.BAD_STATE,
                     "second backward", "a second backward after the reductions")
            self.same_snapshot(before, self.snapshot(0), "refused second backward")
            for p in plist(self.nets[0]):  # what the refused backward left in p.grad
                p.grad = None
        elif what == "zero_grad":
            before = self.snapshot(0)
            _refused(lambda: S.zero_grad(set_to_none=r.random() < 0.5), Status.BAD_STATE,
                     "zero_grad", "zero_grad after the reductions")
            self.same_snapshot(before, self.snapshot(0), "refused zero_grad")
        elif what == "clip":
            return self.clip_by_hand()
        elif what == "hyper":
            gi, key = r.randrange(2), r.choice(["lr", "weight_decay"])
            v = r.choice([1e-3, 5e-3, 2e-2]) if key == "lr" else r.choice([0.0, 0.05, 0.2])
            for o in self.opts:
                o.param_groups[gi][key] = v
            return f"; group {gi} {key} = {v} after backward"
        elif what == "bad_lr":
            g = S.param_groups[0]
            old = g["lr"]
            before = self.snapshot(0)
            try:
                try:
                    g["lr"] = -1.0
                except (ValueError, ZoptError):
                    return "; bad lr refused at the assignment"
                try:
                    S.step()
                except (ValueError, ZoptError):
                    pass
                else:
                    if any(p.requires_grad for p in g["params"]):
                        raise Fail("a negative lr after backward was not refused at step()")
                    return "; bad lr not pushed (its group frozen), S stepped"  # (checked next)
            finally:
                g["lr"] = old
            self.same_snapshot(before, self.snapshot(0), "refused bad lr after backward")
        elif what == "state_dict":
            self.check("between backward and step()")
        elif what == "new_memory":  # registered in place: the reduced shards kept (S1)
            with torch.no_grad():
                for net in self.nets:
                    for p in plist(net):
                        p.data = p.data.clone()
        elif what == "freeze":  # requires_grad toggled, the gradients kept: stepped (torch)
            i = r.randrange(5)
            for net in self.nets:
                plist(net)[i].requires_grad_(not plist(net)[i].requires_grad)
            return f"; param {i} requires_grad toggled after backward"
        elif what == "write":  # in place (a version bump): the master made again
            i = r.randrange(5)
            val = (torch.randn(SHAPES[i], generator=self.g) * 0.5).to(self.dtype)
            with torch.no_grad():
                for net in self.nets:
                    plist(net)[i].copy_(val)
            return f"; param {i} written in place after backward"
        elif what == "load_state_dict":
            for o in self.opts:
                o.load_state_dict(o.state_dict())
        elif what == "add_group":  # a grown native optimizer: S's reduced shards lost
            if self.with_extra:
                return " (add_group: none to add)"
            was = st.reduced
            msg = self.a_add_group()
            if was:
                _refused(S.step, Status.BAD_STATE, "rebuilt", "step() after add_param_group")
            for p, q in zip(plist(self.nets[0]), plist(self.nets[1])):
                p.grad = None if q.grad is None else q.grad.clone()
            return f"; {msg} after backward, S's step refused, N's grads by hand"
        return f"; {what} after backward"

    def a_write(self):
        """A param written in place or given new memory; or (``handed``)
        l2.bias given new memory and its old storage the loose param's
        (their shapes are the same: a registered storage handed on)."""
        i = self.r.randrange(5)
        how = self.r.choice(["inplace", "replace", "handed"])
        if how == "handed":
            i = 3
        val = (torch.randn(SHAPES[i], generator=self.g) * 0.5).to(self.dtype)
        for net in self.nets:
            p = plist(net)[i]
            with torch.no_grad():
                if how == "inplace":
                    p.copy_(val)
                    continue
                old = p.data
                p.data = val.clone()
                if how == "handed":
                    old.copy_(net.extra.data)
                    net.extra.data = old
        return f"param {i} written {how}"

    def a_abort(self):
        self._abort_probe = self.r.random() < 0.5
        try:
            msg = super().a_abort()
        finally:
            probed, self._abort_probe = self._abort_probe, False
        return msg and msg + ("; zero_grad refused" if probed == "done" else "")

    def unused_grads(self):
        """(World.a_abort calls it right after the aborted backward: there,
        S's zero_grad is refused if a bucket was reduced, changing nothing.)"""
        super().unused_grads()
        if self._abort_probe is True and self.streamer.reduced:
            self._abort_probe = "done"
            before = self.snapshot(0)
            _refused(lambda: self.opts[0].zero_grad(set_to_none=self.r.random() < 0.5),
                     Status.BAD_STATE, "zero_grad", "zero_grad after an aborted backward")
            self.same_snapshot(before, self.snapshot(0), "refused zero_grad after an abort")

    _abort_probe = False

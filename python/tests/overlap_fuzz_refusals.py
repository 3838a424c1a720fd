"""The overlap fuzzer's actions around refusals and early reads
(python/tests/overlap_fuzz.py's World mixes them in): refusals between the
marks and step(), the model read right after step(), a backward aborted by
an exception, a negative lr."""
import ctypes

import torch

from zopt._lib import Status, ZoptError
from overlap_fuzz_model import SHAPES, Fail, expect, plist, same_t


class Refusals:
    """Methods of overlap_fuzz.World (its state: nets, opts, names, ...)."""

    def refusals_after_marks(self):
        """Between the marks and step(): A refuses (the documented error),
        nothing changes (the state cannot be read while buckets are marked:
        the step that follows must equal B's and C's)."""
        A = self.opts[0]
        ov = A._overlap
        if not ov.nmarked:
            return " (nothing marked)"
        what = self.r.choice(["second_backward", "zero_grad", "clip", "hyper"])
        if what == "second_backward":
            grads = [None if p.grad is None else p.grad.clone() for p in plist(self.nets[0])]
            mgs = [getattr(p, "main_grad", None) for p in plist(self.nets[0])]
            mgs = [None if m is None else m.clone() for m in mgs]
            try:
                self.loss(0, self.x(0.3)).backward()
            except ZoptError as e:
                expect(e.code == Status.BAD_STATE, f"second backward: {e}")
            else:
                raise Fail("a second backward after the marks was not refused")
            # the user's gradients back as they were (torch accumulated into them)
            for p, gr, mg in zip(plist(self.nets[0]), grads, mgs):
                p.grad = None if gr is None else self.dev(tuple(gr.shape), gr, gr.dtype)
                if mg is not None:
                    p.main_grad.copy_(mg)
        elif what == "zero_grad":
            try:
                A.zero_grad(set_to_none=self.r.random() < 0.5)
            except ZoptError as e:
                expect(e.code == Status.BAD_STATE, f"zero_grad after marks: {e}")
            else:
                raise Fail("zero_grad after the marks was not refused")
        elif what == "clip":
            try:
                A.clip_grad_norm_(1.0)
            except ZoptError as e:
                expect(e.code == Status.UNSUPPORTED, f"clip_grad_norm_ with overlap: {e}")
            else:
                raise Fail("clip_grad_norm_ with overlap was not refused")
        else:
            g = A.param_groups[0]
            old = g["lr"]
            g["lr"] = old * 2
            try:
                A.step()
            except ZoptError as e:
                expect(e.code == Status.BAD_STATE, f"lr edit after marks: {e}")
            else:
                raise Fail("an lr edit between the marks and step() was not refused")
            finally:
                g["lr"] = old
        return f"; refused {what}"

    def read_right_after_step(self):
        """A's model read right after step() (no drain): its forward (each
        module's pre-hook waits for its buckets, then the stream is
        synchronized) and its state_dict() (the hook waits for every
        bucket) see this step's params: B's and C's."""
        how = self.r.choice(["forward", "state_dict", "wait_params"])
        if how == "forward":
            x = self.x(1.0)
            ya = self.nets[0](x).detach().clone()
            with self.on(1):
                self.opts[1].step_count()
            self.fake.fake_cuda_drain_all()
            ys = [net(x) for net in self.nets[1:]]
            expect(all(torch.equal(ya, y) for y in ys),
                   "a forward right after step() saw other params than B's / C's")
        else:
            if how == "state_dict":
                sd = self.nets[0].state_dict()
            else:
                self.opts[0].wait_params()
                sd = dict(self.nets[0].named_parameters())
            assert self.fake.cuStreamSynchronize(ctypes.c_void_p(self.s.cur["s"])) == 0
            got = {k: v.detach().clone() for k, v in sd.items()}
            self.settle()
            late = dict(self.nets[0].named_parameters())
            for k, v in self.nets[-1].named_parameters():
                expect(same_t(got[k], v), f"model {how} right after step(): {k} is not "
                       f"this step's: {got[k].float().view(-1)[:3].tolist()}, then "
                       f"{late[k].detach().float().view(-1)[:3].tolist()}; "
                       f"{self.names[-1]}'s {v.detach().float().view(-1)[:3].tolist()}"
                       + "".join(f"; {self.names[j]}'s "
                                 f"{dict(self.nets[j].named_parameters())[k].detach().float().view(-1)[:3].tolist()}"
                                 for j in range(1, len(self.nets) - 1)))
        return f"; {how} right after step"

    def a_abort(self):
        """A backward aborted by an exception between l2 and l1: l2's (and
        extra's) gradients accumulated, l1's not; then step()."""
        l1 = self.nets[0].l1
        if not (l1.weight.requires_grad or l1.bias.requires_grad):
            return None  # (no backward through l1 to abort)
        for net in self.nets:
            net.abort = True
        self.zero_grad(self.r.choice(["none", "zeros"]))
        x = self.x(0.3)
        try:
            for k in range(len(self.opts)):
                with self.on(k):
                    try:
                        self.loss(k, x).backward()
                    except RuntimeError as e:
                        expect("fuzz: backward aborted" in str(e), f"aborted backward: {e}")
                    else:
                        raise Fail("the backward was not aborted")
        finally:
            for net in self.nets:
                net.abort = False
        self.unused_grads()
        msg = "aborted backward"
        # at 1 rank with overlap, a param that requires grad but has none
        # after the marks: step() refuses naming it, nothing changes; then
        # every copy gets the same gradient by hand
        lacking = [i for i, p in enumerate(plist(self.nets[0]))
                   if p.requires_grad and p.grad is None and (i < 4 or self.with_extra)
                   and not (self.main and getattr(p, "main_grad", None) is not None)]
        cls = self.opts[0]._class_of  # (gpu_fraction: the GPU class takes its gradients
        off = [i for i in lacking  # at step(), a param without one left alone)
               if not str(cls.get(id(plist(self.nets[0])[i]), "")).endswith(":gpu")]
        if self.ov and off and self.opts[0]._overlap.started:
            try:
                self.opts[0].step()
            except ZoptError as e:
                expect(e.code == Status.BAD_STATE and "has no gradient" in str(e),
                       f"step after an aborted backward: {e}")
            else:
                raise Fail("step() after an aborted backward stepped without gradients")
            for i in lacking:
                gd = (torch.randn(SHAPES[i], generator=self.g) * 0.01).to(self.grad_dtype())
                for k, net in enumerate(self.nets):
                    p = plist(net)[i]
                    self.give(k, p, gd)
            msg += f"; step refused, grads by hand for {lacking}"
        self.step_all()
        return msg

    def a_bad_lr(self):
        """A negative lr: refused (ValueError or ZoptError), nothing changes:
        with overlap at the first hook (the hyperparameters are pushed
        there; raised at the end of that backward, nothing marked) or, where
        no hook pushed it, at step(); else at the assignment (GPU steps push
        it at once) or at step(). Then the lr back and a step of every copy
        (a step refused after the marks goes on with them)."""
        self.zero_grad("none")
        before = self.snapshot(0)
        o = self.opts[0]
        old = o.param_groups[0]["lr"]
        x = self.x(0.3)
        stage = "assign"
        try:
            try:
                o.param_groups[0]["lr"] = -1.0
            except (ValueError, ZoptError):  # a GPU step pushes it at once: refused there
                expect(o.param_groups[0]["lr"] == old, "a refused lr was kept in param_groups")
                raise
            if self.ov:
                stage = "backward"
                self.loss(0, x).backward()
                stage = "step"
                o.step()
            else:
                self.hand_grads_only()
                stage = "step"
                o.step()
        except (ValueError, ZoptError):
            pass
        else:  # (a group whose every param is frozen is not pushed: its lr unused)
            if self.mode == "gpu" or any(p.requires_grad for p in o.param_groups[0]["params"]):
                raise Fail(f"a negative lr was not refused (stage {stage})")
        finally:
            o.param_groups[0]["lr"] = old
        if self.ov and stage == "step" and o._overlap.nmarked:
            for k in range(1, len(self.opts)):  # the other copies' same backward
                with self.on(k):
                    self.loss(k, x).backward()
            self.unused_grads()
            self.step_all()
            return "bad lr refused at step() after the marks, then step"
        if self.ov:
            expect(o._overlap.nmarked == 0, "a refused backward marked buckets")
        self.same_snapshot(before, self.snapshot(0), "refused bad lr")
        if self.ov:
            self.zero_grad("none")
            self.backward_all(x)
            self.unused_grads()
        self.step_all()
        return f"bad lr refused ({stage}), then step"

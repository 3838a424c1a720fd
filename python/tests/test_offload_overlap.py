"""``zopt.Optimizer(..., overlap=True)`` (zopt/overlap.py; docs/USAGE.md
"Overlapping an offloaded step with backward"): an offloaded step whose
gradient buckets are marked ready from autograd hooks during backward.

The stand-in driver test (libzopt-fake-cuda.so: the real offload backend,
device memory in host memory, copies queued asynchronously with random
delays) runs a small model's backward with fresh bf16 gradients in device
memory every step (a hook moves each new p.grad there before zopt's hook
sees it). The overlapped optimizer's params and states equal, bit for bit,
those of the same offloaded optimizer without overlap at every step:
clipping inactive (every speculation committed), clipping active
(recomputed), an inf (discarded), a speculation budget below the model
(some buckets updated after validation), gradient accumulation inside
``no_sync()``, a step() with no backward hook (marked at step). The
buckets are marked during backward (pipeline_stats, the binding's
counters). Then the refusals.
"""
import os
import sys

import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError
import overlap_fakes as of
from gpu_fakes import REPO, needs_fake, run_worker

STEP = "examples/adamw_bf16_offload_6b.mlir"  # bf16 everywhere, clip at 1.0


@pytest.fixture
def six_byte(steps):
    with open(os.path.join(REPO, STEP)) as fh:
        return steps.text(fh.read())


@needs_fake
def test_overlap_from_backward_hooks_bit_identical(six_byte, tmp_path):
    out = run_worker(__file__, "overlap", six_byte.path, tmp_path,
                     ZOPT_FAKE_CUDA_ASYNC="1", ZOPT_FAKE_CUDA_STRESS="200")
    assert out["nb"] >= 3
    assert out["same"] == [True] * len(out["plans"]), out
    want = {"small": "commit", "clip": "recompute", "inf": "discard", "budget": "commit",
            "accumulate": "commit", "no_hooks": "commit"}
    for plan, st in zip(out["plans"], out["stats"]):
        assert st["outcome"] == want[plan], (plan, st)
        assert st["buckets"] == out["nb"]
        if plan == "budget":
            assert 1 <= st["speculated"] < out["nb"] and st["late"] == out["nb"] - st["speculated"]
        elif plan != "inf":
            assert st["speculated"] == out["nb"]
    # the hooks marked every bucket during backward but the steps without one
    assert out["in_backward"] == (len(out["plans"]) - 1) * out["nb"]
    assert out["at_step"] == out["nb"]
    assert out["finite"] and out["bad_ranges"] == 0
    assert out["refusals"] == ["second_backward", "zero_grad", "clip_grad_norm_",
                               "hyper_after_mark", "stats_without_overlap", "no_grad"], out
    assert out["last_outcome"] == "commit"


def test_overlap_refused_where_it_cannot_work(steps):
    """A CPU step (nothing to overlap), grad_streaming together with it, a
    step per dtype, a bad budget: clear errors at construction."""
    st = steps(rule="adamw", layout="f32")
    p = [torch.nn.Parameter(torch.randn(8))]
    with pytest.raises(ZoptError) as e:
        zopt.Optimizer(st, p, overlap=True)
    assert e.value.code == Status.UNSUPPORTED and "offloaded" in str(e.value)
    with pytest.raises(ZoptError) as e:
        zopt.Optimizer(st, p, speculation_budget=1 << 20)
    assert e.value.code == Status.INVALID_ARGUMENT and "overlap=True" in str(e.value)
    with pytest.raises(ZoptError) as e:
        zopt.Optimizer({torch.float32: st}, p, overlap=True)
    assert e.value.code == Status.UNSUPPORTED


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _worker(what, step_path, tmp):
    s, fake, dev, g, init = of.start()
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # overlap
    B = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # serial
    inject = {"inf": False}
    keep = []
    of.grads_to_device(A + B, dev, keep,  # an inf in b1's when asked
                       lambda p: inject["inf"] and p.dim() == 1 and p.numel() == 64)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    step = zopt.Step(step_path)
    opt_a = zopt.Optimizer(step, A, overlap=True, speculation_budget=1 << 40, **kw)
    opt_b = zopt.Optimizer(step, B, **kw)
    ov = opt_a._overlap
    out = {"nb": ov.nb, "plans": [], "stats": [], "same": []}
    backward = of.backward
    plans = [("small", 1e-3), ("clip", 50.0), ("inf", 1e-3), ("budget", 1e-3),
             ("accumulate", 1e-3), ("no_hooks", 1e-3), ("small", 1e-3)]
    for k, (plan, scale) in enumerate(plans):
        x = torch.randn(8, 32, generator=g)
        for o in (opt_a, opt_b):
            o.zero_grad(set_to_none=True)
        if plan == "budget":  # about one bucket: the rest updated after validation
            ov.set_budget(1500 * 8)
        inject["inf"] = plan == "inf"
        if plan == "accumulate":  # two micro-batches: only the last backward marks
            x2 = torch.randn(8, 32, generator=g)
            of.first_micro_batch(opt_a, A, B, x2, scale)
        if plan == "no_hooks":  # gradients set by hand: step() marks every bucket
            for p, q in zip(A, B):
                gd = torch.randn(p.shape, generator=g).bfloat16() * 1e-3
                p.grad, q.grad = dev(tuple(p.shape), gd), dev(tuple(p.shape), gd)
        else:
            of.marking_backward(opt_a, A, B, x, scale)
        inject["inf"] = False
        opt_a.step()
        opt_b.step()
        if plan == "budget":
            ov.set_budget(None)
        opt_a.step_count()
        opt_b.step_count()
        fake.fake_cuda_drain_all()
        st = opt_a.pipeline_stats()
        same = all(of.equal(p, q) for p, q in zip(A, B)) and of.same_states(opt_a, opt_b)
        same = same and opt_a.last_skipped == opt_b.last_skipped
        out["plans"].append(plan)
        out["stats"].append(st)
        out["same"].append(bool(same))
    out.update(ov.stats)
    out["finite"] = all(bool(torch.isfinite(p.float()).all()) for p in A)

    refusals = []

    def refused(name, fn, status):
        try:
            fn()
        except ZoptError as e:
            if e.code == status:
                refusals.append(name)
                return
            raise
    # a second backward after the buckets were marked
    x = torch.randn(8, 32, generator=g)
    opt_a.zero_grad(set_to_none=True)
    backward(A, x, 1e-3)
    refused("second_backward", lambda: backward(A, x, 1e-3), Status.BAD_STATE)
    refused("zero_grad", lambda: opt_a.zero_grad(), Status.BAD_STATE)
    refused("clip_grad_norm_", lambda: opt_a.clip_grad_norm_(1.0), Status.UNSUPPORTED)

    def change_lr():
        opt_a.param_groups[0]["lr"] = 0.5
        try:
            opt_a.step()
        finally:
            opt_a.param_groups[0]["lr"] = 1e-2
    refused("hyper_after_mark", change_lr, Status.BAD_STATE)
    opt_a.step()  # the marked step goes on, the lr as at the marks
    refused("stats_without_overlap", opt_b.pipeline_stats, Status.BAD_STATE)
    # a backward that leaves params 2 and 3 without a gradient: their
    # buckets stay unmarked, step() names one; given one by hand, it steps
    opt_a.zero_grad(set_to_none=True)
    w1, b1 = A[0].float(), A[1].float()
    (torch.tanh(x @ w1.t() + b1).square().mean() * 1e-3).backward()
    assert 0 < ov.nmarked < ov.nb
    try:
        opt_a.step()
    except ZoptError as e:
        m = str(e)
        if e.code == Status.BAD_STATE and "has no gradient" in m and (
                "['params'][2]" in m or "['params'][3]" in m):
            refusals.append("no_grad")
        else:
            raise
    for p in A[2:]:
        p.grad = dev(tuple(p.shape), torch.full(p.shape, 1e-3))
    opt_a.step()
    out["last_outcome"] = opt_a.pipeline_stats()["outcome"]
    out["refusals"] = refusals
    of.finish(s, out, opt_a, opt_b)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

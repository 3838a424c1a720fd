"""``zopt.Optimizer(..., overlap=True)`` with f32 gradients of bf16 params
(``p.main_grad``; docs/USAGE.md sections 5 and 13) on the stand-in driver
(libzopt-fake-cuda.so: device memory in host memory, copies queued
asynchronously with random delays).

The offloaded step reads f32 gradients: the binding's hooks on each
param's AccumulateGrad node first add ``p.grad`` into ``p.main_grad`` (the
optimizer's own f32 buffer in device memory, or a user's ``main_grad``
read in place), then mark each bucket whose params are final. The
overlapped optimizer's params and states equal, bit for bit, those of the
same offloaded optimizer without overlap at every step: clipping inactive
(committed), clipping active (recomputed), an inf (discarded), gradient
accumulation of two micro-batches in f32 inside ``no_sync()``, a user's
``main_grad`` (read in place, never copied), ``grad_accumulation="manual"``
(``p.grad`` left for the binding to add at the mark), and ``main_grad``
set by hand with no backward (marked at ``step()``). A ``main_grad`` of
the wrong dtype is refused before anything is marked; without it the
next backward steps as the serial optimizer. A process whose last
backward was refused so exits at once (the hooks' error is raised at the
end of backward, not from the hook: torch 1.13 otherwise left the graph
in the main thread's ready queue, freed at exit after the interpreter,
and the process hung there; zopt/_marks.py).
"""
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
import overlap_fakes as of  # noqa: E402
from gpu_fakes import FAKE, REPO, needs_fake, run_worker  # noqa: E402


@needs_fake
def test_overlap_main_grad_bit_identical(steps, tmp_path):
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", param="bf16", grad="f32",
                                  master="f32", clip=1.0, comments=False))
    want = {"small": "commit", "clip": "recompute", "inf": "discard", "accumulate": "commit",
            "user_main": "commit", "manual": "commit", "no_backward": "commit"}
    out = run_worker(__file__, "main", off.path, tmp_path,
                     ZOPT_FAKE_CUDA_ASYNC="1", ZOPT_FAKE_CUDA_STRESS="200")
    assert out["nb"] >= 3
    assert out["same"] == [True] * len(out["plans"]), out
    for plan, st, nmark in zip(out["plans"], out["stats"], out["in_backward"]):
        assert st["outcome"] == want[plan], (plan, st)
        assert st["buckets"] == out["nb"]
        # the hooks mark every bucket during backward (not without one)
        assert nmark == (0 if plan == "no_backward" else out["nb"]), (plan, nmark)
    assert out["user_in_place"] and out["finite"] and out["bad_ranges"] == 0
    code, msg = out["bad_main"]
    assert code == int(zopt.Status.INVALID_ARGUMENT) and "main_grad" in msg and "float32" in msg
    assert out["bad_main_marked"] == 0 and out["after_bad_same"]


@needs_fake
def test_refused_backward_then_exit(steps, tmp_path):
    """The process's last backward refused (a main_grad of the wrong dtype):
    it raises and the process exits at once (it hung at exit before)."""
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", param="bf16", grad="f32",
                                  master="f32", clip=1.0, comments=False))
    env = dict(os.environ, ZOPT_CUDA_DRIVER=FAKE, ZOPT_FAKE_CUDA_ASYNC="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "exit", off.path,
                            str(tmp_path)], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:  # (run() killed it)
        raise AssertionError(f"the process hung at exit:\n{e.stdout}\n{e.stderr}") from None
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == int(zopt.Status.INVALID_ARGUMENT) and "main_grad" in out["msg"]
    assert out["marked"] == 0 and out["stepped"]


def _refused_then_exit(step_path):
    """One step, then a backward refused at its first hook; the process ends."""
    s, fake, dev, g, init = of.start()
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]
    opt = zopt.Optimizer(zopt.Step(step_path), A, overlap=True, lr=1e-2, bucket_elems=1024)
    x = torch.randn(8, 32, generator=g)
    of.backward(A, x, 1e-3)
    opt.step()
    out = {"stepped": opt.step_count() == 1}
    opt.zero_grad(set_to_none=True)
    A[0].main_grad = torch.zeros(A[0].shape, dtype=torch.float16)
    try:
        of.backward(A, x, 1e-3)
    except zopt.ZoptError as e:
        out.update(code=int(e.code), msg=str(e))
    out["marked"] = opt._overlap.nmarked
    print(json.dumps(out), flush=True)


def _worker(what, step_path, tmp):
    if what == "exit":
        return _refused_then_exit(step_path)
    s, fake, dev, g, init = of.start()
    inject = {"inf": False}
    keep = []

    def inf_hook(p):  # before zopt's hooks: an inf in p.grad when asked
        def hook(*_):
            if inject["inf"] and p.grad is not None:
                p.grad = p.grad.clone()
                p.grad[5] = float("inf")
        node = p.expand_as(p).grad_fn.next_functions[0][0]
        keep.append((node, node.register_hook(hook)))

    def model():
        ps = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]
        inf_hook(ps[1])
        return ps
    A, B, M, N = model(), model(), model(), model()
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    step = zopt.Step(step_path)
    opt_a = zopt.Optimizer(step, A, overlap=True, **kw)
    opt_b = zopt.Optimizer(step, B, **kw)
    ov = opt_a._overlap
    out = {"nb": ov.nb, "plans": [], "stats": [], "same": [], "in_backward": []}

    backward = of.backward

    def same_as(oa, ob, pa, pb):
        return of.same_as(fake, oa, ob, pa, pb)

    plans = [("small", 1e-3), ("clip", 50.0), ("inf", 1e-3), ("accumulate", 1e-3),
             ("user_main", 1e-3), ("no_backward", 1e-3), ("small", 1e-3)]
    user = None
    for plan, scale in plans:
        x = torch.randn(8, 32, generator=g)
        for o in (opt_a, opt_b):
            o.zero_grad(set_to_none=True)
        n0 = ov.stats["in_backward"]
        if plan == "user_main":  # a framework's main_grad: accumulated into, read in place
            user = [dev(p.shape, torch.zeros(p.shape), torch.float32) for p in A]
            for p, q, u in zip(A, B, user):
                p.main_grad = u
                q.main_grad = dev(p.shape, torch.zeros(p.shape), torch.float32)
        inject["inf"] = plan == "inf"
        if plan == "accumulate":  # two micro-batches, summed in f32: the last one marks
            x2 = torch.randn(8, 32, generator=g)
            of.first_micro_batch(opt_a, A, B, x2, scale)
        if plan == "no_backward":  # main_grad set by hand: step() marks every bucket
            for p, q in zip(A, B):
                gd = torch.randn(p.shape, generator=g) * 1e-3
                p.main_grad = dev(p.shape, gd, torch.float32)
                q.main_grad = dev(p.shape, gd, torch.float32)
        else:
            of.marking_backward(opt_a, A, B, x, scale)
        inject["inf"] = False
        opt_a.step()
        opt_b.step()
        if plan == "user_main":
            c = opt_a._parts[0]
            out["user_in_place"] = all(c.foreign[t][0] is u for t, u in enumerate(user)) \
                and all(p.main_grad is u for p, u in zip(A, user))
        out["plans"].append(plan)
        out["stats"].append(opt_a.pipeline_stats())
        out["in_backward"].append(ov.stats["in_backward"] - n0)
        out["same"].append(same_as(opt_a, opt_b, A, B))
    out["finite"] = all(bool(torch.isfinite(p.float()).all()) for p in A)

    # grad_accumulation="manual": p.grad is left by torch; the binding adds
    # it into main_grad at the mark (the serial step at step()).
    opt_m = zopt.Optimizer(step, M, overlap=True, grad_accumulation="manual", **kw)
    opt_n = zopt.Optimizer(step, N, grad_accumulation="manual", **kw)
    x = torch.randn(8, 32, generator=g)
    backward(M, x, 1e-3)
    assert opt_m._overlap.nmarked == opt_m._overlap.nb
    backward(N, x, 1e-3)
    opt_m.step()
    opt_n.step()
    out["plans"].append("manual")
    out["stats"].append(opt_m.pipeline_stats())
    out["in_backward"].append(opt_m._overlap.stats["in_backward"])
    out["same"].append(same_as(opt_m, opt_n, M, N))

    # A user's main_grad the step cannot read (f16): refused at the first
    # hook, before any bucket is marked.
    opt_a.zero_grad(set_to_none=True)
    A[0].main_grad = torch.zeros(A[0].shape, dtype=torch.float16)
    out["bad_main"] = None
    try:
        backward(A, x, 1e-3)
    except zopt.ZoptError as e:
        out["bad_main"] = [int(e.code), str(e)]
    out["bad_main_marked"] = ov.nmarked
    # nothing changed: without it, the next backward marks and steps (as the
    # serial optimizer over the same gradients). (Not needed to exit: see
    # test_refused_backward_then_exit.)
    A[0].main_grad = None
    for o in (opt_a, opt_b):
        o.zero_grad(set_to_none=True)
    backward(A, x, 1e-3)
    backward(B, x, 1e-3)
    opt_a.step()
    opt_b.step()
    out["after_bad_same"] = same_as(opt_a, opt_b, A, B)
    for o in (opt_a, opt_b, opt_m, opt_n):
        o.close()
    fake.fake_cuda_drain_all()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

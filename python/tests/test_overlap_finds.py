"""What the overlap fuzzer found (python/tests/overlap_fuzz.py; docs/TESTING.md
"The overlap fuzzer"), each minimized to a deterministic test that failed
before its fix. Stand-in driver workers (libzopt-fake-cuda.so, copies queued
asynchronously), as test_offload_overlap.py's."""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
import overlap_fakes as of  # noqa: E402
from gpu_fakes import needs_fake, run_worker  # noqa: E402


@needs_fake
def test_o2_param_unfrozen_after_build_steps_at_once(steps, tmp_path):
    """O2 (silently wrong): an overlapped optimizer built (or rebuilt by a
    load into a new one) while a param was frozen hooks only the params that
    required grad. Unfrozen later, that param got its gradient in the next
    backward, but the step took the set of params to update from the hooks
    (an unhooked param: inactive) and left it alone without a word: one
    update lost, its count one behind, the serial step's result never met
    again. Now it is active and its bucket is marked at the end of that
    backward: every step bit-identical to the serial optimizer's."""
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", param="bf16", master="f32", clip=1.0))
    out = run_worker(__file__, "unfrozen", off.path, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1")
    assert out["same"] == [True] * 4, out
    assert out["counts"] == [[0, 1, 1, 1], [1, 2, 2, 2], [2, 3, 3, 3], [3, 4, 4, 4]], out
    assert out["bad_ranges"] == 0


# ---- the workers (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _unfrozen(step_path):
    s, fake, dev, g, init = of.start()
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # overlap
    B = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # serial
    keep = []
    of.grads_to_device(A + B, dev, keep)
    for P in (A, B):
        P[0].requires_grad_(False)  # frozen when the optimizers are built
    st = zopt.Step(step_path)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    oa = zopt.Optimizer(st, A, overlap=True, **kw)
    ob = zopt.Optimizer(st, B, **kw)
    out = {"same": [], "counts": []}
    for frozen in (True, False, False, False):  # unfrozen before the second step
        for P in (A, B):
            P[0].requires_grad_(not frozen)
        x = torch.randn(8, 32, generator=g)
        for o in (oa, ob):
            o.zero_grad(set_to_none=True)
        fake.fake_cuda_drain_all()  # (B's forward reads its params on the host)
        of.backward(A, x, 1e-3)
        of.backward(B, x, 1e-3)
        oa.step()
        ob.step()
        out["same"].append(of.same_as(fake, oa, ob, A, B))
        out["counts"].append([oa.tensor_step(p) for p in A])
    of.finish(s, out, oa, ob)


if __name__ == "__main__":
    {"unfrozen": _unfrozen}[sys.argv[1]](sys.argv[2])

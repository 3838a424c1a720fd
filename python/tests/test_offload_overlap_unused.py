"""``zopt.Optimizer(..., overlap=True)`` at 2 gloo ranks when a param that
requires grad gets no gradient on some ranks (docs/USAGE.md "Overlapping an
offloaded step with backward", Ranks).

Each rank is a process with the stand-in CUDA driver (libzopt-fake-cuda.so)
and two optimizers over the same small bf16 model on the gloo process
group: the overlapped one and the same offloaded step without overlap
(serial). Each step a rank's loss leaves some params out of its graph
(``p.detach()``): w1 on rank 1 only (its buckets are marked last); b1 on
rank 1 only (a bucket in the middle); b1 on both ranks; w2 on rank 0 and
b1 on rank 1 (with clipping active); then every param on both ranks. The
rank without a gradient marks the param's bucket at the end of backward
with zeros and drops the param from its mask at ``step()``: after every
step the overlapped optimizer's params, states and per-param step counts
equal the serial one's bit for bit (a param with a gradient on one rank
is updated with it, the other rank contributing zeros; a param with none
on any rank is left alone, its count unchanged), and the buckets are
marked in ascending order on both ranks. Before, rank 1's step() raised
(a param without a gradient) while rank 0's waited for w1's bucket's
reduction: until the communicator's timeout (60 s here; the job's hard
timeout is 40 s) while rank 1 stayed out of zopt's collectives, or until
rank 1 exited (as here: rank 0 then fails, connection closed); and a
bucket in the middle failed both ranks' steps as if they had marked in
different orders.
"""
import datetime
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
import overlap_fakes as of  # noqa: E402
from gpu_fakes import FAKE, needs_fake  # noqa: E402

KW = dict(param="bf16", grad="bf16", master="f32", clip=1.0, comments=False)
# per step: (loss scale, the params rank 0 leaves out, those rank 1 leaves out)
PLANS = [(1e-3, [], [0]), (1e-3, [], [1]), (1e-3, [1], [1]), (50.0, [2], [1]), (1e-3, [], [])]


@needs_fake
@pytest.mark.parametrize("zero_stage", [2, 0])
def test_overlap_param_without_grad_on_one_rank(steps, tmp_path, zero_stage):
    from test_comm import _free_port, _run_all, _runtime_env
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", zero_stage=zero_stage, **KW))
    env = dict(_runtime_env(), ZOPT_CUDA_DRIVER=FAKE, ZOPT_FAKE_CUDA_ASYNC="1",
               ZOPT_FAKE_CUDA_STRESS="200")
    port = _free_port()
    cmds = [[sys.executable, os.path.abspath(__file__), str(r), "2", str(port), str(tmp_path),
             off.path] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=40, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    got = []
    for r in range(2):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            got.append(json.load(fh))
    for r, out in enumerate(got):
        assert out["same"] == [True] * len(PLANS), (r, out)
        assert [s["outcome"] for s in out["stats"]] == ["commit"] * 3 + ["recompute",
                                                                         "commit"], (r, out)
        # b1's count: no rank had its gradient at step 3
        assert out["counts"][-1] == [5, 4, 5, 5], (r, out)
        assert out["zeroed"] == sum(len(p[1 + r]) for p in PLANS), (r, out)
        assert out["in_order"] and out["bad_ranges"] == 0
    assert got[0]["params"] == got[1]["params"]


# ---- one rank (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _rank(rank, world, port, outdir, off_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    s, fake, dev, g, init = of.start()
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # overlap
    B = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # serial
    keep = []
    of.grads_to_device(A + B, dev, keep)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024, process_group=dist.group.WORLD)
    opt_a = zopt.Optimizer(zopt.Step(off_path), A, overlap=True, **kw)
    opt_b = zopt.Optimizer(zopt.Step(off_path), B, **kw)
    ov = opt_a._overlap
    order = []
    real_mark = ov._mark
    ov._mark = lambda b, where: (order.append(b), real_mark(b, where))
    out = {"same": [], "stats": [], "counts": []}
    for scale, left0, left1 in PLANS:
        left = left0 if rank == 0 else left1
        x = torch.randn(8, 32, generator=g) + rank  # each rank its own batch
        for o in (opt_a, opt_b):
            o.zero_grad(set_to_none=True)
        for ps in (A, B):  # the params left out: in the forward, not in the graph
            of.loss([p.detach() if i in left else p for i, p in enumerate(ps)], x,
                    scale).backward()
        assert ov.nmarked == ov.nb  # every bucket marked by the end of backward
        opt_a.step()
        opt_b.step()
        out["same"].append(of.same_as(fake, opt_a, opt_b, A, B) and
                           [opt_a.tensor_step(p) for p in A] == [opt_b.tensor_step(p) for p in B])
        out["stats"].append(opt_a.pipeline_stats())
        out["counts"].append([opt_a.tensor_step(p) for p in A])
    out["in_order"] = order == list(range(ov.nb)) * len(PLANS)
    out["zeroed"] = ov.stats["zeroed"]
    out["params"] = [p.detach().float().tolist() for p in A]
    s.close_all(out, opt_a, opt_b)
    of.finish_rank(out, outdir, rank)


if __name__ == "__main__":
    a = sys.argv
    _rank(int(a[1]), int(a[2]), a[3], a[4], a[5])

"""``zopt.Optimizer(..., overlap=True)`` at 2 gloo ranks (ZeRO-2, ZeRO-1 and
ZeRO-0 offloaded steps; docs/USAGE.md "Overlapping an offloaded step with
backward").

Each rank is a process with the stand-in CUDA driver (libzopt-fake-cuda.so:
device memory in host memory, copies queued asynchronously with random
delays) and three optimizers over the same small bf16 model, all on the
gloo process group: the overlapped one (its buckets marked from autograd
hooks during backward: each bucket's job reduces it across the ranks, and
at ZeRO-1/0 gathers the reduced bucket), the
same offloaded step without overlap (serial), and the all-CPU twin of the
step. Each step every rank runs a backward on its own batch. After every
step the overlapped optimizer's params and states equal the serial one's
bit for bit, and the serial one's equal the CPU twin's: clipping inactive
(committed), clipping active (recomputed), an inf on rank 1 only
(discarded on both), gradient accumulation inside ``no_sync()``, and a
step without backward whose gradients only rank 0 has (both ranks'
step() mark every bucket: the step is collective). Then
rank 1's backward produces its gradients in another order than rank 0's:
at W ranks the buckets are marked in ascending order (each once it and
the ones before it are final), so both ranks mark in the same order and
the step is bit-identical to the serial one over the same gradients.
The processes have a hard timeout and are killed on failure.
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


@needs_fake
@pytest.mark.parametrize("zero_stage", [2, 1, 0])
def test_overlap_two_gloo_ranks_bit_identical(steps, tmp_path, zero_stage):
    from test_comm import _free_port, _run_all, _runtime_env
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", zero_stage=zero_stage, **KW))
    cpu = steps.text(S.adamw.text(zero_stage=zero_stage, **KW))
    env = dict(_runtime_env(), ZOPT_CUDA_DRIVER=FAKE, ZOPT_FAKE_CUDA_ASYNC="1",
               ZOPT_FAKE_CUDA_STRESS="200")
    port = _free_port()
    cmds = [[sys.executable, os.path.abspath(__file__), str(r), "2", str(port), str(tmp_path),
             off.path, cpu.path] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=120, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    got = []
    for r in range(2):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            got.append(json.load(fh))
    want = {"small": "commit", "clip": "recompute", "inf": "discard", "accumulate": "commit",
            "by_hand": "commit"}
    for r, out in enumerate(got):
        assert out["nb"] >= 3
        assert out["same_as_serial"] == [True] * len(out["plans"]), (r, out)
        assert out["serial_same_as_cpu"] == [True] * len(out["plans"]), (r, out)
        for plan, st in zip(out["plans"], out["stats"]):
            assert st["outcome"] == want[plan], (r, plan, st)
            assert st["buckets"] == out["nb"]
        assert out["skipped"] == [p == "inf" for p in out["plans"]], (r, out)
        # every bucket marked from the hooks during backward, every step
        # but the one without a backward (at step(), also on rank 1, which
        # has no gradient: every step() is collective)
        assert out["in_backward"] == (len(out["plans"]) - 1) * out["nb"], (r, out)
        assert out["at_step"] == out["nb"]
        assert out["finite"]
        assert out["other_order_same"], (r, out)
        assert out["bad_ranges"] == 0
    # rank 1's gradients came in another order; both marked in ascending order
    assert got[0]["order"] == got[1]["order"] == sorted(got[0]["order"]), (got[0], got[1])
    assert got[0]["final_order"] != got[1]["final_order"], (got[0], got[1])
    # the ranks agree (each holds the whole params after the gather)
    assert got[0]["params"] == got[1]["params"]


# ---- one rank (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _rank(rank, world, port, outdir, off_path, cpu_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # the CPU twin's gradients in host memory
    s, fake, dev, g, init = of.start(device_steps_only=True)
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # overlap
    B = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # serial
    C = [torch.nn.Parameter(w.clone()) for w in init]                       # CPU twin
    inject = {"inf": False}
    keep = []
    of.grads_to_device(A + B, dev, keep,  # an inf in b1's on rank 1 when asked
                       lambda p: inject["inf"] and rank == 1 and p.dim() == 1 and p.numel() == 64)
    pg = dist.group.WORLD
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024, process_group=pg)
    opt_a = zopt.Optimizer(zopt.Step(off_path), A, overlap=True, **kw)
    opt_b = zopt.Optimizer(zopt.Step(off_path), B, **kw)
    opt_c = zopt.Optimizer(zopt.Step(cpu_path), C, **kw)
    assert opt_a.world_size == world and opt_a.rank == rank
    ov = opt_a._overlap
    out = {"nb": ov.nb, "plans": [], "stats": [], "same_as_serial": [],
           "serial_same_as_cpu": [], "skipped": []}

    loss, equal, same_states = of.loss, of.equal, of.same_states

    def first_layer_first(ps, scale):
        """A loss whose backward produces w1's gradient first and b2's last
        (independent terms: the term made last is differentiated first), so
        its buckets are final in another order than loss()'s."""
        return sum((p.float().square().sum() * scale for p in reversed(ps)), 0)

    def compare():
        for o in (opt_a, opt_b):
            o.step_count()
        fake.fake_cuda_drain_all()
        same = all(equal(p, q) for p, q in zip(A, B)) and same_states(opt_a, opt_b)
        twin = all(equal(p, q) for p, q in zip(B, C)) and same_states(opt_b, opt_c)
        return bool(same), bool(twin)

    def batch():
        x = torch.randn(8, 32, generator=g)  # the same stream on both ranks:
        return x + rank                      # each rank its own batch

    plans = [("small", 1e-3), ("clip", 50.0), ("inf", 1e-3), ("accumulate", 1e-3),
             ("by_hand", 1e-3), ("small", 1e-3)]
    for plan, scale in plans:
        x = batch()
        for o in (opt_a, opt_b, opt_c):
            o.zero_grad(set_to_none=True)
        inject["inf"] = plan == "inf"
        if plan == "accumulate":  # two micro-batches: only the last backward marks
            x2 = batch()
            with opt_a.no_sync():
                loss(A, x2, scale).backward()
            assert ov.nmarked == 0
            loss(B, x2, scale).backward()
            loss(C, x2, scale).backward()
        if plan == "by_hand":  # no backward; gradients on rank 0 only: step() marks
            for p, q, h in zip(A, B, C):
                gd = torch.randn(p.shape, generator=g).bfloat16() * 1e-3  # (both ranks draw)
                if rank == 0:
                    p.grad, q.grad, h.grad = dev(p.shape, gd), dev(p.shape, gd), gd.clone()
        else:
            loss(A, x, scale).backward()
            assert ov.nmarked == ov.nb  # every bucket marked by the end of backward
            loss(B, x, scale).backward()
            loss(C, x, scale).backward()
        if plan == "inf" and rank == 1:
            C[1].grad[5] = float("inf")
        inject["inf"] = False
        for o in (opt_a, opt_b, opt_c):
            o.step()
        same, twin = compare()
        out["plans"].append(plan)
        out["stats"].append(opt_a.pipeline_stats())
        out["same_as_serial"].append(same)
        out["serial_same_as_cpu"].append(twin)
        out["skipped"].append(opt_a.last_skipped)
    out.update(ov.stats)
    out["finite"] = all(bool(torch.isfinite(p.float()).all()) for p in A)

    # Rank 1 produces its gradients in another order: the buckets are still
    # marked in ascending order on both ranks, and the step is the serial one.
    x = batch()
    for o in (opt_a, opt_b):
        o.zero_grad(set_to_none=True)
    order, final = [], []
    real_mark, real_final = ov._mark, ov._grad_final
    ov._mark = lambda b, where: (order.append(b), real_mark(b, where))
    ov._grad_final = lambda c, t: (final.append(t), real_final(c, t))
    (first_layer_first(A, 1e-3) if rank == 1 else loss(A, x, 1e-3)).backward()
    ov._mark, ov._grad_final = real_mark, real_final
    out["order"], out["final_order"] = order, final
    for p, q in zip(A, B):  # the serial optimizer: the same gradients
        q.grad = dev(tuple(p.shape), p.grad)
    opt_a.step()
    opt_b.step()
    out["other_order_same"] = compare()[0]
    out["params"] = [p.detach().float().tolist() for p in A]

    for o in (opt_a, opt_b, opt_c):
        o.close()
    fake.fake_cuda_drain_all()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
    of.finish_rank(out, outdir, rank)


if __name__ == "__main__":
    a = sys.argv
    _rank(int(a[1]), int(a[2]), a[3], a[4], a[5], a[6])

"""Params back early at 2 gloo ranks (``zopt.Optimizer(..., overlap=True,
model=model, process_group=pg)``; docs/USAGE.md section 5, docs/GPU.md
"Params back early").

Each rank is a process with the stand-in CUDA driver (libzopt-fake-cuda.so)
and three optimizers over the same small bf16 model (a ZeRO-2 offloaded
step; ZeRO-0/1 and 3 ranks: offload-tail.test): per-bucket mode with the
model's hooks (A), the serial offloaded step (B, the default mode) and the
all-CPU twin (C). Each step
every rank runs a backward on its own batch; A's step returns while its
tail (per bucket in forward order: commit or recompute, the bucket's
ALL_GATHER of the params across the ranks, its copy back) is held (every
copy back of A's params stalled in its call, released by a timer), the
model's state_dict() right after it waits for the tail, and the next
forward (the hooks' per-bucket waits) gives the serial step's and the
twin's loss; params and states equal B's and C's bit for bit (clipping
inactive and active). The processes have a hard timeout and are killed on
failure.
"""
import ctypes
import datetime
import json
import os
import sys
import threading

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
import overlap_fakes as of  # noqa: E402
from gpu_fakes import FAKE, needs_fake  # noqa: E402

KW = dict(param="bf16", grad="bf16", master="f32", clip=1.0, comments=False)


@needs_fake
@pytest.mark.parametrize("zero_stage", [2])
def test_early_params_two_gloo_ranks_bit_identical(steps, tmp_path, zero_stage):
    from test_comm import _free_port, _run_all, _runtime_env
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", zero_stage=zero_stage, **KW))
    cpu = steps.text(S.adamw.text(zero_stage=zero_stage, **KW))
    env = dict(_runtime_env(), ZOPT_CUDA_DRIVER=FAKE, ZOPT_FAKE_CUDA_ASYNC="1")
    port = _free_port()
    cmds = [[sys.executable, os.path.abspath(__file__), str(r), "2", str(port), str(tmp_path),
             off.path, cpu.path] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=90, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    for r in range(2):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            out = json.load(fh)
        assert out["mode"] == 1, out  # per bucket at 2 ranks
        assert out["returned_early"] == [True] * 3, (r, out)
        assert out["model_joined"] == [True] * 3, (r, out)
        assert out["losses_same"] == [True] * 3, (r, out)
        assert out["same"] == [True] * 3, (r, out)
        assert [st["outcome"] for st in out["stats"]] == ["commit", "recompute", "commit"], (r, out)
        assert out["bad_ranges"] == 0


# ---- one rank (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _rank(rank, world, port, outdir, off_path, cpu_path):
    import torch.distributed as dist
    from test_early_params import Net
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    s, fake, dev, g, init = of.start(device_steps_only=True)
    A = [dev(sh, w) for sh, w in zip(of.SHAPES, init)]   # per bucket (model=)
    B = [dev(sh, w) for sh, w in zip(of.SHAPES, init)]   # serial offloaded
    C = [w.clone() for w in init]                        # the CPU twin
    nets = [Net(X) for X in (A, B, C)]
    params = [list(n.parameters()) for n in nets]
    keep = []
    of.grads_to_device(params[0] + params[1], dev, keep)
    pg = dist.group.WORLD
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024, process_group=pg)
    off, cpu = zopt.Step(off_path), zopt.Step(cpu_path)
    opt_a = zopt.Optimizer(off, params[0], overlap=True, model=nets[0], **kw)
    opt_b = zopt.Optimizer(off, params[1], **kw)
    opt_c = zopt.Optimizer(cpu, params[2], **kw)
    assert opt_a.world_size == world and opt_a.rank == rank
    mode = ctypes.c_int()
    assert opt_a._lib.zopt_optimizer_get_param_wait(opt_a._parts[0].h, ctypes.byref(mode)) == 0
    lo = min(p.data_ptr() for p in params[0])
    hi = max(p.data_ptr() + p.numel() * p.element_size() for p in params[0])
    fake.fake_cuda_stall_htod.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    out = {"mode": mode.value, "returned_early": [], "model_joined": [], "losses_same": [],
           "same": [], "stats": []}
    for it in range(3):
        x = torch.randn(8, 32, generator=g) + rank  # each rank its own batch
        scale = 50.0 if it == 1 else 1e-3  # step 2 clips
        for k, o in enumerate((opt_a, opt_b, opt_c)):
            o.zero_grad(set_to_none=True)
            (nets[k](x).square().mean() * scale).backward()
        fake.fake_cuda_stall_htod(lo, hi)  # the tail's first copy back waits in its call
        released = threading.Event()

        def release():
            released.set()
            fake.fake_cuda_release_htod()
        timer = threading.Timer(0.3, release)
        timer.start()
        opt_a.step()
        out["returned_early"].append(not released.is_set())
        nets[0].state_dict()  # the model's: its state-dict hook joins the tail
        out["model_joined"].append(released.is_set())
        timer.join()
        out["stats"].append(opt_a.pipeline_stats())
        opt_b.step()
        opt_c.step()
        la = nets[0](x).square().mean()  # A: the hooks wait per bucket
        fake.fake_cuda_drain_all()
        lb, lc = nets[1](x).square().mean(), nets[2](x).square().mean()
        out["losses_same"].append(bool(torch.equal(la, lb) and torch.equal(la, lc)))
        sta, stb, stc = (o.state_dict()["state"] for o in (opt_a, opt_b, opt_c))
        fake.fake_cuda_drain_all()
        same = all(of.equal(p, q) and of.equal(p, r) for p, q, r in zip(*params))
        same = same and sorted(sta) == sorted(stb) == sorted(stc) and all(
            torch.equal(sta[i][key], stb[i][key]) and torch.equal(sta[i][key], stc[i][key])
            for i in sta for key in sta[i])
        out["same"].append(bool(same))
    for o in (opt_a, opt_b, opt_c):
        o.close()
    fake.fake_cuda_drain_all()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
    of.finish_rank(out, outdir, rank)


if __name__ == "__main__":
    a = sys.argv
    _rank(int(a[1]), int(a[2]), a[3], a[4], a[5], a[6])

"""Optimizer.step_stats() (zopt/_stats.py; the C zopt_step_stats): an
offloaded step on the stand-in driver reports its copies of the grads to the
host, its CPU update and its copies of the params back, each measured, the
bytes each moved, and a total no smaller than their sum; an all-CPU step
reports no copies. The offloaded step runs in a worker process with
ZOPT_CUDA_DRIVER pointing at the stand-in (gpu_fakes.run_worker)."""
import json
import sys

import numpy as np
import torch

import zopt
from gpu_fakes import StandIn, needs_fake, run_worker

SIZES = [33, 1000, 5000]


def _check_parts(s):
    parts = s["d2h_seconds"] + s["update_seconds"] + s["h2d_seconds"]
    assert all(s[k] >= 0 for k in ("d2h_seconds", "update_seconds", "h2d_seconds"))
    assert s["update_seconds"] > 0 and s["total_seconds"] >= parts


def test_cpu_step_reports_no_copies(steps):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=1e-2)
    for k in (1, 2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        s = opt.step_stats()
        _check_parts(s)
        assert s["steps"] == k and s["offloaded"] is False
        assert (s["d2h_seconds"], s["h2d_seconds"], s["d2h_bytes"], s["h2d_bytes"]) == (0, 0, 0, 0)
    opt.close()


@needs_fake
def test_offloaded_step_on_stand_in(steps, tmp_path):
    st = steps(rule="adamw", layout="f32", placement="offload")
    out = run_worker(__file__, "offload", st.path, tmp_path)
    n = sum(SIZES)
    assert [s["steps"] for s in out["stats"]] == [1, 2, 3]
    for s in out["stats"]:
        _check_parts(s)
        assert s["offloaded"] is True
        assert s["d2h_seconds"] > 0 and s["h2d_seconds"] > 0
        # f32 grads and params to the host (without a master the update
        # reads the param), f32 params back
        assert (s["d2h_bytes"], s["h2d_bytes"]) == (8 * n, 4 * n)


def _worker(what, step_path, tmp):
    s = StandIn()
    rng = np.random.default_rng(0)
    out = {"stats": []}
    if what == "offload":
        dp = [(s.dev_array(n, rng.standard_normal(n).astype(np.float32)), s.dev_array(n))
              for n in SIZES]
        opt = zopt.Optimizer(zopt.Step(step_path), dp, lr=1e-2)
        for _ in range(3):
            for _, g in dp:
                g[:] = rng.standard_normal(g.size).astype(np.float32) * 0.1
            opt.step()
            out["stats"].append(opt.step_stats())
        opt.close()
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

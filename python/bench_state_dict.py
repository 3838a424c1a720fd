#!/usr/bin/env python3
"""The cost of moving an optimizer's state from Python: ``state_dict()``,
``load_state_dict()`` and ``add_param_group`` on a model of many
parameters (default ~50M bf16 params in 48 tensors with an f32 master:
examples/adamw_bf16_master.mlir, 12 bytes of state per param).

    PYTHONPATH=python /usr/bin/python3 python/bench_state_dict.py [--params N] [--tensors N]

Medians of --reps calls, in seconds; each add_param_group adds one more
group of one tensor of --add elements to the same optimizer. Uses the
public API only, so it times any version of the binding.
"""
import argparse
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import zopt  # noqa: E402

REPO = os.path.dirname(HERE)


def timed(fn, reps, setup=None):
    ts = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--add", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--step", default="adamw_bf16_master")
    a = ap.parse_args()
    step = zopt.Step(zopt.compile(os.path.join(REPO, "examples", a.step + ".mlir")))
    dt = torch.bfloat16 if "bf16" in a.step else torch.float32
    numel = int(a.params) // a.tensors
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(numel).to(dt)) for _ in range(a.tensors)]
    opt = zopt.Optimizer(step, ps, lr=1e-4, weight_decay=0.01)
    for p in ps:
        p.grad = (torch.randn(numel) * 1e-3).to(dt)
    opt.step()  # every state made
    sd = opt.state_dict()
    t_sd = timed(opt.state_dict, a.reps)
    t_load = timed(lambda: opt.load_state_dict(sd), a.reps)
    extra = []

    def add():
        x = torch.nn.Parameter(torch.randn(a.add).to(dt))
        extra.append(x)
        opt.add_param_group({"params": [x], "lr": 2e-4})
    t_add = timed(add, a.reps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.step}: {a.tensors} tensors x {numel} elements ({a.tensors * numel / 1e6:.1f}M "
          f"params), torch {torch.__version__}, {os.cpu_count()} CPUs, median of {a.reps}: "
          f"state_dict() {t_sd:.3f} s, load_state_dict() {t_load:.3f} s, "
          f"add_param_group({a.add} elements) {t_add:.3f} s; peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()

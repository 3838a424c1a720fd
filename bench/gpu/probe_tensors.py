"""Where a GPU step over many tensors spends its time (issue 20 follow-up).

gpu_bench.py's work list measured step() over 10,000 tensors at ~200x one
tensor of the same total. This probe runs the same case and prints (1) a
cProfile of step() (host side: the binding and the runtime call), (2) the
kernels and driver/runtime calls torch.profiler sees per step, and (3) the
time of the bare C step (opt's native handle) when the binding exposes it.
Usage: python3 probe_tensors.py STEP.gpu.so [PARTS ...]
"""
import cProfile
import io
import pstats
import sys
import time

import torch
import zopt

so = sys.argv[1]
parts_list = [int(x) for x in sys.argv[2:]] or [1, 10000]
n = 1 << 26
for parts in parts_list:
    sizes = [n // parts] * (parts - 1) + [n - (n // parts) * (parts - 1)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = zopt.Optimizer(zopt.Step(so), ps, lr=1e-4, weight_decay=0.01)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        opt.step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"== parts {parts}: host time per step() {(t1 - t0) / 5 * 1e3:.3f} ms, "
          f"with sync {(t2 - t0) / 5 * 1e3:.3f} ms", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000], flush=True)
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                opt.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="count", row_limit=25), flush=True)
    except Exception as e:  # noqa: BLE001
        print("profiler:", e)
    opt.close()
    del opt, ps
    torch.cuda.empty_cache()

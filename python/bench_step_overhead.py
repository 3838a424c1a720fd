#!/usr/bin/env python3
"""The Python overhead of zopt.Optimizer.step(): the whole step() against
the runtime's zopt_optimizer_step alone, on the same optimizer, for many
small tensors (default 10,000 tensors of 1,000 elements: the case where
per-tensor Python work shows).

    PYTHONPATH=python /usr/bin/python3 python/bench_step_overhead.py [--tensors N] [--numel N]

Rows: an f32 AdamW step, a bf16-param step with an f32 master (which
also checks every param for user writes: version counters and sampled
elements), and a mixed optimizer over both (half the tensors bf16 with an
f32 master, half f32, both clipped at 1.0: two classes stepped by
zopt_optimizer_step_linked; its "C step" is the linked step). Columns: the runtime's step alone (zopt_optimizer_step through
ctypes); then what step() adds to the runtime's step inside it (measured
per call as step() minus its C step, so that the C step's own variance on a
busy machine does not count): right after a real backward through every
param (the training loop: gradients accumulated in place into the
registered memory), back to back (the previous C step has just evicted the
params' metadata from the caches: the pessimistic case), and with fresh
gradient tensors (zero_grad(set_to_none=True) and a new .grad per param,
each copied into the registered memory); and zero_grad(). Medians.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import zopt  # noqa: E402

REPO = os.path.dirname(HERE)


def median_time(fn, iters, setup=None):
    ts = []
    for _ in range(iters):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def step_overhead(opt, iters, setup=None):
    """Median of (whole step() - the runtime's step inside it), per call:
    what the binding adds, robust to the runtime step's own variance on a
    busy machine."""
    ts = []
    for _ in range(iters):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0 - opt.last_metrics["step_time_s"])
    return statistics.median(ts)


def run(step, dtype, n_tensors, numel, iters, threads):
    torch.manual_seed(0)
    dts = dtype if isinstance(dtype, list) else [dtype]
    ps = [torch.nn.Parameter(torch.randn(numel).to(dts[i % len(dts)]))
          for i in range(n_tensors)]
    grads = [torch.randn(numel).to(p.dtype) * 1e-3 for p in ps]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt = zopt.Optimizer(step, ps, lr=1e-4, weight_decay=0.01, num_threads=threads)
    opt.step()  # grads copied in and attached once
    if isinstance(step, dict):  # the linked step over the classes
        h, n, res = opt._harr, len(opt._parts), opt._res_ref
        fn = opt._lib.zopt_optimizer_step_linked

        def c_step():
            fn(h, n, res)
    else:
        c = opt._parts[0]  # the one class's native optimizer
        h, fn1, res = c.h, c.step_fn, c.res_ref

        def c_step():
            fn1(h, res)
    r = {}
    r["c"] = median_time(c_step, iters)
    opt.refresh_master()  # the direct calls above wrote params behind its back
    r["b2b"] = step_overhead(opt, iters)

    def backward():  # a real backward through every param (grads accumulate in place)
        opt.zero_grad()
        torch.stack([p.sum() for p in ps]).sum().backward()
    r["bwd"] = step_overhead(opt, max(5, iters // 2), setup=backward)
    r["zero"] = median_time(opt.zero_grad, iters)

    def fresh():
        opt.zero_grad(set_to_none=True)
        for p, g in zip(ps, grads):
            p.grad = g
    r["fresh"] = step_overhead(opt, iters, setup=fresh)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--numel", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-mixed", action="store_true", help="leave out the mixed row")
    a = ap.parse_args()
    cases = [("adamw_f32", torch.float32), ("adamw_bf16_master", torch.bfloat16)]
    print(f"{a.tensors} tensors x {a.numel} elements, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, median of {a.iters}")
    print(f"{'step':<18} {'C step':>8} {'+ after backward':>17} {'+ back-to-back':>15} "
          f"{'+ fresh grads':>14} {'zero_grad()':>12}   (ms; + = what step() adds to the C step)")
    for name, dtype in cases:
        step = zopt.Step(zopt.compile(os.path.join(REPO, "examples", name + ".mlir")))
        r = run(step, dtype, a.tensors, a.numel, a.iters, a.threads)
        print(f"{name:<18} {r['c'] * 1e3:>8.2f} {r['bwd'] * 1e3:>17.2f} {r['b2b'] * 1e3:>15.2f} "
              f"{r['fresh'] * 1e3:>14.2f} {r['zero'] * 1e3:>12.2f}")
    if not a.no_mixed:
        name = "mixed bf16+f32"
        # both classes clipped at 1.0, as adamw_bf16_master is (one global norm)
        step = dict(zopt.steps.adamw(clip=1.0, classes={"bf16": dict(master="f32"),
                                                        "f32": {}}))
        r = run(step, [torch.bfloat16, torch.float32], a.tensors, a.numel, a.iters, a.threads)
        print(f"{name:<18} {r['c'] * 1e3:>8.2f} {r['bwd'] * 1e3:>17.2f} {r['b2b'] * 1e3:>15.2f} "
              f"{r['fresh'] * 1e3:>14.2f} {r['zero'] * 1e3:>12.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""zopt.Optimizer.step() against the runtime's step alone, for many small
tensors (default 10,000 tensors of 1,000 elements) and for one tensor of
the same total, on both implementations of the binding's per-step pass
over the params (the extension zopt._fast, "ext", and Python, "py").

    PYTHONPATH=python /usr/bin/python3 python/bench_step_overhead.py \\
        [--tensors N] [--numel N] [--iters N] [--steps adamw_f32,...] [--cpu]

For each step (an f32 AdamW step, a bf16-param step with an f32 master,
which also checks every param for user writes) and each pass, in one run,
alternating ext and py iteration by iteration (a busy machine drifts):

* ``C``: zopt_optimizer_step alone (through ctypes) on the optimizer of
  the 10,000 tensors;
* step() with ``fresh`` gradient tensors every step (new tensors, as
  zero_grad(set_to_none=True) and a backward make: torch 2's default),
  and with gradients ``accum``ulated in place into the same tensors (as
  zero_grad(set_to_none=False) and a backward);
* ``views``: 10,000 params that are views of one flat buffer, with
  gradients that are views of another (DeepSpeed's and FSDP's layout),
  written in place each step: the C step of that optimizer and step();
* ``1 tensor``: one param of the same total size, fresh gradients: the C
  step and step().

The ratios (``x C``): step() over the C step it ran (the same call:
issue 17's measure, at most 1.1 with fresh gradients), and (``/1
tensor``) step() of the 10,000 tensors (fresh) and of the 10,000 views
over step() of one tensor in the same iteration (at most 1.1 each):
medians of per-call ratios, robust to a busy machine's drift. Times:
medians in ms.

``--cpu``: the runtime on one thread (zopt_optimizer_set_num_threads 1:
the step runs on the caller's thread) and every time the thread's CPU
time (time.thread_time), so that what the host's other jobs take (a
shared machine's descheduling) is not counted; ``x C`` is then step()
over the median C step of the same optimizer (issue 17's measure: the C
step alone, not step()'s own call, which also rebinds moved gradients). Setting up the gradients is not timed; torch runs its own
ops on one thread (its idle OpenMP threads would spin against the
runtime's). Copied next to an older binding's package (one without
zopt._scan), it measures that binding as "old", for comparisons.
"""
import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import zopt  # noqa: E402

try:
    from zopt import _ext, _hypers, _scan  # noqa: E402
except ImportError:  # a binding before zopt._scan (run this script on it to compare)
    _ext = None

REPO = os.path.dirname(HERE)


def py_same(a, b):
    return len(a) == len(b) and all(map(lambda u, v: u is v, a, b))


class Path:
    """Builds optimizers on one implementation of the per-step pass."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if _ext is None:
            return self
        self.saved = _ext.scan_class, _hypers.same
        if self.name == "py":
            _ext.scan_class = lambda params: _scan.Scan
            _hypers.same = py_same
        return self

    def __exit__(self, *exc):
        if _ext is not None:
            _ext.scan_class, _hypers.same = self.saved


CLOCK = time.perf_counter  # --cpu: time.thread_time
THREADS = None  # --cpu: 1


class Case:
    """One optimizer and its gradients: ``layout`` "tensors" (each param and
    gradient its own tensor), "views" (views of one flat param buffer and
    one flat gradient buffer) or "one" (one tensor of the same total)."""

    def __init__(self, step, dtype, layout, n, numel, path):
        g = torch.Generator().manual_seed(0)
        total = n * numel
        self.dtype = dtype
        if layout == "one":
            self.ps = [torch.nn.Parameter(torch.randn(total, generator=g).to(dtype))]
        elif layout == "views":
            self.flat = torch.randn(total, generator=g).to(dtype)
            self.ps = [torch.nn.Parameter(self.flat[i * numel:(i + 1) * numel])
                       for i in range(n)]
        else:
            self.ps = [torch.nn.Parameter(torch.randn(numel, generator=g).to(dtype))
                       for _ in range(n)]
        if layout == "views":
            self.gflat = (torch.randn(total, generator=g) * 1e-3).to(dtype)
            self.pool = [self.gflat[i * numel:(i + 1) * numel] for i in range(n)]
        else:
            self.pool = [(torch.randn(p.shape, generator=g) * 1e-3).to(dtype) for p in self.ps]
        for p, q in zip(self.ps, self.pool):
            p.grad = q
        with Path(path):
            self.opt = zopt.Optimizer(step, self.ps, lr=1e-4, weight_decay=0.01,
                                      num_threads=THREADS)
        self.opt.step()
        c = self.opt._parts[0]
        self.c_args = (c.step_fn, c.h, c.res_ref)
        self.next = None

    def c_step(self):
        fn, h, res = self.c_args
        t0 = CLOCK()
        fn(h, res)
        return CLOCK() - t0

    def prepare(self, how):
        """The gradients of the next step() (not timed)."""
        if how == "fresh":
            self.opt.zero_grad(set_to_none=True)
            for p, q in zip(self.ps, self.pool):
                p.grad = q.clone()
        else:  # accumulated in place (a backward into the same tensors)
            torch._foreach_add_(self.pool, 1e-6) if len(self.pool) > 1 else self.pool[0].add_(1e-6)

    def step(self):
        t0 = CLOCK()
        self.opt.step()
        return CLOCK() - t0


def run(name, dtype, a, paths):
    """{(path, what): median ms or ratio} for one step: every optimizer
    built first, then their iterations interleaved."""
    step = zopt.Step(zopt.compile(os.path.join(REPO, "examples", name + ".mlir")))
    cases = {(p, lay): Case(step, dtype, lay, a.tensors, a.numel, p)
             for lay in ("tensors", "views", "one") for p in paths}
    C = {k: [] for k in cases}
    for _ in range(a.iters):
        for k, c in cases.items():
            C[k].append(c.c_step())
    for c in cases.values():
        c.opt.refresh_master()  # the direct C steps wrote the params behind its back
    runs = [("tensors", "fresh"), ("tensors", "accum"), ("views", "accum"), ("one", "fresh")]
    S = {(p, lay, m): [] for p in paths for lay, m in runs}  # (step(), its own C step)
    for _ in range(a.iters):
        for lay, m in runs:
            for p in paths:
                c = cases[(p, lay)]
                c.prepare(m)
                t = c.step()
                S[(p, lay, m)].append((t, c.opt.last_metrics["step_time_s"]))
    med = statistics.median
    if a.cpu:  # over the C step alone (step_time_s is wall time)
        for p in paths:
            for lay, m in runs:
                c0 = med(C[(p, lay)])
                S[(p, lay, m)] = [(t, c0) for t, _ in S[(p, lay, m)]]
    out = {}
    for p in paths:
        for lay in ("tensors", "views", "one"):
            out[(p, lay, "C")] = med(C[(p, lay)])
        for lay, m in runs:
            out[(p, lay, m)] = med(t for t, _ in S[(p, lay, m)])
            out[(p, lay, m, "x")] = med(t / ci for t, ci in S[(p, lay, m)])
        one = [t for t, _ in S[(p, "one", "fresh")]]
        for lay, m in (("tensors", "fresh"), ("views", "accum")):
            out[(p, lay, m, "/1")] = med(t / o for (t, _), o in zip(S[(p, lay, m)], one))
    del cases
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--numel", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--steps", default="adamw_f32,adamw_bf16_master")
    ap.add_argument("--cpu", action="store_true",
                    help="one runtime thread, the thread's CPU time (see the docstring)")
    a = ap.parse_args()
    global CLOCK, THREADS
    if a.cpu:
        CLOCK, THREADS = time.thread_time, 1
    paths = ["old"] if _ext is None else ["ext", "py"] if _ext.fast is not None else ["py"]
    torch.set_num_threads(1)  # torch's own ops (the untimed gradient set-up) spin no threads
    print(f"{a.tensors} tensors x {a.numel} elements, and 1 tensor of {a.tensors * a.numel}; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, median of {a.iters} (ms"
          f"{', thread CPU time, 1 runtime thread' if a.cpu else ''}); load average "
          f"{os.getloadavg()[0]:.1f}")
    if _ext is not None and _ext.fast is None:
        print(f"(no extension: {_ext.why})")
    print(f"{'':<24}{'-- ' + format(a.tensors, ',') + ' tensors ':-<34}  {'-- views ':-<20}  "
          f"{'-- 1 tensor ':-<14}  {'-- /1 tensor ':-<14}")
    print(f"{'step':<18} {'pass':<4} {'C':>6} {'fresh':>7} {'x C':>5} {'accum':>7} {'x C':>5}  "
          f"{'C':>6} {'step()':>7} {'x C':>5}  {'C':>6} {'step()':>7}  {'fresh':>6} {'views':>6}")
    dts = {"adamw_f32": torch.float32, "adamw_bf16_master": torch.bfloat16}
    for name in a.steps.split(","):
        r = run(name, dts[name], a, paths)
        for p in paths:
            def ms(*k):
                return f"{r[(p,) + k] * 1e3:>{7 if k[-1] != 'C' else 6}.2f}"

            def x(*k):
                return f"{r[(p,) + k]:>5.2f}"
            print(f"{name:<18} {p:<4} {ms('tensors', 'C')} {ms('tensors', 'fresh')} "
                  f"{x('tensors', 'fresh', 'x')} {ms('tensors', 'accum')} "
                  f"{x('tensors', 'accum', 'x')}  {ms('views', 'C')} {ms('views', 'accum')} "
                  f"{x('views', 'accum', 'x')}  {ms('one', 'C')} {ms('one', 'fresh')}  "
                  f" {x('tensors', 'fresh', '/1')}  {x('views', 'accum', '/1')}")


if __name__ == "__main__":
    main()

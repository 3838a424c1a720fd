"""zopt's ZeRO-2 AdamW step against torch's ZeroRedundancyOptimizer, both over
the same torch.distributed gloo process group, at W CPU ranks.

    /usr/bin/python3 bench/zero_torch_bench.py --world 2 --params 67108864

Every rank holds the same fp32 model (T tensors, N params in all) and its own
gradients. torch's step, as a DDP user runs it: the gradients averaged with
gloo all_reduce in 25 MB buckets (what DDP does during backward), then
`ZeroRedundancyOptimizer(params, torch.optim.AdamW).step()` (each rank
updates the params it owns, whole tensors, and broadcasts them). zopt's step:
one `zopt_optimizer_step` of an AdamW ZeRO-2 step.so over a TorchComm on the
same process group (reduce-scatter by all-to-all + a rank-order f32 sum,
the update of this rank's shards, the all-gather of params). Both steps
average the gradients and leave every rank with the updated params; the
script checks that zopt's and torch's params agree (to fp32 rounding: the
all-reduce adds in another order) after the timed steps. Reported per W: the
median step time of each, the ratio, and the optimizer-state bytes per param
each rank holds.
"""
import argparse
import ctypes
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

STEP = """// AdamW, fp32, ZeRO-2, no clipping (torch's ZeroRedundancyOptimizer
// does not clip by itself).
zopt.step @adamw_f32_z2 attributes {zero_stage = 2 : i64, align = 16 : i64} {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %wd = zopt.hyper weight_decay
  %p1, %m1, %v1 = zopt.adam %p, %g, %m, %v, %lr, %b1, %b2, %eps, %wd {decoupled} : f32, f32, f32, f32
  zopt.yield %p1, %m1, %v1 into %p, %m, %v : f32, f32, f32 into f32, f32, f32
}
"""


def worker(rank, world, port, args, so_path, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import zopt
    from zopt import _lib
    from zopt.comm import TorchComm

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = [args.params // args.tensors + (1 if t < args.params % args.tensors else 0)
             for t in range(args.tensors)]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(n, generator=gen) * 0.05 for n in sizes]
    gen_r = torch.Generator().manual_seed(100 + rank)
    grads = [torch.randn(n, generator=gen_r) * 1e-3 for n in sizes]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    # ---- torch: DDP-style bucketed all_reduce + ZeroRedundancyOptimizer ----
    tparams = [torch.nn.Parameter(x.clone()) for x in init]
    zro = ZeroRedundancyOptimizer(tparams, optimizer_class=torch.optim.AdamW, **hyper)
    bucket = 25 * 1024 * 1024 // 4  # DDP's default 25 MB buckets
    flat = torch.empty(max(sizes) + bucket, dtype=torch.float32)

    def torch_step():
        for p, g in zip(tparams, grads):
            p.grad = g.clone()
        # Reverse order, buckets of 25 MB, averaged (DDP's allreduce).
        pending, filled = [], 0
        def flush():
            nonlocal pending, filled
            if not pending:
                return
            view = flat[:filled]
            off = 0
            for p in pending:
                view[off:off + p.numel()].copy_(p.grad.view(-1))
                off += p.numel()
            dist.all_reduce(view)
            view.div_(world)
            off = 0
            for p in pending:
                p.grad.view(-1).copy_(view[off:off + p.numel()])
                off += p.numel()
            pending, filled = [], 0
        for p in reversed(tparams):
            if filled + p.numel() > bucket:
                flush()
            pending.append(p)
            filled += p.numel()
        flush()
        zro.step()

    # ---- zopt: ZeRO-2 over a TorchComm on the same process group ----------
    L = _lib.lib()
    step = ctypes.c_void_p()
    _lib.check(L.zopt_step_load(so_path.encode(), ctypes.byref(step)), "step_load")
    opt = ctypes.c_void_p()
    _lib.check(L.zopt_optimizer_create(step, ctypes.byref(opt)), "create")
    _lib.check(L.zopt_optimizer_set_num_threads(opt, 1), "threads")
    gid = ctypes.c_int()
    _lib.check(L.zopt_optimizer_add_group(opt, ctypes.byref(gid)), "group")
    for name, v in (("lr", 1e-3), ("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8), ("weight_decay", 0.01)):
        _lib.check(L.zopt_optimizer_set_hyper(opt, gid.value, name.encode(), v), name)
    zparams = [x.clone() for x in init]
    zgrads = [torch.empty(n) for n in sizes]
    tid = ctypes.c_int()
    for p, g in zip(zparams, zgrads):
        _lib.check(L.zopt_optimizer_add_tensor(opt, gid.value, ctypes.c_void_p(p.data_ptr()),
                                               ctypes.c_void_p(g.data_ptr()), p.numel(), 1,
                                               ctypes.byref(tid)), "add_tensor")
    comm = TorchComm()
    comm.set_checks(False)  # a trusted job (checks: one more small collective each)
    _lib.check(L.zopt_optimizer_set_comm(opt, comm._h), "set_comm")
    _lib.check(L.zopt_optimizer_finalize(opt), "finalize")
    res = _lib.StepResult()

    def zopt_step():
        for g, src in zip(zgrads, grads):
            g.copy_(src)
        _lib.check(L.zopt_optimizer_step(opt, ctypes.byref(res)), "step")

    times = {"torch": [], "zopt": []}
    for k in range(args.steps + 1):  # the first step of each is a warm-up
        for name, fn in (("torch", torch_step), ("zopt", zopt_step)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if k:
                times[name].append(time.perf_counter() - t0)
    err = max(float((a.detach() - b).abs().max()) for a, b in zip(tparams, zparams))
    scale = max(float(a.detach().abs().max()) for a in tparams)
    mi = _lib.MemoryInfo()
    _lib.check(L.zopt_optimizer_memory_info(opt, ctypes.byref(mi)), "memory_info")
    torch_state = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel()
                      for s in zro.optim.state.values()) * 4
    row = dict(rank=rank, torch_ms=statistics.median(times["torch"]) * 1e3,
               zopt_ms=statistics.median(times["zopt"]) * 1e3,
               zopt_state_bpp=mi.state_bytes / mi.num_params,
               torch_state_bpp=torch_state / args.params, max_diff=err, scale=scale)
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(gathered))
    L.zopt_optimizer_free(opt)
    comm.close()
    L.zopt_step_free(step)
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    import zopt
    tmp = tempfile.mkdtemp(prefix="zopt-zero-bench-")
    so = os.path.join(tmp, "adamw_f32_z2.so")
    zopt.compile(STEP, out_path=so)
    print(f"AdamW fp32, {args.params} params in {args.tensors} tensors, gloo on 127.0.0.1, "
          f"1 thread per rank, median of {args.steps} steps ({os.cpu_count()} cores)")
    print(f"{'W':>3} {'torch ZeRO ms':>14} {'zopt ZeRO-2 ms':>15} {'speedup':>8} "
          f"{'torch state B/p':>16} {'zopt state B/p':>15} {'max |diff|':>11}")
    for w in args.world:
        out = os.path.join(tmp, f"w{w}.txt")
        mp.spawn(worker, args=(w, free_port(), args, so, out), nprocs=w, join=True)
        rows = eval(open(out).read())
        t = statistics.median(r["torch_ms"] for r in rows)
        z = statistics.median(r["zopt_ms"] for r in rows)
        tb = max(r["torch_state_bpp"] for r in rows)
        zb = max(r["zopt_state_bpp"] for r in rows)
        d = max(r["max_diff"] for r in rows)
        print(f"{w:>3} {t:>14.1f} {z:>15.1f} {t / z:>8.2f} {tb:>16.2f} {zb:>15.2f} {d:>11.2e}")


if __name__ == "__main__":
    main()

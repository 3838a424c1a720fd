"""GPU step benchmark (bench/gpu/run_gpu_bench.sh, stage 5; first run on an
H200 on 2026-11-27: docs/benchmarks/gpu.md).

Issue 20's speed list, every ratio measured in the same run, on the same
tensors:
* per layout and size (64Mi and 1Gi params by default; --sizes): zopt's
  whole step and its UPDATE kernel alone (torch.profiler's CUDA activity:
  the ``<step>_update`` kernels), each as GB/s of the roofline bytes/param
  and against a device-to-device copy of the same bytes (goal >= 0.90);
  torch.optim.AdamW(fused=True) on the same params (goal: torch / zopt >=
  1.0) and, for clipped layouts, clip_grad_norm_ + fused AdamW (goal >= 1.25);
* the work list: the same parameter count as 1, 1,000 and 10,000 tensors
  (goal: <= 1.1x one tensor), with torch's fused AdamW on the same tensors
  as the peer.
CUDA events, median of --iters after 3 warm-ups. The markdown (--out) is
rewritten after every row, so a run stopped by its time box (--deadline, a
Unix time) keeps the rows it finished. --check (no GPU needed) only loads
every step and checks the arguments (the rehearsal)."""
import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time

import torch

import zopt

# name -> (param dtype, bytes/param of the step, of UPDATE alone, clip,
#          resident bytes/param of zopt (params, grads, states))
LAYOUTS = {
    "f32": (torch.float32, 28, 28, False, 16),
    "bf16_master_clip": (torch.bfloat16, 30, 28, True, 16),  # + 2: SUMSQ reads g
    "bf16": (torch.bfloat16, 14, 14, False, 8),
    "f32_clip": (torch.float32, 32, 28, True, 16),
    # DeepSpeed's default bf16 layout: f32 gradients (p.main_grad) of bf16
    # params, f32 master/moments, clip: read g (4, SUMSQ) + g, w, m, v (16),
    # write w, m, v, p (14). torch's fused AdamW has no such layout: its
    # columns time the bf16 grads of the bf16 param.
    "bf16_f32grad": (torch.bfloat16, 34, 30, True, 20),
}
F32GRAD = {"bf16_f32grad"}
# issue 20: the 28 B layouts (f32, bf16 + f32 master) and the 14 B one first
ORDER = ["f32", "bf16_master_clip", "bf16", "f32_clip", "bf16_f32grad"]


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def kernel_time(fn, iters, suffix):
    """Mean device time per call of the kernels named *suffix launched by fn
    (torch.profiler sees the kernels zopt launches through the driver API);
    None when the profiler has nothing."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        tot, calls = 0.0, 0
        for e in prof.key_averages():
            if e.key.endswith(suffix):
                us = getattr(e, "device_time_total", None)
                if us is None:
                    us = getattr(e, "cuda_time_total", 0.0)
                tot += us
                calls += e.count
        return tot / 1e6 / iters if calls else None
    except Exception as e:  # noqa: BLE001  (a profiler that fails costs only this column)
        print(f"profiler: {e}", file=sys.stderr)
        return None


def driver_version():
    try:
        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"{v.value // 1000}.{v.value % 1000 // 10} ({v.value})"
    except OSError:
        return "unknown"


def make_params(n, dtype, parts=8):
    sizes = [n // parts] * (parts - 1) + [n - (n // parts) * (parts - 1)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def zopt_opt(so, ps, name):
    opt = zopt.Optimizer(zopt.Step(so), ps, lr=1e-4, weight_decay=0.01)
    if name in F32GRAD:
        # The first step takes each bf16 p.grad into the optimizer's f32
        # p.main_grad (p.grad becomes None); the timed steps read that.
        opt.step()
    return opt


def master_peer(ps, name, clip, iters):
    """The same work in torch for a 16-bit param with an f32 master (what
    Megatron's and DeepSpeed's bf16 optimizers do around a fused AdamW):
    the f32 gradient (bf16_master_clip: cast from the bf16 p.grad; the
    f32-grad layout: already f32), clip_grad_norm_ over the masters when the
    layout clips, AdamW(fused=True) on the f32 masters, the masters copied
    back into the 16-bit params. None where it does not fit in memory."""
    try:
        masters = [torch.nn.Parameter(p.detach().float()) for p in ps]
        f32g = [p.grad.float() for p in ps] if name in F32GRAD else None
        opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

        def step():
            for m, p, i in zip(masters, ps, range(len(ps))):
                m.grad = f32g[i] if f32g is not None else p.grad.float()
            if clip:
                torch.nn.utils.clip_grad_norm_(masters, 1.0)
            opt.step()
            with torch.no_grad():
                for p, m in zip(ps, masters):
                    p.copy_(m)
        t = timed(step, iters)
        del opt, masters, f32g
        return t
    except torch.cuda.OutOfMemoryError:
        return None


def fits(n, name):
    dt, bpp, _, _, res = LAYOUTS[name]
    pg = 2 * torch.finfo(dt).bits // 8
    need = n * max(res, pg + bpp, pg + 2 * torch.finfo(dt).bits // 8) * 1.1
    torch.cuda.empty_cache()
    return need < torch.cuda.mem_get_info()[0]


class Report:
    def __init__(self, path, head):
        self.path, self.head, self.rows, self.seg, self.notes = path, head, [], [], []

    def write(self):
        lines = [self.head, "",
                 "| layout | params | step ms | step GB/s | copy: step / copy (>= 0.90) | "
                 "UPDATE ms | UPDATE GB/s | UPDATE / copy (>= 0.90) | fused AdamW ms | "
                 "fused / zopt (>= 1.0) | clip_grad_norm_ + fused ms | that / zopt (>= 1.25) | "
                 "torch with an f32 master ms | that / zopt |",
                 "|" + "---|" * 14]
        for r in self.rows:
            lines.append("| " + " | ".join(r) + " |")
        if self.seg:
            lines += ["", "| layout | params | tensors | step ms | / one tensor (<= 1.1) | fused AdamW ms | "
                      "fused / zopt |", "|---|---|---|---|---|---|---|"]
            lines += ["| " + " | ".join(r) + " |" for r in self.seg]
        lines += [""] + self.notes
        text = "\n".join(lines) + "\n"
        with open(self.path + ".tmp", "w") as f:
            f.write(text)
        os.replace(self.path + ".tmp", self.path)
        return text


def fmt(x, spec):
    return "n/a" if x is None or x != x else format(x, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True, help="folder of <layout>.gpu.so")
    ap.add_argument("--out", default="gpu_bench.md")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sizes", default="67108864,1073741824",
                    help="parameter counts (each layout: the largest that fits when one does not)")
    ap.add_argument("--layouts", default=",".join(ORDER))
    ap.add_argument("--toolkit", default="", help="file with the toolkit version the steps were built with")
    ap.add_argument("--segment-params", type=float, default=float(1 << 26),
                    help="parameters of the 1 / 1,000 / 10,000-tensor runs")
    ap.add_argument("--deadline", type=float, default=0, help="Unix time: start nothing after it")
    ap.add_argument("--check", action="store_true", help="load the steps and stop (no GPU needed)")
    a = ap.parse_args()
    layouts = [x for x in a.layouts.split(",") if x]
    missing = [x for x in layouts if x not in LAYOUTS or not os.path.exists(os.path.join(a.steps, x + ".gpu.so"))]
    if missing:
        sys.exit(f"gpu_bench.py: no step for layout(s) {missing} in {a.steps}")
    sizes = [int(float(s)) for s in a.sizes.split(",") if s]
    if a.check:
        for x in layouts:
            st = zopt.Step(os.path.join(a.steps, x + ".gpu.so"))
            assert st.gpu, f"{x}: not a GPU step"
        print(f"gpu_bench.py --check: {len(layouts)} GPU steps load; sizes {sizes}; torch {torch.__version__}")
        return
    left = (lambda: a.deadline - time.time()) if a.deadline else (lambda: float("inf"))
    dev = torch.cuda.get_device_name()
    toolkit = open(a.toolkit).read().strip().replace("\n", " ") if a.toolkit and os.path.exists(a.toolkit) else "?"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "?"
    head = (f"{datetime.date.today()}: GPU {dev}, CUDA driver {driver_version()}, steps built by {toolkit}, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}). Median of {a.iters} steps "
            "(CUDA events) after 3 warm-ups; UPDATE from torch.profiler. torch's fused AdamW keeps its states "
            "in the param dtype (no f32 master): for bf16_master_clip it moves fewer bytes than zopt; the "
            "last two columns time the same work in torch (f32 grads, clip, fused AdamW on f32 masters, copy "
            "back to the bf16 params).")
    print(head, flush=True)
    rep = Report(a.out, head)
    rep.write()
    for n0 in sizes:
        for name in layouts:
            if left() < 15:
                rep.notes.append(f"- not run (time box): {name} at {n0} params")
                continue
            dt, bpp, bpp_up, clip, _ = LAYOUTS[name]
            so = os.path.join(a.steps, name + ".gpu.so")
            n = n0
            while n > (1 << 20) and not fits(n, name):
                n //= 2
            if n != n0:
                rep.notes.append(f"- {name}: {n} params instead of {n0} (memory)")
            ps = make_params(n, dt)
            opt = zopt_opt(so, ps, name)
            t_step = timed(opt.step, a.iters)
            t_up = kernel_time(opt.step, 5, "_update")
            opt.gpu_result()
            opt.close()
            del opt
            if name in F32GRAD:
                for p in ps:
                    p.main_grad = None
                    p.grad = torch.randn_like(p) * 1e-3
            torch.cuda.empty_cache()
            # Device-to-device copy of the step's byte volume (read + write).
            src = torch.empty(int(bpp * n / 2), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            t_copy = timed(lambda: dst.copy_(src), a.iters)
            del src, dst
            torch.cuda.empty_cache()
            copy_gbs = bpp * n / t_copy / 1e9
            topt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
            t_torch = timed(topt.step, a.iters)
            t_clip = timed(lambda: (torch.nn.utils.clip_grad_norm_(ps, 1.0), topt.step()), a.iters) \
                if clip else None
            del topt
            torch.cuda.empty_cache()
            t_master = master_peer(ps, name, clip, a.iters) if dt != torch.float32 and name != "bf16" else None
            del ps
            torch.cuda.empty_cache()
            gbs = bpp * n / t_step / 1e9
            up_gbs = bpp_up * n / t_up / 1e9 if t_up else None
            rep.rows.append([name, f"{n:.3g}", fmt(t_step * 1e3, ".3f"), fmt(gbs, ".0f"), fmt(gbs / copy_gbs, ".2f"),
                             fmt(t_up * 1e3 if t_up else None, ".3f"), fmt(up_gbs, ".0f"),
                             fmt(up_gbs / copy_gbs if up_gbs else None, ".2f"),
                             fmt(t_torch * 1e3, ".3f"), fmt(t_torch / t_step, ".2f"),
                             fmt(t_clip * 1e3 if t_clip else None, ".3f"),
                             fmt(t_clip / t_step if t_clip else None, ".2f"),
                             fmt(t_master * 1e3 if t_master else None, ".3f"),
                             fmt(t_master / t_step if t_master else None, ".2f")])
            rep.write()
            print("| " + " | ".join(rep.rows[-1]) + " |", flush=True)
    # The work list: the same parameters as 1, 1,000 and 10,000 tensors.
    for name in ("f32", "bf16"):
        if name not in layouts:
            continue
        dt = LAYOUTS[name][0]
        n = int(a.segment_params)
        base = None
        for parts in (1, 1000, 10000):
            if left() < 10:
                rep.notes.append(f"- not run (time box): {name} as {parts} tensors")
                continue
            torch.cuda.empty_cache()
            ps = make_params(n, dt, parts)
            opt = zopt_opt(os.path.join(a.steps, name + ".gpu.so"), ps, name)
            t = timed(opt.step, a.iters)
            opt.gpu_result()
            opt.close()
            del opt
            # The peer on the same tensors: torch's fused AdamW (its own
            # per-tensor host work included, as zopt's is).
            topt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
            t_torch = timed(topt.step, a.iters)
            del topt, ps
            base = base or t
            rep.seg.append([name, f"{n:.3g}", str(parts), fmt(t * 1e3, ".3f"), fmt(t / base, ".2f"),
                            fmt(t_torch * 1e3, ".3f"), fmt(t_torch / t, ".2f")])
            rep.write()
    print(rep.write())


if __name__ == "__main__":
    main()

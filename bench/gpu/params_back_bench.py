"""Params back early on a GPU (docs/GPU.md "Params back early"; issue 18).

  params_back_bench.py --step STEP.so [--layers 16] [--width 4096] [--steps 6]

STEP.so is an offloaded step (bf16 params and grads on the GPU, the update on
the CPU; the carry's ``steps/zero_offload.so``). The same MLP (``--layers``
bf16 Linear(width, width) + ReLU, one batch of 64 rows) is trained with
``zopt.Optimizer(..., overlap=True)`` twice from the same start on the same
data: with ``model=net`` (per-bucket waits from the forward pre-hooks) and
with ``early_params=False`` (the optimizer's stream waits for every copy).
Per step: an event right after ``step()`` returns (on an idle side
stream: the time of the return, not behind the current stream's waits),
on torch's current stream one in a pre-hook of the first layer registered
after zopt's (the first forward kernel can start there: after the waits)
and one after the forward. Printed per mode, the median over the steps after the first: the
time from ``step()``'s return to the first forward kernel's start, to the
end of the forward, and ``step()``'s host time; then whether both runs end
with bit-identical params. Without a GPU it prints UNSUPPORTED and exits 0.
"""
import argparse
import statistics
import sys
import time

import torch


def run(step_path, early, layers, width, steps, seed=0):
    import zopt
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(*[m for _ in range(layers) for m in
                                (torch.nn.Linear(width, width), torch.nn.ReLU())])
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * width ** -0.5)
    net = net.to("cuda", torch.bfloat16)
    kw = dict(model=net) if early else dict(early_params=False)
    opt = zopt.Optimizer(zopt.Step(step_path), net.parameters(), lr=1e-4, overlap=True, **kw)
    ev = {}
    side = torch.cuda.Stream()  # idle: its event is the time of the call, not behind any wait

    def mark(name, stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        ev[name] = e
    first = net[0]
    first.register_forward_pre_hook(lambda m, a: mark("first"))  # after zopt's pre-hook
    rows = []
    for k in range(steps):
        x = torch.randn(64, width, generator=g).to("cuda", torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        y = net(x)
        mark("fwd_end")
        if k:
            torch.cuda.synchronize()
            rows.append((ev["ret"].elapsed_time(ev["first"]), ev["ret"].elapsed_time(ev["fwd_end"]),
                         host_ms))
        y.float().square().mean().backward()
        t0 = time.perf_counter()
        opt.step()
        host_ms = (time.perf_counter() - t0) * 1e3
        mark("ret", side)  # step() returned (the default mode's stream waits behind it)
    x = torch.randn(64, width, generator=g).to("cuda", torch.bfloat16)
    net(x)  # the last step's waits
    torch.cuda.synchronize()
    params = [p.detach().clone() for p in net.parameters()]
    opt.close()
    return rows, params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", required=True, help="an offloaded step.so")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("UNSUPPORTED: no CUDA device")
        return 0
    n = a.layers * (a.width * a.width + a.width)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.layers} x Linear({a.width}, {a.width}) bf16: {n / 2**20:.0f}Mi params, "
          f"{a.steps} steps")
    print("| mode | step() return -> first forward kernel (ms) | -> end of forward (ms) "
          "| step() host (ms) |")
    print("|---|---|---|---|")
    out = {}
    for early in (False, True):
        rows, out[early] = run(a.step, early, a.layers, a.width, a.steps)
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        name = "per bucket (model=net)" if early else "all (early_params=False)"
        print(f"| {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.1f} |", flush=True)
    same = all(torch.equal(p, q) for p, q in zip(out[False], out[True]))
    print(f"params bit-identical between the two modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

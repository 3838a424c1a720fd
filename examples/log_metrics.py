#!/usr/bin/env python3
"""Logs a short training run's per-step optimizer metrics to CSV (and plots
them when matplotlib is installed).

    cd <repo> && PYTHONPATH=python /usr/bin/python3 examples/log_metrics.py [--out DIR] [--steps 200]

A bf16 MLP trained with examples/adamw_bf16_master.mlir (f32 master,
global-norm clipping at 1.0) under a OneCycleLR schedule (lr and beta1
cycled). ``opt.register_metrics_hook(CSVLogger(...))`` writes one row per
step: loss, grad norm, skipped, loss scale, lr per group, the runtime's step
time, the binding's overhead, bytes moved and bytes/s. Writes
DIR/metrics.csv (and DIR/metrics.png) and prints a summary.
"""
import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import zopt  # noqa: E402
from zopt.metrics import CSVLogger, read_csv  # noqa: E402


def plot(cols, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    s = cols["step"]
    ax[0][0].plot(s, cols["loss"]); ax[0][0].set_ylabel("loss"); ax[0][0].set_yscale("log")
    ax[0][1].plot(s, cols["grad_norm"]); ax[0][1].set_ylabel("grad norm (before clipping)")
    for k in sorted(c for c in cols if c.startswith("lr")):
        ax[1][0].plot(s, cols[k], label=k)
    ax[1][0].set_ylabel("lr"); ax[1][0].legend()
    ax[1][1].plot(s, [b / 1e9 for b in cols["bytes_per_s"]]); ax[1][1].set_ylabel("update GB/s")
    for a in ax[1]:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="zopt-metrics-")
    os.makedirs(out, exist_ok=True)
    step = zopt.Step(zopt.compile(os.path.join(HERE, "adamw_bf16_master.mlir")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 1)).to(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = zopt.Optimizer(step, [dict(params=decay, weight_decay=0.05),
                                dict(params=no_decay, weight_decay=0.0)], lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=a.steps)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    y = torch.sin(0.3 * x @ torch.randn(16, 1, generator=g))
    csv_path = os.path.join(out, "metrics.csv")
    with CSVLogger(csv_path, flush_every=50) as log:
        opt.register_metrics_hook(log)
        for s in range(a.steps):
            idx = torch.randint(0, 2048, (64,), generator=g)
            xb, yb = x[idx].to(torch.bfloat16), y[idx]

            def closure():
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
                loss.backward()
                return loss
            opt.step(closure)  # the loss goes into the metrics
            sched.step()
    cols = read_csv(csv_path)
    n = len(cols["step"])
    first, last = statistics.mean(cols["loss"][:20]), statistics.mean(cols["loss"][-20:])
    print(f"{n} rows in {csv_path}; columns: {', '.join(cols)}")
    print(f"loss {first:.4f} -> {last:.4f}; lr0 peak {max(cols['lr0']):.4g}; "
          f"median step {statistics.median(cols['step_time_s']) * 1e6:.0f} us + "
          f"{statistics.median(cols['overhead_s']) * 1e6:.0f} us in Python; "
          f"clipped steps (norm > 1): {sum(v > 1.0 for v in cols['grad_norm'])}")
    png = os.path.join(out, "metrics.png")
    print(f"plot: {png}" if plot(cols, png) else "plot: matplotlib is not installed (CSV only)")
    ok = n == a.steps and last < first
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Trains a small MLP twice - once with a zopt AdamW f32 step, once with
torch.optim.AdamW - on the same synthetic regression data and compares the
loss curves. Exits non-zero if they differ by more than TOL (relative).

    cd <repo> && PYTHONPATH=python /usr/bin/python3 examples/train_mlp.py

Needs zopt-compile and libzopt_runtime.so (see python/README.md).
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import zopt  # noqa: E402

STEPS = 200
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
# Both optimizers do the same fp32 math in a different order; the difference
# per step is a few fp32 ULPs, amplified a little by training dynamics.
TOL = 1e-3  # max |loss_zopt - loss_torch| / loss_torch over the run


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(512, 1, generator=g)
    return x, y


def train(make_opt):
    model = make_model()
    opt = make_opt(model.parameters())
    x, y = data()
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:  # cosine schedule, no recompile needed
            group["lr"] = LR * 0.5 * (1 + torch.cos(torch.tensor(step / STEPS * 3.14159)).item())
        idx = torch.arange(step * 64, step * 64 + 64) % x.shape[0]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    t0 = time.perf_counter()
    so = zopt.compile(os.path.join(HERE, "adamw_f32.mlir"))
    step = zopt.Step(so)
    t1 = time.perf_counter()
    lz = train(lambda ps: zopt.Optimizer(step, ps, lr=LR, betas=BETAS, eps=EPS,
                                         weight_decay=WD))
    t2 = time.perf_counter()
    lt = train(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS,
                                            weight_decay=WD, foreach=False))
    t3 = time.perf_counter()
    print(f"{'step':>5} {'zopt AdamW':>14} {'torch AdamW':>14} {'rel diff':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(lz, lt)):
        d = abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, d)
        if i % 20 == 0 or i == STEPS - 1:
            print(f"{i:5d} {a:14.8f} {b:14.8f} {d:10.2e}")
    print(f"max relative loss difference over {STEPS} steps: {worst:.3e} "
          f"(tolerance {TOL:g})")
    print(f"compile {t1 - t0:.2f} s, zopt training {t2 - t1:.2f} s, "
          f"torch training {t3 - t2:.2f} s")
    learned = sum(lz[-20:]) < 0.75 * sum(lz[:20])
    ok = worst <= TOL and learned
    if not ok:
        print("FAIL: loss curves diverge (or training did not learn)")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

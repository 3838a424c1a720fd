#!/usr/bin/env python3
"""Data-parallel training on 2 CPU ranks (torch.multiprocessing.spawn,
gloo) with zopt doing ZeRO: each rank holds only its shard of the optimizer
states; gradients are averaged across the ranks by the runtime (no DDP
wrapper, no all_reduce in the script: zopt reduces them itself, on a gloo
group of its own); clipping uses the global norm over both ranks.

Porting a DDP script: drop the DistributedDataParallel wrapper (a forward
through one over the optimizer's params warns), and replace

    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

by opt.clip_grad_norm_(1.0) between backward and step(): torch's clips each
rank by its own, unreduced gradient (zopt reduces inside step()), zopt's
returns the norm over all ranks (what torch's returns after DDP) and clips
inside the step. timeout= bounds every collective: a dead or stalled peer
fails every rank within it, naming the rank.

    cd <repo> && PYTHONPATH=python /usr/bin/python3 examples/train_ddp_zero.py [--ranks 2] [--steps 30]

Two runs of the same small bf16 model:
  ZeRO-2 (examples/adamw_bf16_zero2.mlir): params whole on every rank,
          states sharded;
  ZeRO-3 (the same description with zero_stage = 3): params sharded too;
          zopt.zero3_hooks gathers each layer's params for its forward and
          backward and frees them after.
Each rank prints its state bytes against one rank holding everything; rank
0 prints the loss. At the end the ranks compare their params (they must be
identical) and rank 0 prints OK.
"""
import argparse
import datetime
import hashlib
import os
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zopt  # noqa: E402


def make_model():
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 1)).to(torch.bfloat16)


def batch(step, rank, world):
    """This rank's slice of the global batch of the step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64 * world, 32, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.1 * x[:, 1:2]
    sl = slice(rank * 64, (rank + 1) * 64)
    return x[sl].to(torch.bfloat16), y[sl].to(torch.bfloat16)


def train(rank, world, so, zero3, steps):
    model = make_model()
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=3e-3, weight_decay=0.01,
                         process_group=dist.group.WORLD, timeout=60)
    hooks = zopt.zero3_hooks(model, opt) if zero3 else None
    info = opt.memory_info()
    name = "ZeRO-3" if zero3 else "ZeRO-2"
    print(f"[{name}] rank {rank}: optimizer state {info['state_bytes']} bytes "
          f"(one rank would hold {info['state_bytes_one_rank']})", flush=True)
    t0 = time.perf_counter()
    for s in range(steps):
        x, y = batch(s, rank, world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        # the norm over both ranks' averaged gradients; clips this step at 1.0
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        if rank == 0 and (s % 10 == 0 or s == steps - 1):
            print(f"[{name}] step {s:3d} loss {loss.item():.4f} (rank 0's batch) "
                  f"grad norm {norm.item():.4f}", flush=True)
    dt = time.perf_counter() - t0
    opt.gather_params()  # ZeRO-3: the full params back in the model
    h = hashlib.sha256(b"".join(p.detach().view(torch.int16).numpy().tobytes()
                                for p in model.parameters())).digest()
    mine = torch.frombuffer(bytearray(h), dtype=torch.uint8)
    alls = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(alls, mine)
    same = all(torch.equal(a, alls[0]) for a in alls)
    if rank == 0:
        print(f"[{name}] {steps} steps in {dt:.2f} s; params identical on all "
              f"{world} ranks: {same}", flush=True)
    if hooks is not None:
        hooks.remove()
    opt.close()
    return same


def worker(rank, world, port, sos, steps, results):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ok = train(rank, world, sos["zero2"], False, steps)
    ok = train(rank, world, sos["zero3"], True, steps) and ok
    results[rank] = 1 if ok else 0
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    text = open(os.path.join(HERE, "adamw_bf16_zero2.mlir")).read()
    tmp = tempfile.mkdtemp(prefix="zopt-ddp-")
    sos = {"zero2": zopt.compile(text, os.path.join(tmp, "zero2.so")),
           "zero3": zopt.compile(text.replace("zero_stage = 2", "zero_stage = 3")
                                 .replace("@adamw_bf16_zero2", "@adamw_bf16_zero3"),
                                 os.path.join(tmp, "zero3.so"))}
    results = mp.get_context("spawn").Array("i", a.ranks)
    mp.spawn(worker, args=(a.ranks, free_port(), sos, a.steps, results), nprocs=a.ranks,
             join=True)
    if all(results):
        print("OK")
        return 0
    print("FAIL: the ranks' params differ")
    return 1


if __name__ == "__main__":
    sys.exit(main())

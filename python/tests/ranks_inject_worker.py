"""One rank of test_ranks_fuzz.py's disagreement and death cases: two gloo
ranks build a ZeRO-2 zopt.Optimizer (its own group, timeout 3 s), step
once together, then rank 1 does something else than rank 0 at the next
call:

    ranks_inject_worker.py RANK WORLD PORT OUTDIR KIND [KIND ...]

KIND: "lr" (rank 1 another lr), "maximize", "divisor" (another
grad_divisor), "max_norm" (clip_grad_norm_ at another max_norm), "add_group" (rank 1 an add_param_group
rank 0 does not make: rank 0 steps), "skip_step" (rank 1 skips a step()
and calls state_dict()), "exit" (rank 1 exits before the step; last).
Every rank's call must raise ZoptError within a bounded time; each rank
writes {KIND: {"error": text, "seconds": s}} (None: no error) to
OUTDIR/rank{R}.json. A new optimizer (a new zopt group) per kind.
"""
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..")))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zopt  # noqa: E402
from overlap_fakes import finish_rank  # noqa: E402

TIMEOUT = 3


def grads(ps, s, rank):
    g = torch.Generator().manual_seed(10 * s + rank)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) + 0.1


def write(out, outdir, rank):
    import json
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


def run_kind(kind, rank, before_exit):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (40, 7, 130)]
    step = zopt.steps.adamw(zero_stage=2, clip=1.0)
    opt = zopt.Optimizer(step, ps, lr=1e-2, process_group=dist.group.WORLD, timeout=TIMEOUT)
    grads(ps, 0, rank)
    opt.step()
    grads(ps, 1, rank)
    t0 = time.monotonic()
    try:
        if rank == 1 and kind == "exit":
            before_exit()
            print(f"DONE rank {rank}", flush=True)
            os._exit(0)   # dies without a word
        if rank == 1 and kind == "lr":
            opt.param_groups[0]["lr"] = 0.5
        if rank == 1 and kind == "maximize":
            opt.param_groups[0]["maximize"] = True
        if rank == 1 and kind == "divisor":
            opt.grad_divisor = 4
        if rank == 1 and kind == "add_group":
            extra = torch.nn.Parameter(torch.randn(9, generator=torch.Generator().manual_seed(1)))
            opt.add_param_group(dict(params=[extra]))
        elif rank == 1 and kind == "skip_step":
            opt.state_dict()
        elif kind == "max_norm":   # clip_grad_norm_ at another threshold on each rank
            opt.clip_grad_norm_(1.0 if rank == 0 else 0.5)
            opt.step()
        else:
            opt.step()
        err = None
    except zopt.ZoptError as e:
        err = str(e)
    out = {"error": err, "seconds": time.monotonic() - t0}
    print(f"{kind} rank {rank}: {out}", flush=True)
    try:
        opt.close()
    except zopt.ZoptError:
        pass
    return out


def main():
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out = {}
    for kind in sys.argv[5:]:
        out[kind] = run_kind(kind, rank, lambda: write(out, outdir, rank))
        if kind == "exit":   # rank 0 alone: no barrier with a dead peer
            write(out, outdir, rank)
            print(f"DONE rank {rank}", flush=True)
            os._exit(0)
    finish_rank(out, outdir, rank)


if __name__ == "__main__":
    main()

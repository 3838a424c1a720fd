"""Ranks of test_ranks.py (issue 16: clipping, DDP, dead and stalled peers).

    ranks_worker.py clip RANK WORLD PORT OUTDIR STEP.so
        A ZeRO-2 f32 step compiled with clip=1.0: each step
        opt.clip_grad_norm_(MAX_NORMS[s]) between backward and step(), once
        without and once with grad_streaming=True; saves the returned norms
        and the params. Then torch.nn.utils.clip_grad_norm_ on p.grad between
        backward and step() must warn, and a rank with another lr must fail
        the step naming the setting and both values.
    ranks_worker.py ddp RANK WORLD PORT OUTDIR STEP.so
        The model wrapped in DistributedDataParallel (kept by mistake), zopt
        on the same world group, without and with grad_streaming=True:
        a UserWarning saying to unwrap, no deadlock, the params saved.
    ranks_worker.py faults PORT OUTDIR STEP.so REPS
        Forks (after importing torch once) REPS jobs of 3 gloo ranks (a
        ZeRO-2 step over two buckets, timeout=2) whose last rank kills itself
        (SIGKILL) before its third step, and one job whose last rank stalls
        (sleeps) there; the survivors' step raises, they record the error
        and leave through sys.exit(3) (the normal interpreter exit, with the
        model and optimizer alive until its teardown, as a script's globals). Prints one line per survivor: its exit status,
        the seconds its failed step took, and its error.

Prints "DONE rank R" (or "DONE faults") last.
"""
import datetime
import os
import signal
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zopt  # noqa: E402

STEPS = 4
LR, WD = 1e-2, 0.1
MAX_NORMS = [0.05, 100.0, 0.3, 1.0]   # clipping active, inactive, active, ...


def model_of(big=False):
    """6-16-3; big: 32-512-64 (49,728 params: two buckets of 32,768, so the
    streamed reductions run during backward, beside DDP's)."""
    torch.manual_seed(0)
    i, h, o = (32, 512, 64) if big else (6, 16, 3)
    return torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.Tanh(), torch.nn.Linear(h, o))


def batch(s, r, big=False):
    g = torch.Generator().manual_seed(1000 * s + r)
    i, o = (32, 64) if big else (6, 3)
    return torch.randn(8, i, generator=g), torch.randn(8, o, generator=g)


def loss_of(model, s, r, big=False):
    x, y = batch(s, r, big)
    return torch.nn.functional.mse_loss(model(x), y) * 10  # norms around 1-10


def init(rank, world, port, seconds=30):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))


def run_clip(rank, world, port, out, so):
    init(rank, world, port)
    step = zopt.Step(so)
    res = {}
    for stream in (False, True):
        model = model_of()
        opt = zopt.Optimizer(step, model.parameters(), lr=LR, weight_decay=WD,
                             process_group=dist.group.WORLD, timeout=20, grad_streaming=stream)
        norms = []
        for s in range(STEPS):
            opt.zero_grad()
            loss_of(model, s, rank).backward()
            n = opt.clip_grad_norm_(MAX_NORMS[s])
            assert isinstance(n, torch.Tensor) and n.dim() == 0, n
            norms.append(float(n))
            opt.step()
            assert float(torch.tensor(opt.last_grad_norm, dtype=torch.float32)) == norms[-1]
        res[stream] = {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}
        opt.close()
    torch.save(res, os.path.join(out, f"clip_rank{rank}.pt"))
    print(f"ok clip rank {rank}", flush=True)

    # torch's clipper on this rank's own gradients: warned, once
    model = model_of()
    opt = zopt.Optimizer(step, model.parameters(), lr=LR, process_group=dist.group.WORLD,
                         timeout=20)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(2):
            opt.zero_grad()
            loss_of(model, s, rank).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    texts = [str(x.message) for x in w if issubclass(x.category, UserWarning)]
    hits = [t for t in texts if "changed in place between backward and step()" in t]
    assert len(hits) == 1 and "opt.clip_grad_norm_(max_norm)" in hits[0], texts
    print(f"ok a per-rank clipper warns once: {hits[0][:120]}", flush=True)

    # a rank with another lr: the step fails on every rank naming it
    for g in opt.param_groups:
        g["lr"] = 0.5 if rank == 1 else LR
    opt.zero_grad()
    loss_of(model, 0, rank).backward()
    try:
        opt.step()
        raise AssertionError("a step with another lr on rank 1 raised nothing")
    except zopt.ZoptError as e:
        want = f"group 0 lr: rank 0 has {LR:.17g}, rank 1 has 0.5"
        assert want in str(e), str(e)
        print(f"ok disagreement names the setting: {want}", flush=True)
    opt.close()
    print(f"DONE rank {rank}", flush=True)


def run_ddp(rank, world, port, out, so):
    init(rank, world, port, seconds=20)
    step = zopt.Step(so)
    res = {}
    for stream in (False, True):
        model = model_of(big=True)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = zopt.Optimizer(step, model.parameters(), lr=LR, weight_decay=WD, bucket_elems=32768,
                             process_group=dist.group.WORLD, timeout=10, grad_streaming=stream)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            norms = []
            for s in range(STEPS):
                opt.zero_grad()
                x, y = batch(s, rank, big=True)
                (torch.nn.functional.mse_loss(ddp(x), y) * 10).backward()
                opt.step()
                norms.append(opt.last_grad_norm)
        texts = [str(x.message) for x in w if issubclass(x.category, UserWarning)]
        hits = [t for t in texts if "DistributedDataParallel" in t]
        assert len(hits) == 1 and "Unwrap the model" in hits[0], texts
        if stream:
            assert all(p.grad is None for p in model.parameters())
        res[stream] = {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}
        print(f"ok ddp stream={stream} rank {rank}: {hits[0][:100]}", flush=True)
        opt.close()
    torch.save(res, os.path.join(out, f"ddp_rank{rank}.pt"))
    print(f"DONE rank {rank}", flush=True)


KEEP = []


def fault_rank(rank, port, so, mode, out):
    """One rank of a faulty job (a forked child)."""
    init(rank, 3, port, seconds=30)
    torch.manual_seed(0)  # two buckets of 32768 elements (the exchanges queue several works)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=LR, bucket_elems=32768,
                         process_group=dist.group.WORLD, timeout=2)
    # kept until the interpreter's teardown, as a script's globals are (the
    # order of that teardown is where gloo's leftovers aborted the process)
    KEEP.extend([model, opt])
    # Per-process first-call costs outside zopt's collectives, then every
    # rank lined up (the default group's 30 s timeout): the first step's
    # collectives must not be charged with another rank's start-up under
    # timeout=2. (torch 2: the first zero_grad() imports torch._dynamo for
    # its disable wrapper, seconds with 21 processes starting at once; a
    # rank that late was rightly named "did not answer" at the first step.)
    opt.zero_grad()
    dist.barrier()
    for s in range(3):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        if s == 2 and rank == 2:
            if mode == "dead":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(20)  # stalled: alive, not calling
            os._exit(0)
        t0 = time.monotonic()
        try:
            opt.step()
        except zopt.ZoptError as e:
            with open(os.path.join(out, f"{mode}.{port}.{rank}"), "w") as f:
                f.write(f"{time.monotonic() - t0:.2f} {e}")
            sys.exit(3)  # the interpreter's own exit, atexit handlers and all
    sys.exit(0)


def run_faults(port, out, so, reps):
    jobs = [("dead", port + 10 * i) for i in range(reps)] + [("stall", port + 10 * reps)]
    kids = {}
    for mode, p in jobs:
        for r in range(3):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    fault_rank(r, p, so, mode, out)
                except SystemExit as e:
                    code = e.code
                    raise
                except BaseException as e:  # unexpected: say so, exit 1
                    print(f"rank {r} of {mode} job: {type(e).__name__}: {e}", flush=True)
                    raise SystemExit(1)
                raise SystemExit(code)
            kids[pid] = (mode, p, r)
    deadline = time.monotonic() + 60
    while any(r != 2 for _, _, r in kids.values()) and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        mode, p, r = kids.pop(pid)
        if r == 2:
            continue  # killed itself / stalled
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        path = os.path.join(out, f"{mode}.{p}.{r}")
        text = open(path).read() if os.path.exists(path) else "? (no error recorded)"
        print(f"SURVIVOR {mode} job {p} rank {r}: exit {code} signal {sig} after {text}", flush=True)
    for pid in kids:  # the stalled ranks, or a hang: end them
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print("DONE faults", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "clip":
        run_clip(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    elif mode == "ddp":
        run_ddp(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    elif mode == "faults":
        run_faults(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        sys.exit(f"unknown mode {mode}")

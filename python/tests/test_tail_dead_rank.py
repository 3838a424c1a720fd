"""A rank that dies while the offloaded step's tail runs, at 2 gloo ranks
(``zopt.Optimizer(..., overlap=True, model=model, process_group=pg,
timeout=3)``; docs/COMM.md "Faults named", docs/GPU.md "What step()
promises in each mode").

One launcher process (torch imported once) forks the jobs one after the
other, two ranks each, with the stand-in CUDA driver (libzopt-fake-cuda.so)
and the small bf16 model of test_early_params_ranks.py (a ZeRO-2 offloaded
step, per-bucket mode: step() returns while its tail, per bucket in
forward order the update, the bucket's ALL_GATHER of the params and its
copy back, runs on the pipeline thread). After one whole step:

* ``after``: rank 1's tail is held in its first copy back
  (fake_cuda_stall_htod) and rank 1 exits abruptly (os._exit) right after
  its step() returned; rank 0's tail fails in a bucket's gather. Rank 0's
  next call (``forward``: the hooks' wait_params; ``backward``: the next
  backward's mark, the params read without the modules' forward) raises
  ZoptError naming the bucket and rank 1.
* ``before``: rank 0's tail is held in its last copy back (bucket 0's,
  after every gather); rank 1 joins its own tail and exits abruptly before
  its next step(). Rank 0's next forward waits for the held copy (released
  after 0.5 s) and its next step's collectives (the backward's marks or
  step()) raise ZoptError naming rank 1.
* ``exit``: rank 0 leaves (sys.exit) right after step(), its tail still
  running, while rank 1 does the same (``both``), is dead (``dead``) or
  alive but not calling (``stalled``, its tail held): the tail is joined
  at exit before the communicators are released (a failure: a
  RuntimeWarning), and the process exits by itself, in the communicator's
  timeout at most. (Before, the pipeline thread, inside a collective's
  Python callback, was ended by the interpreter's teardown and the
  optimizer's free waited for it forever; or the process aborted.)

Each survivor raises within the communicator's timeout and leaves through
sys.exit(3) (the interpreter's own exit, optimizer and model alive), by
itself: the launcher kills nothing but a hang (the test fails then) and
the stalled rank once rank 0 is out.
"""
import datetime
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_fakes import FAKE, needs_fake  # noqa: E402

TIMEOUT = 3  # the communicator's (seconds)
JOBS = [("after", "forward"), ("after", "backward"), ("before", "forward"),
        ("exit", "both"), ("exit", "dead"), ("exit", "stalled")]


@needs_fake
def test_rank_dies_during_tail_named_and_clean_exit(steps, tmp_path):
    from test_comm import _free_port, _run_all, _runtime_env
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", zero_stage=2, param="bf16", grad="bf16",
                                  master="f32", clip=1.0, comments=False))
    env = dict(_runtime_env(), ZOPT_CUDA_DRIVER=FAKE, ZOPT_FAKE_CUDA_ASYNC="1")
    procs, outs = _run_all([[sys.executable, os.path.abspath(__file__), str(_free_port()),
                             str(tmp_path), off.path]], timeout=120, env=env)
    out = outs[0]
    assert procs[0].returncode == 0 and "DONE jobs" in out, out
    got = {}
    for ln in out.splitlines():
        if ln.startswith("JOB "):
            rec = json.loads(ln[4:])
            got[(rec["case"], rec["call"])] = rec
    assert sorted(got) == sorted(JOBS), out
    for job, rec in got.items():
        case, call = job
        # every survivor left through sys.exit(3) by itself, never by a
        # signal; rank 1 by os._exit(0), or (stalled) killed by the launcher
        # once rank 0 was out
        want = {"0": [3, 0], "1": [3, 0] if call == "both" else
                ["killed", 9] if call == "stalled" else [0, 0]}
        assert rec["status"] == want, (job, rec, out)
        for r, left in rec["left"].items():
            # out of the process soon after: its tail joined at exit, in the
            # communicator's timeout at most (a stalled peer), plus the
            # liveness window and slack for 2 shared cores
            assert left["exit_after"] < (TIMEOUT + 3.0 if call == "stalled" else 5.0), (job, rec)
        if case == "exit":
            continue
        err = rec["left"]["0"]
        assert err["type"] == "ZoptError", (job, rec, out)
        assert "rank 1 did not answer" in err["message"], (job, err)
        # the tail's failure names its bucket and the communicator's error
        if case == "after":
            assert "ALL_GATHER of the params" in err["message"], (job, err)
        assert err["took"] < TIMEOUT + 2.0, (job, err)  # a dead peer: at once + liveness


# ---- the launcher and one rank (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ------

def _rank(rank, port, outdir, off_path, case, call):
    import ctypes
    import threading
    import torch
    import torch.distributed as dist
    import zopt
    import overlap_fakes as of
    from test_early_params import Net
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    s, fake, dev, g, init = of.start(device_steps_only=True)
    A = [dev(sh, w) for sh, w in zip(of.SHAPES, init)]
    net = Net(A)
    params = list(net.parameters())
    keep = []
    of.grads_to_device(params, dev, keep)
    opt = zopt.Optimizer(zopt.Step(off_path), params, overlap=True, model=net, lr=1e-2,
                         weight_decay=0.1, bucket_elems=1024,
                         process_group=dist.group.WORLD, timeout=TIMEOUT)
    KEEP.extend([s, net, opt, keep])  # alive until the interpreter's teardown
    fake.fake_cuda_stall_htod.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    ov = opt._overlap
    assert ov.nb >= 3, ov.nb

    def span(ps):
        return (min(p.data_ptr() for p in ps),
                max(p.data_ptr() + p.numel() * p.element_size() for p in ps))

    def batch():
        return torch.randn(8, 32, generator=g) + rank  # each rank its own batch

    # one whole step, every rank lined up
    opt.zero_grad(set_to_none=True)
    net(batch()).square().mean().backward()
    opt.step()
    net.state_dict()
    dist.barrier()

    opt.zero_grad(set_to_none=True)
    x = batch()
    net(x).square().mean().backward()
    if case == "exit":  # rank 0 (and rank 1: both) leaves right after step()
        if rank == 1 and call != "both":
            fake.fake_cuda_stall_htod(*span(params))  # its tail held in its first copy back
            opt.step()
            if call == "dead":
                os._exit(0)
            time.sleep(60)  # stalled, alive: the launcher kills it after rank 0 left
        opt.step()
        _record(outdir, rank, None, 0.0)
        sys.exit(3)  # the tail still running (rank 0: in a gather)
    if case == "after":
        if rank == 1:
            fake.fake_cuda_stall_htod(*span(params))  # its tail held in its first copy back
            opt.step()
            os._exit(0)  # dead, its tail running
        opt.step()
        t0 = time.monotonic()
        try:
            if call == "forward":  # the hooks' wait_params
                net(x)
            else:  # the params read without the modules' hooks: the backward's marks join
                opt.zero_grad(set_to_none=True)
                of.loss(params, x, 1.0).backward()
                opt.step()
        except Exception as e:  # noqa: BLE001 - the test checks the type
            _record(outdir, rank, e, time.monotonic() - t0)
            sys.exit(3)
        sys.exit(4)
    # before: rank 0's tail held in its last job's copy back (bucket 0's,
    # after every gather); rank 1 joins its tail and dies before its next
    # step()
    if rank == 1:
        opt.step()
        net.state_dict()
        os._exit(0)
    last = [p for t, p in enumerate(params) if ov.t_buckets[t] == [0]]
    assert last, ov.t_buckets
    fake.fake_cuda_stall_htod(*span(last))
    threading.Timer(0.5, fake.fake_cuda_release_htod).start()
    opt.step()
    t0 = time.monotonic()
    try:
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()
    except Exception as e:  # noqa: BLE001
        _record(outdir, rank, e, time.monotonic() - t0)
        sys.exit(3)
    sys.exit(4)


KEEP = []


def _record(outdir, rank, e, took):
    """What rank `rank` raised (None: it leaves without an error) and when."""
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump({"type": type(e).__name__ if e else None, "message": str(e) if e else "",
                   "took": round(took, 3), "at": time.time()}, fh)


def _launch(port, outdir, off_path):
    import torch  # noqa: F401 - once, before the forks
    for i, (case, call) in enumerate(JOBS):
        jobdir = os.path.join(outdir, f"{case}.{call}")
        os.makedirs(jobdir)
        kids = {}
        for r in range(2):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    torch.set_num_threads(1)
                    _rank(r, port + 10 * i, jobdir, off_path, case, call)
                except SystemExit as e:
                    code = e.code
                    raise
                except BaseException as e:  # unexpected: say so, exit 1
                    print(f"rank {r} of {case}/{call}: {type(e).__name__}: {e}", flush=True)
                    raise SystemExit(1)
                raise SystemExit(code)
            kids[pid] = r
        status, ended = {}, {}
        deadline = time.monotonic() + 20
        while kids and time.monotonic() < deadline:
            if call == "stalled" and 0 in ended:  # rank 0 left: end the stalled one
                for pid, r in list(kids.items()):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status[str(r)] = ["killed", signal.SIGKILL]
                    del kids[pid]
                break
            pid, st = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
            r = kids.pop(pid)
            ended[r] = time.time()
            status[str(r)] = [os.WEXITSTATUS(st) if os.WIFEXITED(st) else -1,
                              os.WTERMSIG(st) if os.WIFSIGNALED(st) else 0]
        for pid, r in kids.items():  # a hang: end it (the test fails)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status[str(r)] = ["hung", signal.SIGKILL]
        left = {}
        for r in range(2):
            path = os.path.join(jobdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    left[str(r)] = json.load(fh)
                left[str(r)]["exit_after"] = round(ended[r] - left[str(r)]["at"], 3) \
                    if r in ended else None
        print("JOB " + json.dumps({"case": case, "call": call, "status": status, "left": left}),
              flush=True)
    print("DONE jobs", flush=True)


if __name__ == "__main__":
    _launch(int(sys.argv[1]), sys.argv[2], sys.argv[3])

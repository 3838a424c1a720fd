"""One rank of the multi-process communicator tests (test_comm.py runs it).

    comm_worker.py torch RANK WORLD PORT   TorchComm over gloo on 127.0.0.1:PORT
    comm_worker.py torch-subgroup RANK WORLD PORT   the same on ranks 1..W-1
    comm_worker.py mpi                     Comm.mpi() (launched by mpirun)

Checks the collectives on random bytes, then a deliberate mismatch (rank 1
calls all_gather where the others call all_to_all), then (torch) a peer that
does not call (timeout 1 s) and a peer that exits: each must raise
ZoptError, never hang. Prints one line per check and
"DONE rank R" last; exits 1 on the first failed check.
"""
import datetime
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import zopt  # noqa: E402
from zopt.comm import Comm, TorchComm  # noqa: E402


def piece(seed, src, dst, n):
    """The bytes rank src sends to rank dst: random, never zero."""
    rng = np.random.default_rng([seed, src, dst + 1])
    return rng.integers(1, 256, size=n, dtype=np.uint8)


def check(cond, what):
    if not cond:
        print(f"FAIL {what}", flush=True)
        sys.exit(1)
    print(f"ok {what}", flush=True)


def collectives(c, seed, torch_tensors=False):
    r, W = c.rank, c.size
    for n in (1, 3, 64, 4097):
        seed += 1
        send = np.concatenate([piece(seed, r, q, n) for q in range(W)])
        recv = np.zeros(W * n, dtype=np.uint8)
        if torch_tensors:
            import torch
            send, recv = torch.from_numpy(send), torch.from_numpy(recv)
        c.all_to_all(send, recv)
        want = np.concatenate([piece(seed, q, r, n) for q in range(W)])
        check(np.array_equal(np.asarray(recv), want), f"all_to_all {n} bytes/rank")
        seed += 1
        mine = piece(seed, r, -1, n)
        out = np.zeros(W * n, dtype=np.uint8)
        c.all_gather(mine, out)
        want = np.concatenate([piece(seed, q, -1, n) for q in range(W)])
        check(np.array_equal(out, want), f"all_gather {n} bytes")
        out[:] = 0
        out[r * n:(r + 1) * n] = mine
        c.all_gather(out[r * n:(r + 1) * n], out)  # in place
        check(np.array_equal(out, want), f"in-place all_gather {n} bytes")
    c.barrier()


def mismatch(c):
    W = c.size
    send = np.ones(W * 64, dtype=np.uint8)
    recv = np.zeros(W * 64, dtype=np.uint8)
    try:
        if c.rank == 1:
            c.all_gather(send[:8], recv[:8 * W])
        else:
            c.all_to_all(send, recv)
    except zopt.ZoptError as e:
        msg = str(e)
        print(f"mismatch raised: {msg}", flush=True)
        check("rank 1" in msg and "all_gather of 8 bytes" in msg and "all_to_all of 64 bytes/rank" in msg,
              "mismatch names rank 1 and both operations")
        return
    check(False, "mismatch raised no error")


def run_torch(rank, world, port):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    c = TorchComm()
    check((c.rank, c.size, c.name) == (rank, world, "torch"), "TorchComm rank, size, name")
    c.set_timeout(20)
    collectives(c, 100)
    collectives(c, 200, torch_tensors=True)
    mismatch(c)
    # A silent peer (alive, not calling) on a group of its own: rank 0 times out.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    c3 = TorchComm(group)
    c3.set_timeout(1)
    if rank == 0:
        try:
            c3.barrier()
            check(False, "a barrier without its peers raised no error")
        except zopt.ZoptError as e:
            print(f"silent peer raised: {e}", flush=True)
            check("timed out" in str(e), "a silent peer gives a ZoptError after the 1 s timeout")
    dist.barrier()
    # A fresh communicator; the last rank leaves (exits) while the others call.
    c2 = TorchComm()
    c2.set_timeout(10)
    c2.barrier()
    if rank == world - 1:
        print(f"DONE rank {rank}", flush=True)
        os._exit(0)  # dies without a word: its peers see the connection close
    try:
        send = np.ones(world * 16, dtype=np.uint8)
        c2.all_to_all(send, np.zeros_like(send))
        check(False, "a collective with a dead peer raised no error")
    except zopt.ZoptError as e:
        print(f"dead peer raised: {e}", flush=True)
        check(True, "a dead peer gives a ZoptError")
    print(f"DONE rank {rank}", flush=True)
    os._exit(0)  # the gloo group has a dead peer: skip its teardown


def run_torch_subgroup(rank, world, port):
    """A process group of ranks 1..W-1 (group rank q is global rank q+1):
    the collectives address peers by their group rank."""
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    sub = dist.new_group(ranks=list(range(1, world)), backend="gloo")
    if rank > 0:
        c = TorchComm(sub)
        check((c.rank, c.size) == (rank - 1, world - 1), "TorchComm on a subgroup: rank, size")
        c.set_timeout(20)
        collectives(c, 400)
    dist.barrier()
    print(f"DONE rank {rank}", flush=True)


def run_mpi():
    c = Comm.mpi()
    check(c.name == "mpi", "Comm.mpi()")
    c.set_timeout(30)
    collectives(c, 300)
    mismatch(c)
    rank = c.rank
    c.close()  # finalizes MPI (initialized by the plugin)
    print(f"DONE rank {rank}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        run_torch(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "torch-subgroup":
        run_torch_subgroup(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "mpi":
        run_mpi()
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")

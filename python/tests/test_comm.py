"""zopt.comm: Comm.self(), loopback ranks as threads, TorchComm over two gloo
processes (collectives on random bytes; a mismatch and a dead peer raise
ZoptError instead of hanging), and Comm.mpi() under mpirun when the plugin
and mpirun are there. Multi-process tests have a hard timeout and kill their
processes on failure."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import zopt
from zopt.comm import Comm, TorchComm

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "comm_worker.py")


def _runtime_env():
    env = dict(os.environ)
    # python/ first; what PYTHONPATH had stays after it (the step cache's
    # sitecustomize on a machine without zopt-compile: bench/gpu/).
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.abspath(os.path.join(HERE, ".."))] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["ZOPT_RUNTIME_LIB"] = zopt.find_runtime_library() or ""
    return env


def _run_all(cmds, timeout, env):
    """Runs the commands at once; returns their outputs. Kills them all when
    one fails or the timeout expires."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True) for c in cmds]
    outs = [None] * len(procs)

    def drain(i):
        outs[i] = procs[i].stdout.read().decode("utf-8", "replace")

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(procs))]
    for t in readers:
        t.start()
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in readers:
            t.join()
    if hung:
        pytest.fail(f"{len(hung)} of {len(procs)} processes still ran after {timeout} s "
                    "(killed):\n" + "\n----\n".join(outs))
    return procs, outs


def test_self():
    with Comm.self() as c:
        assert (c.rank, c.size, c.name) == (0, 1, "self")
        send = np.random.default_rng(1).integers(1, 256, 100, dtype=np.uint8)
        recv = np.zeros_like(send)
        c.all_to_all(send, recv)
        assert np.array_equal(send, recv)
        t = torch.arange(10, dtype=torch.float32) + 1
        out = torch.zeros(10)
        c.all_gather(t, out)
        assert torch.equal(t, out)
        c.barrier()
        assert c.count == 3
        with pytest.raises(ValueError):
            c.all_gather(t, torch.zeros(11))
        with pytest.raises(TypeError):
            c.all_to_all([1, 2], [3, 4])
    with pytest.raises(zopt.ZoptError):
        c.barrier()  # closed


def test_loopback_threads():
    W = 3
    comms = Comm.loopback(W, timeout=10, delay=True, poison=True, seed=5)
    errors = [None] * W

    def rank(r):
        c = comms[r]
        try:
            rng = np.random.default_rng([7, r])
            send = rng.integers(1, 256, W * 33, dtype=np.uint8)
            recv = np.zeros_like(send)
            c.all_to_all(send, recv)
            got = recv.reshape(W, 33)
            for q in range(W):
                peer = np.random.default_rng([7, q]).integers(1, 256, W * 33, dtype=np.uint8)
                assert np.array_equal(got[q], peer.reshape(W, 33)[r])
            # mismatch: rank 1 calls all_gather
            with pytest.raises(zopt.ZoptError, match="rank 1"):
                if r == 1:
                    c.all_gather(send[:8], recv[:8 * W])
                else:
                    c.all_to_all(send, recv)
        except BaseException as e:  # reported by the main thread
            errors[r] = e

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "loopback ranks hung"
    for c in comms:
        c.close()
    for e in errors:
        if e is not None:
            raise e


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_comm_needs_a_process_group():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(zopt.ZoptError, match="not initialized"):
        TorchComm()


def test_torch_gloo_two_processes():
    """Two gloo processes: collectives on random bytes (numpy and torch
    buffers), a mismatch raising ZoptError naming rank 1 on both, a peer
    that does not call (1 s timeout) and a peer that exits: ZoptError, not a
    hang."""
    env = _runtime_env()
    port = _free_port()
    cmds = [[sys.executable, WORKER, "torch", str(r), "2", str(port)] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=120, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
        assert "ok mismatch names rank 1 and both operations" in out, out
    assert "ok a dead peer gives a ZoptError" in outs[0], outs[0]
    assert "ok a silent peer gives a ZoptError after the 1 s timeout" in outs[0], outs[0]


def test_torch_gloo_subgroup():
    """TorchComm over a process group of global ranks 1 and 2 of three:
    every collective's pieces land at their group ranks."""
    env = _runtime_env()
    port = _free_port()
    cmds = [[sys.executable, WORKER, "torch-subgroup", str(r), "3", str(port)] for r in range(3)]
    procs, outs = _run_all(cmds, timeout=120, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    assert "ok all_gather 4097 bytes" in outs[2] and "ok in-place all_gather 4097 bytes" in outs[1]


def _mpi_plugin():
    lib = zopt.find_runtime_library()
    path = os.environ.get("ZOPT_COMM_MPI_LIB") or (
        os.path.join(os.path.dirname(lib), "libzopt_comm_mpi.so") if lib else "")
    return path if path and os.path.exists(path) else None


@pytest.mark.parametrize("np_", [2, 3])
def test_mpi_python(np_):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.skip("no mpirun on this machine (apt-get install openmpi-bin)")
    if not _mpi_plugin():
        pytest.skip("libzopt_comm_mpi.so was not built (no MPI at build time)")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
           "-np", str(np_), sys.executable, WORKER, "mpi"]
    procs, outs = _run_all([cmd], timeout=120, env=_runtime_env())
    out = outs[0]
    assert procs[0].returncode == 0, out
    for r in range(np_):
        assert f"DONE rank {r}" in out, out
    assert out.count("ok mismatch names rank 1 and both operations") == np_, out


# ---- the torch engine's wait slices (fake works) ----------------------------------

class _Work:
    """A fake c10d Work: completes after ``slices`` expired timed waits
    (``race``: at the moment the last one expires, as a work that ends
    while the waiting thread re-takes the GIL), then succeeds or fails."""

    def __init__(self, slices=0, race=False, error=None):
        self.left, self.race, self.error, self.done = slices, race, error, slices == 0
        self.timed = 0

    def wait(self, timeout=None):
        if timeout is not None and not self.done:
            self.timed += 1
            self.left -= 1
            if self.left <= 0 and self.race:
                self.done = True  # completed just after the slice expired
            raise RuntimeError("Operation timed out!")
        if timeout is None and not self.done:
            raise AssertionError("an untimed wait on a running work (it would block)")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        if not self.done and self.left <= 0:
            self.done = True
        return self.done


def _engine(timeout=None, pg_timeout=30.0):
    from zopt.comm import _TorchEngine
    e = object.__new__(_TorchEngine)
    e.timeout, e.pg_timeout, e.private, e.live, e.rank, e.orphans = \
        timeout, pg_timeout, True, None, 0, []
    return e


def test_torch_wait_slices_tell_success_from_failure():
    """_TorchEngine._wait: a work that completes as a wait slice expires
    ("Operation timed out!", then is_completed() is True) succeeded (before:
    taken for a failure, the streamed 2-rank test under torch 2.11); a work
    that failed reports its own error, after every other work ended; works
    still running keep being waited for, slice by slice."""
    e = _engine()
    w = _Work(slices=3, race=True)
    assert e._wait([w], None) is None and w.timed == 3
    slow, bad, ok = _Work(slices=2), _Work(error="Connection reset by peer"), _Work(slices=1, race=True)
    err = e._wait([slow, bad, ok], None)
    assert isinstance(err, RuntimeError) and "Connection reset by peer" in str(err)
    assert slow.done and ok.done and slow.timed == 2
    # set_timeout shorter than the group's: the running work is kept (orphans)
    e = _engine(timeout=0.01, pg_timeout=30.0)
    hang = _Work(slices=10 ** 9)
    err = e._wait([hang], "bufs")
    assert isinstance(err, TimeoutError) and e.orphans == [([hang], "bufs")]

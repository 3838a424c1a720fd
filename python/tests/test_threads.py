"""One zopt.Optimizer used from several threads (docs/USAGE.md "Threads"):
a call while another thread's call runs on the optimizer raises ZoptError
(BAD_STATE, a RuntimeError, naming the running call) and changes nothing;
close() waits for a running step. Bounded: every thread is joined with a
timeout (a deadlock fails the test instead of hanging it)."""
import random
import threading
import time

import pytest
import torch

import zopt
from zopt._native import lock_of

TIMEOUT = 60


def _params(seed, sizes):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.1) for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 0.01 + 1e-3
    return ps


def _bits(opt, ps):
    sd = opt.state_dict()["state"]
    return [p.detach().clone() for p in ps], [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in sd[i].items()} for i in range(len(ps))]


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "params differ"
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]), k


def _join(threads):
    deadline = time.monotonic() + TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock)"


def test_step_from_two_threads_runs_or_refuses(steps):
    step = steps(rule="adamw", layout="f32")
    sizes = (70001, 513, 4096)
    ps = _params(0, sizes)
    opt = zopt.Optimizer(step, ps, lr=1e-2, weight_decay=0.01, num_threads=2)
    calls, ok, refused, other = 60, [0, 0], [0, 0], []

    def run(i):
        rnd = random.Random(i)
        for _ in range(calls):
            time.sleep(rnd.random() * 3e-4)
            try:
                opt.step()
                ok[i] += 1
            except zopt.ZoptError as e:
                if e.code == zopt.Status.BAD_STATE and \
                        "step(): another call (step) is running on this optimizer on another " \
                        "thread" in str(e):
                    refused[i] += 1
                else:
                    other.append(e)
            except BaseException as e:  # pragma: no cover - reported below
                other.append(e)
    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    _join(ts)
    assert not other, other
    n = sum(ok)
    assert n + sum(refused) == 2 * calls and n > 0
    assert opt.step_count() == n
    # the successful number of steps, serially, from the same start
    rs = _params(0, sizes)
    ref = zopt.Optimizer(step, rs, lr=1e-2, weight_decay=0.01, num_threads=2)
    for _ in range(n):
        ref.step()
    _same(_bits(opt, ps), _bits(ref, rs))
    assert isinstance(zopt.ZoptError(zopt.Status.BAD_STATE, ""), RuntimeError)  # torch's type


def test_close_waits_for_a_step_on_another_thread(steps):
    step = steps(rule="adamw", layout="f32")
    sizes = (1 << 22, 4097)
    rs = _params(1, sizes)
    ref = zopt.Optimizer(step, rs, lr=1e-2, num_threads=2)
    ref.step()
    want = [p.detach().clone() for p in rs]
    ref.close()
    overlapped = False
    for _ in range(10):
        ps = _params(1, sizes)
        opt = zopt.Optimizer(step, ps, lr=1e-2, num_threads=2)
        errors, started = [], threading.Event()

        def run():
            started.set()
            try:
                opt.step()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        started.wait(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        # until the step is seen running (it holds the optimizer's call
        # lock: a probe by another call would refuse the step), or is over
        while t.is_alive() and time.monotonic() < deadline:
            if lock_of(opt).running == "step":
                time.sleep(0.002)  # into the native step
                overlapped = True
                break
        opt.close()  # waits for the step
        _join([t])
        assert not errors, errors
        assert all(torch.equal(p.detach(), w) for p, w in zip(ps, want))
        with pytest.raises(zopt.ZoptError, match="closed"):
            opt.step()
        del opt
        if overlapped:
            break
    assert overlapped, "the step was never seen running"

"""Ranks from PyTorch (issue 16 items 5, 7, 8, 9), on gloo processes with
hard timeouts (ranks_worker.py):

* opt.clip_grad_norm_ at 2 ranks returns the norm torch computes on the
  all-reduced (mean) gradients, and the params equal torch's clip + AdamW
  on them, with and without grad_streaming; torch's clipper on a rank's own
  gradients warns; a rank with another lr fails naming the setting.
* A DistributedDataParallel wrapper kept around the model: no deadlock, a
  warning saying to unwrap, the params bit-identical to one process.
* A peer killed mid-step (several jobs) or stalled: the survivors' step
  fails within the timeout naming the rank, and they exit with the error
  (exit status 3), never SIGABRT.
* In one process: clip_grad_norm_ against torch at several max_norms, its
  refusals, and the timeout argument's checks."""
import os
import sys

import pytest
import torch

import zopt
from ranks_worker import LR, MAX_NORMS, STEPS, WD, batch, loss_of, model_of
from test_comm import _free_port, _run_all, _runtime_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ranks_worker.py")


def _z2_clip(steps):
    return steps.text(zopt.steps.adamw.text(clip=1.0, zero_stage=2, comments=False))


def _run(mode, world, so, tmp_path, timeout=120):
    port = _free_port()
    cmds = [[sys.executable, WORKER, mode, str(r), str(world), str(port), str(tmp_path), so]
            for r in range(world)]
    procs, outs = _run_all(cmds, timeout=timeout, env=_runtime_env())
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    return outs


def _grads_mean(model, s, world):
    """The all-reduced gradients DDP would leave in p.grad: the mean of the
    ranks' gradients (f32 sum in rank order, then / world)."""
    total = None
    for r in range(world):
        model.zero_grad(set_to_none=True)
        loss_of(model, s, r).backward()
        g = [p.grad.clone() for p in model.parameters()]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    for p, g in zip(model.parameters(), total):
        p.grad = g / world


def test_clip_grad_norm_two_gloo_ranks(steps, tmp_path):
    so = _z2_clip(steps).path
    outs = _run("clip", 2, so, tmp_path)
    assert "ok a per-rank clipper warns once" in outs[0] + outs[1]
    assert all("ok disagreement names the setting" in o for o in outs), outs
    # torch: clip_grad_norm_ on the all-reduced gradients, then AdamW
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for s in range(STEPS):
        _grads_mean(model, s, 2)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORMS[s])))
        opt.step()
    ref = [p.detach() for p in model.parameters()]
    got = [torch.load(os.path.join(tmp_path, f"clip_rank{r}.pt")) for r in range(2)]
    for r in range(2):
        for stream in (False, True):
            g = got[r][stream]
            for s, (a, b) in enumerate(zip(g["norms"], norms)):
                assert abs(a - b) <= 1e-5 * b, (r, stream, s, a, b)
            for i, (a, b) in enumerate(zip(g["params"], ref)):
                err = (a - b).abs().max().item()
                assert err <= 2e-6, f"rank {r} stream {stream}: param {i} off by {err}"
            # streamed and not: the same step, bit for bit
            assert g["norms"] == got[r][False]["norms"]
            assert all(torch.equal(a, b) for a, b in zip(g["params"], got[r][False]["params"]))
    # the clip was active at steps 0 and 2 and not at step 1
    assert norms[0] > MAX_NORMS[0] and norms[2] > MAX_NORMS[2] and norms[1] < MAX_NORMS[1]


def test_ddp_wrapper_two_gloo_ranks(steps, tmp_path):
    step = _z2_clip(steps)
    _run("ddp", 2, step.path, tmp_path)
    # one process on the rank-order sum of the two ranks' gradients, divisor 2
    torch.set_num_threads(1)
    model = model_of(big=True)
    opt = zopt.Optimizer(step, model.parameters(), lr=LR, weight_decay=WD, grad_divisor=2,
                         bucket_elems=32768)
    norms = []
    for s in range(STEPS):
        total = None
        for r in range(2):
            opt.zero_grad(set_to_none=True)
            loss_of(model, s, r, big=True).backward()
            g = [p.grad.clone() for p in model.parameters()]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for p, g in zip(model.parameters(), total):
            p.grad = g
        opt.step()
        norms.append(opt.last_grad_norm)
    for r in range(2):
        got = torch.load(os.path.join(tmp_path, f"ddp_rank{r}.pt"))
        for stream in (False, True):
            assert got[stream]["norms"] == norms, (r, stream)
            for i, (a, b) in enumerate(zip(got[stream]["params"], model.parameters())):
                assert torch.equal(a, b.detach()), f"rank {r} stream {stream}: param {i}"


def test_dead_and_stalled_peers_named_and_clean_exit(steps, tmp_path):
    reps = 6
    so = steps.text(zopt.steps.adamw.text(zero_stage=2, comments=False)).path
    port = _free_port()
    procs, outs = _run_all([[sys.executable, WORKER, "faults", str(port), str(tmp_path), so,
                             str(reps)]], timeout=120, env=_runtime_env())
    out = outs[0]
    assert procs[0].returncode == 0 and "DONE faults" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("SURVIVOR")]
    assert len(lines) == 2 * reps + 2, out
    for ln in lines:
        # the interpreter's own exit with the error's status: never SIGABRT
        assert "exit 3 signal 0 after" in ln, ln
        assert "rank 2 did not answer within" in ln, ln
        took = float(ln.split(" after ")[1].split()[0])
        # timeout=2: a dead peer fails at once, a stalled one after the
        # timeout; plus the liveness window (0.5 s) and slack for 2 cores
        assert took < (2.0 if ln.startswith("SURVIVOR dead") else 4.0), ln


# ---- one process -------------------------------------------------------------------

def test_clip_grad_norm_one_rank_against_torch(steps):
    torch.set_num_threads(1)
    step = steps.text(zopt.steps.adamw.text(clip=1.0, comments=False))
    m1, m2 = model_of(), model_of()
    o1 = zopt.Optimizer(step, m1.parameters(), lr=LR, weight_decay=WD)
    o2 = torch.optim.AdamW(m2.parameters(), lr=LR, weight_decay=WD)
    for s, mn in enumerate([0.05, 100.0, 0.3, 3.0, 0.01]):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            loss_of(m, s, 0).backward()
        n1 = o1.clip_grad_norm_(mn)
        n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), mn)
        assert n1.shape == () and n1.dtype == torch.float32
        assert abs(float(n1) - float(n2)) <= 1e-6 * float(n2)
        with pytest.raises(zopt.ZoptError, match="call step\\(\\) first"):
            o1.state_dict()  # nothing between the clip and the step
        with pytest.raises(zopt.ZoptError, match="call step\\(\\) first"):
            o1.state[next(m1.parameters())]["exp_avg"]  # opt.state[p] neither
        with pytest.raises(zopt.ZoptError, match="called already"):
            o1.clip_grad_norm_(mn)
        with pytest.raises(zopt.ZoptError, match="zero_grad"):
            o1.zero_grad()  # the begun step reads the gradients
        o1.step()
        o2.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert (a - b).abs().max().item() <= 1e-6
    # the compiled max_norm again at a step without clip_grad_norm_
    h = o1._h
    import ctypes
    v = ctypes.c_double()
    zopt._lib.lib().zopt_optimizer_get_max_norm(h, ctypes.byref(v))
    assert v.value == 1.0
    # refusals
    with pytest.raises(ValueError, match="norm_type"):
        o1.clip_grad_norm_(1.0, norm_type=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        o1.clip_grad_norm_(-1.0)
    noclip = zopt.Optimizer(steps.text(zopt.steps.adamw.text(comments=False)), model_of().parameters())
    with pytest.raises(zopt.ZoptError, match="compiled without global-norm clipping"):
        noclip.clip_grad_norm_(1.0)
    # step(closure) after a clip; then the step still finishes
    o1.zero_grad()
    loss_of(m1, 9, 0).backward()
    o1.clip_grad_norm_(1.0)
    with pytest.raises(zopt.ZoptError, match="without a closure"):
        o1.step(lambda: 0.0)
    o1.step()
    # a non-finite norm with error_if_nonfinite: torch's RuntimeError, no change
    before = [p.detach().clone() for p in m1.parameters()]
    o1.zero_grad()
    loss_of(m1, 10, 0).backward()
    next(m1.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        o1.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, m1.parameters()))
    assert o1.last_skipped


def test_clip_grad_norm_mixed_classes(steps):
    """A step per dtype (bf16 and f32 params): one norm over both classes."""
    torch.set_num_threads(1)
    texts = zopt.steps.adamw.text(clip=1.0, comments=False,
                                  classes={"bf16": dict(master="f32"), "f32": {}})
    mapping = {c: steps.text(t) for c, t in texts.items()}
    model = model_of()
    model[0].to(torch.bfloat16)
    opt = zopt.Optimizer(mapping, model.parameters(), lr=LR)
    x, y = batch(0, 0)
    loss = torch.nn.functional.mse_loss(model[2](torch.tanh(model[0](x.bfloat16())).float()), y)
    loss.backward()
    want = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
    n = opt.clip_grad_norm_(0.1)
    assert abs(float(n) - float(want)) <= 1e-5 * float(want)
    opt.step()
    assert float(n) == float(torch.tensor(opt.last_grad_norm, dtype=torch.float32))


def test_timeout_argument_checked(steps):
    step = steps.text(zopt.steps.adamw.text(comments=False))
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="timeout"):
        zopt.Optimizer(step, p, timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        zopt.Optimizer(step, p, timeout=float("nan"))
    with pytest.raises(TypeError, match="timeout"):
        zopt.Optimizer(step, p, timeout="10")

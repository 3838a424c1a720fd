"""Params back early (``zopt.Optimizer(..., overlap=True, model=model)``;
zopt/_early.py, docs/USAGE.md section 5, docs/GPU.md "Params back early").

The stand-in driver test (libzopt-fake-cuda.so: the real offload backend,
device memory in host memory, copies queued on stream workers) trains a
small model 4 steps with early params: the runtime in per-bucket mode, each
module's forward pre-hook waiting on torch's current stream for its own
params' buckets. Every host-to-device copy takes 10 ms on the stand-in
(fake_cuda_set_htod_delay), and a later pre-hook synchronizes the current
stream before the module reads its params (as a kernel enqueued after the
waits): a module that read params whose bucket it did not wait for would
read the last step's values, and the model would train differently. The
losses, params and states equal those of the serial offloaded step (no
overlap, the default mode) and of the all-CPU twin bit for bit; the hooks
waited for each bucket once per step (a param no module owns: at step());
``opt.wait_params()`` makes the current stream wait for every bucket left.
"""
import contextlib
import ctypes
import os
import sys

import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError
import overlap_fakes as of
from gpu_fakes import REPO, needs_fake, run_worker

STEP = "examples/adamw_zero_offload.mlir"  # bf16 params/grads, f32 master and moments, clip 1.0


@pytest.fixture
def six_byte(steps):
    with open(os.path.join(REPO, STEP)) as fh:
        text = fh.read()
    twin = text.replace(" on gpu", " on cpu").replace(', gpu_arch = "sm_90"', "")
    return steps.text(text), steps.text(twin)


@needs_fake
def test_early_params_bit_identical_waits_once_per_bucket(six_byte, tmp_path):
    off, cpu = six_byte
    out = run_worker(__file__, cpu.path, off.path, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1")
    assert out["mode"] == [1, 0, 0], out          # per bucket; default without model / opted out
    assert out["nb"] >= 3
    assert out["same"] == [True] * 4, out
    assert out["losses_same"] == [True] * 5, out
    # each step: every bucket waited for once (the hooks, the unowned at step())
    assert out["waits"] == [list(range(out["nb"]))] * 4, out
    assert out["outside"] and set(out["outside"]) <= set(range(out["nb"]))
    assert out["wait_all_same"], out  # opt.wait_params() then the stream: every new param
    assert out["refusals"] == ["not_a_module"], out
    assert out["bad_ranges"] == 0


@needs_fake
def test_early_params_state_dict_right_after_step_joins_the_tail(six_byte, tmp_path):
    """Per-bucket mode: step() returns while the step's tail (commit or
    recompute, params back per bucket) is held on the pipeline thread (every
    param copy back stalled in its call, released by a timer); the model's
    state_dict() right after it waits for the tail (a checkpoint of the
    model holds this step's params), and the optimizer's state_dict() waits
    for it too and equals the serial offloaded step's
    and the CPU twin's, bit for bit, every step (clipping inactive and
    active)."""
    off, cpu = six_byte
    out = run_worker(__file__, cpu.path, off.path, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1",
                     ZOPT_TEST_TAIL="1")
    assert out["returned_early"] == [True] * 3, out
    assert out["model_joined"] == [True] * 3, out
    assert out["joined"] == [True] * 3, out
    assert out["same"] == [True] * 3, out
    assert out["bad_ranges"] == 0


def test_early_params_options_refused(steps):
    """model= / early_params= belong to overlap=True; early_params=True needs
    a model; a bad early_params value."""
    st = steps(rule="adamw", layout="f32")
    p = [torch.nn.Parameter(torch.randn(8))]
    m = torch.nn.Linear(2, 2)
    for kw in (dict(model=m), dict(early_params=True), dict(overlap=True, early_params=True),
               dict(overlap=True, model=m, early_params="yes")):
        with pytest.raises(ZoptError) as e:
            zopt.Optimizer(st, p, **kw)
        assert e.value.code == Status.INVALID_ARGUMENT, kw
        assert "early_params" in str(e.value) or "model=" in str(e.value)


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

class Layer(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(b)

    def forward(self, x):
        return x @ self.weight.float().t() + self.bias.float()


class Net(torch.nn.Module):
    def __init__(self, ts):
        super().__init__()
        self.l1 = Layer(ts[0], ts[1])
        self.l2 = Layer(ts[2], ts[3])

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _worker(cpu_path, off_path, tmp):
    shapes = of.SHAPES + [(16,)]  # the last: no module owns it
    s, fake, dev, g, init = of.start(shapes)
    A = [dev(sh, w) for sh, w in zip(shapes, init)]           # early params
    B = [dev(sh, w) for sh, w in zip(shapes, init)]           # serial offloaded
    C = [w.clone() for w in init]                             # the CPU twin
    nets = [Net(X[:4]) for X in (A, B, C)]
    extra = [torch.nn.Parameter(X[4]) for X in (A, B, C)]
    # the unowned param first: in the last bucket, copied first (waiting for it at step()
    # leaves the rest to the hooks)
    params = [[e] + list(n.parameters()) for n, e in zip(nets, extra)]
    keep = []
    of.grads_to_device(params[0] + params[1], dev, keep)

    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    off, cpu = zopt.Step(off_path), zopt.Step(cpu_path)
    sa, sb = s.cur["s"], s.stream()  # A's and B's torch streams

    @contextlib.contextmanager
    def on(stream):
        old, s.cur["s"] = s.cur["s"], stream
        try:
            yield
        finally:
            s.cur["s"] = old
    opt_a = zopt.Optimizer(off, params[0], overlap=True, model=nets[0], **kw)
    with on(sb):
        opt_b = zopt.Optimizer(off, params[1], **kw)
    opt_c = zopt.Optimizer(cpu, params[2], **kw)

    def sync_current(module, _args):  # a kernel after the waits: it reads when the stream does
        assert fake.cuStreamSynchronize(ctypes.c_void_p(s.cur["s"])) == 0
    for m in nets[0].modules():  # after the optimizer's own pre-hooks
        m.register_forward_pre_hook(sync_current)
    ov = opt_a._overlap
    mode = ctypes.c_int()

    def mode_of(o):
        assert o._lib.zopt_optimizer_get_param_wait(o._parts[0].h, ctypes.byref(mode)) == 0
        return mode.value
    out = {"nb": ov.nb, "same": [], "losses_same": [], "outside": ov.early._outside}
    plain = zopt.Optimizer(off, [torch.nn.Parameter(dev((8,), torch.ones(8)))], overlap=True)
    opted_out = zopt.Optimizer(off, [torch.nn.Parameter(dev((8,), torch.ones(8)))],
                               overlap=True, model=torch.nn.Linear(1, 1), early_params=False)
    out["mode"] = [mode_of(opt_a), mode_of(plain), mode_of(opted_out)]
    plain.close()
    opted_out.close()

    fake.fake_cuda_set_htod_delay(10000)  # 10 ms per copy back: still running at the forward

    def loss_of(k, x):
        y = nets[k](x)
        return (y * extra[k].float()).square().mean()

    for it in range(5):
        x = torch.randn(8, 32, generator=g)
        opt_a.zero_grad(set_to_none=True)
        with on(sb):
            opt_b.zero_grad(set_to_none=True)
        opt_c.zero_grad(set_to_none=True)
        la = loss_of(0, x)  # A: the hooks wait per bucket; nothing drained since the step
        fake.fake_cuda_drain_all()  # B: every copy done
        lb, lc = loss_of(1, x), loss_of(2, x)
        out["losses_same"].append(bool(torch.equal(la, lb) and torch.equal(la, lc)))
        if it:
            with on(sb):
                stb = opt_b.state_dict()["state"]
            sta, stc = opt_a.state_dict()["state"], opt_c.state_dict()["state"]
            same = all(of.equal(p, q) and of.equal(p, r) for p, q, r in zip(*params))
            same = same and sorted(sta) == sorted(stb) == sorted(stc) and all(
                torch.equal(sta[i][key], stb[i][key]) and torch.equal(sta[i][key], stc[i][key])
                for i in sta for key in sta[i])
            out["same"].append(bool(same))
        if it == 4:
            break
        for loss in (la, lb, lc):
            loss.backward()
        opt_a.step()
        with on(sb):
            opt_b.step()
        opt_c.step()
        if it == 3:  # opt.wait_params(): every bucket, before reading params outside a forward
            opt_a.wait_params()
            assert fake.cuStreamSynchronize(ctypes.c_void_p(sa)) == 0
            seen = [p.detach().clone() for p in params[0]]
            fake.fake_cuda_drain_all()
            out["wait_all_same"] = all(of.equal(p, q) for p, q in zip(seen, params[1]))
    out["waits"] = [sorted(w) for w in ov.early.waits[-4:]]
    assert all(len(w) == len(set(w)) for w in ov.early.waits), ov.early.waits  # once each
    fake.fake_cuda_set_htod_delay(0)

    refusals = []
    try:
        zopt.Optimizer(off, [torch.nn.Parameter(dev((8,), torch.ones(8)))], overlap=True,
                       model=[1, 2])
    except ZoptError as e:
        if e.code == Status.INVALID_ARGUMENT and "torch.nn.Module" in str(e):
            refusals.append("not_a_module")
    out["refusals"] = refusals
    of.finish(s, out, opt_a, opt_b, opt_c)


def _tail_worker(cpu_path, off_path, tmp):
    import threading
    s, fake, dev, g, init = of.start()
    A = [dev(sh, w) for sh, w in zip(of.SHAPES, init)]   # per bucket (model=)
    B = [dev(sh, w) for sh, w in zip(of.SHAPES, init)]   # serial offloaded
    C = [w.clone() for w in init]                        # the CPU twin
    nets = [Net(X) for X in (A, B, C)]
    params = [list(n.parameters()) for n in nets]
    keep = []
    of.grads_to_device(params[0] + params[1], dev, keep)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    off, cpu = zopt.Step(off_path), zopt.Step(cpu_path)
    opt_a = zopt.Optimizer(off, params[0], overlap=True, model=nets[0], **kw)
    opt_b = zopt.Optimizer(off, params[1], **kw)
    opt_c = zopt.Optimizer(cpu, params[2], **kw)
    lo = min(p.data_ptr() for p in params[0])
    hi = max(p.data_ptr() + p.numel() * p.element_size() for p in params[0])
    fake.fake_cuda_stall_htod.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    out = {"returned_early": [], "model_joined": [], "joined": [], "same": []}
    for it in range(3):
        x = torch.randn(8, 32, generator=g) * (1.0 if it != 1 else 40.0)  # step 2 clips
        for k, o in enumerate((opt_a, opt_b, opt_c)):
            o.zero_grad(set_to_none=True)
            nets[k](x).square().mean().backward()
        fake.fake_cuda_stall_htod(lo, hi)  # the tail's first copy back waits in its call
        released = threading.Event()

        def release():
            released.set()
            fake.fake_cuda_release_htod()
        timer = threading.Timer(0.3, release)
        timer.start()
        opt_a.step()
        out["returned_early"].append(not released.is_set())
        nets[0].state_dict()  # the model's: its state-dict hook joins the tail
        out["model_joined"].append(released.is_set())
        sta = opt_a.state_dict()["state"]  # joins the tail: after the release
        out["joined"].append(released.is_set())
        timer.join()
        opt_b.step()
        opt_c.step()
        stb, stc = opt_b.state_dict()["state"], opt_c.state_dict()["state"]
        fake.fake_cuda_drain_all()
        same = all(of.equal(p, q) and of.equal(p, r) for p, q, r in zip(*params))
        same = same and sorted(sta) == sorted(stb) == sorted(stc) and all(
            torch.equal(sta[i][key], stb[i][key]) and torch.equal(sta[i][key], stc[i][key])
            for i in sta for key in sta[i])
        out["same"].append(bool(same))
    of.finish(s, out, opt_a, opt_b, opt_c)


if __name__ == "__main__":
    (_tail_worker if os.environ.get("ZOPT_TEST_TAIL") else _worker)(sys.argv[1], sys.argv[2], sys.argv[3])

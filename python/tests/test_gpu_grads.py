"""A GPU step reads torch's gradients in place (docs/USAGE.md section 3,
"Gradient memory"; docs/GPU.md "Tensor memory"), without a GPU:

- Recording tests (gpu_fakes.make_gpu_env: a CPU step posing as a GPU
  step over params marked CUDA), on both implementations of the per-step
  pass: a fresh ``p.grad`` at every step (torch 2's ``zero_grad``
  default) is handed to the runtime in place, one
  ``zopt_optimizer_set_grad_memory`` call per step and no copy into the
  optimizer's own gradient memory, with torch.optim.AdamW's numbers; the
  same inside a CUDA graph capture (the runtime writes the device's table
  by value into the graph: nothing is refused).
- Stand-in driver test (libzopt-fake-cuda.so with ZOPT_FAKE_CUDA_TWIN: the
  real CUDA backend, its kernels run on the CPU twin's): fresh gradient
  tensors in "device" memory every step, read in place (the runtime's
  pointer table rewritten), give the bits of the same description's CPU
  step and torch's numbers.
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError
from gpu_fakes import (REPO, StandIn, cuda_params, device_tensors, grads_on_device, needs_fake,
                       needs_toolkit, run_worker, same_as_twin_close_to_torch)

LR, WD = 1e-2, 0.1
OFFLOAD_SIZES = [33, 1000, 5000]


def _params(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5 + 7 * i, generator=g)) for i in range(n)]


def _grads(ps, k):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(p.shape, generator=g) * 0.1 for p in ps]


def _close(a, b):
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=2e-5, atol=1e-6)


def _own_grads_untouched(opt):
    """The optimizer's own gradient buffers were never written (nothing
    was copied into them): still all zero."""
    return all(not f.any() for c in opt._parts for f in c.grad_flats)


@pytest.mark.parametrize("where,capture", [("gpu", False), ("gpu", True), ("offload", False)])
def test_gpu_step_reads_fresh_grads_in_place(steps, gpu_env, scan_impl, where, capture):
    """torch 2's zero_grad (p.grad None) then a new p.grad per param each
    step, on a GPU step and on an offloaded one (whose copies to the host
    read the registered gradient): one set_grad_memory call per step
    handing the runtime every new gradient's address (also while torch's
    stream captures a CUDA graph: the runtime records the table's new
    entries into the graph; offloaded steps are refused there), nothing
    copied into the optimizer's own memory, torch.optim.AdamW's numbers."""
    fc, rec, mode = gpu_env
    mode(where)
    ps = _params()
    ts = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(ts, lr=LR, weight_decay=WD, foreach=False)
    assert opt._parts[0].grad_zero_copy
    n0 = len(rec.calls("zopt_optimizer_set_grad_memory"))
    held = []  # the last step's gradients kept alive: the new ones get other addresses
    for k in range(4):
        held.append([p.grad for p in ps])
        opt.zero_grad(set_to_none=True)
        ot.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in ps)
        gs = _grads(ps, k)
        for p, q, g in zip(ps, ts, gs):
            p.grad, q.grad = g.clone(), g.clone()
        fc.capturing = capture and k >= 2  # after two warm-up steps, as torch.cuda.graph wants
        opt.step()
        ot.step()
        fc.capturing = False
        calls = rec.calls("zopt_optimizer_set_grad_memory")[n0:]
        assert len(calls) == k + 1
        name, _, _, capturing, args = calls[-1]
        n, tids, ptrs = args[1], args[2], args[3]
        assert n == len(ps) and capturing == (capture and k >= 2)
        assert list(np.frombuffer(tids, np.int32)) == list(range(len(ps)))
        assert list(np.frombuffer(ptrs, np.uint64)) == [p.grad.data_ptr() for p in ps]
        _close(ps, ts)
    assert _own_grads_untouched(opt)
    assert opt._parts[0].scan.in_place() == {t: p.grad.data_ptr() for t, p in enumerate(ps)}
    # The same gradients again: nothing handed over, nothing copied.
    n1 = len(rec.calls("zopt_optimizer_set_grad_memory"))
    opt.step()
    ot.step()
    assert len(rec.calls("zopt_optimizer_set_grad_memory")) == n1 and _own_grads_untouched(opt)
    _close(ps, ts)


def test_gpu_step_copies_what_it_cannot_read_in_place(steps, gpu_env, scan_impl):
    """The CPU step's rules on a GPU step: a gradient with other strides
    than its param is copied into the optimizer's memory (and the runtime
    reads that again), the others stay in place; torch's numbers."""
    fc, rec, mode = gpu_env
    mode("gpu")
    g0 = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(4, 6, generator=g0)) for _ in range(2)]
    ts = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = zopt.Optimizer(steps(rule="adamw", layout="f32"), ps, lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(ts, lr=LR, weight_decay=WD, foreach=False)
    for k in range(3):
        gs = _grads(ps, k)
        ps[0].grad = gs[0].clone()
        ps[1].grad = gs[1].t().contiguous().t()  # column-major: not the param's layout
        for q, g in zip(ts, gs):
            q.grad = g.clone()
        opt.step()
        ot.step()
        _close(ps, ts)
    c = opt._parts[0]
    assert c.scan.in_place() == {0: ps[0].grad.data_ptr()}
    assert not _own_grads_untouched(opt)  # param 1's gradient was copied


@pytest.mark.parametrize("where", ["gpu", "offload"])
def test_gpu_step_reads_a_frameworks_main_grad_in_place(steps, gpu_env, where):
    """f32 gradients of bf16 params on a GPU or offloaded step: a
    framework's new p.main_grad each step is handed to the runtime where it
    is (one set_grad_memory per step naming every param's), never copied
    into the optimizer's buffer; the update is the float64 one (plain SGD:
    w - lr * g, g exact in f32)."""
    from zopt import steps as S
    fc, rec, mode = gpu_env
    mode(where)
    st = steps.text(S.sgd.text(param="bf16", grad="f32", master="f32", momentum=0,
                               comments=False))
    ps = [torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16)) for _ in range(3)]
    opt = zopt.Optimizer(st, ps, lr=1.0, grad_accumulation="manual")
    c = opt._parts[0]
    assert not c.main_copied
    held, w = [], [1.0, 1.0, 1.0]
    for k, v in enumerate((0.25, 0.5, -0.125)):
        mgs = [torch.full((4, 3), v * (i + 1)) for i in range(3)]
        held.append(mgs)  # the last ones kept alive: each new one at another address
        for p, mg in zip(ps, mgs):
            p.main_grad = mg
        n0 = len(rec.calls("zopt_optimizer_set_grad_memory"))
        opt.step()
        w = [x - v * (i + 1) for i, x in enumerate(w)]
        calls = rec.calls("zopt_optimizer_set_grad_memory")[n0:]
        assert len(calls) == 1 and calls[0][4][1] == 3
        assert all(c.foreign[t] == (mg, mg.data_ptr()) for t, mg in enumerate(mgs))
        for p, x in zip(ps, w):
            assert torch.equal(p.detach().float(), torch.full((4, 3), x))
    assert not any(f.any() for f in c.grad_flats)  # the optimizer's buffer never written


def test_main_grad_refused_changes_nothing(steps, gpu_env):
    """A main_grad the runtime refuses (here: any registration naming
    param 1 fails) leaves every registration (param 0's too), the mask and
    the params as they were, and the next step looks at every main_grad
    again."""
    from zopt import steps as S
    fc, rec, mode = gpu_env
    mode("offload")
    st = steps.text(S.sgd.text(param="bf16", grad="f32", master="f32", momentum=0,
                               comments=False))
    ps = [torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16)) for _ in range(2)]
    opt = zopt.Optimizer(st, ps, lr=1.0, grad_accumulation="manual")
    c = opt._parts[0]
    mgs = [torch.full((4, 3), 0.25), torch.full((4, 3), 0.5)]
    for p, mg in zip(ps, mgs):
        p.main_grad = mg
    real = c.set_grad_memory

    def failing(tids, ptrs, what=""):
        if 1 in tids:
            raise ZoptError(Status.INVALID_ARGUMENT, "refused (test)")
        return real(tids, ptrs, what)
    c.set_grad_memory = failing
    with pytest.raises(ZoptError, match="refused"):
        opt.step()
    assert c.foreign == {} and bytes(c.active) == c.pushed
    assert all(torch.equal(p.detach().float(), torch.ones(4, 3)) for p in ps)
    c.set_grad_memory = real
    opt.step()
    assert all(c.foreign[t] == (mg, mg.data_ptr()) for t, mg in enumerate(mgs))
    assert torch.equal(ps[0].detach().float(), torch.full((4, 3), 0.75))
    assert torch.equal(ps[1].detach().float(), torch.full((4, 3), 0.5))


@needs_fake
@needs_toolkit
def test_stand_in_twin_fresh_device_grads_read_in_place(steps, tmp_path):
    """The real CUDA backend on the stand-in driver, its kernels run on the
    CPU twin's: new gradient tensors in device memory at every step are
    read in place (one set_grad_memory per step, the runtime's table
    rewritten, the optimizer's own buffers never written) and give the
    bits of the same description's CPU step and torch's numbers."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    cpu = steps(rule="adamw", layout="f32")
    out = run_worker(__file__, "fresh", st.path + os.pathsep + cpu.path, tmp_path,
                     ZOPT_FAKE_CUDA_TWIN=cpu.path)
    assert out["same_as_cpu"] == [True] * 5
    assert out["close_to_torch"] == [True] * 5
    assert out["handed"] == [3] * 5 and out["in_place"] and out["own_untouched"]
    assert out["bad_ranges"] == 0


@needs_fake
@needs_toolkit
def test_stand_in_twin_moved_param_storage_in_place(steps, tmp_path):
    """p.data = new device storage on the real CUDA backend (stand-in, the
    kernels on the CPU twin's): registered in place (one
    zopt_optimizer_set_tensor_memory, the same native optimizer, no
    export), then trained on bit for bit as the CPU step whose param was
    written in place instead."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    cpu = steps(rule="adamw", layout="f32")
    out = run_worker(__file__, "moved", st.path + os.pathsep + cpu.path, tmp_path,
                     ZOPT_FAKE_CUDA_TWIN=cpu.path)
    assert out["same_as_cpu"] == [True] * 5
    assert out["set_tensor_memory"] == 1 and out["same_native"] and not out["exported"]
    assert out["bad_ranges"] == 0


def _offload_pair(steps, layout):
    """An offloaded step and its all-CPU twin (the same update with every
    state on the CPU): DeepSpeed #8010's 6-byte cell (the example; its
    twin, bench/adamw_bf16_6b_cpu.mlir, updates the bf16 param in place,
    as the offloaded step its bf16 master), or bf16 params with f32
    gradients (p.main_grad) and an f32 master."""
    from zopt import steps as S
    if layout == "6b":
        texts = []
        for f in ("examples/adamw_bf16_offload_6b.mlir", "bench/adamw_bf16_6b_cpu.mlir"):
            with open(os.path.join(REPO, f)) as fh:
                texts.append(fh.read())
        return steps.text(texts[0]), steps.text(texts[1])
    kw = dict(param="bf16", grad="f32", master="f32", clip=1.0, comments=False)
    return (steps.text(S.adamw.text(placement="offload", **kw)),
            steps.text(S.adamw.text(**kw)))


@needs_fake
@pytest.mark.parametrize("layout", ["6b", "f32grad"])
@pytest.mark.parametrize("stress", [False, True])
def test_stand_in_offload_fresh_device_grads_read_in_place(steps, tmp_path, layout, stress):
    """An offloaded step (the real offload backend on the stand-in driver:
    params and grads in device memory, the update on the CPU) given new
    gradient tensors in device memory at every step (p.grad of the 6-byte
    cell; p.main_grad of the f32-gradient layout): one set_grad_memory per
    step naming every param, the optimizer's own gradient buffers never
    written, the params and states bit-identical to the all-CPU twin's at
    every step, and step_stats' bytes those of the copies. The previous
    step's gradients are overwritten with NaN before each step: the copy
    to the host reads the new ones. With the stand-in's asynchrony and
    random delays too (ZOPT_FAKE_CUDA_ASYNC/STRESS)."""
    off, cpu = _offload_pair(steps, layout)
    env = dict(ZOPT_FAKE_CUDA_ASYNC="1", ZOPT_FAKE_CUDA_STRESS="300") if stress else {}
    out = run_worker(__file__, "offload-" + layout, off.path + os.pathsep + cpu.path,
                     tmp_path, **env)
    n = sum(OFFLOAD_SIZES)
    gbytes = 2 if layout == "6b" else 4
    assert out["same_as_cpu"] == [True] * 5
    assert out["handed"] == [3] * 5 and out["calls"] == [1] * 5
    assert out["in_place"] and out["own_untouched"] and out["finite"]
    # bf16 or f32 grads to the host (a master: the params are not read), bf16 params back
    assert out["bytes"] == [[gbytes * n, 2 * n]] * 5
    assert out["bad_ranges"] == 0


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

_real_device_grads = zopt._params.device_grads
_real_alloc_grads = zopt._grads.alloc_grads


def _worker(what, step_path, tmp):
    s = StandIn()
    s.grads_on_device()
    fake, dev_array = s.fake, s.dev_array
    # The stand-in's device memory is wrapped in CPU tensors: say it is
    # CUDA memory the kernels read (zopt._params.device_grads).
    zopt._params.device_grads = lambda ents: True
    rng = np.random.default_rng(0)
    sizes = [33, 1000, 5000]
    out = {}
    gpu_path, cpu_path = step_path.split(os.pathsep)
    if what == "moved":
        _moved_worker(s, gpu_path, cpu_path, out)
        print(json.dumps(out))
        return
    if what.startswith("offload-"):
        _offload_worker(s, what[len("offload-"):], gpu_path, cpu_path, out)
        print(json.dumps(out))
        return
    assert what == "fresh"
    init = [rng.standard_normal(n) for n in sizes]
    ps = [torch.nn.Parameter(torch.from_numpy(dev_array(n, w))) for n, w in zip(sizes, init)]
    hs = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in init]
    ts = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in init]
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = zopt.Optimizer(zopt.Step(gpu_path), ps, **kw)
    cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)
    ot = torch.optim.AdamW(ts, foreach=False, **kw)
    c = opt._parts[0]
    handed = []
    real = c.set_grad_memory_packed

    def counted(tids, ptrs):
        handed.append(len(tids) // 4)
        return real(tids, ptrs)
    c.set_grad_memory_packed = counted
    g = np.random.default_rng(1)
    out["same_as_cpu"], out["close_to_torch"] = [], []
    for k in range(5):
        for o in (opt, cpu, ot):
            o.zero_grad(set_to_none=True)
        for p, h, q in zip(ps, hs, ts):
            x = (g.standard_normal(p.numel()) * 0.1).astype(np.float32)
            p.grad = torch.from_numpy(dev_array(p.numel(), x))  # fresh device memory
            h.grad, q.grad = torch.from_numpy(x.copy()), torch.from_numpy(x.copy())
        for o in (opt, cpu, ot):
            o.step()
        same, close, _ = same_as_twin_close_to_torch(opt, cpu, ps, hs, ts)
        out["same_as_cpu"].append(bool(same))
        out["close_to_torch"].append(bool(close))
    out["handed"] = handed
    out["in_place"] = c.scan.in_place() == {t: p.grad.data_ptr() for t, p in enumerate(ps)}
    out["own_untouched"] = all(not f.any() for f in c.grad_flats)
    fake.fake_cuda_drain_all()
    opt.close()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()
    print(json.dumps(out))


def _moved_worker(s, gpu_path, cpu_path, out):
    fake, dev_array = s.fake, s.dev_array
    rng = np.random.default_rng(2)
    sizes = [33, 1000, 5000]
    init = [rng.standard_normal(n) for n in sizes]
    ps = [torch.nn.Parameter(torch.from_numpy(dev_array(n, w))) for n, w in zip(sizes, init)]
    hs = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in init]
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = zopt.Optimizer(zopt.Step(gpu_path), ps, **kw)
    cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)
    c = opt._parts[0]
    h0 = c.h.value
    calls = []
    real_lib = c.lib

    class Counting:
        def __getattr__(self, name):
            f = getattr(real_lib, name)
            if name == "zopt_optimizer_set_tensor_memory":
                def counted(*a):
                    calls.append(name)
                    return f(*a)
                return counted
            return f
    c.lib = Counting()
    exported = []
    real_snapshot = zopt._rebuild.snapshot
    zopt._rebuild.snapshot = lambda part: exported.append(1) or real_snapshot(part)
    g = np.random.default_rng(3)
    out["same_as_cpu"] = []
    for k in range(5):
        if k == 2:  # new device storage for param 1, twice the values; the twin's in place
            x = ps[1].detach().numpy() * 2
            ps[1].data = torch.from_numpy(dev_array(ps[1].numel(), x))
            with torch.no_grad():
                hs[1].mul_(2)
        for p, h in zip(ps, hs):
            x = (g.standard_normal(p.numel()) * 0.1).astype(np.float32)
            p.grad, h.grad = torch.from_numpy(dev_array(p.numel(), x)), torch.from_numpy(x.copy())
        opt.step()
        cpu.step()
        opt.step_count()  # waits for the step
        out["same_as_cpu"].append(all(torch.equal(p, h) for p, h in zip(ps, hs)))
    out["set_tensor_memory"] = len(calls)
    out["same_native"] = c.h.value == h0
    out["exported"] = bool(exported)
    fake.fake_cuda_drain_all()
    opt.close()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()


def _offload_worker(s, layout, off_path, cpu_path, out):
    fake = s.fake
    # The stand-in's device memory is wrapped in CPU tensors: mark the
    # params CUDA params, as torch's would be (zopt._params.device_grads
    # then holds; no sampling of device memory for the write checks).
    zopt._params.device_grads = _real_device_grads
    cuda_params()  # (not the CPU twin's; the stand-in has one context)
    device_tensor = device_tensors(fake)

    def dev(n, dtype, fill=None):  # a torch tensor over stand-in device memory
        return device_tensor((n,), fill, dtype)
    # Our own gradient buffers in device memory, in the step's dtype (not
    # the f32 ones of s.grads_on_device).
    zopt._grads.alloc_grads = _real_alloc_grads
    grads_on_device(device_tensor)
    main = layout == "f32grad"
    rng = np.random.default_rng(4)
    init = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16()
            for n in OFFLOAD_SIZES]
    ps = [torch.nn.Parameter(dev(w.numel(), torch.bfloat16, w)) for w in init]
    hs = [torch.nn.Parameter(w.clone()) for w in init]
    kw = dict(lr=1e-2, weight_decay=0.1)
    if main:
        kw["grad_accumulation"] = "manual"
    opt = zopt.Optimizer(zopt.Step(off_path), ps, **kw)
    cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)
    c = opt._parts[0]
    assert c.offload
    handed, calls = [], []
    real_lib = c.lib

    class Counting:  # every zopt_optimizer_set_grad_memory: how many tensors it names
        def __getattr__(self, name):
            f = getattr(real_lib, name)
            if name == "zopt_optimizer_set_grad_memory":
                def counted(h, n, *a):
                    handed.append(int(n))
                    return f(h, n, *a)
                return counted
            return f
    c.lib = Counting()
    gdt = torch.float32 if main else torch.bfloat16
    g = np.random.default_rng(5)
    old = []
    out["same_as_cpu"], out["bytes"] = [], []
    for k in range(5):
        for o in (opt, cpu):
            o.zero_grad(set_to_none=True)
        new = []
        for p, h in zip(ps, hs):
            x = torch.from_numpy((g.standard_normal(p.numel()) * 0.1).astype(np.float32)).to(gdt)
            d = dev(p.numel(), gdt, x)  # fresh device memory
            new.append(d)
            if main:
                p.main_grad, h.main_grad = d, x.clone()
            else:
                p.grad, h.grad = d, x.clone()
        for d in old:  # the runtime must not read the last step's gradients again
            d.fill_(float("nan"))
        n0 = len(handed)
        opt.step()
        cpu.step()
        calls.append(len(handed) - n0)
        opt.step_count()  # waits for the step's copies back
        fake.fake_cuda_drain_all()
        st = opt.step_stats()
        out["bytes"].append([st["d2h_bytes"], st["h2d_bytes"]])
        sd, sc = opt.state_dict()["state"], cpu.state_dict()["state"]
        same = all(torch.equal(p.view(torch.int16), h.view(torch.int16)) for p, h in zip(ps, hs))
        same = same and sorted(sd) == sorted(sc)  # (the twin of the 6-byte cell: no master)
        same = same and all(torch.equal(sd[i][key], sc[i][key]) for i in sd for key in sc[i])
        out["same_as_cpu"].append(bool(same))
        old = new
    out["handed"] = handed
    out["calls"] = calls
    out["finite"] = all(bool(torch.isfinite(p.float()).all()) for p in ps)
    if main:
        out["in_place"] = all(c.foreign[t][0] is p.main_grad for t, p in enumerate(ps))
    else:
        out["in_place"] = c.scan.in_place() == {t: p.grad.data_ptr() for t, p in enumerate(ps)}
    out["own_untouched"] = all(not f.view(torch.int16 if f.element_size() == 2 else torch.int32).any()
                               for f in c.grad_flats)
    opt.close()
    out["bad_ranges"] = fake.fake_cuda_num_bad_ranges()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

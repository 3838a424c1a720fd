"""The GPU fraction of an offloaded optimizer (issue 18, heterogeneous
placement; docs/USAGE.md "Part of the params' step on the GPU"):
``zopt.steps.adamw(placement="offload", gpu_fraction=f)`` builds the
offloaded class and its "<dtype>:gpu" twin, ``zopt.Optimizer`` sends the
first-added params (the last whose gradients arrive) to the GPU class up to
about f of the elements, and both step as one linked step (one norm, one
skip decision).

- Builder and bad input (no device): the classes and their placements,
  f outside (0, 1), gpu_fraction without placement="offload", with keep32.
- Stand-in driver (libzopt-fake-cuda.so with ZOPT_FAKE_CUDA_TWIN: the real
  CUDA and offload backends, the GPU kernels run as the CPU twin's): the
  routing, then steps bit-identical to the all-offloaded optimizer and to
  the all-CPU twin (clip inactive and active, an inf in either class skips
  every class), a state_dict and a save/load round trip.
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError
from gpu_fakes import (StandIn, cuda_params, device_tensors, grads_on_device, needs_fake,
                       needs_toolkit, run_worker)

SIZES = [700, 1300, 3000, 33, 2967]  # f = 0.3 of 8000: the first two (2000) on the GPU
KW = dict(clip=1.0, comments=False)


# ---- the builder and bad input (no device) --------------------------------------------

def test_spec_builds_the_offloaded_class_and_its_gpu_twin():
    sp = zopt.steps.adamw.spec(placement="offload", gpu_fraction=0.3, **KW)
    assert sorted(sp) == ["f32", "f32:gpu"] and sp.gpu_fraction == 0.3
    assert sp["f32"].placement == "offload" and sp["f32:gpu"].placement == "gpu"
    assert sp["f32"].name != sp["f32:gpu"].name
    sp = zopt.steps.adamw.spec(placement="offload", gpu_fraction=0.5, clip=1.0,
                               classes={"bf16": dict(master="f32"), "f32": {}})
    assert sorted(sp) == ["bf16", "bf16:gpu", "f32", "f32:gpu"]
    assert sp["bf16:gpu"].master == "f32" and sp["bf16:gpu"].placement == "gpu"


@pytest.mark.parametrize("f", [0, 0.0, 1, 1.0, -0.1, 1.5, True, "0.3", float("nan")])
def test_fraction_outside_the_open_interval_refused(f):
    with pytest.raises(ZoptError) as e:
        zopt.steps.adamw.spec(placement="offload", gpu_fraction=f, **KW)
    assert e.value.code == Status.INVALID_ARGUMENT and "gpu_fraction" in str(e.value)
    assert "(0, 1)" in str(e.value)


@pytest.mark.parametrize("placement", [None, "cpu", "gpu"])
def test_fraction_without_offload_refused(placement):
    kw = dict(KW) if placement is None else dict(KW, placement=placement)
    with pytest.raises(ZoptError) as e:
        zopt.steps.adamw.spec(gpu_fraction=0.3, **kw)
    assert e.value.code == Status.INVALID_ARGUMENT
    assert "placement='offload'" in str(e.value)


def test_fraction_with_keep32_refused():
    with pytest.raises(ZoptError, match="gpu_fraction.*keep32"):
        zopt.steps.adamw.spec(placement="offload", gpu_fraction=0.3, moments="bf16",
                              keep32=4096, param="bf16", master="f32", **KW)


def test_a_twin_the_gpu_cannot_take_is_named():
    """A bf16 master of bf16 params is allowed offloaded only: the GPU twin
    cannot have it, and the message names the class."""
    with pytest.raises(ZoptError, match="gpu_fraction \\(class 'bf16:gpu'\\)"):
        zopt.steps.adamw.spec(placement="offload", gpu_fraction=0.3, param="bf16",
                              master="bf16", **KW)


def test_router_takes_the_nearest_add_order_prefix():
    from zopt._placement import GpuSplit
    s = GpuSplit(0.3, sum(SIZES))
    assert [s.takes(n) for n in SIZES] == [True, True, False, False, False]
    s = GpuSplit(0.3, 100)
    assert [s.takes(n) for n in (70, 10, 20)] == [False, False, False]  # nearest: none
    s = GpuSplit(0.5, 100)
    assert [s.takes(n) for n in (10, 30, 20, 40)] == [True, True, True, False]


# ---- against the stand-in driver ------------------------------------------------------

@needs_fake
@needs_toolkit
def test_stand_in_gpu_fraction_routes_and_steps_as_one(steps, tmp_path):
    """f = 0.3 of five f32 params: the first two (2000 of 8000 elements,
    the nearest add-order prefix) on the GPU class, the rest offloaded;
    every step (clip inactive, active; an inf in a GPU-class param, then in
    an offloaded one: every class skipped) bit-identical to the all-
    offloaded optimizer and to the all-CPU twin, params and states; so is
    a step clipped by clip_grad_norm_ (the linked step begun, its norm the
    runtime's); the state_dict and save/load round trips continue
    bit-identically; a param added by add_param_group goes to the offloaded
    class and the next step is the twin's."""
    from zopt import steps as S
    gpu = steps.text(S.adamw.text(placement="gpu", **KW))
    off = steps.text(S.adamw.text(placement="offload", **KW))
    cpu = steps.text(S.adamw.text(**KW))
    out = run_worker(__file__, "fraction", os.pathsep.join([gpu.path, off.path, cpu.path]),
                     tmp_path, ZOPT_FAKE_CUDA_TWIN=cpu.path)
    assert out["classes"] == ["f32:gpu", "f32:gpu", "f32", "f32", "f32"]
    assert out["gpu_fraction"] == 0.25 and out["backends"] == [True, True]
    assert out["norms_equal"] == [True] * 6 and out["clipped"] == [False, False, True, False, False, False]
    assert out["skipped"] == [False, False, False, True, True, False]
    assert out["same_as_offload"] == [True] * 6 and out["same_as_cpu"] == [True] * 6
    assert out["step_stats"] == [["f32"], True, 0.25, True]
    assert out["clip_grad_norm"]
    assert out["state_dict_round_trip"] and out["save_load_round_trip"]
    assert out["files"] == ["ck", "ck.f32:gpu"]
    assert out["added"] == ["f32", True, True]


@needs_fake
@needs_toolkit
def test_stand_in_gpu_fraction_with_overlap(steps, tmp_path):
    """overlap=True with the GPU fraction: the offloaded class's buckets are
    marked from the backward hooks (its pipeline), the GPU class steps at
    step(), one linked step: bit-identical to the same classes without
    overlap, also when clipping is active (recomputed) and with an inf in
    either class (discarded, every class skipped); pipeline_stats() has
    gpu_fraction. A mapping of two offloaded classes is still refused."""
    from zopt import steps as S
    gpu = steps.text(S.adamw.text(placement="gpu", **KW))
    off = steps.text(S.adamw.text(placement="offload", **KW))
    cpu = steps.text(S.adamw.text(**KW))
    out = run_worker(__file__, "overlap", os.pathsep.join([gpu.path, off.path, cpu.path]),
                     tmp_path, ZOPT_FAKE_CUDA_TWIN=cpu.path, ZOPT_FAKE_CUDA_ASYNC="1")
    assert out["classes"] == ["f32:gpu", "f32", "f32", "f32"]
    assert out["same"] == [True] * 5 and out["marked_in_backward"] == [True] * 5
    assert out["outcomes"] == ["commit", "recompute", "discard", "discard", "commit"]
    assert out["skipped"] == [False, False, True, True, False]
    assert out["stats_fraction"] == 2048 / 3152
    with pytest.raises(ZoptError) as e:
        zopt.Optimizer({torch.float32: zopt.Step(off.path), torch.bfloat16: zopt.Step(off.path)},
                       [torch.nn.Parameter(torch.randn(8))], overlap=True)
    assert e.value.code == Status.UNSUPPORTED and "gpu_fraction" in str(e.value)


@needs_fake
@needs_toolkit
def test_stand_in_gpu_fraction_loss_scaled(steps, tmp_path):
    """f16 params with an f32 master, loss-scaled, gpu_fraction=0.3: one loss
    scaler over both classes. Each step (clip inactive, active; an inf in
    the GPU class, then in the offloaded one: skipped, the scale backed off
    alike; growth after 2 good steps) bit-identical to the all-offloaded
    optimizer and the all-CPU twin, the loss scale too."""
    from zopt import steps as S
    kw = dict(param="f16", master="f32", **KW)
    gpu = steps.text(S.adamw.text(placement="gpu", **kw))
    off = steps.text(S.adamw.text(placement="offload", **kw))
    cpu = steps.text(S.adamw.text(**kw))
    out = run_worker(__file__, "f16", os.pathsep.join([gpu.path, off.path, cpu.path]),
                     tmp_path, ZOPT_FAKE_CUDA_TWIN=cpu.path)
    assert out["classes"] == ["f16:gpu", "f16:gpu", "f16", "f16", "f16"]
    assert out["skipped"] == [False, False, True, True, False, False]
    assert out["clipped"] == [False, True, False, False, False, False]
    assert out["scales"] == [1024.0, 1024.0, 2048.0, 1024.0, 512.0, 512.0]  # each step's S
    assert out["same_as_offload"] == [True] * 6 and out["same_as_cpu"] == [True] * 6


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _f16_worker(dev, paths, out):
    gpu_path, off_path, cpu_path = paths
    rng = np.random.default_rng(8)
    init = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).half() for n in SIZES]
    ps = [torch.nn.Parameter(dev(n, w, torch.float16)) for n, w in zip(SIZES, init)]
    qs = [torch.nn.Parameter(dev(n, w, torch.float16)) for n, w in zip(SIZES, init)]
    hs = [torch.nn.Parameter(w.clone()) for w in init]
    classes = zopt.steps.StepClasses({"f16": zopt.Step(off_path), "f16:gpu": zopt.Step(gpu_path)})
    classes.gpu_fraction = 0.3
    kw = dict(lr=1e-2, weight_decay=0.1, loss_scaler=dict(init_scale=1024.0, growth_interval=2))
    opts = (zopt.Optimizer(classes, ps, **kw), zopt.Optimizer(zopt.Step(off_path), qs, **kw),
            zopt.Optimizer(zopt.Step(cpu_path), hs, **kw))
    opt, off, cpu = opts
    out["classes"] = [opt._class_of[id(p)] for p in ps]
    for key in ("skipped", "clipped", "scales", "same_as_offload", "same_as_cpu"):
        out[key] = []
    g = np.random.default_rng(9)

    def same(a, b, pa, pb):
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        return (all(torch.equal(x.detach(), y.detach()) for x, y in zip(pa, pb))
                and sorted(sa) == sorted(sb) and a.loss_scale == b.loss_scale
                and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i]))

    # the scaled gradients: random multiples of 1/64 (exact in f16; their
    # unscaled squares' sums exact in f64), times 256 for clipping
    for mult, bad in ((1, None), (256, None), (1, 0), (1, 4), (1, None), (1, None)):
        xs = [torch.from_numpy((g.integers(-256, 256, n) / 64.0 * mult).astype(np.float32)).half()
              for n in SIZES]
        if bad is not None:
            xs[bad][3] = float("inf")
        for o, params in zip(opts, (ps, qs, hs)):
            o.zero_grad(set_to_none=True)
            for p, x in zip(params, xs):
                p.grad = dev(p.numel(), x, torch.float16) if o is not cpu else x.clone()
            o.step()
        out["skipped"].append(opt.last_skipped and off.last_skipped and cpu.last_skipped)
        out["clipped"].append(bool(opt.last_grad_norm > 1.0) and not opt.last_skipped)
        out["scales"].append(opt.last_loss_scale)
        out["same_as_offload"].append(same(opt, off, ps, qs))
        out["same_as_cpu"].append(same(opt, cpu, ps, hs))
    for o in opts:
        o.close()


def _overlap_worker(s, dev, classes, out):
    """A small model's backward; each new p.grad moved to fresh device
    memory by a hook that runs before zopt's."""
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (64,), (16, 64), (16,)]
    init = [torch.randn(sh, generator=g) * 0.3 for sh in shapes]
    A = [torch.nn.Parameter(dev(w.numel(), w.flatten()).view(sh)) for sh, w in zip(shapes, init)]
    B = [torch.nn.Parameter(dev(w.numel(), w.flatten()).view(sh)) for sh, w in zip(shapes, init)]
    inject = {"at": None}
    keep = []

    def to_device(p, i):
        def hook(*_):
            if p.grad is not None:
                gd = p.grad.detach().clone()
                if inject["at"] == i:
                    gd.view(-1)[5] = float("inf")
                p.grad = dev(p.numel(), gd.flatten()).view(p.shape)
        node = p.expand_as(p).grad_fn.next_functions[0][0]
        keep.append((node, node.register_hook(hook)))
    for ps in (A, B):
        for i, p in enumerate(ps):
            to_device(p, i)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=512)
    opt_a = zopt.Optimizer(classes, A, overlap=True, **kw)
    opt_b = zopt.Optimizer(classes, B, **kw)
    out["classes"] = [opt_a._class_of[id(p)] for p in A]
    ov = opt_a._overlap
    for key in ("same", "marked_in_backward", "outcomes", "skipped"):
        out[key] = []

    def backward(ps, x, scale):
        w1, b1, w2, b2 = ps
        ((torch.tanh(x @ w1.t() + b1) @ w2.t() + b2).square().mean() * scale).backward()

    for scale, at in ((1e-3, None), (50.0, None), (1e-3, 2), (1e-3, 0), (1e-3, None)):
        x = torch.randn(8, 32, generator=g)
        for o in (opt_a, opt_b):
            o.zero_grad(set_to_none=True)
        inject["at"] = at
        backward(A, x, scale)
        backward(B, x, scale)
        inject["at"] = None
        out["marked_in_backward"].append(ov.nmarked == ov.nb)
        opt_a.step()
        opt_b.step()
        st = opt_a.pipeline_stats()
        out["outcomes"].append(st["outcome"])
        out["stats_fraction"] = st["gpu_fraction"]
        out["skipped"].append(opt_a.last_skipped and opt_b.last_skipped)
        sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        na, nb = opt_a.last_grad_norm, opt_b.last_grad_norm
        out["same"].append(all(torch.equal(p.detach(), q.detach()) for p, q in zip(A, B))
                           and sorted(sa) == sorted(sb) == [0, 1, 2, 3]
                           and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
                           and (na == nb or (np.isinf(na) and np.isinf(nb))))
    for o in (opt_a, opt_b):
        o.close()


def _worker(what, step_path, tmp):
    assert what in ("fraction", "overlap", "f16")
    s = StandIn()
    cuda_params()  # (not the CPU twin's; the stand-in has one context)
    device_tensor = device_tensors(s.fake)
    grads_on_device(device_tensor)  # our own gradient buffers in device memory

    def dev(n, fill=None, dtype=torch.float32):  # a tensor over stand-in device memory
        return device_tensor((n,), fill, dtype)
    gpu_path, off_path, cpu_path = step_path.split(os.pathsep)
    if what == "f16":
        out = {}
        _f16_worker(dev, (gpu_path, off_path, cpu_path), out)
        print(json.dumps(out))
        return
    if what == "overlap":
        classes = zopt.steps.StepClasses({"f32": zopt.Step(off_path), "f32:gpu": zopt.Step(gpu_path)})
        classes.gpu_fraction = 0.5
        out = {}
        _overlap_worker(s, dev, classes, out)
        print(json.dumps(out))
        return
    rng = np.random.default_rng(3)
    init = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in SIZES]
    ps = [torch.nn.Parameter(dev(n, w)) for n, w in zip(SIZES, init)]
    qs = [torch.nn.Parameter(dev(n, w)) for n, w in zip(SIZES, init)]
    hs = [torch.nn.Parameter(w.clone()) for w in init]
    classes = zopt.steps.StepClasses({"f32": zopt.Step(off_path), "f32:gpu": zopt.Step(gpu_path)})
    classes.gpu_fraction = 0.3
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = zopt.Optimizer(classes, ps, **kw)
    off = zopt.Optimizer(zopt.Step(off_path), qs, **kw)
    cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)
    out = {"classes": [opt._class_of[id(p)] for p in ps], "gpu_fraction": opt.gpu_fraction,
           "backends": [opt.parts["f32"].offload, opt.parts["f32:gpu"].step.gpu]}
    for key in ("norms_equal", "clipped", "skipped", "same_as_offload", "same_as_cpu"):
        out[key] = []
    g = np.random.default_rng(5)

    def one_step(scale, bad=None, opts=(opt, off, cpu), groups=(ps, qs, hs)):
        # Random multiples of 1/64 (times a power of two): their squares'
        # sums are exact in f64, so the linked norm (two sums added) is the
        # one-class norm bit for bit, and every class's update must be too.
        xs = [torch.from_numpy((g.integers(-256, 256, n) / 64.0 * scale).astype(np.float32))
              for n in SIZES]
        if bad is not None:
            xs[bad][7] = float("inf")
        for o, params in zip(opts, groups):
            o.zero_grad(set_to_none=True)
            for p, x in zip(params, xs):
                p.grad = dev(p.numel(), x) if o is not cpu else x.clone()
            o.step()

    def states(o):
        o.step_count()
        sd = o.state_dict()["state"]
        return {i: {k: v.clone() for k, v in sd[i].items()} for i in sd}

    def same(a, b, pa, pb):
        sa, sb = states(a), states(b)
        return (all(torch.equal(x.detach(), y.detach()) for x, y in zip(pa, pb))
                and sorted(sa) == sorted(sb)
                and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i]))

    for scale, bad in ((1 / 1024, None), (1 / 1024, None), (1.0, None), (1 / 1024, 1),
                       (1 / 1024, 3), (1 / 1024, None)):
        one_step(scale, bad)
        out["norms_equal"].append(opt.last_grad_norm == off.last_grad_norm == cpu.last_grad_norm
                                  or (bad is not None and np.isinf(opt.last_grad_norm)))
        out["clipped"].append(bool(opt.last_grad_norm > 1.0) and not opt.last_skipped)
        out["skipped"].append(opt.last_skipped and off.last_skipped and cpu.last_skipped)
        out["same_as_offload"].append(same(opt, off, ps, qs))
        out["same_as_cpu"].append(same(opt, cpu, ps, hs))
    st = opt.step_stats()  # the offloaded class's host times; the GPU class has none
    out["step_stats"] = [sorted(st["classes"]), st["offloaded"], st["gpu_fraction"],
                         st["d2h_bytes"] == off.step_stats()["d2h_bytes"] * 6000 // 8000]
    # clip_grad_norm_: the linked step begun (the runtime's norm over both
    # classes), then finished, clipped at the given max_norm
    xs = [torch.from_numpy((g.integers(-256, 256, n) / 64.0).astype(np.float32)) for n in SIZES]
    norms = []
    for o, params in zip((opt, off, cpu), (ps, qs, hs)):
        o.zero_grad(set_to_none=True)
        for p, x in zip(params, xs):
            p.grad = dev(p.numel(), x) if o is not cpu else x.clone()
        norms.append(float(o.clip_grad_norm_(0.5)))
        o.step()
    out["clip_grad_norm"] = (norms[0] == norms[1] == norms[2] > 0.5 and same(opt, off, ps, qs)
                             and same(opt, cpu, ps, hs))
    # state_dict into a new optimizer (other device params), stepped beside
    rs = [torch.nn.Parameter(dev(n, p.detach())) for n, p in zip(SIZES, ps)]
    opt2 = zopt.Optimizer(classes, rs, **kw)
    opt2.load_state_dict(opt.state_dict())
    one_step(1.0, opts=(opt, opt2, cpu), groups=(ps, rs, hs))
    out["state_dict_round_trip"] = same(opt, opt2, ps, rs) and same(opt2, cpu, rs, hs)
    # save / load: one linked save over the two classes
    path = os.path.join(tmp, "ck")
    opt.save(path)
    out["files"] = sorted(os.path.basename(f) for f in opt.checkpoint_files(path).values())
    ts = [torch.nn.Parameter(dev(n, p.detach())) for n, p in zip(SIZES, ps)]  # the model's load
    opt3 = zopt.Optimizer(classes, ts, **kw)
    opt3.load(path)
    one_step(1 / 1024, opts=(opt, opt3, cpu), groups=(ps, ts, hs))
    out["save_load_round_trip"] = same(opt, opt3, ps, ts) and same(opt3, cpu, ts, hs)
    # add_param_group: the new params go to the offloaded class (their
    # gradients arrive first); the GPU class gets the empty group
    w = torch.from_numpy(rng.standard_normal(77).astype(np.float32))
    extra = (torch.nn.Parameter(dev(77, w)), torch.nn.Parameter(w.clone()))
    opt.add_param_group({"params": [extra[0]], "lr": 3e-3})
    cpu.add_param_group({"params": [extra[1]], "lr": 3e-3})
    xs = [torch.from_numpy((g.integers(-256, 256, n) / 64.0 / 1024).astype(np.float32))
          for n in SIZES + [77]]
    for o, params in ((opt, ps + [extra[0]]), (cpu, hs + [extra[1]])):
        o.zero_grad(set_to_none=True)
        for p, x in zip(params, xs):
            p.grad = dev(p.numel(), x) if o is not cpu else x.clone()
        o.step()
    out["added"] = [opt._class_of[id(extra[0])], opt.last_grad_norm == cpu.last_grad_norm,
                    same(opt, cpu, ps + [extra[0]], hs + [extra[1]])]
    for o in (opt, opt2, opt3, off, cpu):
        o.close()
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

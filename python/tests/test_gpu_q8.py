"""q8 moments on the CUDA backend through the binding, on the stand-in
driver (docs/GPU.md "q8 moments on the GPU"): with ZOPT_EXPERIMENTAL_GPU_Q8=1
zopt.steps.adamw(moments="q8", placement="gpu") builds, and its optimizer
over "device" params (libzopt-fake-cuda.so with ZOPT_FAKE_CUDA_TWIN: the
GPU kernels run on the CPU twin's) trains 4 clipped steps bit for bit as
the same description's CPU step: params, and state_dict's decoded moments
(torch's layout) and the raw codes and absmax; save() on the GPU and
load() into the CPU optimizer resume there bit for bit.
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import StateKind
from gpu_fakes import StandIn, needs_fake, needs_toolkit, run_worker

SIZES = [33, 1000, 5000]  # partial q8 blocks, two chunks of 4096 + 904


@needs_fake
@needs_toolkit
def test_stand_in_twin_q8_moments_on_the_gpu(steps, tmp_path, monkeypatch):
    monkeypatch.setenv("ZOPT_EXPERIMENTAL_GPU_Q8", "1")
    kw = dict(param="f32", moments="q8", clip=1.0, comments=False)
    gpu = steps.text(zopt.steps.adamw.text(placement="gpu", **kw))
    cpu = steps.text(zopt.steps.adamw.text(**kw))
    out = run_worker(__file__, "q8", gpu.path + os.pathsep + cpu.path, tmp_path,
                     ZOPT_FAKE_CUDA_TWIN=cpu.path, ZOPT_EXPERIMENTAL_GPU_Q8="1")
    assert out["q8_on_gpu"]
    assert out["same_as_cpu"] == [True] * 4
    assert out["raw_same"] == [True] * 4
    assert out["clipped"] and out["moved"]
    assert out["resumed_on_cpu"]
    assert out["bad_ranges"] == 0


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _worker(what, step_path, tmp):
    assert what == "q8"
    s = StandIn()
    s.grads_on_device()
    dev_array = s.dev_array
    zopt._params.device_grads = lambda ents: True  # the stand-in's memory is "device" memory
    gpu_path, cpu_path = step_path.split(os.pathsep)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    ps = [torch.nn.Parameter(torch.from_numpy(dev_array(n, w))) for n, w in zip(SIZES, init)]
    hs = [torch.nn.Parameter(torch.tensor(w)) for w in init]
    kw = dict(lr=1e-2, weight_decay=0.1)
    step = zopt.Step(gpu_path)
    out = {"q8_on_gpu": step.state_dtype(StateKind.EXP_AVG) == zopt._lib.DType.Q8}
    opt = zopt.Optimizer(step, ps, **kw)
    cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)
    g = np.random.default_rng(1)
    out["same_as_cpu"], out["raw_same"] = [], []
    for _ in range(4):
        for p, h in zip(ps, hs):
            x = (g.standard_normal(p.numel()) * 0.5).astype(np.float32)  # norm ~ 40: clipped
            p.grad = torch.from_numpy(dev_array(p.numel(), x))
            h.grad = torch.from_numpy(x.copy())
        opt.step()
        cpu.step()
        opt.step_count()  # waits for the step
        sd, sc = opt.state_dict()["state"], cpu.state_dict()["state"]
        same = all(torch.equal(p, h) for p, h in zip(ps, hs)) and sorted(sd) == sorted(sc)
        same = same and all(torch.equal(sd[i][k], sc[i][k]) for i in sc for k in sc[i])
        out["same_as_cpu"].append(bool(same))
        out["raw_same"].append(all(
            np.array_equal(opt.read_state_raw(i, k), cpu.read_state_raw(i, k))
            for i in range(len(SIZES))
            for k in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ,
                      StateKind.EXP_AVG_ABSMAX, StateKind.EXP_AVG_SQ_ABSMAX)))
    gn, _, _ = opt.gpu_result()
    cn = cpu.step_result()[0]  # the GPU adds the norm's partials in another order
    out["clipped"] = bool(gn > 1.0 and abs(gn - cn) <= 1e-9 * cn)
    out["moved"] = not all(np.array_equal(p.detach().numpy(), w) for p, w in zip(ps, init))
    # The GPU optimizer's checkpoint into the CPU optimizer: one more step
    # on both (the same grads) gives the same bits.
    path = os.path.join(tmp, "q8.ckpt")
    opt.save(path)
    cpu2 = zopt.Optimizer(zopt.Step(cpu_path), [torch.nn.Parameter(p.detach().clone()) for p in ps], **kw)
    cpu2.load(path)
    hs2 = [q for grp in cpu2.param_groups for q in grp["params"]]
    for p, h in zip(ps, hs2):
        x = (g.standard_normal(p.numel()) * 0.5).astype(np.float32)
        p.grad = torch.from_numpy(dev_array(p.numel(), x))
        h.grad = torch.from_numpy(x.copy())
    opt.step()
    cpu2.step()
    opt.step_count()
    out["resumed_on_cpu"] = all(torch.equal(p, h) for p, h in zip(ps, hs2)) and all(
        np.array_equal(opt.read_state_raw(i, StateKind.EXP_AVG_SQ), cpu2.read_state_raw(i, StateKind.EXP_AVG_SQ))
        for i in range(len(SIZES)))
    s.close_all(out, opt)
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

"""GPU steps' params without a gradient and frozen params in the Python
binding, without a GPU (docs/GPU.md "What the Python binding does",
docs/USAGE.md section 3; the fakes: gpu_fakes.py).

- Recording tests (run everywhere; a CPU step posing as a GPU step): a
  param without a gradient left alone as torch.optim.AdamW leaves it (the
  runtime's active mask, pushed on the current stream only when the set of
  params with a gradient changes), frozen params left out of the native
  optimizer (empty slots) and joining when unfrozen with zero states and
  step 0 in their param group, every count carried by state_dict/save, a
  file saved with the former extra native groups ("cohorts") loaded, and
  the refusals inside a CUDA graph capture. The mask and join tests run on
  both implementations of the per-step pass (conftest.py's ``scan_impl``):
  the mask is what the pass finds.
- Stand-in driver tests (the CUDA toolkit and libzopt-fake-cuda.so): the
  real runtime's GPU host path with a frozen param and a missing gradient
  (counts from the stand-in's emulated FINISH), and with
  ZOPT_FAKE_CUDA_TWIN (the GPU kernels run on the CPU twin's) the numbers
  of torch.optim.AdamW and the bits of the CPU step.
"""
import ctypes
import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch

import zopt
from gpu_fakes import StandIn, needs_fake, needs_toolkit, run_worker, same_as_twin_close_to_torch
from gpu_fakes import assert_on_current_stream as _assert_on_current_stream
from gpu_fakes import params_with_grads as _params
from zopt._lib import Status, ZoptError


# ---- recording tests -------------------------------------------------------

LR, WD = 1e-2, 0.1


def _mlp(seed=0, frozen=True):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if frozen:
        m[0].weight.requires_grad_(False)  # a frozen base weight (LoRA, embeddings)
    return m


def _train(model, opt, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _close(a, b, rtol=2e-5, atol=1e-6):
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=rtol, atol=atol)


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _built(rec, opt):
    """(group, param pointer, grad pointer, numel) of every tensor the
    native optimizer now running was given."""
    return [(c[4][1], c[4][2].value, c[4][3].value, c[4][4])
            for c in rec.calls("zopt_optimizer_add_tensor") if c[4][0].value == opt._h.value]


def test_gpu_step_leaves_frozen_params_out(steps, gpu_env, tmp_path):
    """A model with a frozen weight in model.parameters() on a GPU step (no
    per-tensor skip on the device): the frozen weight is left out of the
    native optimizer (an empty slot: no state or gradient memory, never
    written), the others are stepped bit for bit as by the same step built
    on the trainable params only (and as torch.optim.AdamW)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr, mt = _mlp(), _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, [p for p in mr.parameters() if p.requires_grad], lr=LR,
                         weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    w = mz[0].weight
    assert oz._parts[0].excluded == {0} and len(oz.param_groups[0]["params"]) == 4
    built = _built(rec, oz)
    assert built[0] == (0, None, None, 0)  # an empty slot: tensor ids stay param indices
    assert all(n > 0 and pp and gp for _, pp, gp, n in built[1:])
    assert oz.memory_info()["state_bytes"] == orf.memory_info()["state_bytes"]
    assert sum(f.numel() for f in oz._parts[0].grad_flats) == sum(f.numel() for f in orf._parts[0].grad_flats)
    w0 = w.detach().clone()
    for i in range(3):
        for m, o in ((mz, oz), (mr, orf), (mt, ot)):
            _train(m, o, i)
    assert torch.equal(w, w0) and w.grad is None
    assert _same(list(mz.parameters())[1:], list(mr.parameters())[1:])
    _close(mz.parameters(), mt.parameters())
    assert oz.last_metrics["active_tensors"] == 3
    assert oz.last_metrics["updated_elems"] == sum(p.numel() for p in mr.parameters()
                                                   if p.requires_grad)
    # state: empty for the frozen weight, as torch's
    assert oz.state[w] == {} and w not in oz.state and len(oz.state) == 3
    assert oz.tensor_step(w) == 0 and oz.tensor_step(mz[0].bias) == 3
    with pytest.raises(ZoptError, match="left out"):
        oz.state[w] = {"exp_avg": torch.zeros(8, 6)}
    with pytest.raises(ZoptError, match="left out"):
        oz.read_state(w, "exp_avg")
    del oz.state[w]  # nothing to reset
    sd = oz.state_dict()
    assert sorted(sd["state"]) == [1, 2, 3] and sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    t2 = torch.optim.AdamW(_mlp().parameters(), lr=LR)
    t2.load_state_dict(sd)  # torch's layout: loads into torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        oz.load_state_dict(sd)
    oz.save(tmp_path / "ck")
    oz.load(tmp_path / "ck")
    # a torch state_dict with states for the weight (trained there): dropped, with a warning
    mt[0].weight.requires_grad_(True)
    _train(mt, ot, 3)
    with pytest.warns(UserWarning, match=r"left out .*\['params'\]\[0\]"):
        oz.load_state_dict(ot.state_dict())
    assert oz.state[w] == {} and oz.tensor_step(mz[2].weight) == 4
    assert torch.equal(w, w0)


def test_gpu_step_frozen_params_in_a_new_group_and_other_dtypes(steps, gpu_env):
    """add_param_group: its frozen params are left out too, whatever their
    dtype (a frozen bf16 table beside an f32 step); the rebuilt optimizer
    keeps stepping bit for bit as one over the trainable params only. A
    param left out that is unfrozen with a dtype the step cannot update is
    refused then, naming it."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr = _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, [p for p in mr.parameters() if p.requires_grad], lr=LR,
                         weight_decay=WD)
    for i in range(2):
        _train(mz, oz, i)
        _train(mr, orf, i)
    torch.manual_seed(5)
    table = torch.nn.Parameter(torch.randn(10, 4).to(torch.bfloat16), requires_grad=False)
    frozen32 = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    head_z = torch.nn.Parameter(torch.randn(3, 3))
    head_r = torch.nn.Parameter(head_z.detach().clone())
    oz.add_param_group({"params": [table, head_z, frozen32], "lr": 5e-3})
    orf.add_param_group({"params": [head_r], "lr": 5e-3})
    assert oz._parts[0].excluded == {0, 4, 6} and oz.rebuilds == 1
    t0 = table.detach().clone()
    for i in range(2, 5):
        for m, o, h in ((mz, oz, head_z), (mr, orf, head_r)):
            g = torch.Generator().manual_seed(100 + i)
            x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x) @ h, y).backward()
            o.step()
    assert _same(list(mz.parameters())[1:] + [head_z], list(mr.parameters())[1:] + [head_r])
    assert torch.equal(table.view(torch.int16), t0.view(torch.int16))
    assert oz.state[table] == {} and oz.tensor_step(head_z) == 3
    table.requires_grad_(True)
    table.grad = torch.ones_like(table)
    for p in oz.param_groups[0]["params"][1:] + [head_z]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ZoptError, match=r"param_groups\[1\]\['params'\]\[0\].*bf16"):
        oz.step()
    assert torch.equal(table.view(torch.int16), t0.view(torch.int16))


def test_gpu_step_unfrozen_param_joins_with_fresh_states(steps, gpu_env, scan_impl, tmp_path):
    """A frozen weight unfrozen after 3 steps: from its first gradient on it
    is stepped, starting from zero states and step 0 like torch's lazily
    created state, in its param group's native group (every tensor counts
    its own steps: no extra native group); state_dict() and save() carry
    its count into a new optimizer (all params trainable at build) without
    rebuilding it, which steps on bit for bit."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mt = _mlp(), _mlp()
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    ot = torch.optim.AdamW(mt.parameters(), lr=LR, weight_decay=WD, foreach=False)
    w, wt = mz[0].weight, mt[0].weight
    for i in range(3):
        _train(mz, oz, i)
        _train(mt, ot, i)
    assert oz.rebuilds == 0 and oz._parts[0].excluded == {0}
    w.requires_grad_(True)
    wt.requires_grad_(True)
    for i in range(3, 6):
        _train(mz, oz, i)
        _train(mt, ot, i)
        _close(mz.parameters(), mt.parameters())
        assert float(oz.state[w]["step"]) == float(ot.state[wt]["step"]) == i - 2
        _close([oz.state[w]["exp_avg"], oz.state[w]["exp_avg_sq"]],
               [ot.state[wt]["exp_avg"], ot.state[wt]["exp_avg_sq"]])
    assert oz.rebuilds == 1 and not oz._parts[0].excluded
    assert [b[0] for b in _built(rec, oz)] == [0, 0, 0, 0]  # its param group's native group
    assert oz._parts[0].native_steps() == [6] and oz.step_count(0) == 6
    assert oz.tensor_step(w) == 3 and oz.tensor_step(mz[0].bias) == 6
    # a scheduler's lr reaches the one native group of param group 0
    n = len(rec.calls("zopt_optimizer_set_hyper"))
    oz.param_groups[0]["lr"] = 5e-3
    assert sorted(c[4][1] for c in rec.calls("zopt_optimizer_set_hyper")[n:]) == [0]
    assert oz.get_hyper(0, "lr") == 5e-3
    # state_dict() into a new optimizer whose weight is trainable from the start
    sd = oz.state_dict()
    assert sd["zopt"]["group_steps"] == [6]
    m2 = _mlp(frozen=False)
    m2.load_state_dict(mz.state_dict())
    o2 = zopt.Optimizer(st, m2.parameters(), lr=LR, weight_decay=WD)
    assert not o2._parts[0].excluded
    o2.load_state_dict(sd)
    assert o2.rebuilds == 0 and o2._parts[0].native_steps() == [6]
    assert o2.tensor_step(m2[0].weight) == 3 and o2.tensor_step(m2[0].bias) == 6
    assert o2.param_groups[0]["lr"] == 5e-3 and o2.get_hyper(0, "lr") == 5e-3
    # save() / load(): the file's native groups
    oz.save(tmp_path / "ck")
    m3 = _mlp(frozen=False)
    m3.load_state_dict(mz.state_dict())
    o3 = zopt.Optimizer(st, m3.parameters(), lr=LR, weight_decay=WD)
    o3.load(tmp_path / "ck")
    assert o3.rebuilds == 0 and o3._parts[0].native_steps() == [6]
    assert o3.tensor_step(m3[0].weight) == 3 and o3.tensor_step(m3[0].bias) == 6
    for i in range(6, 8):
        for m, o in ((mz, oz), (m2, o2), (m3, o3)):
            _train(m, o, i)
    assert _same(mz.parameters(), m2.parameters()) and _same(mz.parameters(), m3.parameters())
    assert o2.tensor_step(m2[0].weight) == o3.tensor_step(m3[0].weight) == 5
    # a load the runtime refuses changes nothing
    m4 = _mlp(frozen=False)
    o4 = zopt.Optimizer(st, m4.parameters(), lr=LR, weight_decay=WD)
    _train(m4, o4, 0)
    before = o4.state_dict()
    real = zopt._rebuild.restore

    def failing(c, snap, **kw):
        zopt._rebuild.restore = real
        raise ZoptError(Status.CHECKPOINT, "refused (test)")
    zopt._rebuild.restore = failing
    with pytest.raises(ZoptError, match="refused"):
        o4.load_state_dict(sd)
    assert o4.rebuilds == 0 and o4._parts[0].native_steps() == [1]
    after = o4.state_dict()
    for t in before["state"]:
        for k in before["state"][t]:
            assert torch.equal(before["state"][t][k], after["state"][t][k])


def test_gpu_step_loads_a_file_saved_with_extra_groups(steps, gpu_env, tmp_path):
    """A checkpoint file saved by the binding before the GPU mask, whose
    unfrozen param sat in an extra native group of its own (one count per
    group, "cohorts"; made here with the C API), loads without a rebuild:
    every tensor its states and its own count, the param group the largest
    count of its native groups and the file's hyperparameters; the next
    step is bit-identical to the native optimizer that saved it. A corrupt
    file of that kind is refused by the runtime, nothing changed."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    L = zopt._lib.lib()
    rng = np.random.default_rng(3)
    init = [rng.standard_normal(n).astype(np.float32) for n in (6, 9, 4)]
    pairs = [(w.copy(), np.zeros_like(w)) for w in init]
    h = ctypes.c_void_p()
    zopt._lib.check(L.zopt_optimizer_create(st._h, ctypes.byref(h)))
    for g in range(2):  # group 1: the extra group of param 0, which joined later
        zopt._lib.check(L.zopt_optimizer_add_group(h, ctypes.byref(ctypes.c_int())))
        zopt._lib.check(L.zopt_optimizer_set_hyper(h, g, b"lr", 3e-3))
        zopt._lib.check(L.zopt_optimizer_set_hyper(h, g, b"weight_decay", WD))
    for t, (w, gr) in enumerate(pairs):
        zopt._lib.check(L.zopt_optimizer_add_tensor(
            h, 1 if t == 0 else 0, ctypes.c_void_p(w.ctypes.data), ctypes.c_void_p(gr.ctypes.data),
            w.size, int(st.param_dtype), ctypes.byref(ctypes.c_int())))
    zopt._lib.check(L.zopt_optimizer_finalize(h))
    res = zopt._lib.StepResult()
    mask = (ctypes.c_uint8 * 3)(0, 1, 1)
    grads = [[(rng.standard_normal(w.size) * 0.1).astype(np.float32) for w in init]
             for _ in range(6)]
    for k in range(5):
        zopt._lib.check(L.zopt_optimizer_set_active(h, mask if k < 3 else None, 3))
        for (_, gr), x in zip(pairs, grads[k]):
            gr[:] = x
        zopt._lib.check(L.zopt_optimizer_step(h, ctypes.byref(res)))
    path = tmp_path / "cohorts.ck"
    zopt._lib.check(L.zopt_optimizer_save(h, str(path).encode()))
    ps = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w, _ in pairs]
    opt = zopt.Optimizer(st, ps, lr=1e-2)
    bad = tmp_path / "bad.ck"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # in the last piece's data
    bad.write_bytes(bytes(raw))
    with pytest.raises(ZoptError, match="checksum"):
        opt.load(bad)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.tensor_step(ps[1]) == 0
    opt.load(path)
    assert opt.rebuilds == 0 and opt._parts[0].native_steps() == [5]
    assert [opt.tensor_step(p) for p in ps] == [2, 5, 5]
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == WD
    for t in range(3):
        for key, k in (("exp_avg", 4), ("exp_avg_sq", 5)):
            want = np.empty(init[t].size, dtype=np.float32)
            zopt._lib.check(L.zopt_optimizer_read_state_f32(
                h, t, k, ctypes.c_void_p(want.ctypes.data), want.size))
            assert np.array_equal(opt.read_state(ps[t], key), want)
    for p, (_, gr), x in zip(ps, pairs, grads[5]):
        p.grad = torch.from_numpy(x.copy())
        gr[:] = x
    zopt._lib.check(L.zopt_optimizer_step(h, ctypes.byref(res)))
    opt.step()
    assert all(np.array_equal(p.detach().numpy(), w) for p, (w, _) in zip(ps, pairs))
    L.zopt_optimizer_free(h)


def test_gpu_step_unfrozen_before_the_first_step(steps, gpu_env):
    """Unfrozen before any step: it joins at its first gradient, stepped as
    if it had been trainable from the start."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    mz, mr = _mlp(), _mlp(frozen=False)
    oz = zopt.Optimizer(st, mz.parameters(), lr=LR, weight_decay=WD)
    orf = zopt.Optimizer(st, mr.parameters(), lr=LR, weight_decay=WD)
    mz[0].weight.requires_grad_(True)
    for i in range(3):
        _train(mz, oz, i)
        _train(mr, orf, i)
    assert oz.rebuilds == 1 and not oz._parts[0].excluded
    assert _same(mz.parameters(), mr.parameters())


def test_gpu_step_f32_grads_frozen_param_joins_with_hooks(steps, gpu_env):
    """bf16 params with f32 gradients (p.main_grad, accumulated by hooks):
    a frozen param has no hook and no main_grad buffer; unfrozen, its
    p.grad of the first backward is accumulated at step() and it joins
    (hooked from then on)."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps.text(zopt.steps.adamw.text(param="bf16", grad="f32", master="f32",
                                          comments=False))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (5, 7, 9)]
    ps[1].requires_grad_(False)
    opt = zopt.Optimizer(st, ps, lr=1e-2)
    assert opt._parts[0].excluded == {1} and len(opt._parts[0].acc_hooks) == 2
    frozen0 = ps[1].detach().clone()

    def backward():
        (sum((p.float() ** 2).sum() for p in ps)).backward()
    backward()
    opt.step()
    assert torch.equal(ps[1], frozen0) and getattr(ps[1], "main_grad", None) is None
    ps[1].requires_grad_(True)
    backward()
    assert ps[1].grad is not None  # no hook yet: taken at step()
    opt.step()
    assert opt.rebuilds == 1 and not opt._parts[0].excluded and len(opt._parts[0].acc_hooks) == 3
    assert opt.tensor_step(ps[1]) == 1 and opt.tensor_step(ps[0]) == 2
    assert not torch.equal(ps[1], frozen0) and ps[1].main_grad.dtype == torch.float32
    opt.zero_grad()
    backward()
    assert ps[1].grad is None and ps[1].main_grad is not None  # the hook took it
    opt.step()
    assert opt.tensor_step(ps[1]) == 2


def test_gpu_step_param_without_grad_left_alone(steps, gpu_env, scan_impl):
    """A param that requires grad but has no gradient at a GPU step is left
    alone as torch does (the runtime's active mask, pushed on the current
    stream only when the set of params with a gradient changes), its count
    not advanced: torch.optim.AdamW's numbers and counts at every step; no
    gradient at all is a no-op (torch's). Offloaded steps (updated on the
    CPU) skip it as well."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    ps = _params()
    ts = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    g = torch.Generator().manual_seed(7)
    opt = zopt.Optimizer(st, ps, lr=1e-2, weight_decay=WD)
    ot = torch.optim.AdamW(ts, lr=1e-2, weight_decay=WD, foreach=False)

    def step(which):
        for p, q, on in zip(ps, ts, which):
            x = torch.randn(p.shape, generator=g) * 0.1 if on else None
            p.grad, q.grad = x, (None if x is None else x.clone())
        n = len(rec.calls("zopt_optimizer_set_active"))
        opt.step()
        ot.step()
        _close(ps, ts)
        for p, q in zip(ps, ts):
            assert opt.tensor_step(p) == (int(ot.state[q]["step"]) if q in ot.state else 0)
        return rec.calls("zopt_optimizer_set_active")[n:]
    before = ps[1].detach().clone()
    pushed = step((1, 0, 1))  # the mask: pushed once
    assert len(pushed) == 1 and ctypes.string_at(pushed[0][4][1], 3) == b"\x01\x00\x01"
    assert not step((1, 0, 1))  # the same set: nothing pushed
    assert _same(ps[1:2], [before]) and opt.tensor_step(ps[1]) == 0
    assert opt.last_metrics["active_tensors"] == 2
    assert [c[4][1] for c in step((1, 1, 1))] == [None]  # every param again
    assert [opt.tensor_step(p) for p in ps] == [3, 1, 3]
    assert len(rec.calls("zopt_optimizer_step")) == 3
    opt.zero_grad(set_to_none=True)
    after = [p.detach().clone() for p in ps]
    opt.step()  # no gradient at all: nothing happens, as in torch
    assert opt.last_metrics["no_grads"] and _same(ps, after)
    assert len(rec.calls("zopt_optimizer_step")) == 3
    step((1, 0, 0))
    assert [opt.tensor_step(p) for p in ps] == [4, 1, 3]
    _assert_on_current_stream(rec)
    mode("offload")
    qs = _params(seed=1)
    qs[1].grad = None
    q1 = qs[1].detach().clone()
    off = zopt.Optimizer(st, qs, lr=1e-2)
    off.step()
    assert torch.equal(qs[1], q1) and off.tensor_step(qs[1]) == 0 and off.tensor_step(qs[0]) == 1


def test_gpu_step_changed_grads_inside_capture_refused(steps, gpu_env, scan_impl):
    """Inside a CUDA graph capture the device's mask cannot change: a step
    whose set of params with a gradient differs from the last step's
    (a param without one now, a frozen param with one) raises ZoptError
    BAD_STATE naming them, before anything is enqueued; the same step
    retried after the capture, with the same p.grad, skips that param
    (torch's numbers), and the same set is captured as usual."""
    fc, rec, mode = gpu_env
    mode("gpu")
    st = steps(rule="adamw", layout="f32")
    ps = _params(4)
    ps[3].grad = None
    ps[3].requires_grad_(False)  # frozen at build: left out
    ts = [torch.nn.Parameter(p.detach().clone()) for p in ps[:3]]
    opt = zopt.Optimizer(st, ps, lr=1e-2, weight_decay=WD)
    ot = torch.optim.AdamW(ts, lr=1e-2, weight_decay=WD, foreach=False)
    grads = [p.grad.clone() for p in ps[:3]]

    def give(which):
        for p, q, x, on in zip(ps, ts, grads, which):
            p.grad, q.grad = (x.clone(), x.clone()) if on else (None, None)

    def ref_step():
        # torch's own AdamW (capturable=False) refuses a step inside a capture
        # where CUDA is there (torch 2: _accelerator_graph_capture_health_check,
        # which sees the faked capture): the reference steps outside it
        assert not fc.capturing, "the reference stepped inside the faked capture"
        ot.step()
    give((1, 1, 1))
    opt.step()
    ref_step()
    fc.capturing = True
    n_step, n_act = len(rec.calls("zopt_optimizer_step")), len(rec.calls("zopt_optimizer_set_active"))
    w = [p.detach().clone() for p in ps]
    give((1, 0, 1))
    with pytest.raises(ZoptError) as e:
        opt.step()
    assert e.value.code == Status.BAD_STATE
    msg = str(e.value)
    assert "CUDA graph capture" in msg and "param_groups[0]['params'][1]" in msg
    assert "without a gradient now" in msg and "['params'][0]" not in msg
    assert len(rec.calls("zopt_optimizer_step")) == n_step and _same(ps, w)
    assert len(rec.calls("zopt_optimizer_set_active")) == n_act
    fc.capturing = False
    opt.step()  # the same p.grad after the capture: param 1 left alone
    ref_step()
    assert torch.equal(ps[1], w[1]) and opt.tensor_step(ps[1]) == 1
    _close(ps[:3], ts)
    fc.capturing = True
    give((1, 0, 1))
    opt.step()  # the same set as the step before: captured
    fc.capturing = False
    ref_step()
    fc.capturing = True
    assert len(rec.calls("zopt_optimizer_step")) == n_step + 2
    ps[3].requires_grad_(True)
    ps[3].grad = torch.ones_like(ps[3])
    with pytest.raises(ZoptError, match=r"\['params'\]\[3\].*CUDA graph capture"):
        opt.step()
    assert opt.rebuilds == 0 and opt._parts[0].excluded == {3}
    assert len(rec.calls("zopt_optimizer_step")) == n_step + 2
    fc.capturing = False
    _close(ps[:3], ts)
    assert [opt.tensor_step(p) for p in ps] == [3, 1, 3, 0]
    opt.step()  # outside a capture the frozen param joins
    assert opt.rebuilds == 1 and not opt._parts[0].excluded and opt.tensor_step(ps[3]) == 1


# ---- the real runtime against the stand-in driver (subprocess) ----------------------

@needs_fake
@needs_toolkit
def test_stand_in_driver_frozen_params(steps, tmp_path):
    """The real runtime's GPU host path with a frozen param left out (an
    empty slot in the device tables, masked off), a param without a
    gradient at one step (left alone by the device's mask: the emulated
    FINISH advances only the active tensors' counts) and the frozen one
    unfrozen later (its param group's native group, its own count from
    0); state_dict() and save() carry every count into a new optimizer
    without a rebuild."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    out = run_worker(__file__, "frozen", st.path, tmp_path)
    assert out["excluded"] == [1]
    assert out["state_bytes"][0] == out["state_bytes"][1] > 0  # as without the frozen param
    assert out["counts_before"] == [3]
    assert out["o0"] == [[3], [1], 2]  # save/load and state_dict with the empty slot
    assert out["missing_counts"] == [[4], [3, 0, 4]]
    assert out["rebuilds"] == 1 and out["native_G"] == 1
    assert out["counts_after"] == [6] and out["tensor_steps"] == [5, 2, 6]
    assert out["lr_table"] == [5e-4]  # the scheduler's lr in the group's table
    assert out["o2_counts"] == [0, [7], [6, 3, 7]]
    assert out["o3_counts"] == [0, [7], [6, 3, 7]]
    assert out["bad_ranges"] == 0


@needs_fake
@needs_toolkit
def test_stand_in_twin_params_without_grads_as_torch(steps, tmp_path):
    """The real runtime's GPU step with its kernels run on the CPU twin's
    (ZOPT_FAKE_CUDA_TWIN): params without a gradient at some steps and a
    frozen param unfrozen at step 3 give torch.optim.AdamW's params,
    moments and counts at every step, and the bits of the same
    description's CPU step (params and every state)."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    cpu = steps(rule="adamw", layout="f32")
    out = run_worker(__file__, "twin", st.path + os.pathsep + cpu.path, tmp_path,
                      ZOPT_FAKE_CUDA_TWIN=cpu.path)
    assert out["close_to_torch"] == [True] * 7
    assert out["same_as_cpu"] == [True] * 7
    for mine, torch_steps in out["steps"]:
        assert mine == torch_steps
    assert out["steps"][-1][0] == [4, 4, 6] and out["rebuilds"] == 1
    assert out["bad_ranges"] == 0


# ---- the worker (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _worker(what, step_path, tmp):
    s = StandIn()
    s.grads_on_device()
    fake, dev_array = s.fake, s.dev_array
    rng = np.random.default_rng(0)
    sizes = [33, 1000, 5000]
    out = {}

    def params(trainable=(True, False, True), init=None):
        init = init or [rng.standard_normal(n) for n in sizes]
        return [torch.nn.Parameter(torch.from_numpy(dev_array(n, w)), requires_grad=r)
                for n, w, r in zip(sizes, init, trainable)]
    if what == "frozen":
        fake.fake_cuda_set_emulation(1, 0)  # FINISH counts steps, PREPARE records the table
        st = zopt.Step(step_path)
        lr_i, H = list(st.hypers).index("lr"), len(st.hypers)

        def grads(ps):
            for p in ps:
                if p.requires_grad:
                    p.grad = torch.full(p.shape, 0.01)
        ps = params()
        opt = zopt.Optimizer(st, ps, lr=1e-3)
        twin = zopt.Optimizer(st, [p for p in params() if p.requires_grad], lr=1e-3)
        out["excluded"] = sorted(opt._parts[0].excluded)
        out["state_bytes"] = [opt.memory_info()["state_bytes"],
                              twin.memory_info()["state_bytes"]]
        for _ in range(3):
            grads(ps)
            opt.step()
        out["counts_before"] = opt._parts[0].native_steps()
        opt.save(os.path.join(tmp, "ck0"))  # with the empty slot
        o0 = zopt.Optimizer(st, params(), lr=1e-3)
        o0.load(os.path.join(tmp, "ck0"))
        o0.load_state_dict(opt.state_dict())
        out["o0"] = [o0._parts[0].native_steps(), sorted(o0._parts[0].excluded), len(o0.state_dict()["state"])]
        o0.close()
        ps[0].grad = None  # no gradient at this step: left alone, its count kept
        opt.step()
        out["missing_counts"] = [opt._parts[0].native_steps(),
                                 [opt.tensor_step(p) for p in ps]]
        ps[1].requires_grad_(True)
        for _ in range(2):
            grads(ps)
            opt.step()
        out["rebuilds"], out["native_G"] = opt.rebuilds, opt._parts[0].native_G
        out["counts_after"] = opt._parts[0].native_steps()
        out["tensor_steps"] = [opt.tensor_step(p) for p in ps]
        opt.param_groups[0]["lr"] = 5e-4
        grads(ps)
        opt.step()
        opt.step_count()  # waits for the step
        h = (ctypes.c_double * H)()
        fake.fake_cuda_prepare_hypers(fake.fake_cuda_num_prepares() - 1, h, H)
        out["lr_table"] = [h[lr_i]]
        sd = opt.state_dict()
        o2 = zopt.Optimizer(st, params((True, True, True)), lr=1e-3)
        o2.load_state_dict(sd)
        out["o2_counts"] = [o2.rebuilds, o2._parts[0].native_steps(),
                            [o2.tensor_step(p) for p in o2.param_groups[0]["params"]]]
        opt.save(os.path.join(tmp, "ck"))
        o3 = zopt.Optimizer(st, params((True, True, True)), lr=1e-3)
        o3.load(os.path.join(tmp, "ck"))
        out["o3_counts"] = [o3.rebuilds, o3._parts[0].native_steps(),
                            [o3.tensor_step(p) for p in o3.param_groups[0]["params"]]]
        s.close_all(out, opt, twin, o2, o3)
    elif what == "twin":
        # ZOPT_FAKE_CUDA_TWIN: the GPU step's kernels run on its CPU twin's
        gpu_path, cpu_path = step_path.split(os.pathsep)
        init = [rng.standard_normal(n) for n in sizes]
        ps = params(init=init)  # param 1 frozen at build: left out
        hs = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32), requires_grad=r)
              for w, r in zip(init, (True, False, True))]
        ts = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in init]
        kw = dict(lr=1e-2, weight_decay=0.1)
        opt = zopt.Optimizer(zopt.Step(gpu_path), ps, **kw)
        cpu = zopt.Optimizer(zopt.Step(cpu_path), hs, **kw)  # the CPU step of the same description
        ot = torch.optim.AdamW(ts, foreach=False, **kw)
        # which params have a gradient at each step: 0 misses steps 1, 2
        # and 5, 1 is unfrozen at step 3, 2 misses step 4
        plan = [(1, 0, 1), (0, 0, 1), (0, 0, 1), (1, 1, 1), (1, 1, 0), (0, 1, 1), (1, 1, 1)]
        g = np.random.default_rng(1)
        out["same_as_cpu"], out["close_to_torch"], out["steps"] = [], [], []
        for k, which in enumerate(plan):
            if k == 3:
                ps[1].requires_grad_(True)
                hs[1].requires_grad_(True)
            for p, h, q, on in zip(ps, hs, ts, which):
                x = torch.from_numpy((g.standard_normal(p.numel()) * 0.1).astype(np.float32))
                p.grad, h.grad, q.grad = (x.clone(), x.clone(), x.clone()) if on else (None,) * 3
            for o in (opt, cpu, ot):
                o.step()
            same, close, sd = same_as_twin_close_to_torch(opt, cpu, ps, hs, ts)
            for i, q in enumerate(ts):
                if q in ot.state:
                    close = close and i in sd and all(np.allclose(
                        sd[i][key].numpy(), ot.state[q][key].numpy(), rtol=2e-5, atol=1e-7)
                        for key in ("exp_avg", "exp_avg_sq"))
            out["same_as_cpu"].append(bool(same))
            out["close_to_torch"].append(bool(close))
            out["steps"].append([[opt.tensor_step(p) for p in ps],
                                 [int(ot.state[q]["step"]) if q in ot.state else 0 for q in ts]])
        out["rebuilds"] = opt.rebuilds
        s.close_all(out, opt)
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])

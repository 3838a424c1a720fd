"""What the overlap fuzzer found (python/tests/overlap_fuzz.py; docs/TESTING.md
"The overlap fuzzer"), each minimized to a deterministic test that failed
before its fix. Stand-in driver workers (libzopt-fake-cuda.so, copies queued
asynchronously), as test_offload_overlap.py's."""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zopt  # noqa: E402
import overlap_fakes as of  # noqa: E402
from gpu_fakes import StandIn, cuda_params, device_tensors, grads_on_device, needs_fake, \
    needs_toolkit, run_worker  # noqa: E402


@needs_fake
def test_o2_param_unfrozen_after_build_steps_at_once(steps, tmp_path):
    """O2 (silently wrong): an overlapped optimizer built (or rebuilt by a
    load into a new one) while a param was frozen hooks only the params that
    required grad. Unfrozen later, that param got its gradient in the next
    backward, but the step took the set of params to update from the hooks
    (an unhooked param: inactive) and left it alone without a word: one
    update lost, its count one behind, the serial step's result never met
    again. Now it is active and its bucket is marked at the end of that
    backward: every step bit-identical to the serial optimizer's."""
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", param="bf16", master="f32", clip=1.0))
    out = run_worker(__file__, "unfrozen", off.path, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1")
    assert out["same"] == [True] * 4, out
    assert out["counts"] == [[0, 1, 1, 1], [1, 2, 2, 2], [2, 3, 3, 3], [3, 4, 4, 4]], out
    assert out["bad_ranges"] == 0


@needs_fake
@needs_toolkit
def test_o1_gpu_load_of_other_left_out_params_refused_naming_them(steps, tmp_path):
    """O1 (an unclear refusal): a GPU step's file saved with a param left out
    (frozen when that optimizer was built) loaded into an optimizer that
    holds it, and the reverse, were refused by the runtime as "tensor 1 has
    0 elements, the optimizer's has 24" (load_state_dict() of the same
    states loads; the CPU step's file loads). Now refused naming the param,
    why and what loads instead; nothing changes."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    out = run_worker(__file__, "slots", st.path, tmp_path)
    for key in ("held_loads_left_out", "left_out_loads_held"):
        code, msg, unchanged = out[key]
        assert code == int(zopt.Status.CHECKPOINT), out
        assert "['params'][1]" in msg and "left out" in msg and "load_state_dict" in msg, msg
        assert unchanged, out
    assert out["same_frozen_loads"] and out["bad_ranges"] == 0


@needs_fake
@needs_toolkit
def test_o3_gpu_fraction_load_with_a_left_out_param(steps, tmp_path):
    """O3 (a wrong refusal): with gpu_fraction, a GPU-class param frozen when
    the optimizer was built is left out (an empty slot in the class's
    file); save() and load() into an optimizer built the same way was
    refused as "not this class's checkpoint (another model, or another
    split into classes)": the check of the files counted the left-out
    param's elements. Now it loads (every count carried); a file whose
    left-out params differ is refused naming them (O1's message)."""
    from zopt import steps as S
    off = steps.text(S.adamw.text(placement="offload", param="f32", clip=1.0))
    gpu = steps.text(S.adamw.text(placement="gpu", param="f32", clip=1.0))
    out = run_worker(__file__, "fraction_slots", off.path + os.pathsep + gpu.path, tmp_path)
    assert out["classes"] == ["f32:gpu", "f32:gpu", "f32"], out
    assert out["same_built_loads"] == [0, 1, 1], out
    code, msg = out["other_left_out"]
    assert code == int(zopt.Status.CHECKPOINT) and "left out" in msg and "['params'][0]" in msg, out
    assert out["bad_ranges"] == 0


@needs_fake
@needs_toolkit
def test_o4_refused_lr_edit_not_kept_by_a_joining_gpu_class(steps, tmp_path):
    """O4 (silently wrong): gpu_fraction with overlap=True, a GPU-class param
    frozen when the optimizer was built and unfrozen since, an lr edit
    between the marks and step(): step() first rebuilt the GPU class for
    the joining param, restoring every group's hyperparameters from
    param_groups (the edit included), then refused the edit (BAD_STATE).
    With the lr put back the next step() pushed nothing (nothing pending),
    and the GPU class stepped with the refused lr. Now the rebuild keeps
    the hyperparameters its native optimizer had: every step equals the
    same classes without overlap, bit for bit."""
    from zopt import steps as S
    paths = [steps.text(S.adamw.text(placement=pl, param="f32", clip=1.0)).path
             for pl in ("offload", "gpu", "cpu")]
    out = run_worker(__file__, "fraction_refuse", os.pathsep.join(paths[:2]), tmp_path,
                     ZOPT_FAKE_CUDA_TWIN=paths[2], ZOPT_FAKE_CUDA_ASYNC="1")
    assert out["refused"] and out["joined"], out
    assert out["same"] == [True] * 3, out
    assert out["bad_ranges"] == 0


def test_o5_streaming_param_unfrozen_after_build_steps_at_once(steps):
    """O5 (silently wrong, grad_streaming=True; O2's pattern in the other
    user of zopt._marks): a param frozen when the optimizer was built and
    unfrozen later had no hook in the next backward and counted as ready at
    once: its bucket was reduced before backward gave it a gradient, and
    the step left it alone (one update lost, its count one behind). Now it
    is ready at the end of backward: every step equals the optimizer
    without streaming, bit for bit (ZeRO-2 step, one rank)."""
    import overlap_fuzz as F
    from zopt import steps as S
    st = steps.text(S.adamw.text(param="f32", clip=1.0, zero_stage=2))
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(sh, generator=g) * 0.5 for sh in F.SHAPES]
    nets = [F.Net([w.clone() for w in init]) for _ in range(2)]
    for net in nets:
        F.plist(net)[0].requires_grad_(False)
    kw = dict(lr=1e-2, bucket_elems=64)
    oa = zopt.Optimizer(st, F.plist(nets[0]), grad_streaming=True, **kw)
    ob = zopt.Optimizer(st, F.plist(nets[1]), **kw)
    for it in range(3):
        if it == 1:
            for net in nets:
                F.plist(net)[0].requires_grad_(True)
        x = torch.randn(8, F.D, generator=g)
        for o, net in ((oa, nets[0]), (ob, nets[1])):
            o.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            o.step()
        assert [oa.tensor_step(p) for p in F.plist(nets[0])] == \
            [ob.tensor_step(p) for p in F.plist(nets[1])], it
        for p, q in zip(F.plist(nets[0]), F.plist(nets[1])):
            assert torch.equal(p, q), it
    for o in (oa, ob):
        o.close()


# ---- the workers (run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so) ----------------------

def _fraction_refuse(paths, tmp):
    import ctypes
    import overlap_fuzz as F
    off_path, gpu_path = paths.split(os.pathsep)
    s = StandIn()
    cuda_params()
    dev = device_tensors(s.fake)
    grads_on_device(dev)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(sh, generator=g) * 0.5 + 0.1 for sh in F.SHAPES]
    nets = [F.Net([dev(sh, w, torch.float32) for sh, w in zip(F.SHAPES, init)])
            for _ in range(2)]
    keep = []
    for net in nets:  # each new p.grad in fresh device memory
        of.grads_to_device(F.plist(net), lambda shape, gd: dev(shape, gd, torch.float32), keep)
        F.plist(net)[0].requires_grad_(False)  # frozen at build: the GPU class leaves it out
    opts = []
    for k, net in enumerate(nets):
        cl = zopt.steps.StepClasses({"f32": zopt.Step(off_path), "f32:gpu": zopt.Step(gpu_path)})
        cl.gpu_fraction = 0.5
        opts.append(zopt.Optimizer(cl, F.plist(net), lr=1e-2, bucket_elems=128,
                                   **(dict(overlap=True) if k == 0 else {})))

    def settle():
        assert s.fake.cuStreamSynchronize(ctypes.c_void_p(s.cur["s"])) == 0
        s.fake.fake_cuda_drain_all()
    out = {"same": [], "refused": False}
    for it in range(3):
        if it == 1:
            for net in nets:
                F.plist(net)[0].requires_grad_(True)
        x = torch.randn(8, F.D, generator=g)
        for o, net in zip(opts, nets):
            settle()
            o.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
        if it == 1:  # an lr edit between the marks and step(): refused, then put back
            a = opts[0]
            a.param_groups[0]["lr"] = 2e-2
            try:
                a.step()
            except zopt.ZoptError as e:
                out["refused"] = e.code == zopt.Status.BAD_STATE
            a.param_groups[0]["lr"] = 1e-2
        for o in opts:
            o.step()
        out["joined"] = opts[0].tensor_step(F.plist(nets[0])[0]) == it
        for o in opts:
            o.step_count()
        settle()
        out["same"].append(all(of.equal(p, q) for p, q in zip(F.plist(nets[0]),
                                                               F.plist(nets[1])))
                           and of.same_states(*opts))
    s.close_all(out, *opts)
    print(json.dumps(out))



def _fraction_slots(paths, tmp):
    off_path, gpu_path = paths.split(os.pathsep)
    s = StandIn()
    cuda_params()
    grads_on_device(device_tensors(s.fake))
    s.fake.fake_cuda_set_emulation(1, 0)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in (40, 24, 100)]

    def opt(frozen0):
        ps = [torch.nn.Parameter(torch.from_numpy(s.dev_array(w.numel(), w.numpy())))
              for w in init]
        ps[0].requires_grad_(not frozen0)
        cl = zopt.steps.StepClasses({"f32": zopt.Step(off_path), "f32:gpu": zopt.Step(gpu_path)})
        cl.gpu_fraction = 0.4
        o = zopt.Optimizer(cl, ps, lr=1e-2)
        for p in ps:
            if p.requires_grad:
                p.grad = torch.from_numpy(s.dev_array(p.numel(), 0.1))
        o.step()
        o.step_count()
        return o, ps
    out = {}
    o, ps = opt(True)
    out["classes"] = [o._class_of[id(p)] for p in ps]
    path = os.path.join(tmp, "ck")
    o.save(path)
    o2, ps2 = opt(True)  # built the same way: param 0 left out
    o2.load(path)
    out["same_built_loads"] = [o2.tensor_step(p) for p in ps2]
    o3, _ = opt(False)  # param 0 held: the file's left-out param differs
    try:
        o3.load(path)
        out["other_left_out"] = [0, "loaded"]
    except zopt.ZoptError as e:
        out["other_left_out"] = [int(e.code), str(e)]
    s.close_all(out, o, o2, o3)
    print(json.dumps(out))



def _slots(step_path, tmp):
    s = StandIn()
    s.grads_on_device()
    s.fake.fake_cuda_set_emulation(1, 0)
    st = zopt.Step(step_path)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in (33, 24)]

    def opt(frozen):
        ps = [torch.nn.Parameter(torch.from_numpy(s.dev_array(w.numel(), w.numpy())))
              for w in init]
        ps[1].requires_grad_(not frozen)
        o = zopt.Optimizer(st, ps, lr=1e-2)
        for p in ps:
            if p.requires_grad:
                p.grad = torch.from_numpy(s.dev_array(p.numel(), 0.1))
        o.step()
        o.step_count()
        return o

    def refused(saved_frozen, loading_frozen):
        path = os.path.join(tmp, f"ck{saved_frozen}")
        opt(saved_frozen).save(path)
        o = opt(loading_frozen)
        before = o.state_dict()
        try:
            o.load(path)
        except zopt.ZoptError as e:
            after = o.state_dict()
            same = sorted(before["state"]) == sorted(after["state"]) and all(
                torch.equal(before["state"][i][k], after["state"][i][k])
                for i in before["state"] for k in before["state"][i])
            return [int(e.code), str(e), bool(same)]
        return [0, "loaded", False]
    out = {"held_loads_left_out": refused(True, False),
           "left_out_loads_held": refused(False, True)}
    o = opt(True)
    o.load(os.path.join(tmp, "ckTrue"))  # the same params left out: loads
    out["same_frozen_loads"] = o.step_count() == 1
    s.close_all(out)
    print(json.dumps(out))




def _unfrozen(step_path):
    s, fake, dev, g, init = of.start()
    A = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # overlap
    B = [torch.nn.Parameter(dev(sh, w)) for sh, w in zip(of.SHAPES, init)]  # serial
    keep = []
    of.grads_to_device(A + B, dev, keep)
    for P in (A, B):
        P[0].requires_grad_(False)  # frozen when the optimizers are built
    st = zopt.Step(step_path)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_elems=1024)
    oa = zopt.Optimizer(st, A, overlap=True, **kw)
    ob = zopt.Optimizer(st, B, **kw)
    out = {"same": [], "counts": []}
    for frozen in (True, False, False, False):  # unfrozen before the second step
        for P in (A, B):
            P[0].requires_grad_(not frozen)
        x = torch.randn(8, 32, generator=g)
        for o in (oa, ob):
            o.zero_grad(set_to_none=True)
        fake.fake_cuda_drain_all()  # (B's forward reads its params on the host)
        of.backward(A, x, 1e-3)
        of.backward(B, x, 1e-3)
        oa.step()
        ob.step()
        out["same"].append(of.same_as(fake, oa, ob, A, B))
        out["counts"].append([oa.tensor_step(p) for p in A])
    of.finish(s, out, oa, ob)


if __name__ == "__main__":
    if sys.argv[1] == "slots":
        _slots(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "fraction_refuse":
        _fraction_refuse(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "fraction_slots":
        _fraction_slots(sys.argv[2], sys.argv[3])
    else:
        {"unfrozen": _unfrozen}[sys.argv[1]](sys.argv[2])

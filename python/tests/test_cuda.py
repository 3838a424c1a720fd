"""GPU steps through the Python bindings.

On a machine without a CUDA device the GPU tests are reported SKIPPED with
the reason "no CUDA device" (never passed). One test runs everywhere: on a
machine without a device it checks that a GPU step is refused with
ZOPT_ERR_UNSUPPORTED and a message naming CUDA.

test_adam_parity_gpu / test_adam_parity_offload run the CPU parity matrix
(test_adam_parity.MATRIX: 128 cells against the float64 reference, and
torch for f32) with the params/grads as torch CUDA tensors: every state on
the GPU, and params/grads on the GPU with the states on the CPU. On a GPU
machine without zopt-compile they run from ZOPT_TEST_STEP_CACHE, filled here
by bench/gpu/prepare_carry.sh (precompile_parity_steps below)."""
import ctypes
import math
import os
import warnings

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError
from test_adam_parity import MATRIX, adam_parity_case, case_id

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(REPO, "examples", "adamw_bf16_gpu.mlir")
CUDA_ROOT = os.environ.get("CUDA_HOME") or "/usr/local/cuda"


def _cuda_device():
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        return cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except OSError:
        return False


HAVE_GPU = _cuda_device() and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device")
needs_toolkit = pytest.mark.skipif(
    not os.path.exists(os.path.join(CUDA_ROOT, "bin", "ptxas")),
    reason="no CUDA toolkit (ptxas) to compile GPU steps")


def _compile(src, tmp_path, gpu=True):
    args = [f"--cuda-path={CUDA_ROOT}", "--gpu=sm_80,sm_90"] if gpu else []
    return zopt.compile(src, str(tmp_path / ("gpu.so" if gpu else "cpu.so")), extra_args=args)


@needs_toolkit
def test_gpu_step_refused_without_device(tmp_path):
    if HAVE_GPU:
        pytest.skip("has a CUDA device: covered by the tests below")
    step = zopt.Step(_compile(EXAMPLE, tmp_path))
    with pytest.raises(ZoptError) as e:
        zopt.Optimizer(step, [(np.zeros(4, np.uint16), np.zeros(4, np.uint16))])
    assert e.value.code == Status.UNSUPPORTED
    assert "CUDA" in str(e.value)


def _example_texts():
    gpu = open(EXAMPLE).read()
    return gpu, gpu.replace(" on gpu", " on cpu").replace(', gpu_arch = "sm_90"', "")


@needs_gpu
def test_bf16_master_matches_cpu_step(steps):
    gpu_text, cpu_text = _example_texts()
    gpu_step, cpu_step = steps.text(gpu_text), steps.text(cpu_text)
    torch.manual_seed(0)
    sizes = [1, 7, 17, 1000, 65537, 1000003]
    host = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    grads = [(torch.randn(n) * 1e-2).to(torch.bfloat16) for n in sizes]
    pc = [torch.nn.Parameter(h.clone()) for h in host]
    pg = [torch.nn.Parameter(h.clone().cuda()) for h in host]
    oc = zopt.Optimizer(cpu_step, pc, lr=1e-3, weight_decay=0.01)
    og = zopt.Optimizer(gpu_step, pg, lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        for a, b, g in zip(pc, pg, grads):
            a.grad = g.clone()
            b.grad = g.cuda()
        oc.step()
        norm_c, skipped_c = oc.step_result()
        og.step()
        norm_g, skipped_g, _ = og.gpu_result()
        assert skipped_c == skipped_g == False  # noqa: E712
        assert abs(norm_c - norm_g) <= 1e-9 * norm_c
    for i, (a, b) in enumerate(zip(pc, pg)):
        wa = oc.read_state(i, "master")
        wb = og.read_state(i, "master")
        np.testing.assert_allclose(wb, wa, rtol=1e-6, atol=1e-30)
        # bf16 params: within one bf16 ULP (as bit patterns).
        da = a.detach().view(torch.int16).numpy().astype(np.int32)
        db = b.detach().cpu().view(torch.int16).numpy().astype(np.int32)
        assert np.abs(da - db).max() <= 1


@needs_gpu
@pytest.mark.parametrize("case", MATRIX, ids=[case_id(c) for c in MATRIX])
def test_adam_parity_gpu(steps, case):
    adam_parity_case(steps, **case, placement="gpu")


@needs_gpu
@pytest.mark.parametrize("case", MATRIX, ids=[case_id(c) for c in MATRIX])
def test_adam_parity_offload(steps, case):
    adam_parity_case(steps, **case, placement="offload")


def _graph_case(steps):
    """An f32 AdamW step with clipping on the GPU and its CPU twin, over the
    same params, each with the same lr scheduler."""
    gpu_step = steps(rule="adamw", layout="f32", clip=1.0, placement="gpu")
    cpu_step = steps(rule="adamw", layout="f32", clip=1.0)
    torch.manual_seed(0)
    sizes = [7, 1000, 65537]
    host = [torch.randn(n) for n in sizes]
    grads = [[torch.randn(n) * 0.1 for n in sizes] for _ in range(5)]
    pc = [torch.nn.Parameter(h.clone()) for h in host]
    pg = [torch.nn.Parameter(h.cuda()) for h in host]
    oc = zopt.Optimizer(cpu_step, pc, lr=1e-2, weight_decay=0.01)
    og = zopt.Optimizer(gpu_step, pg, lr=1e-2, weight_decay=0.01)
    sc = torch.optim.lr_scheduler.LambdaLR(oc, lambda i: 0.5 ** i)
    sg = torch.optim.lr_scheduler.LambdaLR(og, lambda i: 0.5 ** i)
    return pc, pg, oc, og, sc, sg, grads


@needs_gpu
def test_graph_replays_on_another_stream_follow_the_lr_schedule(steps):
    """Captured under torch.cuda.graph, replayed on a third stream, with the
    scheduler stepping between replays on the default stream (no step()
    between replays): each replay uses the lr set before it, and
    gpu_result() right after a replay (no stream sync) is that replay's
    norm. Compared with the same schedule on the CPU twin."""
    pc, pg, oc, og, sc, sg, grads = _graph_case(steps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's docs ask
        for p, g in zip(pg, grads[0]):
            p.grad = g.cuda()
        og.step()
    torch.cuda.current_stream().wait_stream(side)
    for p, g in zip(pc, grads[0]):
        p.grad = g.clone()
    oc.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og.step()
        with pytest.raises(ZoptError, match="CUDA graph capture"):
            og.param_groups[0]["lr"] = 1.0
    assert og.param_groups[0]["lr"] == 1e-2
    replay = torch.cuda.Stream()
    for k in range(1, 5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sg.step()  # pushed now, on the default stream
            sc.step()
        # no wait_stream: the replay waits for the lr write by itself (the
        # captured step's event wait node)
        with torch.cuda.stream(replay):
            for p, g in zip(pg, grads[k]):
                p.grad.copy_(g.cuda())  # the captured step reads these buffers
            graph.replay()
        for p, g in zip(pc, grads[k]):
            p.grad = g.clone()
        oc.step()
        # on the default stream, nothing synchronized with `replay`
        norm_g, skipped_g, _ = og.gpu_result()
        norm_c, skipped_c = oc.step_result()
        assert not skipped_g and not skipped_c
        assert abs(norm_g - norm_c) <= 1e-9 * norm_c, (k, norm_g, norm_c)
    assert og.step_count() == oc.step_count() == 5
    torch.cuda.current_stream().wait_stream(replay)
    for a, b in zip(pc, pg):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)
    del graph  # before the optimizer (its buffers and events)
    og.close()


@needs_gpu
def test_gpu_step_memory_from_torch_allocator(steps):
    """device_allocator: torch's caching allocator by default (the states
    count in torch.cuda.memory_allocated()), cuMemAlloc with "driver"."""
    st = steps(rule="adamw", layout="f32", placement="gpu")
    n = 1 << 20
    states = 2 * 4 * n  # exp_avg, exp_avg_sq
    torch.cuda.synchronize()
    p = torch.nn.Parameter(torch.randn(n, device="cuda"))
    m0 = torch.cuda.memory_allocated()
    o = zopt.Optimizer(st, [p], lr=1e-3)
    assert torch.cuda.memory_allocated() - m0 >= states
    o.close()
    m1 = torch.cuda.memory_allocated()
    o = zopt.Optimizer(st, [p], lr=1e-3, device_allocator="driver")
    assert torch.cuda.memory_allocated() - m1 < states
    p.grad = torch.randn(n, device="cuda")
    o.step()
    assert o.step_count() == 1
    o.close()


OFFLOAD_6B = os.path.join(REPO, "examples", "adamw_bf16_offload_6b.mlir")


@needs_gpu
def test_overlap_offload_from_backward_matches_serial(steps):
    """overlap=True on a GPU (docs/USAGE.md section 5): a small MLP's
    backward marks every bucket of the 6-byte cell's offloaded step from
    its hooks; params and states bit-identical to the same optimizer
    without overlap (given clones of the same grads) through commit,
    recompute (clipping active) and discard (an inf)."""
    step = steps.text(open(OFFLOAD_6B).read())

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                   torch.nn.Linear(256, 64)).cuda().bfloat16()
    ma, mb = mlp(), mlp()
    pa, pb = list(ma.parameters()), list(mb.parameters())
    kw = dict(lr=1e-3, weight_decay=0.01, bucket_elems=8192)
    oa = zopt.Optimizer(step, pa, overlap=True, **kw)
    ob = zopt.Optimizer(step, pb, **kw)
    ov = oa._overlap
    assert ov.nb >= 3
    for scale, inf, want in [(1e-3, False, "commit"), (1e3, False, "recompute"),
                             (1e-3, True, "discard"), (1e-3, False, "commit")]:
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
        h = pa[1].register_hook(lambda g: g.index_fill(0, torch.tensor([3], device=g.device),
                                                       float("inf"))) if inf else None
        (ma(x).float().square().mean() * scale).backward()
        if h is not None:
            h.remove()
        assert ov.nmarked == ov.nb  # marked during backward
        for a, b in zip(pa, pb):
            b.grad = a.grad.clone()
        oa.step()
        ob.step()
        torch.cuda.synchronize()
        st = oa.pipeline_stats()
        assert st["outcome"] == want and st["buckets"] == ov.nb, st
        assert oa.last_skipped == ob.last_skipped == inf
        for a, b in zip(pa, pb):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sb for k in sb[i])


@needs_gpu
def test_clip_grad_norm_on_a_gpu_step_matches_the_cpu_step(steps):
    """opt.clip_grad_norm_(max_norm) on a GPU step (the kernels read the
    runtime's max_norm from the device) and on its CPU twin: the same norm,
    the step clipped at max_norm (compiled 1.0 would not clip) on both."""
    gpu_step = steps(rule="sgd", layout="f32", clip=1.0, placement="gpu")
    cpu_step = steps(rule="sgd", layout="f32", clip=1.0)
    torch.manual_seed(0)
    sizes = [7, 1000, 65537]
    host = [torch.randn(n) for n in sizes]
    pc = [torch.nn.Parameter(h.clone()) for h in host]
    pg = [torch.nn.Parameter(h.clone().cuda()) for h in host]
    oc, og = zopt.Optimizer(cpu_step, pc, lr=0.5), zopt.Optimizer(gpu_step, pg, lr=0.5)
    for k in range(3):
        grads = [torch.randn(n) * 1e-2 for n in sizes]
        for a, b, g in zip(pc, pg, grads):
            a.grad, b.grad = g.clone(), g.cuda()
        m = 0.1 * 0.5 ** k
        nc, ng = oc.clip_grad_norm_(m), og.clip_grad_norm_(m)
        assert float(nc) > 2 * m and float(ng) == pytest.approx(float(nc), rel=1e-6)
        oc.step()
        og.step()
        norm_g, skipped_g, _ = og.gpu_result()
        assert not skipped_g and norm_g == pytest.approx(oc.step_result()[0], rel=1e-9)
    for a, b in zip(pc, pg):
        np.testing.assert_allclose(b.detach().cpu().numpy(), a.detach().numpy(), rtol=1e-6, atol=1e-7)


@needs_gpu
def test_frozen_params_left_out_and_unfrozen_like_torch(steps):
    """A model with a frozen weight in model.parameters() (LoRA's base
    weights, frozen embeddings) on a GPU step, beside torch.optim.AdamW on
    the same GPU: the frozen weight is left out (unchanged, no state), the
    others match torch; unfrozen after 4 steps it is stepped from zero
    states and step 0 (its own count on the device: the kernels' bias
    correction uses step 1, 2, ... for it while its param group is at 5,
    6, ...), as torch's lazily created state; a param that requires grad
    but has no gradient at a step is left alone (the device's mask), as
    torch does."""
    st = steps(rule="adamw", layout="f32", placement="gpu")

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 10)).cuda()
        m[0].weight.requires_grad_(False)
        return m

    def train(m, o, i):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(32, 64, generator=g).cuda(), torch.randn(32, 10, generator=g).cuda()
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()

    def close(a, b):
        for p, q in zip(a, b):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-6)

    mz, mt = build(), build()
    oz = zopt.Optimizer(st, mz.parameters(), lr=1e-2, weight_decay=0.1)
    ot = torch.optim.AdamW(mt.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    w, wt = mz[0].weight, mt[0].weight
    w0 = w.detach().clone()
    for i in range(4):
        train(mz, oz, i)
        train(mt, ot, i)
    torch.cuda.synchronize()
    assert torch.equal(w, w0) and oz.state[w] == {} and w.grad is None
    close(mz.parameters(), mt.parameters())
    w.requires_grad_(True)
    wt.requires_grad_(True)
    for i in range(4, 8):
        train(mz, oz, i)
        train(mt, ot, i)
        close(mz.parameters(), mt.parameters())
    assert oz.rebuilds == 1 and oz.step_count() == 8
    assert float(oz.state[w]["step"]) == float(ot.state[wt]["step"]) == 4
    close([oz.state[w]["exp_avg"], oz.state[w]["exp_avg_sq"]],
          [ot.state[wt]["exp_avg"], ot.state[wt]["exp_avg_sq"]])
    # a requires_grad param without a gradient: left alone, as torch does
    for m in (mz, mt):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        m[2].bias.grad = None
    before = mz[2].bias.detach().clone()
    oz.step()
    ot.step()
    torch.cuda.synchronize()
    assert torch.equal(before, mz[2].bias)
    close(mz.parameters(), mt.parameters())
    assert oz.tensor_step(mz[2].bias) == 8 and oz.tensor_step(mz[2].weight) == 9
    oz.close()


@needs_gpu
def test_gpu_fraction_steps_as_one_with_the_offloaded_class(steps):
    """gpu_fraction on a GPU (docs/USAGE.md "Part of the params' step on the
    GPU"): the first-added params' step on the GPU, the rest offloaded, one
    linked step. Against the all-offloaded optimizer over the same params
    and gradients (random multiples of 1/64, times 2^-10 or 1: their
    squares' sums are exact, so the norms agree bit for bit): the same
    norm, clip and skip decisions (an inf in either class skips both), the
    same step counts; the params within the GPU's rounding of the CPU's."""
    gpu = steps(rule="adamw", layout="f32", clip=1.0, placement="gpu")
    off = steps(rule="adamw", layout="f32", clip=1.0, placement="offload")
    classes = zopt.steps.StepClasses({"f32": off, "f32:gpu": gpu})
    classes.gpu_fraction = 0.3
    torch.manual_seed(0)
    sizes = [700, 1300, 3000, 33, 2967]
    host = [torch.randn(n) for n in sizes]
    pa = [torch.nn.Parameter(h.clone().cuda()) for h in host]
    pb = [torch.nn.Parameter(h.clone().cuda()) for h in host]
    oa = zopt.Optimizer(classes, pa, lr=1e-2, weight_decay=0.1)
    ob = zopt.Optimizer(off, pb, lr=1e-2, weight_decay=0.1)
    assert [oa._class_of[id(p)] for p in pa] == ["f32:gpu"] * 2 + ["f32"] * 3
    assert oa.gpu_fraction == 0.25
    g = torch.Generator().manual_seed(1)
    for scale, bad in ((2.0 ** -10, None), (1.0, None), (2.0 ** -10, 1), (2.0 ** -10, 3),
                       (2.0 ** -10, None)):
        xs = [torch.randint(-256, 256, (n,), generator=g).float() / 64 * scale for n in sizes]
        if bad is not None:
            xs[bad][7] = float("inf")
        for o, ps in ((oa, pa), (ob, pb)):
            o.zero_grad(set_to_none=True)
            for p, x in zip(ps, xs):
                p.grad = x.cuda()
            o.step()
        torch.cuda.synchronize()
        assert oa.last_grad_norm == ob.last_grad_norm or (bad is not None and
                                                          math.isinf(oa.last_grad_norm))
        assert oa.last_skipped == ob.last_skipped == (bad is not None)
        assert (oa.last_grad_norm > 1.0) == (scale == 1.0 and bad is None)
        assert [oa.tensor_step(p) for p in pa] == [ob.tensor_step(p) for p in pb]
        for a, b in zip(pa, pb):
            np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(),
                                       rtol=1e-6, atol=1e-7)
    oa.close()
    ob.close()


def precompile_parity_steps(cache_dir):
    """Records every step the GPU tests above use into cache_dir (the
    ZOPT_TEST_STEP_CACHE recording cache, zopt_stepcache.py); returns how
    many. Needs zopt-compile and the CUDA toolkit: run it where the compiler
    is, carry the folder. Where there is no compiler it checks instead that
    every one is in the cache (a missing one skips: pytest.skip's exception
    names it)."""
    import tempfile
    import zopt_stepcache
    from conftest import StepCache
    zopt_stepcache.install(cache_dir)
    cache = StepCache(tempfile.mkdtemp(prefix="zopt-parity-"))
    keys = ("rule", "amsgrad", "layout", "clip")
    for placement in ("gpu", "offload"):
        for c in MATRIX:
            cache(**{k: c[k] for k in keys}, placement=placement)
    for text in _example_texts():
        cache.text(text)
    cache.text(open(OFFLOAD_6B).read())  # test_overlap_offload_from_backward_matches_serial
    for placement in ("gpu", "cpu", "offload"):  # _graph_case, the allocator test, gpu_fraction
        cache(rule="adamw", layout="f32", clip=1.0, placement=placement)
    cache(rule="adamw", layout="f32", placement="gpu")
    import shutil
    shutil.rmtree(cache.root, ignore_errors=True)
    return len(cache.steps)


if __name__ == "__main__":
    import sys
    try:
        print(f"{precompile_parity_steps(sys.argv[1])} steps in {sys.argv[1]}")
    except pytest.skip.Exception as e:  # no compiler here, and a step is missing
        sys.exit(f"test_cuda.py's steps: {e.msg}")

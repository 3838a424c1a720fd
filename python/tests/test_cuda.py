"""GPU steps through the Python bindings.

On a machine without a CUDA device the GPU tests are reported SKIPPED with
the reason "no CUDA device" (never passed). One test runs everywhere: on a
machine without a device it checks that a GPU step is refused with
ZOPT_ERR_UNSUPPORTED and a message naming CUDA."""
import ctypes
import os

import numpy as np
import pytest
import torch

import zopt
from zopt._lib import Status, ZoptError

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


@needs_gpu
@needs_toolkit
def test_bf16_master_matches_cpu_step(tmp_path):
    gpu_so = _compile(EXAMPLE, tmp_path)
    cpu_src = open(EXAMPLE).read().replace(" on gpu", " on cpu").replace(', gpu_arch = "sm_90"', "")
    cpu_so = _compile(cpu_src, tmp_path, gpu=False)
    torch.manual_seed(0)
    sizes = [1, 7, 17, 1000, 65537, 1000003]
    host = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    grads = [(torch.randn(n) * 1e-2).to(torch.bfloat16) for n in sizes]
    pc = [torch.nn.Parameter(h.clone()) for h in host]
    pg = [torch.nn.Parameter(h.clone().cuda()) for h in host]
    oc = zopt.Optimizer(zopt.Step(cpu_so), pc, lr=1e-3, weight_decay=0.01)
    og = zopt.Optimizer(zopt.Step(gpu_so), pg, lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        for a, b, g in zip(pc, pg, grads):
            a.grad.copy_(g)
            b.grad.copy_(g.cuda())
        norm_c, skipped_c = oc.step()
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

"""The overlap fuzzer (python/tests/overlap_fuzz.py; docs/TESTING.md "The
overlap fuzzer"): one seeded random sequence of training-script actions
applied to an offloaded optimizer with ``overlap=True`` (with and without
``model=``), the same optimizer without overlap and the CPU twin, and to a
GPU step on the stand-in driver (ZOPT_FAKE_CUDA_TWIN) and its CPU twin;
every param and state element compared bit for bit after the actions.

ZOPT_FUZZ_CASES (default 8 per world; 2 at 2 gloo ranks), ZOPT_FUZZ_SEED and
ZOPT_FUZZ_ACTIONS (default 25) pick the cases; ZOPT_FUZZ_MAX_FAIL how many
failing cases a worker reports before it stops (default 1)."""
import os

import pytest

from gpu_fakes import needs_fake, needs_toolkit, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "overlap_fuzz.py")

# name (rule:param[:f32grad]) -> the builder's options (clip 1.0 everywhere)
OVERLAP = {
    "adamw:bf16": dict(param="bf16", master="f32"),
    "adamw:bf16:f32grad": dict(param="bf16", grad="f32", master="f32"),
    "sgd:f32": dict(param="f32"),
    "adamw:f16": dict(param="f16", master="f32"),
}
# one per worker: ZOPT_FAKE_CUDA_TWIN names the one CPU twin the stand-in runs
GPU = {"adamw:f32": dict(param="f32"), "adamw:bf16": dict(param="bf16", master="f32")}
FRACTION = {"adamw:f32": dict(param="f32")}
# grad_streaming=True (CPU-updated ZeRO-2 / ZeRO-3 steps, gradients in the
# param's dtype) against the same step without: every stage of each
STREAM = {"adamw:bf16": dict(param="bf16", master="f32"), "sgd:f32": dict(param="f32"),
          "adamw:f16": dict(param="f16", master="f32")}


def _paths(steps, table, placement, with_gpu=False):
    from zopt import steps as S
    out = []
    for name, kw in table.items():
        rule = getattr(S, name.split(":")[0])
        dev = steps.text(rule.text(placement=placement, clip=1.0, **kw))
        cpu = steps.text(rule.text(clip=1.0, **kw))
        out.append(f"{name}={dev.path}={cpu.path}")
        if with_gpu:  # the GPU twin class of gpu_fraction
            out[-1] += "=" + steps.text(rule.text(placement="gpu", clip=1.0, **kw)).path
    return ";".join(out), cpu.path


def _stream_paths(steps):
    from zopt import steps as S
    out = []
    for name, kw in STREAM.items():
        rule = getattr(S, name.split(":")[0])
        z0 = steps.text(rule.text(clip=1.0, **kw)).path  # the ZeRO-0 copy's
        for stage in (2, 3):
            path = steps.text(rule.text(clip=1.0, zero_stage=stage, **kw)).path
            out.append(f"{name}:z{stage}={path}={z0}")
    return ";".join(out)


def _check(out):
    assert out["failures"] == [], "\n".join(
        f"case seed {f['seed']}:\n  " + "\n  ".join(f["log"]) + f"\n{f['error']}\n{f['trace']}"
        for f in out["failures"])
    assert out["bad_ranges"] == 0


@needs_fake
def test_overlap_fuzz(steps, tmp_path):
    paths, _ = _paths(steps, OVERLAP, "offload")
    out = run_worker(WORKER, "overlap", paths, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1")
    _check(out)


@needs_fake
@needs_toolkit
@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_twin_fuzz(steps, tmp_path, name):
    paths, cpu = _paths(steps, {name: GPU[name]}, "gpu")
    out = run_worker(WORKER, "gpu", paths, tmp_path, ZOPT_FAKE_CUDA_TWIN=cpu)
    _check(out)


@needs_fake
@needs_toolkit
def test_gpu_fraction_overlap_fuzz(steps, tmp_path):
    """gpu_fraction's two classes (offloaded + its GPU twin, one linked step):
    with overlap=True (and model=) against the same classes without."""
    paths, cpu = _paths(steps, FRACTION, "offload", with_gpu=True)
    out = run_worker(WORKER, "fraction", paths, tmp_path, ZOPT_FAKE_CUDA_TWIN=cpu,
                     ZOPT_FAKE_CUDA_ASYNC="1")
    _check(out)


def test_stream_fuzz(steps, tmp_path):
    """grad_streaming=True at one rank (ZeRO-2 and ZeRO-3) against the same
    step without streaming (stream_fuzz.py; no stand-in driver)."""
    out = run_worker(WORKER, "stream", _stream_paths(steps), tmp_path)
    _check(out)


def test_stream_fuzz_two_gloo_ranks(steps, tmp_path):
    """The streaming world at 2 gloo ranks (every rank the same actions,
    its own batches; the loose param left out of a backward on rank 1
    only): each rank's S against its C. Hard timeout, killed on failure."""
    import json
    import sys
    from test_comm import _free_port, _run_all, _runtime_env
    env = dict(_runtime_env(), ZOPT_FUZZ_WORLD="2", ZOPT_FUZZ_PORT=str(_free_port()),
               ZOPT_FUZZ_CASES=os.environ.get("ZOPT_FUZZ_CASES", "2"))
    paths = _stream_paths(steps)
    cmds = [["env", f"ZOPT_FUZZ_RANK={r}", sys.executable, WORKER, "stream", paths,
             str(tmp_path)] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=240, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
        _check(json.loads(out.strip().splitlines()[-1]))


@needs_fake
def test_the_harness_can_fail(steps, tmp_path):
    """The copy under test given a gradient 1% off (l2.bias, from the
    worker's ZOPT_FUZZ_BREAK=1): the first check after a step fails, naming
    a param or state element that differs from the CPU twin's."""
    paths, _ = _paths(steps, OVERLAP, "offload")
    out = run_worker(WORKER, "overlap", paths, tmp_path, ZOPT_FAKE_CUDA_ASYNC="1",
                     ZOPT_FUZZ_BREAK="1", ZOPT_FUZZ_CASES="3", ZOPT_FUZZ_MAX_FAIL="3")
    assert len(out["failures"]) == 3, out
    assert all("differs from C's" in f["error"] for f in out["failures"]), out["failures"]


def test_the_stream_harness_can_fail(steps, tmp_path):
    """The same for the streaming world: S's l2.bias gradient 1% off (a
    param, a state element or the norm clip_grad_norm_ returns differs)."""
    out = run_worker(WORKER, "stream", _stream_paths(steps), tmp_path, ZOPT_FUZZ_BREAK="1",
                     ZOPT_FUZZ_CASES="3", ZOPT_FUZZ_MAX_FAIL="3")
    assert len(out["failures"]) == 3, out
    assert all("differs from C's" in f["error"] or "Fail: clip_grad_norm_: [" in f["error"]
               for f in out["failures"]), out["failures"]

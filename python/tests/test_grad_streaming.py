"""zopt.Optimizer(..., grad_streaming=True): ZeRO-2/3 gradients handed to the
runtime bucket by bucket during backward (zopt_optimizer_reduce_bucket) and
freed once reduced (python/zopt/streaming.py).

On 2 gloo processes (stream_worker.py, hard timeout, killed on failure) and
in one process (world size 1): a small bf16 MLP of several buckets, ZeRO-2
and ZeRO-3, trained 4 steps with and without streaming gives bit-identical
params, global norms and step counts after every step; every p.grad is None
after step(); during a streamed backward of one micro-batch the gradient
elements alive stay within one bucket plus the largest tensor; two
micro-batches accumulated with opt.no_sync() equal the non-streamed
accumulation; a layer unused on one rank only (its bucket reduced at the
end of that rank's backward). Also: frozen params and unused params at
world size 1, the refusals, misuse (a second backward, zero_grad between
backward and step, a group added after the reduction), rebuilds
(p.data = ..., add_param_group)."""
import os
import sys

import numpy as np
import pytest
import torch

import zopt
from stream_worker import BUCKET, LR, WD, stream_model, train
from test_comm import _free_port, _run_all, _runtime_env
from zopt.describe import describe

HERE = os.path.dirname(os.path.abspath(__file__))


def _text(stage, layout="bf16_master"):
    return describe("adamw", layout=layout, clip=1.0, attributes={"zero_stage": stage})


def _same(a, b):
    a, b = a.detach(), b.detach()
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


def _loss(model, s, skip=False):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    y = torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x, skip_extra=skip).float(), y)


def _pair(step, **kw):
    """(model, non-streamed optimizer), (model, streamed optimizer)."""
    a, b = stream_model(), stream_model()
    kw = dict(lr=LR, weight_decay=WD, bucket_elems=BUCKET, **kw)
    return ((a, zopt.Optimizer(step, a.parameters(), **kw)),
            (b, zopt.Optimizer(step, b.parameters(), grad_streaming=True, **kw)))


def test_two_gloo_ranks_streamed_equals_non_streamed(steps):
    sos = {"z2": steps.text(_text(2)).path, "z3": steps.text(_text(3)).path}
    port = _free_port()
    cmds = [[sys.executable, os.path.join(HERE, "stream_worker.py"), str(r), "2", str(port),
             *[f"{c}={so}" for c, so in sos.items()]] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=240, env=_runtime_env())
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
        for case in sos:
            assert f"ok {case} rank {r}" in out, out
    # rank 1 skipped a layer at step 2: its buckets from there were reduced
    # at the end of its backward, rank 0's during backward
    nb = 8  # buckets of the model (stream_worker.StreamNet)
    assert f"z2: step 0 rank 1: identical" in outs[1] and f"at its end ({nb}, 0)" in outs[1]
    assert "step 2 rank 1: identical" in outs[1] and f"at its end ({nb}, 0)" not in \
        outs[1].split("z2: step 2 rank 1")[1].splitlines()[0], outs[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_streamed_equals_non_streamed(steps, stage):
    out = train(steps.text(_text(stage)), 0, 1, log=lambda m: None)
    assert out["nb"] == 8
    assert out["peaks"][0] <= out["bound"] < out["total"] / 2, out
    assert out["stats"] == [(8, 0)] * 4, out


def test_unused_and_frozen_params_one_rank(steps):
    """A layer unused in the graph (no gradient: not updated, its step count
    stays) and a frozen layer (requires_grad=False: nothing to wait for, so
    every bucket is still reduced during backward)."""
    (ma, a), (mb, b) = _pair(steps.text(_text(2)))
    st = b._streamer
    for m in (ma, mb):
        m.layers[1].requires_grad_(False)
    for s in range(3):
        skip = s == 1
        for m, o in ((ma, a), (mb, b)):
            o.zero_grad(set_to_none=True)
            before = dict(st.stats)
            _loss(m, s, skip).backward()
            if o is b:
                at_end = st.stats["at_backward_end"] - before["at_backward_end"]
                assert (at_end > 0) == skip, (s, st.stats, before)
            o.step()
        for x, y in zip(ma.parameters(), mb.parameters()):
            assert _same(x, y), s
        assert all(p.grad is None for p in mb.parameters())
        assert [a.tensor_step(t) for t in range(a.num_tensors)] == \
            [b.tensor_step(t) for t in range(b.num_tensors)]
    assert b.tensor_step(mb.layers[1].weight) == 0
    assert b.tensor_step(mb.layers[4].weight) == 2  # unused at step 1


def test_no_sync_without_streaming_is_a_no_op(steps):
    (m, a), _ = _pair(steps.text(_text(2)))
    with a.no_sync():
        _loss(m, 0).backward()
    assert all(p.grad is not None for p in m.parameters())
    a.step()


def test_refusals(steps):
    m = stream_model()
    for stage in (0, 1):
        with pytest.raises(zopt.ZoptError, match="zero_stage = %d" % stage):
            zopt.Optimizer(steps.text(_text(stage)), m.parameters(), grad_streaming=True)
    f32g = steps.text(zopt.steps.adamw.text(param="bf16", master="f32", grad="f32",
                                            zero_stage=2))
    with pytest.raises(zopt.ZoptError, match="f32 gradients"):
        zopt.Optimizer(f32g, m.parameters(), grad_streaming=True)
    f32 = steps.text(_text(2, "f32"))
    p = np.zeros(4, np.float32)
    with pytest.raises(zopt.ZoptError, match="pass the params alone"):
        zopt.Optimizer(f32, [(p, np.zeros_like(p))], grad_streaming=True)
    with pytest.raises(zopt.ZoptError, match="not for a step per dtype"):
        zopt.Optimizer({"bf16": steps.text(_text(2))}, m.parameters(), grad_streaming=True)


def test_misuse_raises_and_recovers(steps):
    (ma, a), (mb, b) = _pair(steps.text(_text(2)))
    _loss(mb, 0).backward()        # streamed: every bucket reduced, grads freed
    assert all(p.grad is None for p in mb.parameters())
    with pytest.raises(zopt.ZoptError, match="second backward"):
        _loss(mb, 1).backward()
    with pytest.raises(zopt.ZoptError, match="zero_grad"):
        b.zero_grad()
    for p in mb.parameters():      # what the failed backward left
        p.grad = None
    b.step()
    _loss(ma, 0).backward()
    a.step()
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert _same(x, y)
    # a param group added after the reduction (the native optimizer grown):
    # the shards are lost (params given new memory keep them: test_stream_finds.py S1)
    _loss(mb, 2).backward()
    b.add_param_group({"params": [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]})
    with pytest.raises(zopt.ZoptError, match="rebuilt"):
        b.step()


def test_rebuilds_and_gradients_set_by_hand(steps):
    """p.data = ... before a backward (the native optimizer rebuilt at the
    first reduction), add_param_group, and gradients assigned without a
    backward (reduced at step()): all as the non-streamed optimizer."""
    (ma, a), (mb, b) = _pair(steps.text(_text(2)))
    extra = [torch.nn.Parameter(torch.full((3000,), 0.5, dtype=torch.bfloat16))
             for _ in range(2)]
    for s in range(4):
        for m, o, x in ((ma, a, extra[0]), (mb, b, extra[1])):
            if s == 1:
                with torch.no_grad():
                    for p in m.parameters():
                        p.data = p.data.clone()
            if s == 2:
                o.add_param_group({"params": [x], "lr": 0.1})
            o.zero_grad(set_to_none=True)
            if s >= 2:  # (before backward: a streamed backward ends with every bucket reduced)
                x.grad = torch.full_like(x, 0.25)
            if s == 3:
                for i, p in enumerate(m.parameters()):
                    p.grad = torch.full_like(p, 0.01 * (i + 1))
            else:
                _loss(m, s).backward()
            o.step()
        for x, y in zip(list(ma.parameters()) + extra[:1], list(mb.parameters()) + extra[1:]):
            assert _same(x, y), s
        assert all(p.grad is None for p in list(mb.parameters()) + extra[1:])
    assert b.rebuilds == a.rebuilds == 2
    assert b._streamer.stats["at_step"] > 0

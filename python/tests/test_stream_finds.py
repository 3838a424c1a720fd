"""What the overlap fuzzer's streaming world (python/tests/stream_fuzz.py;
docs/TESTING.md "The overlap fuzzer", findings S1, ...) found in
``grad_streaming=True``, minimized: each test failed before its fix."""
import os
import sys

import pytest
import torch

import zopt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from overlap_fuzz_model import SHAPES, Net, plist, same_t  # noqa: E402


def _pair(steps, stage):
    """Two copies of the fuzzer's model (bf16): (net, the step without
    streaming), (net, the same step with grad_streaming=True)."""
    step = steps.text(zopt.steps.adamw.text(param="bf16", master="f32", clip=1.0,
                                            zero_stage=stage))
    g = torch.Generator().manual_seed(5)
    init = [(torch.randn(sh, generator=g) * 0.5 + 0.1).to(torch.bfloat16) for sh in SHAPES]
    out = []
    for streamed in (False, True):
        net = Net([t.clone() for t in init])
        out.append((net, zopt.Optimizer(step, plist(net)[:4], lr=1e-2, weight_decay=0.1,
                                         bucket_elems=64, grad_streaming=streamed)))
    return out


def _backward(net, seed, extra=False):
    g = torch.Generator().manual_seed(seed)
    net(torch.randn(8, 16, generator=g)).square().mean().backward()
    if not extra:
        net.extra.grad = None  # (not in the optimizer)


def _same(a, b):
    (na, oa), (nb, ob) = a, b
    for p, q in zip(plist(na), plist(nb)):
        assert same_t(p, q)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert same_t(x, y) if torch.is_tensor(x) else x == y, (i, k)


@pytest.mark.parametrize("stage", [2, 3])
def test_s1_params_given_new_memory_after_a_streamed_backward(steps, stage):
    """S1: every param given new memory (``p.data = p.data.clone()``) between
    a streamed backward and ``step()``. ZeRO-2 registers the new memory in
    place (the native optimizer and the shards it reduced stay), but
    ``step()`` took any re-registration for a new native optimizer: it
    refused "the native optimizer was rebuilt ... run the backward again",
    and from then on every backward and step failed ("bucket 0 was already
    reduced since the last step"): the optimizer was stuck for good. Now
    the reduced shards are kept (as ZeRO-3 did): the step and the ones after
    it equal the non-streamed optimizer's."""
    a, b = _pair(steps, stage)
    for s in range(3):
        for net, o in (a, b):
            o.zero_grad(set_to_none=True)
            _backward(net, s)
            if s == 1:
                with torch.no_grad():
                    for p in plist(net):
                        p.data = p.data.clone()
            o.step()
        assert all(p.grad is None for p in plist(b[0]))
        _same(a, b)


def test_s1_a_group_added_after_a_streamed_backward_refuses_then_recovers(steps):
    """The refusal S1 kept for what does lose the reduced shards (a param
    group added: the native optimizer grown): BAD_STATE naming it, then the
    backward run again steps as the non-streamed optimizer."""
    a, b = _pair(steps, 2)
    for net, o in (a, b):
        _backward(net, 0)
        o.add_param_group(dict(params=[net.extra], lr=3e-2))
    with pytest.raises(zopt.ZoptError, match="rebuilt .*run the backward again"):
        b[1].step()
    for s in range(2):  # the backward again (the extra param's gradient in the step now)
        for net, o in (a, b):
            o.zero_grad(set_to_none=True)
            _backward(net, s, extra=True)
            o.step()
        _same(a, b)


@pytest.mark.parametrize("streamed", [False, True])
def test_s2_zero3_a_param_added_in_the_memory_a_moved_param_left(steps, streamed):
    """S2 (ZeRO-3, streamed or not): a param given new memory (``p.data =
    new``) stayed registered in the runtime at its old storage (ZeRO-3
    never reads it after finalize, so the move was not registered); a param
    added later in that storage (the old tensor reused, or the allocator
    handing its memory out again, as the fuzzer hit at random) was refused
    by ``add_param_group``: "param pointer ... is already registered". Now
    the move is registered in place as at the other stages: it is added
    and every step equals the same steps of ZeRO-0."""
    z3 = steps.text(zopt.steps.sgd.text(param="f32", clip=1.0, zero_stage=3))
    z0 = steps.text(zopt.steps.sgd.text(param="f32", clip=1.0))
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(8, generator=g) for _ in range(3)]
    grads = [[torch.randn(8, generator=g) for _ in range(3)] for _ in range(3)]
    runs = []
    for step, st in ((z0, False), (z3, streamed)):
        ps = [torch.nn.Parameter(t.clone()) for t in init[:2]]
        o = zopt.Optimizer(step, ps, lr=1e-2, momentum=0.9, grad_streaming=st)
        for s in range(3):
            if s == 1:
                old = ps[0].data
                ps[0].data = old.clone().mul_(0.5)  # ps[0] moves (new values); its old storage ...
                x = torch.nn.Parameter(old)  # ... becomes the added param's
                with torch.no_grad():
                    x.copy_(init[2])
                o.add_param_group(dict(params=[x], lr=3e-2))
                ps.append(x)
            for p, gr in zip(ps, grads[s]):
                p.grad = gr.clone()
            o.step()
        runs.append(ps)
    for p, q in zip(*runs):
        assert same_t(p, q)


def test_s3_zero3_two_ranks_a_param_back_in_its_registered_storage_on_one_rank(steps):
    """S3 (ZeRO-3, several ranks; the streaming fuzzer at 2 gloo ranks): a
    param given new memory on every rank is written into the runtime's
    held shard and master from its current storage (a collective read of
    the master) unless its storage is the registered one (then the
    runtime refreshes from there, locally). On one rank the new storage
    was, by the allocator's chance, the registered one again: that rank
    refreshed otherwise than the other, a collective mismatch (ZoptError
    COMM) in the next call. Fixed with S2: the new storage is registered
    on every rank, so every rank's record follows its storage.
    Rank 1 puts the param back into its registered storage on purpose;
    both ranks' params equal the same steps' over params moved plainly."""
    from test_comm import _free_port, _run_all, _runtime_env
    so = steps.text(zopt.steps.adamw.text(param="bf16", master="f32", clip=1.0,
                                          zero_stage=3)).path
    port = _free_port()
    cmds = [[sys.executable, os.path.abspath(__file__), "s3", str(r), str(port), so]
            for r in range(2)]
    procs, outs = _run_all(cmds, timeout=90, env=_runtime_env())
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"


def _s3_rank(rank, port, so):
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(8, generator=g).to(torch.bfloat16) for _ in range(2)]
    grads = [[torch.randn(8, generator=g).to(torch.bfloat16) for _ in range(2)]
             for _ in range(3)]
    step = zopt.Step(so)
    ps, qs = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    o, oq = (zopt.Optimizer(step, x, lr=1e-2, weight_decay=0.1, process_group=dist.group.WORLD)
             for x in (ps, qs))
    keep = None
    for s in range(3):
        with torch.no_grad():
            if s == 1:
                keep = ps[0].data  # the registered storage (rank 1 keeps it)
                ps[0].data = keep.clone()
                qs[0].data = qs[0].data.clone()
            if s == 2:
                if rank == 1:  # back into the registered storage
                    keep.copy_(ps[0].data)
                    ps[0].data = keep
                else:
                    ps[0].data = ps[0].data.clone()
                qs[0].data = qs[0].data.clone()
        for x, opt in ((ps, o), (qs, oq)):
            for p, gr in zip(x, grads[s]):
                p.grad = gr.clone()
            opt.step()
    for p, q in zip(ps, qs):
        assert same_t(p, q), (p, q)
    print(f"DONE rank {rank}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "s3":
        _s3_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""The shared worker setup of the offload-overlap tests (test_offload_overlap*.py,
test_early_params.py), run with ZOPT_CUDA_DRIVER=libzopt-fake-cuda.so: the
stand-in's memory as CUDA params, tensors and gradient buffers in stand-in
device memory (gpu_fakes.py's), the small two-layer bf16 model, the hook that moves each new
``p.grad`` to device memory, and the bit-for-bit comparison of two
optimizers' params and states."""
import json
import os

import torch
import torch.distributed as dist

from gpu_fakes import StandIn, cuda_params, device_tensors, grads_on_device

SHAPES = [(64, 32), (64,), (16, 64), (16,)]  # w1, b1, w2, b2


def setup(fake, device_steps_only=False):
    """cuda_params(), grads_on_device(); returns dev (device_tensors)."""
    cuda_params()
    dev = device_tensors(fake)
    grads_on_device(dev, device_steps_only)
    return dev


def start(shapes=SHAPES, device_steps_only=False):
    """A worker's start: the StandIn, setup(); returns (s, fake, dev, g, init):
    g the generator seeded 0 that drew init, the model's initial values."""
    s = StandIn()
    dev = setup(s.fake, device_steps_only)
    g = torch.Generator().manual_seed(0)
    return s, s.fake, dev, g, initial(g, shapes)


def initial(g, shapes=SHAPES):
    """The small model's initial bf16 values, from generator g."""
    return [torch.randn(sh, generator=g).bfloat16() * 0.3 for sh in shapes]


def grads_to_device(params, dev, keep, inf_when=lambda p: False):
    """Before zopt's hook: each new p.grad moved to fresh device memory (with
    an inf at [5] where inf_when(p)). The hook handles go into keep."""
    def to_device(p):
        def hook(*_):
            if p.grad is not None:
                gd = p.grad.detach()
                if inf_when(p):
                    gd = gd.clone()
                    gd[5] = float("inf")
                p.grad = dev(tuple(p.shape), gd)
        node = p.expand_as(p).grad_fn.next_functions[0][0]
        keep.append((node, node.register_hook(hook)))
    for p in params:
        to_device(p)


def loss(ps, x, scale):
    """The two-layer model's loss over params ps = [w1, b1, w2, b2]."""
    w1, b1, w2, b2 = (p.float() for p in ps)
    y = torch.tanh(x @ w1.t() + b1) @ w2.t() + b2
    return y.square().mean() * scale


def backward(ps, x, scale):
    loss(ps, x, scale).backward()


def first_micro_batch(opt_a, A, B, x, scale):
    """A's backward inside opt_a.no_sync() (nothing marked), then B's."""
    with opt_a.no_sync():
        backward(A, x, scale)
    assert opt_a._overlap.nmarked == 0
    backward(B, x, scale)


def marking_backward(opt_a, A, B, x, scale):
    """A's backward and B's; A's marked every bucket of opt_a by its end."""
    backward(A, x, scale)
    backward(B, x, scale)
    ov = opt_a._overlap
    assert ov.nmarked == ov.nb


def equal(p, q):
    """Bit for bit (bf16 through its int16 view)."""
    return torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))


def same_states(o1, o2):
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    return sorted(s1) == sorted(s2) and all(
        torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])


def same_as(fake, oa, ob, pa, pb):
    """After both optimizers' steps are done: params, states and last_skipped
    equal bit for bit."""
    for o in (oa, ob):
        o.step_count()
    fake.fake_cuda_drain_all()
    same = all(equal(p, q) for p, q in zip(pa, pb)) and same_states(oa, ob)
    return bool(same and oa.last_skipped == ob.last_skipped)


def finish_rank(out, outdir, rank):
    """A gloo rank worker's end: out written to outdir/rank{rank}.json (the
    launcher reads it), a barrier, "DONE rank r", the group destroyed."""
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    print(f"DONE rank {rank}", flush=True)
    dist.destroy_process_group()


def finish(s, out, *opts):
    """s.close_all(out, *opts) (s: the StandIn), then out printed as JSON."""
    s.close_all(out, *opts)
    print(json.dumps(out))

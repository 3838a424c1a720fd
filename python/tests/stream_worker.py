"""One rank of test_grad_streaming.py (and its one-process runs): trains
two copies of stream_model(), one with zopt.Optimizer(..., grad_streaming=
True) and one without, on the same batches, and checks after every step
that their params are bit-identical and that the streamed copy holds no
gradient. Steps 1 and 3 accumulate two micro-batches (the first inside
opt.no_sync() for the streamed copy); at step 2 rank 1 (of 2) skips the
`extra` layer (its params get no gradient there: unused in the graph on
one rank only). During each streamed backward of one micro-batch a hook
after the optimizer's counts the gradient elements alive; its peak must
stay within one bucket plus the largest tensor.

    stream_worker.py RANK WORLD PORT CASE=STEP.so [CASE=STEP.so ...]

Prints "ok CASE rank R ..." per case and "DONE rank R" last.
"""
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..")))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import zopt  # noqa: E402

STEPS = 4
LR, WD = 1e-2, 0.1
BUCKET = 32768   # the smallest bucket (one norm block): several buckets here
EXTRA = 4        # the index of the layer rank 1 skips at step 2


class StreamNet(torch.nn.Module):
    """An MLP of 128-wide layers (16512 params each) registered in forward
    order, so backward produces the gradients in the layout's order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(32, 128)] + [torch.nn.Linear(128, 128) for _ in range(15)]
            + [torch.nn.Linear(128, 8)])

    def forward(self, x, skip_extra=False):
        h = x
        for i, m in enumerate(self.layers[:-1]):
            if i == EXTRA and skip_extra:
                continue
            h = torch.tanh(m(h))
        return self.layers[-1](h)


def stream_model():
    return StreamNet().to(torch.bfloat16)


def batch(s, r, k):
    g = torch.Generator().manual_seed(10000 * s + 100 * r + k)
    return (torch.randn(16, 32, generator=g).to(torch.bfloat16),
            torch.randn(16, 8, generator=g))


def micro_batches(s):
    return 2 if s % 2 else 1


def loss_of(model, s, r, k, world):
    x, y = batch(s, r, k)
    skip = s == 2 and world > 1 and r == 1
    return torch.nn.functional.mse_loss(model(x, skip_extra=skip).float(), y)


def _same(a, b):
    return torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))


class LiveGrads:
    """Hooks on the params' AccumulateGrad nodes registered after the
    optimizer's (so they run after it may have freed gradients): the peak
    number of gradient elements alive during a backward."""

    def __init__(self, model):
        self.ps = list(model.parameters())
        self.peak = 0
        self.handles = []
        for p in self.ps:
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            self.handles.append(node.register_hook(lambda *_: self._count()))

    def _count(self):
        self.peak = max(self.peak, sum(p.numel() for p in self.ps if p.grad is not None))

    def remove(self):
        for h in self.handles:
            h.remove()


def train(step, rank, world, pg=None, log=print):
    """Both copies, STEPS steps; asserts bit-identity and freed gradients
    every step; returns the streamed optimizer's counters and peaks."""
    torch.set_num_threads(1)
    kw = dict(lr=LR, weight_decay=WD, bucket_elems=BUCKET)
    if pg is not None:
        kw["process_group"] = pg
    ref_m, st_m = stream_model(), stream_model()
    ref = zopt.Optimizer(step, ref_m.parameters(), **kw)
    opt = zopt.Optimizer(step, st_m.parameters(), grad_streaming=True, **kw)
    assert opt.world_size == world and opt.rank == rank
    streamer = opt._streamer
    assert streamer.nb >= 4, streamer.nb  # several buckets, some tensors spanning two
    assert any(len(b) > 1 for b in streamer.t_buckets)
    live = LiveGrads(st_m)
    ps = list(st_m.parameters())
    total = sum(p.numel() for p in ps)
    # one bucket in flight (reduced in the background), the next one being
    # filled, and a tensor spanning them
    bound = 2 * BUCKET + max(p.numel() for p in ps)
    peaks, stats = [], []
    for s in range(STEPS):
        ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        n = micro_batches(s)
        for k in range(n):
            loss_of(ref_m, s, rank, k, world).backward()
            if k < n - 1:
                with opt.no_sync():
                    loss_of(st_m, s, rank, k, world).backward()
                assert all(p.grad is not None for p in ps), "no_sync() dropped a gradient"
            else:
                live.peak = 0
                before = dict(streamer.stats)
                loss_of(st_m, s, rank, k, world).backward()
                in_bw = streamer.stats["in_backward"] - before["in_backward"]
                at_end = streamer.stats["at_backward_end"] - before["at_backward_end"]
                peaks.append(live.peak)
                stats.append((in_bw, at_end))
        ref.step()
        opt.step()
        for i, (a, b) in enumerate(zip(ref_m.parameters(), ps)):
            assert _same(a, b), f"step {s}: param {i} differs from the non-streamed step"
        assert all(p.grad is None for p in ps), f"step {s}: a gradient survived step()"
        assert opt.last_grad_norm == ref.last_grad_norm, (s, opt.last_grad_norm,
                                                          ref.last_grad_norm)
        assert [opt.tensor_step(t) for t in range(opt.num_tensors)] == \
            [ref.tensor_step(t) for t in range(ref.num_tensors)], f"step {s}: step counts"
        unused_here = s == 2 and world > 1 and rank == 1
        if unused_here:
            # the skipped layer's bucket waits for the end of backward
            assert stats[-1][1] > 0, stats[-1]
        else:
            assert stats[-1] == (streamer.nb, 0), (s, stats[-1])  # all during backward
            if n == 1:  # (accumulated micro-batches hold every gradient until streamed)
                assert peaks[-1] <= bound, (s, peaks[-1], bound)
        log(f"step {s} rank {rank}: identical; peak live grad elements {peaks[-1]} of "
            f"{total} (bound {bound}); buckets reduced in backward / at its end {stats[-1]}")
    live.remove()
    out = dict(peaks=peaks, stats=stats, total=total, bound=bound, nb=streamer.nb)
    ref.close()
    opt.close()
    return out


def main():
    import torch.distributed as dist
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for arg in sys.argv[4:]:
        case, so = arg.split("=", 1)
        out = train(zopt.Step(so), rank, world, pg=dist.group.WORLD,
                    log=lambda m: print(f"{case}: {m}", flush=True))
        print(f"ok {case} rank {rank}: peaks {out['peaks']} of {out['total']}", flush=True)
    dist.barrier()
    print(f"DONE rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

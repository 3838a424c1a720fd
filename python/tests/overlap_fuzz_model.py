"""The overlap fuzzer's model (python/tests/overlap_fuzz.py): a small
two-layer net with a loose param, in SHAPES' order by :func:`plist`, and
the bit-for-bit comparison of tensors (bf16 / f16 through int16)."""
import torch

D, H, O = 16, 24, 8  # the model: x (8, D) -> tanh(l1) (H) -> l2 (O) * extra


class Layer(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(b)

    def forward(self, x):
        return x @ self.weight.float().t() + self.bias.float()


class Net(torch.nn.Module):
    """l2(tanh(l1(x))) * extra; ``abort`` raises in backward between l2 and
    l1 (after l2's gradients were accumulated); ``use_extra`` False: extra
    left out of the forward (no gradient)."""

    def __init__(self, ts):
        super().__init__()
        self.l1 = Layer(ts[0], ts[1])
        self.l2 = Layer(ts[2], ts[3])
        self.extra = torch.nn.Parameter(ts[4])
        self.abort = False
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.abort:
            def boom(_g):
                raise RuntimeError("fuzz: backward aborted")
            h.register_hook(boom)
        y = self.l2(h)
        return y * self.extra.float() if self.use_extra else y


SHAPES = [(H, D), (H,), (O, H), (O,), (O,)]


def plist(net):
    """The model's params in SHAPES' order (net.parameters() lists extra first)."""
    return [net.l1.weight, net.l1.bias, net.l2.weight, net.l2.bias, net.extra]


class Fail(AssertionError):
    pass


def expect(cond, what):
    if not cond:
        raise Fail(what)


def bits(t):
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same_t(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))

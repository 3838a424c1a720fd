"""Where the runtime reads a torch param's gradient: a fresh gradient
tensor (zero_grad(set_to_none=True) then backward, or p.grad assigned) is
read in place, without a copy (zopt_optimizer_set_grad_memory), views of
a flat buffer too (test_scan.py: overlapping ones are copied); gradients
of other strides are copied; every way a training loop hands
gradients over gives torch.optim.AdamW's result step by step. Every test
runs on both implementations of the per-step pass (zopt._scan, in Python
and in the extension zopt._fast)."""
import pytest
import torch

import zopt

pytestmark = pytest.mark.usefixtures("scan_impl")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _pair(adamw_step):
    m1, m2 = _model(), _model()
    o1 = zopt.Optimizer(adamw_step, m1.parameters(), lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    return (m1, o1), (m2, o2)


@pytest.fixture(scope="module")
def adamw_step(steps):
    return steps(rule="adamw", layout="f32")


def _close(m1, m2):
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_fresh_grads_read_in_place(adamw_step):
    (m1, o1), (m2, o2) = _pair(adamw_step)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 3, generator=g)
    for i in range(4):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=True)
            ((m(x) - y) ** 2).mean().backward()
        before = [p.grad for p in m1.parameters()]
        o1.step(), o2.step()
        # no copy: p.grad is still backward's tensor, and the runtime read it
        assert all(p.grad is b for p, b in zip(m1.parameters(), before))
        assert len(o1._parts[0].scan.in_place()) == 4
        _close(m1, m2)


def test_every_way_of_handing_gradients_over(adamw_step):
    (m1, o1), (m2, o2) = _pair(adamw_step)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 3, generator=g)
    for i in range(14):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=(i % 3 != 0))  # in place every third step
            ((m(x) - y) ** 2).mean().backward()
            ps = list(m.parameters())
            if i in (2, 4):  # views into one flat buffer (as DeepSpeed makes): in place
                flat = torch.zeros(sum(p.numel() for p in ps) + 5)
                off = 5
                for p in ps:
                    v = flat[off:off + p.numel()].view_as(p)
                    v.copy_(p.grad)
                    p.grad = v
                    off += p.numel()
            if i == 6:  # a gradient of other strides than its param: copied
                w = ps[0]
                w.grad = w.grad.t().contiguous().t()
                assert w.grad.stride() != w.stride()
            if i in (7, 8):  # a param without a gradient: left alone
                ps[2].grad = None
            if i == 10:  # the same gradient tensor given other memory
                ps[1].grad.data = ps[1].grad.data.clone() * 0.5
            if i == 11:  # accumulation over two backwards into fresh grads
                ((m(x) - y) ** 2).mean().backward()
        o1.step(), o2.step()
        _close(m1, m2)
        assert o1.tensor_step(list(m1.parameters())[2]) == o2.state[list(m2.parameters())[2]]["step"]


def test_grad_kept_alive_only_while_read(adamw_step):
    """zero_grad(set_to_none=True) drops the optimizer's references to the
    gradients it read in place (torch frees them before the next forward)."""
    import weakref
    (m1, o1), _ = _pair(adamw_step)
    x = torch.randn(4, 8)
    m1(x).sum().backward()
    o1.step()
    refs = [weakref.ref(p.grad) for p in m1.parameters()]
    o1.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)
    m1(x).sum().backward()
    o1.step()  # the runtime reads the new gradients, not the freed ones
    assert all(torch.isfinite(p).all() for p in m1.parameters())


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


def _share(m):
    m.share_memory()


def _to_double_and_back(m):
    m.double()
    m.float()


def _grad_data(m):
    for p in m.parameters():
        p.grad.data = p.grad.data.clone()


@pytest.mark.parametrize("mutate", [_grad_data, _share, _to_double_and_back])
def test_grad_given_other_memory_under_the_same_object(adamw_step, mutate):
    """p.grad keeps its Python object but gets other memory (p.grad.data =
    ..., Module._apply behind share_memory() and dtype round trips) while it
    is the optimizer's own gradient view (zero_grad(set_to_none=False)): the
    step must read the new memory (it used to read the old, freed, buffer),
    and zero_grad must clear what backward accumulates into."""
    (m1, o1), (m2, o2) = _pair(adamw_step)
    for i in range(5):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            x, y = _batch(i)
            torch.nn.functional.mse_loss(m(x), y).backward()
            if i == 1:
                mutate(m)
            o.step()
        _close(m1, m2)


def _flat_views(ps):
    flat = torch.zeros(sum(p.numel() for p in ps))
    out, o = [], 0
    for p in ps:
        out.append(flat[o:o + p.numel()].view_as(p))
        o += p.numel()
    return out


def _transposed(ps):
    return [torch.zeros(p.shape[::-1]).t() if p.dim() == 2 else torch.zeros(p.shape) for p in ps]


def _contiguous(ps):
    return [torch.zeros(p.shape) for p in ps]


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("make", [_flat_views, _transposed, _contiguous])
def test_user_grad_tensors_stay_p_grad(adamw_step, make, zero):
    """The user sets p.grad = g once and writes each step's gradient into g
    (flat-buffer and manual all-reduce patterns): g stays p.grad (other
    strides are copied each step, views and contiguous ones read in place;
    zero_grad(set_to_none=False) zeroes g in place, as torch does), and the
    result is torch's. Both used to swap the optimizer's buffer into p.grad,
    so later writes into g were lost."""
    (m1, o1), (m2, o2) = _pair(adamw_step)
    runs = []
    for m, o in ((m1, o1), (m2, o2)):
        ps = list(m.parameters())
        gs = make(ps)
        for p, g in zip(ps, gs):
            p.grad = g
        runs.append((m, o, ps, gs))
    for i in range(4):
        for m, o, ps, gs in runs:
            if zero:
                o.zero_grad(set_to_none=False)
            x, y = _batch(i)
            new = torch.autograd.grad(torch.nn.functional.mse_loss(m(x), y), ps)
            for g, n in zip(gs, new):
                g.copy_(n)
            o.step()
            assert all(p.grad is g for p, g in zip(ps, gs))
        _close(m1, m2)


@pytest.mark.parametrize("change", ["add_param_group", "p.data"])
def test_registrations_changed_in_place_with_grads_read_in_place(adamw_step, monkeypatch,
                                                                change):
    """add_param_group (zopt_optimizer_add_tensors) and a moved p.data
    (zopt_optimizer_set_tensor_memory) change the registered memory of the
    same native optimizer while the runtime reads fresh gradients in place:
    the next steps must read the gradients the user gives then, read in
    place or copied (other strides), as torch.optim.AdamW does. (The runtime
    used to keep reading a gradient freed since, or the optimizer's own
    stale memory, while the per-step pass thought it read p.grad.)"""
    monkeypatch.setattr(zopt._rebuild, "snapshot", lambda c: pytest.fail("rebuilt"))
    (m1, o1), (m2, o2) = _pair(adamw_step)
    extra = [torch.nn.Parameter(torch.full((5,), 0.5)) for _ in range(2)]
    for i in range(4):
        for m, o, x in ((m1, o1, extra[0]), (m2, o2, extra[1])):
            ps = list(m.parameters())
            if i == 1 and change == "add_param_group":
                o.add_param_group({"params": [x], "lr": 0.1})
            if i == 1 and change == "p.data":
                with torch.no_grad():
                    for p in ps:
                        p.data = p.data.clone()
            o.zero_grad(set_to_none=True)
            xb, yb = _batch(i)
            torch.nn.functional.mse_loss(m(xb), yb).backward()
            if i >= 1:
                x.grad = torch.full_like(x, 0.25 * i)
            if i in (1, 3):  # other strides than the params: copied
                for p in ps:
                    if p.dim() == 2:
                        p.grad = p.grad.t().contiguous().t()
            o.step()
        _close(m1, m2)
        torch.testing.assert_close(extra[0], extra[1], rtol=2e-6, atol=2e-7)
    assert o1.rebuilds == 1

"""The per-step pass over the params (zopt._scan, and its C++ twin in the
extension zopt._fast, loaded by zopt._ext): the gradients of DeepSpeed's
and FSDP's flat buffers are read in place, overlapping ones are copied, a
refused gradient changes nothing, and the extension is loaded only under
the torch it was built for. The tests marked ``scan_impl`` run on both
implementations; every numeric check is against torch.optim.AdamW."""
import json
import os
import shutil

import pytest
import torch

import zopt
from zopt import _ext

both = pytest.mark.usefixtures("scan_impl")


@pytest.fixture(scope="module")
def adamw(steps):
    return steps(rule="adamw", layout="f32")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _pair(adamw, order=None):
    m1, m2 = _model(), _model()
    ps1, ps2 = list(m1.parameters()), list(m2.parameters())
    if order is not None:
        ps1, ps2 = [ps1[i] for i in order], [ps2[i] for i in order]
    o1 = zopt.Optimizer(adamw, ps1, lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW(ps2, lr=1e-2, weight_decay=0.1, foreach=False)
    return (m1, o1), (m2, o2)


def _grads(m, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    ps = list(m.parameters())
    return ps, torch.autograd.grad(torch.nn.functional.mse_loss(m(x), y), ps)


def _close(m1, m2):
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def _count_registrations(monkeypatch, part):
    calls = []
    real = part.set_grad_memory_packed

    def rec(tids, ptrs):
        calls.append(len(tids) // 4)
        return real(tids, ptrs)
    monkeypatch.setattr(part, "set_grad_memory_packed", rec)
    return calls


@both
@pytest.mark.parametrize("fresh_views", [False, True])
def test_flat_buffer_views_read_in_place(adamw, monkeypatch, fresh_views):
    """The gradients are views of one flat buffer laid out like the params
    (DeepSpeed keeps the views as p.grad; FSDP makes new views each step):
    the runtime reads the buffer where it is, registered once (no copy, no
    registration again while the views stay where they are), and the
    result is torch's."""
    (m1, o1), (m2, o2) = _pair(adamw)
    part = o1._parts[0]
    calls = _count_registrations(monkeypatch, part)
    bufs = {}
    for i in range(5):
        for m, o in ((m1, o1), (m2, o2)):
            ps, new = _grads(m, i)
            flat = bufs.setdefault(id(m), torch.zeros(sum(p.numel() for p in ps) + 3))
            off = 3
            for p, n in zip(ps, new):
                if fresh_views or i == 0:
                    p.grad = flat[off:off + p.numel()].view_as(p)
                p.grad.copy_(n)
                off += p.numel()
            o.step()
        _close(m1, m2)
        views = {t: p.grad.data_ptr() for t, p in enumerate(m1.parameters())}
        assert part.scan.in_place() == views  # every gradient read where it is
    assert calls == [4]  # registered once


@both
def test_views_after_fresh_gradients(adamw):
    """Fresh gradients, then views among them (the pass meets the first
    view after it handled others: it starts over with the views' overlap
    check), then fresh ones again: every step torch's, every gradient read
    in place."""
    (m1, o1), (m2, o2) = _pair(adamw)
    part = o1._parts[0]
    for i in range(4):
        for m, o in ((m1, o1), (m2, o2)):
            ps, new = _grads(m, i)
            flat = torch.zeros(sum(p.numel() for p in ps))
            off = 0
            for k, (p, n) in enumerate(zip(ps, new)):
                if i == 2 and k:
                    p.grad = flat[off:off + p.numel()].view_as(p)
                    p.grad.copy_(n)
                else:
                    p.grad = n.clone()
                off += p.numel()
            o.step()
        _close(m1, m2)
        assert part.scan.in_place() == {t: p.grad.data_ptr()
                                         for t, p in enumerate(m1.parameters())}


@both
def test_overlapping_views_copied(adamw):
    """Views that overlap each other, or a param, are copied at every step
    (read in place, a gradient could be reduced twice, or read after its
    memory was updated); the others are still read in place."""
    # tensor ids: w2, w1, b1, b2 (torch steps in this order too: w2's
    # gradient, a view of w1's memory, is read before w1 is updated)
    (m1, o1), (m2, o2) = _pair(adamw, order=[2, 0, 1, 3])
    part = o1._parts[0]
    for i in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            ps, new = _grads(m, i)
            w1, b1, w2, b2 = ps
            flat = torch.zeros(b1.numel() + 4)
            b1.grad = flat[:16]
            b1.grad.copy_(new[1])
            b2.grad = flat[2:5]  # overlaps b1's gradient
            w2.grad = w1.data.view(-1)[8:56].view_as(w2)  # a view of another param
            w1.grad = new[0].clone()
            o.step()
        _close(m1, m2)
        assert set(part.scan.in_place()) == {1}  # w1's (not a view) only


@both
def test_refused_gradient_changes_nothing(adamw):
    """A sparse gradient among fresh ones is refused (UNSUPPORTED, naming
    the param) before anything changes: once replaced, the step reads the
    gradients of that step, not those registered before the refusal (the
    pass used to record the fresh gradients before it, which the runtime
    never got: it then read the previous step's, freed, memory)."""
    (m1, o1), (m2, o2) = _pair(adamw)
    keep = []  # no gradient's memory is reused: an address read by mistake shows
    for i in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=True)
            ps, new = _grads(m, i)
            keep.append(new)
            for p, n in zip(ps, new):
                p.grad = n.clone()
                keep.append(p.grad)
            if i == 1 and o is o1:
                good = ps[2].grad
                ps[2].grad = good.to_sparse()
                with pytest.raises(zopt.ZoptError, match=r"params'\]\[2\].*sparse") as e:
                    o.step()
                assert e.value.code == zopt.Status.UNSUPPORTED
                ps[2].grad = good
            o.step()
        _close(m1, m2)


@both
def test_moved_storage_and_writes_seen(steps):
    """The pass's param checks: p.data = new (moved storage) and p.copy_
    (a write the bf16 master would lose) are seen at the next step, in the
    pass or, once its baselines are stale, by the full check."""
    step = steps(rule="adamw", layout="bf16_master")
    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(6 + i).bfloat16()) for i in range(4)]
    o = zopt.Optimizer(step, ps, lr=1e-2)
    for i in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape).bfloat16()
        if i == 1:
            ps[1].data = ps[1].data.clone()  # moved: rebuilt around the new storage
        if i == 2:
            with torch.no_grad():
                ps[3].copy_(torch.full_like(ps[3], 2.0))  # the master is made again
        rb = o.rebuilds
        o.step()
        assert o.rebuilds == rb + (i == 1)
        if i == 2:
            m = o.state[ps[3]]["master"]
            assert (m - 2.0).abs().max() < 0.1  # one step from 2.0, not from the old master


@both
def test_storage_resized_in_place_seen(adamw):
    """FSDP frees a param's storage and allocates it again in place
    (``p.storage().resize_(0)``, then back to its size): the tensor and its
    StorageImpl stay, only the data pointer moves. The pass sees it, the
    next step registers the new memory (a rebuild) and updates it, as
    torch.optim.AdamW does."""
    (m1, o1), (m2, o2) = _pair(adamw)
    for i in range(3):
        if i == 1:
            blockers = []
            for m in (m1, m2):
                p = list(m.parameters())[2]  # the second Linear's weight
                keep, before = p.detach().clone(), p.data_ptr()
                p.storage().resize_(0)
                blockers.append(torch.empty(p.numel()))  # takes the freed block
                p.storage().resize_(p.numel())
                with torch.no_grad():
                    p.copy_(keep)
                assert p.data_ptr() != before
        rb = o1.rebuilds
        for m, o in ((m1, o1), (m2, o2)):
            ps, new = _grads(m, i)
            for p, g in zip(ps, new):
                p.grad = g
            o.step()
        assert o1.rebuilds == rb + (i == 1)
        _close(m1, m2)


@both
def test_forget_reports_the_mask_again(adamw):
    """forget(): the next pass looks at every gradient again, so a mask
    change the binding could not push (zopt._grads.push_mask puts the mask
    the runtime has back, e.g. a GPU step inside a CUDA graph capture) is
    reported again; gradients read in place stay handed over (no moved
    pointers). The steps after are torch's."""
    (m1, o1), (m2, o2) = _pair(adamw)
    part = o1._parts[0]
    for i in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            ps, new = _grads(m, i)
            for p, n in zip(ps, new):
                p.grad = n.clone()
            ps[1].grad = None if i < 2 else ps[1].grad
            o.step()
        _close(m1, m2)
        if i == 0:
            assert bytes(part.active) == b"\x01\x00\x01\x01"
            part.active[:] = b"\x01" * 4  # as if the push had failed and been put back
            assert part.scan.sync() is None  # the pass alone sees no change
            part.scan.forget()
            r = part.scan.sync()
            assert r is not None and r[0] is None and r[1] is None and r[2] is True
            assert bytes(part.active) == b"\x01\x00\x01\x01"
            assert set(part.scan.in_place()) == {0, 2, 3}


def test_same():
    a = [torch.zeros(1) for _ in range(5)]
    for same in (_ext.same, lambda x, y: len(x) == len(y) and all(u is v for u, v in zip(x, y))):
        assert same(a, tuple(a)) and same([], ())
        assert not same(a, a[:4]) and not same(a, a[:4] + [torch.zeros(1)])


# ---- the extension: loaded only under its torch -------------------------------------
def _built():
    d = os.path.join(zopt._lib.REPO_ROOT, "build", "python", "zopt_fast")
    try:
        with open(os.path.join(d, "_fast.json")) as f:
            return d, json.load(f)
    except OSError:
        return d, None


def test_extension_loaded_where_built():
    """Where scripts/build.sh built the extension for this torch, the binding
    uses it (unless ZOPT_NO_EXTENSION is set)."""
    d, meta = _built()
    if meta is None or _ext.refusal(meta) is not None:
        pytest.skip(f"no extension built for this torch in {d}")
    if os.environ.get("ZOPT_NO_EXTENSION", "") not in ("", "0"):
        assert _ext.fast is None and "ZOPT_NO_EXTENSION" in _ext.why
        return
    assert _ext.fast is not None, _ext.why
    assert zopt.installation()["extension"]["path"] == _ext.where


@pytest.mark.parametrize("change,why", [
    ({"torch": "0.0.1"}, "built for torch 0.0.1"),
    ({"cxx11_abi": None}, "_GLIBCXX_USE_CXX11_ABI"),
    ({"python": "cpython-27"}, "built for cpython-27"),
    ({"interface": 0}, "interface 0"),
    (None, "no readable _fast.json"),
])
def test_extension_for_another_torch_refused(tmp_path, monkeypatch, change, why):
    """A copy whose _fast.json names another torch, ABI, interpreter or
    interface (or has none) is never loaded (a mismatched one could
    crash): the binding says why and runs its Python path."""
    d, meta = _built()
    if _ext.where:  # the extension loaded (beside the package, or the build's): its metadata
        d = os.path.dirname(_ext.where)
        with open(os.path.join(d, "_fast.json")) as f:
            meta = json.load(f)
    so = _ext.where or (meta and [os.path.join(d, f) for f in os.listdir(d)
                                  if f.endswith(".so")][0])
    if not so:
        pytest.skip("no extension built here")
    monkeypatch.delenv("ZOPT_NO_EXTENSION", raising=False)
    shutil.copy(so, tmp_path)
    if change is not None:
        m = dict(meta or {})
        m.update(change)
        (tmp_path / "_fast.json").write_text(json.dumps(m))
    mod, where, w = _ext.load([str(tmp_path)])
    assert mod is None and where is None and why in w, w
    monkeypatch.setenv("ZOPT_NO_EXTENSION", "1")
    assert _ext.load([str(tmp_path)])[2] == "ZOPT_NO_EXTENSION is set"

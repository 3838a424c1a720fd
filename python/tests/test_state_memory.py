"""The binding over the runtime's state in memory (issue 17): state_dict()
reads the runtime's export, load_state_dict() is one staged import per
parameter class, add_param_group adds tensors to the native optimizer in
place (zopt_optimizer_add_tensors), a moved p.data is registered in place
(zopt_optimizer_set_tensor_memory); no file is written for any of them.

Checked bit for bit against the optimizer as it was, or against an
optimizer built with every param from the start whose old states were
loaded; a refused load (by the binding or by the runtime's import) leaves
states, counts, hyperparameters, loss scaler, seed and params as they
were."""
import contextlib
import copy
import io
import os
import tempfile
import warnings

import pytest
import torch

import zopt
from zopt import steps as S

LAYOUTS = ["f32", "bf16_master", "bf16", "f16_loss_scale"]
PDT = {"f32": torch.float32, "bf16_master": torch.bfloat16, "bf16": torch.bfloat16,
       "f16_loss_scale": torch.float16}


def _step(steps, layout):
    return steps(rule="adamw", layout=layout, amsgrad=layout == "bf16",
                 clip=1.0 if layout == "bf16_master" else None)


def _model(dt, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dt)


def _forward(m, x):
    """The model computed in f32 (CPU torch has no f16 matmul); the
    gradients are the params' dtype."""
    F = torch.nn.functional
    h = torch.tanh(F.linear(x, m[0].weight.float(), m[0].bias.float()))
    return F.linear(h, m[2].weight.float(), m[2].bias.float())


def _train(m, opt, i, fresh=True):
    """One step on batch i: fresh gradient tensors (set_to_none=True) by
    default, the loss multiplied by the loss scale."""
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad(set_to_none=fresh)
    loss = torch.nn.functional.mse_loss(_forward(m, x), y)
    (loss * opt.loss_scale).backward()
    opt.step()


def _bits(t):
    t = t.detach()
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _assert_same_state_dict(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["zopt"] == b["zopt"]
    assert a["state"].keys() == b["state"].keys()
    for t, st in a["state"].items():
        assert st.keys() == b["state"][t].keys(), t
        for k, v in st.items():
            assert _same(v, b["state"][t][k]), (t, k)


def _everything(opt, params):
    """What a load may change, exactly: every raw state, count,
    hyperparameter (binding and runtime), the scaler, the seed, the
    params."""
    out = {"params": [_bits(p).numpy().tobytes() for p in params],
           "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                    for g in opt.param_groups]),
           "counts": [opt.step_count(g) for g in range(len(opt.param_groups))],
           "seed": opt.seed, "scale": opt.loss_scale}
    for c in opt.parts.values():
        out[c.cls, "scaler"] = c.scaler_state()
        out[c.cls, "hypers"] = [[c.get_hyper(g, n) for n in c.step.hypers]
                                for g in range(len(opt.param_groups))]
        for t in range(len(c.entries)):
            out[c.cls, t, "step"] = c.tensor_step(t)
            for k in c.step.owned_states:
                out[c.cls, t, int(k)] = c.read_raw(t, k).tobytes()
    return out


@contextlib.contextmanager
def _no_files(tmp_path, monkeypatch):
    """Any file opened for writing from Python, any temporary file or
    folder fails; the temporary folder is watched (a file the runtime
    would write at a path the binding chose lands there)."""
    tmp = tmp_path / f"tmp{len(os.listdir(tmp_path))}"
    tmp.mkdir()
    real_open, real_os_open = open, os.open

    def guarded_open(f, mode="r", *a, **kw):
        if any(c in mode for c in "wax+"):
            raise AssertionError(f"a file written: {f}")
        return real_open(f, mode, *a, **kw)

    def guarded_os_open(f, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise AssertionError(f"a file written: {f}")
        return real_os_open(f, flags, *a, **kw)

    def no_temp(*a, **kw):
        raise AssertionError("a temporary file or folder")
    with monkeypatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(tmp))
        mp.setattr("builtins.open", guarded_open)
        mp.setattr(io, "open", guarded_open)
        mp.setattr(os, "open", guarded_os_open)
        for name in ("mkstemp", "mkdtemp", "TemporaryDirectory", "NamedTemporaryFile"):
            mp.setattr(tempfile, name, no_temp)
        yield
    assert os.listdir(tmp) == []


@pytest.fixture
def no_files(tmp_path, monkeypatch):
    return lambda: _no_files(tmp_path, monkeypatch)


def _optimizer(steps, layout, m, **kw):
    kw.setdefault("loss_scaler", dict(init_scale=256.0, growth_interval=2)
                  if layout == "f16_loss_scale" else None)
    return zopt.Optimizer(_step(steps, layout),
                          [{"params": list(m[0].parameters())},
                           {"params": list(m[2].parameters()), "lr": 2e-2, "maximize": True}],
                          lr=1e-2, weight_decay=0.1, seed=11, **kw)


# ---- state_dict -> load_state_dict ------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dict_round_trip_in_memory(steps, layout, no_files):
    """state_dict() after load_state_dict(state_dict()) is the same, bit for
    bit (every state, count, group, the scaler and the seed), after
    everything moved on in between; nothing is written to a file."""
    m = _model(PDT[layout])
    opt = _optimizer(steps, layout, m)
    for i in range(3):
        _train(m, opt, i)
    with no_files():
        sd = opt.state_dict()
    saved = [p.detach().clone() for p in m.parameters()]
    keep = copy.deepcopy(sd)
    for i in range(3, 6):  # states, counts and the scaler move on
        _train(m, opt, i)
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[1]["maximize"] = False
    opt.set_seed(99)
    with torch.no_grad():  # the model first, then the optimizer (no master conflict)
        for p, s in zip(m.parameters(), saved):
            p.copy_(s)
    with no_files(), warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
        got = opt.state_dict()
    _assert_same_state_dict(keep, got)
    assert all(_same(p, s) for p, s in zip(m.parameters(), saved))
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[1]["maximize"]
    assert opt.seed == 11 and got["zopt"]["group_steps"] == [3, 3]
    if layout == "f16_loss_scale":
        ls = got["zopt"]["loss_scaler"]
        assert (ls["scale"], ls["good_steps"], ls["growth_interval"]) == (512.0, 1, 2)


# ---- refused loads -------------------------------------------------------------------
def _bad_lr(sd):
    sd["param_groups"][1]["lr"] = -1.0


def _bad_scaler(sd):
    sd["zopt"]["loss_scaler"]["growth_factor"] = 0.5


def _bad_shape(sd):
    sd["state"][3]["exp_avg"] = torch.zeros(2)


@pytest.mark.parametrize("bad", [_bad_lr, _bad_scaler, _bad_shape])
def test_refused_load_changes_nothing(steps, bad):
    """A state_dict refused by the runtime's staged import (a hyperparameter
    out of range, an invalid scaler configuration) or by the binding (a
    state of another shape): states, counts, hyperparameters, scaler, seed
    and params are as they were; its masters (which disagree with the
    params) are not written into them either."""
    layout = "bf16_master"
    m = _model(PDT[layout])
    opt = _optimizer(steps, layout, m)
    for i in range(2):
        _train(m, opt, i)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():  # everything would change
        for k in ("exp_avg", "exp_avg_sq", "master"):
            st[k] = st[k] * 1.5 + 0.25
        st["step"] = st["step"] + 4
    sd["zopt"]["seed"] = 5
    sd["param_groups"][0]["lr"] = 0.5
    bad(sd)
    _train(m, opt, 2)
    before = _everything(opt, list(m.parameters()))
    with pytest.raises(zopt.ZoptError) as e:
        opt.load_state_dict(sd)
    if bad is _bad_lr:
        assert isinstance(e.value, ValueError) and "lr" in str(e.value)
    assert _everything(opt, list(m.parameters())) == before
    _train(m, opt, 3)  # and it steps on


def test_refused_commit_of_a_later_class_puts_the_first_back(steps, monkeypatch):
    """Two parameter classes: the second class's import fails at its commit
    (after the first class's was applied): the first is put back (from a
    snapshot in memory), nothing changed anywhere."""
    texts = S.BUILDERS["adamw"].text(comments=False, classes={"bf16": dict(master="f32"),
                                                             "f32": {}})
    cl = {c: steps.text(t) for c, t in texts.items()}
    m = _model(torch.float32)
    m[0].to(torch.bfloat16)
    m[2].to(torch.bfloat16)
    norm = torch.nn.Parameter(torch.randn(5))
    opt = zopt.Optimizer(cl, [{"params": list(m.parameters()) + [norm]}], lr=1e-2, seed=3)

    def train(i):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        for p in list(m.parameters()) + [norm]:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    for i in range(2):
        train(i)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["exp_avg"] = st["exp_avg"] * 2 + 1
    train(2)
    ps = list(m.parameters()) + [norm]
    before = _everything(opt, ps)
    real = zopt._stateio.StagedImport.commit
    calls = []

    def commit(self, what="import"):
        calls.append(what)
        if len(calls) == 2:  # the f32 class's, after the bf16 class's
            self.abort()
            raise zopt.ZoptError(zopt.Status.OUT_OF_MEMORY, "commit refused (test)")
        return real(self, what)
    monkeypatch.setattr(zopt._stateio.StagedImport, "commit", commit)
    with pytest.raises(zopt.ZoptError, match="refused"):
        opt.load_state_dict(sd)
    assert len(calls) == 3  # bf16, f32 (refused), bf16 put back
    monkeypatch.setattr(zopt._stateio.StagedImport, "commit", real)
    assert _everything(opt, ps) == before
    with pytest.warns(zopt.optimizer.MasterWeightsWarning):  # (the params moved on since)
        opt.load_state_dict(sd)  # the same state_dict loads when nothing refuses it
    assert _same(opt.state[norm]["exp_avg"], sd["state"][len(ps) - 1]["exp_avg"])


# ---- add_param_group ------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_param_group_after_steps_as_built_with_every_param(steps, layout, no_files,
                                                              monkeypatch):
    """add_param_group after steps (fresh gradient tensors every step, so the
    runtime reads some gradients from the user's memory) adds the group in
    place (no export: CPU steps), writing no file; training on is bit for
    bit that of an optimizer built with every param from the start into
    which the old states were loaded."""
    m = _model(PDT[layout])
    st = _step(steps, layout)
    kw = dict(lr=1e-2, weight_decay=0.1, seed=11,
              loss_scaler=dict(init_scale=256.0, growth_interval=2)
              if layout == "f16_loss_scale" else None)
    a = zopt.Optimizer(st, list(m[0].parameters()), **kw)
    for i in range(3):
        _train(m, a, i)
    sd = copy.deepcopy(a.state_dict())
    m2 = copy.deepcopy(m)
    b = zopt.Optimizer(st, [{"params": list(m2[0].parameters())},
                            {"params": list(m2[2].parameters()), "lr": 2e-2,
                             "maximize": True}], **kw)
    sd["param_groups"].append(dict(b.state_dict()["param_groups"][1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.load_state_dict(sd)

    def no_export(c):
        raise AssertionError("add_param_group exported the state")
    with no_files(), monkeypatch.context() as mp:
        mp.setattr(zopt._rebuild, "snapshot", no_export)
        a.add_param_group({"params": list(m[2].parameters()), "lr": 2e-2, "maximize": True})
    assert a.rebuilds == 1 and a.param_groups[1]["maximize"]
    for i in range(3, 6):
        _train(m, a, i)
        _train(m2, b, i)
        assert all(_same(p, q) for p, q in zip(m.parameters(), m2.parameters())), i
    _assert_same_state_dict(a.state_dict(), b.state_dict())
    assert [a.tensor_step(p) for p in m.parameters()] == [6, 6, 3, 3]


# ---- moved storage ----------------------------------------------------------------------
def test_moved_storage_in_place_and_swapped(steps, no_files, monkeypatch):
    """p.data = new storage on a CPU step: registered in place
    (set_tensor_memory, no export, no file); two params that swapped their
    storage (the runtime refuses the first one's new pointer: still
    registered) fall back to a rebuild in memory. Both train on bit for bit
    as an optimizer whose params were written in place instead."""
    st = _step(steps, "bf16_master")

    def params():
        g = torch.Generator().manual_seed(7)
        return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16))
                for s in ((5, 7), (5, 7), (3,))]
    pa, pb = params(), params()
    oa = zopt.Optimizer(st, pa, lr=1e-2, weight_decay=0.1)
    ob = zopt.Optimizer(st, pb, lr=1e-2, weight_decay=0.1)

    def train(ps, o, i):
        g = torch.Generator().manual_seed(50 + i)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        o.step()
    for i in range(2):
        train(pa, oa, i)
        train(pb, ob, i)
    with no_files(), monkeypatch.context() as mp:
        mp.setattr(zopt._rebuild, "snapshot", lambda c: pytest.fail("exported"))
        pa[2].data = pa[2].data * 2  # new storage
        train(pa, oa, 2)
    with torch.no_grad():
        pb[2].mul_(2)
    train(pb, ob, 2)
    assert oa.rebuilds == 1 and ob.rebuilds == 0
    with no_files():
        pa[0].data, pa[1].data = pa[1].data, pa[0].data
        train(pa, oa, 3)
    with torch.no_grad():
        x = pb[0].clone()
        pb[0].copy_(pb[1])
        pb[1].copy_(x)
    train(pb, ob, 3)
    assert oa.rebuilds == 2
    for i in (4, 5):
        train(pa, oa, i)
        train(pb, ob, i)
    assert all(_same(p, q) for p, q in zip(pa, pb))
    _assert_same_state_dict(oa.state_dict(), ob.state_dict())


def test_legacy_state_dict_loads_from_memory(steps, tmp_path, no_files):
    """The first binding's state_dict format (a runtime checkpoint's bytes)
    is imported from memory, not through a temporary file."""
    m = _model(torch.float32)
    opt = _optimizer(steps, "f32", m)
    for i in range(2):
        _train(m, opt, i)
    opt.save(tmp_path / "ck")
    legacy = {"format": "zopt-state-dict-1", "checkpoint": (tmp_path / "ck").read_bytes()}
    want = opt.state_dict()
    _train(m, opt, 2)
    with no_files():
        opt.load_state_dict(legacy)
    _assert_same_state_dict(want, opt.state_dict())

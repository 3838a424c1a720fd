"""A zopt.Optimizer of two parameter classes (bf16 params with an f32
master, f32 params) saves ONE checkpoint: one identity and one commit point
over both classes' files (docs/CHECKPOINT.md "Linked saves"). A save that
fails in the second class leaves the previous save for both classes; one
that dies after its commit, before the second class's rename, loads as this
save; a hand-mixed set (the second class's file of another save) is
refused, nothing changed."""
import os
import shutil

import pytest
import torch

import zopt
from zopt import steps as S

BF = torch.bfloat16
# (each load puts the loaded masters into the model's params: expected here)
pytestmark = pytest.mark.filterwarnings("ignore::zopt._checkpoint.MasterWeightsWarning")


def classes(steps):
    texts = S.BUILDERS["adamw"].text(comments=False, clip=0.05,
                                     classes={"bf16": dict(master="f32"), "f32": {}})
    return {c: steps.text(t) for c, t in texts.items()}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(12, 16).to(BF)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.tanh(self.fc(x.to(BF))).float())


def train(m, opt, s0, n):
    for s in range(s0, s0 + n):
        g = torch.Generator().manual_seed(100 + s)
        opt.zero_grad()
        loss = (m(torch.randn(8, 12, generator=g)) - torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()


def snap(opt, m):
    """Every state of both classes (bits), the step counts, the scaler and
    seed, and the params' bits."""
    sd = opt.state_dict()
    out = {}
    for t, st in sd["state"].items():
        for k, v in st.items():
            v = torch.as_tensor(v).detach().reshape(-1)
            out[(t, k)] = v.view(torch.int16 if v.dtype == BF else torch.int32).tolist() \
                if v.dtype in (BF, torch.float32) else v.tolist()
    z = sd["zopt"]
    out["zopt"] = (z["group_steps"], z["loss_scaler"], z["seed"],
                   [(c["class"], c["group_steps"]) for c in z["classes"]])
    out["params"] = [(p.detach().view(torch.int16) if p.dtype == BF else p.detach()).tolist()
                     for p in m.parameters()]
    return out


def listing(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.fixture
def trained(steps):
    m = Net()
    opt = zopt.Optimizer(classes(steps), m.parameters(), lr=1e-2, weight_decay=0.1)
    assert [c.cls for c in opt._parts] == ["bf16", "f32"]
    train(m, opt, 0, 2)
    return m, opt


def test_failed_save_of_the_second_class_keeps_the_first_save(trained, tmp_path, monkeypatch):
    m, opt = trained
    path = str(tmp_path / "ck")
    opt.save(path)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.f32"]
    a, files_a = snap(opt, m), listing(tmp_path)
    train(m, opt, 2, 1)
    b = snap(opt, m)
    assert b != a
    for fault in ("0:write:1", "0:fsync:1", "0:rename"):
        monkeypatch.setenv("ZOPT_TEST_SAVE_FAULT", fault)
        with pytest.raises(zopt.ZoptError) as e:
            opt.save(path)
        monkeypatch.delenv("ZOPT_TEST_SAVE_FAULT")
        assert e.value.code == zopt.Status.IO, e.value
        if fault != "0:rename":
            assert f"part 1 ('{path}.f32')" in e.value.message
        assert listing(tmp_path) == files_a, fault  # nothing written, nothing changed
        assert snap(opt, m) == b  # a failed save changes nothing
    # the first save, for both classes, bit for bit
    opt.load(path)
    assert snap(opt, m)["zopt"] == a["zopt"]
    assert {k: v for k, v in snap(opt, m).items() if k != "params"} == \
        {k: v for k, v in a.items() if k != "params"}


def test_save_that_dies_after_its_commit_loads_as_that_save(trained, tmp_path, monkeypatch):
    m, opt = trained
    for first in (True, False):  # no checkpoint at the path before / one before
        d = tmp_path / ("first" if first else "again")
        d.mkdir()
        path = str(d / "ck")
        if not first:
            opt.save(path)
            old_f32 = open(path + ".f32", "rb").read()
        train(m, opt, 2, 1)
        b = {k: v for k, v in snap(opt, m).items() if k != "params"}
        monkeypatch.setenv("ZOPT_TEST_SAVE_FAULT", "0:after-commit")
        with pytest.raises(zopt.ZoptError) as e:
            opt.save(path)
        monkeypatch.delenv("ZOPT_TEST_SAVE_FAULT")
        assert e.value.code == zopt.Status.COMM
        # part 1 (the f32 class) is not at its path: the previous file, or none
        if first:
            assert not os.path.exists(path + ".f32")
        else:
            assert open(path + ".f32", "rb").read() == old_f32
        train(m, opt, 3, 1)  # move on, then load the save that died after its commit
        opt.load(path)
        assert {k: v for k, v in snap(opt, m).items() if k != "params"} == b
        opt.save(path)  # the next save leaves the two files
        assert sorted(os.listdir(d)) == ["ck", "ck.f32"]


def test_hand_mixed_set_is_refused_and_changes_nothing(trained, tmp_path):
    m, opt = trained
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    opt.save(a)
    train(m, opt, 2, 1)
    opt.save(b)
    shutil.copyfile(b + ".f32", a + ".f32")  # the f32 class's file of the other save
    train(m, opt, 3, 1)
    now = snap(opt, m)
    with pytest.raises(zopt.ZoptError, match=r"a\.f32.*belongs to another save") as e:
        opt.load(a)
    assert e.value.code == zopt.Status.CHECKPOINT and "part 1" in e.value.message
    assert snap(opt, m) == now
    opt.load(b)  # an unmixed set loads

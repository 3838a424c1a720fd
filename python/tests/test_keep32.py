"""The precision policy per parameter class (issue 19, item 3): params under
a size threshold and params named by the user keep 32-bit moments, in one
optimizer with the others' narrow moments and one global norm
(zopt.steps.<rule>(..., keep32=...), python/zopt/_policy.py).

Checked bit for bit: without clipping each class's params take exactly the
steps of a one-class optimizer of that class's step over the same params
(so a param routed to the wrong class, or a keep32 class whose moments are
not f32, fails); with clipping the norm is the one over all params
(torch's clip_grad_norm_), and every param equals, within f32 rounding, a
one-class run over all params that is given the same clip coefficient."""
import warnings

import numpy as np
import pytest
import torch

import zopt
from zopt import steps as S

BF = torch.bfloat16


def policy_classes(steps, keep32, **kw):
    """zopt.steps.adamw(..., keep32=...) compiled through the test cache."""
    sp = S.adamw.spec(comments=False, keep32=keep32, **kw)
    out = S.StepClasses((c, steps.text(s.text())) for c, s in sp.items())
    out.keep32 = sp.keep32
    return out


def model(seed=0):
    """(name, bf16 param) pairs: an embedding (large, named), a large weight,
    a small weight, a bias; random values, never zeros."""
    g = torch.Generator().manual_seed(seed)
    shapes = [("emb.weight", (64, 96)), ("fc.weight", (80, 64)),
              ("ln.weight", (64,)), ("fc.bias", (80,))]
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g).to(BF))) for n, s in shapes]


def grads(params, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.5).to(BF)


def bits(t):
    return t.detach().view(torch.int16).clone()


def test_routing_and_moment_dtypes(steps):
    cl = policy_classes(steps, dict(below=4096, names=["emb.*"]), param="bf16",
                        master="f32", moments="bf16")
    assert set(cl) == {"bf16", "bf16:keep32"}
    named = model()
    opt = zopt.Optimizer(cl, named, lr=1e-2)
    by = {n: opt._class_of[id(p)] for n, p in named}
    # emb.weight: 6144 elements but named; fc.weight 5120 >= 4096: narrow;
    # ln.weight and fc.bias: under 4096.
    assert by == {"emb.weight": "bf16:keep32", "fc.weight": "bf16",
                  "ln.weight": "bf16:keep32", "fc.bias": "bf16:keep32"}
    grads([p for _, p in named], 0)
    opt.step()
    for n, p in named:
        m = opt.state[p]["exp_avg"]
        want = torch.float32 if by[n] == "bf16:keep32" else BF
        assert m.dtype == want, (n, m.dtype)
    opt.close()


@pytest.mark.parametrize("clip,moments", [(None, "bf16"), (0.5, "bf16"), (None, "q8"), (0.5, "q8")])
def test_each_class_steps_as_its_own_step(steps, clip, moments):
    keep = dict(below=4096, names=["emb.*"])
    cl = policy_classes(steps, keep, param="bf16", master="f32", moments=moments, clip=clip)
    assert cl["bf16"].state_dtype(zopt.StateKind.EXP_AVG) == \
        (zopt.DType.Q8 if moments == "q8" else zopt.DType.BF16)
    assert cl["bf16:keep32"].state_dtype(zopt.StateKind.EXP_AVG) == zopt.DType.F32
    named = model(1)
    opt = zopt.Optimizer(cl, named, lr=1e-2, weight_decay=0.1)
    # References: one optimizer per class step, each over ALL params, so each
    # sees every gradient (the same global norm when clipping).
    refs, rparams = {}, {}
    for c in ("bf16", "bf16:keep32"):
        ps = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
        refs[c] = zopt.Optimizer(cl[c], ps, lr=1e-2, weight_decay=0.1)
        rparams[c] = ps
    for it in range(4):
        grads([p for _, p in named], it)
        for c in refs:
            for q, (_, p) in zip(rparams[c], named):
                q.grad = p.grad.clone()
        opt.step()
        for c in refs:
            refs[c].step()
        if clip is not None:
            full = torch.cat([p.grad.double().reshape(-1) for _, p in named])
            assert opt.last_grad_norm == pytest.approx(float(full.norm()), rel=1e-5)
            assert refs["bf16"].last_grad_norm == pytest.approx(opt.last_grad_norm, rel=1e-6)
        for i, (n, p) in enumerate(named):
            c = opt._class_of[id(p)]
            r = rparams[c][i]
            if clip is None:
                assert torch.equal(bits(p), bits(r)), (it, n)
            else:  # the norm's sum runs over two classes: last-bit coefficient
                mp = torch.from_numpy(opt.read_state(p, "master")).view(p.shape)
                mr = torch.from_numpy(refs[c].read_state(r, "master")).view(r.shape)
                assert torch.allclose(mp, mr, rtol=1e-6, atol=1e-7), (it, n)
    # A param in the wrong class would differ: the two classes' results differ.
    other = rparams["bf16"][0]
    assert not torch.equal(bits(other), bits(rparams["bf16:keep32"][0]))
    opt.close()
    for r in refs.values():
        r.close()


def test_checkpoint_and_state_dict_round_trip(steps, tmp_path):
    cl = policy_classes(steps, 4096, param="bf16", master="f32", moments="bf16")
    named = model(2)
    opt = zopt.Optimizer(cl, named, lr=1e-2)
    for it in range(2):
        grads([p for _, p in named], it)
        opt.step()
    path = str(tmp_path / "ckpt")
    opt.save(path)
    files = opt.checkpoint_files(path)
    assert set(files) == {"bf16", "bf16:keep32"}
    sd = opt.state_dict()
    saved = [bits(p) for _, p in named]
    grads([p for _, p in named], 5)
    opt.step()
    after = [bits(p) for _, p in named]
    # Back to the saved point by the checkpoint, and on to the same step.
    opt.load(path)
    assert all(torch.equal(bits(p), s) for (_, p), s in zip(named, saved))
    grads([p for _, p in named], 5)
    opt.step()
    assert all(torch.equal(bits(p), a) for (_, p), a in zip(named, after))
    # The same by the state_dict (torch's layout, f32 moments for keep32 params).
    for (_, p), s in zip(named, saved):
        p.data.copy_(s.view(BF))
    opt.load_state_dict(sd)
    grads([p for _, p in named], 5)
    opt.step()
    assert all(torch.equal(bits(p), a) for (_, p), a in zip(named, after))
    opt.close()


def test_add_param_group_is_routed(steps):
    cl = policy_classes(steps, dict(below=100, names=["head.*"]), param="bf16",
                        master="f32", moments="bf16")
    named = model(3)
    opt = zopt.Optimizer(cl, named[:2], lr=1e-2)
    g = torch.Generator().manual_seed(7)
    head = torch.nn.Parameter(torch.randn(50, 50, generator=g).to(BF))
    small = torch.nn.Parameter(torch.randn(10, generator=g).to(BF))
    opt.add_param_group({"params": [("head.weight", head), ("x.bias", small)]})
    assert opt._class_of[id(head)] == "bf16:keep32"
    assert opt._class_of[id(small)] == "bf16:keep32"
    assert opt._class_of[id(named[1][1])] == "bf16"  # fc.weight: 5120, no name
    opt.close()


def test_bad_policies(steps):
    with pytest.raises(zopt.ZoptError, match="every class already has f32 moments"):
        S.adamw.spec(param="bf16", master="f32", keep32=4096)
    with pytest.raises(zopt.ZoptError, match="unknown key 'size'"):
        S.adamw.spec(param="bf16", moments="bf16", keep32={"size": 3})
    with pytest.raises(zopt.ZoptError, match="an element count"):
        S.adamw.spec(param="bf16", moments="bf16", keep32={"below": -1})
    with pytest.raises(zopt.ZoptError, match="fnmatch pattern"):
        S.adamw.spec(param="bf16", moments="bf16", keep32={"names": [""]})
    cl = policy_classes(steps, dict(names=["emb.*"]), param="bf16", master="f32",
                        moments="bf16")
    plain = [p for _, p in model()]
    with pytest.raises(zopt.ZoptError, match="have no names"):
        zopt.Optimizer(cl, plain, lr=1e-2)
    with pytest.warns(UserWarning, match="'nothing.*' matches no param name"):
        zopt.Optimizer(policy_classes(steps, dict(names=["nothing.*"]), param="bf16",
                                      master="f32", moments="bf16"),
                       model(), lr=1e-2).close()
    with pytest.raises(zopt.ZoptError, match="without class 'bf16'"):
        zopt.Optimizer({"bf16:keep32": cl["bf16:keep32"]}, plain, lr=1e-2)


def test_plain_mapping_gets_the_default_threshold(steps):
    cl = policy_classes(steps, 4096, param="bf16", master="f32", moments="bf16")
    plain = {"bf16": cl["bf16"], "bf16:keep32": cl["bf16:keep32"]}  # no .keep32
    named = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = zopt.Optimizer(plain, [p for _, p in named], lr=1e-2)
    assert [opt._class_of[id(p)] for _, p in named] == \
        ["bf16", "bf16", "bf16:keep32", "bf16:keep32"]  # 6144, 5120 >= 4096
    opt.close()

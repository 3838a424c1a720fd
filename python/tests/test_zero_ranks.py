"""zopt.Optimizer across 2 gloo processes (process_group=): ZeRO-2 and ZeRO-3
(gathered after each step, and with zopt.zero3_hooks) train a small bf16
model for a few steps; the params, masters and moments of both ranks must
equal, bit for bit, a one-process run of the same step on the rank-order
sum of the two ranks' gradients (divided by 2 as the runtime's default
divisor, the world size, does). The same for a model of two parameter
classes (bf16 Linears, an f32 LayerNorm) under one optimizer, ZeRO-2 and
ZeRO-3 with f32 gradients of the bf16 class. The processes have a hard
timeout and are killed on failure. Also: the example
examples/train_ddp_zero.py (mp.spawn, 2 ranks) as a smoke test."""
import os
import subprocess
import sys

import pytest
import torch

import zopt
from test_comm import _free_port, _run_all, _runtime_env
from zero_worker import (LR, STEPS, WD, drop_grad, extra_grad, extra_param, loss_of, mixed_drop,
                         mixed_loss_of, mixed_model, round_trip_sequence, zero_model)
from zopt.describe import describe

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

CASES = {"z2": 2, "z3step": 3, "z3hooks": 3}
# Mixed models: (ZeRO stage, f32 gradients of the bf16 class)
MIXED = {"mixed_z2": (2, False), "mixed_f32grad_z3": (3, True)}


def _mixed_texts(stage, f32grad):
    bf = dict(master="f32", grad="f32") if f32grad else dict(master="f32")
    return zopt.steps.adamw.text(clip=1.0, zero_stage=stage, comments=False,
                                 classes={"bf16": bf, "f32": {}})


def _step_text(stage):
    return describe("adamw", layout="bf16_master", clip=1.0,
                    attributes={"zero_stage": stage})


def reference(step, world):
    """One process, world size 1: each step the ranks' gradients are
    computed with the same params and summed in f32 in rank order (the
    runtime's fold), rounded to the grad dtype; the divisor is the
    multi-rank run's default (its world size)."""
    torch.set_num_threads(1)
    model = zero_model()
    opt = zopt.Optimizer(step, model.parameters(), lr=LR, weight_decay=WD,
                         grad_divisor=world)
    for s in range(STEPS):
        total = [None] * 4
        for r in range(world):
            opt.zero_grad(set_to_none=True)
            loss_of(model, s, r).backward()
            drop_grad(model, s, r)
            for i, p in enumerate(model.parameters()):
                if p.grad is not None:
                    g = p.grad.float()
                    total[i] = g if total[i] is None else total[i] + g
        for p, g in zip(model.parameters(), total):
            p.grad = None if g is None else g.to(p.dtype)
        opt.step()
    sd = opt.state_dict()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "master": [torch.from_numpy(opt.read_state(t, "master")) for t in range(4)],
            "steps": [opt.tensor_step(t) for t in range(4)],
            "exp_avg": [sd["state"][t]["exp_avg"] for t in range(4)]}


def mixed_reference(mapping, world, f32grad):
    """One process, world size 1, the mixed model: each step every rank's
    gradients (bf16 ones for the bf16 class, or their f32 values when the
    class has f32 gradients; f32 for the LayerNorm) summed in f32 in rank
    order, rounded to the class's gradient dtype."""
    torch.set_num_threads(1)
    model = mixed_model()
    opt = zopt.Optimizer(mapping, model.parameters(), lr=LR, weight_decay=WD,
                         grad_divisor=world)
    ps = list(model.parameters())
    main = [f32grad and p.dtype == torch.bfloat16 for p in ps]
    norms = []
    for s in range(STEPS):
        total = [None] * len(ps)
        for r in range(world):
            opt.zero_grad(set_to_none=True)
            mixed_loss_of(model, s, r).backward()
            mixed_drop(model, s, r)
            for i, p in enumerate(ps):
                g = getattr(p, "main_grad", None) if main[i] else p.grad
                if g is not None:
                    g = g.float().clone()
                    total[i] = g if total[i] is None else total[i] + g
        for p, m, g in zip(ps, main, total):
            p.grad = None if (m or g is None) else g.to(p.dtype)
            if m:
                p.main_grad = g   # read in place (None: no gradient)
        opt.step()
        norms.append(opt.last_grad_norm)
    return {"params": [p.detach().clone() for p in ps], "norms": norms,
            "steps": [opt.tensor_step(t) for t in range(len(ps))],
            "state": opt.state_dict()["state"]}


def _equal(a, b):
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


def test_zero2_zero3_two_gloo_ranks_bit_identical(steps, tmp_path):
    sos = {case: steps.text(_step_text(stage)).path for case, stage in CASES.items()}
    mixed = {case: {c: steps.text(t) for c, t in _mixed_texts(*v).items()}
             for case, v in MIXED.items()}
    for case, m in mixed.items():
        sos[case] = ",".join(f"{c}:{st.path}" for c, st in m.items())
    env = _runtime_env()
    port = _free_port()
    args = [f"{c}={so}" for c, so in sos.items()]
    cmds = [[sys.executable, os.path.join(HERE, "zero_worker.py"), str(r), "2", str(port),
             str(tmp_path), *args] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=180, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    for case, stage in CASES.items():
        ref = reference(steps.text(_step_text(stage)), 2)
        assert ref["steps"] == [4, 3, 4, 4]  # no rank had the first bias's grad at step 2
        for r in range(2):
            got = torch.load(os.path.join(tmp_path, f"{case}_rank{r}.pt"))
            assert got["steps"] == ref["steps"], case
            for what in ("params", "master", "exp_avg"):
                for i, (a, b) in enumerate(zip(got[what], ref[what])):
                    assert _equal(a, b), f"{case} rank {r}: {what} {i} differs from one rank"
            # each rank holds half of what one rank holds (f32 master and
            # moments; ZeRO-3 also the bf16 params), within one norm block
            # (this model of 163 elements gets the smallest, 64 elements);
            # the layout itself is checked by zopt-zero-check
            held = 3 * 4 + (2 if stage == 3 else 0)
            one = got["one_rank"]
            assert got["state_bytes"] < one and abs(2 * got["state_bytes"] - one) <= 2 * 64 * held, \
                (case, got["state_bytes"], one)
    for case, (stage, f32grad) in MIXED.items():
        ref = mixed_reference(mixed[case], 2, f32grad)
        # the LayerNorm's bias had no gradient at step 2 on any rank
        assert ref["steps"] == [4, 4, 4, 3, 4, 4], case
        for r in range(2):
            got = torch.load(os.path.join(tmp_path, f"{case}_rank{r}.pt"))
            assert got["steps"] == ref["steps"], case
            assert got["norms"] == ref["norms"], f"{case} rank {r}: the global norms differ"
            for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
                assert _equal(a, b), f"{case} rank {r}: param {i} differs from one rank"
            assert got["state"].keys() == ref["state"].keys()
            for t, st in ref["state"].items():
                assert st.keys() == got["state"][t].keys()
                for k, v in st.items():
                    assert _equal(got["state"][t][k], v), f"{case} rank {r}: {k} of {t}"


def test_state_dict_on_one_rank_gloo(steps, tmp_path):
    """Issue 16 item 12: on 2 gloo ranks, only rank 0 calls state_dict()
    (rank 1 goes on to step()). Both calls fail at once with ZoptError
    (COMM): rank 0's says that every rank must call state_dict(), rank 1's
    names rank 0's call; nothing changed, so the process group and the
    optimizer stay usable: an all_reduce works, state_dict() on both ranks
    returns the same states, and training goes on to the one-process result
    bit for bit. The processes have a hard timeout."""
    so = steps.text(_step_text(2)).path
    port = _free_port()
    cmds = [[sys.executable, os.path.join(HERE, "zero_worker.py"), str(r), "2", str(port),
             str(tmp_path), f"one_rank_state_dict={so}"] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=120, env=_runtime_env())
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    got = [torch.load(os.path.join(tmp_path, f"one_rank_state_dict_rank{r}.pt")) for r in range(2)]
    (c0, m0), (c1, m1) = got[0]["first"], got[1]["first"]
    assert c0 == c1 == int(zopt.Status.COMM), (m0, m1)
    assert "state_dict() is collective at world size 2: every rank must call it" in m0, m0
    assert "rank 1 called" in m0 and "STEP" in m0, m0
    assert "rank 0 called" in m1 and "EXPORT" in m1, m1  # (the state's export: issue 17)
    for m in (m0, m1):
        assert "this call changed nothing and the communicator remains usable" in m, m
    assert got[0]["all_reduce"] == got[1]["all_reduce"] == 2.0
    sd0, sd1 = got[0]["state_dict"], got[1]["state_dict"]
    assert sd0.keys() == sd1.keys() and len(sd0) == 4
    for t in sd0:
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert _equal(sd0[t][k], sd1[t][k]), (t, k)
    ref = reference(steps.text(_step_text(2)), 2)
    for r in range(2):
        for i, (a, b) in enumerate(zip(got[r]["params"], ref["params"])):
            assert _equal(a, b), f"rank {r}: param {i} differs from one process"


def test_example_train_ddp_zero(zopt_bins):
    env = _runtime_env()
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_ddp_zero.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout, r.stdout + r.stderr


def test_zero3_one_process_gather_release_and_user_writes(steps):
    """World size 1: a ZeRO-3 step (params held by the runtime) trains
    bit-identically to the ZeRO-0 step, with params gathered after every
    step or through zero3_hooks; released params have no storage; weights
    loaded into the model (after gather_params) are not lost."""
    z0 = steps(rule="adamw", layout="bf16_master", clip=1.0)
    z3 = steps.text(_step_text(3))
    assert z3.zero3 and not z0.zero3

    def run(step, mode):
        torch.set_num_threads(1)
        model = zero_model()
        opt = zopt.Optimizer(step, model.parameters(), lr=LR, weight_decay=WD)
        hooks = zopt.zero3_hooks(model, opt) if mode == "hooks" else None
        for s in range(STEPS):
            opt.zero_grad()
            loss_of(model, s, 0).backward()
            opt.step()
            if hooks is not None:
                assert len(opt.released_params) == 4
                assert all(p.storage().size() == 0 for p in model.parameters())
        opt.gather_params()
        return model, opt, hooks
    ref, _, _ = run(z0, None)
    for mode in ("step", "hooks"):
        model, opt, hooks = run(z3, mode)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert _equal(a.detach(), b.detach()), mode
        # user weights loaded after a gather survive the next gather/step
        new = zero_model()
        with torch.no_grad():
            for p in new.parameters():
                p.mul_(0.5)
        model.load_state_dict(new.state_dict())
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        opt.zero_grad()
        loss_of(model, 0, 0).backward()
        opt.step()
        opt.gather_params()
        for a, b in zip(model.parameters(), new.parameters()):
            assert _equal(a.detach(), b.detach()), f"{mode}: loaded weights lost"
        if hooks is not None:
            hooks.remove()
    with pytest.raises(zopt.ZoptError, match="not ZeRO-3"):
        zopt.Optimizer(z0, zero_model().parameters()).release_params()


def test_comm_loopback_threads(steps):
    """comm= a zopt.comm.Comm: 2 loopback ranks as threads of this process
    (ZeRO-2, f32), against one rank on the summed gradients; accumulation
    of 2 micro-batches through grad_divisor (the mean over 4 gradients)."""
    import threading
    import numpy as np
    from zopt.comm import Comm
    step = steps.text(describe("adamw", layout="f32", attributes={"zero_stage": 2}))
    rng = np.random.default_rng(0)
    p0 = [rng.standard_normal(n).astype(np.float32) for n in (5, 300, 1)]
    grads = [[[rng.standard_normal(p.size).astype(np.float32) for p in p0] for _ in range(2)]
             for _ in range(3)]  # [step][rank][tensor]
    comms = Comm.loopback(2, timeout=30)
    out, errors = [None, None], []

    def rank(r):
        try:
            ps = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
            opt = zopt.Optimizer(step, ps, lr=0.01, weight_decay=0.1, comm=comms[r],
                                 grad_divisor=4)
            assert opt.world_size == 2 and opt.grad_divisor == 4
            for s in range(3):
                for p, g in zip(ps, grads[s][r]):  # two micro-batches: 2 * g
                    p.grad = torch.from_numpy(g.copy())
                    p.grad += torch.from_numpy(g)
                opt.step()
            out[r] = [p.detach().clone() for p in ps]
            opt.close()
        except BaseException as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "loopback ranks hung"
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    ps = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    ref = zopt.Optimizer(step, ps, lr=0.01, weight_decay=0.1, grad_divisor=4)
    for s in range(3):
        for i, p in enumerate(ps):
            a, b = (torch.from_numpy(grads[s][r][i]) for r in range(2))
            p.grad = (a + a) + (b + b)
        ref.step()
    for r in range(2):
        for a, b in zip(out[r], ps):
            assert torch.equal(a, b.detach())


def test_state_dict_round_trip_and_add_param_group_two_gloo_ranks(steps, tmp_path):
    """Issue 17 on 2 gloo ranks, ZeRO-2 and ZeRO-3 (bf16 params, f32 master
    and moments sharded): state_dict() (the runtime's whole export,
    gathered) loaded back with load_state_dict (one staged import per rank)
    gives the same state_dict bit for bit and the same training as before
    it; add_param_group adds the group in place (the sharded states
    re-sharded). Every rank ends with the one-process run of the same
    sequence on the rank-order sum of the gradients, bit for bit. The
    processes have a hard timeout."""
    cases = {"roundtrip_z2": 2, "roundtrip_z3": 3}
    sos = {c: steps.text(_step_text(stage)).path for c, stage in cases.items()}
    port = _free_port()
    cmds = [[sys.executable, os.path.join(HERE, "zero_worker.py"), str(r), "2", str(port),
             str(tmp_path), *[f"{c}={so}" for c, so in sos.items()]] for r in range(2)]
    procs, outs = _run_all(cmds, timeout=180, env=_runtime_env())
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE rank {r}" in out, f"rank {r}:\n{out}"
    for case, stage in cases.items():
        torch.set_num_threads(1)
        model, extra = zero_model(), extra_param()
        opt = zopt.Optimizer(steps.text(_step_text(stage)), model.parameters(), lr=LR,
                             weight_decay=WD, grad_divisor=2, seed=9)

        def set_grads(s, with_extra):  # the rank-order f32 sum, rounded
            ps = list(model.parameters())
            total = [None] * len(ps)
            for r in range(2):
                for p in ps:
                    p.grad = None
                loss_of(model, s, r).backward()
                for i, p in enumerate(ps):
                    total[i] = p.grad.float() if total[i] is None else total[i] + p.grad.float()
            for p, g in zip(ps, total):
                p.grad = g.to(p.dtype)
            if with_extra:
                extra.grad = (extra_grad(s, 0).float() + extra_grad(s, 1).float()).to(extra.dtype)
        ref = round_trip_sequence(opt, model, extra, set_grads)
        for r in range(2):
            got = torch.load(os.path.join(tmp_path, f"{case}_rank{r}.pt"))
            assert got["rebuilds"] == 1, case
            for phase in ("sd", "again"):
                assert got[phase]["zopt"]["group_steps"] == [2], (case, phase)
                for t, st in got[phase]["state"].items():
                    for k, v in st.items():
                        assert _equal(v, got["sd"]["state"][t][k]), (case, r, phase, t, k)
                        assert _equal(v, ref["sd"]["state"][t][k]), (case, r, phase, t, k)
            for phase in ("first", "second", "final"):
                for i, (a, b) in enumerate(zip(got[phase], ref[phase])):
                    assert _equal(a, b), f"{case} rank {r}: {phase} param {i}"
            for i, (a, b) in enumerate(zip(got["first"], got["second"])):
                assert _equal(a, b), f"{case} rank {r}: param {i} after the round trip"
            for t, st in ref["final_state"].items():
                for k, v in st.items():
                    assert _equal(got["final_state"][t][k], v), (case, r, "final", t, k)

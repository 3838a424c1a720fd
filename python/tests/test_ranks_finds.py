"""What the ranks fuzzer (test_ranks_fuzz.py) found, each minimized to a
deterministic test that failed before its fix (docs/TESTING.md "The ranks
fuzzer"). Ranks are loopback threads of this process (zopt.comm.Comm:
the runtime's own collectives, no process start)."""
import threading

import torch

import zopt
from zopt.comm import Comm


def on_ranks(world, fn, timeout=60):
    """fn(rank, comm) on `world` loopback ranks (threads); their results."""
    comms = Comm.loopback(world, timeout=20)
    out, errors = [None] * world, []

    def rank(r):
        try:
            out[r] = fn(r, comms[r])
        except BaseException as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout)
    hung = any(t.is_alive() for t in ts)
    if not hung:
        for c in comms:
            c.close()
    assert not hung, "loopback ranks hung"
    if errors:
        raise errors[0]
    return out


def _grads(step, p):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(p.shape, generator=g)
    return (torch.sign(x) * (x.abs() + 0.1) * 1024).to(p.dtype)


def test_r1_a_step_without_gradients_is_no_good_step_for_the_loss_scaler(steps):
    """R1: at W = 2 a step() where no rank had a gradient ran the runtime
    (collective: it cannot know the others have none), whose FINISH counted
    a good step for the dynamic loss scaler; at one rank the binding does
    not call the runtime, nothing changes. The scale then grew a step
    earlier than one rank's and every later update differed. With two
    classes (a linked step) the scaler counts when any class has a
    gradient, alike in both (a part without one would otherwise fall
    behind the other, and the next linked step be refused)."""
    one = zopt.steps.adamw(loss_scale=True, zero_stage=1)
    mixed = zopt.steps.adamw(loss_scale=True, zero_stage=2,
                             classes={"bf16": dict(master="f32"), "f32": {}})

    def train(step, comm, world):
        g = torch.Generator().manual_seed(0)   # (threads: not the global generator)
        ps = [torch.nn.Parameter(torch.randn(40, generator=g)),
              torch.nn.Parameter(torch.randn(70, generator=g).to(torch.bfloat16))]
        if not isinstance(step, dict):
            ps = ps[:1]
        kw = dict(comm=comm) if comm is not None else dict(grad_divisor=world)
        opt = zopt.Optimizer(step, ps, lr=1e-2, loss_scaler=dict(growth_interval=3), **kw)
        scales = []
        # grads: both / none (no rank) / f32 class only / both ...
        for s, which in enumerate([(0, 1), (), (0,), (0, 1), (), (), (0, 1), (0, 1)]):
            for i, p in enumerate(ps):
                g = _grads(s, p) if i in which else None
                # every rank the same gradient: the one-rank run gets their sum
                p.grad = None if g is None else (g if comm is not None else
                                                 (g.float() * world).to(p.dtype))
            opt.step()
            sd = opt.state_dict()["zopt"]["loss_scaler"]
            # (the outcome of a step without gradients: at one rank none is
            # run; at W = 2 the runtime's, norm 0: docs/USAGE.md section 3)
            scales.append((opt.last_loss_scale if which else None, sd["scale"],
                           sd["good_steps"]))
        out = scales, [p.detach().clone() for p in ps]
        opt.close()
        return out

    for step in (one, mixed):
        ref_scales, ref_ps = train(step, None, 2)
        assert ref_scales[-1][1] == 2 * 65536.0   # it grew once (4 good steps of 3)
        for r, (scales, ps) in enumerate(on_ranks(2, lambda r, c: train(step, c, 2))):
            assert scales == ref_scales, f"rank {r}: loss scaler {scales} vs one rank {ref_scales}"
            for a, b in zip(ps, ref_ps):
                assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_r2_a_sharded_model_of_empty_params_exports_and_grows(tmp_path):
    """R2: at W = 2 a ZeRO-1/2/3 optimizer whose params are all empty
    (numel 0: no bucket, so no collective scratch) failed state_dict() /
    save() with INTERNAL "gather_state: no collective scratch". Now the
    export gathers nothing; add_param_group then adds real params, and
    training, state_dict() and a save loaded at one rank equal one rank's,
    bit for bit."""
    def run(stage, comm, r):
        g = torch.Generator().manual_seed(3)
        empty = torch.nn.Parameter(torch.randn(0))
        kw = dict(comm=comm) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(zopt.steps.adamw(zero_stage=stage, clip=1.0), [empty],
                             lr=1e-2, **kw)
        sd0 = opt.state_dict()
        path = str(tmp_path / f"z{stage}_{'w2' if comm is not None else 'w1'}")
        opt.save(path)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (33, 70)]
        opt.add_param_group(dict(params=ps, lr=3e-2))
        for s in range(3):
            for p in ps:
                x = _grads(s, p)
                p.grad = x if comm is not None else x * 2
            opt.step()
        sd = opt.state_dict()
        opt.close()
        return sd0["state"], sd["state"], [p.detach().clone() for p in ps], path

    for stage in (1, 2, 3):
        ref = run(stage, None, 0)
        got = on_ranks(2, lambda r, c: run(stage, c, r))
        for r, (sd0, sd, ps, path) in enumerate(got):
            assert sd0 == {} and sorted(sd) == sorted(ref[1]), (stage, r)
            for i in sd:
                for k, v in sd[i].items():
                    assert torch.equal(v, ref[1][i][k]), (stage, r, i, k)
            for a, b in zip(ps, ref[2]):
                assert torch.equal(a, b), (stage, r)
        one = zopt.Optimizer(zopt.steps.adamw(zero_stage=stage, clip=1.0),
                             [torch.nn.Parameter(torch.randn(0))])
        one.load(got[0][3])   # the W = 2 save of the empty model, at one rank
        one.close()


def test_r3_a_refused_streamed_step_reduces_nothing():
    """R3: with grad_streaming=True, step() reduced the gradients set by
    hand (and freed p.grad) before it pushed the groups' edits; an lr out
    of range then raised ValueError with the reduction done: p.grad was
    gone, zero_grad() refused, and the gradients set again for the retried
    step were silently ignored (it stepped on the first ones). Now the
    edits are pushed first: the refusal changes nothing, and the retried
    step equals one rank's on the new gradients."""
    step = zopt.steps.adamw(zero_stage=2)

    def grad(s, i, p):
        return torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))

    def run(comm):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (30, 50)]
        kw = dict(comm=comm, grad_streaming=True) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(step, ps, lr=1e-2, **kw)
        k = 1 if comm is not None else 2   # one rank: the two ranks' sum
        for s in range(3):
            if s == 1 and comm is not None:
                for i, p in enumerate(ps):
                    p.grad = grad(99, i, p)
                held = [p.grad for p in ps]
                opt.param_groups[0]["lr"] = -1.0
                try:
                    opt.step()
                except ValueError:
                    pass
                else:
                    raise AssertionError("a step at lr -1 was not refused")
                assert all(p.grad is h for p, h in zip(ps, held)), "p.grad changed by a refusal"
                opt.param_groups[0]["lr"] = 1e-2
                opt.zero_grad(set_to_none=True)
            for i, p in enumerate(ps):
                p.grad = grad(s, i, p) * k
            opt.step()
        out = [p.detach().clone() for p in ps]
        opt.close()
        return out

    ref = run(None)
    for r, ps in enumerate(on_ranks(2, lambda r, c: run(c))):
        for a, b in zip(ps, ref):
            assert torch.equal(a, b), f"rank {r}: differs from one rank"


def test_r4_a_streamed_empty_param_without_gradient_is_left_alone():
    """R4: with grad_streaming=True the runtime took every empty param (in no
    bucket, so never handed over) as having a gradient: its step count
    advanced at every step, also with p.grad None (torch and one rank leave
    it alone), and its state showed steps it never took. Now the binding
    tells the runtime through the mask (read for empty tensors only)."""
    step = zopt.steps.adamw(zero_stage=2)

    def run(comm):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(0)), torch.nn.Parameter(torch.randn(40, generator=g))]
        kw = dict(comm=comm, grad_streaming=True) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(step, ps, lr=1e-2, **kw)
        counts = []
        for s, empty_grad in enumerate([True, False, False, True, False]):
            ps[0].grad = torch.zeros(0) if empty_grad else None
            ps[1].grad = _grads(s, ps[1]) * (1 if comm is not None else 2)
            opt.step()
            counts.append([opt.tensor_step(p) for p in ps])
        sd = opt.state_dict()
        opt.close()
        return counts, sd["state"][0]["step"].item(), ps[1].detach().clone()

    ref = run(None)
    assert ref[0][-1] == [2, 5]
    for r, got in enumerate(on_ranks(2, lambda r, c: run(c))):
        assert got[0] == ref[0] and got[1] == ref[1], f"rank {r}: step counts {got[0]} vs {ref[0]}"
        assert torch.equal(got[2], ref[2])


def test_r5_zero3_remainder_master_state_reset():
    """R5: `opt.state[p] = {}` (reset: the master made from the param) on a
    ZeRO-3 step with a remainder master (bf16 params, the f32 master's low
    half as int16) raised KeyError (no int16 conversion) after the moments
    and the count were already reset. Now the remainder is zeroed (the
    master is the param): the reset and the steps after it equal the same
    at ZeRO-0, bit for bit, at one rank and at two."""
    def run(stage, comm):
        step = zopt.steps.lion(param="bf16", master="remainder", zero_stage=stage)
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in (33, 70)]
        kw = dict(comm=comm) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(step, ps, lr=1e-2, **kw)
        for s in range(4):
            for p in ps:
                x = torch.randn(p.shape, generator=g).bfloat16()
                p.grad = x if comm is not None else (x.float() * 2).bfloat16()
            opt.step()
            if s == 1:
                opt.state[ps[0]] = {}
        out = ([opt.tensor_step(p) for p in ps], [p.detach().clone() for p in ps],
               [torch.from_numpy(opt.read_state(p, "master")) for p in ps])
        opt.close()
        return out

    ref = run(0, None)
    assert ref[0] == [2, 4]
    for got in [run(3, None)] + on_ranks(2, lambda r, c: run(3, c)):
        assert got[0] == ref[0]
        for a, b in zip(got[1] + got[2], ref[1] + ref[2]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_r6_zero3_add_param_group_at_memory_a_param_had():
    """R6: under ZeRO-3 the runtime kept each param's memory as registered
    at build, though the binding moves params to other storage without
    telling it (release_params and zero3_hooks free it and gather into new
    storage; p.data = new): add_param_group of a new param at such an
    address (the allocator hands freed memory out again; here the old
    storage itself, kept) was refused ("param pointer ... is already
    registered"). Now the moved params are registered first, in two passes
    (two params that swapped storage are each where the other was); the
    training equals one where the new param has other memory, bit for
    bit."""
    def run(same_memory):
        step = zopt.steps.adamw(zero_stage=3)
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(100, generator=g))
        r1, r2 = (torch.nn.Parameter(torch.randn(50, generator=g)) for _ in range(2))
        opt = zopt.Optimizer(step, [p, r1, r2], lr=1e-2)
        p.grad, r1.grad, r2.grad = _grads(0, p), _grads(1, r1), _grads(2, r2)
        opt.step()
        old = p.data
        p.data = old.clone()   # p moves; its old memory becomes q's
        r1.data, r2.data = r2.data, r1.data   # each where the other is registered
        x = old if same_memory else torch.empty(100)
        x.copy_(torch.randn(100, generator=g))
        q = torch.nn.Parameter(x)
        opt.add_param_group(dict(params=[q], lr=3e-2))
        opt.release_params()
        opt.gather_params()
        for s in range(1, 3):
            p.grad, q.grad, r1.grad = _grads(s, p), _grads(10 + s, q), _grads(20 + s, r1)
            opt.step()
        out = [x.detach().clone() for x in (p, q, r1, r2)]
        opt.close()
        return out

    ref = run(False)
    for a, b in zip(run(True), ref):
        assert torch.equal(a, b)


def test_r7_zero3_write_after_storage_moved_on_one_rank():
    """R7: under ZeRO-3 a write into a param (detected at the next call:
    the master and the held param made again from it) took one of two
    paths by whether the param's storage was still the one registered at
    build: a runtime refresh, or a write that reads the gathered master
    (collective). Whether storage moves is the allocator's doing (a release
    and gather: zero3_hooks at every step, or p.data = a copy), so ranks
    writing the same values took different paths and failed with COMM
    ("read_state_raw ... rank 1 called ... EXPORT"). Here rank 1's param
    moves (the same values); both ranks then write it and train on: the
    one-rank result, bit for bit."""
    step = zopt.steps.sgd(param="bf16", master="f32", zero_stage=3)

    def run(comm, r):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in (40, 70)]
        kw = dict(comm=comm) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(step, ps, lr=1e-2, momentum=0.9, **kw)
        for s in range(3):
            for p in ps:
                x = _grads(s, p)
                p.grad = x if comm is not None else (x.float() * 2).bfloat16()
            opt.step()
            if s == 0:
                if r == 1:
                    ps[0].data = ps[0].data.clone()   # moved on one rank only
                with torch.no_grad():
                    ps[0].mul_(2.0)                   # a write on every rank
        sd = opt.state_dict()["state"]
        out = [p.detach().clone() for p in ps], [sd[i]["master"] for i in range(2)]
        opt.close()
        return out

    ref = run(None, 0)
    for r, (ps, ms) in enumerate(on_ranks(2, lambda r, c: run(c, r))):
        for a, b in zip(ps + ms, ref[0] + ref[1]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b), f"rank {r}"


def test_r8_params_moved_onto_memory_registered_for_another_on_one_rank():
    """R8: a param given storage still registered for another param (the
    allocator hands a moved param's freed memory out again, which differs
    between ranks; here done by hand on rank 1 with the same values as
    rank 0's) made set_tensor_memory refuse it, and the binding rebuilt the
    native optimizer (a collective export) on that rank only: COMM at the
    next step. Now such params go to scratch memory first, then to their
    storage, in place on every rank: the one-rank result, bit for bit."""
    step = zopt.steps.adamw(param="bf16", master="f32", zero_stage=2)

    def run(comm, r):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(50, generator=g).bfloat16()) for _ in range(2)]
        kw = dict(comm=comm) if comm is not None else dict(grad_divisor=2)
        opt = zopt.Optimizer(step, ps, lr=1e-2, **kw)
        for s in range(3):
            for p in ps:
                x = _grads(s, p)
                p.grad = x if comm is not None else (x.float() * 2).bfloat16()
            opt.step()
            if s == 0:
                v0, v1 = ps[0].detach() * 2, ps[1].detach() * 3
                if r == 1:   # param 0 takes the memory param 1 is registered at
                    old1 = ps[1].data
                    ps[1].data = v1.clone()
                    old1.copy_(v0)
                    ps[0].data = old1
                else:
                    ps[0].data, ps[1].data = v0.clone(), v1.clone()
        out = [p.detach().clone() for p in ps]
        opt.close()
        return out

    ref = run(None, 0)
    for r, ps in enumerate(on_ranks(2, lambda r, c: run(c, r))):
        for a, b in zip(ps, ref):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"rank {r}"


def test_r9_ranks_loading_different_checkpoints_are_refused(tmp_path):
    """R9: opt.load(path) at W = 2 with another checkpoint on each rank was
    accepted: each rank kept its shards from its own file (here two saves
    at the same step, the moments changed between them): the gathered
    state a mix of both, silently. Now the ranks agree on the save's
    identity and settings before anything is applied: refused on every
    rank, naming rank 1, nothing changed; the same checkpoint on both
    loads."""
    step = zopt.steps.adamw(zero_stage=2)

    def run(comm, r):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (50, 70)]
        opt = zopt.Optimizer(step, ps, lr=1e-2, comm=comm)
        for s in range(2):
            for p in ps:
                p.grad = _grads(s, p)
            opt.step()
        opt.save(str(tmp_path / "a"))
        opt.state[ps[0]]["exp_avg"] = torch.full((50,), 0.5)   # (every rank alike)
        opt.save(str(tmp_path / "b"))
        before = opt.state_dict()["state"]
        try:
            opt.load(str(tmp_path / ("a" if r == 0 else "b")))
            err = None
        except zopt.ZoptError as e:
            err = str(e)
        after = opt.state_dict()["state"]
        opt.load(str(tmp_path / "a"))
        again = opt.state_dict()["state"][0]["exp_avg"]
        opt.close()
        return err, before, after, again

    for r, (err, before, after, again) in enumerate(on_ranks(2, lambda r, c: run(c, r))):
        assert err is not None and "rank 1 has another save" in err, f"rank {r}: {err}"
        for i in before:
            for k in before[i]:
                assert torch.equal(before[i][k], after[i][k]), f"rank {r}: {k} of {i} changed"
        assert not torch.equal(again, torch.full((50,), 0.5))   # a's moments, whole


def test_r10_scratch_registration_avoids_registered_freed_memory(monkeypatch):
    """R10 (R8's fix, seed 30 case 142): the scratch memory a moved param's
    registration is parked at could be memory the allocator freed while a
    param (moved, under ZeRO-3 not re-registered) is still registered there:
    that registration was refused ("already registered") on one rank,
    and the other waited at add_param_group's collective. Scratch at a
    registered address is now set aside and drawn again. Here the first
    scratch is made to land there (the old storage of c, kept)."""
    import zopt._rebuild as rb
    step = zopt.steps.adamw(zero_stage=3)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(64, generator=g)) for _ in range(3))
    opt = zopt.Optimizer(step, [a, b, c], lr=1e-2)
    for p in (a, b, c):
        p.grad = torch.randn(64, generator=g)
    opt.step()
    old_c = c.data
    c.data = old_c.clone()           # c moved; still registered at old_c
    a.data, b.data = b.data, a.data  # a and b each where the other is registered
    real, first = rb._scratch_like, [old_c]
    monkeypatch.setattr(rb, "_scratch_like", lambda p: first.pop() if first else real(p))
    q = torch.nn.Parameter(torch.randn(64, generator=g))
    opt.add_param_group(dict(params=[q]))
    assert not first
    for p in (a, b, c, q):
        p.grad = torch.randn(64, generator=g)
    opt.step()
    opt.close()

"""One rank of test_zero_ranks.py: trains the small model of zero_model()
with zopt.Optimizer(..., process_group=WORLD) on gloo, for each case given,
and saves the final params, masters and step counts.

    zero_worker.py RANK WORLD PORT OUTDIR CASE=STEP.so [CASE=STEP.so ...]

CASE: "z2" (ZeRO-2), "z3step" (ZeRO-3, params gathered after each step),
"z3hooks" (ZeRO-3 with zopt.zero3_hooks: gathered per module in forward and
backward, released after), "one_rank_state_dict" (ZeRO-2; before step 2
only rank 0 calls state_dict() while rank 1 steps: both fail, and go on),
"roundtrip_z2" / "roundtrip_z3" (round_trip_sequence: state_dict ->
load_state_dict, add_param_group). Rank r trains on batches (s, r); some params
have no gradient on some ranks (drop_grad). A case whose value is
"bf16:A.so,f32:B.so" trains mixed_model() (bf16 Linears, an f32 LayerNorm)
with one optimizer over both classes. Prints "DONE rank R" last.
"""
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..")))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zopt  # noqa: E402

STEPS = 4
LR, WD = 1e-2, 0.1


def zero_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(torch.bfloat16)


def zero_batch(s, r):
    g = torch.Generator().manual_seed(1000 * s + r)
    return (torch.randn(8, 6, generator=g).to(torch.bfloat16),
            torch.randn(8, 3, generator=g).to(torch.bfloat16))


def loss_of(model, s, r):
    x, y = zero_batch(s, r)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def drop_grad(model, s, r):
    """The gradients a rank does not have at step s: at step 1 rank 1 lacks
    the last bias's (the ranks' masks differ: updated with rank 0's
    gradient), at step 2 no rank has the first bias's (left alone)."""
    if s == 1 and r == 1:
        model[2].bias.grad = None
    if s == 2:
        model[0].bias.grad = None


def mixed_model():
    """bf16 Linear -> f32 LayerNorm -> bf16 Linear: two parameter classes."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 3))
    m[0].to(torch.bfloat16)
    m[2].to(torch.bfloat16)
    with torch.no_grad():
        m[1].weight.add_(torch.randn(16) * 0.1)
        m[1].bias.add_(torch.randn(16) * 0.1)
    return m


def mixed_loss_of(model, s, r):
    x, y = zero_batch(s, r)
    h = model[1](torch.tanh(model[0](x)).float())
    return torch.nn.functional.mse_loss(model[2](h.to(torch.bfloat16)).float(), y.float())


def mixed_drop(model, s, r):
    """At step 1 rank 1 lacks the last (bf16) bias's gradient, at step 2
    no rank has the LayerNorm's (f32) bias's."""
    drop = []
    if s == 1 and r == 1:
        drop.append(model[2].bias)
    if s == 2:
        drop.append(model[1].bias)
    for p in drop:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:  # f32 gradients of a bf16 param
            p.main_grad = None


def mixed_steps(spec):
    return {c: zopt.Step(so) for c, so in (kv.split(":", 1) for kv in spec.split(","))}


def run_mixed(case, spec, rank, world, outdir):
    model = mixed_model()
    opt = zopt.Optimizer(mixed_steps(spec), model.parameters(), lr=LR, weight_decay=WD,
                         process_group=dist.group.WORLD)
    assert opt.world_size == world and list(opt.parts) == ["bf16", "f32"]
    norms = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        mixed_loss_of(model, s, rank).backward()
        mixed_drop(model, s, rank)
        opt.step()
        norms.append(opt.last_grad_norm)
    opt.gather_params()
    n = opt.num_tensors
    out = {"params": [p.detach().clone() for p in model.parameters()],
           "steps": [opt.tensor_step(t) for t in range(n)], "norms": norms,
           "state": opt.state_dict()["state"]}  # collective: the states gathered whole
    torch.save(out, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    print(f"ok {case} rank {rank}", flush=True)
    opt.close()


def run_one_rank_state_dict(case, so, rank, world, outdir):
    """ZeRO-2 training where, before step 2, only rank 0 calls state_dict()
    while rank 1 goes on to step(): both calls fail (every rank must call
    state_dict()), the process group and the optimizer stay usable, and
    training goes on to the one-process result."""
    model = zero_model()
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=LR, weight_decay=WD,
                         process_group=dist.group.WORLD)
    errors = {}
    for s in range(STEPS):
        if s == 2:
            try:
                if rank == 0:
                    opt.state_dict()
                else:
                    opt.zero_grad(set_to_none=True)
                    loss_of(model, s, rank).backward()
                    opt.step()
            except zopt.ZoptError as e:
                errors["first"] = (int(e.code), e.message)
            x = torch.ones(1)
            dist.all_reduce(x)  # the process group still works
            errors["all_reduce"] = float(x)
            errors["state_dict"] = opt.state_dict()["state"]  # now on both ranks
        opt.zero_grad(set_to_none=True)
        loss_of(model, s, rank).backward()
        drop_grad(model, s, rank)
        opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()], **errors}
    torch.save(out, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    print(f"ok {case} rank {rank}", flush=True)
    opt.close()


def extra_param():
    """The param add_param_group adds (the same on every rank)."""
    g = torch.Generator().manual_seed(77)
    return torch.nn.Parameter(torch.randn(37, generator=g).to(torch.bfloat16))


def extra_grad(s, r):
    g = torch.Generator().manual_seed(500 + 10 * s + r)
    return torch.randn(37, generator=g).to(torch.bfloat16)


def round_trip_sequence(opt, model, extra, set_grads):
    """Two steps; state_dict(); two more; the params put back and the
    state_dict loaded; its state_dict again; the same two steps again;
    add_param_group([extra]) and two steps. ``set_grads(s, with_extra)``
    gives the gradients of step s. Returns what each phase ended with."""
    def run(ss, with_extra=False):
        for s in ss:
            opt.zero_grad(set_to_none=True)
            set_grads(s, with_extra)
            opt.step()
        opt.gather_params()
        return [p.detach().clone() for p in model.parameters()] + \
            ([extra.detach().clone()] if with_extra else [])
    run(range(2))
    saved = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    first = run(range(2, 4))
    with torch.no_grad():
        for p, x in zip(model.parameters(), saved):
            p.copy_(x)
    opt.load_state_dict(sd)
    again = opt.state_dict()
    second = run(range(2, 4))
    opt.add_param_group({"params": [extra], "lr": 2 * LR})
    final = run(range(4, 6), with_extra=True)
    return {"sd": sd, "again": again, "first": first, "second": second, "final": final,
            "final_state": opt.state_dict()["state"]}


def run_round_trip(case, so, rank, world, outdir):
    model, extra = zero_model(), extra_param()
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=LR, weight_decay=WD,
                         process_group=dist.group.WORLD, seed=9)

    def set_grads(s, with_extra):
        loss_of(model, s, rank).backward()
        if with_extra:
            extra.grad = extra_grad(s, rank)
    out = round_trip_sequence(opt, model, extra, set_grads)
    out["rebuilds"] = opt.rebuilds
    torch.save(out, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    print(f"ok {case} rank {rank}", flush=True)
    opt.close()


def run_case(case, so, rank, world, outdir):
    if case == "one_rank_state_dict":
        return run_one_rank_state_dict(case, so, rank, world, outdir)
    if case.startswith("roundtrip"):
        return run_round_trip(case, so, rank, world, outdir)
    if "," in so:
        return run_mixed(case, so, rank, world, outdir)
    model = zero_model()
    mode = {"z2": "step", "z3step": "step", "z3hooks": "step"}[case]
    opt = zopt.Optimizer(zopt.Step(so), model.parameters(), lr=LR, weight_decay=WD,
                         process_group=dist.group.WORLD, zero3_gather=mode)
    assert opt.world_size == world and opt.rank == rank
    hooks = zopt.zero3_hooks(model, opt) if case == "z3hooks" else None
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, s, rank).backward()
        drop_grad(model, s, rank)
        opt.step()
        if hooks is not None:
            assert len(opt.released_params) == 4, "params held after the step"
    info = opt.memory_info()
    opt.gather_params()
    out = {"params": [p.detach().clone() for p in model.parameters()],
           "master": [torch.from_numpy(opt.read_state(t, "master")) for t in range(opt.num_tensors)],
           "steps": [opt.tensor_step(t) for t in range(opt.num_tensors)],
           "state_bytes": info["state_bytes"], "one_rank": info["state_bytes_one_rank"]}
    sd = opt.state_dict()  # collective; the moments gathered whole
    out["exp_avg"] = [sd["state"][t]["exp_avg"] for t in range(opt.num_tensors)]
    torch.save(out, os.path.join(outdir, f"{case}_rank{rank}.pt"))
    print(f"ok {case} rank {rank}: state bytes {info['state_bytes']} of "
          f"{info['state_bytes_one_rank']}", flush=True)
    if hooks is not None:
        hooks.remove()
    opt.close()


def main():
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for arg in sys.argv[5:]:
        case, so = arg.split("=", 1)
        run_case(case, so, rank, world, outdir)
    dist.barrier()
    print(f"DONE rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

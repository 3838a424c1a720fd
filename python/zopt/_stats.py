"""``Optimizer.step_stats()``: where the last step's time went on the host
(the C struct ``zopt_step_stats``, zopt.h; keys: docs/USAGE.md "Step
statistics"), the baseline of an offloaded step: its copies of the grads
to the host, the CPU update, the copies of the params back, the whole;
and ``opt.last_metrics`` / the metrics hooks of every step (record_metrics);
``repr(opt)`` (describe)."""
import ctypes
import time

from . import _lib, _placement
from ._lib import DTYPE_NAMES, STATE_NAMES, check

_SUMMED = ("total_seconds", "d2h_seconds", "update_seconds", "h2d_seconds", "d2h_bytes",
           "h2d_bytes")


def _one(part):
    s = _lib.StepStats()
    check(part.lib.zopt_optimizer_get_step_stats(part.handle(), ctypes.byref(s)),
          "zopt_optimizer_get_step_stats")
    out = {f: getattr(s, f) for f in _SUMMED}
    out["offloaded"] = bool(s.offloaded)
    out["steps"] = s.steps
    return out


def step_stats(opt):
    """The last completed step's figures; with a step per class the
    classes' summed (``offloaded`` if any is, ``steps`` the most),
    ``classes``: each class's own, and ``gpu_fraction`` (the GPU classes'
    share of the elements: a GPU fraction's class has no host times, its
    kernels run asynchronously, and is left out of the sums)."""
    opt._check_open()
    if not opt._mapped:
        return _one(opt._parts[0])
    per = {c.cls: _one(c) for c in opt._parts if not c.step.gpu}
    out = {k: sum(p[k] for p in per.values()) for k in _SUMMED}
    out["offloaded"] = any(p["offloaded"] for p in per.values())
    out["steps"] = max((p["steps"] for p in per.values()), default=0)
    out["classes"] = per
    out["gpu_fraction"] = _placement.share(opt._parts)
    return out


def record_metrics(opt, t0, t1, t2, no_grads=False):
    """opt.last_metrics of the step that began at t0 (its native step ran
    t1..t2; None: no native step ran), then the metrics hooks (docs/USAGE.md)."""
    step_s = (t2 - t1) if t1 is not None else 0.0
    over = (t1 - t0) if t1 is not None else (time.perf_counter() - t0)
    W = max(opt.world_size, 1)
    parts = opt._parts
    elems = 0 if no_grads else sum(c.active_elems for c in parts) / W
    nbytes = 0 if no_grads else int(sum(c.active_elems / W * c.bytes_per_elem
                                        for c in parts))
    loss = opt.last_loss
    try:
        loss = float(loss) if loss is not None else None
    except (TypeError, ValueError):
        loss = None
    m = dict(step=opt.steps_taken, grad_norm=float(opt.last_grad_norm),
             skipped=bool(opt.last_skipped),
             loss_scale=float(opt.last_loss_scale) if not no_grads else float("nan"),
             loss=loss, lr=[g.get("lr") for g in opt.param_groups],
             active_tensors=sum(len(c.active) - c.active.count(0) for c in parts),
             updated_elems=int(elems), step_time_s=step_s, overhead_s=over,
             bytes=nbytes, bytes_per_s=(nbytes / step_s if step_s > 0 else float("nan")),
             refreshes=opt.refreshes, rebuilds=opt.rebuilds, no_grads=no_grads)
    if opt._mapped:
        m["classes"] = [c.cls for c in parts]
    opt.last_metrics = m
    for fn in list(opt._metrics_hooks):
        fn(opt, m)


def describe(opt):
    """repr(opt): its classes (steps, states, tensors), size, rank, steps
    taken, then its param groups."""
    ents = opt._entries
    n = sum(e.numel for e in ents)
    tail = (f"{len(ents)} tensors, {n} elements, rank {getattr(opt, 'rank', 0)} of "
            f"{getattr(opt, 'world_size', 1)}, ")
    if opt._mapped:
        cls = [f"{c.cls}: {c.step.name} ["
               + ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in c.step.states)
               + f"] {len(c.entries)} tensors" for c in opt._parts]
        missing = [k for k in opt._steps if k not in opt.parts]
        head = (f"zopt.Optimizer(classes {{{'; '.join(cls)}}}"
                + (f" (no params yet: {', '.join(missing)})" if missing else "")
                + f"; {tail}steps taken {opt.steps_taken}")
    else:
        s = opt.step_obj
        head = (f"zopt.Optimizer(step={s.name}, "
                + ", ".join(f"{STATE_NAMES[k]}:{DTYPE_NAMES[dt]}" for k, dt, _ in s.states)
                + f"; isa={'gpu' if s.gpu else s.isa.name}, {tail}"
                f"zero_stage={s.zero_stage}, steps taken {opt.steps_taken}")
    lines = [head + (", closed" if opt._closed else "") + ")"]
    for i, group in enumerate(opt.param_groups):
        lines.append(f"Parameter Group {i} ({len(group['params'])} tensors)")
        for key in sorted(group):
            if key != "params":
                lines.append(f"    {key}: {group[key]}")
    return "\n".join(lines)

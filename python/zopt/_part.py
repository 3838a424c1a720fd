"""One parameter class of a zopt.Optimizer: its step, its native optimizer
and its registered tensors (a *part*; ``opt.parts`` maps each class name
to its part).

A part ties the layers below together: the native handle (zopt._native),
param registration (zopt._params), gradient memory (zopt._grads), the
state moved in memory (zopt._rebuild; GPU steps' frozen params: zopt._frozen)
and the lent state tensors (zopt._state). An optimizer over one dtype has
one part; ``zopt.Optimizer({dtype: step})`` one per class that has params,
stepped together (``zopt_optimizer_step_linked``). Every part holds every param group
(empty where the group has no param of its class), so group ids are the
same everywhere. The optimizer owns ``param_groups``; a part reads them
through its owner.
"""
from __future__ import annotations

import weakref

from . import _frozen, _grads, _params, _rebuild, _state, _strided
from ._collective import collective_errors
from ._lib import Status, ZoptError
from ._native import Native


class Part(Native):
    """The params of one class and the native optimizer over them."""

    def __init__(self, owner, cls, step, *, zero3_mode="step", grad_accumulation="hooks",
                 **settings):
        super().__init__(step, **settings)
        self.owner = weakref.ref(owner)
        self.cls = cls
        self.zero3_mode = zero3_mode
        self.grad_accumulation = grad_accumulation
        self.main = step.f32_grads  # gradients from p.main_grad (f32)
        self.grad_flats = []
        self.released = set()  # ZeRO-3: tensor ids whose storage is freed
        # tensor id -> (the user's tensor or None, its pointer): the runtime
        # reads this tensor's gradient from user memory (a main_grad, or a
        # fresh p.grad registered without a copy), not from our own buffer
        self.foreign = {}
        self.scan = None       # zopt._scan.Scan or zopt._fast.Scan (zopt._grads.make_scan)
        self.tp_synced = False
        self.acc_hooks = []    # (AccumulateGrad node, hook handle) per param
        self.rank_checks = None
        self.lent = ()         # [_state.Lent]: tensors handed out by state[p]
        self.state_epoch = 0   # bumped when a load replaces every state
        self.steps_taken = 0
        self.refreshes = 0
        self.rebuilds = 0
        self.a_params = []

    @property
    def groups(self):
        """The optimizer's param groups (each part holds every group)."""
        return self.owner().param_groups

    def handle(self):
        """The native optimizer for a call now (Native.handle), refused
        while clip_grad_norm_ has begun the optimizer's step."""
        o = self.owner()
        if self.h is not None and o is not None and o._begun:
            raise ZoptError(Status.BAD_STATE, "clip_grad_norm_ began this step (the gradients "
                            "are reduced and the norm computed): call step() first")
        return super().handle()

    # ---- build and checks -------------------------------------------------------------
    def build(self):
        """A new native optimizer over the registered tensors and the
        optimizer's groups (the old one freed), and the per-step tables."""
        self.build_native(self.groups)
        self.scan, self.foreign = None, {}  # (what the old native optimizer was handed)
        self.after_layout()

    def after_layout(self, same_tensors=False):
        """The per-step tables after the registered memory changed: every
        path that changes it ends here (a native optimizer built, tensors
        added in place, moved params registered in place; ``same_tensors``:
        only moved, the streamer's buckets stay). The gradients handed to
        the runtime in place are read from our own memory again
        (zopt._grads.own_again), then the tables and the per-step pass
        (zopt._scan, its baselines) are made anew over the registrations as
        they are now; the next step hands the gradients over again."""
        _grads.own_again(self)
        _params.rebuild_lists(self)
        _grads.make_scan(self)
        if self.streamer is not None and not same_tensors:
            self.streamer.attach(self.h)
        if self.overlap is not None:
            self.overlap.attach(self.h)

    def check_params(self, same=False):
        """Before the runtime reads the params: in-place changes to lent
        state tensors written back, moved storages re-registered (a
        rebuild), the master made again from params written behind the
        optimizer's back. ``same``: this step's pass found every param's
        data pointer and version as last seen."""
        if self.lent:
            _state.flush_lent(self)
        moved, changed = _params.detect_changes(self, same)
        if moved:
            _rebuild.register_moved(self, moved)
            changed = set(changed)
            changed.update(moved)
        if changed:
            _params.refresh(self, sorted(changed))

    def check_overlaps(self):
        _params.check_overlaps(self)

    def prepare(self):
        """Checks before anything reads or writes the native optimizer."""
        self.handle()
        self.check_params()

    def outdate(self, tids, keys=None):
        _state.outdate(self, tids, keys)

    # ---- a step -----------------------------------------------------------------------
    def pre_step(self):
        """Every per-param check of a step. When every torch param is given
        alone (the usual case) in one pass over the params (zopt._scan, in
        C++ where the extension is loaded): gradients, moved storage and
        versions, each param's metadata brought into the caches once."""
        if self.excluded:  # GPU steps: frozen params that got a gradient join
            _frozen.include_unfrozen(self)
        rb = self.rebuilds
        if self.main:
            self.take_grads()
            if self.a_params:
                _grads.sync_main(self)
            self.check_params()
            if self.a_params and self.rebuilds != rb:  # a rebuilt native optimizer: new mask
                _grads.sync_main(self)
            return
        dirty = _grads.sync_grads(self) if self.a_params else True
        if self.one_pass and self.tp_synced and not dirty:
            self.check_params(same=True)
        else:
            self.check_params()
            if self.one_pass and self.scan is not None:  # its baselines: the checks' own
                self.scan.rebase(self.tp_ptrs, self.tp_vers if self.watch else None)
                self.tp_synced = True
        if self.a_params and self.rebuilds != rb:  # p.data = new: a new native optimizer
            _grads.sync_grads(self)

    def take_grads(self):
        """f32 gradients: every p.grad accumulated into p.main_grad."""
        if not self.main or not self.a_params:
            return
        if self.excluded:  # GPU steps: a frozen param's p.grad: it joins first
            _frozen.include_unfrozen(self)
        _grads.take_grads(self)

    def after_step(self, r):
        """After the runtime's step (r: its result): the strided params'
        copies, ZeRO-3's gather and the write-check baselines."""
        self.steps_taken += 1
        if self.strided and not r.skipped:  # the updated copies -> the strided params
            _strided.copy_out(self.entries, self.strided)
        if self.step.zero3:
            _params.after_zero3_step(self)
        elif self.sampler is not None:
            self.sampler.snapshot()

    def gather_params(self, tids):
        """ZeRO-3: the full params of tids into the model (collective)."""
        self.handle()
        if not self.step.zero3:
            return
        if _params.changed_some(self, tids):  # user writes into held params are not lost
            self.check_params()
        with collective_errors(self, "gather_params"):
            _params.gather_into(self, tids)

    def free(self):
        _grads.remove_acc_hooks(self)
        self.free_native()

    # ---- inspection (opt.parts[cls]) ------------------------------------------------
    @property
    def param_groups(self):
        """The optimizer's groups with only this class's params."""
        out = []
        for gid, g in enumerate(self.groups):
            sub = {k: v for k, v in g.items() if k != "params"}
            sub["params"] = [e.param for e in self.entries if e.group == gid]
            out.append(sub)
        return out

    @property
    def loss_scale(self):
        return self.get_loss_scale()

    @property
    def seed(self):
        return self.get_seed()

    @property
    def grad_divisor(self):
        return self.grad_divisor_value

    def step_count(self, gid=0):
        return self.group_step_count(gid)

    def __repr__(self):
        return (f"<zopt part {self.cls}: step {self.step.name}, {len(self.entries)} tensors"
                + (", closed" if self.h is None else "") + ">")

"""The C objects of the runtime's state in memory (zopt.h "the state in
memory"; docs/CHECKPOINT.md "In memory") beside a native optimizer
(zopt._native): the buffer of an exported image, seen by numpy and freed by
the runtime, and a staged import (``zopt_state_import``).
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from ._lib import STATE_NAMES, check


class StateBuffer:
    """A buffer zopt_optimizer_export_state allocated, seen by numpy
    (``np.asarray``: the array keeps this object alive) and freed with
    zopt_state_buffer_free when the last view of it is gone."""

    def __init__(self, lib_, ptr, size):
        self._lib, self._ptr = lib_, ptr
        self.__array_interface__ = {"shape": (int(size),), "typestr": "|u1",
                                    "data": (int(ptr or 0), False), "version": 3}

    def __del__(self):
        p, self._ptr = self._ptr, None
        if p:
            try:
                self._lib.zopt_state_buffer_free(ctypes.c_void_p(p))
            except Exception:  # pragma: no cover (interpreter shutdown)
                pass


class StagedImport:
    """``zopt_optimizer_import_begin`` ... ``zopt_state_import_commit``: the
    whole state of a native optimizer given piece by piece and applied at
    once, or not at all (docs/CHECKPOINT.md "In memory"). Used as a context
    manager: leaving it without :meth:`commit` aborts (nothing changed)."""

    def __init__(self, lib_, h):
        self.lib = lib_
        self.imp = ctypes.c_void_p()
        check(lib_.zopt_optimizer_import_begin(h, ctypes.byref(self.imp)),
              "zopt_optimizer_import_begin")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.abort()

    def abort(self):
        if self.imp is not None:
            imp, self.imp = self.imp, None
            self.lib.zopt_state_import_abort(imp)

    def put(self, t, kind, dtype, a, what=None):
        """State ``kind`` of tensor t: ``a`` (f32, f16 or bf16 bits of
        ``dtype``, every element in memory order), converted to the state's
        storage dtype by the runtime."""
        a = np.ascontiguousarray(a)
        check(self.lib.zopt_state_import_put(
            self.imp, int(t), int(kind), int(dtype),
            ctypes.c_void_p(a.ctypes.data if a.size else None), a.size),
            what or f"import of tensor {t}'s {STATE_NAMES[kind]}")

    def tensor_step(self, t, n):
        check(self.lib.zopt_state_import_set_tensor_step(self.imp, int(t), int(n)),
              f"import of tensor {t}'s step count")

    def group(self, g, count, flags):
        check(self.lib.zopt_state_import_set_group(self.imp, int(g), int(count), int(flags)),
              f"import of group {g}")

    def hyper(self, g, name, value, what=None):
        _lib.check_value(self.lib.zopt_state_import_set_hyper(self.imp, int(g), name.encode(),
                                                              float(value)),
                         what or f"param group {g}: {name}={value!r}")

    def scaler(self, cfg, scale, good):
        c = None
        if cfg is not None:
            c = _lib.LossScalerConfig(cfg["init_scale"], cfg["growth_factor"],
                                      cfg["backoff_factor"], cfg["growth_interval"],
                                      cfg["min_scale"], 1 if cfg["dynamic"] else 0)
        check(self.lib.zopt_state_import_set_loss_scaler(
            self.imp, ctypes.byref(c) if c is not None else None, float(scale), int(good)),
            "import of the loss scaler")

    def seed(self, s):
        check(self.lib.zopt_state_import_set_seed(self.imp, int(s) & (2**64 - 1)),
              "import of the seed")

    def commit(self, what="import"):
        """Applies everything (collective at world size > 1); frees the
        import whatever it returns."""
        imp, self.imp = self.imp, None
        check(self.lib.zopt_state_import_commit(imp), what)

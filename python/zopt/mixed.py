"""Params of several dtypes in one optimizer (docs/USAGE.md, "Params of
several dtypes"): ``zopt.Optimizer({dtype: step}, params, ...)``, one native
optimizer per parameter class, stepped as one (one global norm, one skip
decision, one loss scaler).

    classes = zopt.steps.adamw(clip=1.0, classes={"bf16": dict(master="f32"), "f32": {}})
    opt = zopt.Optimizer(classes, model.parameters(), lr=1e-3, weight_decay=0.01)

``zopt.Optimizer`` does it all (a one-dtype optimizer is the one-class
case); this module keeps the names it had: :class:`MixedOptimizer` (the
class of an optimizer built from a mapping, a trivial subclass),
``CLASS_ORDER`` and :func:`part_path` (the checkpoint file of a class).
"""
from ._checkpoint import part_path
from ._classes import CLASS_ORDER
from .optimizer import MixedOptimizer

__all__ = ["MixedOptimizer", "CLASS_ORDER", "part_path"]

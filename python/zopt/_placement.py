"""The GPU fraction of an offloaded optimizer (docs/USAGE.md, "Part of the
params' step on the GPU: gpu_fraction"; docs/GPU.md, "The GPU fraction").

``zopt.steps.<rule>(placement="offload", gpu_fraction=f)`` builds, next to
each offloaded class, a twin class ``"<dtype>:gpu"``: the same step with
every state on the GPU. ``zopt.Optimizer`` sends to it the params whose
gradients arrive LAST in backward -- the first-added ones, in add order --
while they make up about ``f`` of the elements, and the rest to the
offloaded class; the classes step as one (one global norm, one skip
decision: the runtime's linked step with a GPU part). DeepSpeed's
SuperOffload / Twin-Flow ``ratio`` and Megatron's
``optimizer_offload_fraction`` (the complement) are the same knob.
"""
from __future__ import annotations

from ._lib import Status, ZoptError

SUFFIX = ":gpu"


def gpu_fraction_of(f, placement):
    """``gpu_fraction=`` checked: a number in (0, 1), only with
    ``placement="offload"``."""
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 < float(f) < 1.0):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"gpu_fraction: {f!r}: the share of the params (by elements) whose "
                        "optimizer step stays on the GPU, a number in (0, 1) (0: "
                        "placement='offload' alone; 1: placement='gpu')")
    if placement != "offload":
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"gpu_fraction: {f!r} with placement={placement!r}: the GPU fraction "
                        "splits an offloaded optimizer (placement='offload') between the GPU "
                        "and the CPU")
    return float(f)


def split_key(key):
    """(base class, is the GPU class) of a class key."""
    if isinstance(key, str) and key.endswith(SUFFIX):
        return key[:-len(SUFFIX)], True
    return key, False


class GpuSplit:
    """Routes params in add order: a param goes to the GPU class while the
    params before it, plus half of it, stay within ``fraction`` of
    ``total`` elements (the add-order prefix whose share is nearest to
    ``fraction``); after the first param that does not, every later one
    goes to the offloaded class (params added later, by add_param_group,
    too: their gradients arrive first)."""

    def __init__(self, fraction, total):
        self.fraction = float(fraction)
        self.total = int(total)
        self.taken = 0
        self.closed = False

    def takes(self, numel):
        if self.closed or 2 * (self.taken + numel) - numel > 2 * self.fraction * self.total:
            self.closed = True
            return False
        self.taken += numel
        return True


def share(parts):
    """The share of the elements of ``parts`` (an optimizer's classes) whose
    step runs on the GPU: 1.0 for a GPU step, 0.0 offloaded or on the CPU,
    about f with ``gpu_fraction=f``."""
    total = gpu = 0
    for c in parts:
        n = sum(int(e.numel) for e in c.entries)
        total += n
        gpu += n if c.step.gpu else 0
    return gpu / total if total else 0.0

"""zopt._options: the checks of ``zopt.Optimizer``'s keyword options that
take a fixed set of values or go together (docs/USAGE.md names them all),
before anything is built. One place, so the constructor stays the
torch.optim surface."""
from . import _early
from ._lib import Status, ZoptError


def check(device_allocator, zero3_gather, grad_accumulation, overlap, speculation_budget,
          model, early_params):
    """Raises ZoptError INVALID_ARGUMENT on a bad option; returns the model
    whose forward waits for its params per bucket (params back early), or
    None."""
    if device_allocator not in (None, "torch", "driver"):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"device_allocator={device_allocator!r}: 'torch' (torch's caching "
                        "allocator) or 'driver' (cuMemAlloc)")
    if zero3_gather not in ("step", "manual", "hooks"):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"zero3_gather={zero3_gather!r}: 'step', 'manual' or 'hooks'")
    if grad_accumulation not in ("hooks", "manual"):
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"grad_accumulation={grad_accumulation!r}: 'hooks' or 'manual'")
    if speculation_budget is not None and not overlap:
        raise ZoptError(Status.INVALID_ARGUMENT, "speculation_budget= is an option of "
                        "overlap=True (offloaded steps overlapped with backward)")
    return _early.model_of(overlap, model, early_params)

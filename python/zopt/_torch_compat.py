"""What zopt.Optimizer needs from torch.optim.Optimizer, on torch 1.13 and 2.x.

zopt.Optimizer subclasses torch.optim.Optimizer without running its
``__init__`` (the states live in the runtime), so whatever that ``__init__``
sets up per instance, and whatever torch 2 changed in the base class, is
done here, by feature (never by version number):

* the step wrapper: torch 1.13's ``_hook_for_profile`` became
  ``_patch_step_function`` (2.1); the wrapper it puts around the class's
  ``step`` (``profile_hook_step``) runs the step hooks of torch >= 2.0,
  which need the instance's hook dicts (``register_step_pre_hook`` & co.);
* the state_dict / load_state_dict hooks of torch >= 2.1
  (``register_state_dict_pre_hook`` & co.), which zopt's own state_dict and
  load_state_dict run as torch's do;
* ``zero_grad()``'s default: set_to_none=False on torch 1.13, True from 2.0:
  zopt follows the installed torch's own signature;
* ``torch.compile``: the methods torch marks ``torch._disable_dynamo`` are
  marked the same, and so is ``step`` (a call into the runtime through
  ctypes that Dynamo cannot trace): a compiled function that calls
  ``opt.step()`` graph-breaks there and the step runs eagerly.
"""
import collections
import functools
import inspect

try:  # torch is optional
    import torch
    _Base = torch.optim.Optimizer
except Exception:  # pragma: no cover
    torch = None
    _Base = object

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def init_base(opt):
    """The per-instance setup of torch.optim.Optimizer.__init__ that zopt
    skips: its hook dicts and the profiling wrapper around step()."""
    if torch is None:
        return
    torch._C._log_api_usage_once("python.optimizer")
    for name in _HOOK_DICTS:
        if name not in opt.__dict__:
            setattr(opt, name, collections.OrderedDict())
    opt._warned_capturable_if_run_uncaptured = True
    patch = getattr(opt, "_patch_step_function", None) or getattr(opt, "_hook_for_profile", None)
    if patch is not None:
        patch()


_zg_cache = [None, False]  # (torch's zero_grad, its set_to_none default)


def zero_grad_default():
    """The installed torch's default for zero_grad(set_to_none=...): False
    on torch 1.13, True on torch >= 2.0 (False without torch)."""
    if torch is None:
        return False
    fn = _Base.zero_grad
    if _zg_cache[0] is not fn:
        try:
            d = inspect.signature(fn).parameters["set_to_none"].default
            _zg_cache[:] = [fn, bool(d) if d is not inspect.Parameter.empty else False]
        except (KeyError, TypeError, ValueError):
            _zg_cache[:] = [fn, False]
    return _zg_cache[1]


def _no_dynamo(fn):
    dis = getattr(torch, "_disable_dynamo", None) if torch is not None else None
    return dis(fn) if dis is not None else fn


def _with_state_dict_hooks(fn):
    @functools.wraps(fn)
    def state_dict(self, *args, **kwargs):
        for hook in tuple(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)
        sd = fn(self, *args, **kwargs)
        for hook in tuple(getattr(self, "_optimizer_state_dict_post_hooks", {}).values()):
            r = hook(self, sd)
            if r is not None:
                sd = r
        return sd
    return state_dict


def _with_load_state_dict_hooks(fn):
    @functools.wraps(fn)
    def load_state_dict(self, state_dict, *args, **kwargs):
        pre = tuple(getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values())
        if pre:
            state_dict = state_dict.copy()  # shallow, as torch: the hooks may edit it
            for hook in pre:
                r = hook(self, state_dict)
                if r is not None:
                    state_dict = r
        out = fn(self, state_dict, *args, **kwargs)
        for hook in tuple(getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values()):
            hook(self)
        return out
    return load_state_dict


def patch_class(cls):
    """Wraps the methods of a zopt optimizer class defined in its own body
    (state_dict hooks; Dynamo disabled). Call once per class, after it."""
    d = cls.__dict__
    if "state_dict" in d:
        cls.state_dict = _with_state_dict_hooks(d["state_dict"])
    if "load_state_dict" in d:
        cls.load_state_dict = _with_load_state_dict_hooks(d["load_state_dict"])
    for name in ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group"):
        if name in cls.__dict__:
            setattr(cls, name, _no_dynamo(cls.__dict__[name]))
    return cls


def _is_named(p):
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and \
        torch is not None and isinstance(p[1], torch.Tensor)


def split_named(params):
    """torch >= 2.5 takes ``model.named_parameters()``: (name, tensor)
    pairs, whose names go into the group as 'param_names'. Returns (the
    tensors, the names or None); a list mixing named and unnamed params is
    refused as torch refuses it."""
    params = list(params)
    named = [_is_named(p) for p in params]
    if not any(named):
        return params, None
    if not all(named):
        raise ValueError("all optimizer params should be with/without names. "
                         "Some param names are missing")
    return [p[1] for p in params], [p[0] for p in params]


# ---- tensor storage (ZeRO-3's released params) -----------------------------------------
# torch >= 2.0 deprecates Tensor.storage() (a TypedStorage, with a warning);
# untyped_storage() counts bytes. torch 1.13 has only storage() (elements).

def storage_nbytes(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().nbytes()
    return t.storage().size() * t.element_size()


def storage_resize_(t, nbytes):
    if hasattr(t, "untyped_storage"):
        t.untyped_storage().resize_(nbytes)
    else:
        t.storage().resize_(nbytes // t.element_size())


def storage_ptr(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()

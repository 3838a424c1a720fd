"""The precision policy per parameter class: which params keep 32-bit
moments (docs/USAGE.md, "Params that keep 32-bit moments").

Narrow optimizer states (bf16 or 8-bit moments) are known to hurt small
tensors (biases, LayerNorm weights) and embeddings; bitsandbytes and torchao
keep 32-bit states for tensors under 4,096 elements, and bitsandbytes asks
for embeddings to be named. ``Keep32`` is that rule: a param keeps 32-bit
moments when it has fewer than ``below`` elements or its name matches one of
``names`` (``fnmatch`` patterns over the names of ``model.named_parameters()``,
e.g. ``"*embed*"``, ``"lm_head.weight"``). ``zopt.steps.<rule>(...,
keep32=...)`` builds a second class per narrow class (key ``"<dtype>:keep32"``,
the same step with f32 moments) and ``zopt.Optimizer`` routes each param by
this rule when it is added; the classes step as one (one global norm).
"""
from __future__ import annotations

import dataclasses
import fnmatch

from ._lib import Status, ZoptError

SUFFIX = ":keep32"
DEFAULT_BELOW = 4096


@dataclasses.dataclass(frozen=True)
class Keep32:
    """Params with fewer than ``below`` elements, or whose name matches one of
    ``names`` (fnmatch patterns), keep 32-bit moments."""
    below: int = DEFAULT_BELOW
    names: tuple = ()

    def takes(self, name, numel):
        """Whether a param of ``numel`` elements named ``name`` (None: the
        optimizer was given no names) keeps 32-bit moments."""
        if numel < self.below:
            return True
        return name is not None and any(name_matches(name, p) for p in self.names)


def name_matches(name, pattern):
    """Whether param name ``name`` matches ``pattern`` (fnmatch, case-sensitive)."""
    return fnmatch.fnmatchcase(name, pattern)


def keep32_of(x, arg="keep32"):
    """A :class:`Keep32` from ``keep32=``: a Keep32, an int (``below``), or a
    dict ``{"below": int, "names": [patterns]}``."""
    if isinstance(x, Keep32):
        x = {"below": x.below, "names": x.names}
    elif isinstance(x, bool):
        raise ZoptError(Status.INVALID_ARGUMENT, f"{arg}: {x!r}: give a size threshold "
                        "(elements), a dict {'below': N, 'names': [...]} or zopt.steps.Keep32")
    elif isinstance(x, int):
        x = {"below": x}
    if not isinstance(x, dict):
        raise ZoptError(Status.INVALID_ARGUMENT, f"{arg}: {x!r}: give a size threshold "
                        "(elements), a dict {'below': N, 'names': [...]} or zopt.steps.Keep32")
    unknown = sorted(set(x) - {"below", "names"})
    if unknown:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{arg}: unknown key {unknown[0]!r}; the keys: below, names")
    below = x.get("below", DEFAULT_BELOW)
    if isinstance(below, bool) or not isinstance(below, int) or below < 0:
        raise ZoptError(Status.INVALID_ARGUMENT,
                        f"{arg}['below']: {below!r}: an element count >= 0")
    names = x.get("names", ())
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    for n in names:
        if not isinstance(n, str) or not n:
            raise ZoptError(Status.INVALID_ARGUMENT,
                            f"{arg}['names']: {n!r}: each is a non-empty fnmatch pattern "
                            "over param names, e.g. '*embed*'")
    return Keep32(below=below, names=names)


def split_key(key):
    """(base class, keeps 32-bit moments) of a class key."""
    if isinstance(key, str) and key.endswith(SUFFIX):
        return key[:-len(SUFFIX)], True
    return key, False

"""DeepSpeed config import, the field bookkeeping under every section's
handler: :class:`DeepSpeedConfigError` (the refusal, naming the dotted path
of the field), ``_Walker`` (checks a section's keys against the fields it
supports and records how each field was used: ``defaults["fields"]``) and
the value checks (``_bool``, ``_num``, ``_str``; each refuses DeepSpeed's
Hugging Face ``"auto"``). zopt.deepspeed, the public module, re-exports
DeepSpeedConfigError; its ``__module__`` stays ``zopt.deepspeed`` (the name
tracebacks, reprs and pickles give)."""
from __future__ import annotations

import math

from ._lib import Status, ZoptError


class DeepSpeedConfigError(ZoptError):
    """A DeepSpeed config field zopt cannot honour. ``field``: its dotted
    path."""

    __module__ = "zopt.deepspeed"   # its public home

    def __init__(self, field, message):
        self.field = field
        super().__init__(Status.INVALID_ARGUMENT, f"{field}: {message}")


class _Walker:
    """Reads a config section, records how every field was used and refuses
    the fields nobody took."""

    def __init__(self):
        self.fields = {}   # dotted path -> how it was used

    def section(self, d, path, known):
        """Checks a section is a dict whose keys are all in ``known`` (a dict
        key -> one-line description for the error)."""
        if not isinstance(d, dict):
            raise DeepSpeedConfigError(path or "<config>",
                                       f"must be a JSON object, got {d!r}")
        for k in d:
            if k not in known:
                p = f"{path}.{k}" if path else k
                raise DeepSpeedConfigError(
                    p, f"unknown or unsupported field; the fields zopt supports "
                    f"{'in ' + repr(path) if path else 'at the top level'}: "
                    + ", ".join(sorted(known)))
        return d

    def use(self, path, how):
        self.fields[path] = how



def _no_auto(v, path):
    if isinstance(v, str) and v.strip().lower() == "auto":
        raise DeepSpeedConfigError(path, "'auto' is filled in by the Hugging Face "
                                   "Trainer's DeepSpeed integration; give the "
                                   "value itself")
    return v


def _bool(v, path):
    _no_auto(v, path)
    if not isinstance(v, bool):
        raise DeepSpeedConfigError(path, f"must be true or false, got {v!r}")
    return v


def _num(v, path, lo=None, hi=None, integer=False, lo_open=False):
    _no_auto(v, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DeepSpeedConfigError(path, f"must be a number, got {v!r}")
    if not math.isfinite(v):
        raise DeepSpeedConfigError(path, f"must be a finite number, got {v!r}")
    if integer and float(v) != int(v):
        raise DeepSpeedConfigError(path, f"must be an integer, got {v!r}")
    if (lo is not None and (v <= lo if lo_open else v < lo)) \
            or (hi is not None and v > hi):
        rng = ("(" if lo_open else "[") + f"{lo}, {hi if hi is not None else 'inf'}]"
        raise DeepSpeedConfigError(path, f"{v!r} is out of range {rng}")
    return int(v) if integer else float(v)


def _str(v, path, allowed):
    _no_auto(v, path)
    if not isinstance(v, str) or v.lower() not in [a.lower() for a in allowed]:
        raise DeepSpeedConfigError(path, f"{v!r}; allowed: " + ", ".join(map(repr, allowed)))
    return v.lower()

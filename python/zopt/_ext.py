"""zopt._fast, the compiled per-step pass (zopt/_fast.cpp): found, checked,
loaded, or refused with the reason, in which case the binding runs the
same pass in Python (zopt._scan).

It is looked for next to this package (``pip install ./python`` or
``cmake --install`` put it there) and in the build tree of the checkout
(``build/python/zopt_fast``, where ``scripts/build.sh`` builds it). A copy
is loaded only when its ``_fast.json`` (written by python/build_fast.py)
names this interpreter and this torch (version and C++ ABI), so that an
extension built against another torch is never loaded (a mismatched one
could crash, not just fail); after loading, the module's own interface
number and torch version are checked again. ``ZOPT_NO_EXTENSION=1`` turns
it off. ``zopt.installation()["extension"]`` says what was found.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import operator
import os
import sys

from ._dtypes import torch
from ._lib import REPO_ROOT
from ._scan import Scan as PyScan

INTERFACE = 2  # zopt/_fast.cpp's kInterface
_is = operator.is_


def _dirs():
    here = os.path.dirname(os.path.abspath(__file__))
    return [here, os.path.join(REPO_ROOT, "build", "python", "zopt_fast")]


def refusal(meta):
    """Why an extension whose _fast.json says ``meta`` cannot be loaded
    here (None: it can)."""
    if meta.get("python") != sys.implementation.cache_tag:
        return f"built for {meta.get('python')}, this is {sys.implementation.cache_tag}"
    if meta.get("torch") != torch.__version__:
        return f"built for torch {meta.get('torch')}, this is torch {torch.__version__}"
    abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))
    if meta.get("cxx11_abi") != abi:
        return f"built with _GLIBCXX_USE_CXX11_ABI={meta.get('cxx11_abi')}, torch has {abi}"
    if meta.get("interface") != INTERFACE:
        return f"interface {meta.get('interface')}, this package needs {INTERFACE}"
    return None


def load(dirs=None):
    """(module or None, where or None, why): the first loadable extension
    of ``dirs`` (default: next to the package, then the build tree)."""
    if os.environ.get("ZOPT_NO_EXTENSION", "") not in ("", "0"):
        return None, None, "ZOPT_NO_EXTENSION is set"
    if torch is None:
        return None, None, "no torch"
    why = []
    for d in dirs if dirs is not None else _dirs():
        so = [os.path.join(d, "_fast" + s) for s in importlib.machinery.EXTENSION_SUFFIXES]
        so = [p for p in so if os.path.isfile(p)]
        if not so:
            continue
        try:
            with open(os.path.join(d, "_fast.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            why.append(f"{so[0]}: no readable _fast.json ({e})")
            continue
        r = refusal(meta)
        if r is not None:
            why.append(f"{so[0]}: {r}")
            continue
        try:
            spec = importlib.util.spec_from_file_location("zopt._fast", so[0])
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except Exception as e:  # (ImportError: a missing symbol, ...)
            why.append(f"{so[0]}: {type(e).__name__}: {e}")
            continue
        if getattr(mod, "INTERFACE", None) != INTERFACE or \
                getattr(mod, "TORCH_VERSION", None) != torch.__version__:
            why.append(f"{so[0]}: interface {getattr(mod, 'INTERFACE', None)} for torch "
                       f"{getattr(mod, 'TORCH_VERSION', None)}")
            continue
        return mod, so[0], None
    return None, None, "; ".join(why) or "not built (scripts/build.sh or pip install ./python)"


fast, where, why = load()


def info():
    """{"path": the loaded extension or None, "why": why not}."""
    return {"path": where, "why": why}


def scan_class(params):
    """The Scan to use for ``params``: the extension's when it is loaded
    and every param is a plain tensor or Parameter (a subclass may
    override attribute access, which only Python sees)."""
    if fast is not None and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params):
        return fast.Scan
    return PyScan


if fast is not None:
    same = fast.same
else:
    def same(a, b):
        """The two sequences hold the same objects, in order."""
        return len(a) == len(b) and all(map(_is, a, b))

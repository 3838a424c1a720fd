"""The layout of the zopt package (issue 17): one thing per module, imports
that run one way, no module past ~800 lines without a reason at its top,
and no test oracle in the product package.

* The import graph is read from the sources (``ast``): every import of a
  zopt module sits at a module's top level (none inside a function to
  dodge a cycle) and the graph has no cycle.
* Each module imports alone: in a fresh interpreter whose ``zopt`` package
  is empty (its ``__init__`` not run), importing ``zopt.<module>`` pulls
  in only what that module names.
"""
import ast
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(HERE), "zopt")
MODULES = sorted(f[:-3] for f in os.listdir(PKG) if f.endswith(".py"))
MAX_LINES = 800
# Longer modules say why in their first lines (this phrase).
WHY = "Longer than"


def _zopt_imports(name):
    """[(imported zopt module, line, at top level)] of module ``name``."""
    path = os.path.join(PKG, name + ".py")
    tree = ast.parse(open(path).read(), path)
    top = set(id(n) for n in tree.body)
    for n in tree.body:  # `try: import torch` blocks are top level too
        if isinstance(n, (ast.Try, ast.If)):
            top |= {id(x) for x in ast.walk(n)}
    out = []
    for n in ast.walk(tree):
        mods = []
        if isinstance(n, ast.ImportFrom):
            if n.level == 1:
                mods = [n.module] if n.module else [a.name for a in n.names]
            elif n.level == 0 and n.module and n.module.split(".")[0] == "zopt":
                mods = [n.module.split(".", 1)[1]] if "." in n.module else \
                    [a.name for a in n.names]
        elif isinstance(n, ast.Import):
            mods = [a.name.split(".", 1)[1] for a in n.names
                    if a.name.startswith("zopt.")]
        for m in mods:
            m = m.split(".")[0]
            if m in MODULES:
                out.append((m, n.lineno, id(n) in top))
    return out


def test_imports_run_one_way():
    graph = {}
    inside = []
    for name in MODULES:
        deps = _zopt_imports(name)
        inside += [f"{name}.py:{line} imports {m} inside a function"
                   for m, line, at_top in deps if not at_top]
        graph[name] = {m for m, _, _ in deps if m != name}
    assert not inside, inside
    # no cycle: a topological order exists
    order, state = [], {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path + [m])
        state[m] = "open"
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = "done"
        order.append(m)
    for m in MODULES:
        visit(m, [])
    # the optimizer sits above the layers it composes; they never import it
    assert "optimizer" not in set().union(*(graph[m] for m in MODULES if m not in (
        "__init__", "mixed", "optimizer")))


def test_each_module_imports_alone():
    code = (
        "import importlib, sys, types\n"
        f"pkg, names = {PKG!r}, {MODULES!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    if name == '__init__':\n"
        "        continue\n"
        "    for k in [k for k in sys.modules if k == 'zopt' or k.startswith('zopt.')]:\n"
        "        del sys.modules[k]\n"
        "    stub = types.ModuleType('zopt')\n"
        "    stub.__path__ = [pkg]\n"
        "    sys.modules['zopt'] = stub\n"
        "    try:\n"
        "        importlib.import_module('zopt.' + name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", MODULES)
def test_module_size(name):
    """No module past ~800 lines without saying why at its top."""
    with open(os.path.join(PKG, name + ".py")) as f:
        lines = f.read().splitlines()
    if len(lines) > MAX_LINES + 20:
        head = "\n".join(lines[:30])
        assert WHY in head, (f"zopt/{name}.py has {len(lines)} lines (> ~{MAX_LINES}) and "
                             f"does not say why at its top ('{WHY} ...')")


def test_oracles_not_in_the_package():
    """The float64 oracles are the tests' (python/tests/oracles), not the
    product's: the installed package does not ship them."""
    assert not {"reference", "interp"} & set(MODULES)
    assert os.path.isfile(os.path.join(HERE, "oracles", "reference.py"))
    assert os.path.isfile(os.path.join(HERE, "oracles", "interp.py"))

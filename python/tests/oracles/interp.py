"""A float64 interpreter of zopt step descriptions: the oracle of the
property test (python/tests/test_property.py).
(Longer than ~800 lines: one interpreter of the whole dialect, its text
reader and its error bounds, kept together so that one file is the oracle.)

``oracles.reference`` models the four named rules; a description can say
anything the verifier accepts (a mutated one, a new rule), so this module
reads the description *text* and runs its per-element program on float64
numpy arrays, following docs/Dialects/Zopt.md (the ops and their formulas),
docs/ABI.md (the gradient scale, the step program) and the numerics contract
(docs/NUMERICS.md):

* every primitive is evaluated in float64 with its hyperparameters as f64
  per-group values; ``adam_direction`` applies the group's bias correction
  with its step count t (``bc = 1 - beta^t`` when the ``bias_correction``
  slot is non-zero); ``momentum`` is the gradient at the group's first step
  (and, as in torch and the compiler, whenever the momentum is 0);
* ``clip_by_global_norm`` scales its operand by ``c = max_norm / (n + 1e-6)``
  when ``c < 1``, n the L2 norm of that operand over every element of every
  tensor of every group;
* ``unscale``: the gradient is divided by the loss scale S; a non-finite
  reduced value (the clip's operand, or the unscaled gradient without a
  clip) skips the step as a whole: no state changes, no step count, the
  scaler backs off. ``grad_reads_unscaled`` chooses what a *direct* read of
  the ``grad`` state is in a loss-scaled step: ``False`` (default) follows
  the dialect (``%g`` is the loss-scaled value, only ``zopt.unscale``
  divides); ``True`` follows docs/ABI.md ("every read of the grad is
  multiplied by the gradient scale"), which is what the plan phase does;
* every stored value is rounded to its state's dtype after the step
  (``reference.round_to``); a value stored into two states is rounded for
  each.

Besides the float64 value of every stored state, the interpreter propagates
a first-order bound on how far an implementation that computes each
primitive in f32 (f32 coefficients derived in f64, as the decompose phase
lowers them) may land from it (``Value.err``): each primitive adds a few f32
unit roundoffs of the magnitudes of its terms and passes its operands'
bounds on through its partial derivatives. ``expected()`` turns value and
bound into the interval of storage values an implementation may produce:
``[round(y - E), round(y + E)]`` with the state's rounding (both neighbours
for stochastic rounding). Where the bound is infinite the element is
*ambiguous* (a ``sign`` of a value within its error of 0, a ``sqrt`` of a
value within its error of 0 from below, ...) and is not checked.

What it cannot model raises ``Unmodelled`` (a ``NotImplementedError``): the
generic op syntax, attributes it does not know, ops the dialect reserves for
the compiler (a description cannot use them anyway).

Usage::

    prog = oracles.interp.parse(text)
    it = oracles.interp.Interpreter(prog, [dict(params=[p0, p1], lr=0.01), ...])
    res = it.step([g0, g1])          # dict(norm, skipped, clip_coef, scale)
    it.state(0, "exp_avg")          # float64 stored values
    y, lo, hi = it.expected(0, "exp_avg")
"""
from __future__ import annotations

import math
import re

import numpy as np

from .reference import LossScaler, round_to

__all__ = ["Unmodelled", "DescriptionError", "RestatedAttribute", "parse", "Program", "Interpreter",
           "RUNTIME_DEFAULTS", "STATE_KINDS", "HYPER_KINDS", "DTYPES", "U32",
           "round_interval"]

#: The f32 unit roundoff (half an ULP at 1).
U32 = 2.0 ** -24
#: The smallest f32 subnormal (twice the error of a rounding into it).
_TINY = 2.0 ** -149

STATE_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq",
               "max_exp_avg_sq", "momentum_buffer")
HYPER_KINDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum",
               "dampening", "bias_correction")
DTYPES = ("f32", "bf16", "f16")
PLACEMENTS = ("cpu", "gpu")
ROUNDINGS = ("nearest_even", "stochastic")  # as written; "nearest_away": a remainder master's param

#: The runtime's slot defaults (getHyperInfo in lib/Dialect/Zopt/IR/
#: ZoptDialect.cpp): what a group gets for a slot that neither it nor the
#: description gives a value.
RUNTIME_DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, momentum=0.9, dampening=0.0,
                        bias_correction=1.0)

# op -> (number of f32 operands, hyper operand names, result count)
_PRIMS = {
    "l2_decay": (2, ("hyper",), 1),
    "decoupled_decay": (1, ("lr", "weight_decay"), 1),
    "ema": (2, ("hyper",), 1),
    "ema_sq": (2, ("hyper",), 1),
    "max": (2, (), 1),
    "momentum": (2, ("momentum", "dampening"), 1),
    "nesterov": (2, ("hyper",), 1),
    "sign": (1, (), 1),
    "adam_direction": (2, ("beta1", "beta2", "eps"), 1),
    "apply": (2, ("hyper",), 1),
    "unscale": (1, (), 1),
    "adam": (4, ("lr", "beta1", "beta2", "eps", "weight_decay"), 3),
}
_ATTRS = {"adam": ("decoupled",)}
_RESERVED = ("global", "reduce_sumsq")


class Unmodelled(NotImplementedError):
    """The description uses something the interpreter does not model."""


#: Attributes an op's custom syntax gives (ODS properties): restated in its
#: attribute dictionary, the dictionary's value wins in the compiler's parser.
_INHERENT = {
    "step": {"sym_name": "@name"},
    "state": {"kind": "the kind keyword", "placement": "'on'",
              "rounding": "'rounding'"},
    "hyper": {"kind": "the slot keyword", "default_value": "'default'"},
    "clip_by_global_norm": {"max_norm": "'max'"},
}


class DescriptionError(ValueError):
    """The text is not a description (the compiler must refuse it too):
    ``line``/``col`` are 1-based positions in the text."""

    def __init__(self, msg, line=None, col=None):
        super().__init__(f"{line}:{col}: {msg}" if line else msg)
        self.line, self.col = line, col


class RestatedAttribute(DescriptionError):
    """An attribute dictionary restates an attribute the op's syntax gives
    (``zopt.clip_by_global_norm %g max 1.0 {max_norm = 100.0}``): ambiguous
    (the compiler takes the dictionary's value: finding F2)."""


# ---------------------------------------------------------------------------
# Parsing (the custom syntax of docs/reference/ZoptDialect.md)
# ---------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<ssa>%[A-Za-z0-9_$.\-]+(?:\#[0-9]+)?(?::[0-9]+)?)
  | (?P<sym>@[A-Za-z_$.][A-Za-z0-9_$.\-]*|@"(?:[^"\\\n]|\\.)*")
  | (?P<num>[-+]?(?:0x[0-9A-Fa-f]+|[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?))
  | (?P<id>[A-Za-z_][A-Za-z0-9_$.]*)
  | (?P<punct>->|[{}()\[\]<>,:=*?!#^])
""", re.X)


class _Tok:
    __slots__ = ("kind", "text", "line", "col")

    def __init__(self, kind, text, line, col):
        self.kind, self.text, self.line, self.col = kind, text, line, col

    def __repr__(self):
        return f"{self.kind}:{self.text!r}@{self.line}:{self.col}"


def _tokenize(text):
    out = []
    pos, line, lstart = 0, 1, 0
    n = len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise Unmodelled(f"{line}:{pos - lstart + 1}: cannot tokenize "
                             f"{text[pos:pos + 20]!r}")
        kind = m.lastgroup
        s = m.group()
        if kind not in ("ws", "comment"):
            out.append(_Tok(kind, s, line, pos - lstart + 1))
        nl = s.count("\n")
        if nl:
            line += nl
            lstart = pos + s.rfind("\n") + 1
        pos = m.end()
    return out


def _parse_number(tok):
    s = tok.text
    neg = s.startswith("-")
    body = s.lstrip("+-")
    if body.lower().startswith("0x"):
        bits = int(body, 16)
        if bits >= 1 << 64:
            raise Unmodelled(f"{tok.line}:{tok.col}: hex float {s} wider than f64")
        v = float(np.array([bits], dtype=np.uint64).view(np.float64)[0])
        return -v if neg else v
    return float(s)


class Op:
    """One operation of the body: ``name`` without the ``zopt.`` prefix,
    result and operand SSA names, attributes (``kind``, ``default``,
    ``max_norm``, ``decoupled``, ...) and its 1-based line."""

    def __init__(self, name, results, operands, attrs, line, col, types=()):
        self.name, self.results, self.operands = name, results, operands
        self.attrs, self.line, self.col, self.types = attrs, line, col, types

    def __repr__(self):
        return (f"<{self.name} {self.results} <- {self.operands} {self.attrs} "
                f"@{self.line}>")


class Program:
    """A parsed description: ``states`` {kind: dict(ssa, dtype, placement,
    rounding)}, ``hypers`` {ssa: (kind, default or None)}, ``ops`` (the
    body in order, yield excluded), ``stores`` [(value ssa, state kind)],
    the step's ``attrs`` (zero_stage, align, gpu_arch)."""

    def __init__(self):
        self.name = None
        self.attrs = {}
        self.states = {}
        self.state_of_ssa = {}
        self.hypers = {}
        self.ops = []
        self.stores = []
        self.defs = {}   # ssa -> op

    # -- derived facts ---------------------------------------------------------
    @property
    def cpu_only(self):
        """True when the step runs on the CPU (no gpu_arch, nothing on gpu)."""
        return ("gpu_arch" not in self.attrs
                and all(s["placement"] == "cpu" for s in self.states.values()))

    @property
    def zero_stage(self):
        return int(self.attrs.get("zero_stage", 0))

    def op_named(self, name):
        return [o for o in self.ops if o.name == name]

    @property
    def loss_scaled(self):
        return bool(self.op_named("unscale"))

    @property
    def clip(self):
        c = self.op_named("clip_by_global_norm")
        return c[0] if c else None

    def defaults(self):
        """{slot: default} of every slot the step has: the description's
        declarations (a default given, else the runtime's) and
        ``bias_correction`` when Adam's direction reads it."""
        out = {}
        for kind, dflt in self.hypers.values():
            if dflt is not None:
                out[kind] = dflt
            else:
                out.setdefault(kind, RUNTIME_DEFAULTS[kind])
        if self.op_named("adam_direction") or self.op_named("adam"):
            out.setdefault("bias_correction", RUNTIME_DEFAULTS["bias_correction"])
        return out

    def live(self):
        """SSA names that reach a stored value."""
        live = set()
        work = [v for v, _ in self.stores]
        while work:
            v = work.pop()
            if v in live:
                continue
            live.add(v)
            op = self.defs.get(v)
            if op is not None:
                work.extend(op.operands)
        return live

    def used_slots(self):
        """Hyperparameter slots whose value reaches a stored value."""
        live = self.live()
        out = {k for ssa, (k, _) in self.hypers.items() if ssa in live}
        for o in self.ops:
            if o.name in ("adam_direction", "adam") and any(r in live for r in o.results):
                out.add("bias_correction")
        return out

    def stored_kinds(self):
        return [k for _, k in self.stores]


class _Parser:
    def __init__(self, text):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    def peek(self, k=0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def next(self):
        t = self.peek()
        if t is None:
            raise DescriptionError("unexpected end of the description")
        self.i += 1
        return t

    def expect(self, text=None, kind=None):
        t = self.next()
        if (text is not None and t.text != text) or (kind is not None and t.kind != kind):
            raise DescriptionError(f"expected {text or kind}, got {t.text!r}", t.line, t.col)
        return t

    def accept(self, text):
        t = self.peek()
        if t is not None and t.text == text:
            self.i += 1
            return t
        return None

    # -- attribute dictionaries -----------------------------------------------
    def attr_dict(self):
        """{name: value} of `{a, b = 1 : i64, c = "x"}`; values as Python."""
        out = {}
        self.expect("{")
        if self.accept("}"):
            return out
        while True:
            t = self.next()
            if t.kind == "string":
                name = t.text[1:-1]
            elif t.kind == "id":
                name = t.text
            else:
                raise DescriptionError(f"expected an attribute name, got {t.text!r}",
                                       t.line, t.col)
            if name in out:
                raise DescriptionError(f"duplicate attribute {name!r}", t.line, t.col)
            if self.accept("="):
                out[name] = self.attr_value()
            else:
                out[name] = True  # unit
            if self.accept("}"):
                return out
            self.expect(",")

    def attr_value(self):
        t = self.next()
        if t.kind == "num":
            v = t.text
            if self.accept(":"):
                ty = self.next()
                if ty.kind != "id":
                    raise Unmodelled(f"{ty.line}:{ty.col}: attribute type {ty.text!r}")
                return ("num", v, ty.text, t)
            return ("num", v, None, t)
        if t.kind == "string":
            return ("str", t.text[1:-1], None, t)
        if t.kind == "id" and t.text in ("unit", "true", "false"):
            return ("id", t.text, None, t)
        if t.text == "#":   # a dialect attribute: #zopt<rounding stochastic>
            parts, depth = ["#"], 0
            while True:
                u = self.next()
                parts.append(u.text)
                if u.text == "<":
                    depth += 1
                elif u.text == ">":
                    depth -= 1
                    if depth == 0:
                        break
                elif depth == 0 and u.kind != "id" and u.text != ".":
                    raise Unmodelled(f"{u.line}:{u.col}: attribute value {''.join(parts)}")
            return ("attr", " ".join(parts), None, t)
        raise Unmodelled(f"{t.line}:{t.col}: attribute value {t.text!r}")

    # -- the step --------------------------------------------------------------
    def parse(self):
        prog = Program()
        t = self.next()
        if t.text == '"zopt.step"':
            raise Unmodelled(f"{t.line}:{t.col}: the generic form of zopt.step")
        if t.text != "zopt.step":
            raise DescriptionError(f"expected zopt.step, got {t.text!r}", t.line, t.col)
        sym = self.expect(kind="sym")
        prog.name = sym.text[1:]
        if self.accept("attributes"):
            prog.attrs = self._step_attrs(self.attr_dict())
        elif self.peek() is not None and self.peek().text == "{" and self._looks_like_attrs():
            raise Unmodelled(f"{t.line}:{t.col}: step attributes without 'attributes'")
        self.expect("{")
        while True:
            t = self.peek()
            if t is None:
                raise DescriptionError("unterminated zopt.step body")
            if t.text == "}":
                self.next()
                break
            self._op(prog)
        if self.peek() is not None:
            t = self.peek()
            raise DescriptionError("only one zopt.step at the top level", t.line, t.col)
        if not prog.stores and not any(o.name == "yield" for o in prog.ops):
            raise DescriptionError("the step has no zopt.yield")
        return prog

    def _looks_like_attrs(self):
        a, b = self.peek(1), self.peek(2)
        return a is not None and b is not None and a.kind == "id" and b.text == "="

    def _step_attrs(self, d):
        out = {}
        for k, v in d.items():
            if k in ("zero_stage", "align"):
                if v is True or v[0] != "num":
                    raise Unmodelled(f"step attribute {k}={v!r}")
                if v[2] not in (None, "i64"):
                    raise Unmodelled(f"step attribute {k} of type {v[2]}")
                out[k] = int(v[1], 0)
            elif k == "gpu_arch":
                out[k] = v[1] if v is not True else v
            elif k in _INHERENT["step"]:
                raise RestatedAttribute(
                    f"zopt.step's attributes restate '{k}', which its syntax gives "
                    f"({_INHERENT['step'][k]}) (finding F2 of docs/TESTING.md)")
            else:
                raise Unmodelled(f"step attribute {k!r}")
        return out

    def _results(self):
        """%a, %b = ... -> ['%a', '%b'] (%x:3 -> %x#0, %x#1, %x#2)."""
        res = []
        while True:
            t = self.next()
            if t.kind != "ssa":
                raise DescriptionError(f"expected a value name, got {t.text!r}",
                                       t.line, t.col)
            name = t.text
            if ":" in name:
                base, cnt = name.rsplit(":", 1)
                res += [f"{base}#{i}" for i in range(int(cnt))]
            else:
                res.append(name)
            if not self.accept(","):
                break
        self.expect("=")
        return res

    def _operands(self):
        ops = []
        t = self.peek()
        if t is None or t.kind != "ssa":
            return ops
        while True:
            t = self.next()
            if t.kind != "ssa" or ":" in t.text:
                raise DescriptionError(f"expected an operand, got {t.text!r}",
                                       t.line, t.col)
            ops.append(t)
            if not self.accept(","):
                return ops

    def _types(self):
        tys = []
        while True:
            t = self.next()
            if t.kind != "id":
                raise DescriptionError(f"expected a type, got {t.text!r}", t.line, t.col)
            tys.append(t.text)
            if not self.accept(","):
                return tys

    def _maybe_attrs(self):
        t = self.peek()
        if t is not None and t.text == "{":
            return self.attr_dict()
        return {}

    def _use(self, prog, tok):
        name = tok.text
        if name not in prog.defs and name not in prog.hypers and name not in prog.state_of_ssa:
            raise DescriptionError(f"use of undefined value {name}", tok.line, tok.col)
        return name

    def _def(self, prog, names, op, tok):
        for n in names:
            if n in prog.defs:
                raise DescriptionError(f"redefinition of {n}", tok.line, tok.col)
            prog.defs[n] = op

    def _op(self, prog):
        start = self.peek()
        results = []
        if start.kind == "ssa":
            results = self._results()
        t = self.next()
        if t.kind == "string":
            raise Unmodelled(f"{t.line}:{t.col}: generic op syntax {t.text}")
        if t.kind != "id" or not t.text.startswith("zopt."):
            raise DescriptionError(f"only zopt operations in a step, got {t.text!r}",
                                   t.line, t.col)
        name = t.text[5:]
        if name in _RESERVED:
            raise DescriptionError(f"zopt.{name} is introduced by the compiler",
                                   t.line, t.col)
        if name == "state":
            self._state(prog, results, t)
        elif name == "hyper":
            self._hyper(prog, results, t)
        elif name == "yield":
            self._yield(prog, results, t)
        elif name == "clip_by_global_norm":
            opnds = self._operands()
            self.expect("max")
            num = self.next()
            if num.kind != "num":
                raise DescriptionError(f"expected max_norm, got {num.text!r}",
                                       num.line, num.col)
            attrs = self._maybe_attrs()
            self._check_attrs(attrs, (), t)
            self.expect(":")
            tys = self._types()
            op = Op(name, results, [self._use(prog, o) for o in opnds],
                    {"max_norm": _parse_number(num)}, t.line, t.col, tys)
            self._finish(prog, op, 1, 1, t)
        elif name in _PRIMS:
            nf, hy, nres = _PRIMS[name]
            opnds = self._operands()
            attrs = self._maybe_attrs()
            self._check_attrs(attrs, _ATTRS.get(name, ()), t)
            self.expect(":")
            tys = self._types()
            op = Op(name, results, [self._use(prog, o) for o in opnds],
                    {k: True for k in attrs}, t.line, t.col, tys)
            self._finish(prog, op, nf + len(hy), nres, t, nf)
        else:
            raise Unmodelled(f"{t.line}:{t.col}: unknown op zopt.{name}")

    def _check_attrs(self, attrs, known, t):
        name = t.text[5:]
        for k in attrs:
            if k in _INHERENT.get(name, ()):
                raise RestatedAttribute(
                    f"zopt.{name}'s attribute dictionary restates '{k}', which its "
                    f"syntax gives ({_INHERENT[name][k]}); the compiler lets the "
                    "dictionary's value override the syntax's (finding F2 of "
                    "docs/TESTING.md)", t.line, t.col)
        for k, v in attrs.items():
            if k not in known:
                raise Unmodelled(f"{t.line}:{t.col}: attribute {k!r} of zopt.{t.text[5:]}")
            if v is not True and v[:2] != ("id", "unit"):
                raise Unmodelled(f"{t.line}:{t.col}: attribute {k}={v!r}")

    def _finish(self, prog, op, nopnds, nres, t, nf=None):
        if len(op.operands) != nopnds:
            raise DescriptionError(f"zopt.{op.name} takes {nopnds} operands, got "
                                   f"{len(op.operands)}", t.line, t.col)
        if len(op.results) != nres:
            raise DescriptionError(f"zopt.{op.name} has {nres} results", t.line, t.col)
        nf = nopnds if nf is None else nf
        if len(op.types) != nf:
            raise DescriptionError(f"zopt.{op.name} lists {nf} types, got "
                                   f"{len(op.types)}", t.line, t.col)
        for i, v in enumerate(op.operands):
            want_hyper = i >= nf
            if (v in prog.hypers) != want_hyper:
                raise DescriptionError(
                    f"operand {i} of zopt.{op.name} ({v}) must be "
                    + ("a hyperparameter" if want_hyper else "a per-element value"),
                    t.line, t.col)
        # the listed types are the operands' stored types
        for v, ty in zip(op.operands[:nf], op.types):
            have = self._type_of(prog, v)
            if have != ty:
                raise DescriptionError(f"{v} is {have}, listed as {ty}", t.line, t.col)
        self._def(prog, op.results, op, t)
        prog.ops.append(op)

    @staticmethod
    def _type_of(prog, v):
        if v in prog.state_of_ssa:
            return prog.states[prog.state_of_ssa[v]]["dtype"]
        return "f32"

    def _state(self, prog, results, t):
        kind = self.expect(kind="id")
        if kind.text not in STATE_KINDS:
            raise DescriptionError(f"unknown state kind {kind.text!r}", kind.line, kind.col)
        self.expect(":")
        ty = self.expect(kind="id")
        self.expect("on")
        pl = self.expect(kind="id")
        if pl.text not in PLACEMENTS:
            raise DescriptionError(f"unknown placement {pl.text!r}", pl.line, pl.col)
        rounding = None
        if self.accept("rounding"):
            r = self.expect(kind="id")
            if r.text not in ROUNDINGS:
                raise DescriptionError(f"unknown rounding {r.text!r}", r.line, r.col)
            rounding = r.text
        # `remainder` (docs/NUMERICS.md §9): the f32 master kept as the
        # int16 low half beside its bf16 param; checked in parse().
        remainder = self.accept("remainder")
        attrs = self._maybe_attrs()
        self._check_attrs(attrs, (), t)
        if len(results) != 1:
            raise DescriptionError("zopt.state has one result", t.line, t.col)
        if ty.text not in DTYPES:
            raise DescriptionError(f"state type {ty.text}", ty.line, ty.col)
        if kind.text in prog.states:
            raise DescriptionError(f"state {kind.text} declared twice", t.line, t.col)
        op = Op("state", results, [], {"kind": kind.text}, t.line, t.col)
        self._def(prog, results, op, t)
        prog.states[kind.text] = dict(ssa=results[0], dtype=ty.text, placement=pl.text,
                                      rounding=rounding or "nearest_even", line=t.line,
                                      remainder=bool(remainder), col=t.col)
        prog.state_of_ssa[results[0]] = kind.text

    def _hyper(self, prog, results, t):
        kind = self.next()
        if kind.kind != "id" or kind.text not in HYPER_KINDS:
            raise DescriptionError(f"unknown hyperparameter {kind.text!r}",
                                   kind.line, kind.col)
        dflt = None
        if self.accept("default"):
            num = self.next()
            if num.kind != "num":
                raise DescriptionError(f"expected a number, got {num.text!r}",
                                       num.line, num.col)
            dflt = _parse_number(num)
            if self.peek() is not None and self.peek().text == ":":
                raise Unmodelled(f"{num.line}:{num.col}: typed hyper default")
        attrs = self._maybe_attrs()
        self._check_attrs(attrs, (), t)
        if len(results) != 1:
            raise DescriptionError("zopt.hyper has one result", t.line, t.col)
        op = Op("hyper", results, [], {"kind": kind.text, "default": dflt}, t.line, t.col)
        self._def(prog, results, op, t)
        prog.hypers[results[0]] = (kind.text, dflt)

    def _yield(self, prog, results, t):
        if results:
            raise DescriptionError("zopt.yield has no results", t.line, t.col)
        vals = self._operands()
        self.expect("into")
        tgts = self._operands()
        attrs = self._maybe_attrs()
        self._check_attrs(attrs, (), t)
        self.expect(":")
        vtys = self._types()
        self.expect("into")
        ttys = self._types()
        if self.peek() is None or self.peek().text != "}":
            nt = self.peek()
            raise DescriptionError("zopt.yield must end the step", nt.line, nt.col)
        if len(vals) != len(tgts) or len(vtys) != len(vals) or len(ttys) != len(tgts):
            raise DescriptionError("zopt.yield: as many values, targets and types",
                                   t.line, t.col)
        for v, ty in zip(vals, vtys):
            self._use(prog, v)
            if v.text in prog.hypers or self._type_of(prog, v.text) != ty.strip():
                raise DescriptionError(f"yield value {v.text} listed as {ty}", v.line, v.col)
        for v, ty in zip(tgts, ttys):
            if v.text not in prog.state_of_ssa:
                raise DescriptionError(f"yield target {v.text} is not a state",
                                       v.line, v.col)
            if self._type_of(prog, v.text) != ty:
                raise DescriptionError(f"yield target {v.text} listed as {ty}",
                                       v.line, v.col)
        prog.stores = [(v.text, prog.state_of_ssa[s.text]) for v, s in zip(vals, tgts)]
        prog.ops.append(Op("yield", [], [v.text for v in vals], {}, t.line, t.col))


def parse(text):
    """Parses a description (custom syntax) into a :class:`Program`."""
    prog = _Parser(text).parse()
    prog.ops = [o for o in prog.ops if o.name != "yield"]
    for k in ("param", "grad"):
        if k not in prog.states:
            raise DescriptionError(f"the step has no {k} state")
    for k, st in prog.states.items():
        if not st.get("remainder"):
            continue
        p = prog.states["param"]
        if (k != "master" or st["dtype"] != "f32" or p["dtype"] != "bf16"
                or p["placement"] != st["placement"] or p["rounding"] != "nearest_even"):
            raise DescriptionError("'remainder' needs the f32 master of a bf16 param on its "
                                   "placement, rounded to nearest", st["line"], st["col"])
        # The param is the master's high half rounded to nearest with ties
        # away (NUMERICS §9), not ties to even: its interval is the directed
        # one (either neighbour); the master itself is checked as any f32
        # state, and it decides the param (zopt-kernel-check checks that
        # split bit for bit).
        p["rounding"] = "nearest_away"
    return prog


# ---------------------------------------------------------------------------
# Values with error bounds
# ---------------------------------------------------------------------------

class Value:
    """Per-element float64 values and a bound on |f32 result - value|."""
    __slots__ = ("val", "err")

    def __init__(self, val, err=None):
        self.val = val
        self.err = np.zeros_like(val) if err is None else err


def _abs(x):
    return np.abs(x)


def _f(x):
    return np.float64(x)


def _lin(a, ka, b, kb, nops=3):
    """ka*a + kb*b in f32 with f32 coefficients: nops unit roundoffs of
    the terms' magnitudes plus the operands' bounds."""
    ta, tb = ka * a.val, kb * b.val
    val = ta + tb
    err = (nops * U32 * (_abs(ta) + _abs(tb)) + _abs(ka) * a.err + _abs(kb) * b.err)
    return Value(val, err)


def _settle(val, err, amb_in):
    """The bound of a result: infinite where an operand was ambiguous;
    where the value is NaN or infinite (not ambiguous) 0: the
    implementation must produce the same NaN / infinity; a NaN bound of a
    finite value (0 * inf, ...) is infinite."""
    # an op's own ambiguity (a sign near 0, a sqrt near 0: an infinite
    # bound of a finite or NaN value) stays
    own = (err == np.inf) & ~np.isinf(val)
    special = np.isnan(val) | np.isinf(val)
    err = np.where(np.isnan(err) | special, np.where(special, 0.0, np.inf), err)
    return np.where(own | amb_in, np.inf, err)


def _ema_sq(avg, x, b):
    """b*avg + ((1-b)*x)*x (the association of the lowering and of
    oracles.reference)."""
    c = _f(1.0) - b
    ta = b * avg.val
    tx = (c * x.val) * x.val
    err = (4 * U32 * (_abs(ta) + _abs(tx)) + _abs(b) * avg.err
           + _abs(c) * (2 * _abs(x.val) * x.err + x.err * x.err))
    return Value(ta + tx, err)


class _Tensor:
    __slots__ = ("group", "n", "states")

    def __init__(self, group, n):
        self.group, self.n, self.states = group, n, {}


_BF16_MIN_NORMAL = 2.0 ** -126
_BF16_SUB_ULP = 2.0 ** -133


def store_round(x, dtype):
    """float64 values rounded to storage dtype: ``reference.round_to``, with
    the bf16 subnormal range (|x| < 2^-126, spacing 2^-133) rounded to
    nearest even as well (``bf16.round_f64`` is exact for normal values
    only and leaves tinier ones unrounded)."""
    out = round_to(x, dtype)
    if dtype == "bf16":
        x = np.asarray(x, dtype=np.float64)
        tiny = np.abs(x) < _BF16_MIN_NORMAL
        if tiny.any():
            q = np.round(x[tiny] / _BF16_SUB_ULP) * _BF16_SUB_ULP   # half to even
            out = np.array(out, dtype=np.float64)
            out[tiny] = np.copysign(q, x[tiny])
    return out


def _directed_bf16(x, up):
    """x rounded to the bf16 grid toward +inf (up) or -inf."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float64))
    bits = a.view(np.uint64)
    mask = np.uint64((1 << 45) - 1)
    t = (bits & ~mask).view(np.float64).copy()        # toward zero
    inexact = (bits & mask) != 0
    away = np.where(up, a > 0, a < 0) & inexact
    t2 = (t.view(np.uint64) + np.uint64(1 << 45)).view(np.float64)
    out = np.where(away, t2, t)
    tiny = np.abs(a) < _BF16_MIN_NORMAL               # the subnormal grid
    if tiny.any():
        q = a / _BF16_SUB_ULP
        q = np.ceil(q) if up else np.floor(q)
        out = np.where(tiny, q * _BF16_SUB_ULP, out)
    # (the input's shape: ascontiguousarray makes a 0-d array 1-element,
    # which numpy 2.5 refuses where a scalar is assigned)
    return np.where(np.isfinite(a), out, a).reshape(np.shape(x))


def round_interval(lo, hi, dtype, rounding="nearest_even"):
    """Storage values an implementation may store for a result in [lo, hi]."""
    if rounding in ("stochastic", "nearest_away") and dtype == "bf16":
        return _directed_bf16(lo, False), _directed_bf16(hi, True)
    return store_round(lo, dtype), store_round(hi, dtype)


# ---------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------

class Interpreter:
    """Runs a Program's steps on float64 arrays.

    groups: [dict(params=[arrays of the stored param values], slot=value,
    ...)] (``betas=(b1, b2)`` accepted); a slot a group does not set takes
    the description's default, else the runtime's (RUNTIME_DEFAULTS).
    Owned states start as the runtime initializes them: the master from the
    param, everything else at zero. ``loss_scaler``: the scaler's settings
    (reference.LossScaler keywords) for a loss-scaled step.
    """

    def __init__(self, program, groups, loss_scaler=None, grad_reads_unscaled=False,
                 safety=2.0):
        self.prog = program
        self.safety = safety
        self.grad_reads_unscaled = grad_reads_unscaled
        dflt = program.defaults()
        self.groups = []
        self.tensors = []
        for gi, g in enumerate(groups):
            h = dict(dflt)
            for k, v in g.items():
                if k == "params":
                    continue
                if k == "betas":
                    h["beta1"], h["beta2"] = float(v[0]), float(v[1])
                elif k == "bias_correction":
                    h[k] = 1.0 if v else 0.0
                else:
                    h[k] = float(v)
            h["step"] = 0
            self.groups.append(h)
            for p in g["params"]:
                p = np.array(p, dtype=np.float64).reshape(-1)
                t = _Tensor(gi, p.size)
                for kind, st in program.states.items():
                    if kind == "grad":
                        continue
                    if kind in ("param", "master"):
                        t.states[kind] = store_round(p, st["dtype"])
                    else:
                        t.states[kind] = np.zeros(p.size)
                self.tensors.append(t)
        self.scaler = LossScaler(**(loss_scaler or {})) if program.loss_scaled else None
        self.last = None       # per tensor: {kind: Value} of the last step
        self.history = []

    # -- accessors ---------------------------------------------------------------
    def state(self, i, kind):
        """Stored values (float64) of state ``kind`` of tensor i."""
        return self.tensors[i].states[kind]

    def set_state(self, i, kind, values):
        """Replaces a stored state (re-synchronizing with an implementation
        so that the next step starts from its exact values)."""
        self.tensors[i].states[kind] = np.array(values, dtype=np.float64).reshape(-1)

    def step_count(self, gi):
        return self.groups[gi]["step"]

    def written_kinds(self):
        return list(dict.fromkeys(self.prog.stored_kinds()))

    def expected(self, i, kind):
        """(value, lo, hi) of the last step for stored state ``kind`` of
        tensor i: the float64 result rounded to the state's dtype and the
        interval [lo, hi] of storage values an f32 implementation may
        store. After a skipped step: the unchanged state, lo = hi."""
        st = self.prog.states[kind]
        cur = self.tensors[i].states[kind]
        if self.last is None or self.last[i] is None or kind not in self.last[i]:
            return cur, cur, cur
        v = self.last[i][kind]
        E = self.safety * v.err
        with np.errstate(invalid="ignore", over="ignore"):
            lo, hi = round_interval(v.val - E, v.val + E, st["dtype"], st["rounding"])
        return cur, lo, hi

    def error_bound(self, i, kind):
        """The f32 error bound of the last value stored into ``kind``."""
        if self.last is None or self.last[i] is None:
            return np.zeros(self.tensors[i].n)
        return self.last[i][kind].err

    # -- stepping -----------------------------------------------------------------
    def step(self, grads):
        """grads: one array per tensor (registration order) of the values the
        runtime reads (loss-scaled in a loss-scaled step). Returns
        dict(norm, norm_err, skipped, clip_coef, scale)."""
        prog = self.prog
        gs = [np.asarray(g, dtype=np.float64).reshape(-1) for g in grads]
        if len(gs) != len(self.tensors):
            raise ValueError(f"{len(gs)} grads for {len(self.tensors)} tensors")
        S = self.scaler.scale if self.scaler is not None else 1.0
        clip = prog.clip
        reduced = None   # the value the global sum of squares is taken of
        if clip is not None:
            reduced = clip.operands[0]
        elif prog.loss_scaled:
            reduced = prog.op_named("unscale")[0].results[0]
        norm, norm_err, coef = float("nan"), 0.0, 1.0
        # the step being taken is the groups' step t for the norm pass too
        # (momentum's first step, adam_direction's bias correction); a
        # skipped step takes it back
        for h in self.groups:
            h["step"] += 1
        with np.errstate(all="ignore"):
            if reduced is not None:
                parts = [self._eval(i, gs[i], S, None, stop=reduced)[reduced]
                         for i in range(len(self.tensors))]
                sumsq = math.fsum(float(np.dot(p.val, p.val)) for p in parts)
                finite = all(np.isfinite(p.val).all() for p in parts)
                norm = math.sqrt(sumsq) if finite and math.isfinite(sumsq) else float("inf")
                # |n' - n| <= || x' - x || (triangle inequality)
                norm_err = math.sqrt(math.fsum(float(np.dot(p.err, p.err)) for p in parts)) \
                    if finite else float("inf")
                if prog.loss_scaled and not math.isfinite(norm):
                    for h in self.groups:
                        h["step"] -= 1
                    self.scaler.update(True)
                    self.last = [None] * len(self.tensors)
                    rec = dict(norm=float("nan"), norm_err=0.0, skipped=True,
                               clip_coef=1.0, scale=S)
                    self.history.append(rec)
                    return rec
                if clip is not None:
                    c = clip.attrs["max_norm"] / (norm + 1e-6)
                    coef = c
            self.last = []
            new_states = []
            for i, t in enumerate(self.tensors):
                env = self._eval(i, gs[i], S, (coef, norm, norm_err))
                out, new = {}, {}
                for v, kind in prog.stores:
                    val = env[v]
                    out[kind] = val
                    st = prog.states[kind]
                    new[kind] = store_round(val.val, st["dtype"])
                self.last.append(out)
                new_states.append(new)
            for t, new in zip(self.tensors, new_states):
                t.states.update(new)
        if self.scaler is not None:
            self.scaler.update(False)
        rec = dict(norm=norm, norm_err=norm_err, skipped=False,
                   clip_coef=coef if coef < 1.0 else 1.0, scale=S)
        self.history.append(rec)
        return rec

    def _eval(self, i, g, S, clipinfo, stop=None):
        """Evaluates the body for tensor i; returns {ssa: Value or float}."""
        prog = self.prog
        t = self.tensors[i]
        h = self.groups[t.group]
        env = {}
        for ssa, (kind, _) in prog.hypers.items():
            env[ssa] = _f(h[kind])
        for kind, st in prog.states.items():
            if kind == "grad":
                gv = g / S if (self.grad_reads_unscaled and prog.loss_scaled) else g
                env[st["ssa"]] = Value(gv)
            else:
                env[st["ssa"]] = Value(t.states[kind])
        if stop is not None and stop in env:
            return env
        for op in prog.ops:
            if op.name in ("state", "hyper"):
                continue
            args = [env[a] for a in op.operands]
            res = self._apply(op, args, h, S, clipinfo)
            # f32 underflow: relative bounds do not hold below the normal
            # range; each result and each coefficient product may be off by
            # half the smallest f32 subnormal
            vals = [x for x in args if isinstance(x, Value)]
            floor = _TINY * (1.0 + sum(_abs(x.val) for x in vals))
            amb_in = np.zeros(np.shape(res[0].val), dtype=bool)
            for x in vals:
                amb_in |= ~(x.err < np.inf)
            for v in res:
                v.err = _settle(v.val, v.err + floor, amb_in)
            for r, v in zip(op.results, res):
                env[r] = v
            if stop is not None and stop in op.results:
                return env
        return env

    def _apply(self, op, a, h, S, clipinfo):
        n = op.name
        t = _f(h["step"])
        one = _f(1.0)
        if n == "l2_decay" or n == "nesterov":     # x + k*y
            return [_lin(a[0], one, a[1], a[2])]
        if n == "apply":                           # p - lr*u
            return [_lin(a[0], one, a[1], -a[2])]
        if n == "ema":                             # b*avg + (1-b)*x
            return [_lin(a[0], a[2], a[1], one - a[2])]
        if n == "ema_sq":                          # b*avg + (1-b)*x*x
            return [_ema_sq(a[0], a[1], a[2])]
        if n == "decoupled_decay":                 # p*(1 - lr*wd), k in f64
            k = one - a[1] * a[2]
            val = a[0].val * k
            return [Value(val, 2 * U32 * _abs(val) + _abs(k) * a[0].err)]
        if n == "momentum":
            mu, damp = a[2], a[3]
            if t == 1.0:
                ca, cb = _f(0.0), one
            elif mu == 0.0:
                ca, cb = _f(0.0), one
            else:
                ca, cb = mu, one - damp
            return [_lin(a[0], ca, a[1], cb)]
        if n == "max":
            x, y = a
            return [Value(np.maximum(x.val, y.val), np.maximum(x.err, y.err))]
        if n == "sign":
            x = a[0]
            val = np.where(x.val > 0, 1.0, np.where(x.val < 0, -1.0, x.val))
            amb = (x.err > 0) & (_abs(x.val) <= x.err)
            return [Value(val, np.where(amb, np.inf, 0.0))]
        if n == "unscale":
            x = a[0]
            # with grad_reads_unscaled every read of the grad is already
            # divided (the plan phase's gradient scale): unscale is the identity
            k = one if self.grad_reads_unscaled else one / _f(S)
            val = x.val * k
            return [Value(val, 2 * U32 * _abs(val) + k * x.err)]
        if n == "clip_by_global_norm":
            x = a[0]
            coef, norm, norm_err = clipinfo
            rel = norm_err / norm if norm > 0 else 0.0
            if coef < 1.0:
                val = x.val * coef
                err = (2 * U32 + rel) * _abs(val) + coef * x.err
                if coef * (1 + rel) + 2 * U32 >= 1.0:   # c < 1 might not hold in f32
                    err = err + _abs(x.val) * (1.0 - coef)
            else:
                val = x.val
                err = x.err
                if coef * (1 - rel) - 2 * U32 < 1.0:    # ... or hold
                    err = err + _abs(x.val) * (coef * rel + 2 * U32)
            return [Value(val, err)]
        if n == "adam_direction":
            return [self._adam_direction(a[0], a[1], a[2], a[3], a[4], t, h)]
        if n == "adam":
            p, g, m, v, lr, b1, b2, eps, wd = a
            if op.attrs.get("decoupled"):
                p = self._apply(_Op1("decoupled_decay"), [p, lr, wd], h, S, clipinfo)[0]
            else:
                g = _lin(g, one, p, wd)
            m1 = _lin(m, b1, g, one - b1)
            v1 = _ema_sq(v, g, b2)
            u = self._adam_direction(m1, v1, b1, b2, eps, t, h)
            p1 = _lin(p, one, u, -lr)
            return [p1, m1, v1]
        raise Unmodelled(f"zopt.{n}")

    @staticmethod
    def _adam_direction(m, v, b1, b2, eps, t, h):
        one = _f(1.0)
        if h.get("bias_correction", 1.0) != 0.0:
            bc1 = one - np.power(b1, t)
            bc2s = np.sqrt(one - np.power(b2, t))
        else:
            bc1 = bc2s = one
        inv1 = one / bc1
        inv2 = one / bc2s
        mhat = m.val * inv1
        sq = np.sqrt(v.val)
        den = sq * inv2 + eps
        r = mhat / den
        # sqrt: |d sqrt| <= min(e / (2 sqrt(v)), sqrt(e))
        with np.errstate(divide="ignore", invalid="ignore"):
            dsq = np.minimum(v.err / (2 * np.maximum(sq, 1e-300)), np.sqrt(v.err))
        dden = _abs(inv2) * dsq
        with np.errstate(divide="ignore", invalid="ignore"):
            err = (8 * U32 * _abs(r) + _abs(inv1) * m.err / _abs(den)
                   + _abs(mhat) * dden / (den * den))
        # a sqrt of a value within its error of 0 from either side may be
        # NaN on one side and a number on the other; a denominator within
        # its error of 0 is unbounded
        crossing = ((v.val < 0) & (v.val + v.err >= 0)) | ((v.val >= 0) & (v.val - v.err < 0))
        amb = (crossing & (v.err > 0)) | (
            _abs(den) <= dden + 4 * U32 * (_abs(sq * inv2) + _abs(eps)))
        err = np.where(amb, np.inf, err)
        return Value(r, err)


class _Op1:
    def __init__(self, name):
        self.name, self.attrs = name, {}

"""Property test of the compiler (issue 10): mutate valid descriptions and
check that every mutant is either

* refused with a located diagnostic (``description:LINE:COL: error:`` with
  LINE:COL inside the text), without a crash or a timeout of zopt-compile,
* or accepted, and then (CPU placement) the step.so loads and its steps
  match a float64 interpreter of the mutated description itself
  (oracles/interp.py) on random data, for every element of every state and of the
  param; a GPU / offload mutant is only compiled.

(Longer than ~800 lines: one test and its parts, in the order they run:
the seed descriptions, the mutation grammar (one function per mutation),
the diagnostic check, the C runner and its element-wise comparison, the
oracle's own validation, the pinned findings, the mutant loop. Each part
serves only this test; split apart they would be read together anyway.)

The oracle: oracles/interp.py reads the description text and evaluates its
per-element program in float64 (it is validated below against
oracles/reference.py on every layout and rule of zopt.describe: bit-identical).
It also propagates a bound on how far an f32 evaluation of each primitive
(f32 coefficients derived in f64, as the decompose phase lowers them) may
land from the float64 value. A stored element passes when it lies in
[round(y - 2E), round(y + 2E)] (round: to the state's storage dtype with its
rounding; both neighbours for stochastic rounding): bit-identical to the
float64 result's rounding unless an f32 implementation can legitimately
round the other way (a tie or a value within E of a rounding boundary).
E is a few f32 unit roundoffs of the terms, so a wrong formula, a wrong
coefficient, a swapped operand or a missing step count fails by orders of
magnitude. After each step the interpreter's states are set to the
implementation's stored values, so that every step is checked from
identical inputs (errors do not accumulate, every step stays tight).
Elements whose bound is infinite (a ``sign`` of a value within its f32
error of zero, a ``sqrt`` of a value within its error of 0) are not
checked and are counted.

Data: two groups of tensors of awkward sizes, never-zero params and
gradients, 3 steps with gradient scales 1, 0.02, 0.5 (a clip at max_norm
O(1) is active in steps 1 and 3 and not in step 2), hyperparameters drawn
per case from ranges that make every term visible at bf16 precision (lr
0.02-0.08, eps 1e-3-1e-2, weight decay 0.05-0.2, ...); group 0 sets every
slot, group 1 a random subset (the others take the description's or the
runtime's defaults); group 0's lr changes every step; loss-scaled steps
get a non-finite gradient in step 2 half of the time (the step must skip).

The steps run through the C API (CRunner: zopt.Optimizer refuses f32
gradients of 16-bit params and steps with one of beta1/beta2 only, which
the compiler accepts). A mismatch names the mutant, the step, tensor,
state and element, both values, the allowed interval and the element's
inputs. The compiler findings (docs/TESTING.md: F1, F2) are fixed; their
minimal reproducers are regression tests (refused with a located
diagnostic), and an accepted mutant that shows either one fails.

ZOPT_PROPERTY_CASES=N runs N mutants (default 200: CI), e.g. 2000 for a
long run; ZOPT_PROPERTY_SEED=k shifts the seed list (default 0). A summary
(tried / refused with a location / accepted and matched / compile-only /
skipped as unmodelled / known findings) is printed at the end.

(Longer than ~800 lines: the mutators, the runner and the checks of one
property, and the interpreter's validation against the reference, which
must change together.)
"""
import ctypes
import hashlib
import math
import os
import random
import re
import time
import warnings
from collections import Counter

import numpy as np
import pytest

import zopt
from zopt import _lib
from oracles import interp
from zopt.compiler import CompileWarning
from zopt.describe import LAYOUTS, RULES, describe, layout_types
from oracles.reference import Reference, round_to
from zopt_testutil import from_storage, never_zero, to_storage

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = int(os.environ.get("ZOPT_PROPERTY_CASES", "200"))
SEED = int(os.environ.get("ZOPT_PROPERTY_SEED", "0"))
COMPILE_TIMEOUT = 60
GRAD_SCALES = (1.0, 0.02, 0.5)
SIZES = (1, 2, 3, 7, 17, 31, 33, 64, 65, 130, 257)


# ---------------------------------------------------------------------------
# Valid descriptions to start from
# ---------------------------------------------------------------------------

def _matrix():
    """Every layout and rule of zopt.describe (the named test matrix)."""
    out = []
    for rule in RULES:
        for layout in LAYOUTS:
            for clip in (None, 1.0):
                if rule in ("adam", "adamw"):
                    out += [dict(rule=rule, layout=layout, clip=clip),
                            dict(rule=rule, layout=layout, clip=clip, style="primitives"),
                            dict(rule=rule, layout=layout, clip=clip, amsgrad=True)]
                elif rule == "sgd":
                    out += [dict(rule=rule, layout=layout, clip=clip),
                            dict(rule=rule, layout=layout, clip=clip, nesterov=True),
                            dict(rule=rule, layout=layout, clip=clip, momentum=False)]
                else:
                    out += [dict(rule=rule, layout=layout, clip=clip),
                            dict(rule=rule, layout=layout, clip=clip, state_dtype="bf16")]
    return out


def _builder_sources():
    """zopt.steps outputs (commented text, defaults, rounding, ZeRO)."""
    S = zopt.steps
    return [
        S.adamw.text(param="bf16", master="f32", moments="bf16", clip=1.0,
                     rounding="stochastic", zero_stage=2, lr=0.01, betas=(0.85, 0.98)),
        S.adam.text(param="f16", master="f32", amsgrad=True, eps=1e-6),
        S.adamw.text(param="bf16", grad="f32", master="f32", weight_decay=0.1),
        S.adam.text(param="bf16", moments="bf16", rounding={"param": "stochastic"},
                    style="named", zero_stage=1, clip=2.0),
        S.sgd.text(param="bf16", master="f32", momentum=0.8, dampening=0.1, zero_stage=3),
        S.sgd.text(param="f32", momentum=0.9, nesterov=True, weight_decay=0.01),
        S.sgd.text(param="f16", master="f32", momentum=0),
        S.lion.text(param="bf16", master="f32", moments="bf16", clip=1.0),
        S.lion.text(param="f32", betas=None, weight_decay=0.5),
        S.adamw.text(param="f32", exp_avg="bf16", exp_avg_sq="f32", amsgrad=True,
                     max_exp_avg_sq="bf16", zero_stage=2, align=64),
    ]


def sources():
    """[(name, text)] of valid CPU descriptions."""
    out = []
    ex = os.path.join(ROOT, "examples")
    for f in sorted(os.listdir(ex)):
        if f.endswith(".mlir"):
            text = open(os.path.join(ex, f)).read()
            # q8 moments: test_q8.py and the runtime's q8 tests;
            # a Kahan param: the interpreter does not model its compensation
            # (NUMERICS §11; zopt-kernel-check and test_kahan check it)
            if ("gpu_arch" not in text and "on gpu" not in text and " q8" not in text
                    and " kahan" not in text):
                out.append(("examples/" + f, text))
    for kw in _matrix():
        out.append(("describe(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")",
                    describe(**kw)))
    for i, t in enumerate(_builder_sources()):
        out.append((f"zopt.steps[{i}]", t))
    return out


# ---------------------------------------------------------------------------
# Mutations (line-level; every source has one op per line)
# ---------------------------------------------------------------------------

SSA = re.compile(r"%[A-Za-z0-9_$.\-]+(?:#[0-9]+)?")
NUM = re.compile(r"(?<![\w.%@#])[-+]?(?:0x[0-9A-Fa-f]+|[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)")
OPLINE = re.compile(r"^(\s*)((?:%[\w$.\-]+\s*,\s*)*%[\w$.\-]+\s*=\s*)?zopt\.(\w+)\b")
DTYPE_TOK = re.compile(r"\b(f32|bf16|f16)\b")
SAME_SIG = {  # ops with the same operand signature (2 values + 1 hyper)
    "l2_decay": ("ema", "ema_sq", "nesterov", "apply"),
    "ema": ("ema_sq", "l2_decay", "nesterov", "apply"),
    "ema_sq": ("ema", "l2_decay", "nesterov", "apply"),
    "nesterov": ("l2_decay", "ema", "ema_sq", "apply"),
    "apply": ("l2_decay", "ema", "ema_sq", "nesterov"),
}
STATE_KINDS = interp.STATE_KINDS
HYPERS = interp.HYPER_KINDS
NUMBERS = ["0", "1", "0.0", "1.0", "0.5", "0.9", "0.99", "0.999", "1.5", "2.0", "-1.0",
           "1.0e-03", "1e-8", "1.0e30", "1.0e-45", "3", "4", "16", "64", "1024",
           "100.0", "0.1", "7", "1048576", "2097152", "0x3FF0000000000000", "-0.0",
           "0.25", "1e400"]


class Text:
    """A description as lines, with the facts the mutators need."""

    def __init__(self, text):
        self.lines = text.split("\n")

    def text(self):
        return "\n".join(self.lines)

    def op_lines(self, name=None):
        out = []
        for i, ln in enumerate(self.lines):
            m = OPLINE.match(ln)
            if m and (name is None or m.group(3) == name):
                out.append(i)
        return out

    @staticmethod
    def op_of(ln):
        m = OPLINE.match(ln)
        return m.group(3) if m else None

    @staticmethod
    def code(ln):
        """The line without its comment."""
        i = ln.find("//")
        return ln if i < 0 else ln[:i]

    def operand_spans(self, i):
        """[(start, end)] of the operand uses of line i (yield: values and
        targets)."""
        ln = self.code(self.lines[i])
        m = OPLINE.match(ln)
        if not m:
            return []
        start = m.end()
        stop = len(ln)
        name = m.group(3)
        for pat in (r"\{", r"\s:\s", r"\smax\s") if name != "yield" else (r"\{", r"\s:\s"):
            mm = re.compile(pat).search(ln, start)
            if mm:
                stop = min(stop, mm.start())
        return [(x.start(), x.end()) for x in SSA.finditer(ln, start, stop)]

    def type_spans(self, i):
        """[(start, end)] of the dtypes after the ':' of line i."""
        ln = self.code(self.lines[i])
        m = re.search(r"\s:\s", ln)
        if not m:
            return []
        return [(x.start(), x.end()) for x in DTYPE_TOK.finditer(ln, m.end())]

    def defs(self):
        """{ssa: line} of every defined value."""
        out = {}
        for i, ln in enumerate(self.lines):
            m = OPLINE.match(ln)
            if m and m.group(2):
                for x in SSA.finditer(m.group(2)):
                    out[x.group()] = i
        return out

    def states(self):
        """{ssa: (line, kind)}"""
        out = {}
        for i in self.op_lines("state"):
            m = re.match(r"\s*(%[\w$.\-]+)\s*=\s*zopt\.state\s+(\w+)", self.lines[i])
            if m:
                out[m.group(1)] = (i, m.group(2))
        return out

    def hypers(self):
        out = {}
        for i in self.op_lines("hyper"):
            m = re.match(r"\s*(%[\w$.\-]+)\s*=\s*zopt\.hyper\s+(\w+)", self.lines[i])
            if m:
                out[m.group(1)] = (i, m.group(2))
        return out

    def replace(self, i, start, end, new):
        ln = self.lines[i]
        self.lines[i] = ln[:start] + new + ln[end:]

    def body_range(self):
        first = next(i for i, ln in enumerate(self.lines) if "zopt.step" in self.code(ln))
        last = max(i for i, ln in enumerate(self.lines) if self.code(ln).strip() == "}")
        return first, last


def _types_for(t, ssa):
    """Every (line, type span) where ssa's stored type is listed: operand
    type lists and the yield's value/target type lists."""
    out = []
    for i in t.op_lines():
        name = t.op_of(t.lines[i])
        ops = t.operand_spans(i)
        tys = t.type_spans(i)
        ln = t.lines[i]
        if name == "yield":
            into = ln.find(" into ")
            vals = [s for s in ops if s[0] < into]
            tgts = [s for s in ops if s[0] > into]
            pairs = list(zip(vals + tgts, tys))
        elif name in ("state", "hyper"):
            continue
        else:
            pairs = list(zip(ops, tys))
        for (a, b), ty in pairs:
            if ln[a:b] == ssa:
                out.append((i, ty))
    return out


def m_swap_operands(t, r):
    cands = [i for i in t.op_lines() if len(t.operand_spans(i)) >= 2]
    if not cands:
        return None
    i = r.choice(cands)
    sp = t.operand_spans(i)
    a, b = r.sample(range(len(sp)), 2)
    ln = t.lines[i]
    xa, xb = ln[sp[a][0]:sp[a][1]], ln[sp[b][0]:sp[b][1]]
    if xa == xb:
        return None
    (s0, e0), (s1, e1) = sorted([sp[a], sp[b]])
    x0, x1 = ln[s0:e0], ln[s1:e1]
    t.lines[i] = ln[:s0] + x1 + ln[e0:s1] + x0 + ln[e1:]
    return f"swap operands {x0} <-> {x1} on line {i + 1}"


def m_change_type(t, r):
    cands = [(i, s) for i in t.op_lines() for s in t.type_spans(i)]
    if not cands:
        return None
    i, (a, b) = r.choice(cands)
    old = t.lines[i][a:b]
    new = r.choice([d for d in ("f32", "bf16", "f16", "f64", "i32") if d != old])
    t.replace(i, a, b, new)
    return f"type {old} -> {new} on line {i + 1}"


def m_state_dtype(t, r, consistent=None):
    st = t.states()
    if not st:
        return None
    ssa = r.choice(sorted(st))
    i, kind = st[ssa]
    m = re.search(r":\s*(\w+)\s+on", t.lines[i])
    if not m:
        return None
    old = m.group(1)
    new = r.choice([d for d in ("f32", "bf16", "f16") if d != old] + (["f64"] if r.random() < 0.1 else []))
    if consistent is None:
        consistent = r.random() < 0.8
    spans = _types_for(t, ssa) if consistent else []
    t.replace(i, m.start(1), m.end(1), new)
    for li, (a, b) in sorted(spans, key=lambda x: -x[1][0]):
        t.replace(li, a, b, new)
    if new == "f32" and "rounding" in t.lines[i] and r.random() < 0.7:
        t.lines[i] = re.sub(r"\s+rounding\s+\w+", "", t.lines[i])
    return f"state {kind} {old} -> {new}" + (" (type lists too)" if consistent else "")


def m_state_kind(t, r):
    st = t.states()
    if not st:
        return None
    ssa = r.choice(sorted(st))
    i, kind = st[ssa]
    new = r.choice([k for k in STATE_KINDS + ("weights",) if k != kind])
    t.lines[i] = t.lines[i].replace(f"zopt.state {kind}", f"zopt.state {new}", 1)
    return f"state kind {kind} -> {new}"


def m_drop_line(t, r):
    a, b = t.body_range()
    i = r.randrange(a, b + 1) if r.random() < 0.1 else r.randrange(a + 1, b)
    del t.lines[i]
    return f"drop line {i + 1}"


def m_dup_line(t, r):
    a, b = t.body_range()
    i = r.randrange(a + 1, b)
    t.lines.insert(i, t.lines[i])
    return f"duplicate line {i + 1}"


def m_number(t, r):
    cands = []
    for i, ln in enumerate(t.lines):
        code = t.code(ln)
        for m in NUM.finditer(code):
            if code[max(0, m.start() - 4):m.start()].endswith("sm_"):
                continue
            cands.append((i, m.start(), m.end()))
    if not cands:
        return None
    i, a, b = r.choice(cands)
    old = t.lines[i][a:b]
    new = r.choice([n for n in NUMBERS if n != old])
    t.replace(i, a, b, new)
    return f"number {old} -> {new} on line {i + 1}"


def m_attribute(t, r):
    choice = r.randrange(6)
    adam = t.op_lines("adam")
    if choice == 0 and adam:
        i = r.choice(adam)
        if "{decoupled}" in t.lines[i]:
            t.lines[i] = t.lines[i].replace(" {decoupled}", "")
            return "drop {decoupled}"
        t.lines[i] = t.lines[i].replace(" :", " {decoupled} :", 1)
        return "add {decoupled}"
    if choice == 1 and adam:
        i = r.choice(adam)
        new = r.choice(["{decoupled_wd}", "{decoupled = unit}", "{decoupled = true}",
                        "{amsgrad}", "{decoupled, decoupled}"])
        if "{decoupled}" in t.lines[i]:
            t.lines[i] = t.lines[i].replace("{decoupled}", new)
        else:
            t.lines[i] = t.lines[i].replace(" :", f" {new} :", 1)
        return f"attribute -> {new}"
    ops = [i for i in t.op_lines() if t.op_of(t.lines[i]) not in ("state", "hyper")]
    i = r.choice(ops)
    attr = r.choice(["{decoupled}", "{zopt.slot = 1 : i64}", "{foo}", "{max_norm = 1.0}",
                     "{zopt.loss_scale}", "{bias_correction}"])
    ln = t.lines[i]
    m = re.search(r"\s:\s", t.code(ln))
    if not m:
        return None
    t.lines[i] = ln[:m.start()] + " " + attr + ln[m.start():]
    return f"add attribute {attr} on line {i + 1}"


def m_rename_use(t, r):
    cands = [(i, s) for i in t.op_lines() for s in t.operand_spans(i)]
    if not cands:
        return None
    i, (a, b) = r.choice(cands)
    old = t.lines[i][a:b]
    defs = t.defs()
    earlier = [v for v, li in defs.items() if li < i and v != old]
    pool = earlier if earlier and r.random() < 0.9 else list(defs) + ["%undefined"]
    new = r.choice(sorted(pool))
    # half the time the type list follows (the listed type of operand k is
    # its stored type: a state's dtype, f32 for a computed value)
    fix = r.random() < 0.5
    k = t.operand_spans(i).index((a, b))
    tys = t.type_spans(i)
    if t.op_of(t.lines[i]) == "yield":
        fix = False
    t.replace(i, a, b, new)
    if fix and k < len(tys):
        st = t.states()
        nty = t.lines[st[new][0]].split(":")[1].split()[0] if new in st else "f32"
        ta, tb = t.type_spans(i)[k]
        t.replace(i, ta, tb, nty)
    return f"use {old} -> {new} on line {i + 1}" + (" (type list too)" if fix else "")


def m_rename_def(t, r):
    defs = t.defs()
    if not defs:
        return None
    v = r.choice(sorted(defs))
    i = defs[v]
    m = OPLINE.match(t.lines[i])
    new = v + "_r" if r.random() < 0.7 else r.choice(sorted(defs))
    head = m.group(2).replace(v, new, 1) if v in m.group(2) else m.group(2)
    t.lines[i] = m.group(1) + head + t.lines[i][m.end(2):]
    return f"rename definition {v} -> {new}"


def m_hyper_default(t, r):
    hy = t.hypers()
    if not hy:
        return None
    ssa = r.choice(sorted(hy))
    i, kind = hy[ssa]
    ln = t.lines[i]
    val = r.choice({"lr": ["0.05", "0.0", "2.0"], "beta1": ["0.5", "0.0", "0.95", "1.0"],
                    "beta2": ["0.9", "0.5", "1.0"], "eps": ["1.0e-03", "0.1", "0.0"],
                    "weight_decay": ["0.1", "0.3", "-0.1"], "momentum": ["0.5", "0.0", "1.0"],
                    "dampening": ["0.5", "1.0", "2.0"],
                    "bias_correction": ["0.0", "1.0", "0.5"]}.get(kind, ["0.5"]))
    if " default " in ln and r.random() < 0.3:
        t.lines[i] = re.sub(r"\s+default\s+\S+", "", ln)
        return f"drop the default of {kind}"
    if " default " in ln:
        t.lines[i] = re.sub(r"(\s+default\s+)\S+", r"\g<1>" + val, ln)
    else:
        code = t.code(ln).rstrip()
        t.lines[i] = code + f" default {val}" + ln[len(code):]
    return f"hyper {kind} default {val}"


def m_hyper_kind(t, r):
    hy = t.hypers()
    if not hy:
        return None
    ssa = r.choice(sorted(hy))
    i, kind = hy[ssa]
    new = r.choice([k for k in HYPERS + ("beta3",) if k != kind])
    t.lines[i] = t.lines[i].replace(f"zopt.hyper {kind}", f"zopt.hyper {new}", 1)
    return f"hyper slot {kind} -> {new}"


def m_swap_yield(t, r):
    ys = t.op_lines("yield")
    if not ys:
        return None
    i = ys[0]
    ln = t.lines[i]
    sp = t.operand_spans(i)
    into = ln.find(" into ")
    vals = [s for s in sp if s[0] < into]
    tgts = [s for s in sp if s[0] > into]
    group = tgts if r.random() < 0.5 else vals
    if len(group) < 2:
        return None
    a, b = sorted(r.sample(group, 2))
    xa, xb = ln[a[0]:a[1]], ln[b[0]:b[1]]
    t.lines[i] = ln[:a[0]] + xb + ln[a[1]:b[0]] + xa + ln[b[1]:]
    return f"swap yield {'targets' if group is tgts else 'values'} {xa} <-> {xb}"


def m_clip(t, r):
    cl = t.op_lines("clip_by_global_norm")
    if cl and r.random() < 0.6:
        i = cl[0]
        new = r.choice(["0.5", "2.0", "100.0", "1.0e-03", "0.0", "-1.0", "1e400", "0.25"])
        t.lines[i] = re.sub(r"(max\s+)\S+", r"\g<1>" + new, t.lines[i])
        return f"clip max -> {new}"
    if cl:  # remove the clip: its uses take its operand
        i = cl[0]
        m = re.match(r"\s*(%[\w$.\-]+)\s*=\s*zopt\.clip_by_global_norm\s+(%[\w$.\-]+)", t.lines[i])
        res, opnd = m.group(1), m.group(2)
        opty = re.search(r":\s*(\w+)", t.code(t.lines[i])).group(1)
        del t.lines[i]
        for li in range(len(t.lines)):
            spans = [s for s in _types_for(t, res) if s[0] == li]
            for _, (a, b) in sorted(spans, key=lambda x: -x[1][0]):
                t.replace(li, a, b, opty)
            t.lines[li] = re.sub(re.escape(res) + r"(?![\w$.\-])", opnd, t.lines[li])
        return "remove the clip"
    # add a clip in front of one use of the gradient (or its unscaled value)
    st = t.states()
    g = [v for v, (_, k) in st.items() if k == "grad"]
    us = t.op_lines("unscale")
    src = None
    if us:
        src = re.match(r"\s*(%[\w$.\-]+)", t.lines[us[0]]).group(1)
    elif g:
        src = g[0]
    if src is None:
        return None
    uses = [(i, s) for i in t.op_lines() for s in t.operand_spans(i)
            if t.lines[i][s[0]:s[1]] == src and t.op_of(t.lines[i]) not in ("unscale", "yield")]
    if not uses:
        return None
    srcty = "f32" if us else t.lines[st[src][0]].split(":")[1].split()[0]
    maxn = r.choice(["1.0", "0.5", "3.0"])
    picked = [u for u in uses if r.random() < 0.8] or [r.choice(uses)]
    first = min(i for i, _ in picked)
    for i, (a, b) in sorted(picked, key=lambda x: (-x[0], -x[1][0])):
        t.replace(i, a, b, "%gclip")
    # %gclip is computed by a primitive: f32 in the type lists
    for li, (a, b) in sorted(_types_for(t, "%gclip"), key=lambda x: -x[1][0]):
        t.replace(li, a, b, "f32")
    indent = re.match(r"\s*", t.lines[first]).group()
    t.lines.insert(first, f"{indent}%gclip = zopt.clip_by_global_norm {src} max {maxn} : {srcty}")
    return f"add a clip at {maxn} of {src}"


def m_placement(t, r):
    st = t.states()
    kinds = {k: v for v, (_, k) in st.items()}
    choice = r.randrange(3)
    arch = r.choice(["sm_80", "sm_90", "sm_75", "sm_100", "sm_1000"])
    def to_gpu(ssa):
        i = st[ssa][0]
        t.lines[i] = t.lines[i].replace(" on cpu", " on gpu", 1)
    def add_arch():
        a, _ = t.body_range()
        ln = t.lines[a]
        if "attributes {" in ln:
            t.lines[a] = ln.replace("attributes {", f'attributes {{gpu_arch = "{arch}", ', 1)
        else:
            t.lines[a] = re.sub(r"(zopt\.step\s+@[\w$.\-]+)", r'\1 attributes {gpu_arch = "%s"}' % arch, ln, 1)
    if choice == 0:   # one state to the GPU, no arch
        to_gpu(r.choice(sorted(st)))
        return "one state on gpu"
    if choice == 1:   # offload: param and grad on the GPU
        for k in ("param", "grad"):
            if k in kinds:
                to_gpu(kinds[k])
        add_arch()
        return f"offload (param/grad on gpu, {arch})"
    for v in st:
        to_gpu(v)
    add_arch()
    return f"everything on gpu ({arch})"


def m_zero(t, r):
    a, _ = t.body_range()
    ln = t.lines[a]
    key = r.choice(["zero_stage", "zero_stage", "align"])
    val = r.choice(["0", "1", "2", "3", "4", "-1"] if key == "zero_stage" else
                   ["1", "4", "16", "64", "3", "0", "2097152"])
    if f"{key} = " in ln:
        t.lines[a] = re.sub(key + r" = [-\w]+", f"{key} = {val}", ln)
    elif "attributes {" in ln:
        t.lines[a] = ln.replace("attributes {", f"attributes {{{key} = {val} : i64, ", 1)
    else:
        t.lines[a] = re.sub(r"(zopt\.step\s+@[\w$.\-]+)", r"\1 attributes {%s = %s : i64}" % (key, val), ln, 1)
    return f"{key} = {val}"


def m_rounding(t, r):
    st = t.states()
    ssa = r.choice(sorted(st))
    i, kind = st[ssa]
    ln = t.lines[i]
    if " rounding " in ln:
        if r.random() < 0.5:
            t.lines[i] = re.sub(r"\s+rounding\s+\w+", "", ln)
            return f"drop the rounding of {kind}"
        new = r.choice(["nearest_even", "stochastic", "nearest"])
        t.lines[i] = re.sub(r"(rounding\s+)\w+", r"\g<1>" + new, ln)
        return f"rounding of {kind} -> {new}"
    new = r.choice(["stochastic", "stochastic", "nearest_even"])
    t.lines[i] = re.sub(r"(on\s+\w+)", r"\1 rounding " + new, ln, 1)
    return f"{kind} rounding {new}"


def m_op_swap(t, r):
    cands = [i for i in t.op_lines() if t.op_of(t.lines[i]) in SAME_SIG]
    if not cands:
        return None
    i = r.choice(cands)
    old = t.op_of(t.lines[i])
    new = r.choice(SAME_SIG[old])
    t.lines[i] = t.lines[i].replace(f"zopt.{old} ", f"zopt.{new} ", 1)
    return f"op {old} -> {new} on line {i + 1}"


def m_insert_op(t, r):
    """Inserts a primitive applied to a used value and makes one use read it."""
    cands = [(i, s) for i in t.op_lines() for s in t.operand_spans(i)
             if t.op_of(t.lines[i]) not in ("state", "hyper")]
    hy = sorted(t.hypers())
    defs = t.defs()
    st = t.states()
    vals = [v for v in defs if v not in dict(t.hypers())]
    cands = [(i, s) for i, s in cands if t.lines[i][s[0]:s[1]] in vals]
    if not cands or not hy:
        return None
    i, (a, b) = r.choice(cands)
    x = t.lines[i][a:b]
    earlier = [v for v in vals if defs[v] < i]
    y = r.choice(sorted(earlier))
    h = r.choice(hy)
    kind = r.choice(["sign", "max", "ema", "ema_sq", "nesterov", "l2_decay", "apply",
                     "decoupled_decay", "momentum"])

    def ty(v):
        if v in st:
            return t.lines[st[v][0]].split(":")[1].split()[0]
        return "f32"
    if kind == "sign":
        line = f"%mut = zopt.sign {x} : {ty(x)}"
    elif kind == "max":
        line = f"%mut = zopt.max {x}, {y} : {ty(x)}, {ty(y)}"
    elif kind == "decoupled_decay":
        h2 = r.choice(hy)
        line = f"%mut = zopt.decoupled_decay {x}, {h}, {h2} : {ty(x)}"
    elif kind == "momentum":
        h2 = r.choice(hy)
        line = f"%mut = zopt.momentum {x}, {y}, {h}, {h2} : {ty(x)}, {ty(y)}"
    else:
        line = f"%mut = zopt.{kind} {x}, {y}, {h} : {ty(x)}, {ty(y)}"
    t.replace(i, a, b, "%mut")
    for li, (ta, tb) in _types_for(t, "%mut"):
        if li == i:
            t.replace(li, ta, tb, "f32")
    indent = re.match(r"\s*", t.lines[i]).group()
    t.lines.insert(i, indent + line)
    return f"insert `{line}` before line {i + 1}"


def m_restate(t, r):
    """Restates an attribute the syntax gives in the op's attribute
    dictionary (finding F2: the dictionary's value wins)."""
    choice = r.randrange(4)
    if choice == 0 and t.op_lines("clip_by_global_norm"):
        i = t.op_lines("clip_by_global_norm")[0]
        v = r.choice(["1.0", "100.0", "0.5"])
        t.lines[i] = t.lines[i].replace(" :", f" {{max_norm = {v}}} :", 1)
        return f"clip restates max_norm = {v}"
    if choice == 1 and t.hypers():
        i, kind = t.hypers()[r.choice(sorted(t.hypers()))]
        new = r.choice([f"{{default_value = {r.choice(['0.5', '0.05', '0.0'])}}}",
                        f"{{kind = #zopt<hyper {r.choice(HYPERS)}>}}"])
        code = t.code(t.lines[i]).rstrip()
        t.lines[i] = code + " " + new
        return f"hyper {kind} restates {new}"
    if choice == 2:
        st = t.states()
        i, kind = st[r.choice(sorted(st))]
        new = r.choice([f"{{kind = #zopt<state_kind {r.choice(STATE_KINDS)}>}}",
                        "{rounding = #zopt<rounding stochastic>}",
                        "{placement = #zopt<placement cpu>}"])
        code = t.code(t.lines[i]).rstrip()
        t.lines[i] = code + " " + new
        return f"state {kind} restates {new}"
    a, _ = t.body_range()
    ln = t.lines[a]
    if "attributes {" in ln:
        t.lines[a] = ln.replace("attributes {", 'attributes {sym_name = "renamed", ', 1)
    else:
        t.lines[a] = re.sub(r"(zopt\.step\s+@[\w$.\-]+)", r'\1 attributes {sym_name = "renamed"}', ln, 1)
    return "step restates sym_name"


MUTATORS = [
    (m_swap_operands, 3), (m_change_type, 2), (m_state_dtype, 4), (m_state_kind, 1),
    (m_drop_line, 2), (m_dup_line, 1), (m_number, 3), (m_attribute, 2),
    (m_rename_use, 3), (m_rename_def, 1), (m_hyper_default, 3), (m_hyper_kind, 2),
    (m_swap_yield, 2), (m_clip, 3), (m_placement, 1), (m_zero, 2), (m_rounding, 2),
    (m_op_swap, 4), (m_insert_op, 4), (m_restate, 1),
]


def mutate(text, r):
    """Applies 1 (sometimes 2) random mutations; returns (text, labels)."""
    t = Text(text)
    labels = []
    n = 1 if r.random() < 0.75 else 2
    tries = 0
    while len(labels) < n and tries < 20:
        tries += 1
        fns, weights = zip(*MUTATORS)
        fn = r.choices(fns, weights)[0]
        saved = list(t.lines)
        try:
            lab = fn(t, r)
        except (ValueError, IndexError, StopIteration, AttributeError):
            lab = None
        if lab is None or t.lines == saved:
            t.lines = saved
            continue
        labels.append(lab)
    return t.text(), labels


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------

LOC = re.compile(r"^description:(\d+):(\d+): (error|warning|note):", re.M)
CRASH_MARKS = ("LLVM ERROR", "Stack dump", "PLEASE submit a bug report",
               "Assertion", "Segmentation fault", "timed out", "UNREACHABLE")


def check_diagnostic(text, msg):
    """None if msg is a located error inside text, else what is wrong."""
    if any(k in msg for k in CRASH_MARKS):
        return "zopt-compile crashed or timed out"
    m = re.search(r"\(exit (-?\d+)\)", msg)
    if m and int(m.group(1)) < 0:
        return f"zopt-compile killed by signal {-int(m.group(1))}"
    if m and int(m.group(1)) != 1:
        return f"zopt-compile exited with {m.group(1)}"
    errs = [x for x in LOC.finditer(msg) if x.group(3) == "error"]
    if not errs:
        return "no located error (description:LINE:COL: error:)"
    lines = text.split("\n")
    for x in errs:
        ln, col = int(x.group(1)), int(x.group(2))
        if not 1 <= ln <= len(lines):
            return f"error at line {ln}: the text has {len(lines)} lines"
        if not 1 <= col <= len(lines[ln - 1]) + 1:
            return f"error at {ln}:{col}: line {ln} has {len(lines[ln - 1])} characters"
    return None


# ---------------------------------------------------------------------------
# Running an accepted step against the interpreter
# ---------------------------------------------------------------------------

class Mismatch(AssertionError):
    pass


class CRunner:
    """A compiled step driven through the C API (python/zopt/_lib.py): the
    user's param and grad memory are numpy storage arrays. (The C API
    rather than zopt.Optimizer: the binding refuses f32 gradients of 16-bit
    params and steps with only one of beta1/beta2, both of which the
    compiler accepts.)"""

    def __init__(self, step, groups, gdt, loss_scaler=None):
        self.lib = _lib.lib()
        self.step_obj = step
        self.pdt = {v: k for k, v in _DT.items()}[step.param_dtype]
        self.gdt = gdt
        h = ctypes.c_void_p()
        _lib.check(self.lib.zopt_optimizer_create(step._h, ctypes.byref(h)), "create")
        self.h = h
        self.params, self.grads, self.group_of = [], [], []
        try:
            _lib.check(self.lib.zopt_optimizer_set_num_threads(h, 2), "threads")
            for gi, g in enumerate(groups):
                gid = ctypes.c_int()
                _lib.check(self.lib.zopt_optimizer_add_group(h, ctypes.byref(gid)), "add_group")
                assert gid.value == gi
                for k, v in g.items():
                    if k != "params":
                        self.set_hyper(gi, k, v)
                for p, gr in g["params"]:
                    tid = ctypes.c_int()
                    _lib.check(self.lib.zopt_optimizer_add_tensor(
                        h, gi, p.ctypes.data, gr.ctypes.data, p.size, int(_DT[self.pdt]),
                        ctypes.byref(tid)), "add_tensor")
                    self.params.append(p)
                    self.grads.append(gr)
                    self.group_of.append(gi)
            _lib.check(self.lib.zopt_optimizer_finalize(h), "finalize")
            if loss_scaler is not None:
                c = _lib.LossScalerConfig(init_scale=loss_scaler["init_scale"],
                                          growth_factor=2.0, backoff_factor=0.5,
                                          growth_interval=2000, min_scale=1.0, dynamic=1)
                _lib.check(self.lib.zopt_optimizer_configure_loss_scaler(h, ctypes.byref(c)),
                           "configure_loss_scaler")
        except BaseException:
            self.close()
            raise
        self.last = None

    def set_hyper(self, gi, name, value):
        _lib.check(self.lib.zopt_optimizer_set_hyper(self.h, gi, name.encode(),
                                                     float(value)), f"set_hyper {name}")

    @property
    def loss_scale(self):
        s = ctypes.c_double()
        _lib.check(self.lib.zopt_optimizer_get_loss_scale(self.h, ctypes.byref(s)), "scale")
        return s.value

    def step(self):
        r = _lib.StepResult()
        _lib.check(self.lib.zopt_optimizer_step(self.h, ctypes.byref(r)), "step")
        if self.step_obj.zero3:
            _lib.check(self.lib.zopt_optimizer_gather_params(self.h, 0, len(self.params),
                                                             None), "gather_params")
        self.last = r
        return r

    def step_count(self, gi):
        c = ctypes.c_int64()
        _lib.check(self.lib.zopt_optimizer_get_step_count(self.h, gi, ctypes.byref(c)),
                   "step_count")
        return c.value

    def read(self, i, kind):
        """Stored values (float64) of a state; the param from user memory."""
        if kind == "param":
            return from_storage(self.params[i], self.pdt).astype(np.float64)
        n = self.params[i].size
        out = np.empty(n, dtype=np.float32)
        _lib.check(self.lib.zopt_optimizer_read_state_f32(
            self.h, i, int(_lib.StateKind[kind.upper()]), out.ctypes.data, n),
            f"read_state {kind}")
        return out.astype(np.float64)

    def close(self):
        if self.h is not None and self.h.value:
            self.lib.zopt_optimizer_free(self.h)
        self.h = None

    def __del__(self):
        self.close()


_DT = {"f32": _lib.DType.F32, "bf16": _lib.DType.BF16, "f16": _lib.DType.F16}


def _hyper_values(r, group):
    if group == 0:
        return dict(lr=r.uniform(0.02, 0.08), beta1=r.uniform(0.7, 0.88),
                    beta2=r.uniform(0.9, 0.99), eps=r.uniform(1e-3, 1e-2),
                    weight_decay=r.uniform(0.05, 0.2), momentum=r.uniform(0.6, 0.9),
                    dampening=r.uniform(0.1, 0.3), bias_correction=True)
    return dict(lr=r.uniform(0.005, 0.03), beta1=r.uniform(0.8, 0.95),
                beta2=r.uniform(0.95, 0.995), eps=r.uniform(1e-3, 3e-2),
                weight_decay=r.uniform(0.0, 0.1), momentum=r.uniform(0.3, 0.95),
                dampening=r.uniform(0.0, 0.5), bias_correction=r.random() < 0.5)


def _fmt_elem(arr, j):
    return f"{float(arr[j])!r}"


def raw_grad_reads(prog):
    """True when a loss-scaled program reads the grad state other than
    through zopt.unscale (see finding F1 in docs/TESTING.md)."""
    if not prog.loss_scaled:
        return False
    g = prog.states["grad"]["ssa"]
    return any(g in o.operands for o in prog.ops if o.name != "unscale")


def run_and_compare(text, prog, so, seed, stats, allow_known=False):
    """Runs 3 steps of the compiled step and of the interpreter; raises
    Mismatch with a precise report on the first difference."""
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    step = zopt.Step(so)
    pdt = prog.states["param"]["dtype"]
    gdt = prog.states["grad"]["dtype"]
    sizes = [[r.choice(SIZES) for _ in range(r.randint(1, 3))] for _ in range(2)]
    slots = prog.defaults()
    used = prog.used_slots()
    have = set(step.hypers)
    missing = used - have
    if missing:
        raise Mismatch(f"the step.so has no slot for {sorted(missing)} (the description "
                       f"uses them; its slots: {sorted(have)})")
    for k in sorted(have & set(slots)):
        d = step.hypers[k][0]
        if k in used and not (d == slots[k] or (math.isnan(d) and math.isnan(slots[k]))):
            raise Mismatch(f"slot {k}: the step.so's default is {d!r}, the "
                           f"description's {slots[k]!r}")
    if step.loss_scaled != prog.loss_scaled:
        raise Mismatch(f"step.so loss_scaled={step.loss_scaled}, description "
                       f"{prog.loss_scaled}")
    hv = [_hyper_values(r, 0), _hyper_values(r, 1)]
    settable = sorted(have & set(slots))
    gh = []
    for gi in range(2):
        h = {}
        for k in settable:
            if gi == 0 or r.random() < 0.5:
                h[k] = hv[gi][k]
        gh.append(h)
    cgroups, igroups = [], []
    for gi, szs in enumerate(sizes):
        cp, ip = [], []
        for n in szs:
            p = to_storage(never_zero(rng, n), pdt)
            g = to_storage(never_zero(rng, n), gdt)
            cp.append((p, g))
            ip.append(from_storage(p, pdt))
        cgroups.append(dict(params=cp, **gh[gi]))
        igroups.append(dict(params=ip, **gh[gi]))
    scaler = dict(init_scale=1024.0) if prog.loss_scaled else None
    opt = CRunner(step, cgroups, gdt, loss_scaler=scaler)
    try:
        return _run(opt, prog, igroups, gh, gdt, scaler, r, rng, stats, allow_known)
    finally:
        opt.close()


def _run(opt, prog, igroups, gh, gdt, scaler, r, rng, stats, allow_known):
    grads = opt.grads
    it = interp.Interpreter(prog, igroups, loss_scaler=scaler)
    alt = None
    if allow_known and raw_grad_reads(prog):
        alt = interp.Interpreter(prog, igroups, loss_scaler=scaler, grad_reads_unscaled=True)
    inject = prog.loss_scaled and r.random() < 0.5
    kinds = [k for k in prog.states if k != "grad"]
    known = None
    for s, scale in enumerate(GRAD_SCALES):
        S = opt.loss_scale if prog.loss_scaled else 1.0
        if prog.loss_scaled and S != it.scaler.scale:
            raise Mismatch(f"step {s}: loss scale {S} vs the interpreter's {it.scaler.scale}")
        g64 = []
        for gi_, gt in enumerate(grads):
            x = to_storage(never_zero(rng, gt.size, scale, floor=0.05) * S, gdt)
            if inject and s == 1 and gi_ == len(grads) - 1:
                x[x.size // 2] = to_storage(np.array([np.inf]), gdt)[0]
            gt[...] = x
            g64.append(from_storage(x, gdt))
        if "lr" in gh[0]:
            lr = gh[0]["lr"] * (1.0 + 0.4 * s)
            opt.set_hyper(0, "lr", lr)
            it.groups[0]["lr"] = lr
            if alt:
                alt.groups[0]["lr"] = lr
        pre = {(i, k): it.state(i, k).copy() for i in range(len(grads)) for k in kinds}
        cres = opt.step()
        res = it.step(g64)
        ares = alt.step(g64) if alt else None
        stats["steps"] += 1
        if bool(cres.skipped) != res["skipped"]:
            raise Mismatch(f"step {s}: skipped={bool(cres.skipped)}, the interpreter says "
                           f"{res['skipped']}")
        stats["skipped_steps"] += res["skipped"]
        for gi in range(2):
            if opt.step_count(gi) != it.step_count(gi):
                raise Mismatch(f"step {s}: group {gi} step count {opt.step_count(gi)} vs "
                               f"{it.step_count(gi)}")
        n = cres.grad_norm
        if not res["skipped"] and (prog.clip is not None or prog.loss_scaled):
            ok = abs(n - res["norm"]) <= 2 * res["norm_err"] + 1e-9 * abs(res["norm"]) \
                or (math.isinf(n) and math.isinf(res["norm"]))
            if not ok and not (alt and abs(n - ares["norm"]) <= 2 * ares["norm_err"]
                               + 1e-9 * abs(ares["norm"])):
                raise Mismatch(f"step {s}: grad norm {n!r} vs the interpreter's "
                               f"{res['norm']!r} (+- {res['norm_err']:.3g})")
        elif not prog.clip and not prog.loss_scaled and not math.isnan(n):
            raise Mismatch(f"step {s}: grad norm {n!r} without a reduction (NaN expected)")
        actual = {(i, k): opt.read(i, k) for i in range(len(grads)) for k in kinds}
        bad = _compare(it, actual, kinds, stats)
        if bad and alt is not None and not _compare(alt, actual, kinds, Counter()):
            known = "F1"
            bad = None
        if bad:
            i, k, j, y, lo, hi, a = bad
            err = it.error_bound(i, k)[j]
            gi = it.tensors[i].group
            ctx = ", ".join(f"{kk}={_fmt_elem(pre[(i, kk)], j)}" for kk in kinds)
            raise Mismatch(
                f"step {s + 1} (t={it.step_count(gi)}), tensor {i} (group {gi}, "
                f"n={it.tensors[i].n}), state {k} ({prog.states[k]['dtype']}, "
                f"{prog.states[k]['rounding']}), element {j}: zopt {a!r}, interpreter "
                f"{y!r} (allowed [{lo!r}, {hi!r}], f32 error bound {err:.3g}); inputs: "
                f"{ctx}, grad={g64[i][j]!r}; group hypers {it.groups[gi]}; "
                f"norm {res['norm']!r} clip coef {res['clip_coef']!r}")
        for (i, k), a in actual.items():
            it.set_state(i, k, a)
            if alt:
                alt.set_state(i, k, a)
    return known


def _compare(it, actual, kinds, stats):
    for (i, k), a in actual.items():
        y, lo, hi = it.expected(i, k)
        err = it.error_bound(i, k)
        checked = np.isfinite(err)
        with np.errstate(invalid="ignore"):
            ok = ((a >= lo) & (a <= hi)) | (np.isnan(a) & np.isnan(y)) | \
                 (np.isinf(a) & (a == y))
        bad = ~ok & checked
        stats["elements"] += int(checked.sum())
        stats["unchecked"] += int((~checked).sum())
        stats["exact"] += int(((a == y) | (np.isnan(a) & np.isnan(y)))[checked].sum())
        if bad.any():
            j = int(np.argmax(bad))
            return (i, k, j, y[j], lo[j], hi[j], a[j])
    return None


# ---------------------------------------------------------------------------
# The oracle itself: the interpreter agrees with oracles.reference
# ---------------------------------------------------------------------------

def _reference_case(kw, seed, inject=False):
    text = describe(**kw)
    prog = interp.parse(text)
    rng = np.random.default_rng(seed)
    pg, _, _, ls = layout_types(kw["layout"], kw.get("state_dtype"))
    sizes = [[3, 17], [1, 33]]
    params = [[round_to(never_zero(rng, n), pg) for n in s] for s in sizes]
    hyp = [dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, momentum=0.85,
                dampening=0.0 if kw.get("nesterov") else 0.2, bias_correction=True),
           dict(lr=0.02, betas=(0.9, 0.99), eps=1e-2, weight_decay=0.05, momentum=0.7,
                dampening=0.0, bias_correction=False)]
    slots = prog.defaults()
    groups = [dict(params=p, **h) for p, h in zip(params, hyp)]
    igroups = [{k: v for k, v in g.items()
                if k in ("params",) or k in slots or (k == "betas" and "beta1" in slots)}
               for g in groups]
    scaler = dict(init_scale=1024.0) if ls else None
    ref = Reference(kw["rule"], groups, amsgrad=kw.get("amsgrad", False),
                    nesterov=kw.get("nesterov", False),
                    momentum_buffer=kw.get("momentum", True), layout=kw["layout"],
                    state_dtype=kw.get("state_dtype"), clip=kw.get("clip"),
                    loss_scaler=scaler)
    it = interp.Interpreter(prog, igroups, loss_scaler=scaler)
    for s in range(5):
        S = ref.scaler.scale if ls else 1.0
        gs = [round_to(never_zero(rng, t.n, (1.0, 0.01)[s % 2]) * S, pg) for t in it.tensors]
        if inject and s == 2:
            gs[1][0] = np.inf
        rn, rskip, rcoef = ref.step(gs)
        res = it.step(gs)
        assert rskip == res["skipped"], (kw, s)
        if not rskip and (kw.get("clip") or ls):
            assert res["norm"] == pytest.approx(rn, rel=1e-13), (kw, s)
            assert res["clip_coef"] == pytest.approx(rcoef, rel=1e-13), (kw, s)
        for i in range(len(it.tensors)):
            for k in it.written_kinds():
                a, b = it.state(i, k), ref.state(i, k)
                assert np.array_equal(a, b), (kw, s, i, k, np.max(np.abs(a - b)))
                y, lo, hi = it.expected(i, k)
                assert np.all((lo <= y) & (y <= hi)), (kw, s, i, k)
    return text


MATRIX = _matrix()


def test_interpreter_matches_reference():
    """The oracle is trustworthy: for every layout and rule of the named
    matrix (zopt.describe: adam/adamw with and without amsgrad, named and
    primitive forms, sgd plain/momentum/nesterov, lion with f32 and bf16
    momentum, x 4 layouts x clip on/off), the interpreter of the
    description's text and oracles.reference agree bit for bit (both float64,
    both rounding to storage) over 5 steps, 2 groups (bias correction on
    and off), the loss-scaled layout included."""
    for n, kw in enumerate(MATRIX):
        _reference_case(kw, 1000 + n)


def test_interpreter_skip_matches_reference():
    """A non-finite loss-scaled gradient skips the step in both (no state
    change, no step count, the scaler backs off)."""
    for rule in RULES:
        _reference_case(dict(rule=rule, layout="f16_loss_scale", clip=1.0), 7, inject=True)
        _reference_case(dict(rule=rule, layout="f16_loss_scale"), 8, inject=True)


def test_interpreter_refuses_what_it_cannot_model():
    src = describe(rule="adamw")
    with pytest.raises(interp.Unmodelled):
        interp.parse(src.replace("zopt.adam", '"zopt.adam"', 1))
    with pytest.raises(interp.Unmodelled):
        interp.parse(src.replace("{decoupled}", "{decoupled, fancy}"))
    with pytest.raises(interp.DescriptionError):
        interp.parse(src.replace("%m1, %v1 into", "%m1, %undefined into"))


CLIP_MOMENTUM = """zopt.step @clip_momentum {
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %buf = zopt.state momentum_buffer : f32 on cpu
  %lr = zopt.hyper lr
  %mu = zopt.hyper momentum
  %damp = zopt.hyper dampening
  %b1 = zopt.momentum %buf, %g, %mu, %damp : f32, f32
  %c = zopt.clip_by_global_norm %b1 max 100.0 : f32
  %p1 = zopt.apply %p, %c, %lr : f32, f32
  zopt.yield %p1, %b1 into %p, %buf : f32, f32 into f32, f32
}
"""


def test_interpreter_norm_pass_sees_the_step():
    """The global norm is taken with the step being taken: a clipped
    momentum buffer is the gradient at t = 1 (found by the property test:
    the interpreter's norm pass ran with the previous step count)."""
    it = interp.Interpreter(interp.parse(CLIP_MOMENTUM),
                            [dict(params=[np.zeros(4)], momentum=0.9, dampening=0.5)])
    g1, g2 = np.ones(4), np.full(4, 2.0)
    assert it.step([g1])["norm"] == pytest.approx(2.0, rel=1e-15)
    assert it.step([g2])["norm"] == pytest.approx(np.linalg.norm(0.9 * g1 + 0.5 * g2),
                                                  rel=1e-15)
    assert it.step_count(0) == 2


def test_interpreter_bounds_reject_wrong_formulas():
    """The comparison is tight enough to see a slightly wrong rule: the
    results of an interpreter with beta1 0.9 -> 0.9001, beta2 0.99 ->
    0.9901, eps +1%, lr +1e-4 relative or a weight decay of 1e-4 fall
    outside the intervals (f32 storage) of the right rule's results
    for most elements of the state they affect."""
    text = describe(rule="adamw", layout="f32")
    prog = interp.parse(text)
    rng = np.random.default_rng(3)
    p = [never_zero(rng, 50)]
    g = [never_zero(rng, 50)]
    base = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-3)
    it = interp.Interpreter(prog, [dict(params=p, **base)])
    it.step(g)
    for wrong, kind in ((dict(betas=(0.9001, 0.99)), "exp_avg"),
                        (dict(betas=(0.9, 0.9901)), "exp_avg_sq"),
                        (dict(eps=1.01e-3), "param"), (dict(lr=0.05 * (1 + 1e-4)), "param"),
                        (dict(weight_decay=1e-4), "param")):
        y, lo, hi = it.expected(0, kind)
        w = interp.Interpreter(prog, [dict(params=p, **dict(base, **wrong))])
        w.step(g)
        yw = w.state(0, kind)
        assert np.mean((yw < lo) | (yw > hi)) > 0.4, (wrong, kind)


# ---------------------------------------------------------------------------
# Findings of the property test (docs/TESTING.md), as minimal reproducers
# ---------------------------------------------------------------------------

F1_TEXT = """zopt.step @raw_grad_read {
  %p = zopt.state param : f16 on cpu
  %g = zopt.state grad : f16 on cpu
  %w = zopt.state master : f32 on cpu
  %m = zopt.state exp_avg : f32 on cpu
  %v = zopt.state exp_avg_sq : f32 on cpu
  %lr = zopt.hyper lr
  %b1 = zopt.hyper beta1
  %b2 = zopt.hyper beta2
  %eps = zopt.hyper eps
  %gs = zopt.unscale %g : f16
  %m1 = zopt.ema %m, %g, %b1 : f32, f16
  %v1 = zopt.ema_sq %v, %gs, %b2 : f32, f32
  %u = zopt.adam_direction %m1, %v1, %b1, %b2, %eps : f32, f32
  %w1 = zopt.apply %w, %u, %lr : f32, f32
  zopt.yield %w1, %m1, %v1, %w1 into %w, %m, %v, %p : f32, f32, f32, f32 into f32, f32, f32, f16
}
"""


def _refused_or_matches(text, tmp_path):
    try:
        so = zopt.compile(text, out_path=str(tmp_path / "step.so"))
    except zopt.ZoptError as e:
        assert check_diagnostic(text, str(e)) is None, str(e)
        return
    prog = interp.parse(text)
    run_and_compare(text, prog, so, 1, Counter(), allow_known=False)


def test_finding_f1_raw_grad_read_in_loss_scaled_step(zopt_bins, tmp_path):
    """F1 (fixed): in a loss-scaled step a read of the grad other than
    through zopt.unscale got the unscaled gradient (the plan multiplies every
    read by 1/(S*D)) while the dialect says %g is the loss-scaled value; the
    verifier now refuses such a read, pointing at it."""
    with pytest.raises(zopt.ZoptError) as ei:
        zopt.compile(F1_TEXT, out_path=str(tmp_path / "step.so"))
    assert check_diagnostic(F1_TEXT, str(ei.value)) is None, str(ei.value)
    assert "reads the loss-scaled gradient directly" in str(ei.value)


F2_TEXT = open(os.path.join(ROOT, "examples", "adamw_bf16_master.mlir")).read().replace(
    "max 1.0 : bf16", "max 1.0 {max_norm = 100.0} : bf16")


F2_MORE = [
    ("%b2 = zopt.hyper beta2", "%b2 = zopt.hyper beta2 default 0.99 {default_value = 0.5}"),
    ("%m = zopt.state exp_avg : f32 on cpu",
     "%m = zopt.state exp_avg : f32 on cpu {kind = #zopt<state_kind momentum_buffer>}"),
    ("attributes {zero_stage = 0 : i64}", "attributes {zero_stage = 0 : i64, sym_name = \"b\"}"),
]


def test_finding_f2_restated_attribute(zopt_bins, tmp_path):
    """F2 (fixed): an op's attribute dictionary restating an attribute its
    syntax gives won over the syntax (clipped at 100 instead of 1.0); it is
    refused now, pointing at the restated key."""
    base = open(os.path.join(ROOT, "examples", "adamw_bf16_master.mlir")).read()
    texts = [F2_TEXT] + [base.replace(a, b) for a, b in F2_MORE if a in base]
    assert len(texts) >= 3
    for text in texts:
        assert text != base
        with pytest.raises(zopt.ZoptError) as ei:
            zopt.compile(text, out_path=str(tmp_path / "step.so"))
        assert check_diagnostic(text, str(ei.value)) is None, str(ei.value)
        assert "from its syntax" in str(ei.value), str(ei.value)


# ---------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def summary(request):
    stats = Counter()
    t0 = time.perf_counter()
    yield stats
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    dt = time.perf_counter() - t0
    lines = [
        f"zopt property test: {stats['tried']} mutants ({stats['distinct']} distinct) in {dt:.1f} s: "
        f"{stats['refused']} refused with a located diagnostic, "
        f"{stats['matched']} accepted and matched the interpreter "
        f"({stats['steps']} steps, {stats['skipped_steps']} skipped as non-finite; "
        f"{stats['elements']} elements checked, {stats['exact']} bit-identical, "
        f"{stats['unchecked']} ambiguous), "
        f"{stats['compile_only']} accepted GPU/offload (compiled only), "
        f"{stats['unmodelled']} skipped (unmodelled), "
        f"{stats['known']} known findings (xfail), {stats['failed']} failed; "
        f"{stats['warned']} compiled with warnings"]
    for k in sorted(stats):
        if k.startswith("unmodelled:") or k.startswith("known:"):
            lines.append(f"  {k}: {stats[k]}")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line("")
            for ln in lines:
                tr.write_line(ln)
    else:
        print("\n".join(lines))


def test_mutants(zopt_bins, summary, tmp_path):
    srcs = sources()
    for name, text in srcs:   # the sources themselves are valid and modelled
        interp.parse(text)
    failures = []
    seen = {}
    for case in range(CASES):
        seed = 0x5EED0000 + SEED * 1000003 + case
        r = random.Random(seed)
        name, src = srcs[r.randrange(len(srcs))]
        text, labels = mutate(src, r)
        what = f"case {case} (seed {seed:#x}) from {name}: {'; '.join(labels)}"
        summary["tried"] += 1
        h = hashlib.sha256(text.encode()).hexdigest()[:16]
        if h in seen:
            outcome = seen[h]
        else:
            summary["distinct"] += 1
            outcome = one_mutant(text, seed, tmp_path / f"{h}.so", summary)
            seen[h] = outcome
        kind, detail = outcome
        summary[kind] += 1
        if kind == "unmodelled":
            summary["unmodelled:" + detail.split(":")[0][:60]] += 1
        if kind == "known":
            summary["known:" + detail] += 1
        if kind == "failed":
            failures.append((what, detail, text))
    if failures:
        pytest.fail(f"{len(failures)} of {CASES} mutants failed:\n"
                    + "\n".join(f"* {w}\n  {d[:400]}" for w, d, _ in failures)
                    + "\n\nThe first ones in full:\n\n"
                    + "\n\n".join(f"{w}\n  {d}\n--- description ---\n{t}"
                                    for w, d, t in failures[:5]), pytrace=False)


def one_mutant(text, seed, out, stats):
    """-> (outcome, detail): refused / matched / compile_only / unmodelled /
    known / failed."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always", CompileWarning)
        try:
            so = zopt.compile(text, out_path=str(out), timeout=COMPILE_TIMEOUT)
        except zopt.ZoptError as e:
            problem = check_diagnostic(text, str(e))
            if problem:
                return "failed", f"refused without a proper diagnostic: {problem}:\n{e}"
            return "refused", ""
    if any(issubclass(x.category, CompileWarning) for x in w):
        stats["warned"] += 1
    try:
        prog = interp.parse(text)
    except interp.Unmodelled as e:
        return "unmodelled", str(e)
    except interp.RestatedAttribute:
        return "failed", ("accepted an attribute dictionary that restates what the syntax "
                          "gives (finding F2, fixed: the compiler refuses it)")
    except interp.DescriptionError as e:
        return "failed", f"accepted, but the interpreter reads it as invalid: {e}"
    if not prog.cpu_only:
        return "compile_only", ""
    try:
        known = run_and_compare(text, prog, so, seed, stats)
    except interp.Unmodelled as e:
        return "unmodelled", str(e)
    except Mismatch as e:
        return "failed", f"accepted, mismatch: {e}"
    except zopt.ZoptError as e:
        return "failed", f"accepted, but running it failed: {e}"
    if known:
        return "known", known
    return "matched", ""

"""Prints the zopt_step_descriptor that zopt-emit-descriptor wrote.

Reads zopt-opt's output on stdin, finds the exported constant
`@zopt_step_descriptor("...")`, undoes MLIR's string escapes and reads the
bytes through python/zopt/_lib.py's ctypes mirror of abi.h (whose size must
be the constant's), recomputing abi.h's checksum. argv[1]: the repository.
"""
import ctypes
import importlib.util
import os
import re
import sys

spec = importlib.util.spec_from_file_location(
    "zopt_lib", os.path.join(sys.argv[1], "python", "zopt", "_lib.py"))
lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lib)


def unescape(s):
    """MLIR prints a string's bytes as themselves or as \\XX (hex)."""
    raw, i = bytearray(), 0
    while i < len(s):
        if s[i] == "\\":
            raw.append(int(s[i + 1:i + 3], 16))
            i += 3
        else:
            raw += s[i].encode("latin-1")
            i += 1
    return raw


def show(raw):
    if len(raw) != ctypes.sizeof(lib.StepDescriptor):
        sys.exit("descriptor is %d bytes; _lib.StepDescriptor is %d"
                 % (len(raw), ctypes.sizeof(lib.StepDescriptor)))
    d = lib.StepDescriptor.from_buffer_copy(bytes(raw))

    off = lib.StepDescriptor.checksum.offset
    h = 14695981039346656037
    for j, c in enumerate(raw):
        if off <= j < off + 8:
            c = 0
        h = ((h ^ c) * 1099511628211) % (1 << 64)
    print("magic %s abi %d size %d checksum %s" % (
        bytes(d.magic).decode(), d.abi_version, d.size,
        "ok" if h == d.checksum else "BAD"))
    print("name %s stage %d align %d flags %d max_norm %g coeffs %d" % (
        d.name.decode(), d.zero_stage, d.align, d.flags, d.max_norm, d.num_coeffs))
    for j in range(d.num_states):
        x = d.states[j]
        print("state %d: kind %d dtype %d placement %d rounding %d init %d "
              "access %d flags %d" % (j, x.kind, x.dtype, x.placement, x.rounding,
                                      x.init, x.access, x.flags))
    for j in range(d.num_hypers):
        x = d.hypers[j]
        print("hyper %d: kind %d default %g min %g max %g exclusive %d" % (
            j, x.kind, x.default_value, x.min_value, x.max_value, x.max_exclusive))
    for j in range(d.num_kernels):
        x = d.kernels[j]
        print("kernel %d: role %d isa %d device %d %s" % (
            j, x.role, x.isa, x.device, x.symbol.decode()))
    for j in range(d.num_program):
        x = d.program[j]
        print("program %d: code %d state %d range %d dtype %d accum %d src %d "
              "dst %d flags %d" % (j, x.code, x.state, x.range, x.dtype, x.accum,
                                   x.src, x.dst, x.flags))


found = re.findall(r'@zopt_step_descriptor\("((?:[^"\\]|\\[0-9A-Fa-f]{2})*)"\)',
                   sys.stdin.read())
if not found:
    sys.exit("no @zopt_step_descriptor constant in the input")
for text in found:
    show(unescape(text))

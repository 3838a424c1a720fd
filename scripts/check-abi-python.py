#!/usr/bin/env python3
"""Checks python/zopt/_lib.py's copies of the C API's values against the
headers (runtime/include/zopt/*.h), so that a value changed on one side only
fails the build (CMakeLists.txt, target zopt-check-abi-python) and lit
(test/ABI/python-constants.test). The compiler's copies (the .td enums) are
checked by static_asserts in lib/Target/Descriptor/AbiCheck.cpp.

  check-abi-python.py HEADER_DIR LIB_PY

Rules:
  - every module-level integer constant NAME of _lib.py equals the C macro
    or enumerator ZOPT_NAME;
  - every IntEnum class of _lib.py mirrors one C enum: the same members
    (ZOPT_<PREFIX><NAME>), the same values, none missing on either side.
Prints one line per checked value family and exits 0; else prints every
mismatch and exits 1.
"""
import enum
import importlib.util
import os
import re
import sys

# Python IntEnum class -> (C enum type, prefix of its members' names).
ENUMS = {
    "Status": ("zopt_status", "ZOPT_ERR_"),
    "DType": ("zopt_dtype", "ZOPT_DTYPE_"),
    "Placement": ("zopt_placement", "ZOPT_PLACE_"),
    "StateKind": ("zopt_state_kind", "ZOPT_STATE_"),
    "Rounding": ("zopt_rounding", "ZOPT_ROUND_"),
    "StateInit": ("zopt_state_init", "ZOPT_INIT_"),
    "HyperKind": ("zopt_hyper_kind", "ZOPT_HYPER_"),
    "Global": ("zopt_global", "ZOPT_GLOBAL_"),
    "KernelRole": ("zopt_kernel_role", "ZOPT_KERNEL_"),
    "Isa": ("zopt_isa", "ZOPT_ISA_"),
    "OpCode": ("zopt_op_code", "ZOPT_OP_"),
    "Range": ("zopt_range", "ZOPT_RANGE_"),
}


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def c_int(token, values):
    token = token.strip()
    m = re.fullmatch(r"\(?\s*(-?(?:0x[0-9A-Fa-f]+|\d+))[uUlL]*\s*\)?", token)
    if m:
        return int(m.group(1), 0)
    return values.get(token)  # an alias of another name, or not an integer


def parse_headers(header_dir):
    """All integer macros and enumerators, and each enum's members."""
    values, enums = {}, {}
    for name in sorted(os.listdir(header_dir)):
        if not name.endswith(".h"):
            continue
        with open(os.path.join(header_dir, name)) as f:
            text = strip_comments(f.read())
        for m in re.finditer(r"^\s*#\s*define\s+(ZOPT_\w+)\s+(\S[^\n]*)$", text, re.M):
            v = c_int(m.group(2), values)
            if v is not None:
                values[m.group(1)] = v
        for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*\w+\s*;", text, re.S):
            members, nxt = {}, 0
            for item in m.group(2).split(","):
                item = item.strip()
                if not item:
                    continue
                key, _, val = item.partition("=")
                key = key.strip()
                v = c_int(val, values) if val else nxt
                if v is None:
                    sys.exit("%s: cannot read the value of %s" % (name, key))
                alias = bool(val) and val.strip() in values
                values[key] = v
                members[key] = (v, alias)
                nxt = v + 1
            enums[m.group(1)] = members
    return values, enums


def load_lib(path):
    spec = importlib.util.spec_from_file_location("zopt_lib_checked", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # _lib.py loads the runtime lazily
    return mod


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    values, enums = parse_headers(sys.argv[1])
    lib = load_lib(sys.argv[2])
    errors, checked = [], []
    where = os.path.basename(sys.argv[2])

    for name, v in sorted(vars(lib).items()):
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or type(v) is not int:
            continue
        c = "ZOPT_" + name
        if c not in values:
            errors.append("%s: %s = %d has no counterpart %s in the headers"
                          % (where, name, v, c))
        elif values[c] != v:
            errors.append("%s: %s = %d, but %s is %d" % (where, name, v, c, values[c]))
        else:
            checked.append(name)

    for name, cls in sorted(vars(lib).items()):
        if not (isinstance(cls, type) and issubclass(cls, enum.IntEnum)
                and cls.__module__ == lib.__name__):
            continue
        if name not in ENUMS:
            errors.append("%s: IntEnum %s mirrors no known C enum: add it to "
                          "ENUMS in %s" % (where, name, os.path.basename(__file__)))
            continue
        ctype, prefix = ENUMS[name]
        if ctype not in enums:
            errors.append("the headers have no enum %s (for %s.%s)" % (ctype, where, name))
            continue
        cmembers = {k: v for k, (v, alias) in enums[ctype].items() if not alias}
        py = {}
        for e in cls:
            c = prefix + e.name
            if c not in cmembers and "ZOPT_" + e.name in cmembers:
                c = "ZOPT_" + e.name  # ZOPT_OK
            py[c] = (e.name, int(e))
            if c not in cmembers:
                errors.append("%s: %s.%s = %d has no counterpart in %s"
                              % (where, name, e.name, int(e), ctype))
            elif cmembers[c] != int(e):
                errors.append("%s: %s.%s = %d, but %s is %d"
                              % (where, name, e.name, int(e), c, cmembers[c]))
        for c, v in sorted(cmembers.items()):
            if c not in py:
                errors.append("%s: %s lacks %s = %d (enum %s)" % (where, name, c, v, ctype))
        checked.append("%s (%d members)" % (name, len(cls)))

    if errors:
        print("\n".join(errors), file=sys.stderr)
        print("python/zopt/_lib.py disagrees with runtime/include/zopt: %d "
              "mismatch(es)" % len(errors), file=sys.stderr)
        return 1
    print("%s matches the headers: %s" % (where, ", ".join(checked)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

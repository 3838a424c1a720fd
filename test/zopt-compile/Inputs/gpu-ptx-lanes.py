"""Per-element arithmetic of a GPU update kernel's vector and scalar paths.

  python3 gpu-ptx-lanes.py KERNEL.ptx ENTRY LANES

Splits the .entry ENTRY into basic blocks and counts its f32/f64
arithmetic instructions (fma, mul, add, sub, div, sqrt, neg, ...) per block.
The vector loop's block (the one with the most of them) must hold exactly
LANES times the scalar loop's block (the one with the fewest, non-zero) of
every kind: then each element gets the same operations on both paths (the
same FMA contractions too), so its result cannot depend on which path, i.e.
on the chunking or the pointers' alignment. Prints one line per kind and
"identical" or "DIFFERENT".
"""
import collections
import re
import sys

ptx, entry, lanes = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(ptx).read()
start = text.index(".entry " + entry + "(")
end = text.find(".entry ", start + 8)
body = text[start:end if end >= 0 else len(text)]
parts = re.split(r"\n(\$L__BB\d+_\d+):", body)
blocks = []
for i in range(1, len(parts), 2):
    c = collections.Counter()
    for op in re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", parts[i + 1], re.M):
        base = op.split(".")[0]
        if base in ("fma", "mul", "add", "sub", "div", "sqrt", "neg", "abs", "max", "min", "rcp") and (
                ".f32" in op or ".f64" in op):
            c[op] += 1
    if c:
        blocks.append(c)
vec = max(blocks, key=lambda c: sum(c.values()))
sca = min(blocks, key=lambda c: sum(c.values()))
ok = set(vec) == set(sca) and all(vec[k] == lanes * sca[k] for k in sca)
for k in sorted(set(vec) | set(sca)):
    print(f"{k}: vector {vec[k]} = {lanes} x scalar {sca[k]}" if vec[k] == lanes * sca[k]
          else f"{k}: vector {vec[k]} != {lanes} x scalar {sca[k]}")
print("identical" if ok else "DIFFERENT")
sys.exit(0 if ok else 1)

"""Writes the oversized descriptions of limits.test to stdout.

  deep N      a step whose attribute nests N brackets ([[[...]]])
  steps N     N zopt.step ops
  chain N     one step with N chained zopt.apply ops
"""
import sys

STEP = """zopt.step @s{i} {{
  %p = zopt.state param : f32 on cpu
  %g = zopt.state grad : f32 on cpu
  %lr = zopt.hyper lr
  %p1 = zopt.apply %p, %g, %lr : f32, f32
  zopt.yield %p1 into %p : f32 into f32
}}
"""


def main():
    mode, n = sys.argv[1], int(sys.argv[2])
    out = sys.stdout
    if mode == "deep":
        out.write("zopt.step @n attributes {a = " + "[" * n + "]" * n + "} {}\n")
    elif mode == "steps":
        for i in range(n):
            out.write(STEP.format(i=i))
    elif mode == "chain":
        out.write("zopt.step @chain {\n  %p = zopt.state param : f32 on cpu\n"
                  "  %g = zopt.state grad : f32 on cpu\n  %lr = zopt.hyper lr\n"
                  "  %x0 = zopt.apply %p, %g, %lr : f32, f32\n")
        for i in range(1, n):
            out.write(f"  %x{i} = zopt.apply %x{i-1}, %g, %lr : f32, f32\n")
        out.write(f"  zopt.yield %x{n-1} into %p : f32 into f32\n}}\n")
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

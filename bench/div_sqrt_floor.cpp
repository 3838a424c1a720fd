//===- div_sqrt_floor.cpp - the divider's floor under an Adam step --------===//
//
//   zopt-bench-divsqrt
//
// An Adam-family update does one VDIVPS and one VSQRTPS per vector of
// elements, correctly rounded (docs/NUMERICS.md: no approximate rcp/rsqrt),
// and both run in the one divider of port 0: their throughput is the floor
// of the UPDATE kernel whatever else it does (docs/benchmarks/cpu.md).
// Prints, in core cycles, the reciprocal throughput of VDIVPS and VSQRTPS
// on ymm and (where the CPU has AVX-512) zmm registers (8 independent
// instructions a loop iteration), of one DIV + one SQRT, and of one DIV + one
// SQRT beside K independent VPADDD (whether the rest of a loop hides behind
// the divider). The clock is measured by a chain of dependent 64-bit IMUL
// (3 cycles each on Intel and AMD cores since 2011).
//===----------------------------------------------------------------------===//
#include <cstdio>
#include <time.h>

namespace {

// This thread's CPU time: on a shared host the calibration and the
// measurement must count the same (running) time.
double now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

constexpr long kIters = 4000000;

double secondsPerCycle() {
  long x = 1;
  const double t = now();
  for (long i = 0; i < kIters * 4; ++i)
    __asm__ volatile("imul %0,%0\n\timul %0,%0\n\timul %0,%0\n\timul %0,%0\n\t"
                     "imul %0,%0\n\timul %0,%0\n\timul %0,%0\n\timul %0,%0"
                     : "+r"(x));
  return (now() - t) / (24.0 * kIters * 4);
}

#define DIV8(r)                                                                                    \
  "vdivps %%" r "1,%%" r "0,%%" r "2\n\tvdivps %%" r "1,%%" r "0,%%" r "3\n\t"                      \
  "vdivps %%" r "1,%%" r "0,%%" r "4\n\tvdivps %%" r "1,%%" r "0,%%" r "5\n\t"                     \
  "vdivps %%" r "1,%%" r "0,%%" r "6\n\tvdivps %%" r "1,%%" r "0,%%" r "7\n\t"                     \
  "vdivps %%" r "1,%%" r "0,%%" r "8\n\tvdivps %%" r "1,%%" r "0,%%" r "9\n\t"
#define SQRT8(r)                                                                                   \
  "vsqrtps %%" r "1,%%" r "2\n\tvsqrtps %%" r "1,%%" r "3\n\tvsqrtps %%" r "1,%%" r "4\n\t"        \
  "vsqrtps %%" r "1,%%" r "5\n\tvsqrtps %%" r "1,%%" r "6\n\tvsqrtps %%" r "1,%%" r "7\n\t"        \
  "vsqrtps %%" r "1,%%" r "8\n\tvsqrtps %%" r "1,%%" r "9\n\t"
#define DS(r) "vdivps %%" r "1,%%" r "0,%%" r "2\n\tvsqrtps %%" r "1,%%" r "3\n\t"
#define ADD4(r)                                                                                    \
  "vpaddd %%" r "1,%%" r "10,%%" r "10\n\tvpaddd %%" r "1,%%" r "11,%%" r "11\n\t"                \
  "vpaddd %%" r "1,%%" r "12,%%" r "12\n\tvpaddd %%" r "1,%%" r "13,%%" r "13\n\t"
#define ADD8(r)                                                                                    \
  ADD4(r) "vpaddd %%" r "1,%%" r "14,%%" r "14\n\tvpaddd %%" r "1,%%" r "15,%%" r "15\n\t"        \
          "vpaddd %%" r "1,%%" r "8,%%" r "8\n\tvpaddd %%" r "1,%%" r "9,%%" r "9\n\t"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                "xmm12", "xmm13", "xmm14", "xmm15"
// Cycles per loop iteration of `body` (divided by `per` instructions); the
// operands (register 0 / register 1, sqrt of register 1) are set in the same
// asm statement (two broadcasts from L1, off the divider's port).
#define RUN(name, per, r, body)                                                                    \
  do {                                                                                             \
    const double t = now();                                                                        \
    for (long i = 0; i < kIters; ++i)                                                              \
      __asm__ volatile("vbroadcastss %0,%%" r "0\n\tvbroadcastss %1,%%" r "1\n\t" body          \
                       ::"m"(a), "m"(b) : CLOBBER);                                                \
    std::printf("  %-34s %6.2f cycles\n", name, (now() - t) / kIters / spc / (per));               \
  } while (0)

} // namespace

int main() {
  // Normal operands: 1.7 / 1.3 and sqrt(1.3) (no subnormal slow path).
  const float a = 1.7f, b = 1.3f;
  const double spc = secondsPerCycle();
  std::printf("clock (dependent IMUL chain): %.2f GHz\n", 1e-9 / spc);
  RUN("ymm VDIVPS", 8, "ymm", DIV8("ymm"));
  RUN("ymm VSQRTPS", 8, "ymm", SQRT8("ymm"));
  RUN("ymm DIV + SQRT", 1, "ymm", DS("ymm"));
  RUN("ymm DIV + SQRT + 24 VPADDD", 1, "ymm", DS("ymm") ADD8("ymm") ADD8("ymm") ADD8("ymm"));
  RUN("ymm DIV + SQRT + 32 VPADDD", 1, "ymm", DS("ymm") ADD8("ymm") ADD8("ymm") ADD8("ymm") ADD8("ymm"));
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("  (no AVX-512: zmm not measured)\n");
    return 0;
  }
  RUN("zmm VDIVPS", 8, "zmm", DIV8("zmm"));
  RUN("zmm VSQRTPS", 8, "zmm", SQRT8("zmm"));
  RUN("zmm DIV + SQRT", 1, "zmm", DS("zmm"));
  RUN("zmm DIV + SQRT + 32 VPADDD", 1, "zmm", DS("zmm") ADD8("zmm") ADD8("zmm") ADD8("zmm") ADD8("zmm"));
  RUN("zmm DIV + SQRT + 40 VPADDD", 1, "zmm",
      DS("zmm") ADD8("zmm") ADD8("zmm") ADD8("zmm") ADD8("zmm") ADD8("zmm"));
  return 0;
}

/*===- zopt/cpu.h - which CPU kernel variants this processor runs -*- C -*-===*
 *
 * Header-only, shared by the runtime's loader and the tools that call step
 * kernels directly (zopt-kernel-check, the benchmarks), so that all of them
 * agree on what each zopt_isa (abi.h) needs. Reads CPUID and XCR0 itself:
 * an ISA counts only when the CPU has the instructions *and* the OS saves
 * the registers they use.
 *
 *===----------------------------------------------------------------------===*/
#ifndef ZOPT_CPU_H
#define ZOPT_CPU_H

#include "zopt/abi.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Nonzero when this CPU (and OS) can run kernels of variant `isa`. */
static inline int zopt_cpu_runs_isa(uint32_t isa) {
  if (isa == ZOPT_ISA_NONE)
    return 1;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d))
    return 0;
  const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1,
            f16c = (c >> 29) & 1;
  if (!osxsave || !avx)
    return 0;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  (void)xhi;
  if ((xlo & 0x6u) != 0x6u) /* XMM and YMM state */
    return 0;
  if (__get_cpuid_max(0, 0) < 7)
    return 0;
  __cpuid_count(7, 0, a, b, c, d);
  const int avx2 = (b >> 5) & 1;
  if (isa == ZOPT_ISA_AVX2)
    return avx2 && fma && f16c;
  const int avx512 = avx2 && fma && f16c && ((b >> 16) & 1) /* F */ &&
                     ((b >> 17) & 1) /* DQ */ && ((b >> 30) & 1) /* BW */ &&
                     ((b >> 31) & 1) /* VL */ &&
                     (xlo & 0xE0u) == 0xE0u; /* opmask, ZMM state */
  if (isa == ZOPT_ISA_AVX512)
    return avx512;
  if (isa == ZOPT_ISA_AVX512BF16) {
    __cpuid_count(7, 1, a, b, c, d);
    return avx512 && ((a >> 5) & 1); /* AVX512_BF16 */
  }
#endif
  return 0;
}

/* The best variant this CPU runs. */
static inline uint32_t zopt_cpu_best_isa(void) {
  uint32_t i = ZOPT_ISA_MAX;
  while (i > ZOPT_ISA_NONE && !zopt_cpu_runs_isa(i))
    --i;
  return i;
}

/* The name used by zopt-compile --cpu, ZOPT_CPU and the tools. */
static inline const char *zopt_isa_name(uint32_t isa) {
  switch (isa) {
  case ZOPT_ISA_NONE: return "none";
  case ZOPT_ISA_AVX2: return "avx2";
  case ZOPT_ISA_AVX512: return "avx512";
  case ZOPT_ISA_AVX512BF16: return "avx512bf16";
  }
  return "unknown";
}

/* Inverse of zopt_isa_name ("baseline" = "none"); -1 when unknown. */
static inline int zopt_isa_from_name(const char *s) {
  for (uint32_t i = ZOPT_ISA_NONE; i <= ZOPT_ISA_MAX; ++i)
    if (!strcmp(s, zopt_isa_name(i)))
      return (int)i;
  return strcmp(s, "baseline") ? -1 : (int)ZOPT_ISA_NONE;
}

#ifdef __cplusplus
}
#endif

#endif /* ZOPT_CPU_H */

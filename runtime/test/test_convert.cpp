// Exhaustive checks of the runtime's dtype conversions (internal API).
#include "internal.h"

#include <cmath>
#include <cstdio>
#include <immintrin.h>
#include <cpuid.h>

using namespace zopt;

static float bits_f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Reference f32 -> f16 with the hardware instruction (F16C), RNE.
__attribute__((target("f16c"))) static uint16_t hw_f16(float f) {
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

int main() {
  int fails = 0;
  // f16 -> f32 -> f16 and bf16 -> f32 -> bf16 round trips (all 65536 codes).
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32((uint16_t)h);
    bool nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff);
    if (!nan && f32_to_f16(f) != h) { if (fails++ < 10) printf("f16 roundtrip %04x\n", h); }
    if (nan && !std::isnan(f)) { if (fails++ < 10) printf("f16 nan %04x\n", h); }
    float b = bf16_to_f32((uint16_t)h);
    bool bnan = ((h >> 7) & 0xff) == 0xff && (h & 0x7f);
    if (!bnan && f32_to_bf16(b) != h) { if (fails++ < 10) printf("bf16 roundtrip %04x\n", h); }
    if (bnan && (!std::isnan(b) || !std::isnan(bf16_to_f32(f32_to_bf16(b))))) { if (fails++ < 10) printf("bf16 nan %04x\n", h); }
  }
  // f32 -> f16 against F16C over a dense sample of all f32 bit patterns.
  __builtin_cpu_init();
  unsigned ca, cb, cc, cd;
  bool f16c = __get_cpuid(1, &ca, &cb, &cc, &cd) && ((cc >> 29) & 1u);
  if (f16c) {
    for (uint64_t u = 0; u <= 0xffffffffull; u += 97) {
      float f = bits_f((uint32_t)u);
      uint16_t a = f32_to_f16(f), b = hw_f16(f);
      if (std::isnan(f)) {
        if (!std::isnan(hw_f16_to_f32(a))) { if (fails++ < 10) printf("f16 nan %08x\n", (unsigned)u); }
      } else if (a != b) {
        if (fails++ < 10) printf("f32->f16 %08x: %04x vs hw %04x\n", (unsigned)u, a, b);
      }
      if (!std::isnan(f) && hw_f16_to_f32(a) != f16_to_f32(a)) { if (fails++ < 10) printf("f16->f32 %04x\n", a); }
    }
  } else {
    printf("no F16C: hardware comparison skipped\n");
  }
  // f32 -> bf16 RNE: ties to even, NaN stays NaN, overflow to inf.
  struct { uint32_t in; uint16_t out; } bc[] = {
      {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81}, {0x7f7fffffu, 0x7f80},
      {0xff800000u, 0xff80}, {0x00000001u, 0x0000}, {0x80000000u, 0x8000}};
  for (auto &c : bc)
    if (f32_to_bf16(bits_f(c.in)) != c.out) { fails++; printf("bf16 %08x -> %04x\n", c.in, f32_to_bf16(bits_f(c.in))); }
  if (!std::isnan(bf16_to_f32(f32_to_bf16(bits_f(0x7f800001u))))) { fails++; printf("sNaN lost\n"); }
  // convert(): bf16 <-> f16 via f32.
  uint16_t src[3] = {0x3c00, 0x7bff, 0x0001}, dst[3];
  convert(src, ZOPT_DTYPE_F16, dst, ZOPT_DTYPE_BF16, 3);
  if (dst[0] != 0x3f80 || bf16_to_f32(dst[1]) != 65536.0f || bf16_to_f32(dst[2]) != bits_f(0x33800000u)) {
    fails++;
    printf("convert f16->bf16 %04x %04x %04x\n", dst[0], dst[1], dst[2]);
  }
  if (fails) {
    printf("%d failure(s)\n", fails);
    return 1;
  }
  printf("test_convert: all passed\n");
  return 0;
}

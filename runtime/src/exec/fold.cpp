// exec/fold.cpp - the rank-order sum of REDUCE_SCATTER (abi.h): W pieces of
// n elements added in f32 in rank order, ((x_0 + x_1) + x_2) + ..., and
// rounded to the storage dtype (nearest even; NaN stays a quiet NaN).
// Vectorized per ISA (target_clones): the same bits on every variant, since
// every operation is an exact widening, one f32 add per rank, or the
// integer rounding of common.cpp.
#include "exec/exec.h"

namespace zopt {
namespace exec {

namespace {

constexpr int64_t kBlock = 512;

inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void fold_bf16(int W, const uint16_t *const *src, uint16_t *dst, int64_t n) {
  float acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    const uint16_t *s0 = src[0] + i0;
    for (int64_t i = 0; i < m; ++i) acc[i] = bits_f32((uint32_t)s0[i] << 16);
    for (int q = 1; q < W; ++q) {
      const uint16_t *sq = src[q] + i0;
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] + bits_f32((uint32_t)sq[i] << 16);
    }
    uint16_t *d = dst + i0;
    for (int64_t i = 0; i < m; ++i) {
      uint32_t u = f32_bits(acc[i]);
      uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      uint32_t nan = (u >> 16) | 0x40u;
      d[i] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rne);
    }
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void fold_f32(int W, const float *const *src, float *dst, int64_t n) {
  float acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    for (int64_t i = 0; i < m; ++i) acc[i] = src[0][i0 + i];
    for (int q = 1; q < W; ++q) {
      const float *sq = src[q] + i0;
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] + sq[i];
    }
    memcpy(dst + i0, acc, (size_t)m * 4);
  }
}

}  // namespace

void fold(uint32_t dt, int W, const char *const *src, char *dst, int64_t n) {
  if (dt == ZOPT_DTYPE_F32) {
    fold_f32(W, (const float *const *)src, (float *)dst, n);
    return;
  }
  if (dt == ZOPT_DTYPE_BF16) {
    fold_bf16(W, (const uint16_t *const *)src, (uint16_t *)dst, n);
    return;
  }
  // f16: through the runtime's exact conversions, a block at a time.
  float acc[kBlock], tmp[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    convert(src[0] + i0 * 2, dt, acc, ZOPT_DTYPE_F32, m);
    for (int q = 1; q < W; ++q) {
      convert(src[q] + i0 * 2, dt, tmp, ZOPT_DTYPE_F32, m);
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] + tmp[i];
    }
    convert(acc, ZOPT_DTYPE_F32, dst + i0 * 2, dt, m);
  }
}

}  // namespace exec
}  // namespace zopt

//===- stream_roofline.h - the in-place stream roofline ------------------===//
//
// Header-only, shared by the main job (zopt-run) and the CPU benchmark
// (bench/zopt-bench-cpu), so that both hold a step against the same
// roofline: one pass over the step's arrays that reads what the step reads
// and writes back what it writes, with no math, interleaved per vector like
// the fused kernel. Call streamAvx512 on CPUs with AVX-512, else streamAvx2
// (or time both and take the faster), over [begin, end) elements.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_STREAM_ROOFLINE_H
#define ZOPT_STREAM_ROOFLINE_H

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace zopt_stream {

//===----------------------------------------------------------------------===//
// The in-place stream. Arrays are byte streams: an f32 array moves 4 bytes
// per element, a bf16/f16 array 2. Each iteration moves two registers'
// worth, 16 (AVX2) or 32 (AVX-512) elements, of every array, as the UPDATE
// kernels do (one register per iteration ran at 0.5-0.7 of the kernel on
// the 2026-11-26 host: a roofline the kernel beats is no roofline), in the
// kernel's order
// (reads, then read-writes, then writes):
//   read-only   XOR-accumulated in a register, written to a volatile sink at
//               the end, so no load can be removed;
//   read-write  x ^= opaque zero, stored back in place;
//   write-only  the opaque zero stored;
// so buffers keep their values and exactly the bytes the UPDATE kernel moves
// are moved; each array is also prefetched kPrefetchBytes ahead, every
// 64-byte line once (as the kernels do). (The first version folded reads in as
// `acc |= x & z` from acc = z, which the compiler reduced to acc = z by absorption, dropping
// every read-only load: that roofline moved fewer bytes than it counted and
// so read too high.) The arrays are sorted into per-class pointer lists
// first, so the hot loop holds no per-element access tests.
//===----------------------------------------------------------------------===//

struct Arr {
  uint8_t *p;
  int es;      // bytes per element
  bool rd, wr; // access in the UPDATE kernel
};

constexpr int kMaxArr = 16;
// Every array is prefetched this far ahead, as the compiled kernels do: on
// the hosts measured, hardware prefetch alone left one thread's stream well
// short of DRAM's rate, and a roofline the kernel beats is no roofline.
constexpr size_t kPrefetchBytes = 2048;
inline volatile uint32_t gReadSink; // keeps the read-only loads of the stream

// Class c of an array: 0 read-only, 1 read-write, 2 write-only; w: 0 = 4 bytes,
// 1 = 2 bytes, 2 = 1 byte.
struct Classes {
  uint8_t *p[3][3][kMaxArr];
  int n[3][3] = {};
  explicit Classes(const Arr *arr, int na) {
    for (int a = 0; a < na; ++a) {
      int c = !arr[a].wr ? 0 : arr[a].rd ? 1 : 2,
          w = arr[a].es == 4 ? 0 : arr[a].es == 2 ? 1 : 2;
      p[c][w][n[c][w]++] = arr[a].p;
    }
  }
};

#define ZOPT_STREAM_BODY(V32, V16, V8, L)                                               \
  const Classes k(arr, na);                                                             \
  V32 z32 = {}, acc32 = {};                                                             \
  V16 z16 = {}, acc16 = {};                                                             \
  V8 z8 = {}, acc8 = {};                                                                \
  z32 += uint32_t(mask); /* opaque zero: the compiler cannot prove it is zero */        \
  z16 += uint16_t(mask);                                                                \
  z8 += uint8_t(mask);                                                                  \
  size_t i = begin;                                                                     \
  for (; i + (L) <= end; i += (L)) {                                                    \
    for (int a = 0; a < na; ++a) /* every line, as the kernels do */                    \
      for (size_t o = 0; o < size_t(L) * arr[a].es; o += 64)                            \
        __builtin_prefetch(arr[a].p + i * arr[a].es + o + kPrefetchBytes);              \
    for (int a = 0; a < k.n[0][0]; ++a) { V32 x; std::memcpy(&x, k.p[0][0][a] + i * 4, sizeof x); acc32 ^= x; } \
    for (int a = 0; a < k.n[0][1]; ++a) { V16 x; std::memcpy(&x, k.p[0][1][a] + i * 2, sizeof x); acc16 ^= x; } \
    for (int a = 0; a < k.n[0][2]; ++a) { V8 x; std::memcpy(&x, k.p[0][2][a] + i, sizeof x); acc8 ^= x; } \
    V32 x32[kMaxArr]; V16 x16[kMaxArr]; V8 x8[kMaxArr]; /* all loads, then all stores */ \
    for (int a = 0; a < k.n[1][0]; ++a) std::memcpy(&x32[a], k.p[1][0][a] + i * 4, sizeof(V32)); \
    for (int a = 0; a < k.n[1][1]; ++a) std::memcpy(&x16[a], k.p[1][1][a] + i * 2, sizeof(V16)); \
    for (int a = 0; a < k.n[1][2]; ++a) std::memcpy(&x8[a], k.p[1][2][a] + i, sizeof(V8)); \
    for (int a = 0; a < k.n[1][0]; ++a) { x32[a] ^= z32; std::memcpy(k.p[1][0][a] + i * 4, &x32[a], sizeof(V32)); } \
    for (int a = 0; a < k.n[1][1]; ++a) { x16[a] ^= z16; std::memcpy(k.p[1][1][a] + i * 2, &x16[a], sizeof(V16)); } \
    for (int a = 0; a < k.n[1][2]; ++a) { x8[a] ^= z8; std::memcpy(k.p[1][2][a] + i, &x8[a], sizeof(V8)); } \
    for (int a = 0; a < k.n[2][0]; ++a) std::memcpy(k.p[2][0][a] + i * 4, &z32, sizeof z32); \
    for (int a = 0; a < k.n[2][1]; ++a) std::memcpy(k.p[2][1][a] + i * 2, &z16, sizeof z16); \
    for (int a = 0; a < k.n[2][2]; ++a) std::memcpy(k.p[2][2][a] + i, &z8, sizeof z8); \
  }                                                                                     \
  for (; i < end; ++i) /* tail: bytes */                                                \
    for (int a = 0; a < na; ++a)                                                        \
      if (arr[a].wr && !arr[a].rd) std::memset(arr[a].p + i * arr[a].es, int(mask), arr[a].es); \
  uint32_t s = 0;                                                                       \
  for (int e = 0; e < (L); ++e) s ^= acc32[e] ^ acc16[e] ^ acc8[e];                      \
  gReadSink = s;

typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v32u32 __attribute__((vector_size(128)));
typedef uint16_t v32u16 __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint8_t v32u8 __attribute__((vector_size(32)));

__attribute__((target("avx2,fma,f16c"), noinline)) inline void
streamAvx2(const Arr *arr, int na, size_t begin, size_t end, uint32_t mask) {
  ZOPT_STREAM_BODY(v16u32, v16u16, v16u8, 16)
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"), noinline)) inline void
streamAvx512(const Arr *arr, int na, size_t begin, size_t end, uint32_t mask) {
  ZOPT_STREAM_BODY(v32u32, v32u16, v32u8, 32)
}

#undef ZOPT_STREAM_BODY

} // namespace zopt_stream

#endif

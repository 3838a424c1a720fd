// zopt-bench-read-streams: does a thread reading K streams at once get more of
// the memory than one stream? (issue 19, the clip's norm pass; results in
// docs/benchmarks/cpu.md.) Over one buffer of N elements of E bytes, T
// threads (one contiguous part each), repetitions interleaved:
//   read1          one read stream per thread (what SUMSQ does today)
//   read2b/read4b  K adjacent norm blocks of B elements summed in one loop
//   read1pf4k      one stream prefetched 4 KiB ahead (read2b's lines in flight)
//   read2f/read4f  the thread's part cut in K runs, read side by side
//   sumsq1/sumsq2b the SUMSQ kernel's work (hand-written, AVX-512 only: not
//                  with --avx2) on one block per call, or two adjacent
//                  blocks per call; their partials are checked bit-equal
//   inplace        the in-place stream over the same buffer (read + write)
// Every read is an AVX-512 load XOR-accumulated (or AVX2), prefetched
// 2 KiB ahead, every 64-byte line, as the kernels and the roofline do.
// Prints each variant's median ms and GB/s (bytes moved / time).
// With --step STEP.so (--sumsq SYMBOL, an AVX-512 SUMSQ variant), two more
// rows: the step's SUMSQ kernel one block per call (kernel1) and its pair
// entry SYMBOL_x2 on two adjacent blocks (kernel2, abi.h "SUMSQ pairs"),
// every state pointer on the buffer, every coefficient 0.5.
//   zopt-bench-read-streams [--elems N] [--es 2|4] [--block B] [--threads T] [--reps R] [--avx2]
//                           [--step STEP.so --sumsq SYMBOL]
#include "zopt/abi.h"

#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kPf = 2048;
volatile uint64_t gSink;

// Reads K streams of `len` bytes each, starting at s[0..K), interleaved one
// 128-byte step of each per iteration.
template <int K, size_t Pf = kPf>
__attribute__((target("avx512f"))) void readK512(const uint8_t *const *s, size_t len) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  for (size_t o = 0; o + 128 <= len; o += 128) {
    for (int k = 0; k < K; ++k) {
      _mm_prefetch((const char *)s[k] + o + Pf, _MM_HINT_T0);
      _mm_prefetch((const char *)s[k] + o + Pf + 64, _MM_HINT_T0);
      a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(s[k] + o));
      a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(s[k] + o + 64));
    }
  }
  gSink = _mm512_reduce_add_epi64(_mm512_xor_si512(a0, a1));
}

template <int K, size_t Pf = kPf>
__attribute__((target("avx2"))) void readK256(const uint8_t *const *s, size_t len) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  for (size_t o = 0; o + 64 <= len; o += 64) {
    for (int k = 0; k < K; ++k) {
      _mm_prefetch((const char *)s[k] + o + Pf, _MM_HINT_T0);
      a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(s[k] + o)));
      a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(s[k] + o + 32)));
    }
  }
  a0 = _mm256_xor_si256(a0, a1);
  gSink = (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
}

// The SUMSQ kernel's work on K chunks at once, written by hand (AVX-512): per
// 32 elements of each chunk, widen (bf16: the split order's shift and mask),
// multiply by a coefficient (the unscale), convert to f64 and add the
// squares into that chunk's own four accumulators, so each chunk's lanes see
// the same sequence as with K = 1.
template <int K, bool Bf16>
__attribute__((target("avx512f,avx512bw,avx512dq"))) void sumsqK512(const uint8_t *const *s, size_t len, float c,
                                                                   double *out) {
  __m512d a[K][4];
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < 4; ++j) a[k][j] = _mm512_setzero_pd();
  const __m512 cv = _mm512_set1_ps(c);
  const size_t step = Bf16 ? 64 : 128;
  for (size_t o = 0; o + step <= len; o += step) {
    for (int k = 0; k < K; ++k) {
      __m512 x0, x1;
      _mm_prefetch((const char *)s[k] + o + kPf, _MM_HINT_T0);
      if (Bf16) {
        __m512i w = _mm512_loadu_si512(s[k] + o);
        x0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        x1 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
      } else {
        _mm_prefetch((const char *)s[k] + o + kPf + 64, _MM_HINT_T0);
        x0 = _mm512_loadu_ps(s[k] + o);
        x1 = _mm512_loadu_ps(s[k] + o + 64);
      }
      x0 = _mm512_mul_ps(x0, cv);
      x1 = _mm512_mul_ps(x1, cv);
      __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x0)),
              d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x0), 1))),
              d2 = _mm512_cvtps_pd(_mm512_castps512_ps256(x1)),
              d3 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x1), 1)));
      a[k][0] = _mm512_fmadd_pd(d0, d0, a[k][0]);
      a[k][1] = _mm512_fmadd_pd(d1, d1, a[k][1]);
      a[k][2] = _mm512_fmadd_pd(d2, d2, a[k][2]);
      a[k][3] = _mm512_fmadd_pd(d3, d3, a[k][3]);
    }
  }
  for (int k = 0; k < K; ++k) {
    alignas(64) double l[32];
    for (int j = 0; j < 4; ++j) _mm512_store_pd(l + 8 * j, a[k][j]);
    double t = 0;
    for (int j = 0; j < 32; ++j) t += l[j];
    out[k] = t;
  }
}

__attribute__((target("avx512f"))) void inplace512(uint8_t *p, size_t len, uint64_t z) {
  __m512i zz = _mm512_set1_epi64((long long)z);
  for (size_t o = 0; o + 128 <= len; o += 128) {
    _mm_prefetch((const char *)p + o + kPf, _MM_HINT_T0);
    _mm_prefetch((const char *)p + o + kPf + 64, _MM_HINT_T0);
    __m512i x0 = _mm512_loadu_si512(p + o), x1 = _mm512_loadu_si512(p + o + 64);
    _mm512_storeu_si512(p + o, _mm512_xor_si512(x0, zz));
    _mm512_storeu_si512(p + o + 64, _mm512_xor_si512(x1, zz));
  }
}

__attribute__((target("avx2"))) void inplace256(uint8_t *p, size_t len, uint64_t z) {
  __m256i zz = _mm256_set1_epi64x((long long)z);
  for (size_t o = 0; o + 64 <= len; o += 64) {
    _mm_prefetch((const char *)p + o + kPf, _MM_HINT_T0);
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(p + o)), x1 = _mm256_loadu_si256((const __m256i *)(p + o + 32));
    _mm256_storeu_si256((__m256i *)(p + o), _mm256_xor_si256(x0, zz));
    _mm256_storeu_si256((__m256i *)(p + o + 32), _mm256_xor_si256(x1, zz));
  }
}

// A pool of T threads running one job per repetition between two barriers.
struct Pool {
  int T;
  std::vector<std::thread> th;
  std::atomic<int> gen{0}, done{0};
  std::function<void(int)> job;
  bool quit = false;
  explicit Pool(int t) : T(t) {
    for (int i = 1; i < T; ++i)
      th.emplace_back([this, i] {
        int seen = 0;
        for (;;) {
          while (gen.load(std::memory_order_acquire) == seen) _mm_pause();
          seen = gen.load();
          if (quit) return;
          job(i);
          done.fetch_add(1, std::memory_order_acq_rel);
        }
      });
  }
  void run(std::function<void(int)> f) {
    job = std::move(f);
    done.store(0);
    gen.fetch_add(1, std::memory_order_acq_rel);
    job(0);
    while (done.load(std::memory_order_acquire) != T - 1) _mm_pause();
  }
  ~Pool() {
    quit = true;
    gen.fetch_add(1);
    for (auto &t : th) t.join();
  }
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char **argv) {
  size_t elems = size_t(64) << 20, es = 2, block = 32768;
  int T = 2, reps = 15;
  bool avx2 = false;
  const char *stepPath = nullptr, *sumsqSym = nullptr;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--step" && i + 1 < argc) { stepPath = argv[++i]; continue; }
    if (a == "--sumsq" && i + 1 < argc) { sumsqSym = argv[++i]; continue; }
    auto val = [&] { return i + 1 < argc ? std::strtoull(argv[++i], nullptr, 10) : 0ull; };
    if (a == "--elems") elems = val();
    else if (a == "--es") es = val();
    else if (a == "--block") block = val();
    else if (a == "--threads") T = (int)val();
    else if (a == "--reps") reps = (int)val();
    else if (a == "--avx2") avx2 = true;
    else { std::fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
  }
  const size_t bytes = elems * es, bb = block * es;  // block bytes
  uint8_t *buf = (uint8_t *)std::aligned_alloc(4096, bytes);
  // Finite values in [-1, 1): f32, or bf16 (their high halves).
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < elems; ++i) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    float f = (float)((double)(rng >> 11) / 4503599627370496.0 - 1.0);  // 2^52
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (es == 2) { uint16_t h = (uint16_t)(u >> 16); std::memcpy(buf + 2 * i, &h, 2); }
    else std::memcpy(buf + 4 * i, &u, 4);
  }
  // Each thread's part: whole blocks, as the executor's partition is.
  const size_t nblk = bytes / bb;
  auto part = [&](int t, size_t &b, size_t &e) { b = nblk * t / T * bb; e = nblk * (t + 1) / T * bb; };

  auto blocks = [&](int K, int t) {  // K adjacent blocks per loop
    size_t b, e;
    part(t, b, e);
    for (size_t o = b; o < e; o += K * bb) {
      int k = (int)std::min<size_t>(K, (e - o) / bb);
      const uint8_t *s[4];
      for (int j = 0; j < k; ++j) s[j] = buf + o + j * bb;
      if (avx2) { if (k == 4) readK256<4>(s, bb); else if (k >= 2) { readK256<2>(s, bb); if (k == 3) readK256<1>(s + 2, bb); } else readK256<1>(s, bb); }
      else { if (k == 4) readK512<4>(s, bb); else if (k >= 2) { readK512<2>(s, bb); if (k == 3) readK512<1>(s + 2, bb); } else readK512<1>(s, bb); }
    }
  };
  auto pf4k = [&](int t) {  // one stream, prefetched 4 KiB ahead (as many lines in flight as read2b)
    size_t b, e;
    part(t, b, e);
    const uint8_t *s[1] = {buf + b};
    if (avx2) readK256<1, 4096>(s, e - b); else readK512<1, 4096>(s, e - b);
  };
  auto far = [&](int K, int t) {  // the part cut in K runs, read side by side
    size_t b, e;
    part(t, b, e);
    size_t run = (e - b) / K / 128 * 128;
    const uint8_t *s[4];
    for (int j = 0; j < K; ++j) s[j] = buf + b + j * run;
    if (avx2) { if (K == 2) readK256<2>(s, run); else readK256<4>(s, run); }
    else { if (K == 2) readK512<2>(s, run); else readK512<4>(s, run); }
  };
  // The SUMSQ work over the same blocks: one per call, or K adjacent blocks
  // per call (the partials are compared below: the same bits).
  std::vector<double> part1(nblk), partK(nblk);
  auto sumsq = [&](int K, int t, std::vector<double> &dst) {
    size_t b, e;
    part(t, b, e);
    for (size_t o = b; o < e; o += K * bb) {
      int k = (int)std::min<size_t>(K, (e - o) / bb);
      const uint8_t *s[2];
      for (int j = 0; j < k; ++j) s[j] = buf + o + j * bb;
      double *d = &dst[o / bb];
      if (k == 2) { if (es == 2) sumsqK512<2, true>(s, bb, 0.5f, d); else sumsqK512<2, false>(s, bb, 0.5f, d); }
      else { if (es == 2) sumsqK512<1, true>(s, bb, 0.5f, d); else sumsqK512<1, false>(s, bb, 0.5f, d); }
    }
  };
  zopt_sumsq_fn k1 = nullptr;
  zopt_sumsq2_fn k2 = nullptr;
  if (stepPath) {
    void *h = dlopen(stepPath, RTLD_NOW | RTLD_LOCAL);
    std::string x2 = std::string(sumsqSym ? sumsqSym : "") + "_x2";
    if (!h || !sumsqSym || !(k1 = (zopt_sumsq_fn)dlsym(h, sumsqSym)) || !(k2 = (zopt_sumsq2_fn)dlsym(h, x2.c_str()))) {
      std::fprintf(stderr, "--step needs a step.so and --sumsq SYMBOL with SYMBOL_x2 exported\n");
      return 2;
    }
  }
  std::vector<float> kco(ZOPT_MAX_COEFFS, 0.5f);
  std::vector<double> kp1(nblk), kp2(nblk);
  auto kernel = [&](int K, int t) {
    size_t b, e;
    part(t, b, e);
    void *tab0[ZOPT_MAX_STATES], *tab1[ZOPT_MAX_STATES];
    for (size_t o = b; o < e; o += K * bb) {
      for (int j = 0; j < ZOPT_MAX_STATES; ++j) tab0[j] = buf + o, tab1[j] = buf + o + bb;
      if (K == 2 && o + 2 * bb <= e) k2(tab0, (int64_t)block, kco.data(), tab1, (int64_t)block, kco.data(), &kp2[o / bb]);
      else (K == 2 ? kp2 : kp1)[o / bb] = k1(tab0, (int64_t)block, kco.data()), o -= (K - 1) * bb;
    }
  };
  auto inplace = [&](int t) {
    size_t b, e;
    part(t, b, e);
    if (avx2) inplace256(buf + b, e - b, (uint64_t)(reps < 0)); else inplace512(buf + b, e - b, (uint64_t)(reps < 0));
  };
  struct V { const char *name; std::function<void(int)> f; double mult; std::vector<double> t; };
  std::vector<V> vs = {
      {"read1", [&](int t) { blocks(1, t); }, 1, {}},
      {"read1pf4k", pf4k, 1, {}},
      {"read2b", [&](int t) { blocks(2, t); }, 1, {}},
      {"read4b", [&](int t) { blocks(4, t); }, 1, {}},
      {"read2f", [&](int t) { far(2, t); }, 1, {}},
      {"read4f", [&](int t) { far(4, t); }, 1, {}},
      {"sumsq1", [&](int t) { sumsq(1, t, part1); }, 1, {}},
      {"sumsq2b", [&](int t) { sumsq(2, t, partK); }, 1, {}},
      {"inplace", inplace, 2, {}},
  };
  if (avx2) vs.erase(vs.end() - 3, vs.end() - 1);  // the SUMSQ rows are AVX-512 only
  if (k1) {
    vs.insert(vs.end() - 1, V{"kernel1", [&](int t) { kernel(1, t); }, 1, {}});
    vs.insert(vs.end() - 1, V{"kernel2", [&](int t) { kernel(2, t); }, 1, {}});
  }
  Pool pool(T);
  for (int r = -2; r < reps; ++r)
    for (V &v : vs) {
      double t0 = now();
      pool.run(v.f);
      double dt = now() - t0;
      if (r >= 0) v.t.push_back(dt);
    }
  if (!avx2 && std::memcmp(part1.data(), partK.data(), nblk * sizeof(double))) {
    for (size_t i = 0; i < nblk; ++i)
      if (part1[i] != partK[i]) { std::fprintf(stderr, "block %zu: %a vs %a\n", i, part1[i], partK[i]); break; }
    std::fprintf(stderr, "sumsq2b's partials differ from sumsq1's\n");
    return 1;
  }
  if (k1 && std::memcmp(kp1.data(), kp2.data(), nblk * sizeof(double))) {
    std::fprintf(stderr, "the pair entry's partials differ from the kernel's\n");
    return 1;
  }
  std::printf("%zu elems x %zu B, block %zu, %d threads, %d reps, %s\n", elems, es, block, T, reps, avx2 ? "avx2" : "avx512");
  // Per repetition: this variant's GB/s over the in-place stream's of the
  // same repetition (the host is shared: the ratio is steadier).
  const V &ip = vs.back();
  for (V &v : vs) {
    std::vector<double> ratio;
    for (size_t r = 0; r < v.t.size(); ++r) ratio.push_back((v.mult / v.t[r]) / (ip.mult / ip.t[r]));
    std::sort(ratio.begin(), ratio.end());
    std::vector<double> t = v.t;
    std::sort(t.begin(), t.end());
    double med = t[t.size() / 2];
    std::printf("  %-9s median %7.3f ms (min %7.3f)  %6.1f GB/s (best %6.1f)  per-rep GB/s / in-place GB/s: median %.2f\n",
                v.name, med * 1e3, t[0] * 1e3, v.mult * bytes / med / 1e9, v.mult * bytes / t[0] / 1e9,
                ratio[ratio.size() / 2]);
  }
  std::free(buf);
  return 0;
}

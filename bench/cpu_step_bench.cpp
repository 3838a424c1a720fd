//===- cpu_step_bench.cpp - UPDATE kernel vs in-place stream roofline -----===//
//
// zopt-bench-cpu STEP.so [--n=67108864] [--threads=2] [--reps=15] [--warmup=2]
//                        [--isa=auto|avx2|avx512|avx512bf16]
//
// Times the step's UPDATE kernel over n parameters split into one contiguous
// slice per thread (threads created once, pthread-barrier synchronized), and in
// the same run an in-place stream over the same buffers and threads: read
// every array the UPDATE reads (descriptor access bits), write back every
// array it writes, no math. The stream is written in plain C++ (GCC/Clang
// vector extensions, regular stores, no non-temporal hints) in an AVX2 and
// an AVX-512 version; the faster is the roofline. Kernel and stream runs are
// interleaved per repetition so machine noise hits both alike. The ratio is
// the median over repetitions of (roofline time / kernel time) within each
// repetition, the roofline being the stream variant with the lower median
// (one sample per repetition, like the kernel, so neither side gets a
// best-of-two advantage):
// on a machine whose memory bandwidth is shared with other tenants, adjacent
// runs see similar bandwidth, so per-repetition ratios scatter much less
// than a ratio of separate medians. Medians of the times are reported too.
// q8 moments (docs/NUMERICS.md §10): the codes are a 1-byte array of the
// stream; the per-block absmax (4 bytes per 256 params) is counted in
// bytes/param but left out of the stream, as zopt-run's roofline does;
// slices then start at block boundaries (the kernel contract).
//===----------------------------------------------------------------------===//

#include "zopt/abi.h"
#include "zopt/cpu.h"
#include "stream_roofline.h"
#include "bench_step.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using zopt_stream::Arr;
using zopt_stream::kMaxArr;
using zopt_stream::streamAvx2;
using zopt_stream::streamAvx512;

//===----------------------------------------------------------------------===//
// Thread team.
//===----------------------------------------------------------------------===//

enum Job { kQuit, kKernel, kStream2, kStream512 };

struct Team {
  int nthreads;
  size_t n;
  pthread_barrier_t bar;
  volatile int job = kQuit;
  const zopt_step_descriptor *d;
  zopt_update_fn update;
  std::vector<uint8_t *> base; // one per state
  const float *coeffs;
  volatile uint32_t mask = 0;
  size_t align = 64; // slice boundaries: ZOPT_Q8_BLOCK with q8 states
};

size_t elemBytes(uint32_t dtype) {
  return dtype == ZOPT_DTYPE_F32 ? 4 : dtype == ZOPT_DTYPE_Q8 ? 1 : 2;
}
bool perBlock(const zopt_state_desc &sd) { return sd.flags & ZOPT_STATE_PER_BLOCK; }

size_t sliceBegin(const Team &t, int tid) {
  // Contiguous halves, boundaries rounded to `align` elements.
  size_t per = (t.n / t.nthreads + t.align - 1) / t.align * t.align;
  return std::min(t.n, per * size_t(tid));
}

void doJob(Team &t, int tid, int job) {
  size_t b = sliceBegin(t, tid), e = sliceBegin(t, tid + 1);
  if (tid == t.nthreads - 1) e = t.n;
  if (job == kKernel) {
    void *ptrs[ZOPT_MAX_STATES];
    for (uint32_t s = 0; s < t.d->num_states; ++s)
      ptrs[s] = perBlock(t.d->states[s]) ? t.base[s] + b / ZOPT_Q8_BLOCK * 4
                                         : t.base[s] + b * elemBytes(t.d->states[s].dtype);
    zopt_bench::callUpdate(t.d, (void *)t.update, ptrs, int64_t(e - b), t.coeffs, b);
  } else {
    Arr arr[kMaxArr];
    int na = 0;
    for (uint32_t s = 0; s < t.d->num_states; ++s) {
      const zopt_state_desc &sd = t.d->states[s];
      if (perBlock(sd)) continue; // a q8 absmax: left out (see the header)
      arr[na++] = {t.base[s], int(elemBytes(sd.dtype)),
                   bool(sd.access & ZOPT_ACCESS_READ), bool(sd.access & ZOPT_ACCESS_WRITE)};
    }
    (job == kStream512 ? streamAvx512 : streamAvx2)(arr, na, b, e, t.mask);
  }
}

struct Worker { Team *t; int tid; };

void *workerMain(void *p) {
  Worker *w = static_cast<Worker *>(p);
  for (;;) {
    pthread_barrier_wait(&w->t->bar); // start
    int job = w->t->job;
    if (job == kQuit) return nullptr;
    doJob(*w->t, w->tid, job);
    pthread_barrier_wait(&w->t->bar); // end
  }
}

// Runs `job` on all threads (the caller is thread 0); returns seconds.
double runJob(Team &t, int job) {
  t.job = job;
  pthread_barrier_wait(&t.bar);
  auto t0 = std::chrono::steady_clock::now();
  doJob(t, 0, job);
  pthread_barrier_wait(&t.bar);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t k = v.size();
  return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}


uint16_t bf16Of(float f) { uint32_t b; std::memcpy(&b, &f, 4); return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16); }

} // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s STEP.so [--n=N] [--threads=T] [--reps=R] [--warmup=W] "
                         "[--isa=auto|avx2|avx512|avx512bf16]\n", argv[0]);
    return 2;
  }
  size_t n = size_t(64) << 20;
  int threads = 2, reps = 15, warmup = 2;
  std::string isaOpt = "auto";
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--n=", 0) == 0) n = std::strtoull(a.c_str() + 4, nullptr, 10);
    else if (a.rfind("--threads=", 0) == 0) threads = std::atoi(a.c_str() + 10);
    else if (a.rfind("--reps=", 0) == 0) reps = std::atoi(a.c_str() + 7);
    else if (a.rfind("--warmup=", 0) == 0) warmup = std::atoi(a.c_str() + 9);
    else if (a.rfind("--isa=", 0) == 0) isaOpt = a.substr(6);
    else { std::fprintf(stderr, "unknown option %s\n", a.c_str()); return 2; }
  }
  void *lib = nullptr;
  const zopt_step_descriptor *d = zopt_bench::loadStep(argv[1], &lib);
  if (!d) return 1;
  bool has512 = zopt_cpu_runs_isa(ZOPT_ISA_AVX512);
  int wantIsa = isaOpt == "auto" ? -1 : zopt_isa_from_name(isaOpt.c_str());
  if (isaOpt != "auto" && wantIsa < 0) {
    std::fprintf(stderr, "unknown --isa=%s\n", isaOpt.c_str());
    return 2;
  }
  zopt_prepare_fn prepare = nullptr;
  zopt_update_fn update = nullptr;
  uint32_t isa = 0;
  for (uint32_t k = 0; k < d->num_kernels; ++k) {
    const zopt_kernel_desc &kd = d->kernels[k];
    void *fn = dlsym(lib, kd.symbol);
    if (kd.role == ZOPT_KERNEL_PREPARE) prepare = (zopt_prepare_fn)fn;
    if (kd.role != ZOPT_KERNEL_UPDATE || !fn || !zopt_cpu_runs_isa(kd.isa)) continue;
    // auto: the variant the runtime would pick (the highest the CPU runs).
    bool want = wantIsa < 0 ? (!update || kd.isa > isa) : int(kd.isa) == wantIsa;
    if (want) { update = (zopt_update_fn)fn; isa = kd.isa; }
  }
  if (!prepare || !update) {
    std::fprintf(stderr, "no runnable prepare/update kernel\n");
    return 1;
  }

  float coeffs[ZOPT_MAX_COEFFS];
  zopt_bench::defaultCoeffs(d, prepare, coeffs);

  Team t;
  t.nthreads = threads;
  t.n = n;
  t.d = d;
  t.update = update;
  t.coeffs = coeffs;
  double bytesPerParam = 0;
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (perBlock(d->states[s])) t.align = ZOPT_Q8_BLOCK;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const bool pb = perBlock(d->states[s]);
    size_t es = elemBytes(d->states[s].dtype);
    double perParam = pb ? double(es) / ZOPT_Q8_BLOCK : double(es);
    if (d->states[s].access & ZOPT_ACCESS_READ) bytesPerParam += perParam;
    if (d->states[s].access & ZOPT_ACCESS_WRITE) bytesPerParam += perParam;
    size_t count = pb ? (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : n;
    size_t bytes = (count * es + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
    void *p = std::aligned_alloc(2u << 20, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    t.base.push_back(static_cast<uint8_t *>(p));
  }
  pthread_barrier_init(&t.bar, nullptr, unsigned(threads));
  std::vector<pthread_t> th(threads);
  std::vector<Worker> ws(threads);
  for (int i = 1; i < threads; ++i) {
    ws[i] = {&t, i};
    pthread_create(&th[i], nullptr, workerMain, &ws[i]);
  }
  // First touch by the owning thread: run a fill through the team.
  auto fillSlice = [&](int tid) {
    size_t b = sliceBegin(t, tid), e = tid == threads - 1 ? n : sliceBegin(t, tid + 1);
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (perBlock(d->states[s])) { // a q8 absmax: the slice's blocks
        float *p = reinterpret_cast<float *>(t.base[s]);
        float a = kind == ZOPT_STATE_EXP_AVG_SQ_ABSMAX ? 1e-4f : 1e-3f;
        for (size_t k = b / ZOPT_Q8_BLOCK; k < (e + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK; ++k)
          p[k] = a * (1.0f + float(k % 7) * 0.1f);
        continue;
      }
      if (d->states[s].dtype == ZOPT_DTYPE_Q8) { // codes spread over the map
        uint8_t *p = t.base[s];
        for (size_t i = b; i < e; ++i)
          p[i] = kind == ZOPT_STATE_EXP_AVG_SQ ? uint8_t(1 + i * 53 % 255) : uint8_t(i * 37 % 256);
        continue;
      }
      float val = kind == ZOPT_STATE_EXP_AVG_SQ || kind == ZOPT_STATE_MAX_EXP_AVG_SQ ? 1e-4f
                  : kind == ZOPT_STATE_GRAD ? 1e-2f : kind == ZOPT_STATE_EXP_AVG ? 1e-3f : 0.5f;
      if (d->states[s].dtype == ZOPT_DTYPE_F32) {
        float *p = reinterpret_cast<float *>(t.base[s]);
        for (size_t i = b; i < e; ++i) p[i] = val * (1.0f + float(i % 97) * 0.01f);
      } else {
        uint16_t *p = reinterpret_cast<uint16_t *>(t.base[s]);
        uint16_t h = d->states[s].dtype == ZOPT_DTYPE_BF16 ? bf16Of(val) : uint16_t(0x3800);
        for (size_t i = b; i < e; ++i) p[i] = h;
      }
    }
  };
  {
    std::vector<pthread_t> ft(threads);
    struct Arg { decltype(fillSlice) *f; int tid; };
    std::vector<Arg> args(threads);
    for (int i = 0; i < threads; ++i) {
      args[i] = {&fillSlice, i};
      pthread_create(&ft[i], nullptr, [](void *a) -> void * {
        Arg *x = static_cast<Arg *>(a);
        (*x->f)(x->tid);
        return nullptr;
      }, &args[i]);
    }
    for (int i = 0; i < threads; ++i) pthread_join(ft[i], nullptr);
  }

  for (int w = 0; w < warmup; ++w) {
    runJob(t, kKernel);
    runJob(t, kStream2);
    if (has512) runJob(t, kStream512);
  }
  std::vector<double> tk, ts2, ts512;
  for (int r = 0; r < reps; ++r) {
    tk.push_back(runJob(t, kKernel));
    ts2.push_back(runJob(t, kStream2));
    if (has512) ts512.push_back(runJob(t, kStream512));
  }
  t.job = kQuit;
  pthread_barrier_wait(&t.bar);
  for (int i = 1; i < threads; ++i) pthread_join(th[i], nullptr);

  double mk = median(tk), m2 = median(ts2), m512 = has512 ? median(ts512) : INFINITY;
  double roof = std::min(m2, m512);
  std::vector<double> ratios;
  for (int r = 0; r < reps; ++r)
    ratios.push_back((m512 < m2 ? ts512[r] : ts2[r]) / tk[r]);
  double ratio = median(ratios);
  double gb = bytesPerParam * double(n) / 1e9;
  std::printf("step=%s isa=%s n=%zu threads=%d reps=%d bytes/param=%.2f\n", d->name,
              zopt_isa_name(isa), n,
              threads, reps, bytesPerParam);
  std::printf("kernel:        median %.3f ms  %.3f Gparam/s  %.2f GB/s  (min %.3f max %.3f ms)\n",
              mk * 1e3, n / mk / 1e9, gb / mk, *std::min_element(tk.begin(), tk.end()) * 1e3,
              *std::max_element(tk.begin(), tk.end()) * 1e3);
  std::printf("stream avx2:   median %.3f ms  %.2f GB/s\n", m2 * 1e3, gb / m2);
  if (has512) std::printf("stream avx512: median %.3f ms  %.2f GB/s\n", m512 * 1e3, gb / m512);
  else std::printf("stream avx512: not run (CPU lacks AVX-512)\n");
  std::printf("per-repetition ratio: median %.3f  min %.3f  max %.3f  (ratio of medians %.3f)\n",
              ratio, *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()), roof / mk);
  std::printf("RESULT %s isa=%s params_per_s=%.4g kernel_GBps=%.2f roofline_GBps=%.2f "
              "roofline=%s ratio=%.3f\n",
              d->name, zopt_isa_name(isa), n / mk, gb / mk, gb / roof,
              m512 < m2 ? "avx512" : "avx2", ratio);
  return 0;
}

//===- kernel_compute_bench.cpp - UPDATE kernel cost with data in L1 ------===//
//
//   zopt-bench-compute STEP.so [ISA...] [--n=N,N,...]
//                                          ISA: avx2 | avx512 | avx512bf16
//
// Calls each UPDATE variant (all those this CPU runs, or the ones named), then
// each SUMSQ variant (a clipping step's norm pass), over 4096 elements
// (L1/L2-resident) many times on one thread: the kernel's compute cost per
// element, without memory. With --n, the cost of one call
// over each N elements instead (the minimum of 20 runs of 2000 calls, each
// call on the next of 16 sets of buffers of the largest N, as calls over
// separate tensors are: a call's prologue, vector loop and tail; issue
// 17's small tensors). Run the small and the large sizes apart: the sets
// of the largest N decide where the buffers live (L1 or L2). Used to tell a compute-bound
// layout from a memory-bound one (docs/benchmarks/cpu.md). Prints the
// wall-clock figure and the thread's CPU time (steadier on a shared host). States hold 1.0
// (f32 1.0f, bf16 pairs 0x3f80): finite, normal values on every path.
//===----------------------------------------------------------------------===//
#include "zopt/abi.h"
#include "zopt/cpu.h"
#include "bench_step.h"

#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

// This thread's CPU time: on a shared host, the time it ran, not the time
// it waited for a core (docs/benchmarks/cpu.md).
static double threadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s STEP.so [avx2|avx512|avx512bf16...]\n", argv[0]);
    return 2;
  }
  void *h = nullptr;
  const zopt_step_descriptor *d = zopt_bench::loadStep(argv[1], &h);
  if (!d) return 1;
  std::vector<int> wanted;
  std::vector<long> sizes;
  for (int i = 2; i < argc; ++i) {
    if (!std::strncmp(argv[i], "--n=", 4)) {
      for (const char *p = argv[i] + 4; *p;) {
        char *end;
        long v = std::strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096) {
          std::fprintf(stderr, "--n: sizes from 1 to 4096, comma-separated\n");
          return 2;
        }
        sizes.push_back(v);
        p = *end == ',' ? end + 1 : end;
      }
      continue;
    }
    int isa = zopt_isa_from_name(argv[i]);
    if (isa < 0) {
      std::fprintf(stderr, "unknown ISA '%s'\n", argv[i]);
      return 2;
    }
    wanted.push_back(isa);
  }
  zopt_prepare_fn prep = nullptr;
  for (uint32_t i = 0; i < d->num_kernels; ++i)
    if (d->kernels[i].role == ZOPT_KERNEL_PREPARE)
      prep = (zopt_prepare_fn)dlsym(h, d->kernels[i].symbol);
  if (!prep) {
    std::fprintf(stderr, "no PREPARE kernel\n");
    return 1;
  }
  float co[ZOPT_MAX_COEFFS];
  zopt_bench::defaultCoeffs(d, prep, co);

  const long n = 4096;
  std::vector<std::vector<uint32_t>> buf(d->num_states, std::vector<uint32_t>(n));
  void *ptrs[ZOPT_MAX_STATES];
  for (uint32_t s = 0; s < d->num_states; ++s) {
    uint32_t v = d->states[s].dtype == ZOPT_DTYPE_F32 ? 0x3f800000u : 0x3f803f80u;
    std::fill(buf[s].begin(), buf[s].end(), v);
    ptrs[s] = buf[s].data();
  }
  // --n: 16 sets of the largest N per state (the separate tensors; 16 x
  // 4 states x 128 f32 fit in L1).
  const int kSets = 16;
  const long setN = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::vector<uint32_t>> sets(sizes.empty() ? 0 : kSets * d->num_states);
  std::vector<std::vector<void *>> setPtrs(sizes.empty() ? 0 : kSets, std::vector<void *>(ZOPT_MAX_STATES));
  for (size_t j = 0; j < sets.size(); ++j) {
    const uint32_t s = j % d->num_states;
    sets[j].assign(setN, d->states[s].dtype == ZOPT_DTYPE_F32 ? 0x3f800000u : 0x3f803f80u);
    setPtrs[j / d->num_states][s] = sets[j].data();
  }
  int ran = 0;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.role != ZOPT_KERNEL_UPDATE || k.device != ZOPT_PLACE_CPU) continue;
    bool named = false;
    for (int w : wanted) named |= w == int(k.isa);
    if (!wanted.empty() && !named) continue;
    if (!zopt_cpu_runs_isa(k.isa)) {
      std::printf("%s %s: not run, this CPU lacks the instruction set\n", d->name,
                  zopt_isa_name(k.isa));
      continue;
    }
    void *sym = dlsym(h, k.symbol);
    if (!sym) continue;
    auto upd = [&](void *const *p, long m, const float *c) {
      zopt_bench::callUpdate(d, sym, p, m, c, 0);
    };
    if (!sizes.empty()) {
      for (long m : sizes) {
        double best = 1e30;
        for (int r = 0; r < 20; ++r) {
          auto t0 = std::chrono::steady_clock::now();
          for (int k = 0; k < 2000; ++k) upd(setPtrs[k % kSets].data(), m, co);
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2000);
        }
        std::printf("%s %s: n=%ld %.1f ns/call %.3f ns/elem (L1/L2-resident, 1 thread)\n", d->name,
                    zopt_isa_name(k.isa), m, best * 1e9, best * 1e9 / m);
      }
      ++ran;
      continue;
    }
    // Re-fill between variants: the update drifts the values a little.
    for (uint32_t s = 0; s < d->num_states; ++s)
      std::fill(buf[s].begin(), buf[s].end(),
                d->states[s].dtype == ZOPT_DTYPE_F32 ? 0x3f800000u : 0x3f803f80u);
    for (int r = 0; r < 1000; ++r) upd(ptrs, n, co);
    const int R = 20000;
    const double c0 = threadCpuSeconds();
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < R; ++r) upd(ptrs, n, co);
    auto t1 = std::chrono::steady_clock::now();
    const double c1 = threadCpuSeconds();
    std::printf("%s %s: %.3f ns/elem (L1-resident, 1 thread; %.3f in thread CPU time)\n", d->name,
                zopt_isa_name(k.isa), std::chrono::duration<double>(t1 - t0).count() / R / n * 1e9,
                (c1 - c0) / R / n * 1e9);
    ++ran;
  }
  if (!ran) {
    std::fprintf(stderr, "no UPDATE variant ran\n");
    return 1;
  }
  // The norm pass (SUMSQ) of a clipping step, likewise (without --n).
  for (uint32_t i = 0; i < d->num_kernels && sizes.empty(); ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (k.role != ZOPT_KERNEL_SUMSQ || k.device != ZOPT_PLACE_CPU) continue;
    bool named = wanted.empty();
    for (int w : wanted) named |= w == int(k.isa);
    if (!named || !zopt_cpu_runs_isa(k.isa)) continue;
    auto fn = (zopt_sumsq_fn)dlsym(h, k.symbol);
    if (!fn) continue;
    volatile double sink = 0;
    for (int r = 0; r < 1000; ++r) sink = sink + fn(ptrs, n, co);
    const int R = 100000;
    const double c0 = threadCpuSeconds();
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < R; ++r) sink = sink + fn(ptrs, n, co);
    auto t1 = std::chrono::steady_clock::now();
    const double c1 = threadCpuSeconds();
    std::printf("%s %s sumsq: %.3f ns/elem (L1-resident, 1 thread; %.3f in thread CPU time)\n", d->name,
                zopt_isa_name(k.isa), std::chrono::duration<double>(t1 - t0).count() / R / n * 1e9,
                (c1 - c0) / R / n * 1e9);
  }
  return 0;
}

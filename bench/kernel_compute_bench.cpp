//===- kernel_compute_bench.cpp - UPDATE kernel cost with data in L1 ------===//
//
//   zopt-bench-compute STEP.so [ISA...]      ISA: avx2 | avx512 | avx512bf16
//
// Calls each UPDATE variant (all those this CPU runs, or the ones named) over
// 4096 elements (L1/L2-resident) many times on one thread: the kernel's
// compute cost per element, without memory. Used to tell a compute-bound
// layout from a memory-bound one (docs/benchmarks/cpu.md). States hold 1.0
// (f32 1.0f, bf16 pairs 0x3f80): finite, normal values on every path.
//===----------------------------------------------------------------------===//
#include "zopt/abi.h"
#include "zopt/cpu.h"
#include "bench_step.h"

#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s STEP.so [avx2|avx512|avx512bf16...]\n", argv[0]);
    return 2;
  }
  void *h = nullptr;
  const zopt_step_descriptor *d = zopt_bench::loadStep(argv[1], &h);
  if (!d) return 1;
  std::vector<int> wanted;
  for (int i = 2; i < argc; ++i) {
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
    // Re-fill between variants: the update drifts the values a little.
    for (uint32_t s = 0; s < d->num_states; ++s)
      std::fill(buf[s].begin(), buf[s].end(),
                d->states[s].dtype == ZOPT_DTYPE_F32 ? 0x3f800000u : 0x3f803f80u);
    for (int r = 0; r < 1000; ++r) upd(ptrs, n, co);
    const int R = 20000;
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < R; ++r) upd(ptrs, n, co);
    auto t1 = std::chrono::steady_clock::now();
    std::printf("%s %s: %.3f ns/elem (L1-resident, 1 thread)\n", d->name, zopt_isa_name(k.isa),
                std::chrono::duration<double>(t1 - t0).count() / R / n * 1e9);
    ++ran;
  }
  if (!ran) {
    std::fprintf(stderr, "no UPDATE variant ran\n");
    return 1;
  }
  return 0;
}

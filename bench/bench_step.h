//===- bench_step.h - what the CPU benchmarks share about a step.so -------===//
//
// The benchmarks call kernels directly (no runtime): load and validate the
// descriptor, compute the coefficients every benchmark uses, and call an
// UPDATE with the arguments its descriptor says it takes.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_BENCH_BENCH_STEP_H
#define ZOPT_BENCH_BENCH_STEP_H

#include "zopt/abi.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace zopt_bench {

// dlopens `path` and returns its validated descriptor (nullptr after a
// message on stderr).
inline const zopt_step_descriptor *loadStep(const char *path, void **lib) {
  std::string file = std::strchr(path, '/') ? path : std::string("./") + path;
  *lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!*lib) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return nullptr;
  }
  auto *d = static_cast<const zopt_step_descriptor *>(dlsym(*lib, ZOPT_DESC_SYMBOL));
  if (!d || std::memcmp(d->magic, ZOPT_DESC_MAGIC, 8) || d->abi_version != ZOPT_ABI_VERSION ||
      d->checksum != zopt_desc_checksum(d)) {
    std::fprintf(stderr, "bad descriptor\n");
    return nullptr;
  }
  return d;
}

// The benchmarks' coefficients: default hyperparameters, t = 3, no
// clipping, no loss scale.
inline void defaultCoeffs(const zopt_step_descriptor *d, zopt_prepare_fn prepare, float *coeffs) {
  double hy[ZOPT_MAX_HYPERS];
  for (uint32_t h = 0; h < d->num_hypers; ++h) hy[h] = d->hypers[h].default_value;
  double globals[ZOPT_NUM_GLOBALS] = {3, 1, 1};
  prepare(hy, globals, coeffs);
}

// One UPDATE call over n elements starting at element `first` of a tensor;
// steps with stochastic rounding also get (key, first) (abi.h).
inline void callUpdate(const zopt_step_descriptor *d, void *fn, void *const *ptrs, int64_t n,
                       const float *coeffs, uint64_t first) {
  if (d->flags & ZOPT_FLAG_STOCHASTIC)
    ((zopt_update_sr_fn)fn)(ptrs, ptrs, n, coeffs, zopt_sr_key(0, 1, 0, uint32_t(first >> 32)),
                            uint32_t(first));
  else
    ((zopt_update_fn)fn)(ptrs, ptrs, n, coeffs);
}

} // namespace zopt_bench

#endif

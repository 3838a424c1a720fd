//===- offload_common.h - what the offload benchmarks share ---------------===//
//
// zopt-bench-offload and zopt-bench-offload-pipeline (docs/benchmarks/
// offload.md) both load an offloaded step.so through the public C API, put
// random params and grads in device memory (zopt_run_device.h) and time
// zopt_optimizer_step. This header holds what they share: the check macro,
// the clock, the options, what a descriptor says about the step (param and
// grad dtypes, host bytes/param of its optimizer state) and the random
// values in a dtype's bits.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_BENCH_OFFLOAD_COMMON_H
#define ZOPT_BENCH_OFFLOAD_COMMON_H

#include "zopt/zopt.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace zopt_bench {

// The benchmark's name, for its messages (set by main).
inline const char *&prog() {
  static const char *p = "zopt-bench";
  return p;
}

#define ZB_CHECK(call)                                                                                     \
  do {                                                                                                     \
    if (zopt_status st_ = (call)) {                                                                        \
      std::fprintf(stderr, "%s: %s: %d %s\n", ::zopt_bench::prog(), #call, (int)st_, zopt_last_error());  \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The options both take: --params N --tensors T --steps K --threads P, and
// the caller's own (`extra`: name -> where its value goes). Returns false
// after a message on stderr.
struct OffloadOpts {
  long long params = 64ll << 20;
  int tensors = 64, steps = 5, threads = 0;
};
struct ExtraOpt {
  const char *name;
  double *value;
};
inline bool parse_opts(int argc, char **argv, int first, OffloadOpts &o, std::vector<ExtraOpt> extra = {}) {
  for (int i = first; i < argc; i += 2) {
    std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s needs a value\n", prog(), a.c_str());
      return false;
    }
    const double v = std::atof(argv[i + 1]);
    if (a == "--params") o.params = (long long)v;
    else if (a == "--tensors") o.tensors = (int)v;
    else if (a == "--steps") o.steps = (int)v;
    else if (a == "--threads") o.threads = (int)v;
    else {
      auto it = std::find_if(extra.begin(), extra.end(), [&](const ExtraOpt &e) { return a == e.name; });
      if (it == extra.end()) {
        std::fprintf(stderr, "%s: unknown option %s\n", prog(), a.c_str());
        return false;
      }
      *it->value = v;
    }
  }
  if (o.params < o.tensors || o.tensors < 1 || o.steps < 1) {
    std::fprintf(stderr, "%s: need params >= tensors >= 1, steps >= 1\n", prog());
    return false;
  }
  return true;
}

inline size_t dsize(uint32_t d) { return d == ZOPT_DTYPE_F32 ? 4 : d == ZOPT_DTYPE_Q8 ? 1 : 2; }

// What a descriptor says about an offloaded step: the param and grad
// dtypes and its optimizer state's host bytes per param (a q8 absmax: one
// f32 per block).
struct StepShape {
  uint32_t pdt = 0, gdt = 0;
  double host_state = 0;
  explicit StepShape(const zopt_step_descriptor *d) {
    for (uint32_t s = 0; s < d->num_states; ++s) {
      const zopt_state_desc &x = d->states[s];
      if (x.kind == ZOPT_STATE_PARAM) pdt = x.dtype;
      else if (x.kind == ZOPT_STATE_GRAD) gdt = x.dtype;
      else host_state += (double)dsize(x.dtype) / ((x.flags & ZOPT_STATE_PER_BLOCK) ? ZOPT_Q8_BLOCK : 1);
    }
  }
};

// f in dtype dt's bits at out (bf16 rounded to nearest even).
inline void store_as(float f, uint32_t dt, unsigned char *out) {
  if (dt == ZOPT_DTYPE_F32) {
    std::memcpy(out, &f, 4);
    return;
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t h = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  std::memcpy(out, &h, 2);
}

}  // namespace zopt_bench

#endif

// zero_check.h - what the files of zopt-zero-check share (zero_check.cpp
// says what it checks): the options, PASS/FAIL reporting, the model and
// its deterministic values; zero_check.cpp runs the ranks (the models, the
// gradients, streaming, the steps), zero_check_compare.cpp checks what a
// rank holds against one rank and the documented layout.
#ifndef ZOPT_ZERO_CHECK_H
#define ZOPT_ZERO_CHECK_H

#include "zopt/comm.h"
#include "zopt/zopt.h"
#include "rank_test_util.h"
#include "zopt_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <chrono>
#include <thread>
#include <vector>

namespace zc {

struct Options {
  std::string step, other, linked, comm = "loopback", save, load, mismatch;
  bool begin = false, stall = false;
  int world = 2, steps = 4, threads = 1, accum = 1, inf_at = -1, from_world = 1, loaded_steps = 0;
  int64_t bucket = 65536, params = 0;
  double grad_scale = 0.05;
  bool mask = false, delay = false, stream = false, async = false, misorder = false, async_free = false;
};

inline std::mutex g_print_mu;
inline int g_failures = 0, g_passes = 0;

inline void report(int rank, bool ok, const char *fmt, ...) {
  char m[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_print_mu);
  if (ok) {
    ++g_passes;
    if (rank == 0) printf("PASS %s\n", m);
  } else {
    ++g_failures;
    printf("FAIL rank %d: %s\n", rank, m);
  }
  fflush(stdout);
}

#define CK(call)                                                                      \
  do {                                                                                \
    zopt_status st_ = (call);                                                         \
    if (st_ != ZOPT_OK) {                                                             \
      report(rank, false, "%s -> %d: %s", #call, (int)st_, zopt_last_error());       \
      return false;                                                                   \
    }                                                                                 \
  } while (0)

inline size_t esize(uint32_t dt) { return rtu::dtype_size(dt); }
using rtu::load;
using rtu::mix;
using rtu::store;

// A deterministic value in +-[0.1, 1.1) * scale (never zero).
inline float value(uint64_t a, uint64_t b, uint64_t c, uint64_t i, double scale) {
  uint64_t h = mix(a * 0x9E3779B97F4A7C15ull ^ mix(b * 31 + c * 1000003 + i * 7919 + 17));
  double u = (double)(h >> 11) / 9007199254740992.0;
  return (float)((h & 1 ? 1.0 : -1.0) * (0.1 + u) * scale);
}

inline std::vector<int64_t> kSizes = {0, 1, 3, 5, 1000, 33333, 70001, 130000, 7};  // --params scales it
inline const std::vector<int> kGroups = {0, 0, 1, 0, 1, 0, 1, 0, 1};

struct Model {
  const zopt_step *step;
  const zopt_step_descriptor *d;
  uint32_t pdt, gdt;
  std::vector<std::vector<unsigned char>> p, g;
  zopt_optimizer *o = nullptr;
  ~Model() { zopt_optimizer_free(o); }
};

inline uint32_t dtype_of(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == kind) return d->states[i].dtype;
  return 0;
}

// zero_check_compare.cpp: everything a step produces against one rank's
// (`own`: this rank's gradients as handed to the step, NULL after a load),
// and the runtime-held bytes against the documented layout.
bool compare(int rank, Model &m, Model &ref, const zopt_step_result &a, const zopt_step_result &b, int k,
             const Options &opt, const char *tag, const std::vector<std::vector<unsigned char>> *own = nullptr);
bool check_memory(int rank, Model &m, Model &ref, const Options &opt, const char *tag);
// The layout's model (zero_check_compare.cpp): the number of elements of the model.
int64_t model_elems();

}  // namespace zc

#endif

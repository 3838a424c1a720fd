// rank_test_util.h - what the multi-rank checks share (zopt-ckpt-check,
// zopt-state-check, zopt-zero-check): deterministic never-zero values,
// W ranks as loopback threads, and RANK_CK for a rank's failed call.
// Values are stored with the reference's rounding (test/reference).
#ifndef ZOPT_RANK_TEST_UTIL_H
#define ZOPT_RANK_TEST_UTIL_H

#include "zopt/comm.h"
#include "zopt/zopt.h"
#include "zopt_reference.h"

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace rtu {

using zopt_ref::dtype_size;
using zopt_ref::load;   // element i of a dtype array, widened
using zopt_ref::store;  // ... stored rounded (docs/NUMERICS.md §1)

// The step's param and grad dtypes, and whether params are partitioned
// (ZeRO-3), from its descriptor.
inline void tensor_types(const zopt_step_descriptor *d, uint32_t *pdt, uint32_t *gdt, bool *zero3) {
  for (uint32_t s = 0; s < d->num_states; ++s) {
    if (d->states[s].kind == ZOPT_STATE_PARAM) {
      *pdt = d->states[s].dtype;
      *zero3 = d->states[s].flags & ZOPT_STATE_PARTITIONED;
    }
    if (d->states[s].kind == ZOPT_STATE_GRAD) *gdt = d->states[s].dtype;
  }
}

// A 64-bit mixer (splitmix64's finalizer).
inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}
// Deterministic values in +-[0.1, 1.1) * scale, never zero.
inline float value(uint64_t a, uint64_t b, uint64_t i, double scale) {
  uint64_t h = mix(a * 0x9E3779B97F4A7C15ull ^ mix(b * 1000003 + i * 7919 + 17));
  double u = (double)(h >> 11) / 9007199254740992.0;
  return (float)((h & 1 ? 1.0 : -1.0) * (0.1 + u) * scale);
}

// Runs fn(rank, comm) on `world` fresh loopback ranks (threads) with
// `timeout_s`, and frees them; with `none_at_one`, world 1 runs fn(0, NULL)
// (no communicator). Returns false (with zopt_last_error()) when the
// ranks cannot be made.
inline bool on_ranks(int world, double timeout_s, bool none_at_one,
                     const std::function<void(int, zopt_comm *)> &fn) {
  if (world == 1 && none_at_one) {
    fn(0, nullptr);
    return true;
  }
  std::vector<zopt_comm *> comms((size_t)world);
  zopt_loopback_options lo{};
  lo.timeout_s = timeout_s;
  if (zopt_comm_create_loopback(world, &lo, comms.data())) return false;
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back([&, r] { fn(r, comms[(size_t)r]); });
  for (auto &t : th) t.join();
  for (zopt_comm *c : comms) zopt_comm_free(c);
  return true;
}

}  // namespace rtu

// In a rank's function (rank `r`): a false `call` reports the failure with
// the runtime's last error (the caller's `report(ok, fmt, ...)`) and returns.
#define RANK_CK(call)                                                                              \
  do {                                                                                             \
    if (!(call)) {                                                                                 \
      report(false, "rank %d: %s at %s:%d: %s", r, #call, __FILE__, __LINE__, zopt_last_error()); \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

#endif

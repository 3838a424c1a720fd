//===- control-check.h - the CONTROL kernel against the contract -*- C++ -*-===//
//
// The check of a step's CONTROL kernel (abi.h) against the reference's
// control semantics (test/reference/zopt_reference.h: docs/NUMERICS.md §3
// the norm, clip coefficient and non-finite skip; §5 the loss scaler; §6
// whether the step counts advance; written from the contract, independently
// of the compiler's zk.control), bit for bit, over a grid of inputs:
// sums of squares (zero, tiny, ordinary, huge, inf, NaN), max_norms and
// loss-scaler states (growth at the interval, growth to inf refused,
// backoff to min_scale, static). Used by zopt-kernel-check.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_CONTROL_CHECK_H
#define ZOPT_TEST_CONTROL_CHECK_H

#include "zopt/abi.h"
#include "zopt_reference.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace control_check {

using Out = zopt_ref::Control;

inline bool sameBits(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, sizeof a) == 0;
}

/// Runs `fn` over the grid; returns the number of cases and sets `bad` to
/// the number that differ from the reference in any bit, `first` to the
/// first such case's description.
template <class Describe>
int check(uint32_t flags, zopt_control_fn fn, int *bad, Describe describe) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double sums[] = {0.0, 4.9e-324, 1e-14, 0.25, 1.0, 3.7, 1e10, 1e300, 1.7976931348623157e308, inf, nan};
  const double norms[] = {1.0, 0.37, 1e-3, 5e5};
  struct Sc {
    double scale, growth, backoff, min;
    int64_t interval, good;
    uint32_t dynamic;
  } scs[] = {
      {65536, 2, 0.5, 1, 2000, 0, 1},      {65536, 2, 0.5, 1, 2000, 1998, 1}, {65536, 2, 0.5, 1, 2000, 1999, 1},
      {1.5, 2, 0.5, 1, 3, 1, 1},           {1e308, 2, 0.5, 1, 1, 0, 1},       {3.0, 1.5, 0.25, 0.5, 1, 0, 1},
      {1024, 2, 0.5, 1, 2000, 7, 0},       {1, 1, 0.999, 1e-300, 1, 0, 1},    {65536, 2, 0.5, 1, INT64_MAX, 5, 1},
  };
  int n = 0;
  *bad = 0;
  for (double s : sums)
    for (double m : norms)
      for (const Sc &c : scs) {
        zopt_control io;
        std::memset(&io, 0xA5, sizeof io);  // outputs must all be written
        io.sumsq = s;
        io.max_norm = m;
        io.scale = c.scale;
        io.growth_factor = c.growth;
        io.backoff_factor = c.backoff;
        io.min_scale = c.min;
        io.growth_interval = c.interval;
        io.good_steps = c.good;
        io.dynamic = c.dynamic;
        io.reserved0 = 0;
        const zopt_control before = io;
        fn(&io);
        Out r = zopt_ref::control(flags, before);
        bool ok = sameBits(io.norm, r.norm) && sameBits(io.clip_coef, r.clip) && sameBits(io.new_scale, r.scale) &&
                  io.new_good_steps == r.good && io.skip == (r.skip ? 1u : 0u) &&
                  io.advance == (r.advance ? 1u : 0u) &&
                  std::memcmp(&io, &before, offsetof(zopt_control, norm)) == 0;  // inputs untouched
        ++n;
        if (!ok && (*bad)++ == 0) describe(before, io, r);
      }
  return n;
}

}  // namespace control_check

#endif

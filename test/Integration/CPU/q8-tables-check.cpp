//===- q8-tables-check.cpp - the q8 maps and their encode, exhaustively ---===//
//
// zopt-q8-tables-check [--stride=97]
//
// The golden tables of q8 moments (docs/NUMERICS.md §10, abi.h "q8
// moments"): abi.h's definition (the generated tables of zopt/q8_maps.h,
// zopt_q8_decode, zopt_q8_encode's threshold search) against the float64
// reference (test/reference/zopt_reference.h §10: the maps built in
// float64, the encode by float64 midpoints), for both maps:
//  * decode: every code's value is the float64 construction rounded to
//    f32, bit for bit; the maps ascend strictly, hold 0 (code 127 signed,
//    0 unsigned) and 1.0 (code 255); map * absmax is one f32 multiply;
//  * encode: every f32 bit pattern in [-1, 1] with a stride (default 97:
//    about 22 million patterns per map, a few seconds; --stride=1 runs all
//    2^31 of them), then exactly every map value, every f32 around every
//    midpoint and their neighbours (+-1 and +-2 ulp), with absmax 1 (so
//    r = x); random x and absmax (r = x / absmax rounded in f32);
//  * the zero point: a nonzero v never takes the unsigned map's zero code
//    (subnormals, x / absmax underflowing to 0), +-0 take it;
//  * non-finite and zero absmax: the zero code, which decodes to NaN under
//    a NaN or infinite absmax and to 0 under absmax 0.
// Prints PASS/FAIL lines and `N passed, M failed`; exit 1 on a failure.
//===----------------------------------------------------------------------===//
#include "zopt_reference.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

namespace {

int gPassed = 0, gFailed = 0;

void report(bool ok, const std::string &what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  (ok ? gPassed : gFailed)++;
}

using zopt_ref::bits_f32;
using zopt_ref::f32_bits;

float nextUp(float x) { return std::nextafter(x, INFINITY); }
float nextDown(float x) { return std::nextafter(x, -INFINITY); }

struct Map {
  const char *name;
  bool isUnsigned;
  const float *table; // abi.h's (generated)
  float ref[256];     // the reference's construction
  uint8_t zero;
};

void checkDecode(const Map &m) {
  double d[256];
  zopt_ref::q8_map_f64(!m.isUnsigned, d);
  int bad = 0, order = 0;
  for (int k = 0; k < 256; ++k) {
    bad += f32_bits(m.table[k]) != f32_bits(float(d[k])) ||
           f32_bits(zopt_q8_decode(uint8_t(k), 1.0f, m.isUnsigned)) != f32_bits(m.table[k]);
    if (k) order += !(m.table[k - 1] < m.table[k]);
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "decode %s: 256 codes == f32(float64 construction): %d differ; "
                "strictly ascending: %d out of order", m.name, bad, order);
  report(bad == 0 && order == 0, buf);
  const bool ends = m.table[m.zero] == 0.0f && !std::signbit(m.table[m.zero]) &&
                    m.table[255] == 1.0f &&
                    (m.isUnsigned ? m.table[0] == 0.0f : m.table[0] < -0.99f && m.table[0] > -1.0f);
  std::snprintf(buf, sizeof buf, "decode %s: code %u is 0, code 255 is 1.0, code 0 is %a", m.name,
                m.zero, m.table[0]);
  report(ends, buf);
  // map * absmax, one f32 multiply, for random absmax.
  std::mt19937 rng(7);
  int mulBad = 0;
  for (int i = 0; i < 4096; ++i) {
    const float a = bits_f32(0x30000000u + (rng() % 0x1F000000u)); // ~5e-10 .. ~1e9
    const uint8_t c = uint8_t(rng());
    mulBad += f32_bits(zopt_q8_decode(c, a, m.isUnsigned)) != f32_bits(zopt_ref::q8_decode(m.ref, c, a));
  }
  std::snprintf(buf, sizeof buf, "decode %s: map[code] * absmax for 4096 random (code, absmax): %d "
                "differ from the reference", m.name, mulBad);
  report(mulBad == 0, buf);
}

void checkEncode(const Map &m, uint64_t stride) {
  // Every midpoint is exact in float64 (the two f32 values are close).
  int inexact = 0;
  for (int k = 0; k < 255; ++k) {
    const double mid = (double(m.ref[k]) + double(m.ref[k + 1])) / 2.0;
    inexact += mid * 2.0 - double(m.ref[k]) != double(m.ref[k + 1]);
  }
  char buf[320];
  std::snprintf(buf, sizeof buf, "encode %s: the 255 float64 midpoints are exact: %d are not",
                m.name, inexact);
  report(inexact == 0, buf);

  uint64_t n = 0, bad = 0;
  uint32_t firstBad = 0;
  auto one = [&](float x, float a) {
    ++n;
    const uint8_t got = zopt_q8_encode(x, a, m.isUnsigned), want = zopt_ref::q8_encode(m.ref, m.isUnsigned, x, a);
    if (got != want && !bad++) firstBad = f32_bits(x);
  };
  // Every stride-th bit pattern of [0, 1] and of [-1, -0].
  const uint32_t top = 0x3F800000u; // 1.0
  for (uint64_t b = 0; b <= top; b += stride) {
    one(bits_f32(uint32_t(b)), 1.0f);
    one(bits_f32(uint32_t(b) | 0x80000000u), 1.0f);
  }
  std::snprintf(buf, sizeof buf, "encode %s: every %" PRIu64 "th f32 pattern in [-1, 1] (%" PRIu64
                " values, absmax 1) == the float64-midpoint reference: %" PRIu64 " differ%s",
                m.name, stride, n, bad, bad ? " (first x bits shown below)" : "");
  report(bad == 0, buf);
  if (bad) std::printf("INFO first x = 0x%08x (%a)\n", firstBad, bits_f32(firstBad));

  // Exactly at and around every map value and every midpoint.
  n = bad = 0;
  for (int k = 0; k < 256; ++k) {
    float x = m.ref[k];
    for (float y : {x, nextUp(x), nextDown(x), nextUp(nextUp(x)), nextDown(nextDown(x))})
      if (y >= -1.0f && y <= 1.0f) one(y, 1.0f);
  }
  int ties = 0;
  for (int k = 0; k < 255; ++k) {
    const double mid = (double(m.ref[k]) + double(m.ref[k + 1])) / 2.0;
    float lo = float(mid); // the f32 nearest the midpoint, then those around
    ties += double(lo) == mid;
    for (float y : {lo, nextUp(lo), nextDown(lo), nextUp(nextUp(lo)), nextDown(nextDown(lo))})
      one(y, 1.0f);
    // An exact tie goes to the smaller magnitude.
    if (double(lo) == mid) {
      const uint8_t c = zopt_q8_encode(lo, 1.0f, m.isUnsigned);
      const uint8_t want = uint8_t(std::fabs(m.ref[k]) < std::fabs(m.ref[k + 1]) ? k : k + 1);
      if (!(m.isUnsigned && want == 0) && c != want && !bad++) firstBad = f32_bits(lo);
    }
  }
  std::snprintf(buf, sizeof buf, "encode %s: every map value and every midpoint, +-1 and +-2 ulp "
                "(%" PRIu64 " values, %d midpoints exact f32 ties -> the smaller magnitude): %" PRIu64
                " differ", m.name, n, ties, bad);
  report(bad == 0, buf);

  // r = x / absmax rounded in f32: random x within the block, random absmax.
  n = bad = 0;
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int i = 0; i < 200000; ++i) {
    const float a = float(std::ldexp(1.0 + std::fabs(u(rng)), int(rng() % 200) - 100));
    float x = float(u(rng) * a);
    if (m.isUnsigned) x = std::fabs(x);
    one(x, a);
  }
  std::snprintf(buf, sizeof buf, "encode %s: 200000 random (x, absmax), r = x / absmax in f32: "
                "%" PRIu64 " differ", m.name, bad);
  report(bad == 0, buf);
}

void checkZeroAndSpecials(const Map &m) {
  char buf[320];
  const float tiny = bits_f32(1); // the smallest subnormal
  const float inf = INFINITY, nan = NAN;
  bool ok = true;
  std::string why;
  auto expect = [&](float x, float a, uint8_t want, const char *what) {
    const uint8_t got = zopt_q8_encode(x, a, m.isUnsigned), ref = zopt_ref::q8_encode(m.ref, m.isUnsigned, x, a);
    if (got != want || ref != want) {
      ok = false;
      char w[160];
      std::snprintf(w, sizeof w, " [%s: x=%a absmax=%a -> %u, reference %u, want %u]", what, x, a, got, ref, want);
      why += w;
    }
  };
  if (m.isUnsigned) {
    expect(tiny, 1.0f, 1, "subnormal v");
    expect(1e-40f, 1e30f, 1, "v / absmax underflows to 0");
    expect(1e-30f, 1.0f, 1, "v far below the smallest code");
    expect(m.ref[1] * 0.49f, 1.0f, 1, "v below half the smallest code");
    expect(-tiny, 1.0f, 1, "a negative v (never produced by Adam)");
  } else {
    expect(tiny, 1.0f, m.zero, "subnormal m");
    expect(-tiny, 1.0f, m.zero, "-subnormal m");
  }
  expect(0.0f, 1.0f, m.zero, "+0");
  expect(-0.0f, 1.0f, m.zero, "-0");
  expect(0.0f, 0.0f, m.zero, "a block of zeros (absmax 0)");
  expect(0.5f, nan, m.zero, "absmax NaN");
  expect(0.5f, inf, m.zero, "absmax inf");
  expect(inf, inf, m.zero, "x inf, absmax inf");
  expect(nan, nan, m.zero, "x NaN, absmax NaN");
  expect(1.0f, 1.0f, 255, "x = absmax");
  std::snprintf(buf, sizeof buf, "zero point and specials %s: nonzero v never code 0; +-0, absmax 0, "
                "NaN and inf absmax give the zero code%s", m.name, why.c_str());
  report(ok, buf);
  const bool dec = std::isnan(zopt_q8_decode(m.zero, nan, m.isUnsigned)) &&
                   std::isnan(zopt_q8_decode(m.zero, inf, m.isUnsigned)) &&
                   zopt_q8_decode(m.zero, 0.0f, m.isUnsigned) == 0.0f &&
                   zopt_q8_decode(uint8_t(m.zero + 1), 0.0f, m.isUnsigned) == 0.0f;
  std::snprintf(buf, sizeof buf, "decode %s: the zero code under a NaN or inf absmax is NaN, under "
                "absmax 0 is 0", m.name);
  report(dec, buf);
}

} // namespace

int main(int argc, char **argv) {
  uint64_t stride = 97;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--stride=", 9) == 0 && std::atoll(argv[i] + 9) > 0) {
      stride = uint64_t(std::atoll(argv[i] + 9));
    } else {
      std::fprintf(stderr, "usage: %s [--stride=N]\n", argv[0]);
      return 2;
    }
  }
  Map maps[2] = {{"signed", false, zopt_q8_signed_map, {}, ZOPT_Q8_SIGNED_ZERO},
                 {"unsigned", true, zopt_q8_unsigned_map, {}, ZOPT_Q8_UNSIGNED_ZERO}};
  for (Map &m : maps) {
    zopt_ref::q8_map_f32(!m.isUnsigned, m.ref);
    checkDecode(m);
    checkEncode(m, stride);
    checkZeroAndSpecials(m);
  }
  std::printf("%d passed, %d failed\n", gPassed, gFailed);
  return gFailed ? 1 : 0;
}

//===- zopt_reference.h - the float64 reference of the numerics contract --===//
//
// docs/NUMERICS.md implemented once, for every C/C++ test (zopt-kernel-check,
// zopt_test_step, the backend conformance suite, the ZeRO check): the
// section numbers below are the contract's. Header-only; depends on abi.h
// alone (the stochastic-rounding hash there is the definition, §7).
//
//   §1  storage types: exact decoding of bf16/f16, round-to-nearest-even
//       encoding (two independent implementations, cross-checked by
//       zopt-kernel-check's self-test), load/store by zopt_dtype
//   §1  the per-(group, step) coefficients in float64, rounded once to f32
//   §2  the gradient: g * f32(1/(S*D)) * f32(c), maximize
//   §3  the norm (abi.h's SUMSQ order inside a block), clip, skip
//   §4  the rules, per element, over a value type V: double for a plain
//       float64 model, or a test's own type that also carries an error
//       bound (zopt-kernel-check), through zopt_ref::Num<V>
//   §5  the loss scaler, §6 whether the step counts advance, and CONTROL
//       (abi.h zopt_control) composed of §3, §5, §6
//   §7  stochastic rounding of bf16
//   §9  remainder masters: the split of an f32 master into a bf16 param and
//       an int16 remainder, by values (abi.h's bit formulas are checked
//       against it), and the rebuild
//   §11 Kahan-compensated params: the store of the param and its
//       compensation, in f32 operations done in double and rounded once
//   §10 q8 moments: the two dynamic maps built in float64 (the generated
//       tables of zopt/q8_maps.h are checked against them), the encode by
//       float64 midpoints (abi.h's threshold search is checked against it),
//       the decode
//
// A change to the contract changes this file; a test that needs a value of
// the contract asks this file for it instead of writing its own formula.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_REFERENCE_H
#define ZOPT_TEST_REFERENCE_H

#include "zopt/abi.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace zopt_ref {

//===----------------------------------------------------------------------===//
// §1 Storage types.
//===----------------------------------------------------------------------===//

inline uint32_t f32_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline uint64_t f64_bits(double f) { uint64_t b; std::memcpy(&b, &f, 8); return b; }
inline float bits_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

inline size_t dtype_size(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : dt == ZOPT_DTYPE_Q8 ? 1 : 2; }
inline const char *dtype_name(uint32_t dt) {
  return dt == ZOPT_DTYPE_F32    ? "f32"
         : dt == ZOPT_DTYPE_BF16 ? "bf16"
         : dt == ZOPT_DTYPE_F16  ? "f16"
         : dt == ZOPT_DTYPE_I16  ? "i16"
         : dt == ZOPT_DTYPE_Q8   ? "q8"
                                 : "?";
}

/// Exact widening of a 16-bit value.
inline double decode_bf16(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
inline double decode_f16(uint16_t h) {
  int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp(double(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(double(1024 + m), e - 25);
  return sign ? -v : v;
}

/// Rounds a double to a binary format with `p` significand bits (implicit
/// one included), minimum normal exponent emin and maximum exponent emax,
/// to nearest even, overflowing to infinity. Generic, via the FPU's RNE.
inline double round_format(double x, int p, int emin, int emax) {
  if (!std::isfinite(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);
  int lead = std::max(e - 1, emin);
  double q = std::ldexp(1.0, lead - (p - 1));
  double r = std::nearbyint(x / q) * q;
  if (std::fabs(r) >= std::ldexp(1.0, emax + 1)) r = std::copysign(INFINITY, x);
  return r;
}
inline double round_bf16(double x) { return round_format(x, 8, -126, 127); }
inline double round_f16(double x) { return round_format(x, 11, -14, 15); }
inline double round_f32(double x) { return round_format(x, 24, -126, 127); }

/// The bits of an exactly representable (already rounded) double.
inline uint16_t encode_bf16_exact(double r) {
  if (std::isnan(r)) return 0x7FC0;
  return uint16_t(f32_bits(float(r)) >> 16);
}
inline uint16_t encode_f16_exact(double r) {
  if (std::isnan(r)) return 0x7E00;
  uint16_t s = std::signbit(r) ? 0x8000 : 0;
  double a = std::fabs(r);
  if (std::isinf(a)) return s | 0x7C00;
  if (a == 0) return s;
  int e;
  std::frexp(a, &e);
  int lead = e - 1;
  if (lead < -14) return s | uint16_t(a / std::ldexp(1.0, -24));
  return s | uint16_t((lead + 15) << 10) | uint16_t(a / std::ldexp(1.0, lead) * 1024.0 - 1024.0);
}
/// RNE of a double (one rounding), through the generic rounding.
inline uint16_t rne_bf16(double x) { return encode_bf16_exact(round_bf16(x)); }
inline uint16_t rne_f16(double x) { return encode_f16_exact(round_f16(x)); }

/// The second implementation: RNE of an f32's bits in integer arithmetic
/// (non-NaN inputs; as the kernels narrow).
inline uint16_t rne_bf16_bits(uint32_t b) { return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16); }
inline uint16_t rne_f16_bits(uint32_t b) {
  uint16_t s = (b >> 16) & 0x8000;
  int e = int((b >> 23) & 0xFF);
  uint32_t m = b & 0x7FFFFF;
  if (e == 0xFF) return s | 0x7C00;  // inf (NaN not handled here)
  if (e == 0) return s;              // f32 denormals are < 2^-126
  int ue = e - 127;                  // unbiased
  uint32_t sig = m | 0x800000;       // 24 bits
  int shift;                         // bits to drop from sig
  uint32_t expField;
  if (ue >= -14) { shift = 13; expField = uint32_t(ue + 15); }
  else { shift = 13 + (-14 - ue); expField = 0; }
  if (shift > 25) return s;          // < 2^-25 (half of min denormal)
  uint32_t kept = sig >> shift;
  uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (kept & 1))) ++kept;
  uint32_t bits;
  if (expField) bits = (expField << 10) + (kept - 1024);  // carry ok
  else bits = kept;                                      // may become normal
  if (bits >= 0x7C00) return s | 0x7C00;
  return uint16_t(s | bits);
}

inline bool is_nan_bits(uint32_t bits, uint32_t dt) {
  switch (dt) {
  case ZOPT_DTYPE_F32: return (bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu);
  case ZOPT_DTYPE_BF16: return (bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu);
  case ZOPT_DTYPE_F16: return (bits & 0x7C00u) == 0x7C00u && (bits & 0x3FFu);
  }
  return false;
}

/// An f32 stored as `dt` (§1 "Stores"): RNE, a NaN stays a quiet NaN (bf16
/// keeps the payload's high half, as the kernels do).
inline uint16_t to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  return rne_bf16_bits(u);
}
inline uint16_t to_f16(float f) { return rne_f16(double(f)); }
inline float from_bf16(uint16_t h) { return float(decode_bf16(h)); }
inline float from_f16(uint16_t h) { return float(decode_f16(h)); }

/// Element i of an array of dtype `dt`, widened exactly / stored rounded.
inline float load(const void *p, uint32_t dt, size_t i) {
  if (dt == ZOPT_DTYPE_F32) { float f; std::memcpy(&f, (const char *)p + 4 * i, 4); return f; }
  uint16_t h;
  std::memcpy(&h, (const char *)p + 2 * i, 2);
  return dt == ZOPT_DTYPE_BF16 ? from_bf16(h) : from_f16(h);
}
inline void store(void *p, uint32_t dt, size_t i, float v) {
  if (dt == ZOPT_DTYPE_F32) { std::memcpy((char *)p + 4 * i, &v, 4); return; }
  uint16_t h = dt == ZOPT_DTYPE_BF16 ? to_bf16(v) : to_f16(v);
  std::memcpy((char *)p + 2 * i, &h, 2);
}
/// v rounded to `dt` and widened again.
inline float round_to(float v, uint32_t dt) {
  if (dt == ZOPT_DTYPE_F32) return v;
  return dt == ZOPT_DTYPE_BF16 ? from_bf16(to_bf16(v)) : from_f16(to_f16(v));
}

//===----------------------------------------------------------------------===//
// §1 Coefficients and §4 the rules.
//===----------------------------------------------------------------------===//

enum class Rule { Adam, AdamW, AdamAmsgrad, Sgd, SgdNesterov, Lion };

/// A group's hyperparameters for one step (the slots of abi.h).
struct Hypers {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, momentum = 0, dampening = 0;
  bool bias_correction = true;
};

/// Everything the element math multiplies by that depends only on the
/// hyperparameters and the step count t: computed in float64, and (with
/// rounded()) rounded once to f32, as a step's PREPARE does (§1).
struct Coeffs {
  double lr, wd, decay;            // decay = 1 - lr*wd (decoupled)
  double b1, one_minus_b1, b2, one_minus_b2, eps;
  double inv_bc1, inv_sqrt_bc2;    // 1/bc1, 1/sqrt(bc2) (1 without bias correction)
  double mu, one_minus_damp;       // SGD
};

inline Coeffs coefficients(const Hypers &h, double t) {
  Coeffs c;
  c.lr = h.lr;
  c.wd = h.weight_decay;
  c.decay = 1 - h.lr * h.weight_decay;
  c.b1 = h.beta1;
  c.one_minus_b1 = 1 - h.beta1;
  c.b2 = h.beta2;
  c.one_minus_b2 = 1 - h.beta2;
  c.eps = h.eps;
  const double bc1 = h.bias_correction ? 1 - std::pow(h.beta1, t) : 1;
  const double bc2 = h.bias_correction ? 1 - std::pow(h.beta2, t) : 1;
  c.inv_bc1 = 1 / bc1;
  c.inv_sqrt_bc2 = 1 / std::sqrt(bc2);
  c.mu = h.momentum;
  c.one_minus_damp = 1 - h.dampening;
  return c;
}

inline Coeffs rounded(Coeffs c) {
  double *f[] = {&c.lr, &c.wd, &c.decay, &c.b1, &c.one_minus_b1, &c.b2, &c.one_minus_b2,
                 &c.eps, &c.inv_bc1, &c.inv_sqrt_bc2, &c.mu, &c.one_minus_damp};
  for (double *x : f) *x = double(float(*x));
  return c;
}

/// How the rules compute with a value type V. The default is a plain
/// number (double); a test specializes it for a type that carries more
/// (zopt-kernel-check: an f64 value with a running error bound).
template <class V> struct Num {
  static V coef(double c) { return V(c); }   // a coefficient (f32 in the kernel)
  static V exact(double x) { return V(x); }  // an exactly known value
  static V sqrt(const V &x) { using std::sqrt; return sqrt(x); }
  static V max(const V &a, const V &b) { return a >= b ? a : b; }
  static double value(const V &x) { return double(x); }
};

/// One element's states (those the rule has; the others are ignored).
template <class V> struct Elem {
  V p, m, v, vmax, buf;
};

/// What Lion's sign saw: the interpolation and the decayed param, so a test
/// can accept the other sign where the interpolation lies within its error.
template <class V> struct LionTrace {
  V interp, p_decayed;
};

/// §2: the gradient the rule reads, from the stored gradient g_s (widened),
/// the gradient scale 1/(S*D) and the clip coefficient (each a
/// coefficient: rounded to f32), negated for a maximizing group.
inline double gradient(double g_s, double grad_scale, double clip, bool maximize = false) {
  double g = g_s * double(float(grad_scale)) * double(float(clip));
  return maximize ? -g : g;
}

/// torch.sign: +-0 and NaN pass through.
inline double sign(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : x; }

/// §4: one step of `rule` on one element, with gradient `g` (§2) and the
/// coefficients of its group at its tensor's step count (`first`: t == 1).
/// `has_buf`: SGD with a momentum buffer state.
template <class V>
void step_element(Rule rule, const Coeffs &c, bool first, bool has_buf, V g, Elem<V> &s,
                  LionTrace<V> *lion = nullptr) {
  using N = Num<V>;
  switch (rule) {
  case Rule::Adam: case Rule::AdamW: case Rule::AdamAmsgrad: {
    if (rule != Rule::AdamW) g = g + N::coef(c.wd) * s.p;  // L2
    s.m = N::coef(c.b1) * s.m + N::coef(c.one_minus_b1) * g;
    s.v = N::coef(c.b2) * s.v + N::coef(c.one_minus_b2) * g * g;
    V vv = s.v;
    if (rule == Rule::AdamAmsgrad) { s.vmax = N::max(s.vmax, s.v); vv = s.vmax; }
    V u = (s.m * N::coef(c.inv_bc1)) / (N::sqrt(vv) * N::coef(c.inv_sqrt_bc2) + N::coef(c.eps));
    V pd = rule == Rule::AdamW ? s.p * N::coef(c.decay) : s.p;
    s.p = pd - N::coef(c.lr) * u;
    break;
  }
  case Rule::Sgd: case Rule::SgdNesterov: {
    g = g + N::coef(c.wd) * s.p;
    V d = g;
    if (has_buf) {
      s.buf = first || c.mu == 0 ? g : N::coef(c.mu) * s.buf + N::coef(c.one_minus_damp) * g;
      d = rule == Rule::SgdNesterov ? g + N::coef(c.mu) * s.buf : s.buf;
    }
    s.p = s.p - N::coef(c.lr) * d;
    break;
  }
  case Rule::Lion: {
    V cc = N::coef(c.b1) * s.m + N::coef(c.one_minus_b1) * g;
    V pd = s.p * N::coef(c.decay);
    if (lion) *lion = {cc, pd};
    s.p = pd - N::coef(c.lr) * N::exact(sign(N::value(cc)));
    s.m = N::coef(c.b2) * s.m + N::coef(c.one_minus_b2) * g;
    break;
  }
  }
}

//===----------------------------------------------------------------------===//
// §2, §3 The gradient scale, the norm, clipping, the skip.
//===----------------------------------------------------------------------===//

/// The gradient scale as the kernels multiply by it: f32(1 / (S * D)).
inline float grad_scale(double S, double D) { return float(1.0 / (S * D)); }

/// The value the norm is taken of: the stored gradient times the gradient
/// scale, one f32 multiplication.
inline float norm_value(float g_s, float scale) { return g_s * scale; }

/// One block's partial: abi.h's SUMSQ order (ZOPT_SUMSQ_LANES f64 lanes,
/// element i into lane i mod lanes, the lanes added left to right).
template <class Get> double sumsq_block(size_t n, Get x) {
  double lane[ZOPT_SUMSQ_LANES] = {0};
  for (size_t i = 0; i < n; ++i) {
    const double v = double(x(i));
    lane[i % ZOPT_SUMSQ_LANES] += v * v;
  }
  double s = lane[0];
  for (int l = 1; l < ZOPT_SUMSQ_LANES; ++l) s += lane[l];
  return s;
}

/// The sum of squares summed in long double (64-bit mantissa): the value
/// any f64 order approximates, for a tolerance check.
template <class Get> long double sumsq_exact(size_t n, Get x) {
  long double s = 0;
  for (size_t i = 0; i < n; ++i) {
    const long double v = (long double)double(x(i));
    s += v * v;
  }
  return s;
}

/// The relative error bound of any f64 summation order of n non-negative
/// terms against sumsq_exact (first order): (n-1) 2^-53 (+1%) plus the
/// long double sum's own n 2^-63.
inline double sumsq_tolerance(size_t n, double sum) {
  return double(n > 1 ? n - 1 : 0) * std::ldexp(1.0, -53) * sum * 1.01 + double(n) * std::ldexp(1.0, -63) * sum;
}

inline bool takes_norm(uint32_t flags) { return flags & ZOPT_FLAG_SUMSQ; }
inline double norm(double sumsq) { return std::sqrt(sumsq); }
/// PyTorch's clip_grad_norm_: min(1, max_norm / (norm + 1e-6)), in f64.
inline double clip_coef(double norm, double max_norm) {
  double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}
inline bool skips(uint32_t flags, double sumsq) { return takes_norm(flags) && !std::isfinite(sumsq); }

//===----------------------------------------------------------------------===//
// §5 The loss scaler, §6 step counts, CONTROL.
//===----------------------------------------------------------------------===//

struct Scaler {
  double scale, growth_factor, backoff_factor, min_scale;
  int64_t growth_interval, good_steps;
  bool dynamic;
};

/// The scaler after a step (skipped or taken).
inline Scaler scaler_after(Scaler s, bool skipped) {
  if (!s.dynamic) return s;
  if (skipped) {
    double b = s.scale * s.backoff_factor;
    s.scale = b < s.min_scale ? s.min_scale : b;
    s.good_steps = 0;
  } else if (s.good_steps + 1 >= s.growth_interval) {
    double g = s.scale * s.growth_factor;
    if (std::isfinite(g)) s.scale = g;
    s.good_steps = 0;
  } else {
    s.good_steps = s.good_steps + 1;
  }
  return s;
}

/// §6: a taken step advances the counts of its updated tensors and their
/// groups; a skipped one advances none.
inline bool counts_advance(bool skipped) { return !skipped; }

/// What CONTROL (abi.h) decides.
struct Control {
  double norm, clip, scale;
  int64_t good;
  bool skip, advance;
};

/// CONTROL for a step with descriptor flags `flags`, from its inputs.
inline Control control(uint32_t flags, const zopt_control &in) {
  Control o;
  o.norm = takes_norm(flags) ? norm(in.sumsq) : std::numeric_limits<double>::quiet_NaN();
  o.skip = skips(flags, in.sumsq);
  o.clip = (flags & ZOPT_FLAG_CLIP) && !o.skip ? clip_coef(o.norm, in.max_norm) : 1.0;
  o.advance = counts_advance(o.skip);
  Scaler s{in.scale, in.growth_factor, in.backoff_factor, in.min_scale, in.growth_interval, in.good_steps,
           in.dynamic != 0};
  if (flags & ZOPT_FLAG_LOSS_SCALE) s = scaler_after(s, o.skip);
  o.scale = s.scale;
  o.good = s.good_steps;
  return o;
}

//===----------------------------------------------------------------------===//
// §7 Stochastic rounding.
//===----------------------------------------------------------------------===//

/// x stored as a stochastically rounded bf16: element i of state slot
/// `slot` under key (abi.h zopt_sr_key); NaN rounds as RNE.
inline uint16_t sr_bf16(float x, uint32_t key, uint32_t slot, uint32_t i) {
  if (std::isnan(x)) return to_bf16(x);
  return uint16_t((f32_bits(x) + zopt_sr_bits(key, slot, i)) >> 16);
}

//===----------------------------------------------------------------------===//
// §9 Remainder masters.
//===----------------------------------------------------------------------===//

/// The bf16 param of an f32 master x, by values: the nearer of the two bf16
/// values around x (the truncation t of x and the next bf16 away from
/// zero), ties to the one away from zero; a NaN is quieted as RNE. (abi.h's
/// zopt_remainder_split does it on bits.)
inline uint16_t remainder_param(float x) {
  if (std::isnan(x)) return to_bf16(x);
  const uint32_t b = f32_bits(x);
  const uint16_t t = uint16_t(b >> 16), up = uint16_t(t + 1);
  const double dt = std::fabs(double(x) - decode_bf16(t));
  // The next bf16 away from zero of the largest finite is infinite: its
  // distance is taken as the distance to 2^128, where it would lie.
  const double vu = (up & 0x7FFF) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), double(x))
                                            : decode_bf16(up);
  const double du = std::fabs(vu - double(x));
  if ((b & 0x7FFFFFFFu) >= 0x7F800000u) return t;  // infinite
  return du <= dt ? up : t;
}
/// The remainder: bits(x) - bits(param) << 16, which fits int16.
inline uint16_t remainder_rem(float x) {
  const int64_t d = int64_t(f32_bits(x)) - (int64_t(remainder_param(x)) << 16);
  return uint16_t(int16_t(std::isnan(x) ? int64_t(int16_t(uint16_t(f32_bits(x)))) : d));
}
/// The f32 master a param and a remainder stand for.
inline float remainder_master(uint16_t param, uint16_t rem) {
  return bits_f32(uint32_t(int64_t(uint32_t(param) << 16) + int64_t(int16_t(rem))));
}

//===----------------------------------------------------------------------===//
// §10 q8 moments.
//===----------------------------------------------------------------------===//

/// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7,
/// total_bits=8) in float64, sorted ascending: the 256 values before their
/// rounding to f32 (docs/NUMERICS.md §10 gives the construction).
inline void q8_map_f64(bool is_signed, double out[256]) {
#pragma clang fp contract(off)
  static const double scales[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  int n = 0;
  for (int i = 0; i < 7; ++i) {
    const int f = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const double step = (1.0 - 0.1) / (f - 1);
    double b[129];
    for (int k = 0; k < f; ++k) // torch.linspace's two-sided formula
      b[k] = k < f / 2 ? 0.1 + k * step : 1.0 - (f - 1 - k) * step;
    for (int k = 0; k + 1 < f; ++k) {
      const double m = (b[k] + b[k + 1]) / 2.0;
      out[n++] = scales[i] * m;
      if (is_signed) out[n++] = -(scales[i] * m);
    }
  }
  out[n++] = 0.0;
  out[n++] = 1.0;
  std::sort(out, out + n);
}

/// The f32 map (the float64 values rounded to nearest even).
inline void q8_map_f32(bool is_signed, float out[256]) {
  double d[256];
  q8_map_f64(is_signed, d);
  for (int k = 0; k < 256; ++k) out[k] = float(d[k]);
}

/// The code of x in a block with absmax a, by values: r = x / a (f32); the
/// map value nearest to r by the float64 midpoints of adjacent f32 map
/// values, a tie going to the smaller magnitude; the unsigned map never
/// gives a nonzero x the zero code (code 1 instead); a = 0 or not finite:
/// the zero code (127 signed, 0 unsigned).
inline uint8_t q8_encode(const float map[256], bool is_unsigned, float x, float a) {
  if (!(a > 0.0f) || !std::isfinite(a)) return is_unsigned ? 0 : 127;
  const float r = x / a;
  // up(k): r belongs above the midpoint of map[k] and map[k+1] (monotone).
  auto up = [&](int k) {
    const double mid = (double(map[k]) + double(map[k + 1])) / 2.0; // exact
    return mid > 0 ? double(r) > mid : double(r) >= mid;
  };
  int lo = 0, hi = 255; // the code: the first k with !up(k), or 255
  while (lo < hi) {
    const int m = (lo + hi) / 2;
    if (up(m)) lo = m + 1;
    else hi = m;
  }
  if (is_unsigned && lo == 0 && x != 0.0f) lo = 1;
  return uint8_t(lo);
}

/// map[code] * a in f32.
inline float q8_decode(const float map[256], uint8_t code, float a) { return map[code] * a; }

//===----------------------------------------------------------------------===//
// §11 Kahan-compensated params.
//===----------------------------------------------------------------------===//

/// An f32 operation's result: the exact double result of two floats rounded
/// once to f32 (a double holds more than 2*24+2 bits, so rounding the double
/// sum or difference to float is the correctly rounded f32 operation).
inline float f32_add(float a, float b) { return float(double(a) + double(b)); }
inline float f32_sub(float a, float b) { return float(double(a) - double(b)); }

/// The store of a Kahan-compensated param (docs/NUMERICS.md §11): param p
/// and compensation c (bf16 bits), the rule's new f32 value v; the new
/// param and compensation (bits), each rounded to nearest even (to_bf16: a
/// NaN stays a quiet NaN). (abi.h's zopt_kahan_store is checked against it.)
struct KahanOut { uint16_t p, c; };
/// The compensation after the store made param p the new param np: given
/// np, monotone in v (and np is monotone in v).
inline uint16_t kahan_comp(uint16_t p, uint16_t c, float v, uint16_t np) {
  const float pf = float(decode_bf16(p));
  const float y = f32_add(f32_sub(v, pf), float(decode_bf16(c)));
  return to_bf16(f32_sub(y, f32_sub(float(decode_bf16(np)), pf)));
}
inline KahanOut kahan_store(uint16_t p, uint16_t c, float v) {
  const float pf = float(decode_bf16(p));
  const float y = f32_add(f32_sub(v, pf), float(decode_bf16(c)));
  const uint16_t np = to_bf16(f32_add(pf, y));
  return {np, kahan_comp(p, c, v, np)};
}

}  // namespace zopt_ref

#endif

//===- kernel-check.h - what the files of zopt-kernel-check share -*- C++ -*-===//
//
// zopt-kernel-check (kernel-check.cpp says what it checks and with which
// tolerances) in files: kernel-check.cpp (main, the descriptor, PREPARE,
// the self-test), kernel-check-update.cpp (UPDATE against the reference,
// the narrowing stores), kernel-check-sumsq.cpp (SUMSQ), kernel-check-q8.cpp
// (UPDATE kernels with q8 moments). This header: the
// PASS/FAIL lines, the reference's storage helpers, the error-bound type E
// the reference's rules run on, a run's configuration, the step's kernels,
// guarded buffers.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_KERNEL_CHECK_H
#define ZOPT_TEST_KERNEL_CHECK_H

#include "zopt_reference.h"
#include "zopt/abi.h"
#include "zopt/cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kc {

inline int gPassed = 0, gFailed = 0;

inline void report(bool ok, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::printf("%s ", ok ? "PASS" : "FAIL");
  std::vprintf(fmt, ap);
  std::printf("\n");
  va_end(ap);
  (ok ? gPassed : gFailed)++;
  std::fflush(stdout);
}

//===----------------------------------------------------------------------===//
// Storage types: the reference's (test/reference/zopt_reference.h: exact
// decode, two independent RNE encodings, cross-checked in selfTest()).
//===----------------------------------------------------------------------===//

using zopt_ref::bits_f32;
using zopt_ref::decode_bf16;
using zopt_ref::decode_f16;
using zopt_ref::dtype_name;
using zopt_ref::dtype_size;
using zopt_ref::f32_bits;
using zopt_ref::f64_bits;
using zopt_ref::is_nan_bits;
using zopt_ref::rne_bf16;
using zopt_ref::rne_bf16_bits;
using zopt_ref::rne_f16;
using zopt_ref::rne_f16_bits;
using zopt_ref::round_f32;

inline const char *kindName(uint32_t k) {
  static const char *n[] = {"?", "param", "grad", "master", "exp_avg",
                            "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                            "exp_avg_absmax", "exp_avg_sq_absmax", "kahan_comp"};
  return k < 11 ? n[k] : "?";
}

// Monotone integer index of a 16-bit value (sign-magnitude -> two's complement)
inline int32_t ord16(uint16_t b) { int32_t m = b & 0x7FFF; return (b & 0x8000) ? -m : m; }

//===----------------------------------------------------------------------===//
// f64 values with a first-order running error bound (in units of u).
//===----------------------------------------------------------------------===//

struct E {
  double v, s; // value, accumulated bound: |f32 computation - v| <= u*s
};
inline E exact(double v) { return {v, 0}; }
inline E coef(double v) { return {v, std::fabs(v)}; } // rounded once to f32
inline E operator+(E a, E b) { double v = a.v + b.v; return {v, a.s + b.s + std::fabs(v)}; }
inline E operator-(E a, E b) { double v = a.v - b.v; return {v, a.s + b.s + std::fabs(v)}; }
inline E operator*(E a, E b) {
  double v = a.v * b.v;
  return {v, std::fabs(a.v) * b.s + std::fabs(b.v) * a.s + std::fabs(v)};
}
inline E operator/(E a, E b) {
  double v = a.v / b.v;
  return {v, a.s / std::fabs(b.v) + std::fabs(a.v) * b.s / (b.v * b.v) + std::fabs(v)};
}
inline E esqrt(E a) { double v = std::sqrt(a.v); return {v, a.s / (2 * v) + v}; }
inline E emax(E a, E b) { return a.v >= b.v ? E{a.v, std::max(a.s, b.s)} : E{b.v, std::max(a.s, b.s)}; }

} // namespace kc

// The reference's rules computed on E (zopt_reference.h, Num<V>).
template <> struct zopt_ref::Num<kc::E> {
  using E = kc::E;
  static E coef(double c) { return kc::coef(c); }
  static E exact(double x) { return kc::exact(x); }
  static E sqrt(const E &x) { return kc::esqrt(x); }
  static E max(const E &a, const E &b) { return kc::emax(a, b); }
  static double value(const E &x) { return x.v; }
};

namespace kc {

const double kU = std::ldexp(1.0, -24);
const double kK = 2.0;
inline double tolOf(const E &e) { return kK * kU * e.s + 1e-38; }

//===----------------------------------------------------------------------===//
// Rule and run configuration.
//===----------------------------------------------------------------------===//

using zopt_ref::Rule;

struct Config {
  double t;
  bool biasCorrection;
  double clipCoef;     // global 1
  double invLossScale; // global 2
  double lr;           // overrides for the RNE check
  double wd;
};

// The hyperparameters of every run (the RNE check overrides lr and wd).
struct Hypers : zopt_ref::Hypers {
  Hypers() {
    lr = 1e-2; beta1 = 0.9; beta2 = 0.99; eps = 1e-8; weight_decay = 0.1; momentum = 0.9; dampening = 0.1;
    bias_correction = true;
  }
};

struct Step {
  const zopt_step_descriptor *d = nullptr;
  void *lib = nullptr;
  Rule rule;
  bool clip = false, lossScale = false;
  bool remainder = false; // the master is a remainder (I16; abi.h)
  bool q8 = false;        // some moment is q8 (abi.h "q8 moments")
  bool kahan = false;     // the param is Kahan-compensated (KAHAN_COMP; abi.h)
  int idx[11]; // state index by kind, -1 if absent
  zopt_prepare_fn prepare = nullptr;
  zopt_control_fn control = nullptr;
  int nControl = 0;
  std::vector<std::pair<uint32_t, zopt_update_fn>> updates; // isa, fn
  std::vector<std::pair<uint32_t, zopt_sumsq_fn>> sumsqs;
  std::vector<zopt_sumsq2_fn> sumsq2s; // sumsqs[i]'s pair entry or null (abi.h "SUMSQ pairs")
};

inline const char *isaName(uint32_t isa) { return zopt_isa_name(isa); }

inline bool cpuRuns(uint32_t isa) { return zopt_cpu_runs_isa(isa) != 0; }

// Fills the descriptor-ordered hyperparameter array.
inline std::vector<double> hyperArray(const Step &st, const Hypers &h) {
  std::vector<double> out;
  for (uint32_t i = 0; i < st.d->num_hypers; ++i) {
    switch (st.d->hypers[i].kind) {
    case ZOPT_HYPER_LR: out.push_back(h.lr); break;
    case ZOPT_HYPER_BETA1: out.push_back(h.beta1); break;
    case ZOPT_HYPER_BETA2: out.push_back(h.beta2); break;
    case ZOPT_HYPER_EPS: out.push_back(h.eps); break;
    case ZOPT_HYPER_WEIGHT_DECAY: out.push_back(h.weight_decay); break;
    case ZOPT_HYPER_MOMENTUM: out.push_back(h.momentum); break;
    case ZOPT_HYPER_DAMPENING: out.push_back(h.dampening); break;
    case ZOPT_HYPER_BIAS_CORRECTION: out.push_back(h.bias_correction ? 1 : 0); break;
    default: out.push_back(NAN);
    }
  }
  return out;
}

//===----------------------------------------------------------------------===//
// Buffers: one per state, with a prefix offset (misalignment) and a guard.
//===----------------------------------------------------------------------===//

constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xA5;

struct Buf {
  uint32_t dtype;
  std::vector<uint8_t> mem; // offset + n + kGuard elements, 64-aligned data()
  size_t off, n;
  uint8_t *ptr() { return mem.data() + off * dtype_size(dtype); }
  uint32_t bits(size_t i) const {
    const uint8_t *p = mem.data() + (off + i) * dtype_size(dtype);
    if (dtype == ZOPT_DTYPE_F32) { uint32_t b; std::memcpy(&b, p, 4); return b; }
    if (dtype == ZOPT_DTYPE_Q8) return *p;
    uint16_t b; std::memcpy(&b, p, 2); return b;
  }
  void setBits(size_t i, uint32_t b) {
    uint8_t *p = mem.data() + (off + i) * dtype_size(dtype);
    if (dtype == ZOPT_DTYPE_F32) std::memcpy(p, &b, 4);
    else if (dtype == ZOPT_DTYPE_Q8) *p = uint8_t(b);
    else { uint16_t h = uint16_t(b); std::memcpy(p, &h, 2); }
  }
  double value(size_t i) const {
    uint32_t b = bits(i);
    if (dtype == ZOPT_DTYPE_F32) return bits_f32(b);
    if (dtype == ZOPT_DTYPE_BF16) return decode_bf16(uint16_t(b));
    return decode_f16(uint16_t(b));
  }
  // Stores x rounded (RNE) to the storage type; returns the stored value.
  double store(size_t i, double x) {
    if (dtype == ZOPT_DTYPE_F32) setBits(i, f32_bits(float(round_f32(x))));
    else if (dtype == ZOPT_DTYPE_BF16) setBits(i, rne_bf16(x));
    else setBits(i, rne_f16(x));
    return value(i);
  }
  bool guardsIntact() const {
    size_t es = dtype_size(dtype);
    for (size_t i = 0; i < off * es; ++i) if (mem[i] != kGuardByte) return false;
    for (size_t i = (off + n) * es; i < mem.size(); ++i) if (mem[i] != kGuardByte) return false;
    return true;
  }
};

inline Buf makeBuf(uint32_t dtype, size_t n, size_t off) {
  Buf b;
  b.dtype = dtype; b.n = n; b.off = off;
  b.mem.assign((off + n + kGuard) * dtype_size(dtype), kGuardByte);
  return b;
}

//===----------------------------------------------------------------------===//
// The float64 reference.
//===----------------------------------------------------------------------===//

// The reference's rule on E for one element (kernel-check-update.cpp).
struct RefIn { double p, g, m, v, vm, buf; };
struct RefOut {
  E p, m, v, vm, buf;
  bool ambiguous = false; // Lion: sign of the interpolation within its error
  E pAlt, pZero;          // Lion: p with the other sign / with sign 0
};

RefOut reference(Rule rule, const Hypers &h, const Config &c, bool hasBuf, RefIn in);

// kernel-check.cpp: the step's descriptor validated and its kernels found;
// PREPARE run (finite, deterministic, only its coefficients written) and
// its coefficients named; the reference's conversions cross-checked.
bool loadStep(const char *path, Step &st);
std::vector<float> runPrepare(const Step &st, const Hypers &h, const Config &c, bool &ok);
void identifyCoeffs(const Step &st, const Hypers &h, const Config &c, const std::vector<float> &co, const char *tag);
bool selfTest();
// Values for a state of `kind` (kernel-check-update.cpp).
struct Gen {
  std::mt19937_64 rng;
  explicit Gen(uint64_t seed) : rng(seed) {}
  double uni(double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); }
  double sgn() { return (rng() & 1) ? 1.0 : -1.0; }
};
double genFor(uint32_t kind, Gen &gen, const Config &c);
const char *configTag(const Config &c, char *buf, size_t len);
// kernel-check-update.cpp: an UPDATE variant against the reference; the
// bit-exact narrowing of an f32 master into a 16-bit param.
void checkUpdate(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n, const Config &c, uint64_t seed);
std::vector<uint32_t> specialValues(uint32_t pdt);
void checkRne(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n);
// kernel-check-narrow.cpp: --rne on an Adam(W) step with bf16 moments and no
// master (the narrowing of m' and v' on special values).
bool narrowCheckApplies(const Step &st);
void checkNarrowMoments(const Step &st, uint32_t isa, zopt_update_fn fn);
// Every variant this CPU runs against the others at n = 1..67 (the tails).
void checkUpdateTails(const Step &st, uint64_t seed);
// A remainder master (abi.h "Remainder masters"): the f32 master bits that
// param bits p and remainder bits r stand for, and x split into both.
inline uint32_t joinedMaster(uint32_t p, uint32_t r) {
  return f32_bits(zopt_ref::remainder_master(uint16_t(p), uint16_t(r)));
}
// kernel-check-remainder.cpp: a remainder step against its f32-master twin,
// `steps` steps, bit for bit.
void checkRemainderTwin(const Step &st, const Step &twin, uint32_t isa, zopt_update_fn fa,
                        zopt_update_fn fb, size_t n, int steps, uint64_t seed);
// kernel-check-q8.cpp: an UPDATE variant of a step with q8 moments against
// the reference (decoded inputs, float64 rule, the block's absmax and the
// codes as the reference encodes the kernel's f32 values).
void checkQ8Update(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n, const Config &c,
                   uint64_t seed);
// Every variant the CPU runs bit for bit on the same inputs; zero, NaN and
// zero-point blocks (kernel-check-q8.cpp).
void checkQ8Isas(const Step &st, size_t n);
// kernel-check-kahan.cpp (abi.h "Kahan-compensated params", NUMERICS §11):
// the param and compensation a kernel stored, against the reference's store
// of every f32 value within the rule's bound (both are monotone in it);
// special params and compensations through a zero update, bit for bit; every
// variant the CPU runs bit for bit; abi.h's store against the reference's.
bool kahanStoredOk(uint16_t p, uint16_t c, const E &v, uint16_t gotP, uint16_t gotC);
void checkKahanSpecial(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n);
void checkKahanIsas(const Step &st, size_t n, uint64_t seed);
bool kahanSelfTest();
// --track: `steps` small AdamW steps of the Kahan step, its f32-master twin
// and its plain bf16 twin on the same gradients: the Kahan param must stay
// much closer to the f32 master than the plain one (a measured ratio).
void checkKahanTracking(const Step &kahan, const Step &master, const Step &plain, size_t n,
                        int steps);
// --q8-sweep: the kernel's encode of chosen values, exactly (kernel-check-q8.cpp).
void checkQ8Sweep(const Step &st, uint32_t isa, zopt_update_fn fn, uint64_t stride);
// kernel-check-sumsq.cpp: a SUMSQ variant: abi.h's order bit for bit, the
// error bound, non-finite inputs.
void checkSumsq(const Step &st, uint32_t isa, zopt_sumsq_fn fn, size_t n, uint64_t seed);
// The pair entry against two calls of the single kernel, bit for bit.
void checkSumsqPair(const Step &st, uint32_t isa, zopt_sumsq_fn fn, zopt_sumsq2_fn fn2, uint64_t seed);

} // namespace kc

#endif

//===- kernel-check.cpp - executes the kernels of a step.so -----*- C++ -*-===//
//
// zopt-kernel-check STEP.so RULE [--clip] [--loss-scale] [--rne]
//                   [--sizes=1,15,17,1000003]
//
// dlopens a compiled step, validates its descriptor (magic, ABI version,
// size, checksum, bounds, state kinds, kernel table, symbols) and checks every
// UPDATE and SUMSQ variant of the kernel table that this CPU can run against
// the float64 reference of the numerics contract (docs/NUMERICS.md,
// test/reference/zopt_reference.h: written independently of the compiler),
// and the CONTROL kernel against it (control-check.h). Coefficients come
// from the step's own PREPARE kernel.
//
// RULE: adam | adamw | adam_amsgrad | sgd | sgd_nesterov | lion. Plain `sgd`
// means momentum without Nesterov when the step has a momentum_buffer state,
// and no momentum otherwise.
//   --clip        the step clips by global norm (descriptor flag must agree);
//                 the run uses clip_coef = 0.37.
//   --loss-scale  grads are loss-scaled (flag must agree); S = 1024.
//   --rne         additionally: bit-exact check of the narrowing store
//                 (f32 master -> bf16/f16 param) on chosen values (ties, NaN,
//                 inf, overflow, denormals) through the master->param copy-out
//                 with lr = 0, wd = 0 (the master is then unchanged).
//
// Tolerances:
//  * f32 results: the reference carries, next to each f64 value v, a
//    first-order running error bound s (Higham-style): every rounded f32
//    operation or f32-rounded coefficient adds |result| to s, and s propagates
//    through +,*,/,sqrt by the usual first-order rules. |kernel - v| <= K*u*s
//    with u = 2^-24 (f32 unit roundoff) is then a rigorous bound for any
//    evaluation order of the same formula up to reassociation/FMA; we use
//    K = 2 for margin. Where nothing cancels, s is a small multiple of |v| (a
//    few f32 ULP relative); where terms cancel, s keeps the scale of the terms.
//  * bf16/f16 stores: the kernel rounds its f32 value with RNE. The kernel's
//    f32 value lies in [v - tol, v + tol] and RNE is monotone, so the stored
//    value must lie in [RNE(v - tol), RNE(v + tol)]. As tol is ~2^16 (bf16)
//    or ~2^13 (f16) times smaller than a storage ULP, this interval is
//    RNE(v) itself or RNE(v) and one neighbour: the kernel result is within
//    1 ULP of RNE(v) and is only allowed to be the neighbour when v lies
//    within the f32 error of a rounding boundary (a tie), where the f32
//    intermediate can legitimately land on the other side. A truncating (or
//    otherwise wrong) conversion fails because it is off by one ULP on
//    elements far from any tie. The separate --rne check is bit-exact.
//  * With an f32 master, the narrow param must equal RNE(kernel's own master)
//    bit for bit.
//  * SUMSQ: x*x of an f32 x is exact in f64 (48 significant bits), so the
//    only error is the f64 summation: for any summation order of n
//    non-negative terms |err| <= (n-1)*2^-53*sum (+O(u^2)). The reference is
//    summed in long double (64-bit mantissa), so tol = (n-1)*2^-53*sum*1.01
//    + n*2^-63*sum. An inf or NaN in a grad must make SUMSQ non-finite.
//
// Output: one line per check (PASS/FAIL/SKIP/INFO ...) and a final line
// `N passed, M failed`; exit status 1 on any failure, 2 on usage errors.
//===----------------------------------------------------------------------===//

#include "control-check.h"
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

namespace {

int gPassed = 0, gFailed = 0;

void report(bool ok, const char *fmt, ...) {
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

const char *kindName(uint32_t k) {
  static const char *n[] = {"?", "param", "grad", "master", "exp_avg",
                            "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
  return k < 8 ? n[k] : "?";
}

// Monotone integer index of a 16-bit value (sign-magnitude -> two's complement)
int32_t ord16(uint16_t b) { int32_t m = b & 0x7FFF; return (b & 0x8000) ? -m : m; }

//===----------------------------------------------------------------------===//
// f64 values with a first-order running error bound (in units of u).
//===----------------------------------------------------------------------===//

struct E {
  double v, s; // value, accumulated bound: |f32 computation - v| <= u*s
};
E exact(double v) { return {v, 0}; }
E coef(double v) { return {v, std::fabs(v)}; } // rounded once to f32
E operator+(E a, E b) { double v = a.v + b.v; return {v, a.s + b.s + std::fabs(v)}; }
E operator-(E a, E b) { double v = a.v - b.v; return {v, a.s + b.s + std::fabs(v)}; }
E operator*(E a, E b) {
  double v = a.v * b.v;
  return {v, std::fabs(a.v) * b.s + std::fabs(b.v) * a.s + std::fabs(v)};
}
E operator/(E a, E b) {
  double v = a.v / b.v;
  return {v, a.s / std::fabs(b.v) + std::fabs(a.v) * b.s / (b.v * b.v) + std::fabs(v)};
}
E esqrt(E a) { double v = std::sqrt(a.v); return {v, a.s / (2 * v) + v}; }
E emax(E a, E b) { return a.v >= b.v ? E{a.v, std::max(a.s, b.s)} : E{b.v, std::max(a.s, b.s)}; }

} // namespace

// The reference's rules computed on E (zopt_reference.h, Num<V>).
template <> struct zopt_ref::Num<E> {
  static E coef(double c) { return ::coef(c); }
  static E exact(double x) { return ::exact(x); }
  static E sqrt(const E &x) { return esqrt(x); }
  static E max(const E &a, const E &b) { return emax(a, b); }
  static double value(const E &x) { return x.v; }
};

namespace {

const double kU = std::ldexp(1.0, -24);
const double kK = 2.0;
double tolOf(const E &e) { return kK * kU * e.s + 1e-38; }

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
  int idx[8]; // state index by kind, -1 if absent
  zopt_prepare_fn prepare = nullptr;
  zopt_control_fn control = nullptr;
  int nControl = 0;
  std::vector<std::pair<uint32_t, zopt_update_fn>> updates; // isa, fn
  std::vector<std::pair<uint32_t, zopt_sumsq_fn>> sumsqs;
};

const char *isaName(uint32_t isa) { return zopt_isa_name(isa); }

bool cpuRuns(uint32_t isa) { return zopt_cpu_runs_isa(isa) != 0; }

// Fills the descriptor-ordered hyperparameter array.
std::vector<double> hyperArray(const Step &st, const Hypers &h) {
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
    uint16_t b; std::memcpy(&b, p, 2); return b;
  }
  void setBits(size_t i, uint32_t b) {
    uint8_t *p = mem.data() + (off + i) * dtype_size(dtype);
    if (dtype == ZOPT_DTYPE_F32) std::memcpy(p, &b, 4);
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

Buf makeBuf(uint32_t dtype, size_t n, size_t off) {
  Buf b;
  b.dtype = dtype; b.n = n; b.off = off;
  b.mem.assign((off + n + kGuard) * dtype_size(dtype), kGuardByte);
  return b;
}

//===----------------------------------------------------------------------===//
// The float64 reference.
//===----------------------------------------------------------------------===//

struct RefIn { double p, g, m, v, vm, buf; };
struct RefOut {
  E p, m, v, vm, buf;
  bool ambiguous = false; // Lion: sign of the interpolation within its error
  E pAlt, pZero;          // Lion: p with the other sign / with sign 0
};

// The reference's rule (zopt_reference.h, docs/NUMERICS.md §4) on E: its
// f64 value and this check's error bound.
RefOut reference(Rule rule, const Hypers &h, const Config &c, bool hasBuf, RefIn in) {
  RefOut o;
  zopt_ref::Hypers hy = h;
  hy.lr = c.lr;
  hy.weight_decay = c.wd;
  const zopt_ref::Coeffs co = zopt_ref::rounded(zopt_ref::coefficients(hy, c.t));
  // g after unscaling and clipping (§2); the kernel multiplies by f32
  // coefficients, two roundings unless both are 1.
  double gs = zopt_ref::gradient(in.g, c.invLossScale, c.clipCoef);
  E g = {gs, (c.invLossScale != 1 || c.clipCoef != 1) ? 2 * std::fabs(gs) : 0};
  zopt_ref::Elem<E> s{exact(in.p), exact(in.m), exact(in.v), exact(in.vm), exact(in.buf)};
  zopt_ref::LionTrace<E> lion{};
  zopt_ref::step_element(rule, co, c.t == 1, hasBuf, g, s, &lion);
  o.p = s.p; o.m = s.m; o.v = s.v; o.vm = s.vmax; o.buf = s.buf;
  if (rule == Rule::Lion) {
    // Within its f32 error bound the interpolation's sign is not determined:
    // the kernel may see -1, 0 or +1 there; accept each (counted, reported).
    const double sg = zopt_ref::sign(lion.interp.v);
    o.ambiguous = std::fabs(lion.interp.v) <= tolOf(lion.interp);
    o.pAlt = lion.p_decayed - coef(co.lr) * exact(-sg);
    o.pZero = lion.p_decayed; // the f32 interpolation may round to exactly 0: sign(0) = 0
  }
  return o;
}

//===----------------------------------------------------------------------===//
// Descriptor validation.
//===----------------------------------------------------------------------===//

bool loadStep(const char *path, Step &st) {
  std::string file = std::strchr(path, '/') ? path : std::string("./") + path;
  st.lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!st.lib) { report(false, "dlopen %s: %s", path, dlerror()); return false; }
  st.d = static_cast<const zopt_step_descriptor *>(dlsym(st.lib, ZOPT_DESC_SYMBOL));
  if (!st.d) { report(false, "descriptor symbol %s missing", ZOPT_DESC_SYMBOL); return false; }
  const zopt_step_descriptor *d = st.d;
  bool ok = std::memcmp(d->magic, ZOPT_DESC_MAGIC, 8) == 0 &&
            d->abi_version == ZOPT_ABI_VERSION && d->size == sizeof(*d) &&
            d->checksum == zopt_desc_checksum(d) && d->num_states >= 2 &&
            d->num_states <= ZOPT_MAX_STATES && d->num_hypers <= ZOPT_MAX_HYPERS &&
            d->num_coeffs <= ZOPT_MAX_COEFFS && d->num_kernels >= 2 &&
            d->num_kernels <= ZOPT_MAX_KERNELS && d->zero_stage <= 3 &&
            d->align != 0 && (d->align & (d->align - 1)) == 0 &&
            std::memchr(d->name, 0, ZOPT_NAME_LEN) != nullptr;
  report(ok, "descriptor %s: magic/abi=%u/size=%u/checksum/bounds (states=%u hypers=%u "
             "coeffs=%u kernels=%u flags=%u)",
         ok ? d->name : "?", d->abi_version, d->size, d->num_states, d->num_hypers,
         d->num_coeffs, d->num_kernels, d->flags);
  if (!ok) return false;

  std::fill(std::begin(st.idx), std::end(st.idx), -1);
  bool statesOk = true;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    if (s.kind < 1 || s.kind > 7 || st.idx[s.kind] != -1 || s.dtype < 1 || s.dtype > 3 ||
        s.placement != ZOPT_PLACE_CPU || (s.access & ~3u) || !s.access)
      statesOk = false;
    else st.idx[s.kind] = int(i);
    std::printf("INFO state %u: %s %s access=%s%s\n", i, kindName(s.kind), dtype_name(s.dtype),
                (s.access & ZOPT_ACCESS_READ) ? "r" : "", (s.access & ZOPT_ACCESS_WRITE) ? "w" : "");
  }
  auto has = [&](uint32_t k) { return st.idx[k] >= 0; };
  statesOk = statesOk && has(ZOPT_STATE_PARAM) && has(ZOPT_STATE_GRAD) &&
             d->states[st.idx[ZOPT_STATE_GRAD]].access == ZOPT_ACCESS_READ &&
             (d->states[st.idx[ZOPT_STATE_PARAM]].access & ZOPT_ACCESS_WRITE);
  if (has(ZOPT_STATE_MASTER))
    statesOk = statesOk && d->states[st.idx[ZOPT_STATE_MASTER]].dtype == ZOPT_DTYPE_F32 &&
               d->states[st.idx[ZOPT_STATE_PARAM]].access == ZOPT_ACCESS_WRITE;
  switch (st.rule) {
  case Rule::Adam: case Rule::AdamW:
    statesOk = statesOk && has(ZOPT_STATE_EXP_AVG) && has(ZOPT_STATE_EXP_AVG_SQ) &&
               !has(ZOPT_STATE_MAX_EXP_AVG_SQ);
    break;
  case Rule::AdamAmsgrad:
    statesOk = statesOk && has(ZOPT_STATE_EXP_AVG) && has(ZOPT_STATE_EXP_AVG_SQ) &&
               has(ZOPT_STATE_MAX_EXP_AVG_SQ);
    break;
  case Rule::Sgd: break;
  case Rule::SgdNesterov: statesOk = statesOk && has(ZOPT_STATE_MOMENTUM_BUFFER); break;
  case Rule::Lion:
    statesOk = statesOk && has(ZOPT_STATE_EXP_AVG) && !has(ZOPT_STATE_EXP_AVG_SQ);
    break;
  }
  report(statesOk, "descriptor states match the rule (param/grad present, grad read-only, "
                   "master f32 and param write-only when a master exists)");

  bool flagsOk = bool(d->flags & ZOPT_FLAG_CLIP) == st.clip &&
                 bool(d->flags & ZOPT_FLAG_LOSS_SCALE) == st.lossScale &&
                 (!st.clip || (d->max_norm > 0 && std::isfinite(d->max_norm)));
  report(flagsOk, "descriptor flags: clip=%d (expected %d, max_norm=%g) loss_scale=%d "
                  "(expected %d)",
         bool(d->flags & ZOPT_FLAG_CLIP), st.clip, d->max_norm,
         bool(d->flags & ZOPT_FLAG_LOSS_SCALE), st.lossScale);

  bool kernOk = true;
  int nPrep = 0;
  bool anyUpdate = false;
  for (uint32_t i = 0; i < d->num_kernels; ++i) {
    const zopt_kernel_desc &k = d->kernels[i];
    if (!std::memchr(k.symbol, 0, ZOPT_NAME_LEN) || k.device != ZOPT_PLACE_CPU) {
      kernOk = false; continue;
    }
    void *fn = dlsym(st.lib, k.symbol);
    std::printf("INFO kernel %u: role=%u isa=%s symbol=%s%s\n", i, k.role, isaName(k.isa),
                k.symbol, fn ? "" : " (UNRESOLVED)");
    if (!fn) { kernOk = false; continue; }
    if (k.role == ZOPT_KERNEL_PREPARE) { ++nPrep; st.prepare = (zopt_prepare_fn)fn; }
    else if (k.role == ZOPT_KERNEL_UPDATE) {
      anyUpdate = true;
      for (auto &u : st.updates) if (u.first == k.isa) kernOk = false; // duplicate
      st.updates.push_back({k.isa, (zopt_update_fn)fn});
    } else if (k.role == ZOPT_KERNEL_SUMSQ) {
      for (auto &u : st.sumsqs) if (u.first == k.isa) kernOk = false;
      st.sumsqs.push_back({k.isa, (zopt_sumsq_fn)fn});
    } else if (k.role == ZOPT_KERNEL_CONTROL && k.isa == ZOPT_ISA_NONE) {
      ++st.nControl;
      st.control = (zopt_control_fn)fn;
    } else kernOk = false;
  }
  bool sumsqExpected = (d->flags & ZOPT_FLAG_SUMSQ) != 0;
  kernOk = kernOk && nPrep == 1 && st.nControl == 1 && anyUpdate &&
           sumsqExpected == !st.sumsqs.empty() && sumsqExpected == (st.clip || st.lossScale);
  report(kernOk, "kernel table: 1 prepare, %zu update, %zu sumsq variants, all symbols "
                 "resolve; SUMSQ flag=%d", st.updates.size(), st.sumsqs.size(), sumsqExpected);
  return ok && statesOk && flagsOk && kernOk;
}

//===----------------------------------------------------------------------===//
// PREPARE checks.
//===----------------------------------------------------------------------===//

std::vector<float> runPrepare(const Step &st, const Hypers &h, const Config &c, bool &ok) {
  std::vector<double> hy = hyperArray(st, h);
  double globals[ZOPT_NUM_GLOBALS] = {c.t, c.clipCoef, c.invLossScale};
  std::vector<float> co(ZOPT_MAX_COEFFS + 8, bits_f32(0x7FC0DEADu));
  const float sentinel = bits_f32(0x7FC0BEEFu);
  for (size_t i = st.d->num_coeffs; i < co.size(); ++i) co[i] = sentinel;
  st.prepare(hy.data(), globals, co.data());
  ok = true;
  for (size_t i = 0; i < co.size(); ++i) {
    if (i < st.d->num_coeffs) ok = ok && std::isfinite(co[i]);
    else ok = ok && f32_bits(co[i]) == f32_bits(sentinel);
  }
  // Determinism: a second call gives the same bits.
  std::vector<float> co2(co.size(), 0.f);
  st.prepare(hy.data(), globals, co2.data());
  for (size_t i = 0; i < st.d->num_coeffs; ++i) ok = ok && f32_bits(co[i]) == f32_bits(co2[i]);
  co.resize(std::max<size_t>(st.d->num_coeffs, 1));
  return co;
}

// Coefficients we can identify: f32(x) of f64 expressions of the contract.
void identifyCoeffs(const Step &st, const Hypers &h, const Config &c,
                    const std::vector<float> &co, const char *tag) {
  std::vector<std::pair<const char *, double>> exp;
  zopt_ref::Hypers hy = h;
  hy.lr = c.lr;
  hy.weight_decay = c.wd;
  const zopt_ref::Coeffs k = zopt_ref::coefficients(hy, c.t);
  switch (st.rule) {
  case Rule::Adam: case Rule::AdamW: case Rule::AdamAmsgrad:
    exp = {{"lr", k.lr}, {"b1", k.b1}, {"1-b1", k.one_minus_b1}, {"b2", k.b2}, {"1-b2", k.one_minus_b2},
           {"eps", k.eps}, {"1/bc1", k.inv_bc1}, {"1/sqrt(bc2)", k.inv_sqrt_bc2}};
    if (st.rule == Rule::AdamW) exp.push_back({"1-lr*wd", k.decay});
    else exp.push_back({"wd", k.wd});
    break;
  case Rule::Sgd: case Rule::SgdNesterov:
    exp = {{"lr", k.lr}, {"wd", k.wd}};
    if (st.idx[ZOPT_STATE_MOMENTUM_BUFFER] >= 0) {
      exp.push_back({"mu or 0 at t=1", c.t == 1 ? 0.0 : k.mu});
      exp.push_back({"1-damp or 1 at t=1", c.t == 1 ? 1.0 : k.one_minus_damp});
    }
    break;
  case Rule::Lion:
    exp = {{"lr", k.lr}, {"b1", k.b1}, {"1-b1", k.one_minus_b1}, {"b2", k.b2}, {"1-b2", k.one_minus_b2},
           {"1-lr*wd", k.decay}};
    break;
  }
  if (st.clip && c.clipCoef != 1) exp.push_back({"clip_coef", c.clipCoef});
  if (st.lossScale) exp.push_back({"1/S", c.invLossScale});
  int found = 0;
  std::string missing;
  for (auto &e : exp) {
    float want = float(e.second);
    bool f = std::any_of(co.begin(), co.end(), [&](float x) { return f32_bits(x) == f32_bits(want); });
    found += f;
    if (!f) missing += std::string(" ") + e.first;
  }
  std::printf("INFO prepare %s: %d of %zu expected coefficient values found bit-exact "
              "among %u coefficients%s%s\n", tag, found, exp.size(), st.d->num_coeffs,
              missing.empty() ? "" : "; not found:", missing.c_str());
}

//===----------------------------------------------------------------------===//
// UPDATE check.
//===----------------------------------------------------------------------===//

struct Gen {
  std::mt19937_64 rng;
  explicit Gen(uint64_t seed) : rng(seed) {}
  double uni(double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); }
  double sgn() { return (rng() & 1) ? 1.0 : -1.0; }
};

double genFor(uint32_t kind, Gen &gen, const Config &c) {
  switch (kind) {
  case ZOPT_STATE_PARAM: case ZOPT_STATE_MASTER: return gen.sgn() * gen.uni(0.01, 1.0);
  case ZOPT_STATE_GRAD: return gen.sgn() * gen.uni(1e-3, 1.0) / c.invLossScale;
  case ZOPT_STATE_EXP_AVG: return gen.sgn() * gen.uni(1e-3, 0.1);
  case ZOPT_STATE_EXP_AVG_SQ: return gen.uni(1e-4, 1e-1);
  case ZOPT_STATE_MAX_EXP_AVG_SQ: return gen.uni(1e-4, 1.2e-1);
  case ZOPT_STATE_MOMENTUM_BUFFER: return gen.sgn() * gen.uni(1e-3, 1.0);
  }
  return 1.0;
}

const char *configTag(const Config &c, char *buf, size_t len) {
  std::snprintf(buf, len, "t=%g bc=%d clip=%g invS=%g", c.t, int(c.biasCorrection),
                c.clipCoef, c.invLossScale);
  return buf;
}

void checkUpdate(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n, const Config &c,
                 uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  Hypers h;
  h.bias_correction = c.biasCorrection;
  h.lr = c.lr; h.weight_decay = c.wd;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  char tag[128];
  configTag(c, tag, sizeof tag);
  size_t off = (seed & 1) ? 1 : 0; // every other run uses misaligned pointers
  std::vector<Buf> bufs;
  Gen gen(seed);
  for (uint32_t i = 0; i < d->num_states; ++i) bufs.push_back(makeBuf(d->states[i].dtype, n, off));
  std::vector<RefIn> in(n);
  int ip = st.idx[ZOPT_STATE_MASTER] >= 0 ? st.idx[ZOPT_STATE_MASTER] : st.idx[ZOPT_STATE_PARAM];
  for (size_t e = 0; e < n; ++e) {
    for (uint32_t i = 0; i < d->num_states; ++i) {
      const zopt_state_desc &s = d->states[i];
      if (!(s.access & ZOPT_ACCESS_READ)) { // write-only: poison with a NaN pattern
        bufs[i].setBits(e, s.dtype == ZOPT_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu);
        continue;
      }
      double v = bufs[i].store(e, genFor(s.kind, gen, c));
      switch (s.kind) {
      case ZOPT_STATE_GRAD: in[e].g = v; break;
      case ZOPT_STATE_EXP_AVG: in[e].m = v; break;
      case ZOPT_STATE_EXP_AVG_SQ: in[e].v = v; break;
      case ZOPT_STATE_MAX_EXP_AVG_SQ: in[e].vm = v; break;
      case ZOPT_STATE_MOMENTUM_BUFFER: in[e].buf = v; break;
      }
      if (int(i) == ip) in[e].p = v;
    }
  }
  std::vector<Buf> before = bufs;
  // Out of place first (abi.h: loads through `in`, stores through `out`):
  // the written states go to separate buffers; every input stays as it was.
  std::vector<Buf> outBufs = bufs;
  std::vector<void *> inPtrs, outPtrs;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    inPtrs.push_back(bufs[i].ptr());
    if (d->states[i].access & ZOPT_ACCESS_WRITE)
      for (size_t e = 0; e < n; ++e)
        outBufs[i].setBits(e, d->states[i].dtype == ZOPT_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu);
    outPtrs.push_back((d->states[i].access & ZOPT_ACCESS_WRITE) ? outBufs[i].ptr() : nullptr);
  }
  fn(inPtrs.data(), outPtrs.data(), int64_t(n), co.data());
  size_t inChanged = 0;
  for (uint32_t i = 0; i < d->num_states; ++i)
    for (size_t e = 0; e < n; ++e) inChanged += bufs[i].bits(e) != before[i].bits(e);
  // Then in place; the results must be the same bits.
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
  size_t placeDiff = 0;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].access & ZOPT_ACCESS_WRITE)
      for (size_t e = 0; e < n; ++e) placeDiff += bufs[i].bits(e) != outBufs[i].bits(e);
  report(inChanged == 0 && placeDiff == 0,
         "update[%s] n=%zu out of place: %zu input elements changed, %zu outputs differ from "
         "the in-place run", isaName(isa), n, inChanged, placeDiff);

  bool hasBuf = st.idx[ZOPT_STATE_MOMENTUM_BUFFER] >= 0;
  size_t bad = 0, offByOne = 0, ambiguous = 0;
  double worst = 0; // max |err|/tol over f32 outputs
  std::string firstBad;
  for (size_t e = 0; e < n; ++e) {
    RefOut r = reference(st.rule, h, c, hasBuf, in[e]);
    if (r.ambiguous) ++ambiguous;
    for (uint32_t i = 0; i < d->num_states; ++i) {
      const zopt_state_desc &s = d->states[i];
      uint32_t gotBits = bufs[i].bits(e);
      if (!(s.access & ZOPT_ACCESS_WRITE)) {
        if (gotBits != before[i].bits(e)) {
          if (!bad++) {
            char m[256];
            std::snprintf(m, sizeof m, "read-only %s[%zu] modified", kindName(s.kind), e);
            firstBad = m;
          }
        }
        continue;
      }
      const E *want = nullptr;
      switch (s.kind) {
      case ZOPT_STATE_PARAM: case ZOPT_STATE_MASTER: want = &r.p; break;
      case ZOPT_STATE_EXP_AVG: want = &r.m; break;
      case ZOPT_STATE_EXP_AVG_SQ: want = &r.v; break;
      case ZOPT_STATE_MAX_EXP_AVG_SQ: want = &r.vm; break;
      case ZOPT_STATE_MOMENTUM_BUFFER: want = &r.buf; break;
      }
      auto matches = [&](const E &w, double &ratio, bool &one) {
        double tol = tolOf(w);
        if (s.dtype == ZOPT_DTYPE_F32) {
          double got = bits_f32(gotBits);
          ratio = std::fabs(got - w.v) / tol;
          return std::isfinite(got) && std::fabs(got - w.v) <= tol;
        }
        bool bf = s.dtype == ZOPT_DTYPE_BF16;
        uint16_t lo = bf ? rne_bf16(w.v - tol) : rne_f16(w.v - tol);
        uint16_t hi = bf ? rne_bf16(w.v + tol) : rne_f16(w.v + tol);
        uint16_t rn = bf ? rne_bf16(w.v) : rne_f16(w.v);
        uint16_t g16 = uint16_t(gotBits);
        ratio = 0;
        one = g16 != rn;
        return !is_nan_bits(g16, zopt_dtype(s.dtype)) && ord16(g16) >= ord16(lo) &&
               ord16(g16) <= ord16(hi);
      };
      double ratio = 0;
      bool one = false;
      bool ok = matches(*want, ratio, one);
      if (!ok && r.ambiguous && want == &r.p)
        ok = matches(r.pAlt, ratio, one) || matches(r.pZero, ratio, one);
      if (ok && s.dtype == ZOPT_DTYPE_F32) worst = std::max(worst, ratio);
      if (ok && one) ++offByOne;
      // With an f32 master, the narrow param is the rounded master, bit-exact.
      if (ok && s.kind == ZOPT_STATE_PARAM && st.idx[ZOPT_STATE_MASTER] >= 0) {
        uint32_t mb = bufs[st.idx[ZOPT_STATE_MASTER]].bits(e);
        uint16_t w16 = s.dtype == ZOPT_DTYPE_BF16 ? rne_bf16_bits(mb) : rne_f16_bits(mb);
        if (uint16_t(gotBits) != w16) {
          ok = false;
          if (!bad) {
            char m[256];
            std::snprintf(m, sizeof m, "param[%zu]=0x%04x but RNE(master=0x%08x)=0x%04x", e,
                          gotBits, mb, w16);
            firstBad = m;
          }
        }
      }
      if (!ok) {
        if (!bad++ && firstBad.empty()) {
          char m[320];
          double got = bufs[i].value(e);
          std::snprintf(m, sizeof m,
                        "%s[%zu] (%s) got %.9g (bits 0x%x) expected %.9g +- %.3g "
                        "(inputs p=%.9g g=%.9g m=%.9g v=%.9g vmax=%.9g buf=%.9g)",
                        kindName(s.kind), e, dtype_name(s.dtype), got, gotBits, want->v,
                        tolOf(*want), in[e].p, in[e].g, in[e].m, in[e].v, in[e].vm, in[e].buf);
          firstBad = m;
        }
      }
    }
  }
  bool guards = true;
  for (auto &b : bufs) guards = guards && b.guardsIntact();
  bool ok = prepOk && bad == 0 && guards;
  report(ok, "update[%s] n=%zu %s%s: %zu bad elements, max f32 err/tol=%.3f, "
             "narrow stores 1 ULP from RNE(ref)=%zu, lion sign ambiguous=%zu, guards %s, "
             "prepare %s%s%s",
         isaName(isa), n, tag, off ? " misaligned" : "", bad, worst, offByOne, ambiguous,
         guards ? "intact" : "OVERWRITTEN", prepOk ? "ok" : "BAD",
         firstBad.empty() ? "" : "; first: ", firstBad.c_str());
}

//===----------------------------------------------------------------------===//
// SUMSQ checks.
//===----------------------------------------------------------------------===//

void checkSumsq(const Step &st, uint32_t isa, zopt_sumsq_fn fn, size_t n, uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  Config c{3, true, 0.37, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  if (!st.clip) c.clipCoef = 1;
  Hypers h;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  Gen gen(seed);
  std::vector<Buf> bufs;
  for (uint32_t i = 0; i < d->num_states; ++i) bufs.push_back(makeBuf(d->states[i].dtype, n, seed & 1));
  for (uint32_t i = 0; i < d->num_states; ++i)
    for (size_t e = 0; e < n; ++e) bufs[i].store(e, genFor(d->states[i].kind, gen, c));
  Buf &g = bufs[st.idx[ZOPT_STATE_GRAD]];
  // x = g * f32(1/S), the value the norm is taken of (§2, §3).
  const float gscale = float(c.invLossScale);
  auto x = [&](size_t e) { return zopt_ref::norm_value(float(g.value(e)), gscale); };
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  double got = fn(ptrs.data(), int64_t(n), co.data());
  // abi.h's exact order: ZOPT_SUMSQ_LANES lane sums, then the lanes in order.
  double canon = zopt_ref::sumsq_block(n, x);
  report(f64_bits(got) == f64_bits(canon),
         "sumsq[%s] n=%zu: the order of abi.h (%d lanes): got %.17g canonical %.17g",
         isaName(isa), n, ZOPT_SUMSQ_LANES, got, canon);
  double ref = double(zopt_ref::sumsq_exact(n, x));
  double tol = zopt_ref::sumsq_tolerance(n, ref);
  double err = std::fabs(got - ref);
  report(prepOk && std::isfinite(got) && err <= tol,
         "sumsq[%s] n=%zu: got %.17g ref %.17g |err|=%.3g tol=%.3g (rel err %.3g)", isaName(isa),
         n, got, ref, err, tol, ref ? err / ref : 0);

  // Non-finite propagation: inf at the first and at the last element, NaN in the
  // middle (vector body and tail).
  struct Inj { size_t at; bool nan; };
  std::vector<Inj> inj = {{0, false}, {n - 1, false}, {n / 2, true}};
  for (auto &j : inj) {
    uint32_t saved = g.bits(j.at);
    uint32_t bits = g.dtype == ZOPT_DTYPE_F32 ? (j.nan ? 0x7FC00000u : 0x7F800000u)
                    : g.dtype == ZOPT_DTYPE_BF16 ? (j.nan ? 0x7FC0u : 0x7F80u)
                                                 : (j.nan ? 0x7E00u : 0x7C00u);
    g.setBits(j.at, bits);
    double r = fn(ptrs.data(), int64_t(n), co.data());
    report(!std::isfinite(r), "sumsq[%s] n=%zu with %s grad at %zu: returns %g (must be "
                              "non-finite)", isaName(isa), n, j.nan ? "NaN" : "+inf", j.at, r);
    g.setBits(j.at, saved);
  }
}

//===----------------------------------------------------------------------===//
// Bit-exact narrowing check through the master -> param copy-out.
//===----------------------------------------------------------------------===//

std::vector<uint32_t> specialValues(uint32_t pdt) {
  std::vector<uint32_t> v = {0x00000000u, 0x80000000u, 0x3F800000u, 0xBF800000u,
                             0x7F800000u, 0xFF800000u, 0x7F7FFFFFu, 0xFF7FFFFFu,
                             0x00800000u, 0x80800000u};
  if (pdt == ZOPT_DTYPE_BF16) {
    uint32_t more[] = {
        0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F807FFFu, 0x3F80FFFFu, // ties/near
        0x40490FDBu, 0x3DCCCCCDu, 0x7F7F7FFFu, 0x7F7F8000u, 0x7F7E8000u, // pi, 0.1, top
        0x00000001u, 0x00008000u, 0x00018000u, 0x00010000u, 0x007FFFFFu, // denormals
        0x00408000u, 0x00808000u, 0x0000FFFFu, 0x00017FFFu};
    for (uint32_t m : more) { v.push_back(m); v.push_back(m | 0x80000000u); }
  } else {
    uint32_t more[] = {
        0x3F801000u, 0x3F803000u, 0x3F801001u, 0x3F800FFFu, // ties/near at 1.0
        0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x47C35000u, // 65504, <65520, 65520, 1e5
        0x33800000u, 0x33000000u, 0x33400000u, 0x33C00000u, // 2^-24, 2^-25, 1.5,3 *2^-25
        0x38800000u, 0x387FC000u, 0x387FE000u, 0x38000000u, // around 2^-14
        0x00000001u, 0x007FFFFFu, 0x40490FDBu, 0x3DCCCCCDu, 0x32FFFFFFu};
    for (uint32_t m : more) { v.push_back(m); v.push_back(m | 0x80000000u); }
  }
  uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xFFFFFFFFu,
                     0x7FBFFFFFu, 0xFF800001u, 0x7FC0FFFFu};
  for (uint32_t n : nans) v.push_back(n);
  return v;
}

void checkRne(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n) {
  const zopt_step_descriptor *d = st.d;
  int im = st.idx[ZOPT_STATE_MASTER], ip = st.idx[ZOPT_STATE_PARAM];
  uint32_t pdt = d->states[ip].dtype;
  if (im < 0 || pdt == ZOPT_DTYPE_F32) {
    std::printf("SKIP rne[%s]: needs an f32 master and a bf16/f16 param\n", isaName(isa));
    return;
  }
  Config c{3, true, 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 0.0, 0.0};
  Hypers h;
  h.lr = 0; h.weight_decay = 0;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  std::vector<uint32_t> sv = specialValues(pdt);
  // With L2 decay (Adam, SGD) the param enters the gradient as 0 * p even at
  // wd = 0, and 0 * inf = NaN (as in torch): infinite masters cannot pass
  // through unchanged, so they are left out there (overflow to inf is still
  // covered by FLT_MAX and the values that round up to inf).
  bool l2 = st.rule == Rule::Adam || st.rule == Rule::AdamAmsgrad || st.rule == Rule::Sgd ||
            st.rule == Rule::SgdNesterov;
  if (l2)
    sv.erase(std::remove_if(sv.begin(), sv.end(),
                            [](uint32_t b) { return (b & 0x7FFFFFFFu) == 0x7F800000u; }),
             sv.end());
  std::vector<Buf> bufs;
  for (uint32_t i = 0; i < d->num_states; ++i) bufs.push_back(makeBuf(d->states[i].dtype, n, n & 1));
  for (uint32_t i = 0; i < d->num_states; ++i) {
    for (size_t e = 0; e < n; ++e) {
      uint32_t k = d->states[i].kind;
      if (int(i) == im) bufs[i].setBits(e, sv[(e * 7) % sv.size()]); // varied lanes
      else if (int(i) == ip) bufs[i].setBits(e, 0xFFFFu);
      // Positive grads and moments: the update direction u is finite and
      // positive, so w - 0*u == w even for w = -0.
      else if (k == ZOPT_STATE_GRAD) bufs[i].store(e, 0.5 / c.invLossScale);
      else if (k == ZOPT_STATE_EXP_AVG_SQ || k == ZOPT_STATE_MAX_EXP_AVG_SQ) bufs[i].store(e, 0.01);
      else bufs[i].store(e, 0.1);
    }
  }
  std::vector<uint32_t> masterIn(n);
  for (size_t e = 0; e < n; ++e) masterIn[e] = bufs[im].bits(e);
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
  size_t bad = 0, nanPayloadChanged = 0;
  std::string first;
  for (size_t e = 0; e < n; ++e) {
    uint32_t w = masterIn[e], wo = bufs[im].bits(e), p = bufs[ip].bits(e);
    bool wNan = is_nan_bits(w, ZOPT_DTYPE_F32);
    bool ok;
    uint32_t want;
    if (wNan) {
      want = 0;
      ok = is_nan_bits(wo, ZOPT_DTYPE_F32) && is_nan_bits(p, zopt_dtype(pdt));
      uint16_t trunc = uint16_t(w >> 16) | (pdt == ZOPT_DTYPE_BF16 ? 0x40 : 0);
      if (ok && pdt == ZOPT_DTYPE_BF16 && p != trunc) ++nanPayloadChanged;
    } else {
      want = pdt == ZOPT_DTYPE_BF16 ? rne_bf16_bits(w) : rne_f16_bits(w);
      ok = wo == w && p == want;
    }
    if (!ok && !bad++) {
      char m[200];
      std::snprintf(m, sizeof m, "master 0x%08x -> master' 0x%08x param 0x%04x, expected "
                    "param %s0x%04x", w, wo, p, wNan ? "NaN, e.g. " : "", wNan ? 0x7FC0 : want);
      first = m;
    }
  }
  bool guards = true;
  for (auto &b : bufs) guards = guards && b.guardsIntact();
  report(prepOk && bad == 0 && guards,
         "rne[%s] n=%zu f32 master -> %s param, %zu special values (ties, overflow, inf, NaN, "
         "denormals): %zu mismatches%s%s (NaN kept as NaN; %zu NaNs not the quieted "
         "truncated payload)",
         isaName(isa), n, dtype_name(pdt), sv.size(), bad, first.empty() ? "" : "; first: ",
         first.c_str(), nanPayloadChanged);
}

//===----------------------------------------------------------------------===//
// Self test of the reference conversions (two implementations must agree).
//===----------------------------------------------------------------------===//

bool selfTest() {
  std::mt19937 rng(7);
  size_t bad = 0;
  auto one = [&](uint32_t b) {
    if (is_nan_bits(b, ZOPT_DTYPE_F32)) return;
    double x = bits_f32(b);
    if (rne_bf16_bits(b) != rne_bf16(x)) ++bad;
    if (rne_f16_bits(b) != rne_f16(x)) ++bad;
    // Exact round trip of the decoders.
    uint16_t h = rne_f16(x);
    if (!std::isnan(decode_f16(h)) && rne_f16(decode_f16(h)) != h) ++bad;
  };
  for (uint32_t b : specialValues(ZOPT_DTYPE_BF16)) one(b);
  for (uint32_t b : specialValues(ZOPT_DTYPE_F16)) one(b);
  for (int i = 0; i < 2000000; ++i) one(rng());
  // Exhaustive over every f16 ~ around 1.0 ties
  for (uint32_t b = 0x3F000000u; b < 0x3F000000u + (1u << 20); ++b) one(b);
  report(bad == 0, "self-test: two independent f32->bf16 and f32->f16 RNE references agree "
                   "(%zu mismatches)", bad);
  return bad == 0;
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s STEP.so adam|adamw|adam_amsgrad|sgd|sgd_nesterov|lion "
                         "[--clip] [--loss-scale] [--rne] [--sizes=1,15,17,1000003]\n", argv[0]);
    return 2;
  }
  Step st;
  std::string rule = argv[2];
  if (rule == "adam") st.rule = Rule::Adam;
  else if (rule == "adamw") st.rule = Rule::AdamW;
  else if (rule == "adam_amsgrad") st.rule = Rule::AdamAmsgrad;
  else if (rule == "sgd") st.rule = Rule::Sgd;
  else if (rule == "sgd_nesterov") st.rule = Rule::SgdNesterov;
  else if (rule == "lion") st.rule = Rule::Lion;
  else { std::fprintf(stderr, "unknown rule '%s'\n", rule.c_str()); return 2; }
  bool rne = false;
  std::vector<size_t> sizes = {1, 15, 17, 1000003};
  for (int i = 3; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--clip") st.clip = true;
    else if (a == "--loss-scale") st.lossScale = true;
    else if (a == "--rne") rne = true;
    else if (a.rfind("--sizes=", 0) == 0) {
      sizes.clear();
      for (const char *p = a.c_str() + 8; *p;) {
        char *end;
        sizes.push_back(std::strtoull(p, &end, 10));
        p = *end ? end + 1 : end;
      }
    } else { std::fprintf(stderr, "unknown option '%s'\n", a.c_str()); return 2; }
  }
  selfTest();
  if (loadStep(argv[1], st)) {
    if (st.d->flags & ZOPT_FLAG_STOCHASTIC) {
      // Its UPDATE takes (key, first) and rounds with abi.h's hash; that is
      // checked against the float64 reference in python/tests/test_stochastic.py.
      std::fprintf(stderr, "zopt-kernel-check: steps with stochastic rounding are checked by "
                           "python/tests/test_stochastic.py\n");
      return 2;
    }
    const double invS = st.lossScale ? 1.0 / 1024 : 1.0;
    const double clip = st.clip ? 0.37 : 1.0;
    std::vector<Config> configs = {{1, true, clip, invS, 1e-2, 0.1},
                                   {3, true, clip, invS, 1e-2, 0.1},
                                   {3, false, clip, invS, 1e-2, 0.1}};
    // Identify coefficients once per config (informational).
    for (auto &c : configs) {
      Hypers h;
      h.bias_correction = c.biasCorrection;
      bool ok;
      std::vector<float> co = runPrepare(st, h, c, ok);
      char tag[128];
      identifyCoeffs(st, h, c, co, configTag(c, tag, sizeof tag));
      report(ok, "prepare %s: writes exactly %u finite coefficients, deterministic", tag,
             st.d->num_coeffs);
    }
    {
      char first[512] = "";
      int bad = 0;
      int n = control_check::check(
          st.d->flags, st.control, &bad,
          [&](const zopt_control &in, const zopt_control &got, const control_check::Out &want) {
            std::snprintf(first, sizeof first,
                          "; first: sumsq %.17g max_norm %g scale %g good %lld dynamic %u -> norm %.17g clip %.17g "
                          "skip %u advance %u scale %.17g good %lld, want %.17g %.17g %d %d %.17g %lld",
                          in.sumsq, in.max_norm, in.scale, (long long)in.good_steps, in.dynamic, got.norm,
                          got.clip_coef, got.skip, got.advance, got.new_scale, (long long)got.new_good_steps,
                          want.norm, want.clip, want.skip, want.advance, want.scale, (long long)want.good);
          });
      report(bad == 0, "control: norm, clip, skip, counts and loss scaler bit-identical to the contract's "
                       "float64 reference in %d of %d cases%s",
             n - bad, n, first);
    }
    uint64_t seed = 1;
    for (auto &u : st.updates) {
      if (!cpuRuns(u.first)) {
        std::printf("SKIP update[%s]: not run, this CPU lacks the instruction set\n",
                    isaName(u.first));
        continue;
      }
      for (size_t n : sizes)
        for (auto &c : configs) checkUpdate(st, u.first, u.second, n, c, seed++);
      if (rne)
        for (size_t n : {size_t(61), size_t(100003)})
          checkRne(st, u.first, u.second, n);
    }
    for (auto &s : st.sumsqs) {
      if (!cpuRuns(s.first)) {
        std::printf("SKIP sumsq[%s]: not run, this CPU lacks the instruction set\n",
                    isaName(s.first));
        continue;
      }
      for (size_t n : sizes) checkSumsq(st, s.first, s.second, n, seed++);
    }
  }
  std::printf("%d passed, %d failed\n", gPassed, gFailed);
  return gFailed ? 1 : 0;
}

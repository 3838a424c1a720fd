//===- kernel-check-update.cpp - UPDATE kernels against the reference ----===//
//
// zopt-kernel-check's UPDATE checks (kernel-check.cpp: the tolerances): the
// reference's rule on E per element, every written state within its bound
// (narrow stores within one ULP of RNE of the reference, and equal to RNE
// of the kernel's own master), out of place equals in place, read-only
// states and guards untouched; and the bit-exact narrowing of special f32
// master values into a bf16/f16 param.
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

namespace kc {

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
  const int im = st.idx[ZOPT_STATE_MASTER], iparam = st.idx[ZOPT_STATE_PARAM];
  for (size_t e = 0; e < n; ++e) {
    for (uint32_t i = 0; i < d->num_states; ++i) {
      const zopt_state_desc &s = d->states[i];
      if (!(s.access & ZOPT_ACCESS_READ)) { // write-only: poison with a NaN pattern
        bufs[i].setBits(e, s.dtype == ZOPT_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu);
        continue;
      }
      double v;
      if (st.kahan && int(i) == st.idx[ZOPT_STATE_KAHAN_COMP]) {
        // A compensation: up to about an ULP of the param (written after it).
        bufs[i].store(e, in[e].p * gen.uni(-1.0 / 256, 1.0 / 256));
        continue;
      }
      if (st.remainder && int(i) == im) {
        // A random f32 master (random low half), split as the reference says.
        float x = float(genFor(s.kind, gen, c));
        bufs[iparam].setBits(e, zopt_ref::remainder_param(x));
        bufs[i].setBits(e, zopt_ref::remainder_rem(x));
        v = x;
      } else {
        v = bufs[i].store(e, genFor(s.kind, gen, c));
      }
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
  // Stochastic rounding (abi.h): the call's key and the index of its first
  // element (not 0, so that the kernels' index arithmetic is exercised).
  const bool sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  const uint32_t srKey = zopt_sr_key(42, uint64_t(c.t), 3, 0), srFirst = 1000;
  auto run = [&](void *const *inP, void *const *outP) {
    if (sr) ((zopt_update_sr_fn)(void *)fn)(inP, outP, int64_t(n), co.data(), srKey, srFirst);
    else fn(inP, outP, int64_t(n), co.data());
  };
  run(inPtrs.data(), outPtrs.data());
  size_t inChanged = 0;
  for (uint32_t i = 0; i < d->num_states; ++i)
    for (size_t e = 0; e < n; ++e) inChanged += bufs[i].bits(e) != before[i].bits(e);
  // Then in place; the results must be the same bits.
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  run(ptrs.data(), ptrs.data());
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
      zopt_state_desc s = d->states[i];
      uint32_t gotBits = bufs[i].bits(e);
      if (st.remainder && int(i) == im) { // the rebuilt f32 master
        gotBits = joinedMaster(bufs[iparam].bits(e), gotBits);
        s.dtype = ZOPT_DTYPE_F32;
      }
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
      if (st.kahan && s.kind == ZOPT_STATE_KAHAN_COMP) continue; // with the param
      if (st.kahan && s.kind == ZOPT_STATE_PARAM) {
        // The param and its compensation, as the reference stores them from
        // an f32 value within the rule's bound (abi.h, NUMERICS §11).
        const int ic = st.idx[ZOPT_STATE_KAHAN_COMP];
        const uint16_t gc = uint16_t(bufs[ic].bits(e));
        auto stored = [&](const E &v) {
          return kahanStoredOk(uint16_t(before[i].bits(e)), uint16_t(before[ic].bits(e)), v,
                               uint16_t(gotBits), gc);
        };
        // Lion: either sign of the interpolation within its error.
        if (!stored(r.p) && !(r.ambiguous && (stored(r.pAlt) || stored(r.pZero)))) {
          if (!bad++) {
            char m[320];
            std::snprintf(m, sizeof m,
                          "param[%zu] 0x%04x, compensation 0x%04x (from 0x%04x, 0x%04x): not the "
                          "Kahan store of any f32 in %.9g +- %.3g",
                          e, gotBits, gc, before[i].bits(e), before[ic].bits(e), r.p.v, tolOf(r.p));
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
        if (s.rounding == ZOPT_ROUND_STOCHASTIC) {
          // The kernel's f32 value lies in [v - tol, v + tol] and the
          // reference's stochastic rounding (§7) is monotone in it: the
          // stored value lies between the roundings of the two bounds.
          const uint32_t idx = srFirst + uint32_t(e);
          int32_t a = ord16(zopt_ref::sr_bf16(float(w.v - tol), srKey, i, idx));
          int32_t b = ord16(zopt_ref::sr_bf16(float(w.v + tol), srKey, i, idx));
          uint16_t g16 = uint16_t(gotBits);
          ratio = 0;
          one = false;
          return bf && !is_nan_bits(g16, ZOPT_DTYPE_BF16) && ord16(g16) >= std::min(a, b) &&
                 ord16(g16) <= std::max(a, b);
        }
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
      // With an f32 master, the narrow param is the rounded master, bit-exact
      // (stochastically rounded with the call's key where the param is).
      if (ok && s.kind == ZOPT_STATE_PARAM && st.idx[ZOPT_STATE_MASTER] >= 0) {
        uint32_t mb = bufs[im].bits(e);
        if (st.remainder) mb = joinedMaster(gotBits, mb);
        const bool srp = s.rounding == ZOPT_ROUND_STOCHASTIC;
        // A remainder's param: the master rounded to nearest, ties away (§9).
        uint16_t w16 = st.remainder ? zopt_ref::remainder_param(bits_f32(mb))
                       : srp ? zopt_ref::sr_bf16(bits_f32(mb), srKey, i, srFirst + uint32_t(e))
                       : s.dtype == ZOPT_DTYPE_BF16 ? rne_bf16_bits(mb) : rne_f16_bits(mb);
        if (uint16_t(gotBits) != w16) {
          ok = false;
          if (!bad) {
            char m[256];
            std::snprintf(m, sizeof m, "param[%zu]=0x%04x but %s(master=0x%08x)=0x%04x", e,
                          gotBits, st.remainder ? "nearest-away" : srp ? "SR" : "RNE", mb, w16);
            firstBad = m;
          }
        }
      }
      if (!ok) {
        if (!bad++ && firstBad.empty()) {
          char m[320];
          double got = s.dtype == ZOPT_DTYPE_F32 ? double(bits_f32(gotBits)) : bufs[i].value(e);
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
  if (im < 0 || pdt == ZOPT_DTYPE_F32 || d->states[ip].rounding == ZOPT_ROUND_STOCHASTIC) {
    std::printf("SKIP rne[%s]: needs an f32 master and a bf16/f16 param rounded to nearest even\n", isaName(isa));
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
      if (int(i) == im && st.remainder) { // the param first, then the remainder
        const float x = bits_f32(sv[(e * 7) % sv.size()]);
        bufs[ip].setBits(e, zopt_ref::remainder_param(x));
        bufs[i].setBits(e, zopt_ref::remainder_rem(x));
      } else if (int(i) == im) bufs[i].setBits(e, sv[(e * 7) % sv.size()]); // varied lanes
      else if (int(i) == ip) { if (!st.remainder) bufs[i].setBits(e, 0xFFFFu); }
      // Positive grads and moments: the update direction u is finite and
      // positive, so w - 0*u == w even for w = -0.
      else if (k == ZOPT_STATE_GRAD) bufs[i].store(e, 0.5 / c.invLossScale);
      else if (k == ZOPT_STATE_EXP_AVG_SQ || k == ZOPT_STATE_MAX_EXP_AVG_SQ) bufs[i].store(e, 0.01);
      else bufs[i].store(e, 0.1);
    }
  }
  // A remainder master is read and checked as the f32 it rebuilds (§9).
  auto masterBits = [&](size_t e) {
    return st.remainder ? joinedMaster(bufs[ip].bits(e), bufs[im].bits(e)) : bufs[im].bits(e);
  };
  std::vector<uint32_t> masterIn(n);
  for (size_t e = 0; e < n; ++e) masterIn[e] = masterBits(e);
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
  size_t bad = 0, nanPayloadChanged = 0;
  std::string first;
  for (size_t e = 0; e < n; ++e) {
    uint32_t w = masterIn[e], wo = masterBits(e), p = bufs[ip].bits(e);
    bool wNan = is_nan_bits(w, ZOPT_DTYPE_F32);
    bool ok;
    uint32_t want;
    if (wNan) {
      want = 0;
      ok = is_nan_bits(wo, ZOPT_DTYPE_F32) && is_nan_bits(p, zopt_dtype(pdt));
      uint16_t trunc = uint16_t(w >> 16) | (pdt == ZOPT_DTYPE_BF16 ? 0x40 : 0);
      if (ok && pdt == ZOPT_DTYPE_BF16 && p != trunc) ++nanPayloadChanged;
    } else {
      want = st.remainder ? zopt_ref::remainder_param(bits_f32(w))
             : pdt == ZOPT_DTYPE_BF16 ? rne_bf16_bits(w) : rne_f16_bits(w);
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
         "%s[%s] n=%zu f32 master -> %s param, %zu special values (ties, overflow, inf, NaN, "
         "denormals): %zu mismatches%s%s (NaN kept as NaN; %zu NaNs not the quieted "
         "truncated payload)",
         st.remainder ? "remainder" : "rne", isaName(isa), n, dtype_name(pdt), sv.size(), bad,
         first.empty() ? "" : "; first: ",
         first.c_str(), nanPayloadChanged);
}

// Every variant this CPU runs gives the same bits as the others at every
// length up to two of the widest vector steps and past them (each tail: the
// scalar one of AVX2, the masked one of AVX-512), aligned and not, in place,
// leaving the guards untouched.
void checkUpdateTails(const Step &st, uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  std::vector<std::pair<uint32_t, zopt_update_fn>> fns;
  for (auto &u : st.updates)
    if (cpuRuns(u.first)) fns.push_back(u);
  if (fns.size() < 2) {
    std::printf("SKIP update tails: this CPU runs %zu variant(s)\n", fns.size());
    return;
  }
  Hypers h;
  const Config c{3, true, st.clip ? 0.37 : 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  const bool sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  const uint32_t srKey = zopt_sr_key(42, 3, 5, 0), srFirst = 77;
  const int ip = st.idx[ZOPT_STATE_PARAM], im = st.idx[ZOPT_STATE_MASTER];
  const int ic = st.kahan ? st.idx[ZOPT_STATE_KAHAN_COMP] : -1;
  std::vector<size_t> diff(fns.size(), 0);
  bool guards = true;
  Gen gen(seed);
  for (size_t n = 1; n <= 67; ++n)
    for (size_t off : {size_t(0), size_t(1)}) {
      std::vector<Buf> base;
      for (uint32_t i = 0; i < d->num_states; ++i) base.push_back(makeBuf(d->states[i].dtype, n, off));
      for (size_t e = 0; e < n; ++e)
        for (uint32_t i = 0; i < d->num_states; ++i) {
          const zopt_state_desc &s = d->states[i];
          if (int(i) == ic) continue;  // after the param
          if (!(s.access & ZOPT_ACCESS_READ)) base[i].setBits(e, s.dtype == ZOPT_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu);
          else if (st.remainder && int(i) == im) {
            float x = float(genFor(s.kind, gen, c));
            base[ip].setBits(e, zopt_ref::remainder_param(x));
            base[i].setBits(e, zopt_ref::remainder_rem(x));
          } else if (!(st.remainder && int(i) == ip)) {
            base[i].store(e, genFor(s.kind, gen, c));
          }
          if (ic >= 0 && int(i) == ip) base[ic].store(e, base[ip].value(e) * gen.uni(-1.0 / 256, 1.0 / 256));
        }
      std::vector<std::vector<Buf>> out;
      for (auto &[isa, fn] : fns) {
        std::vector<Buf> b = base;
        std::vector<void *> ptrs;
        for (auto &x : b) ptrs.push_back(x.ptr());
        if (sr) ((zopt_update_sr_fn)(void *)fn)(ptrs.data(), ptrs.data(), int64_t(n), co.data(), srKey, srFirst);
        else fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
        for (auto &x : b) guards = guards && x.guardsIntact();
        out.push_back(std::move(b));
      }
      for (size_t k = 1; k < fns.size(); ++k)
        for (uint32_t i = 0; i < d->num_states; ++i)
          for (size_t e = 0; e < n; ++e) diff[k] += out[k][i].bits(e) != out[0][i].bits(e);
    }
  for (size_t k = 1; k < fns.size(); ++k)
    report(prepOk && diff[k] == 0 && guards,
           "update[%s] == update[%s] bit for bit at n=1..67 (every tail), aligned and not, every state: "
           "%zu differ, guards %s",
           isaName(fns[k].first), isaName(fns[0].first), diff[k], guards ? "intact" : "OVERWRITTEN");
}

} // namespace kc

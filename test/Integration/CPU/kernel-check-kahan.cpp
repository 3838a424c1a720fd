//===- kernel-check-kahan.cpp - Kahan-compensated params ------------------===//
//
// A step whose bf16 param is declared `kahan` (abi.h "Kahan-compensated
// params", docs/NUMERICS.md §11) has a KAHAN_COMP state. checkUpdate checks
// its stores with kahanStoredOk; this file also runs special params and
// compensations through a zero update (bit for bit), every ISA variant on
// the same inputs for several steps (bit for bit), and abi.h's store against
// the reference's.
//
//===----------------------------------------------------------------------===//

#include "kernel-check.h"

#include <cmath>

namespace kc {

bool kahanStoredOk(uint16_t p, uint16_t c, const E &v, uint16_t gotP, uint16_t gotC) {
  // The kernel's f32 value lies within the rule's bound of v; the stored
  // param and (given that param) the compensation are monotone in it.
  const double tol = tolOf(v);
  const float lo = std::nextafter(float(v.v - tol), -INFINITY);
  const float hi = std::nextafter(float(v.v + tol), INFINITY);
  if (is_nan_bits(gotP, ZOPT_DTYPE_BF16) || is_nan_bits(gotC, ZOPT_DTYPE_BF16)) return false;
  const int32_t pa = ord16(zopt_ref::kahan_store(p, c, lo).p);
  const int32_t pb = ord16(zopt_ref::kahan_store(p, c, hi).p);
  if (ord16(gotP) < pa || ord16(gotP) > pb) return false;
  const int32_t ca = ord16(zopt_ref::kahan_comp(p, c, lo, gotP));
  const int32_t cb = ord16(zopt_ref::kahan_comp(p, c, hi, gotP));
  return ord16(gotC) >= ca && ord16(gotC) <= cb;
}

namespace {

// bf16 params and compensations with their edge cases: zeros, ±1 and its
// neighbours, the largest finite, infinities, the smallest normal,
// denormals, half an ULP of 1 (a tie), NaNs (quiet and signalling).
const uint16_t kParams[] = {0x0000, 0x8000, 0x3F80, 0xBF80, 0x3F81, 0x3F7F, 0x7F7F, 0xFF7F,
                            0x7F80, 0xFF80, 0x0080, 0x8080, 0x0001, 0x807F, 0x4049, 0x3DCD,
                            0x7FC0, 0xFFC1, 0x7F81};
const uint16_t kComps[] = {0x0000, 0x8000, 0x3B80, 0xBB80, 0x3B00, 0xBB7F, 0x3BC0, 0x0001,
                           0x8080, 0x3F80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0};

} // namespace

void checkKahanSpecial(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n) {
  const zopt_step_descriptor *d = st.d;
  const int ip = st.idx[ZOPT_STATE_PARAM], ic = st.idx[ZOPT_STATE_KAHAN_COMP];
  Config c{3, true, 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 0.0, 0.0};
  Hypers h;
  h.lr = 0; h.weight_decay = 0;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  // lr = 0: the rule's new value is the param itself (as in checkRne; with
  // L2 decay 0 * inf is NaN, so infinite params are left out there).
  const bool l2 = st.rule == Rule::Adam || st.rule == Rule::AdamAmsgrad || st.rule == Rule::Sgd ||
                  st.rule == Rule::SgdNesterov;
  std::vector<uint16_t> ps;
  for (uint16_t p : kParams)
    if (!(l2 && (p & 0x7FFF) == 0x7F80)) ps.push_back(p);
  const size_t np = ps.size(), nc = sizeof kComps / sizeof kComps[0];
  std::vector<Buf> bufs;
  for (uint32_t i = 0; i < d->num_states; ++i) bufs.push_back(makeBuf(d->states[i].dtype, n, n & 1));
  for (uint32_t i = 0; i < d->num_states; ++i)
    for (size_t e = 0; e < n; ++e) {
      const uint32_t k = d->states[i].kind;
      if (int(i) == ip) bufs[i].setBits(e, ps[e % np]);
      else if (int(i) == ic) bufs[i].setBits(e, kComps[(e / np) % nc]);
      // Positive grads and moments: a finite, positive direction times 0.
      else if (k == ZOPT_STATE_GRAD) bufs[i].store(e, 0.5 / c.invLossScale);
      else if (k == ZOPT_STATE_EXP_AVG_SQ || k == ZOPT_STATE_MAX_EXP_AVG_SQ) bufs[i].store(e, 0.25);
      else bufs[i].store(e, 0.1);
    }
  std::vector<uint16_t> pIn(n), cIn(n);
  for (size_t e = 0; e < n; ++e) { pIn[e] = uint16_t(bufs[ip].bits(e)); cIn[e] = uint16_t(bufs[ic].bits(e)); }
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
  size_t bad = 0, nans = 0;
  std::string first;
  for (size_t e = 0; e < n; ++e) {
    const zopt_ref::KahanOut want = zopt_ref::kahan_store(pIn[e], cIn[e], zopt_ref::from_bf16(pIn[e]));
    const uint16_t gp = uint16_t(bufs[ip].bits(e)), gc = uint16_t(bufs[ic].bits(e));
    auto same = [](uint16_t got, uint16_t w) {
      return is_nan_bits(w, ZOPT_DTYPE_BF16) ? is_nan_bits(got, ZOPT_DTYPE_BF16) : got == w;
    };
    nans += is_nan_bits(want.c, ZOPT_DTYPE_BF16);
    if (!same(gp, want.p) || !same(gc, want.c)) {
      if (!bad++) {
        char m[200];
        std::snprintf(m, sizeof m, "p=0x%04x c=0x%04x -> p'=0x%04x c'=0x%04x, want 0x%04x 0x%04x", pIn[e],
                      cIn[e], gp, gc, want.p, want.c);
        first = m;
      }
    }
  }
  bool guards = true;
  for (auto &b : bufs) guards = guards && b.guardsIntact();
  report(prepOk && bad == 0 && guards,
         "kahan[%s] n=%zu %zu special params x %zu special compensations through a zero update: %zu "
         "mismatches (%zu NaN results)%s%s",
         isaName(isa), n, np, nc, bad, nans, first.empty() ? "" : "; first: ", first.c_str());
}

void checkKahanIsas(const Step &st, size_t n, uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  std::vector<std::pair<uint32_t, zopt_update_fn>> fns;
  for (auto &u : st.updates)
    if (cpuRuns(u.first)) fns.push_back(u);
  if (fns.size() < 2) {
    std::printf("SKIP kahan isas: this CPU runs %zu variant(s)\n", fns.size());
    return;
  }
  Hypers h;
  const Config c{3, true, st.clip ? 0.37 : 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  const int ip = st.idx[ZOPT_STATE_PARAM], ic = st.idx[ZOPT_STATE_KAHAN_COMP];
  std::vector<Buf> base;
  for (uint32_t i = 0; i < d->num_states; ++i) base.push_back(makeBuf(d->states[i].dtype, n, 0));
  Gen gen(seed);
  for (size_t e = 0; e < n; ++e)
    for (uint32_t i = 0; i < d->num_states; ++i) {
      if (int(i) == ic) base[i].store(e, base[ip].value(e) * gen.uni(-1.0 / 256, 1.0 / 256));
      else base[i].store(e, genFor(d->states[i].kind, gen, c));
    }
  const int steps = 5;
  std::vector<std::vector<Buf>> out;
  for (auto &[isa, fn] : fns) {
    std::vector<Buf> b = base;
    std::vector<void *> ptrs;
    for (auto &x : b) ptrs.push_back(x.ptr());
    for (int s = 0; s < steps; ++s) fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
    out.push_back(std::move(b));
  }
  for (size_t k = 1; k < fns.size(); ++k) {
    size_t diff = 0;
    for (uint32_t i = 0; i < d->num_states; ++i)
      for (size_t e = 0; e < n; ++e) diff += out[k][i].bits(e) != out[0][i].bits(e);
    report(prepOk && diff == 0,
           "kahan update[%s] == update[%s] bit for bit, n=%zu, %d steps, every state: %zu differ",
           isaName(fns[k].first), isaName(fns[0].first), n, steps, diff);
  }
}

void checkKahanTracking(const Step &kahan, const Step &master, const Step &plain, size_t n,
                        int steps) {
  // The same rule, gradients and hyperparameters for the three steps; small
  // updates (lr 1e-4 against params of 0.01 to 1, whose bf16 half-ULP is
  // 2^-9 of them) that a plain bf16 param mostly rounds away. Each
  // element's gradient keeps its sign (a steady descent direction, random
  // magnitudes), so the f32 master drifts by about lr per step.
  const Step *sts[3] = {&kahan, &master, &plain};
  uint32_t isa = 0;
  for (auto &u : kahan.updates)
    if (cpuRuns(u.first)) { isa = u.first; break; }
  zopt_update_fn fns[3] = {};
  for (int k = 0; k < 3; ++k)
    for (auto &u : sts[k]->updates)
      if (u.first == isa) fns[k] = u.second;
  if (!fns[0] || !fns[1] || !fns[2]) {
    report(false, "track: the three steps have no common ISA variant this CPU runs");
    return;
  }
  Hypers h;
  h.lr = 1e-4; h.weight_decay = 0.01;
  std::vector<Buf> bufs[3];
  for (int k = 0; k < 3; ++k)
    for (uint32_t i = 0; i < sts[k]->d->num_states; ++i)
      bufs[k].push_back(makeBuf(sts[k]->d->states[i].dtype, n, 0));
  Gen gen(2024);
  const Config c0{1, true, 1.0, 1.0, h.lr, h.weight_decay};
  std::vector<double> p0(n), g(n), sign(n);
  for (size_t e = 0; e < n; ++e) p0[e] = genFor(ZOPT_STATE_PARAM, gen, c0);
  for (size_t e = 0; e < n; ++e) sign[e] = gen.sgn();
  for (int k = 0; k < 3; ++k)
    for (uint32_t i = 0; i < sts[k]->d->num_states; ++i) {
      const uint32_t kind = sts[k]->d->states[i].kind;
      for (size_t e = 0; e < n; ++e)
        bufs[k][i].store(e, kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_MASTER
                                ? double(zopt_ref::from_bf16(rne_bf16(p0[e])))
                                : 0.0);
    }
  bool prepOk = true;
  for (int t = 1; t <= steps; ++t) {
    for (size_t e = 0; e < n; ++e) g[e] = sign[e] * gen.uni(0.1, 1.0);
    const Config c{double(t), true, 1.0, 1.0, h.lr, h.weight_decay};
    for (int k = 0; k < 3; ++k) {
      bool ok;
      std::vector<float> co = runPrepare(*sts[k], h, c, ok);
      prepOk = prepOk && ok;
      std::vector<void *> ptrs;
      for (uint32_t i = 0; i < sts[k]->d->num_states; ++i) {
        if (sts[k]->d->states[i].kind == ZOPT_STATE_GRAD)
          for (size_t e = 0; e < n; ++e) bufs[k][i].store(e, g[e]);
        ptrs.push_back(bufs[k][i].ptr());
      }
      fns[k](ptrs.data(), ptrs.data(), int64_t(n), co.data());
    }
  }
  // Distance of each bf16 param (with its compensation, for Kahan: the
  // value it stands for) to the f32 master, root mean square.
  const int wm = master.idx[ZOPT_STATE_MASTER];
  const int kp = kahan.idx[ZOPT_STATE_PARAM], kc = kahan.idx[ZOPT_STATE_KAHAN_COMP];
  const int pp = plain.idx[ZOPT_STATE_PARAM];
  double sk = 0, skc = 0, sp = 0;
  for (size_t e = 0; e < n; ++e) {
    const double w = bufs[1][wm].value(e);
    sk += std::pow(bufs[0][kp].value(e) - w, 2);
    skc += std::pow(bufs[0][kp].value(e) + bufs[0][kc].value(e) - w, 2);
    sp += std::pow(bufs[2][pp].value(e) - w, 2);
  }
  const double ek = std::sqrt(sk / n), ekc = std::sqrt(skc / n), ep = std::sqrt(sp / n);
  report(prepOk && ek < 0.25 * ep && ekc < ek,
         "track[%s]: %d steps of lr 1e-4, n=%zu: rms distance to the f32 master: kahan param %.3g "
         "(param + compensation %.3g), plain bf16 param %.3g: ratio %.3f (must be < 0.25)",
         isaName(isa), steps, n, ek, ekc, ep, ek / ep);
}

bool kahanSelfTest() {
  // abi.h's store (float arithmetic) against the reference's (double
  // arithmetic rounded once): random params and compensations, and new
  // values near the param and anywhere.
  std::mt19937_64 rng(7);
  size_t bad = 0, cases = 0;
  auto one = [&](uint16_t p, uint16_t c, float v) {
    uint16_t gp, gc;
    zopt_kahan_store(p, c, v, &gp, &gc);
    const zopt_ref::KahanOut w = zopt_ref::kahan_store(p, c, v);
    auto same = [](uint16_t got, uint16_t want) {
      return is_nan_bits(want, ZOPT_DTYPE_BF16) ? is_nan_bits(got, ZOPT_DTYPE_BF16) : got == want;
    };
    bad += !same(gp, w.p) || !same(gc, w.c);
    ++cases;
  };
  for (int i = 0; i < 2000000; ++i) {
    const uint16_t p = uint16_t(rng()), c = uint16_t(rng());
    const float pf = zopt_ref::from_bf16(p);
    one(p, c, bits_f32(uint32_t(rng())));
    one(p, c, pf + pf * float(std::ldexp(double(int32_t(rng() % 2001) - 1000), -16)));
  }
  for (uint16_t p : kParams)
    for (uint16_t c : kComps)
      for (uint16_t q : kParams) one(p, c, zopt_ref::from_bf16(q));
  report(bad == 0, "self-test: Kahan-compensated params: abi.h's store agrees with the reference's "
                   "(%zu cases, %zu mismatches)", cases, bad);
  return bad == 0;
}

} // namespace kc

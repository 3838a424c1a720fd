//===- kernel-check-q8.cpp - UPDATE kernels with q8 moments --------------===//
//
// zopt-kernel-check's UPDATE check for a step with q8 moments (abi.h "q8
// moments", docs/NUMERICS.md §10), every element: random codes and a random
// absmax per block (never zero) are decoded by the reference (map[code] *
// absmax, f32); the reference's rule runs in float64 on E from the decoded
// moments; then
//  * the param (or f32 / remainder master and its param) within the
//    reference's bound, as kernel-check-update.cpp checks it (the update
//    uses the new moments before quantization);
//  * each block's stored absmax within the bound of max |new moment|;
//  * each stored code is the reference's encode (float64 midpoints) of the
//    kernel's f32 moment against the stored absmax: the kernel's moment
//    lies within the reference's bound, and the encode is monotone, so the
//    code lies between the encodes of the bound's two ends. That is the
//    reference's code itself, or its neighbour where the moment lies within
//    f32 error of a midpoint (counted);
//  * out of place equals in place; inputs and guards untouched.
// The call starts at a block boundary (element 0); n need not be a multiple
// of the block: the last block is partial.
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

namespace kc {

namespace {

struct Q8State {
  int idx = -1, absIdx = -1; // descriptor states of the codes and the absmax
  bool isUnsigned = false;
  float map[256];
};

} // namespace

void checkQ8Update(const Step &st, uint32_t isa, zopt_update_fn fn, size_t n, const Config &c,
                   uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  Hypers h;
  h.bias_correction = c.biasCorrection;
  h.lr = c.lr; h.weight_decay = c.wd;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  char tag[128];
  configTag(c, tag, sizeof tag);
  const size_t nb = (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK;
  const size_t off = (seed & 1) ? 1 : 0; // misaligned pointers every other run
  Q8State q[2]; // exp_avg, exp_avg_sq
  for (int k = 0; k < 2; ++k) {
    const uint32_t kind = k ? ZOPT_STATE_EXP_AVG_SQ : ZOPT_STATE_EXP_AVG;
    const int i = st.idx[kind];
    if (i >= 0 && d->states[i].dtype == ZOPT_DTYPE_Q8) {
      q[k].idx = i;
      q[k].absIdx = st.idx[k ? ZOPT_STATE_EXP_AVG_SQ_ABSMAX : ZOPT_STATE_EXP_AVG_ABSMAX];
      q[k].isUnsigned = k == 1;
      zopt_ref::q8_map_f32(k == 0, q[k].map);
    }
  }
  std::vector<Buf> bufs;
  for (uint32_t i = 0; i < d->num_states; ++i)
    bufs.push_back(makeBuf(d->states[i].dtype, (d->states[i].flags & ZOPT_STATE_PER_BLOCK) ? nb : n, off));
  Gen gen(seed);
  // Random absmax per block, then every element's inputs.
  for (auto &s : q)
    if (s.idx >= 0)
      for (size_t b = 0; b < nb; ++b)
        bufs[s.absIdx].store(b, s.isUnsigned ? gen.uni(1e-3, 1e-1) : gen.uni(1e-2, 0.3));
  std::vector<RefIn> in(n);
  const int im = st.idx[ZOPT_STATE_MASTER], iparam = st.idx[ZOPT_STATE_PARAM];
  const int ip = im >= 0 ? im : iparam;
  for (size_t e = 0; e < n; ++e) {
    for (uint32_t i = 0; i < d->num_states; ++i) {
      const zopt_state_desc &s = d->states[i];
      if (s.flags & ZOPT_STATE_PER_BLOCK) continue;
      if (!(s.access & ZOPT_ACCESS_READ)) { // write-only: poison
        bufs[i].setBits(e, s.dtype == ZOPT_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu);
        continue;
      }
      double v;
      const Q8State *qs = int(i) == q[0].idx ? &q[0] : int(i) == q[1].idx ? &q[1] : nullptr;
      if (qs) { // a random code, decoded by the reference
        const uint8_t code = uint8_t(gen.rng());
        bufs[i].setBits(e, code);
        v = zopt_ref::q8_decode(qs->map, code, float(bufs[qs->absIdx].value(e / ZOPT_Q8_BLOCK)));
      } else if (st.kahan && int(i) == st.idx[ZOPT_STATE_KAHAN_COMP]) {
        // A Kahan compensation: up to about an ULP of the param.
        bufs[i].store(e, in[e].p * gen.uni(-1.0 / 256, 1.0 / 256));
        continue;
      } else if (st.remainder && int(i) == im) {
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
      }
      if (int(i) == ip) in[e].p = v;
    }
  }
  std::vector<Buf> before = bufs, outBufs = bufs;
  std::vector<void *> inPtrs, outPtrs;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    inPtrs.push_back(bufs[i].ptr());
    outPtrs.push_back((d->states[i].access & ZOPT_ACCESS_WRITE) ? outBufs[i].ptr() : nullptr);
  }
  const bool sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  const uint32_t srKey = zopt_sr_key(42, uint64_t(c.t), 3, 0), srFirst = 0; // a block boundary
  auto run = [&](void *const *inP, void *const *outP) {
    if (sr) ((zopt_update_sr_fn)(void *)fn)(inP, outP, int64_t(n), co.data(), srKey, srFirst);
    else fn(inP, outP, int64_t(n), co.data());
  };
  run(inPtrs.data(), outPtrs.data());
  size_t inChanged = 0, placeDiff = 0;
  for (uint32_t i = 0; i < d->num_states; ++i)
    for (size_t e = 0; e < bufs[i].n; ++e) inChanged += bufs[i].bits(e) != before[i].bits(e);
  std::vector<void *> ptrs;
  for (auto &b : bufs) ptrs.push_back(b.ptr());
  run(ptrs.data(), ptrs.data());
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].access & ZOPT_ACCESS_WRITE)
      for (size_t e = 0; e < bufs[i].n; ++e) placeDiff += bufs[i].bits(e) != outBufs[i].bits(e);
  report(inChanged == 0 && placeDiff == 0,
         "q8 update[%s] n=%zu out of place: %zu input elements changed, %zu outputs differ from "
         "the in-place run", isaName(isa), n, inChanged, placeDiff);

  // The reference per element, then per block.
  std::vector<RefOut> ref(n);
  for (size_t e = 0; e < n; ++e) ref[e] = reference(st.rule, h, c, false, in[e]);
  size_t bad = 0, neighbour = 0, codes = 0;
  double worst = 0;
  std::string firstBad;
  auto fail = [&](const char *fmt, auto... args) {
    if (bad++) return;
    char m[320];
    std::snprintf(m, sizeof m, fmt, args...);
    firstBad = m;
  };
  for (const Q8State &s : q) {
    if (s.idx < 0 || !(d->states[s.idx].access & ZOPT_ACCESS_WRITE)) continue;
    for (size_t b = 0; b < nb; ++b) {
      const size_t e0 = b * ZOPT_Q8_BLOCK, e1 = std::min(n, e0 + ZOPT_Q8_BLOCK);
      double want = 0, tol = 0;
      for (size_t e = e0; e < e1; ++e) {
        const E &w = s.isUnsigned ? ref[e].v : ref[e].m;
        want = std::max(want, std::fabs(w.v));
        tol = std::max(tol, tolOf(w));
      }
      const float a = float(bufs[s.absIdx].value(b));
      if (!(std::fabs(double(a) - want) <= tol))
        fail("%s absmax[%zu] = %.9g, expected %.9g +- %.3g", kindName(d->states[s.idx].kind), b, a,
             want, tol);
      for (size_t e = e0; e < e1; ++e) {
        const E &w = s.isUnsigned ? ref[e].v : ref[e].m;
        const double t = tolOf(w);
        // The kernel's f32 moment x lies in [w - t, w + t]; encode is
        // monotone in x, so the code lies between the ends' codes.
        const float lo = std::nextafter(float(w.v - t), -INFINITY);
        const float hi = std::nextafter(float(w.v + t), INFINITY);
        const uint8_t cl = zopt_ref::q8_encode(s.map, s.isUnsigned, lo, a);
        const uint8_t ch = zopt_ref::q8_encode(s.map, s.isUnsigned, hi, a);
        const uint8_t cw = zopt_ref::q8_encode(s.map, s.isUnsigned, float(w.v), a);
        const uint8_t got = uint8_t(bufs[s.idx].bits(e));
        ++codes;
        neighbour += got != cw;
        if (got < std::min(cl, ch) || got > std::max(cl, ch))
          fail("%s[%zu] code %u, the reference encodes %.9g +- %.3g (absmax %.9g) to %u..%u",
               kindName(d->states[s.idx].kind), e, got, w.v, t, a, std::min(cl, ch),
               std::max(cl, ch));
      }
    }
  }
  // The param (and master) from the unquantized new moments.
  for (size_t e = 0; e < n; ++e) {
    const E &w = ref[e].p;
    const double t = tolOf(w);
    if (im >= 0) {
      uint32_t mb = bufs[im].bits(e);
      if (st.remainder) mb = joinedMaster(bufs[iparam].bits(e), mb);
      const double got = bits_f32(mb);
      worst = std::max(worst, std::fabs(got - w.v) / t);
      if (!(std::fabs(got - w.v) <= t))
        fail("master[%zu] %.9g expected %.9g +- %.3g (p=%.9g g=%.9g m=%.9g v=%.9g)", e, got, w.v, t,
             in[e].p, in[e].g, in[e].m, in[e].v);
      const uint32_t pdt = d->states[iparam].dtype;
      const bool srp = d->states[iparam].rounding == ZOPT_ROUND_STOCHASTIC;
      const uint32_t pb = bufs[iparam].bits(e);
      const uint32_t wantP = st.remainder              ? zopt_ref::remainder_param(bits_f32(mb))
                             : pdt == ZOPT_DTYPE_F32   ? mb
                             : srp                     ? zopt_ref::sr_bf16(bits_f32(mb), srKey, uint32_t(iparam), srFirst + uint32_t(e))
                             : pdt == ZOPT_DTYPE_BF16  ? rne_bf16_bits(mb)
                                                       : rne_f16_bits(mb);
      if (pb != wantP) fail("param[%zu] 0x%x, from the master 0x%08x: 0x%x", e, pb, mb, wantP);
    } else if (st.kahan) { // abi.h "Kahan-compensated params"
      const int ic = st.idx[ZOPT_STATE_KAHAN_COMP];
      if (!kahanStoredOk(uint16_t(before[iparam].bits(e)), uint16_t(before[ic].bits(e)), w,
                         uint16_t(bufs[iparam].bits(e)), uint16_t(bufs[ic].bits(e))))
        fail("param[%zu] 0x%x, compensation 0x%x: not the Kahan store of any f32 in %.9g +- %.3g", e,
             bufs[iparam].bits(e), bufs[ic].bits(e), w.v, t);
    } else {
      const uint32_t pdt = d->states[iparam].dtype;
      const double got = bufs[iparam].value(e);
      bool ok;
      if (pdt == ZOPT_DTYPE_F32) {
        worst = std::max(worst, std::fabs(got - w.v) / t);
        ok = std::fabs(got - w.v) <= t;
      } else { // RNE of the kernel's f32 value, which lies in [w - t, w + t]
        const bool bf = pdt == ZOPT_DTYPE_BF16;
        const uint16_t lo = bf ? rne_bf16(w.v - t) : rne_f16(w.v - t);
        const uint16_t hi = bf ? rne_bf16(w.v + t) : rne_f16(w.v + t);
        const int32_t g = ord16(uint16_t(bufs[iparam].bits(e)));
        ok = g >= std::min(ord16(lo), ord16(hi)) && g <= std::max(ord16(lo), ord16(hi));
      }
      if (!ok) fail("param[%zu] %.9g expected %.9g +- %.3g", e, got, w.v, t);
    }
  }
  bool guards = true;
  for (auto &b : bufs) guards = guards && b.guardsIntact();
  report(prepOk && bad == 0 && guards,
         "q8 update[%s] n=%zu %s%s: %zu bad, %zu codes of which %zu the reference's neighbour "
         "(within f32 error of a midpoint), max param err/tol=%.3f, guards %s, prepare %s%s%s",
         isaName(isa), n, tag, off ? " misaligned" : "", bad, codes, neighbour, worst,
         guards ? "intact" : "OVERWRITTEN", prepOk ? "ok" : "BAD", firstBad.empty() ? "" : "; first: ",
         firstBad.c_str());
}

} // namespace kc

namespace kc {

// Every UPDATE variant this CPU runs on the same random inputs: the same
// bits in every written state (docs/NUMERICS.md §10: decode, max and encode
// are exact). Then special blocks, every variant: a block of zeros (absmax
// 0 stays 0 with the zero code), a block with a NaN gradient (the block's
// absmax NaN, every code the zero code) and a block of tiny gradients next
// to a large one (the zero point: a nonzero v never takes code 0).
void checkQ8Isas(const Step &st, size_t n) {
  const zopt_step_descriptor *d = st.d;
  std::vector<std::pair<uint32_t, zopt_update_fn>> fns;
  for (auto &u : st.updates)
    if (cpuRuns(u.first)) fns.push_back(u);
  if (fns.empty()) return;
  Hypers h;
  const Config c{3, true, st.clip ? 0.37 : 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  const size_t nb = (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK;
  const bool sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  const uint32_t srKey = zopt_sr_key(42, 3, 3, 0);
  auto fresh = [&]() {
    std::vector<Buf> bufs;
    for (uint32_t i = 0; i < d->num_states; ++i)
      bufs.push_back(makeBuf(d->states[i].dtype, (d->states[i].flags & ZOPT_STATE_PER_BLOCK) ? nb : n, 0));
    return bufs;
  };
  auto call = [&](zopt_update_fn fn, std::vector<Buf> &bufs) {
    std::vector<void *> p;
    for (auto &b : bufs) p.push_back(b.ptr());
    if (sr) ((zopt_update_sr_fn)(void *)fn)(p.data(), p.data(), int64_t(n), co.data(), srKey, 0);
    else fn(p.data(), p.data(), int64_t(n), co.data());
  };
  // Random inputs (codes, absmax, params, grads).
  std::vector<Buf> base = fresh();
  Gen gen(99);
  const int im = st.idx[ZOPT_STATE_MASTER], iparam = st.idx[ZOPT_STATE_PARAM];
  for (uint32_t i = 0; i < d->num_states; ++i) {
    const zopt_state_desc &s = d->states[i];
    for (size_t e = 0; e < base[i].n; ++e) {
      if (s.flags & ZOPT_STATE_PER_BLOCK) base[i].store(e, gen.uni(1e-3, 0.3));
      else if (s.dtype == ZOPT_DTYPE_Q8) base[i].setBits(e, uint8_t(gen.rng()));
      else if (st.remainder && int(i) == im) {
        const float x = float(genFor(s.kind, gen, c));
        base[iparam].setBits(e, zopt_ref::remainder_param(x));
        base[i].setBits(e, zopt_ref::remainder_rem(x));
      } else if (!(st.remainder && int(i) == iparam)) base[i].store(e, genFor(s.kind, gen, c));
    }
  }
  std::vector<Buf> first = base;
  call(fns[0].second, first);
  for (size_t k = 1; k < fns.size(); ++k) {
    std::vector<Buf> other = base;
    call(fns[k].second, other);
    size_t diff = 0;
    for (uint32_t i = 0; i < d->num_states; ++i)
      for (size_t e = 0; e < first[i].n; ++e) diff += first[i].bits(e) != other[i].bits(e);
    report(prepOk && diff == 0, "q8 update[%s] == update[%s] bit for bit, n=%zu, every state: %zu differ",
           isaName(fns[k].first), isaName(fns[0].first), n, diff);
  }

  // Special blocks: 0 zeros, 1 a NaN gradient, 2 tiny gradients and a large one.
  if (nb < 3) return;
  const int ig = st.idx[ZOPT_STATE_GRAD];
  for (auto &[isa, fn] : fns) {
    std::vector<Buf> b = base;
    for (uint32_t i = 0; i < d->num_states; ++i) {
      const zopt_state_desc &s = d->states[i];
      const bool isM = s.kind == ZOPT_STATE_EXP_AVG || s.kind == ZOPT_STATE_EXP_AVG_ABSMAX;
      if (s.flags & ZOPT_STATE_PER_BLOCK)
        for (size_t k = 0; k < 3; ++k) b[i].store(k, 0.0);
      else if (s.dtype == ZOPT_DTYPE_Q8)
        for (size_t e = 0; e < 3 * ZOPT_Q8_BLOCK; ++e)
          b[i].setBits(e, isM ? ZOPT_Q8_SIGNED_ZERO : ZOPT_Q8_UNSIGNED_ZERO);
    }
    for (size_t e = 0; e < 3 * ZOPT_Q8_BLOCK; ++e) {
      const size_t blk = e / ZOPT_Q8_BLOCK, j = e % ZOPT_Q8_BLOCK;
      double g = blk == 0 ? 0.0 : blk == 1 ? (j == 17 ? NAN : 0.5) : (j == 5 ? 1.0 : 1e-20 * (1 + j));
      b[ig].store(e, g / c.invLossScale);
    }
    call(fn, b);
    size_t bad = 0;
    std::string why;
    for (uint32_t k : {ZOPT_STATE_EXP_AVG, ZOPT_STATE_EXP_AVG_SQ}) {
      const int i = st.idx[k];
      if (i < 0 || d->states[i].dtype != ZOPT_DTYPE_Q8) continue;
      const int a = st.idx[k == ZOPT_STATE_EXP_AVG ? ZOPT_STATE_EXP_AVG_ABSMAX : ZOPT_STATE_EXP_AVG_SQ_ABSMAX];
      const uint32_t zero = k == ZOPT_STATE_EXP_AVG ? ZOPT_Q8_SIGNED_ZERO : ZOPT_Q8_UNSIGNED_ZERO;
      auto need = [&](bool ok, const char *what) {
        if (!ok && !bad++) why = std::string(kindName(k)) + ": " + what;
      };
      need(b[a].bits(0) == 0, "a block of zeros keeps absmax +0");
      need(std::isnan(b[a].value(1)), "a NaN gradient makes the block's absmax NaN");
      need(b[a].value(2) > 0 && std::isfinite(b[a].value(2)), "block 2's absmax positive, finite");
      for (size_t j = 0; j < ZOPT_Q8_BLOCK; ++j) {
        need(b[i].bits(j) == zero, "a block of zeros keeps the zero code");
        need(b[i].bits(ZOPT_Q8_BLOCK + j) == zero, "a NaN block stores the zero code");
        if (k == ZOPT_STATE_EXP_AVG_SQ)
          need(b[i].bits(2 * ZOPT_Q8_BLOCK + j) >= 1, "the zero point: a nonzero v takes code >= 1");
      }
    }
    bool guards = true;
    for (auto &x : b) guards = guards && x.guardsIntact();
    report(bad == 0 && guards, "q8 special blocks[%s]: zeros stay zero (absmax 0, zero code), a NaN "
           "gradient poisons its block (absmax NaN, zero code), tiny v next to a large one never "
           "code 0: %zu bad%s%s", isaName(isa), bad, why.empty() ? "" : "; first: ", why.c_str());
  }
}

} // namespace kc

namespace kc {

// --q8-sweep=STRIDE on a step whose new moments are the gradient itself
// (test/Integration/CPU/Inputs/q8_sweep.mlir, run with beta1 = beta2 = 0,
// lr = 0): each block holds 1.0 (so its absmax is 1 and r = x) and 255
// chosen values; every code the kernel stores must be the reference's
// midpoint encode, exactly. The values: every STRIDE-th f32 pattern of
// [-1, 1], then every map value and every f32 around every midpoint (+-2
// ulp). The kernel's encode against the definition, value by value, as
// zopt-q8-tables-check checks abi.h's: through the vector loops (full
// blocks), then through the scalar tail loops (calls shorter than a
// vector), which emit the encode differently (Q8Encode.cpp).
void checkQ8Sweep(const Step &st, uint32_t isa, zopt_update_fn fn, uint64_t stride) {
  const zopt_step_descriptor *d = st.d;
  const int ig = st.idx[ZOPT_STATE_GRAD], ip = st.idx[ZOPT_STATE_PARAM];
  const int im = st.idx[ZOPT_STATE_EXP_AVG], iv = st.idx[ZOPT_STATE_EXP_AVG_SQ];
  const int am = st.idx[ZOPT_STATE_EXP_AVG_ABSMAX], av = st.idx[ZOPT_STATE_EXP_AVG_SQ_ABSMAX];
  if (im < 0 || iv < 0 || am < 0 || av < 0 || d->states[ig].dtype != ZOPT_DTYPE_F32 ||
      d->states[ip].dtype != ZOPT_DTYPE_F32) {
    report(false, "q8 sweep: needs f32 param and grad and q8 exp_avg and exp_avg_sq");
    return;
  }
  Hypers h;
  h.beta1 = 0; h.beta2 = 0; h.lr = 0; h.weight_decay = 0; h.bias_correction = false;
  const Config c{1, false, 1.0, 1.0, 0, 0};
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  float map[2][256];
  zopt_ref::q8_map_f32(true, map[0]);
  zopt_ref::q8_map_f32(false, map[1]);
  std::vector<float> xs;
  for (uint64_t b = 0; b <= 0x3F800000u; b += stride) {
    xs.push_back(bits_f32(uint32_t(b)));
    xs.push_back(bits_f32(uint32_t(b) | 0x80000000u));
  }
  for (int s = 0; s < 2; ++s)
    for (int k = 0; k < 256; ++k) {
      float y[2] = {map[s][k], k < 255 ? float((double(map[s][k]) + double(map[s][k + 1])) / 2) : 1.0f};
      for (float x : y)
        for (float z : {x, std::nextafter(x, 2.0f), std::nextafter(x, -2.0f),
                        std::nextafter(std::nextafter(x, 2.0f), 2.0f),
                        std::nextafter(std::nextafter(x, -2.0f), -2.0f)})
          if (z >= -1.0f && z <= 1.0f) xs.push_back(z);
    }
  const size_t blocks = 4096, n = blocks * ZOPT_Q8_BLOCK;
  std::vector<Buf> bufs;
  for (uint32_t i = 0; i < d->num_states; ++i)
    bufs.push_back(makeBuf(d->states[i].dtype, (d->states[i].flags & ZOPT_STATE_PER_BLOCK) ? blocks : n, 0));
  // Each block holds 1.0 (its absmax) and `per` values. The vector pass:
  // 255 values a block, one call over all blocks (full blocks: the vector
  // loops). The tail pass: 6 values a block, one call per block of 7
  // elements, shorter than any vector: the scalar loops.
  auto pass = [&](size_t per, bool tail) {
    size_t bad = 0, done = 0;
    std::string first;
    for (size_t at = 0; at < xs.size(); at += per * blocks) {
      const size_t cnt = std::min(xs.size() - at, per * blocks);
      const size_t nb = (cnt + per - 1) / per, nn = nb * ZOPT_Q8_BLOCK;
      for (size_t b = 0; b < nb; ++b) {
        bufs[am].store(b, 0.0);
        bufs[av].store(b, 0.0);
        for (size_t j = 0; j <= per; ++j) { // what a call reads
          const size_t e = b * ZOPT_Q8_BLOCK + j, xi = at + b * per + j - 1;
          const float x = j == 0 ? 1.0f : xi < at + cnt ? xs[xi] : 0.0f;
          bufs[ig].setBits(e, f32_bits(x));
          bufs[ip].setBits(e, f32_bits(0.5f));
          bufs[im].setBits(e, ZOPT_Q8_SIGNED_ZERO);
          bufs[iv].setBits(e, ZOPT_Q8_UNSIGNED_ZERO);
        }
      }
      if (!tail) {
        std::vector<void *> p;
        for (auto &b : bufs) p.push_back(b.ptr());
        fn(p.data(), p.data(), int64_t(nn), co.data());
      } else {
        void *p[ZOPT_MAX_STATES];
        for (size_t b = 0; b < nb; ++b) {
          for (uint32_t i = 0; i < d->num_states; ++i) {
            const bool pb = d->states[i].flags & ZOPT_STATE_PER_BLOCK;
            p[i] = bufs[i].ptr() + (pb ? b : b * ZOPT_Q8_BLOCK) * dtype_size(d->states[i].dtype);
          }
          fn(p, p, int64_t(per + 1), co.data());
        }
      }
      for (size_t e = 0; e < nn; e += e % ZOPT_Q8_BLOCK < per ? 1 : ZOPT_Q8_BLOCK - per) {
        const float x = bits_f32(bufs[ig].bits(e));
        for (int s = 0; s < 2; ++s) {
          const uint8_t want = zopt_ref::q8_encode(map[s], s == 1, x, 1.0f);
          const uint32_t got = bufs[s ? iv : im].bits(e);
          const float a = float(bufs[s ? av : am].value(e / ZOPT_Q8_BLOCK));
          if ((got != want || a != 1.0f) && !bad++) {
            char m[200];
            std::snprintf(m, sizeof m, "%s map: x = %a (0x%08x) code %u, want %u (absmax %a)",
                          s ? "unsigned" : "signed", x, f32_bits(x), got, want, a);
            first = m;
          }
        }
        done += e % ZOPT_Q8_BLOCK != 0;
      }
    }
    report(prepOk && bad == 0,
           "q8 sweep%s[%s]: the kernel's codes of every %" PRIu64 "th f32 pattern in [-1, 1], every map "
           "value and midpoint (+-2 ulp), absmax 1, both maps == the reference's encode: %zu values, "
           "%zu differ%s%s", tail ? " tail (scalar loops)" : "", isaName(isa), stride, done, bad,
           first.empty() ? "" : "; first: ", first.c_str());
  };
  pass(255, false);
  pass(6, true);
}

} // namespace kc

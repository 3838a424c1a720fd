//===- kernel-check-sumsq.cpp - SUMSQ kernels against the reference ------===//
//
// zopt-kernel-check's SUMSQ checks: abi.h's summation order bit for bit
// (the reference's sumsq_block), the value within the f64 summation bound
// of a long double sum, and a non-finite result for an inf or NaN gradient
// at the first, middle and last element; a pair entry (abi.h "SUMSQ
// pairs") against two calls of the single kernel, bit for bit.
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

namespace kc {

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

void checkSumsqPair(const Step &st, uint32_t isa, zopt_sumsq_fn fn, zopt_sumsq2_fn fn2, uint64_t seed) {
  const zopt_step_descriptor *d = st.d;
  Config c{3, true, 0.37, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  if (!st.clip) c.clipCoef = 1;
  Hypers h;
  bool prepOk;
  std::vector<float> co = runPrepare(st, h, c, prepOk);
  // Chunk 1 with other coefficients (another tensor's): the unscale halved.
  std::vector<float> co1 = co;
  for (float &v : co1) v *= 0.5f;
  // (n0, n1): equal, either longer, vector-length multiples, tails, 1.
  const size_t pairs[][2] = {{4099, 4099}, {4099, 131}, {131, 4099}, {64, 96}, {67, 1}, {1, 33}, {31, 32}};
  Gen gen(seed);
  for (auto &pr : pairs) {
    std::vector<Buf> b0, b1;
    for (uint32_t i = 0; i < d->num_states; ++i) {
      b0.push_back(makeBuf(d->states[i].dtype, pr[0], seed & 1));
      b1.push_back(makeBuf(d->states[i].dtype, pr[1], (seed >> 1) & 1));
      for (size_t e = 0; e < pr[0]; ++e) b0[i].store(e, genFor(d->states[i].kind, gen, c));
      for (size_t e = 0; e < pr[1]; ++e) b1[i].store(e, genFor(d->states[i].kind, gen, c));
    }
    std::vector<void *> p0, p1;
    for (auto &b : b0) p0.push_back(b.ptr());
    for (auto &b : b1) p1.push_back(b.ptr());
    Buf &g1 = b1[st.idx[ZOPT_STATE_GRAD]];
    // Then with an inf at chunk 1's last element: chunk 0's partial stays.
    for (int inf = 0; inf < 2; ++inf) {
      uint32_t saved = g1.bits(pr[1] - 1);
      if (inf)
        g1.setBits(pr[1] - 1, g1.dtype == ZOPT_DTYPE_F32 ? 0x7F800000u : g1.dtype == ZOPT_DTYPE_BF16 ? 0x7F80u : 0x7C00u);
      double out[2] = {-1, -1};
      fn2(p0.data(), int64_t(pr[0]), co.data(), p1.data(), int64_t(pr[1]), co1.data(), out);
      double s0 = fn(p0.data(), int64_t(pr[0]), co.data()), s1 = fn(p1.data(), int64_t(pr[1]), co1.data());
      report(prepOk && f64_bits(out[0]) == f64_bits(s0) && f64_bits(out[1]) == f64_bits(s1) &&
                 std::isfinite(out[1]) == !inf,
             "sumsq2[%s] n=%zu,%zu%s: the pair entry %.17g %.17g, two calls %.17g %.17g", isaName(isa), pr[0],
             pr[1], inf ? " (inf in the second)" : "", out[0], out[1], s0, s1);
      g1.setBits(pr[1] - 1, saved);
    }
  }
}

} // namespace kc

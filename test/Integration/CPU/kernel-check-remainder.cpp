//===- kernel-check-remainder.cpp - a remainder master against its twin --===//
//
// zopt-kernel-check --twin=F32MASTER.so: a step with a remainder master
// (abi.h "Remainder masters", docs/NUMERICS.md §9) against the same step
// with a plain f32 master (its twin), several steps on the same random
// data, every element, bit for bit: the rebuilt master equals the twin's
// f32 master, the param equals the twin's master rounded as §9 says
// (nearest, ties away), and every other written state equals the twin's.
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

namespace kc {

void checkRemainderTwin(const Step &st, const Step &tw, uint32_t isa, zopt_update_fn fa,
                        zopt_update_fn fb, size_t n, int steps, uint64_t seed) {
  const zopt_step_descriptor *da = st.d, *db = tw.d;
  std::vector<Buf> a, b;
  for (uint32_t i = 0; i < da->num_states; ++i) a.push_back(makeBuf(da->states[i].dtype, n, seed & 1));
  for (uint32_t i = 0; i < db->num_states; ++i) b.push_back(makeBuf(db->states[i].dtype, n, 0));
  const int ap = st.idx[ZOPT_STATE_PARAM], am = st.idx[ZOPT_STATE_MASTER];
  const int bp = tw.idx[ZOPT_STATE_PARAM], bm = tw.idx[ZOPT_STATE_MASTER];
  Gen gen(seed);
  const Config c0{1, true, st.clip ? 0.37 : 1.0, st.lossScale ? 1.0 / 1024 : 1.0, 1e-2, 0.1};
  // The same random f32 master (split for the remainder step) and moments.
  for (size_t e = 0; e < n; ++e) {
    const float x = float(genFor(ZOPT_STATE_MASTER, gen, c0));
    a[ap].setBits(e, zopt_ref::remainder_param(x));
    a[am].setBits(e, zopt_ref::remainder_rem(x));
    b[bm].setBits(e, f32_bits(x));
    b[bp].setBits(e, rne_bf16_bits(f32_bits(x)));
    for (uint32_t k = ZOPT_STATE_EXP_AVG; k <= ZOPT_STATE_MOMENTUM_BUFFER; ++k)
      if (st.idx[k] >= 0) {
        double v = a[st.idx[k]].store(e, genFor(k, gen, c0));
        b[tw.idx[k]].store(e, v);
      }
  }
  size_t bad = 0, ties = 0;
  std::string first;
  int stepsRun = 0;
  for (int t = 1; t <= steps; ++t) {
    Config c = c0;
    c.t = t;
    for (size_t e = 0; e < n; ++e) {
      double g = a[st.idx[ZOPT_STATE_GRAD]].store(e, genFor(ZOPT_STATE_GRAD, gen, c));
      b[tw.idx[ZOPT_STATE_GRAD]].store(e, g);
    }
    Hypers h;
    bool okA, okB;
    std::vector<float> coA = runPrepare(st, h, c, okA), coB = runPrepare(tw, h, c, okB);
    std::vector<void *> pa, pb;
    for (auto &x : a) pa.push_back(x.ptr());
    for (auto &x : b) pb.push_back(x.ptr());
    fa(pa.data(), pa.data(), int64_t(n), coA.data());
    fb(pb.data(), pb.data(), int64_t(n), coB.data());
    ++stepsRun;
    for (size_t e = 0; e < n; ++e) {
      const uint32_t w = b[bm].bits(e), got = joinedMaster(a[ap].bits(e), a[am].bits(e));
      const uint16_t wantP = zopt_ref::remainder_param(bits_f32(w));
      bool ok = okA && okB && got == w && a[ap].bits(e) == wantP;
      ties += wantP != b[bp].bits(e); // the twin's param is RNE(master)
      for (uint32_t k = ZOPT_STATE_EXP_AVG; k <= ZOPT_STATE_MOMENTUM_BUFFER; ++k)
        if (st.idx[k] >= 0) ok = ok && a[st.idx[k]].bits(e) == b[tw.idx[k]].bits(e);
      if (!ok && !bad++) {
        char m[256];
        std::snprintf(m, sizeof m, "step %d element %zu: rebuilt master 0x%08x param 0x%04x, twin's "
                      "master 0x%08x (param wanted 0x%04x)", t, e, got, a[ap].bits(e), w, wantP);
        first = m;
      }
    }
  }
  bool guards = true;
  for (auto &x : a) guards = guards && x.guardsIntact();
  report(bad == 0 && guards,
         "twin[%s] n=%zu %d steps: remainder step vs f32-master step bit for bit (rebuilt master, "
         "moments; param = nearest-away(master)): %zu mismatches, %zu params differ from the twin's "
         "RNE (ties), guards %s%s%s",
         isaName(isa), n, stepsRun, bad, ties, guards ? "intact" : "OVERWRITTEN",
         first.empty() ? "" : "; first: ", first.c_str());
}

} // namespace kc

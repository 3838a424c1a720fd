//===- kernel-check-narrow.cpp - bf16 moment stores on special values -----===//
//
// zopt-kernel-check --rne on an Adam(W) step without an f32 master whose
// moments are bf16 rounded to nearest even (the 14 B/param layout:
// examples/adamw_bf16_zero2.mlir): the narrowing of the new moments, bit for
// bit, on special values. checkRne needs a master; here the values come
// from the gradient instead: with beta1 = beta2 = 0 and clip_coef = 1 the
// new moments are m' = RN(g * s) and v' = RN(m' * m') (plus +0), where s is
// the f32 inverse loss scale PREPARE hands the kernel. Each call sets s to
// one special value (ties either way, overflow, inf, denormals, NaNs with
// a payload the rounding's carry would change) and g to powers of two and
// a few other bf16 values, lane by lane; a second call puts one NaN into
// the gradient, so that the vector holding it takes the NaN path and its
// neighbours do not. The same bits on every variant and in every tail
// (n = 100: vector loop and tail on every ISA).
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

namespace kc {

// The bf16 store of an f32 value: RNE, a NaN quieted with its payload.
static uint16_t storeBf16(float x) {
  const uint32_t b = f32_bits(x);
  return is_nan_bits(b, ZOPT_DTYPE_F32) ? uint16_t((b | 0x400000u) >> 16) : rne_bf16_bits(b);
}

bool narrowCheckApplies(const Step &st) {
  const zopt_step_descriptor *d = st.d;
  const int im = st.idx[ZOPT_STATE_EXP_AVG], iv = st.idx[ZOPT_STATE_EXP_AVG_SQ];
  if ((st.rule != Rule::Adam && st.rule != Rule::AdamW) || st.idx[ZOPT_STATE_MASTER] >= 0 ||
      st.q8 || st.remainder || st.kahan || im < 0 || iv < 0)
    return false;
  for (int i : {im, iv})
    if (d->states[i].dtype != ZOPT_DTYPE_BF16 || d->states[i].rounding == ZOPT_ROUND_STOCHASTIC)
      return false;
  return true;
}

void checkNarrowMoments(const Step &st, uint32_t isa, zopt_update_fn fn) {
  const zopt_step_descriptor *d = st.d;
  const int im = st.idx[ZOPT_STATE_EXP_AVG], iv = st.idx[ZOPT_STATE_EXP_AVG_SQ],
            ig = st.idx[ZOPT_STATE_GRAD];
  const size_t n = 100;
  // bf16 gradients: +-2^k from 2^-133 (a bf16 denormal) to 2^60, 0.75, -0.625.
  const uint16_t gs[] = {0x3F80, 0xBF80, 0x3F00, 0x3B80, 0x3580, 0x4300, 0x5D80, 0xBE00,
                         0x3F40, 0xBF20, 0x0080, 0x0001, 0x2000, 0x7E80};
  const size_t nNanLane = 37;
  size_t bad = 0, calls = 0;
  std::string first;
  for (uint32_t sBits : specialValues(ZOPT_DTYPE_BF16))
    for (bool nanLane : {false, true}) {
      Hypers h;
      h.lr = 0; h.weight_decay = 0; h.beta1 = 0; h.beta2 = 0;
      const double s = double(bits_f32(sBits));
      Config c{3, true, 1.0, s, 0.0, 0.0};
      bool prepOk;
      std::vector<float> co = runPrepare(st, h, c, prepOk);
      // What PREPARE gives the kernel: s through f64 into f32 (a signaling
      // NaN comes out quiet, as the kernel sees it).
      const float s32 = float(s);
      std::vector<Buf> bufs;
      for (uint32_t i = 0; i < d->num_states; ++i) bufs.push_back(makeBuf(d->states[i].dtype, n, calls & 1));
      for (size_t e = 0; e < n; ++e)
        for (uint32_t i = 0; i < d->num_states; ++i) {
          if (int(i) == ig)
            bufs[i].setBits(e, nanLane && e == nNanLane ? 0xFFC1u : gs[e % (sizeof gs / sizeof gs[0])]);
          else if (int(i) == iv) bufs[i].store(e, 0.01);
          else bufs[i].store(e, 0.5);
        }
      std::vector<void *> ptrs;
      for (auto &b : bufs) ptrs.push_back(b.ptr());
      fn(ptrs.data(), ptrs.data(), int64_t(n), co.data());
      ++calls;
      bool guards = true;
      for (auto &b : bufs) guards = guards && b.guardsIntact();
      // runPrepare wants finite coefficients: s itself is one where it is not.
      prepOk = prepOk || !std::isfinite(s32);
      if (!prepOk || !guards) {
        if (!bad++) first = !prepOk ? "prepare failed" : "guards overwritten";
        continue;
      }
      for (size_t e = 0; e < n; ++e) {
        const float g = float(decode_bf16(uint16_t(nanLane && e == nNanLane ? 0xFFC1u
                                                   : gs[e % (sizeof gs / sizeof gs[0])])));
        // (g * s) * clip_coef (= 1), then 0 * m + 1 * that: + 0 turns -0 into +0.
        volatile float gsc = g * s32;
        float m = gsc * 1.0f;
        if (m == 0) m = 0.0f;
        volatile float mm = m * m;
        float v = mm;
        if (v == 0) v = 0.0f;
        uint16_t wantM = storeBf16(m), wantV = storeBf16(v);
        const uint16_t gotM = uint16_t(bufs[im].bits(e)), gotV = uint16_t(bufs[iv].bits(e));
        if (std::isnan(g) && std::isnan(s32) && (gotM == storeBf16(g) || gotM == storeBf16(s32)) &&
            gotV == gotM)
          wantM = wantV = gotM; // g * s with both NaN: x86 keeps either payload (operand order)
        if ((gotM != wantM || gotV != wantV) && !bad++) {
          char b[200];
          std::snprintf(b, sizeof b, "s 0x%08x g 0x%04x lane %zu: m' 0x%04x (want 0x%04x), v' 0x%04x (want 0x%04x)",
                        sBits, uint32_t(f32_bits(g) >> 16), e, gotM, wantM, gotV, wantV);
          first = b;
        }
      }
    }
  report(bad == 0, "narrow[%s] n=%zu bf16 moments m' = RN(g*s), v' = RN(m'*m') in %zu calls (each special value "
                   "as s, then with a NaN gradient in one lane): %zu mismatches%s%s",
         isaName(isa), n, calls, bad, first.empty() ? "" : "; first: ", first.c_str());
}

} // namespace kc

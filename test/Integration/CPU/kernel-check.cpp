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
//   --twin=F.so   STEP has a remainder master, F.so is the same step with an
//                 f32 master: both run 5 steps on the same random data and
//                 the rebuilt master, param and moments must match bit for
//                 bit (kernel-check-remainder.cpp).
//   A step with a Kahan-compensated param (abi.h) has its stores checked by
//   kernel-check-kahan.cpp (with --rne: special params and compensations).
//   --track=M.so,P.so  STEP has a Kahan param, M.so is the same rule with an
//                 f32 master, P.so with a plain bf16 param: 200 small steps
//                 on the same gradients; the Kahan param must end much
//                 closer to the f32 master than the plain one.
//   A step with q8 moments (abi.h "q8 moments") is checked by
//   kernel-check-q8.cpp instead: the rule from the decoded moments, each
//   block's absmax and every code against the reference's encode, every
//   variant bit for bit, zero / NaN / zero-point blocks.
//   --q8-sweep=S  STEP is test/Integration/CPU/Inputs/q8_sweep.mlir (the new
//                 moments are the gradient): the kernel's codes of every
//                 S-th f32 pattern of [-1, 1] and around every map value and
//                 midpoint, exactly (instead of the rule's checks).
//   --rne         additionally: bit-exact check of the narrowing store
//                 (f32 master -> bf16/f16 param) on chosen values (ties, NaN,
//                 inf, overflow, denormals) through the master->param copy-out
//                 with lr = 0, wd = 0 (the master is then unchanged). An
//                 Adam(W) step with bf16 moments and no master instead has
//                 its new moments' narrowing checked on such values
//                 (kernel-check-narrow.cpp).
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
//  * Stochastic rounding (steps with ZOPT_FLAG_STOCHASTIC: UPDATE called with
//    a key and a first index, abi.h): a bf16 state declared `rounding
//    stochastic` must lie between the reference's stochastic roundings
//    (zopt_ref::sr_bf16, the same key, slot and index) of v - tol and
//    v + tol, which is monotone in the kernel's f32 value; a stochastically
//    rounded param beside an f32 master must equal the reference's
//    rounding of the kernel's own master, bit for bit.
//  * SUMSQ: x*x of an f32 x is exact in f64 (48 significant bits), so the
//    only error is the f64 summation: for any summation order of n
//    non-negative terms |err| <= (n-1)*2^-53*sum (+O(u^2)). The reference is
//    summed in long double (64-bit mantissa), so tol = (n-1)*2^-53*sum*1.01
//    + n*2^-63*sum. An inf or NaN in a grad must make SUMSQ non-finite.
//
// Output: one line per check (PASS/FAIL/SKIP/INFO ...) and a final line
// `N passed, M failed`; exit status 1 on any failure, 2 on usage errors.
//===----------------------------------------------------------------------===//
#include "kernel-check.h"

#include <string>

#include "control-check.h"

using namespace kc;

namespace kc {

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
    const bool rem = s.kind == ZOPT_STATE_MASTER && s.dtype == ZOPT_DTYPE_I16;
    st.remainder = st.remainder || rem;
    // q8 moments (abi.h "q8 moments"): Q8 codes, an f32 per-block absmax.
    const bool q8 = (s.kind == ZOPT_STATE_EXP_AVG || s.kind == ZOPT_STATE_EXP_AVG_SQ) &&
                    s.dtype == ZOPT_DTYPE_Q8 && !(s.flags & ZOPT_STATE_PER_BLOCK);
    const bool absmax = s.kind == ZOPT_STATE_EXP_AVG_ABSMAX || s.kind == ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
    st.q8 = st.q8 || q8;
    // A Kahan param's compensation (abi.h "Kahan-compensated params").
    const bool kahan = s.kind == ZOPT_STATE_KAHAN_COMP;
    st.kahan = st.kahan || kahan;
    if (absmax && (s.dtype != ZOPT_DTYPE_F32 || !(s.flags & ZOPT_STATE_PER_BLOCK)))
      statesOk = false;
    else if (kahan && (s.dtype != ZOPT_DTYPE_BF16 || s.access != (ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE) ||
                       st.idx[s.kind] != -1 || s.placement != ZOPT_PLACE_CPU))
      statesOk = false;
    else if (kahan) st.idx[s.kind] = int(i);
    else if (s.kind < 1 || s.kind > 9 || st.idx[s.kind] != -1 || s.dtype < 1 ||
        (s.dtype > 3 && !rem && !q8) || (s.kind > 7 && !absmax) ||
        s.placement != ZOPT_PLACE_CPU || (s.access & ~3u) || !s.access)
      statesOk = false;
    else st.idx[s.kind] = int(i);
    std::printf("INFO state %u: %s %s access=%s%s\n", i, kindName(s.kind), dtype_name(s.dtype),
                (s.access & ZOPT_ACCESS_READ) ? "r" : "", (s.access & ZOPT_ACCESS_WRITE) ? "w" : "");
  }
  auto has = [&](uint32_t k) { return st.idx[k] >= 0; };
  // Each q8 moment has its absmax, with the same access.
  for (uint32_t k : {ZOPT_STATE_EXP_AVG, ZOPT_STATE_EXP_AVG_SQ}) {
    const uint32_t a = k == ZOPT_STATE_EXP_AVG ? ZOPT_STATE_EXP_AVG_ABSMAX : ZOPT_STATE_EXP_AVG_SQ_ABSMAX;
    const bool isQ8 = has(k) && d->states[st.idx[k]].dtype == ZOPT_DTYPE_Q8;
    if (isQ8 != has(a) || (isQ8 && d->states[st.idx[a]].access != d->states[st.idx[k]].access))
      statesOk = false;
  }
  statesOk = statesOk && has(ZOPT_STATE_PARAM) && has(ZOPT_STATE_GRAD) &&
             d->states[st.idx[ZOPT_STATE_GRAD]].access == ZOPT_ACCESS_READ &&
             (d->states[st.idx[ZOPT_STATE_PARAM]].access & ZOPT_ACCESS_WRITE);
  // A Kahan param is a bf16 param, read and written, without a master.
  if (st.kahan)
    statesOk = statesOk && !has(ZOPT_STATE_MASTER) &&
               d->states[st.idx[ZOPT_STATE_PARAM]].dtype == ZOPT_DTYPE_BF16 &&
               d->states[st.idx[ZOPT_STATE_PARAM]].access == (ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE);
  // A remainder master reads and writes the param (its high half).
  if (has(ZOPT_STATE_MASTER) && st.remainder)
    statesOk = statesOk && d->states[st.idx[ZOPT_STATE_PARAM]].dtype == ZOPT_DTYPE_BF16 &&
               d->states[st.idx[ZOPT_STATE_PARAM]].access == (ZOPT_ACCESS_READ | ZOPT_ACCESS_WRITE);
  else if (has(ZOPT_STATE_MASTER))
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
      std::string x2 = std::string(k.symbol) + "_x2";
      st.sumsq2s.push_back((zopt_sumsq2_fn)dlsym(st.lib, x2.c_str()));
      if (st.sumsq2s.back()) std::printf("INFO kernel %u: pair entry %s\n", i, x2.c_str());
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
  // Remainder masters: abi.h's split/join on bits against the reference's
  // split by values; every master rebuilds exactly (a NaN as a NaN).
  size_t rbad = 0, ties = 0;
  auto rem = [&](uint32_t b) {
    uint16_t p, r;
    zopt_remainder_split(b, &p, &r);
    const float x = bits_f32(b);
    const uint32_t back = zopt_remainder_join(p, r);
    if (std::isnan(x)) {
      rbad += !is_nan_bits(back, ZOPT_DTYPE_F32) || !is_nan_bits(p, ZOPT_DTYPE_BF16) ||
              p != zopt_ref::remainder_param(x);
      return;
    }
    rbad += p != zopt_ref::remainder_param(x) || r != zopt_ref::remainder_rem(x) || back != b ||
            f32_bits(zopt_ref::remainder_master(p, r)) != b;
    ties += (b & 0xFFFFu) == 0x8000u;
  };
  for (uint32_t b : specialValues(ZOPT_DTYPE_BF16)) rem(b);
  for (int i = 0; i < 2000000; ++i) rem(rng());
  for (uint32_t hi : {0x0000u, 0x3F80u, 0x3F81u, 0x7F7Fu, 0x7F80u, 0x8000u, 0xBF80u, 0xFF7Fu})
    for (uint32_t lo = 0; lo < 0x10000u; ++lo) rem(hi << 16 | lo);
  report(rbad == 0, "self-test: remainder masters: abi.h's split and join on bits agree with the "
                    "reference's split by values and rebuild every master exactly (%zu mismatches, "
                    "%zu ties)", rbad, ties);
  const bool kahanOk = kahanSelfTest();
  return bad == 0 && rbad == 0 && kahanOk;
}

} // namespace kc

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s STEP.so adam|adamw|adam_amsgrad|sgd|sgd_nesterov|lion "
                         "[--clip] [--loss-scale] [--rne] [--twin=F32MASTER.so] [--track=F32MASTER.so,BF16.so] [--q8-sweep=STRIDE] [--sizes=1,15,17,1000003]\n", argv[0]);
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
  std::string twinPath; // --twin: the f32-master twin of a remainder step
  std::string trackPath; // --track=MASTER.so,PLAIN.so: a Kahan step's twins
  uint64_t q8Sweep = 0; // --q8-sweep=STRIDE: the kernel's q8 encode, value by value
  std::vector<size_t> sizes = {1, 15, 17, 1000003};
  for (int i = 3; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--clip") st.clip = true;
    else if (a == "--loss-scale") st.lossScale = true;
    else if (a == "--rne") rne = true;
    else if (a.rfind("--twin=", 0) == 0) twinPath = a.substr(7);
    else if (a.rfind("--track=", 0) == 0) trackPath = a.substr(8);
    else if (a.rfind("--q8-sweep=", 0) == 0) q8Sweep = std::strtoull(a.c_str() + 11, nullptr, 10);
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
      if (q8Sweep) { // a sweep step (Inputs/q8_sweep.mlir), no rule to check
        checkQ8Sweep(st, u.first, u.second, q8Sweep);
        continue;
      }
      for (size_t n : sizes)
        for (auto &c : configs)
          if (st.q8) checkQ8Update(st, u.first, u.second, n, c, seed++);
          else checkUpdate(st, u.first, u.second, n, c, seed++);
      if (rne && st.q8)
        std::printf("SKIP rne[%s]: not written for q8 steps\n", isaName(u.first));
      else if (rne && st.kahan)
        for (size_t n : {size_t(61), size_t(100003)})
          checkKahanSpecial(st, u.first, u.second, n);
      else if (rne && narrowCheckApplies(st))
        checkNarrowMoments(st, u.first, u.second);
      else if (rne)
        for (size_t n : {size_t(61), size_t(100003)})
          checkRne(st, u.first, u.second, n);
    }
    if (!st.q8 && !q8Sweep) checkUpdateTails(st, seed++);
    if (st.kahan) checkKahanIsas(st, 100003, seed++);
    if (st.q8 && !q8Sweep) checkQ8Isas(st, 100003);
    if (!twinPath.empty()) {
      Step tw;
      tw.rule = st.rule; tw.clip = st.clip; tw.lossScale = st.lossScale;
      std::printf("INFO twin %s\n", twinPath.c_str());
      const bool twinOk = st.remainder && loadStep(twinPath.c_str(), tw) && !tw.remainder &&
                          tw.idx[ZOPT_STATE_MASTER] >= 0;
      report(twinOk, "twin: the step has a remainder master and its twin an f32 master");
      for (auto &u : st.updates) {
        zopt_update_fn fb = nullptr;
        for (auto &v : tw.updates) if (v.first == u.first) fb = v.second;
        if (!twinOk || !fb || !cpuRuns(u.first)) continue;
        for (size_t n : sizes) checkRemainderTwin(st, tw, u.first, u.second, fb, n, 5, seed++);
      }
    }
    if (!trackPath.empty()) {
      const size_t comma = trackPath.find(',');
      Step tm, tp;
      tm.rule = tp.rule = st.rule; tm.clip = tp.clip = st.clip;
      tm.lossScale = tp.lossScale = st.lossScale;
      const bool ok = st.kahan && comma != std::string::npos &&
                      loadStep(trackPath.substr(0, comma).c_str(), tm) && tm.idx[ZOPT_STATE_MASTER] >= 0 &&
                      !tm.remainder && loadStep(trackPath.substr(comma + 1).c_str(), tp) && !tp.kahan &&
                      tp.idx[ZOPT_STATE_MASTER] < 0;
      report(ok, "track: the step is Kahan, its twins an f32-master and a plain bf16 step");
      if (ok) checkKahanTracking(st, tm, tp, 4099, 200);
    }
    for (auto &s : st.sumsqs) {
      if (!cpuRuns(s.first)) {
        std::printf("SKIP sumsq[%s]: not run, this CPU lacks the instruction set\n",
                    isaName(s.first));
        continue;
      }
      for (size_t n : sizes) checkSumsq(st, s.first, s.second, n, seed++);
      if (zopt_sumsq2_fn f2 = st.sumsq2s[&s - st.sumsqs.data()]) checkSumsqPair(st, s.first, s.second, f2, seed++);
    }
  }
  std::printf("%d passed, %d failed\n", gPassed, gFailed);
  return gFailed ? 1 : 0;
}


// zopt-q8-check: a step with q8 moments (abi.h "q8 moments",
// docs/NUMERICS.md §10) run through the C API, against the float64
// reference of §10 and bit for bit across the runtime's chunkings.
//
// The step is AdamW with bf16 params, a remainder master and q8 exp_avg /
// exp_avg_sq (examples/adamw_bf16_q8.mlir). Tensors of 1, 3, 255, 256, 257,
// 1000 and 70000 elements (partial last blocks; 70000 spans two work units)
// (in user memory: views of one arena in flat order) are stepped N times with fresh random gradients (never zero; the global
// norm below 1, so clipping leaves them as they are) in four runs:
//   A  one optimizer, 1 thread;      B  one optimizer, 3 threads;
//   C  one optimizer, 4 threads, ZOPT_NO_COALESCE=1 (one call per chunk);
//   D  one optimizer per tensor, 1 thread (one call per 65536 elements
//      from the tensor's element 0: the kernel contract at its plainest).
// After finalize every code is the zero code (127 for exp_avg, 0 for
// exp_avg_sq) and every absmax 0. After every step the params, the
// remainder, the codes and the absmax of every tensor are the same bytes
// in all four runs, and run A follows §10's rules against float64 from the
// state before the step: m1 = b1 m + (1 - b1) g and v1 = b2 v + (1 - b2) g^2
// from the decoded moments; each block's absmax is max |m1| over the
// block's elements (to f32 rounding); each code is the reference encode of
// m1 with that absmax (a neighbour only within f32 error of a midpoint;
// a nonzero v never takes code 0); the master is the AdamW update with the
// unquantized m1, v1 (to f32 rounding) and the param its high half.
// A hash of every byte after the steps is printed for comparing ISA
// variants. Reading a moment as f32 decodes it; writing f32 quantizes it with
// zopt_q8_encode; sizes that do not fit are refused. The staged import
// encodes a moment put as f32 values and refuses codes put without their
// absmax. A checkpoint of run A
// loads into a fresh optimizer of the step bit for bit (codes, absmax,
// master, counts: the next step equal); into a step with f32 moments
// (--f32=STEP2.so, the same params and master) every moment is the
// decoded code, bit for bit; that step's checkpoint (moments of its own)
// loads back into this one encoded by the canonical rule (per block absmax
// max |x|, zopt_q8_encode), every code and absmax.
//
// A checkpoint of a step without Adam moments (--other=STEP3.so, e.g. SGD
// with f32 params) loads with ZOPT_LOAD_ALLOW_RULE_CHANGE into fresh q8
// moments: the zero code everywhere, absmax 0.
//
//   zopt-q8-check STEP.so [--f32=STEP2.so] [--other=STEP3.so] [--steps=N]
#include "test_util.h"
#include "zopt/cpu.h"
#include "zopt_reference.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

const std::vector<int64_t> kSizes = {1, 3, 255, 256, 257, 1000, 70000};
const double kLr = 0.01, kB1 = 0.9, kB2 = 0.999, kEps = 1e-8, kWd = 0.01;
constexpr int kBlk = ZOPT_Q8_BLOCK;

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}
// A deterministic value in +-[0.1, 1.1) * scale: never zero.
float value(uint64_t a, uint64_t b, uint64_t i, double scale) {
  uint64_t h = mix(a * 0x9E3779B97F4A7C15ull ^ mix(b * 1000003 + i * 7919 + 17));
  double u = (double)(h >> 11) / 9007199254740992.0;
  return (float)((h & 1 ? 1.0 : -1.0) * (0.1 + u) * scale);
}
int64_t nblocks(int64_t n) { return (n + kBlk - 1) / kBlk; }

// One run: its optimizers (one, or one per tensor) and the user memory.
struct Run {
  const char *name;
  std::vector<zopt_optimizer *> opts;
  std::vector<int> opt_of, id_of;  // per tensor: its optimizer and id there
  // Params and grads: views of one arena each, in the runtime's flat order
  // (reverse add order) without gaps, so that UPDATE joins neighbours'
  // calls where the runtime-held states are adjacent too (exec/coalesce.cpp).
  std::vector<uint16_t> p_arena, g_arena;
  std::vector<uint16_t *> p, g;
  ~Run() {
    for (zopt_optimizer *o : opts) zopt_optimizer_free(o);
  }
};

// A tensor's whole state as bytes: params, remainder, codes, absmax.
struct Snap {
  std::vector<uint16_t> p;
  std::vector<int16_t> rem;
  std::vector<uint8_t> m, v;
  std::vector<float> am, av;
};

bool make_run(Run &r, const zopt_step *step, int threads, bool per_tensor, bool no_coalesce) {
  const size_t T = kSizes.size();
  r.p.resize(T);
  r.g.resize(T);
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  r.p_arena.assign((size_t)total + 1, 0);
  r.g_arena.assign((size_t)total + 1, 0);
  for (size_t t = T, off = 0; t-- > 0; off += (size_t)kSizes[t]) {
    r.p[t] = r.p_arena.data() + off;
    r.g[t] = r.g_arena.data() + off;
  }
  r.opt_of.assign(T, 0);
  r.id_of.assign(T, 0);
  if (no_coalesce) setenv("ZOPT_NO_COALESCE", "1", 1);
  for (size_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < kSizes[t]; ++i) r.p[t][(size_t)i] = zopt_ref::to_bf16(value(1, t, (uint64_t)i, 1.0));
    if (per_tensor || t == 0) {
      zopt_optimizer *o = nullptr;
      ZT_OK(zopt_optimizer_create(step, &o));
      if (!o) return false;
      r.opts.push_back(o);
      ZT_OK(zopt_optimizer_set_num_threads(o, threads));
      int gid = -1;
      ZT_OK(zopt_optimizer_add_group(o, &gid));
      const std::pair<const char *, double> hs[] = {
          {"lr", kLr}, {"beta1", kB1}, {"beta2", kB2}, {"eps", kEps}, {"weight_decay", kWd}};
      for (auto &h : hs) ZT_OK(zopt_optimizer_set_hyper(o, gid, h.first, h.second));
    }
    r.opt_of[t] = (int)r.opts.size() - 1;
    ZT_OK(zopt_optimizer_add_tensor(r.opts.back(), 0, r.p[t], r.g[t], kSizes[t], ZOPT_DTYPE_BF16,
                                    &r.id_of[t]));
  }
  for (zopt_optimizer *o : r.opts) ZT_OK(zopt_optimizer_finalize(o));
  unsetenv("ZOPT_NO_COALESCE");
  return zt_failures == 0;
}

Snap snap(const Run &r, size_t t) {
  Snap s;
  const int64_t n = kSizes[t], nb = nblocks(n);
  zopt_optimizer *o = r.opts[(size_t)r.opt_of[t]];
  const int id = r.id_of[t];
  s.p.assign(r.p[t], r.p[t] + n);
  s.rem.resize((size_t)n);
  s.m.resize((size_t)n);
  s.v.resize((size_t)n);
  s.am.resize((size_t)nb);
  s.av.resize((size_t)nb);
  ZT_OK(zopt_optimizer_read_state_raw(o, id, ZOPT_STATE_MASTER, s.rem.data(), (size_t)n * 2));
  ZT_OK(zopt_optimizer_read_state_raw(o, id, ZOPT_STATE_EXP_AVG, s.m.data(), (size_t)n));
  ZT_OK(zopt_optimizer_read_state_raw(o, id, ZOPT_STATE_EXP_AVG_SQ, s.v.data(), (size_t)n));
  ZT_OK(zopt_optimizer_read_state_raw(o, id, ZOPT_STATE_EXP_AVG_ABSMAX, s.am.data(), (size_t)nb * 4));
  ZT_OK(zopt_optimizer_read_state_raw(o, id, ZOPT_STATE_EXP_AVG_SQ_ABSMAX, s.av.data(), (size_t)nb * 4));
  return s;
}

bool same(const Snap &a, const Snap &b) {
  return a.p == b.p && a.rem == b.rem && a.m == b.m && a.v == b.v &&
         memcmp(a.am.data(), b.am.data(), a.am.size() * 4) == 0 &&
         memcmp(a.av.data(), b.av.data(), a.av.size() * 4) == 0;
}

float map_m[256], map_v[256];

// Whether `code` is the reference encode of x in a block of absmax a, or its
// neighbour with x / a within f32 error of the midpoint between them.
bool code_ok(const float map[256], bool uns, double x, float a, uint8_t code) {
  const uint8_t want = zopt_ref::q8_encode(map, uns, (float)x, a);
  if (code == want) return true;
  if (std::abs((int)code - (int)want) != 1) return false;
  const int lo = std::min(code, want);
  const double mid = ((double)map[lo] + (double)map[lo + 1]) / 2, r = x / a;
  return std::fabs(r - mid) <= 1e-6 * std::fabs(r) + 1e-12;
}

// Run A's step k of tensor t against §10 from its state before the step.
int check_rules(const Snap &before, const Snap &after, const uint16_t *g, int k, size_t t) {
  const int64_t n = kSizes[t];
  int bad = 0;
  const double bc1 = 1 - std::pow(kB1, k), bc2 = 1 - std::pow(kB2, k);
  std::vector<double> m1((size_t)n), v1((size_t)n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = zopt_ref::from_bf16(g[(size_t)i]);
    const double m = zopt_q8_decode(before.m[(size_t)i], before.am[(size_t)(i / kBlk)], 0);
    const double v = zopt_q8_decode(before.v[(size_t)i], before.av[(size_t)(i / kBlk)], 1);
    m1[(size_t)i] = kB1 * m + (1 - kB1) * gi;
    v1[(size_t)i] = kB2 * v + (1 - kB2) * gi * gi;
  }
  for (int64_t b = 0; b < nblocks(n); ++b) {
    double am = 0, av = 0;
    const int64_t e = std::min(n, (b + 1) * kBlk);
    for (int64_t i = b * kBlk; i < e; ++i) am = std::max(am, std::fabs(m1[(size_t)i])), av = std::max(av, v1[(size_t)i]);
    const float ram = after.am[(size_t)b], rav = after.av[(size_t)b];
    if (!(std::fabs(ram - am) <= 4e-7 * am) || !(std::fabs(rav - av) <= 4e-7 * av)) {
      if (bad++ < 5)
        fprintf(stderr, "tensor %zu step %d block %lld: absmax %.9g / %.9g, reference %.9g / %.9g\n", t, k,
                (long long)b, ram, rav, am, av);
    }
    for (int64_t i = b * kBlk; i < e; ++i) {
      const size_t u = (size_t)i;
      const bool okm = code_ok(map_m, false, m1[u], ram, after.m[u]);
      const bool okv = code_ok(map_v, true, v1[u], rav, after.v[u]) && after.v[u] != 0;
      const uint32_t wb = zopt_remainder_join(before.p[u], (uint16_t)before.rem[u]);
      float w0;
      memcpy(&w0, &wb, 4);
      const double upd = (m1[u] / bc1) / (std::sqrt(v1[u] / bc2) + kEps);
      const double want = (double)w0 * (1 - kLr * kWd) - kLr * upd;
      const uint32_t ab = zopt_remainder_join(after.p[u], (uint16_t)after.rem[u]);
      float w1;
      memcpy(&w1, &ab, 4);
      uint16_t hi, lo;
      zopt_remainder_split(ab, &hi, &lo);
      const bool okw = std::fabs((double)w1 - want) <= 1e-6 * std::fabs(want) + 1e-5 * kLr && hi == after.p[u];
      if (!(okm && okv && okw) && bad++ < 5)
        fprintf(stderr,
                "tensor %zu step %d element %lld: m code %u (m1 %.9g, absmax %.9g), v code %u (v1 %.9g, absmax "
                "%.9g), master %.9g want %.9g\n",
                t, k, (long long)i, after.m[u], m1[u], ram, after.v[u], v1[u], rav, w1, want);
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char **argv) {
  int steps = 3;
  const char *path = nullptr, *f32 = nullptr, *other = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!strncmp(argv[i], "--steps=", 8)) steps = atoi(argv[i] + 8);
    else if (!strncmp(argv[i], "--f32=", 6)) f32 = argv[i] + 6;
    else if (!strncmp(argv[i], "--other=", 8)) other = argv[i] + 8;
    else path = argv[i];
  }
  if (!path) {
    fprintf(stderr, "usage: zopt-q8-check STEP.so [--steps=N]\n");
    return 2;
  }
  zopt_ref::q8_map_f32(true, map_m);
  zopt_ref::q8_map_f32(false, map_v);
  zopt_step *step = nullptr;
  ZT_OK(zopt_step_load(path, &step));
  if (!step) return 1;
  std::unique_ptr<Run> runs[4];
  const char *names[4] = {"1 thread", "3 threads", "4 threads, no coalescing", "one optimizer per tensor"};
  for (int r = 0; r < 4; ++r) {
    runs[r].reset(new Run);
    runs[r]->name = names[r];
    if (!make_run(*runs[r], step, r == 0 || r == 3 ? 1 : r == 1 ? 3 : 4, r == 3, r == 2)) return 1;
  }
  const size_t T = kSizes.size();
  // Fresh: the zero code everywhere, absmax 0.
  int fresh_bad = 0;
  for (size_t t = 0; t < T; ++t) {
    const Snap s = snap(*runs[0], t);
    for (uint8_t c : s.m) fresh_bad += c != ZOPT_Q8_SIGNED_ZERO;
    for (uint8_t c : s.v) fresh_bad += c != ZOPT_Q8_UNSIGNED_ZERO;
    for (float a : s.am) fresh_bad += !(a == 0 && !std::signbit(a));
    for (float a : s.av) fresh_bad += !(a == 0 && !std::signbit(a));
  }
  printf("%s fresh q8 states: zero codes and absmax 0 (%d differ)\n", fresh_bad ? "FAIL" : "PASS", fresh_bad);
  int fails = fresh_bad != 0;
  for (int k = 1; k <= steps; ++k) {
    std::vector<Snap> before(T);
    for (size_t t = 0; t < T; ++t) before[t] = snap(*runs[0], t);
    for (int r = 0; r < 4; ++r) {
      Run &R = *runs[r];
      for (size_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < kSizes[t]; ++i)
          R.g[t][(size_t)i] = zopt_ref::to_bf16(value(100 + k, t, (uint64_t)i, 0.0015));
      for (zopt_optimizer *o : R.opts) {
        zopt_step_result res;
        ZT_OK(zopt_optimizer_step(o, &res));
        if (res.grad_norm >= 0.99 || res.skipped) {
          fprintf(stderr, "step %d: norm %g (want < 1: no clipping), skipped %d\n", k, res.grad_norm, res.skipped);
          ++fails;
        }
      }
    }
    int rule_bad = 0, differ = 0;
    for (size_t t = 0; t < T; ++t) {
      const Snap a = snap(*runs[0], t);
      rule_bad += check_rules(before[t], a, runs[0]->g[t], k, t);
      for (int r = 1; r < 4; ++r)
        if (!same(a, snap(*runs[r], t))) {
          if (differ++ < 5) fprintf(stderr, "step %d tensor %zu: run '%s' differs from 1 thread\n", k, t, runs[r]->name);
        }
    }
    printf("%s step %d: every code, absmax and master by the float64 rules of NUMERICS §10 (%d differ)\n",
           rule_bad ? "FAIL" : "PASS", k, rule_bad);
    printf("%s step %d: 3 threads, 4 threads without coalescing, one optimizer per tensor: the same bytes (%d "
           "differ)\n",
           differ ? "FAIL" : "PASS", k, differ);
    fails += rule_bad != 0 || differ != 0;
  }
  {
    // Every byte of run A after the steps, hashed: the same on every ISA
    // variant (the lit test compares ZOPT_CPU=avx2 and avx512 runs).
    uint64_t h = 1469598103934665603ull;
    auto fnv = [&](const void *p, size_t n) {
      for (size_t i = 0; i < n; ++i) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    };
    for (size_t t = 0; t < T; ++t) {
      const Snap a = snap(*runs[0], t);
      fnv(a.p.data(), a.p.size() * 2);
      fnv(a.rem.data(), a.rem.size() * 2);
      fnv(a.m.data(), a.m.size());
      fnv(a.v.data(), a.v.size());
      fnv(a.am.data(), a.am.size() * 4);
      fnv(a.av.data(), a.av.size() * 4);
    }
    printf("state hash after %d steps (%s kernels): %016llx\n", steps, zopt_isa_name(zopt_step_isa(step)),
           (unsigned long long)h);
  }
  // Reading as f32 decodes; writing f32 encodes (per block max |x|, then
  // zopt_q8_encode), codes and absmax both.
  {
    Run &R = *runs[0];
    zopt_optimizer *o = R.opts[0];
    const size_t t = 4;  // 257 elements: a partial second block
    const int64_t n = kSizes[t];
    const Snap s = snap(R, t);
    std::vector<float> f((size_t)n);
    ZT_OK(zopt_optimizer_read_state_f32(o, R.id_of[t], ZOPT_STATE_EXP_AVG_SQ, f.data(), n));
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float d = zopt_q8_decode(s.v[(size_t)i], s.av[(size_t)(i / kBlk)], 1);
      bad += memcmp(&f[(size_t)i], &d, 4) != 0;
    }
    std::vector<float> x((size_t)n);
    for (int64_t i = 0; i < n; ++i) x[(size_t)i] = value(7, 7, (uint64_t)i, 1e-3);
    ZT_OK(zopt_optimizer_write_state_f32(o, R.id_of[t], ZOPT_STATE_EXP_AVG, x.data(), n));
    const Snap w = snap(R, t);
    for (int64_t b = 0; b < nblocks(n); ++b) {
      float a = 0;
      for (int64_t i = b * kBlk; i < std::min(n, (b + 1) * kBlk); ++i) a = std::max(a, std::fabs(x[(size_t)i]));
      bad += w.am[(size_t)b] != a;
      for (int64_t i = b * kBlk; i < std::min(n, (b + 1) * kBlk); ++i)
        bad += w.m[(size_t)i] != zopt_ref::q8_encode(map_m, false, x[(size_t)i], a);
    }
    printf("%s f32 access: exp_avg_sq read decoded, exp_avg written encoded (%d differ)\n", bad ? "FAIL" : "PASS",
           bad);
    fails += bad != 0;
    // Sizes: a moment is numel codes, an absmax one f32 per block.
    ZT_ERR(zopt_optimizer_read_state_raw(o, R.id_of[t], ZOPT_STATE_EXP_AVG_ABSMAX, f.data(), (size_t)n * 4),
           ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_read_state_raw(o, R.id_of[t], ZOPT_STATE_EXP_AVG, f.data(), (size_t)n * 4),
           ZOPT_ERR_INVALID_ARGUMENT);
    ZT_ERR(zopt_optimizer_read_state_f32(o, R.id_of[t], ZOPT_STATE_EXP_AVG_ABSMAX, f.data(), n),
           ZOPT_ERR_INVALID_ARGUMENT);
  }
  // The staged import (a fresh optimizer): a moment put as f32 values is
  // encoded (codes and absmax both put); codes put without their absmax,
  // or an absmax of the tensor's numel, are refused, nothing changed.
  {
    Run R;
    int bad = 0;
    if (make_run(R, step, 2, false, false)) {
      zopt_optimizer *o = R.opts[0];
      const size_t t = 4;  // 257 elements
      const int64_t n = kSizes[t];
      std::vector<float> x((size_t)n);
      for (int64_t i = 0; i < n; ++i) x[(size_t)i] = value(41, 0, (uint64_t)i, 1e-3);
      zopt_state_import *imp = nullptr;
      ZT_OK(zopt_optimizer_import_begin(o, &imp));
      ZT_OK(zopt_state_import_put(imp, (int)t, ZOPT_STATE_EXP_AVG, ZOPT_DTYPE_F32, x.data(), n));
      ZT_ERR(zopt_state_import_put(imp, (int)t, ZOPT_STATE_EXP_AVG_ABSMAX, ZOPT_DTYPE_F32, x.data(), nblocks(n)),
             ZOPT_ERR_INVALID_ARGUMENT);  // put with its moment already
      ZT_OK(zopt_state_import_commit(imp));
      const Snap w = snap(R, t);
      for (int64_t b = 0; b < nblocks(n); ++b) {
        float a = 0;
        for (int64_t i = b * kBlk; i < std::min(n, (b + 1) * kBlk); ++i) a = std::max(a, std::fabs(x[(size_t)i]));
        bad += w.am[(size_t)b] != a;
        for (int64_t i = b * kBlk; i < std::min(n, (b + 1) * kBlk); ++i)
          bad += w.m[(size_t)i] != zopt_ref::q8_encode(map_m, false, x[(size_t)i], a);
      }
      std::vector<uint8_t> codes((size_t)n, 200);
      imp = nullptr;
      ZT_OK(zopt_optimizer_import_begin(o, &imp));
      ZT_ERR(zopt_state_import_put(imp, (int)t, ZOPT_STATE_EXP_AVG_ABSMAX, ZOPT_DTYPE_F32, x.data(), n),
             ZOPT_ERR_INVALID_ARGUMENT);  // one per block, not per element
      ZT_ERR(zopt_state_import_put(imp, (int)t, ZOPT_STATE_EXP_AVG, ZOPT_DTYPE_I16, codes.data(), n),
             ZOPT_ERR_INVALID_ARGUMENT);
      ZT_OK(zopt_state_import_put(imp, (int)t, ZOPT_STATE_EXP_AVG, ZOPT_DTYPE_Q8, codes.data(), n));
      ZT_ERR(zopt_state_import_commit(imp), ZOPT_ERR_INVALID_ARGUMENT);  // codes without their absmax
      bad += !same(w, snap(R, t));
    } else {
      ++bad;
    }
    printf("%s staged import: f32 moments encoded, codes without their absmax refused (%d differ)\n",
           bad ? "FAIL" : "PASS", bad);
    fails += bad != 0;
  }
  // Checkpoints: saved by run A (a fresh optimizer of the step loads it bit
  // for bit, and its next step is A's), refused into f32 moments and back.
  {
    char dir[] = "/tmp/zopt_q8_check_XXXXXX";
    if (!mkdtemp(dir)) {
      perror("mkdtemp");
      return 1;
    }
    const std::string ck = std::string(dir) + "/q8.ckpt", ck32 = std::string(dir) + "/f32.ckpt";
    Run &A = *runs[0];
    ZT_OK(zopt_optimizer_save(A.opts[0], ck.c_str()));
    // What the checkpoint holds, as f32 (A steps on below): params, and the
    // moments decoded and the master rebuilt by the runtime.
    const zopt_state_kind kF32[3] = {ZOPT_STATE_EXP_AVG, ZOPT_STATE_EXP_AVG_SQ, ZOPT_STATE_MASTER};
    std::vector<std::vector<uint16_t>> saved_p(T);
    std::vector<std::vector<float>> saved_f32(T * 3);
    for (size_t t = 0; t < T; ++t) {
      saved_p[t].assign(A.p[t], A.p[t] + kSizes[t]);
      for (int j = 0; j < 3; ++j) {
        saved_f32[t * 3 + j].resize((size_t)kSizes[t]);
        ZT_OK(zopt_optimizer_read_state_f32(A.opts[0], A.id_of[t], kF32[j], saved_f32[t * 3 + j].data(), kSizes[t]));
      }
    }
    Run L;
    int bad = 0;
    if (make_run(L, step, 2, false, false)) {
      for (size_t t = 0; t < T; ++t) memcpy(L.p[t], A.p[t], (size_t)kSizes[t] * 2);
      ZT_OK(zopt_optimizer_load(L.opts[0], ck.c_str()));
      for (size_t t = 0; t < T; ++t) bad += !same(snap(A, t), snap(L, t));
      for (Run *R : {&A, &L}) {
        for (size_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < kSizes[t]; ++i) R->g[t][(size_t)i] = zopt_ref::to_bf16(value(999, t, (uint64_t)i, 0.0015));
        zopt_step_result res;
        ZT_OK(zopt_optimizer_step(R->opts[0], &res));
      }
      for (size_t t = 0; t < T; ++t) bad += !same(snap(A, t), snap(L, t));
    } else {
      ++bad;
    }
    printf("%s checkpoint: loaded bit for bit, the next step the same bytes (%d differ)\n", bad ? "FAIL" : "PASS",
           bad);
    fails += bad != 0;
    if (f32) {
      zopt_step *s32 = nullptr;
      ZT_OK(zopt_step_load(f32, &s32));
      zopt_optimizer *o = nullptr;
      if (s32) ZT_OK(zopt_optimizer_create(s32, &o));
      std::vector<std::vector<uint16_t>> p(T), g(T);
      if (o) {
        int gid = -1;
        ZT_OK(zopt_optimizer_add_group(o, &gid));
        for (size_t t = 0; t < T; ++t) {
          p[t] = saved_p[t];
          g[t].assign((size_t)kSizes[t], 0);
          int id;
          ZT_OK(zopt_optimizer_add_tensor(o, 0, p[t].data(), g[t].data(), kSizes[t], ZOPT_DTYPE_BF16, &id));
        }
        ZT_OK(zopt_optimizer_finalize(o));
        // q8 -> f32: every moment the decoded code, bit for bit; the master
        // and the counts as they are (no ZOPT_LOAD_ALLOW_RULE_CHANGE: the
        // same rule, its moments stored otherwise).
        ZT_OK(zopt_optimizer_load(o, ck.c_str()));
        int dec_bad = 0, enc_bad = 0;
        for (size_t t = 0; t < T; ++t) {
          const int64_t n = kSizes[t];
          for (int j = 0; j < 3; ++j) {
            std::vector<float> got((size_t)n);
            ZT_OK(zopt_optimizer_read_state_f32(o, (int)t, kF32[j], got.data(), n));
            dec_bad += memcmp(saved_f32[t * 3 + j].data(), got.data(), (size_t)n * 4) != 0;
          }
          int64_t c = -1;
          ZT_OK(zopt_optimizer_get_tensor_step(o, (int)t, &c));
          dec_bad += c != steps;
        }
        // f32 -> q8: moments f32 values of their own (written), encoded by
        // the canonical rule: per block absmax max |x|, zopt_q8_encode.
        for (size_t t = 0; t < T; ++t) {
          std::vector<float> x((size_t)kSizes[t]);
          for (int64_t i = 0; i < kSizes[t]; ++i) x[(size_t)i] = value(31, t, (uint64_t)i, 1e-2 * (1 + (i % 7)));
          ZT_OK(zopt_optimizer_write_state_f32(o, (int)t, ZOPT_STATE_EXP_AVG, x.data(), kSizes[t]));
          for (float &v : x) v = v * v;
          ZT_OK(zopt_optimizer_write_state_f32(o, (int)t, ZOPT_STATE_EXP_AVG_SQ, x.data(), kSizes[t]));
        }
        ZT_OK(zopt_optimizer_save(o, ck32.c_str()));
        Run B;
        if (make_run(B, step, 1, false, false)) {
          ZT_OK(zopt_optimizer_load(B.opts[0], ck32.c_str()));
          for (size_t t = 0; t < T; ++t) {
            const int64_t n = kSizes[t];
            const Snap b = snap(B, t);
            for (int which = 0; which < 2; ++which) {
              std::vector<float> x((size_t)n);
              ZT_OK(zopt_optimizer_read_state_f32(o, (int)t, which ? ZOPT_STATE_EXP_AVG_SQ : ZOPT_STATE_EXP_AVG,
                                                  x.data(), n));
              const std::vector<uint8_t> &codes = which ? b.v : b.m;
              const std::vector<float> &am = which ? b.av : b.am;
              for (int64_t blk = 0; blk < nblocks(n); ++blk) {
                const int64_t e = std::min(n, (blk + 1) * kBlk);
                float a = 0;
                for (int64_t i = blk * kBlk; i < e; ++i) a = std::max(a, std::fabs(x[(size_t)i]));
                enc_bad += am[(size_t)blk] != a;
                for (int64_t i = blk * kBlk; i < e; ++i)
                  enc_bad += codes[(size_t)i] != zopt_ref::q8_encode(which ? map_v : map_m, which, x[(size_t)i], a);
              }
            }
            std::vector<int16_t> r1((size_t)n), r2((size_t)n);
            ZT_OK(zopt_optimizer_read_state_raw(o, (int)t, ZOPT_STATE_MASTER, r1.data(), (size_t)n * 2));
            enc_bad += r1 != b.rem;
          }
        } else {
          ++enc_bad;
        }
        printf("%s checkpoint: q8 moments loaded into f32 ones decoded bit for bit (%d differ), f32 ones into q8 "
               "encoded by the canonical rule (%d differ)\n",
               dec_bad || enc_bad ? "FAIL" : "PASS", dec_bad, enc_bad);
        fails += dec_bad || enc_bad;
      }
      zopt_optimizer_free(o);
      zopt_step_free(s32);
    }
    if (other) {
      const std::string cko = std::string(dir) + "/other.ckpt";
      zopt_step *so = nullptr;
      ZT_OK(zopt_step_load(other, &so));
      zopt_optimizer *o = nullptr;
      if (so) ZT_OK(zopt_optimizer_create(so, &o));
      std::vector<std::vector<float>> p(T), g(T);
      int bad = 0;
      if (o) {
        int gid = -1;
        ZT_OK(zopt_optimizer_add_group(o, &gid));
        for (size_t t = 0; t < T; ++t) {
          p[t].assign((size_t)kSizes[t], 0.5f);
          g[t].assign((size_t)kSizes[t], 0.25f);
          int id;
          ZT_OK(zopt_optimizer_add_tensor(o, 0, p[t].data(), g[t].data(), kSizes[t], ZOPT_DTYPE_F32, &id));
        }
        ZT_OK(zopt_optimizer_finalize(o));
        zopt_step_result res;
        ZT_OK(zopt_optimizer_step(o, &res));
        ZT_OK(zopt_optimizer_save(o, cko.c_str()));
        Run C;
        if (make_run(C, step, 1, false, false)) {
          ZT_ERR(zopt_optimizer_load(C.opts[0], cko.c_str()), ZOPT_ERR_CHECKPOINT);  // another rule
          ZT_OK(zopt_optimizer_load_ex(C.opts[0], cko.c_str(), ZOPT_LOAD_ALLOW_RULE_CHANGE));
          for (size_t t = 0; t < T; ++t) {
            const Snap c = snap(C, t);
            for (uint8_t x : c.m) bad += x != ZOPT_Q8_SIGNED_ZERO;
            for (uint8_t x : c.v) bad += x != ZOPT_Q8_UNSIGNED_ZERO;
            for (float a : c.am) bad += !(a == 0 && !std::signbit(a));
            for (float a : c.av) bad += !(a == 0 && !std::signbit(a));
          }
        } else {
          ++bad;
        }
      }
      printf("%s checkpoint without Adam moments: q8 moments start at the zero code, absmax 0 (%d differ)\n",
             bad ? "FAIL" : "PASS", bad);
      fails += bad != 0;
      zopt_optimizer_free(o);
      zopt_step_free(so);
      unlink(cko.c_str());
    }
    for (const std::string &f : {ck, ck32}) unlink(f.c_str());
    rmdir(dir);
  }
  fails += zt_failures != 0;
  printf("%s\n", fails ? "FAILED" : "OK");
  zopt_step_free(step);
  return fails ? 1 : 0;
}

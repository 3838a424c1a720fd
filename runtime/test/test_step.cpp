// Runs compiled steps through the runtime and checks properties every step
// must have, plus the numerics contract (docs/NUMERICS.md) for the rules it
// can identify from the step name (adamw / adam / sgd[_nesterov] / lion).
//   - bit-identical results for 1, 2 and 3 threads
//   - checkpoint save -> load -> continue is bit-exact
//   - a non-finite gradient skips the step: no state change, count kept,
//     dynamic loss scale backs off; growth after growth_interval good steps
//   - lr = 0 leaves param/master untouched while the count advances
//   - float64 reference (rule from the name) within tolerance
//   - checkpoints across steps: load converts or fails with no change
// Steps: argv[1..] (files or directories of *.so) or $ZOPT_TEST_STEP;
// exit 77 (skipped) without any.
#include "test_util.h"
#include "zopt_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using zopt_ref::load;
using zopt_ref::round_to;
using zopt_ref::store;
size_t esize(uint32_t dt) { return zopt_ref::dtype_size(dt); }

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() {  // [-1, 1)
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (double)(s >> 11) * (2.0 / 9007199254740992.0) - 1.0;
  }
};

struct StepInfo {
  std::string path, name;
  zopt_step *step = nullptr;
  const zopt_step_descriptor *d = nullptr;
  uint32_t pdt = 0, gdt = 0;
  bool has(uint32_t kind) const {
    for (uint32_t i = 0; i < d->num_states; ++i)
      if (d->states[i].kind == kind) return true;
    return false;
  }
  uint32_t dtype_of(uint32_t kind) const {
    for (uint32_t i = 0; i < d->num_states; ++i)
      if (d->states[i].kind == kind) return d->states[i].dtype;
    return 0;
  }
};

// A model: tensors in groups with user-owned param/grad memory.
struct Model {
  const StepInfo *si;
  std::vector<int64_t> numel;
  std::vector<int> group;
  std::vector<std::vector<unsigned char>> p, g;
  zopt_optimizer *o = nullptr;
  int ngroups = 0;

  Model(const StepInfo &s, std::vector<int64_t> n, std::vector<int> grp, int threads, uint64_t seed = 1)
      : si(&s), numel(n), group(grp) {
    ngroups = *std::max_element(grp.begin(), grp.end()) + 1;
    Rng r(seed);
    for (size_t t = 0; t < n.size(); ++t) {
      p.emplace_back((size_t)n[t] * esize(s.pdt));
      g.emplace_back((size_t)n[t] * esize(s.gdt));
      for (int64_t i = 0; i < n[t]; ++i) store(p[t].data(), s.pdt, (size_t)i, (float)r.uniform());
    }
    ZT_OK(zopt_optimizer_create(s.step, &o));
    if (!o) return;
    ZT_OK(zopt_optimizer_set_num_threads(o, threads));
    for (int k = 0; k < ngroups; ++k) {
      int id;
      ZT_OK(zopt_optimizer_add_group(o, &id));
    }
    for (size_t t = 0; t < n.size(); ++t) {
      int id;
      ZT_OK(zopt_optimizer_add_tensor(o, grp[t], p[t].data(), g[t].data(), n[t], (zopt_dtype)s.pdt, &id));
    }
  }
  ~Model() { zopt_optimizer_free(o); }
  void set_hyper_all(const char *name, double v) {
    double old;
    for (int k = 0; k < ngroups; ++k)
      if (zopt_optimizer_get_hyper(o, k, name, &old) == ZOPT_OK) ZT_OK(zopt_optimizer_set_hyper(o, k, name, v));
  }
  // Deterministic gradients for step `k`, multiplied by `scale`.
  void fill_grads(int k, double scale) {
    for (size_t t = 0; t < numel.size(); ++t) {
      Rng r(1000 + 31 * (uint64_t)k + 7 * t);
      for (int64_t i = 0; i < numel[t]; ++i) store(g[t].data(), si->gdt, (size_t)i, (float)(0.5 * r.uniform() * scale));
    }
  }
  // Everything the optimizer owns plus the params and counters, as bytes.
  std::vector<unsigned char> snapshot() const {
    std::vector<unsigned char> out;
    const zopt_step_descriptor *d = si->d;
    for (size_t t = 0; t < numel.size(); ++t) {
      out.insert(out.end(), p[t].begin(), p[t].end());
      for (uint32_t k = 0; k < d->num_states; ++k) {
        uint32_t kind = d->states[k].kind;
        if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
        std::vector<unsigned char> b((size_t)numel[t] * esize(d->states[k].dtype));
        ZT_OK(zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size()));
        out.insert(out.end(), b.begin(), b.end());
      }
    }
    for (int k = 0; k < ngroups; ++k) {
      int64_t c = -1;
      ZT_OK(zopt_optimizer_get_step_count(o, k, &c));
      out.insert(out.end(), (unsigned char *)&c, (unsigned char *)&c + 8);
    }
    double s = 0;
    ZT_OK(zopt_optimizer_get_loss_scale(o, &s));
    out.insert(out.end(), (unsigned char *)&s, (unsigned char *)&s + 8);
    return out;
  }
  double scale() const {
    double s = 1;
    zopt_optimizer_get_loss_scale(o, &s);
    return s;
  }
  zopt_step_result step(int k) {
    fill_grads(k, scale());
    zopt_step_result r{};
    ZT_OK(zopt_optimizer_step(o, &r));
    return r;
  }
};

const std::vector<int64_t> kSizes = {70001, 3000, 17, 65536 * 2 + 64, 999};
const std::vector<int> kGroups = {0, 1, 0, 1, 0};

void test_threads(const StepInfo &s) {
  std::vector<unsigned char> ref;
  for (int threads : {1, 2, 3}) {
    Model m(s, kSizes, kGroups, threads);
    if (!m.o) return;
    ZT_OK(zopt_optimizer_finalize(m.o));
    m.set_hyper_all("lr", 1e-2);
    for (int k = 0; k < 4; ++k) m.step(k);
    auto snap = m.snapshot();
    if (ref.empty()) ref = snap;
    else ZT_CHECK(snap == ref);
  }
  printf("  threads 1/2/3 bit-identical: checked\n");
}

void test_resume(const StepInfo &s) {
  char ck[] = "/tmp/zopt_resume_XXXXXX";
  int fd = mkstemp(ck);
  close(fd);
  Model a(s, kSizes, kGroups, 2);
  if (!a.o) return;
  ZT_OK(zopt_optimizer_finalize(a.o));
  a.set_hyper_all("lr", 3e-3);
  for (int k = 0; k < 3; ++k) a.step(k);
  ZT_OK(zopt_optimizer_save(a.o, ck));
  auto params3 = a.p;
  for (int k = 3; k < 6; ++k) a.step(k);
  auto want = a.snapshot();

  Model b(s, kSizes, kGroups, 3, /*seed*/ 99);  // different initial params
  ZT_OK(zopt_optimizer_finalize(b.o));
  b.p = params3;  // the user restores the model's params...
  for (size_t t = 0; t < b.p.size(); ++t) {
    // ...into the memory registered with the optimizer
    ZT_OK(zopt_optimizer_write_state_raw(b.o, (int)t, ZOPT_STATE_PARAM, params3[t].data(), params3[t].size()));
  }
  ZT_OK(zopt_optimizer_load(b.o, ck));  // ...and the optimizer state
  double hv = 0;
  if (zopt_optimizer_get_hyper(b.o, 0, "lr", &hv) == ZOPT_OK) ZT_CHECK(hv == 3e-3);
  for (int k = 3; k < 6; ++k) b.step(k);
  ZT_CHECK(b.snapshot() == want);
  unlink(ck);
  printf("  checkpoint resume bit-exact: checked\n");
}

void test_skip_and_scaler(const StepInfo &s) {
  const zopt_step_descriptor *d = s.d;
  if (!(d->flags & ZOPT_FLAG_SUMSQ)) {
    printf("  skip on non-finite: step has no SUMSQ pass (not applicable)\n");
    return;
  }
  bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  Model m(s, kSizes, kGroups, 2);
  if (!m.o) return;
  zopt_loss_scaler_config c = {1024, 2, 0.5, 3, 1, 1};
  ZT_OK(zopt_optimizer_configure_loss_scaler(m.o, &c));
  ZT_OK(zopt_optimizer_finalize(m.o));
  zopt_step_result r = m.step(0);
  ZT_CHECK(!r.skipped && std::isfinite(r.grad_norm));
  ZT_CHECK(r.loss_scale == (ls ? 1024.0 : 1.0));
  auto before = m.snapshot();
  for (float bad : {NAN, INFINITY}) {
    m.fill_grads(1, m.scale());
    store(m.g[3].data(), s.gdt, 12345, bad);
    double sc0 = m.scale();
    ZT_OK(zopt_optimizer_step(m.o, &r));
    ZT_CHECK(r.skipped == 1);
    ZT_CHECK(!std::isfinite(r.grad_norm));
    if (ls) ZT_CHECK(m.scale() == std::max(sc0 * 0.5, 1.0));
    auto after = m.snapshot();
    // identical except the loss scale (last 8 bytes)
    ZT_CHECK(after.size() == before.size() &&
             memcmp(after.data(), before.data(), after.size() - 8) == 0);
  }
  if (ls) {
    // 256 now; 3 good steps -> 512
    ZT_CHECK(m.scale() == 256.0);
    for (int k = 2; k < 5; ++k) {
      r = m.step(k);
      ZT_CHECK(!r.skipped && r.loss_scale == 256.0);
    }
    ZT_CHECK(m.scale() == 512.0);
    int64_t cnt = 0;
    ZT_OK(zopt_optimizer_get_step_count(m.o, 0, &cnt));
    ZT_CHECK(cnt == 4);
    // backoff never goes below min_scale
    zopt_loss_scaler_config c2 = {2, 2, 0.5, 100, 1, 1};
    ZT_OK(zopt_optimizer_configure_loss_scaler(m.o, &c2));
    for (int i = 0; i < 3; ++i) {
      m.fill_grads(9, 1);
      store(m.g[0].data(), s.gdt, 0, NAN);
      ZT_OK(zopt_optimizer_step(m.o, &r));
      ZT_CHECK(r.skipped);
    }
    ZT_CHECK(m.scale() == 1.0);
  }
  printf("  non-finite skip%s: checked\n", ls ? " + dynamic loss scaler" : "");
}

void test_lr_zero(const StepInfo &s) {
  Model m(s, kSizes, kGroups, 2);
  if (!m.o) return;
  double v;
  if (zopt_optimizer_get_hyper(m.o, 0, "lr", &v) != ZOPT_OK) return;
  ZT_OK(zopt_optimizer_finalize(m.o));
  m.set_hyper_all("lr", 0.0);
  auto p0 = m.p;
  std::vector<std::vector<float>> w0;
  bool master = s.has(ZOPT_STATE_MASTER);
  for (size_t t = 0; t < kSizes.size() && master; ++t) {
    w0.emplace_back((size_t)kSizes[t]);
    ZT_OK(zopt_optimizer_read_state_f32(m.o, (int)t, ZOPT_STATE_MASTER, w0[t].data(), kSizes[t]));
  }
  m.step(0);
  m.step(1);
  ZT_CHECK(m.p == p0);
  for (size_t t = 0; t < w0.size(); ++t) {
    std::vector<float> w((size_t)kSizes[t]);
    ZT_OK(zopt_optimizer_read_state_f32(m.o, (int)t, ZOPT_STATE_MASTER, w.data(), kSizes[t]));
    ZT_CHECK(memcmp(w.data(), w0[t].data(), w.size() * 4) == 0);
  }
  int64_t cnt = 0;
  ZT_OK(zopt_optimizer_get_step_count(m.o, 1, &cnt));
  ZT_CHECK(cnt == 2);
  // memory accounting
  zopt_memory_info mi;
  ZT_OK(zopt_optimizer_memory_info(m.o, &mi));
  uint64_t n = 0, owned = 0, pad = 0;
  for (auto x : kSizes) n += (uint64_t)x;
  for (uint32_t k = 0; k < s.d->num_states; ++k)
    if (s.d->states[k].kind > ZOPT_STATE_GRAD) {
      owned += n * esize(s.d->states[k].dtype);
      // Each group's last bucket is padded to a norm block (at most 32768 elements).
      pad += 2 * 32768 * esize(s.d->states[k].dtype) + 64;
    }
  ZT_CHECK(mi.num_params == n);
  ZT_CHECK(mi.world_size == 1 && mi.rank == 0);
  ZT_CHECK(mi.state_bytes >= owned && mi.state_bytes <= owned + pad);
  ZT_CHECK(mi.state_bytes_one_rank == mi.state_bytes);
  ZT_CHECK(mi.bytes_cpu == n * (esize(s.pdt) + esize(s.gdt)) + mi.state_bytes + mi.scratch_bytes);
  printf("  lr = 0 keeps params/master, memory_info: checked\n");
}

// ZOPT_GROUP_MAXIMIZE on group 1 steps exactly like minimizing with that
// group's gradients negated (torch's maximize: grad = -grad first, then
// weight decay and the rule), bit for bit: params, every state, step
// counts, loss scale. Group 0 is untouched by the flag. Flags set after
// finalize and switched off again between steps take effect at the next
// step.
void test_maximize(const StepInfo &s) {
  Model a(s, kSizes, kGroups, 2), b(s, kSizes, kGroups, 2);
  if (!a.o || !b.o) return;
  ZT_OK(zopt_optimizer_finalize(a.o));
  ZT_OK(zopt_optimizer_finalize(b.o));
  for (Model *m : {&a, &b}) {
    m->set_hyper_all("lr", 1e-2);
    m->set_hyper_all("weight_decay", 0.1);
  }
  ZT_OK(zopt_optimizer_set_group_flags(a.o, 1, ZOPT_GROUP_MAXIMIZE));
  auto negate_group1 = [&](Model &m) {
    for (size_t t = 0; t < kSizes.size(); ++t)
      if (kGroups[t] == 1)
        for (int64_t i = 0; i < kSizes[t]; ++i)
          store(m.g[t].data(), s.gdt, (size_t)i, -load(m.g[t].data(), s.gdt, (size_t)i));
  };
  for (int k = 0; k < 5; ++k) {
    bool on = k != 3;  // off for one step, then on again
    if (k >= 3) ZT_OK(zopt_optimizer_set_group_flags(a.o, 1, on ? ZOPT_GROUP_MAXIMIZE : 0));
    zopt_step_result ra = a.step(k);
    b.fill_grads(k, b.scale());
    if (on) negate_group1(b);
    zopt_step_result rb{};
    ZT_OK(zopt_optimizer_step(b.o, &rb));
    ZT_CHECK(ra.skipped == rb.skipped);
    ZT_CHECK(ra.grad_norm == rb.grad_norm || (std::isnan(ra.grad_norm) && std::isnan(rb.grad_norm)));
  }
  ZT_CHECK(a.snapshot() == b.snapshot());
  // ...and differs from not maximizing (the flag is not ignored).
  Model c(s, kSizes, kGroups, 2);
  ZT_OK(zopt_optimizer_finalize(c.o));
  c.set_hyper_all("lr", 1e-2);
  c.set_hyper_all("weight_decay", 0.1);
  for (int k = 0; k < 5; ++k) c.step(k);
  ZT_CHECK(c.p[1] != a.p[1]);  // group 1
  ZT_CHECK(c.p[0] == a.p[0]);  // group 0: never maximized
  printf("  maximize == negated gradients, bit-exact: checked\n");
}

// ---- float64 reference (test/reference/zopt_reference.h) -----------------
enum Rule { UNKNOWN, ADAMW, ADAM, SGD, SGD_NESTEROV, LION };

Rule rule_of(const std::string &name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), ::tolower);
  if (n.find("adamw") != std::string::npos) return ADAMW;
  if (n.find("adam") != std::string::npos) return ADAM;
  if (n.find("lion") != std::string::npos) return LION;
  if (n.find("sgd") != std::string::npos) return n.find("nesterov") != std::string::npos ? SGD_NESTEROV : SGD;
  return UNKNOWN;
}

zopt_ref::Rule ref_rule(Rule r, bool ams) {
  switch (r) {
    case ADAMW: return zopt_ref::Rule::AdamW;
    case ADAM: return ams ? zopt_ref::Rule::AdamAmsgrad : zopt_ref::Rule::Adam;
    case SGD: return zopt_ref::Rule::Sgd;
    case SGD_NESTEROV: return zopt_ref::Rule::SgdNesterov;
    default: return zopt_ref::Rule::Lion;
  }
}

void test_reference(const StepInfo &s) {
  Rule rule = rule_of(s.name);
  if (rule == UNKNOWN) {
    printf("  reference: rule not identifiable from the name '%s' (skipped)\n", s.name.c_str());
    return;
  }
  const zopt_step_descriptor *d = s.d;
  std::vector<int64_t> sizes = {3000, 70001, 17};
  std::vector<int> groups = {0, 1, 1};
  Model m(s, sizes, groups, 2);
  if (!m.o) return;
  zopt_loss_scaler_config lc = {256, 2, 0.5, 2, 1, 1};
  ZT_OK(zopt_optimizer_configure_loss_scaler(m.o, &lc));
  ZT_OK(zopt_optimizer_finalize(m.o));
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  // hyperparameters per group (group 1: other lr / wd)
  double H[2][9];
  const char *names[9] = {nullptr, "lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                          "bias_correction"};
  double defaults[9] = {0, 0, 0.9, 0.999, 1e-8, 0, 0, 0, 1};
  for (int gi = 0; gi < 2; ++gi) {
    double lr = rule == LION ? 1e-3 : 1e-2;
    m.set_hyper_all("lr", lr);
    ZT_OK(zopt_optimizer_set_hyper(m.o, 1, "lr", lr * 0.5));
    double wd;
    if (zopt_optimizer_get_hyper(m.o, gi, "weight_decay", &wd) == ZOPT_OK)
      ZT_OK(zopt_optimizer_set_hyper(m.o, gi, "weight_decay", gi ? 0.05 : 0.1));
    double mom;
    if (zopt_optimizer_get_hyper(m.o, gi, "momentum", &mom) == ZOPT_OK)
      ZT_OK(zopt_optimizer_set_hyper(m.o, gi, "momentum", 0.9));
    for (int k = 1; k <= 8; ++k)
      if (zopt_optimizer_get_hyper(m.o, gi, names[k], &H[gi][k]) != ZOPT_OK) H[gi][k] = defaults[k];
  }
  const bool master = s.has(ZOPT_STATE_MASTER);
  const bool ams = s.has(ZOPT_STATE_MAX_EXP_AVG_SQ);
  const bool has_buf = s.has(ZOPT_STATE_MOMENTUM_BUFFER);
  const zopt_ref::Rule rr = ref_rule(rule, ams);
  const uint32_t wdt = master ? s.dtype_of(ZOPT_STATE_MASTER) : s.pdt;
  // reference state
  size_t T = sizes.size();
  std::vector<std::vector<zopt_ref::Elem<double>>> R(T);
  std::vector<std::vector<double>> P(T), M(T);  // R's params and exp_avg, for the comparison
  for (size_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < sizes[t]; ++i) R[t].push_back({load(m.p[t].data(), s.pdt, (size_t)i), 0, 0, 0, 0});
  double worst = 0;
  const int steps = 5;
  for (int k = 0; k < steps; ++k) {
    const int t1 = k + 1;
    double S = ls ? m.scale() : 1.0;
    m.fill_grads(k, S);
    const float gs = zopt_ref::grad_scale(S, 1);
    double ss = 0;
    for (size_t t = 0; t < T; ++t)
      ss += (double)zopt_ref::sumsq_exact((size_t)sizes[t], [&](size_t i) {
        return zopt_ref::norm_value(load(m.g[t].data(), s.gdt, i), gs);
      });
    double norm = zopt_ref::norm(ss), clip = 1;
    if (d->flags & ZOPT_FLAG_CLIP) clip = zopt_ref::clip_coef(norm, d->max_norm);
    zopt_step_result r{};
    ZT_OK(zopt_optimizer_step(m.o, &r));
    if (d->flags & ZOPT_FLAG_SUMSQ) ZT_CHECK(std::fabs(r.grad_norm - norm) <= 1e-5 * norm);
    for (size_t t = 0; t < T; ++t) {
      const double *h = H[groups[t]];
      zopt_ref::Hypers hy;
      hy.lr = h[1];
      hy.beta1 = h[2];
      hy.beta2 = h[3];
      hy.eps = h[4];
      hy.weight_decay = h[5];
      hy.momentum = h[6];
      hy.dampening = h[7];
      hy.bias_correction = h[8] != 0;
      const zopt_ref::Coeffs co = zopt_ref::rounded(zopt_ref::coefficients(hy, t1));
      for (int64_t i = 0; i < sizes[t]; ++i) {
        double g = zopt_ref::gradient(load(m.g[t].data(), s.gdt, (size_t)i), 1.0 / S, clip);
        zopt_ref::step_element(rr, co, t1 == 1, has_buf, g, R[t][i]);
      }
    }
  }
  for (size_t t = 0; t < T; ++t)
    for (const auto &e : R[t]) {
      P[t].push_back(e.p);
      M[t].push_back(e.m);
    }
  // compare
  // Tolerance: rounding of the weights (relative) plus rounding inside the
  // update (relative to the total update, lr * steps), by the precision of
  // the states involved.
  auto rel = [](uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 2e-5 : dt == ZOPT_DTYPE_F16 ? 3e-3 : 1.2e-2; };
  // weights stored narrow: each step may round by half an ulp
  double rtol = wdt == ZOPT_DTYPE_F32 ? 2e-5 : 1.2 * steps * (wdt == ZOPT_DTYPE_BF16 ? 0x1p-8 : 0x1p-11);
  double utol = 2e-5;
  for (uint32_t k = 0; k < d->num_states; ++k)
    if (d->states[k].kind > ZOPT_STATE_MASTER && d->states[k].dtype != ZOPT_DTYPE_F32) utol = 0.1;
  int bad = 0, flips = 0;
  long total = 0;
  for (size_t t = 0; t < T; ++t) {
    const double lr = H[groups[t]][1];
    std::vector<float> w((size_t)sizes[t]);
    ZT_OK(zopt_optimizer_read_state_f32(m.o, (int)t, master ? ZOPT_STATE_MASTER : ZOPT_STATE_PARAM, w.data(),
                                        sizes[t]));
    for (int64_t i = 0; i < sizes[t]; ++i) {
      double err = std::fabs(w[i] - P[t][i]);
      double tol = rtol * std::fabs(P[t][i]) + utol * lr * steps + 1e-7;
      ++total;
      // Lion: sign() of a value within rounding of 0 may flip (error 2 lr)
      if (rule == LION && err > tol && err <= 2 * lr * steps + tol) {
        ++flips;
        continue;
      }
      worst = std::max(worst, err / tol);
      if (err > tol && bad++ < 5)
        printf("    tensor %zu [%lld]: got %.9g want %.9g\n", t, (long long)i, w[i], P[t][i]);
      if (master) {  // the low-precision param is the rounded master
        float pv = load(m.p[t].data(), s.pdt, (size_t)i);
        if (pv != round_to(w[i], s.pdt) && bad++ < 5)
          printf("    tensor %zu [%lld]: param %.9g != rounded master %.9g\n", t, (long long)i, pv, w[i]);
      }
    }
    if (s.has(ZOPT_STATE_EXP_AVG) && (rule == ADAM || rule == ADAMW || rule == LION)) {
      uint32_t mdt = s.dtype_of(ZOPT_STATE_EXP_AVG);
      double mt = rel(mdt);
      double mabs = mdt == ZOPT_DTYPE_F32 ? 1e-7 : 1e-4;
      ZT_OK(zopt_optimizer_read_state_f32(m.o, (int)t, ZOPT_STATE_EXP_AVG, w.data(), sizes[t]));
      for (int64_t i = 0; i < sizes[t]; ++i)
        if (std::fabs(w[i] - M[t][i]) > mt * std::fabs(M[t][i]) + mabs && bad++ < 5)
          printf("    tensor %zu exp_avg[%lld]: got %.9g want %.9g\n", t, (long long)i, w[i], M[t][i]);
    }
  }
  ZT_CHECK(bad == 0);
  ZT_CHECK(flips <= total / 1000);
  static const char *rn[] = {"?", "adamw", "adam", "sgd", "sgd_nesterov", "lion"};
  printf("  float64 reference (%s%s, %d steps): worst error %.3g of tolerance%s\n", rn[rule], ams ? "+amsgrad" : "",
         steps, worst, bad ? "  FAILED" : "");
}

// Save with one step, load into another over the same tensor sizes.
void test_cross(const StepInfo &a, const StepInfo &b) {
  std::vector<int64_t> sizes = {1000, 4097};
  std::vector<int> groups = {0, 0};
  Model ma(a, sizes, groups, 2), mb(b, sizes, groups, 2, 5);
  if (!ma.o || !mb.o) return;
  ZT_OK(zopt_optimizer_finalize(ma.o));
  ZT_OK(zopt_optimizer_finalize(mb.o));
  ma.step(0);
  ma.step(1);
  char ck[] = "/tmp/zopt_cross_XXXXXX";
  int fd = mkstemp(ck);
  close(fd);
  ZT_OK(zopt_optimizer_save(ma.o, ck));
  auto before = mb.snapshot();
  zopt_status st = zopt_optimizer_load(mb.o, ck);
  if (st != ZOPT_OK) {
    ZT_CHECK(st == ZOPT_ERR_CHECKPOINT && zopt_last_error()[0]);
    ZT_CHECK(mb.snapshot() == before);
    printf("  cross %s -> %s: refused (%s)\n", a.name.c_str(), b.name.c_str(), zopt_last_error());
  } else {
    int checked = 0;
    for (uint32_t k = 0; k < b.d->num_states; ++k) {
      uint32_t kind = b.d->states[k].kind;
      if (kind <= ZOPT_STATE_GRAD || !a.has(kind)) continue;
      for (size_t t = 0; t < sizes.size(); ++t) {
        std::vector<float> x((size_t)sizes[t]), y((size_t)sizes[t]);
        ZT_OK(zopt_optimizer_read_state_f32(ma.o, (int)t, (zopt_state_kind)kind, x.data(), sizes[t]));
        ZT_OK(zopt_optimizer_read_state_f32(mb.o, (int)t, (zopt_state_kind)kind, y.data(), sizes[t]));
        for (int64_t i = 0; i < sizes[t]; ++i) {
          float want = round_to(x[i], b.d->states[k].dtype);
          if (memcmp(&want, &y[i], 4) != 0 && !(std::isnan(want) && std::isnan(y[i]))) {
            ZT_CHECK(!"converted state differs");
            break;
          }
        }
        ++checked;
      }
    }
    int64_t ca = 0, cb = 0;
    zopt_optimizer_get_step_count(ma.o, 0, &ca);
    zopt_optimizer_get_step_count(mb.o, 0, &cb);
    ZT_CHECK(ca == cb);
    printf("  cross %s -> %s: loaded, %d state(s) converted exactly\n", a.name.c_str(), b.name.c_str(), checked);
  }
  unlink(ck);
}

}  // namespace

int main(int argc, char **argv) {
  static char paths[64][4096];
  int n = zt_collect_steps(argc, argv, paths, 64);
  if (n == 0) {
    printf("test_step: no compiled step given (argv or ZOPT_TEST_STEP): skipped\n");
    return ZT_SKIP;
  }
  std::vector<StepInfo> steps;
  for (int i = 0; i < n; ++i) {
    StepInfo s;
    s.path = paths[i];
    zopt_status st = zopt_step_load(paths[i], &s.step);
    if (st == ZOPT_ERR_UNSUPPORTED && getenv("ZOPT_CPU")) {  // forced ISA absent here
      printf("== %s: %s (skipped)\n", paths[i], zopt_last_error());
      continue;
    }
    if (st != ZOPT_OK) {
      fprintf(stderr, "cannot load %s: %s\n", paths[i], zopt_last_error());
      zt_failures++;
      continue;
    }
    s.d = zopt_step_get_descriptor(s.step);
    s.name = s.d->name;
    bool gpu = false;
    for (uint32_t k = 0; k < s.d->num_states; ++k) {
      if (s.d->states[k].kind == ZOPT_STATE_PARAM) s.pdt = s.d->states[k].dtype;
      if (s.d->states[k].kind == ZOPT_STATE_GRAD) s.gdt = s.d->states[k].dtype;
      gpu |= s.d->states[k].placement == ZOPT_PLACE_GPU;
    }
    if (gpu) {
      printf("== %s (%s): GPU-placed state, CPU runtime skips it\n", paths[i], s.name.c_str());
      zopt_step_free(s.step);
      continue;
    }
    steps.push_back(s);
  }
  for (auto &s : steps) {
    printf("== %s (%s, isa %d)\n", s.path.c_str(), s.name.c_str(), (int)zopt_step_isa(s.step));
    test_threads(s);
    test_resume(s);
    test_skip_and_scaler(s);
    test_lr_zero(s);
    test_maximize(s);
    test_reference(s);
  }
  for (size_t i = 0; i < steps.size(); ++i)
    for (size_t j = 0; j < steps.size(); ++j)
      if (i != j) test_cross(steps[i], steps[j]);
  for (auto &s : steps) zopt_step_free(s.step);
  if (zt_failures) {
    fprintf(stderr, "%d failure(s)\n", zt_failures);
    return 1;
  }
  printf("test_step: all passed (%zu step(s))\n", steps.size());
  return steps.empty() ? ZT_SKIP : 0;
}

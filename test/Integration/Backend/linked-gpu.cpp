//===- linked-gpu.cpp - a GPU step as a part of a linked step --------------===//
//
// zopt-linked-gpu-check GPU.so PARTNER.so TWIN.so cpu|offload [--ulps=N]
//
// GPU.so is a GPU step, TWIN.so the same description compiled for the CPU,
// PARTNER.so the part linked with the GPU part: the twin itself (cpu) or
// the description with params and grads on the GPU and the rest on the CPU
// (offload). Four tensors in two groups; the GPU part holds tensors 0 and 1
// (the first added: what zopt.steps' gpu_fraction puts on the GPU), the
// partner tensors 2 and 3. Every check steps the two parts with
// zopt_optimizer_step_linked (one norm, one decision) and the same four
// tensors in references on the CPU:
//
//   one  one CPU optimizer of the twin over all four tensors. The values are
//        multiples of 1/64 (random), whose squares' sums are exact in f64 in
//        any order: the linked norm must equal the one step's bit for bit
//        (clip inactive, active, at a max_norm set at run time), and so
//        every stored bit, the counts and the loss scaler
//   pair the twin as two CPU optimizers with the same split, linked (random
//        f32 values, sums not exact): the GPU part's sum of squares is added
//        as a CPU part's is (its block partials in order, docs/NUMERICS.md),
//        so the clipped steps agree bit for bit
//
// and: a non-finite gradient in either part skips every part (no state or
// count changes, the scaler backs off alike), the parts in the other order,
// the step result of a GPU part 0, a linked step begun and ended
// (zopt_optimizer_step_linked_begin), and a linked step inside a CUDA graph
// capture of the GPU part's stream refused with the reason, nothing
// changed. Run against the stand-in driver with ZOPT_FAKE_CUDA_TWIN (the
// GPU kernels run as the twin's CPU kernels), or on a GPU with --ulps=N:
// the GPU's elementwise math may differ from the CPU kernels' by a few
// units in the last place (zopt-gpu-check's tolerances: f32 8, bf16/f16 1),
// so the states compare within N ulp and the "pair" norms (sums in another
// order) within 1e-12 relative; the exact-sum norms, skips, counts and
// scalers still compare exactly.
//
// Output: PASS/FAIL lines and "N passed, M failed"; exit 1 on a failure, 77
// without a CUDA driver.
//===----------------------------------------------------------------------===//
#include "twin_util.h"
#include "zopt/abi.h"
#include "zopt/zopt.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace twin;
using zopt_check::check;

namespace {

int64_t g_ulps = 0;  // --ulps=N: states compared within N units in the last place

// Whether two raw buffers of `es`-byte floats agree within g_ulps.
bool close_raw(const std::vector<unsigned char> &a, const std::vector<unsigned char> &b, size_t es) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i + es <= a.size(); i += es) {
    int64_t u = 0, v = 0;
    memcpy(&u, &a[i], es);
    memcpy(&v, &b[i], es);
    if (u == v) continue;
    if (std::llabs(ordered(u, es) - ordered(v, es)) > g_ulps) return false;
  }
  return true;
}

// The states of tensor t, raw, from whichever optimizer holds it.
std::vector<std::vector<unsigned char>> states(const Opt &x, int t) {
  std::vector<std::vector<unsigned char>> out;
  const int id = x.local(t);
  for (uint32_t s = 0; s < x.d->num_states; ++s) {
    std::vector<unsigned char> b((size_t)kSizes[t] * dsize(x.d->states[s].dtype));
    Z(zopt_optimizer_read_state_raw(x.o, id, (zopt_state_kind)x.d->states[s].kind, b.data(), b.size()));
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc == 6 && !strncmp(argv[5], "--ulps=", 7)) g_ulps = atoll(argv[5] + 7);
  if ((argc != 5 && (argc != 6 || strncmp(argv[5], "--ulps=", 7))) ||
      (std::string(argv[4]) != "cpu" && std::string(argv[4]) != "offload")) {
    fprintf(stderr, "usage: %s GPU.so PARTNER.so TWIN.so cpu|offload [--ulps=N]\n", argv[0]);
    return 2;
  }
  const bool offload = std::string(argv[4]) == "offload";
  if (!load_driver()) {
    printf("UNSUPPORTED: a GPU part needs a CUDA driver and a device\n");
    return 77;
  }
  std::mt19937 rng(11);
  // Random multiples of 1/64 in [-4, 4): exact in every storage dtype.
  auto exact = [&]() { return (float)((int)(rng() % 512) - 256) / 64.0f; };
  std::vector<std::vector<float>> params(4);
  for (int t = 0; t < 4; ++t)
    for (int64_t e = 0; e < kSizes[t]; ++e) params[t].push_back(exact());

  // ---- against one CPU step over all four tensors (exact sums) ----------------
  Opt gpu = make(argv[1], true, {0, 1}, params), partner = make(argv[2], offload, {2, 3}, params);
  Opt one = make(argv[3], false, {0, 1, 2, 3}, params);
  const uint32_t flags = one.d->flags;
  const bool clip = flags & ZOPT_FLAG_CLIP, ls = flags & ZOPT_FLAG_LOSS_SCALE, norm = flags & ZOPT_FLAG_SUMSQ;
  printf("INFO step '%s' (flags %u) linked with '%s' (%s), against '%s'\n", gpu.d->name, flags, partner.d->name,
         argv[4], one.d->name);
  auto owner = [&](int t) -> Opt & { return t < 2 ? gpu : partner; };
  // The same gradients into the parts and `one`: `scale` times random
  // multiples of 1/64; `bad` >= 0 puts an inf into that tensor.
  auto grads = [&](float scale, int bad = -1) {
    for (int t = 0; t < 4; ++t) {
      std::vector<float> g;
      for (int64_t e = 0; e < kSizes[t]; ++e) g.push_back(exact() * scale);
      if (t == bad) g[(size_t)kSizes[t] / 2] = INFINITY;
      Z(zopt_optimizer_write_state_f32(owner(t).o, owner(t).local(t), ZOPT_STATE_GRAD, g.data(), kSizes[t]));
      Z(zopt_optimizer_write_state_f32(one.o, t, ZOPT_STATE_GRAD, g.data(), kSizes[t]));
    }
  };
  zopt_step_result lr{}, orr{};
  auto step = [&](bool gpu_first = true) {
    zopt_optimizer *parts[2] = {gpu.o, partner.o};
    if (!gpu_first) std::swap(parts[0], parts[1]);
    lr = zopt_step_result{};
    Z(zopt_optimizer_step_linked(parts, 2, &lr));
    Z(zopt_optimizer_step(one.o, &orr));
  };
  auto same = [&](const std::string &what) {
    int64_t n = 0;
    for (int t = 0; t < 4; ++t) {
      auto a = states(owner(t), t), b = states(one, t);
      for (size_t s = 0; s < a.size(); ++s)
        n += !close_raw(a[s], b[s], dsize(one.d->states[s].dtype));
    }
    const std::string c = counts(gpu) + " / " + counts(partner);
    check(n == 0, what + ": every state of every tensor " +
                      (g_ulps ? "within " + std::to_string(g_ulps) + " ulp of" : std::string("bit-identical to")) +
                      " one CPU step's" + (n ? " (" + std::to_string(n) + " states differ)" : std::string()) +
                      "; counts " + c);
  };
  const float small = clip ? 0.001f : 1.0f;  // clipping inactive (norm < 1)
  for (int k = 0; k < 2; ++k) {
    grads(small);
    step();
  }
  same("step: 2 linked steps");
  check(counts(gpu) == "2 2 | 2 2" && counts(partner) == "2 2 | 2 2", "counts: 2 on every tensor and group of both parts");
  if (norm)
    check(lr.grad_norm == orr.grad_norm && !lr.skipped && (!clip || lr.grad_norm < 1.0),
          "result: a GPU part 0 reports the linked norm " + std::to_string(lr.grad_norm) + " (one step's " +
              std::to_string(orr.grad_norm) + ")");
  grads(small);
  step(false);
  same("order: the partner as part 0");

  if (clip) {
    grads(64.0f);
    step();
    double mn = 0;
    Z(zopt_optimizer_get_max_norm(one.o, &mn));
    check(lr.grad_norm == orr.grad_norm && lr.grad_norm > mn,
          "clip: the linked norm " + std::to_string(lr.grad_norm) + " equals one step's bit for bit, above max_norm " +
              std::to_string(mn));
    same("clip: the clipped update");
    const double m = 0.125 * lr.grad_norm;
    for (zopt_optimizer *o : {gpu.o, partner.o, one.o}) Z(zopt_optimizer_set_max_norm(o, m));
    grads(64.0f);
    step();
    same("clip: max_norm " + std::to_string(m) + " set at run time on every part");
    for (zopt_optimizer *o : {gpu.o, partner.o, one.o}) Z(zopt_optimizer_set_max_norm(o, mn));
    grads(small);
    step();
    same("clip: the compiled max_norm again, clipping inactive");
  }

  if (norm) {
    for (int bad : {1, 2}) {
      double s0 = 0, s1 = 0, s2 = 0;
      int64_t g0 = 0, g1 = 0, g2 = 0;
      Z(zopt_optimizer_get_loss_scaler_state(gpu.o, &s0, &g0));
      const std::string c0 = counts(gpu) + " / " + counts(partner);
      grads(small, bad);
      std::vector<std::vector<std::vector<unsigned char>>> before;
      for (int t = 0; t < 4; ++t) before.push_back(states(owner(t), t));
      step();
      bool unchanged = true;
      for (int t = 0; t < 4; ++t) unchanged = unchanged && states(owner(t), t) == before[(size_t)t];
      const std::string c1 = counts(gpu) + " / " + counts(partner);
      check(lr.skipped == 1 && orr.skipped == 1 && std::isinf(lr.grad_norm) && unchanged && c1 == c0,
            "skip: an inf in tensor " + std::to_string(bad) + " (the " + (bad < 2 ? "GPU part" : "partner") +
                ") skips every part: no state, param or count changes (" + c1 + ")");
      Z(zopt_optimizer_get_loss_scaler_state(gpu.o, &s1, &g1));
      Z(zopt_optimizer_get_loss_scaler_state(partner.o, &s2, &g2));
      double so = 0;
      int64_t go = 0;
      Z(zopt_optimizer_get_loss_scaler_state(one.o, &so, &go));
      if (ls)
        check(s1 == std::max(s0 * 0.5, 1.0) && s1 == s2 && s1 == so && g1 == 0 && g2 == 0 && go == 0,
              "skip: every part's loss scaler backs off alike: " + std::to_string(s0) + " -> " + std::to_string(s1) +
                  " / " + std::to_string(s2));
      same("skip: after the skipped step");
    }
  }

  if (ls) {
    double s0 = 0, s1 = 0, s2 = 0, so = 0;
    int64_t g = 0;
    Z(zopt_optimizer_get_loss_scaler_state(gpu.o, &s0, &g));
    for (int k = 0; k < 2; ++k) {
      grads(small);
      step();
    }
    Z(zopt_optimizer_get_loss_scaler_state(gpu.o, &s1, &g));
    Z(zopt_optimizer_get_loss_scaler_state(partner.o, &s2, &g));
    Z(zopt_optimizer_get_loss_scaler_state(one.o, &so, &g));
    check(s1 == s0 * 2 && s2 == s1 && so == s1 && lr.loss_scale == orr.loss_scale,
          "scaler: S grows by 2 after 2 good linked steps on every part: " + std::to_string(s0) + " -> " +
              std::to_string(s1));
    same("scaler: after the growth");
  }

  // A linked step begun and ended (the norm known on the host in between).
  {
    zopt_optimizer *parts[2] = {gpu.o, partner.o};
    grads(clip ? 64.0f : small);
    zopt_step_result br{};
    Z(zopt_optimizer_step_linked_begin(parts, 2, &br));
    Z(zopt_optimizer_step_linked(parts, 2, &lr));
    Z(zopt_optimizer_step(one.o, &orr));
    check(!norm || (br.grad_norm == orr.grad_norm && lr.grad_norm == orr.grad_norm),
          "begun: zopt_optimizer_step_linked_begin reports the linked norm " + std::to_string(br.grad_norm));
    same("begun: a linked step begun, then ended");
  }

  // A linked step inside a capture of the GPU part's stream: refused,
  // nothing enqueued or changed.
  {
    void *cs = nullptr;
    C(g_cu.StreamCreate(&cs, 0));
    Z(zopt_optimizer_set_stream(gpu.o, cs));
    grads(small);
    const std::string c0 = counts(gpu) + " / " + counts(partner);
    std::vector<std::vector<std::vector<unsigned char>>> before;
    for (int t = 0; t < 4; ++t) before.push_back(states(owner(t), t));
    C(g_cu.StreamBeginCapture(cs, 0));
    zopt_optimizer *parts[2] = {partner.o, gpu.o};
    const zopt_status st = zopt_optimizer_step_linked(parts, 2, &lr);
    const std::string msg = zopt_last_error();
    void *graph = nullptr;
    const int ec = g_cu.StreamEndCapture(cs, &graph);
    bool unchanged = true;
    for (int t = 0; t < 4; ++t) unchanged = unchanged && states(owner(t), t) == before[(size_t)t];
    check(st == ZOPT_ERR_BAD_STATE && msg.find("capturing a CUDA graph") != std::string::npos &&
              msg.find("linked") != std::string::npos && ec == 0 && unchanged &&
              counts(gpu) + " / " + counts(partner) == c0,
          "capture: a linked step with a GPU part inside a capture is refused, nothing changed: " + msg);
    step();
    same("capture: the next linked step outside it");
    Z(zopt_optimizer_set_stream(gpu.o, nullptr));
  }
  release(gpu);
  release(partner);
  release(one);

  // ---- against the twin as two linked CPU parts (sums not exact) ---------------
  {
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    std::vector<std::vector<float>> p(4);
    for (int t = 0; t < 4; ++t)
      for (int64_t e = 0; e < kSizes[t]; ++e) p[t].push_back(U(rng));
    Opt a = make(argv[1], true, {0, 1}, p), b = make(argv[2], offload, {2, 3}, p);
    Opt ca = make(argv[3], false, {0, 1}, p), cb = make(argv[3], false, {2, 3}, p);
    bool ok = true;
    double n1 = 0, n2 = 0;
    for (int k = 0; k < 3; ++k) {
      for (int t = 0; t < 4; ++t) {
        std::vector<float> g;
        for (int64_t e = 0; e < kSizes[t]; ++e) g.push_back(U(rng) * (clip ? (k == 1 ? 0.01f : 3.0f) : 1.0f));
        Opt &x = t < 2 ? a : b, &y = t < 2 ? ca : cb;
        Z(zopt_optimizer_write_state_f32(x.o, x.local(t), ZOPT_STATE_GRAD, g.data(), kSizes[t]));
        Z(zopt_optimizer_write_state_f32(y.o, y.local(t), ZOPT_STATE_GRAD, g.data(), kSizes[t]));
      }
      zopt_optimizer *gp[2] = {a.o, b.o}, *cp[2] = {ca.o, cb.o};
      zopt_step_result r1{}, r2{};
      Z(zopt_optimizer_step_linked(gp, 2, &r1));
      Z(zopt_optimizer_step_linked(cp, 2, &r2));
      ok = ok && (!norm || r1.grad_norm == r2.grad_norm ||
                  (g_ulps && std::fabs(r1.grad_norm - r2.grad_norm) <= 1e-12 * std::fabs(r2.grad_norm)));
      n1 = r1.grad_norm;
      n2 = r2.grad_norm;
      for (int t = 0; t < 4; ++t) {
        auto x = states(t < 2 ? a : b, t), y = states(t < 2 ? ca : cb, t);
        for (size_t s = 0; s < x.size(); ++s) ok = ok && close_raw(x[s], y[s], dsize(ca.d->states[s].dtype));
      }
    }
    check(ok, "pair: 3 linked steps of random f32 values (clipped, not, clipped) " +
                  (g_ulps ? "within " + std::to_string(g_ulps) + " ulp of" : std::string("bit-identical to")) +
                  " the twin as two linked CPU parts: norm " + std::to_string(n1) + " / " + std::to_string(n2));
    release(a);
    release(b);
    release(ca);
    release(cb);
  }

  free_all();
  printf("%d passed, %d failed\n", zopt_check::passed, zopt_check::failed);
  return zopt_check::failed ? 1 : 0;
}

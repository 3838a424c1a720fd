//===- conformance.cpp - one suite every backend of the runtime runs ------===//
//
// zopt-backend-conformance BACKEND STEP.so TWIN.so
//
// BACKEND is cpu, offload or cuda: the backend STEP.so's optimizer gets
// (runtime/src/backend/). TWIN.so is the same description compiled for the
// CPU (for cpu: the step itself). The same sequence of C API calls drives an
// optimizer of STEP.so (its params and grads in host memory for cpu, in
// device memory from the CUDA driver otherwise: ZOPT_CUDA_DRIVER, e.g. the
// stand-in of test/Integration/GPUHost, whose ZOPT_FAKE_CUDA_TWIN runs the
// GPU kernels on the twin) and a CPU optimizer of TWIN.so, and checks the
// contract (docs/NUMERICS.md) on every backend alike:
//
//   step         two steps: every stored bit of every state equals the twin's
//   counts       per tensor and per group, +1 per taken step
//   read/write   write_state_f32 / read_state_f32 round trips; a step after
//                written moments equals the twin's
//   skip         (a norm) a NaN gradient: the step is skipped, no state or
//                count changes, the loss scaler backs off
//   scaler       (loss scaling) S doubles after growth_interval good steps
//   clip         (clipping) large gradients: the norm is the float64 norm of
//                the scaled gradients, the update equals the twin's (cuda:
//                within the rounding of the clip coefficient, the GPU adds
//                the norm's partials in another order)
//   active       a tensor marked inactive (zopt_optimizer_set_active) is left
//                alone and keeps its count; it joins again at its own t
//   tensor step  set_tensor_step: the rule reads the tensor's count
//
// Output: PASS/FAIL lines and "N passed, M failed"; exit 1 on a failure, 77
// when BACKEND needs a CUDA driver and there is none (lit: UNSUPPORTED).
//===----------------------------------------------------------------------===//
#include "twin_util.h"
#include "zopt_reference.h"
#include "zopt/abi.h"
#include "zopt/zopt.h"

#include <dlfcn.h>

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

// Elements of state s of an n-element tensor (a PER_BLOCK state, a q8
// absmax: one per ZOPT_Q8_BLOCK).
int64_t snumel(const zopt_step_descriptor *d, uint32_t s, int64_t n) {
  return (d->states[s].flags & ZOPT_STATE_PER_BLOCK) ? (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : n;
}

// ---- the suite's optimizers: all four tensors (twin_util.h) -------------------
constexpr int T = 4;
const std::vector<int> kAll = {0, 1, 2, 3};

// A value every storage dtype holds exactly: a multiple of 1/64 below 4.
float exact(std::mt19937 &r) { return (float)((int)(r() % 512) - 256) / 64.0f; }

void step(Opt &x) {
  zopt_step_result r{};
  Z(zopt_optimizer_step(x.o, &r));
  if (std::isnan(r.loss_scale))  // a GPU step: the result is on the device
    Z(zopt_optimizer_gpu_result(x.o, &r));
  x.last = r;
}

// Every stored state of every tensor, raw bytes.
std::vector<std::vector<unsigned char>> snapshot(const Opt &x) {
  std::vector<std::vector<unsigned char>> out;
  for (int t = 0; t < T; ++t)
    for (uint32_t s = 0; s < x.d->num_states; ++s) {
      const uint32_t k = x.d->states[s].kind;
      std::vector<unsigned char> b((size_t)snumel(x.d, s, kSizes[t]) * dsize(x.d->states[s].dtype));
      Z(zopt_optimizer_read_state_raw(x.o, t, (zopt_state_kind)k, b.data(), b.size()));
      out.push_back(std::move(b));
    }
  return out;
}

// Elements that differ between two snapshots of the same layout, and the
// largest difference in units of the last place (f32 or 16-bit as stored).
int64_t diff(const Opt &x, const std::vector<std::vector<unsigned char>> &a,
             const std::vector<std::vector<unsigned char>> &b, int64_t *max_ulp) {
  int64_t n = 0;
  *max_ulp = 0;
  size_t i = 0;
  for (int t = 0; t < T; ++t)
    for (uint32_t s = 0; s < x.d->num_states; ++s, ++i) {
      const size_t es = dsize(x.d->states[s].dtype);
      for (int64_t e = 0; e < snumel(x.d, s, kSizes[t]); ++e) {
        int64_t u = 0, v = 0;
        memcpy(&u, &a[i][(size_t)e * es], es);
        memcpy(&v, &b[i][(size_t)e * es], es);
        if (u == v) continue;
        ++n;
        *max_ulp = std::max<int64_t>(*max_ulp, std::llabs(ordered(u, es) - ordered(v, es)));
      }
    }
  return n;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s cpu|offload|cuda STEP.so TWIN.so\n", argv[0]);
    return 2;
  }
  const std::string backend = argv[1];
  const bool device = backend != "cpu";
  if (backend != "cpu" && backend != "offload" && backend != "cuda") {
    fprintf(stderr, "unknown backend '%s'\n", argv[1]);
    return 2;
  }
  if (device && !load_driver()) {
    printf("UNSUPPORTED: backend %s needs a CUDA driver and a device\n", argv[1]);
    return 77;
  }
  std::mt19937 rng(7);
  std::vector<std::vector<float>> params(T);
  for (int t = 0; t < T; ++t)
    for (int64_t e = 0; e < kSizes[t]; ++e) params[t].push_back(exact(rng));
  Opt a = make(argv[2], device, kAll, params), b = make(argv[3], false, kAll, params);
  const uint32_t flags = a.d->flags;
  const bool clip = flags & ZOPT_FLAG_CLIP, ls = flags & ZOPT_FLAG_LOSS_SCALE, norm = flags & ZOPT_FLAG_SUMSQ;
  // The same gradients into both; `scale` times the exact values, `nan_at`
  // >= 0 puts a NaN into tensor 2.
  auto grads = [&](float scale, int64_t nan_at = -1) {
    for (int t = 0; t < T; ++t) {
      std::vector<float> g;
      for (int64_t e = 0; e < kSizes[t]; ++e) g.push_back(exact(rng) * scale);
      if (t == 2 && nan_at >= 0) g[(size_t)nan_at] = NAN;
      Z(zopt_optimizer_write_state_f32(a.o, t, ZOPT_STATE_GRAD, g.data(), kSizes[t]));
      Z(zopt_optimizer_write_state_f32(b.o, t, ZOPT_STATE_GRAD, g.data(), kSizes[t]));
    }
  };
  // Both optimizers' states the same bits (or, with `ulps`, within that).
  auto same = [&](const std::string &what, int64_t ulps = 0) {
    int64_t mu = 0, n = diff(a, snapshot(a), snapshot(b), &mu);
    check(n == 0 || mu <= ulps, what + ": every state of every tensor " +
                                    (n ? std::to_string(n) + " elements within " + std::to_string(mu) + " ulp of"
                                       : std::string("bit-identical to")) +
                                    " the CPU twin's");
  };
  printf("INFO backend %s, step '%s' (flags %u), twin '%s'\n", argv[1], a.d->name, flags,
         zopt_step_get_descriptor(b.step)->name);
  {
    // Which backend the runtime chose, from what it does: a stream only for
    // a step with something on the GPU, a device result only for a GPU step.
    zopt_step_result r{};
    const zopt_status st_stream = zopt_optimizer_set_stream(a.o, nullptr);
    const zopt_status st_result = zopt_optimizer_gpu_result(a.o, &r);  // before any step: BAD_STATE either way
    const std::string msg = zopt_last_error();
    const bool gpu_step = msg.find("no step has run yet") != std::string::npos;
    check(st_result == ZOPT_ERR_BAD_STATE &&
              (backend == "cpu"       ? st_stream == ZOPT_ERR_BAD_STATE && !gpu_step
               : backend == "offload" ? st_stream == ZOPT_OK && !gpu_step
                                      : st_stream == ZOPT_OK && gpu_step),
          "backend: the optimizer of the step runs on the " + backend + " backend");
  }

  // step, counts
  const float gscale = clip ? 0.01f : 1.0f;  // small: clipping leaves them alone
  for (int k = 0; k < 2; ++k) {
    grads(gscale);
    step(a);
    step(b);
  }
  same("step: 2 steps");
  check(counts(a) == "2 2 2 2 | 2 2" && counts(a) == counts(b), "counts after 2 steps: " + counts(a));

  // read/write: moments written through the API, read back, stepped
  {
    const int mi = state_of(a.d, ZOPT_STATE_EXP_AVG) >= 0 ? ZOPT_STATE_EXP_AVG : ZOPT_STATE_MOMENTUM_BUFFER;
    if (state_of(a.d, (uint32_t)mi) >= 0) {
      std::vector<float> w, r1(kSizes[1]), r2(kSizes[1]);
      for (int64_t e = 0; e < kSizes[1]; ++e) w.push_back(exact(rng) / 8);
      Z(zopt_optimizer_write_state_f32(a.o, 1, (zopt_state_kind)mi, w.data(), kSizes[1]));
      Z(zopt_optimizer_write_state_f32(b.o, 1, (zopt_state_kind)mi, w.data(), kSizes[1]));
      Z(zopt_optimizer_read_state_f32(a.o, 1, (zopt_state_kind)mi, r1.data(), kSizes[1]));
      Z(zopt_optimizer_read_state_f32(b.o, 1, (zopt_state_kind)mi, r2.data(), kSizes[1]));
      // A q8 moment reads back as abi.h's encode then decode of what was
      // written (per block the absmax max |w|), on every backend alike.
      std::vector<float> want = w;
      const bool q8 = a.d->states[state_of(a.d, (uint32_t)mi)].dtype == ZOPT_DTYPE_Q8;
      for (int64_t b0 = 0; q8 && b0 < kSizes[1]; b0 += ZOPT_Q8_BLOCK) {
        const int64_t b1 = std::min<int64_t>(kSizes[1], b0 + ZOPT_Q8_BLOCK);
        float m = 0;
        for (int64_t e = b0; e < b1; ++e) m = std::max(m, std::fabs(w[e]));
        for (int64_t e = b0; e < b1; ++e) want[e] = zopt_q8_decode(zopt_q8_encode(w[e], m, 0), m, 0);
      }
      check(r1 == want && r2 == want, std::string("read/write: a written moment reads back ") +
                                          (q8 ? "as its q8 encode/decode" : "exactly"));
      grads(gscale);
      step(a);
      step(b);
      same("read/write: a step after the written moment");
    } else {
      check(true, "read/write: (no moment in this step)");
    }
  }

  // skip: a NaN gradient
  if (norm) {
    double s0 = 0, s1 = 0;
    int64_t g0 = 0, g1 = 0;
    Z(zopt_optimizer_get_loss_scaler_state(a.o, &s0, &g0));
    const std::string c0 = counts(a);
    auto before = snapshot(a);
    grads(gscale, 17);
    auto with_grads = snapshot(a);  // the grads changed, nothing else may
    step(a);
    step(b);
    Z(zopt_optimizer_get_loss_scaler_state(a.o, &s1, &g1));
    int64_t mu = 0;
    const bool unchanged = diff(a, with_grads, snapshot(a), &mu) == 0;
    (void)before;
    check(a.last.skipped == 1 && b.last.skipped == 1 && unchanged && counts(a) == c0,
          "skip: a NaN gradient skips the step: no state, param or count changes (" + counts(a) + ")");
    if (ls)
      check(s1 == std::max(s0 * 0.5, 1.0) && g1 == 0,
            "skip: the loss scaler backs off: " + std::to_string(s0) + " -> " + std::to_string(s1));
    same("skip: after the skipped step");
  }

  // scaler: growth after growth_interval (2) good steps
  if (ls) {
    double s0 = 0, s1 = 0, t1 = 0;
    int64_t g0 = 0, g1 = 0, h1 = 0;
    Z(zopt_optimizer_get_loss_scaler_state(a.o, &s0, &g0));
    for (int k = 0; k < 2; ++k) {
      grads(gscale);
      step(a);
      step(b);
    }
    Z(zopt_optimizer_get_loss_scaler_state(a.o, &s1, &g1));
    Z(zopt_optimizer_get_loss_scaler_state(b.o, &t1, &h1));
    check(s1 == s0 * 2 && g1 == 0 && t1 == s1 && h1 == g1,
          "scaler: S grows by 2 after 2 good steps: " + std::to_string(s0) + " -> " + std::to_string(s1));
    same("scaler: after the growth");
  }

  // clip: large gradients
  if (clip) {
    grads(64.0f);
    // The norm of the value clipped: the gradient times the gradient scale
    // 1/(S*D), in float64 from the stored grads (ranks: 1, D = 1).
    double S = 1, D = 1;
    if (ls) Z(zopt_optimizer_get_loss_scale(a.o, &S));
    Z(zopt_optimizer_get_grad_divisor(a.o, &D));
    const float gs = zopt_ref::grad_scale(S, D);
    long double sum = 0;
    for (int t = 0; t < T; ++t) {
      std::vector<float> g(kSizes[t]);
      Z(zopt_optimizer_read_state_f32(b.o, t, ZOPT_STATE_GRAD, g.data(), kSizes[t]));
      sum += zopt_ref::sumsq_exact(g.size(), [&](size_t i) { return zopt_ref::norm_value(g[i], gs); });
    }
    step(a);
    step(b);
    const double want = zopt_ref::norm((double)sum);
    check(std::fabs(a.last.grad_norm - want) <= 1e-12 * want && a.last.skipped == 0,
          "clip: the norm " + std::to_string(a.last.grad_norm) + " is the float64 norm of the scaled gradients " +
              std::to_string(want));
    same("clip: the clipped update", backend == "cuda" ? 2 : 0);
    // A max_norm set at run time (zopt_optimizer_set_max_norm; torch's
    // clip_grad_norm_(max_norm)) on both: the step clips by it on every
    // backend (the GPU's kernels read it from the device), then the
    // compiled one again.
    const double m0 = a.d->max_norm, m = 0.125 * a.last.grad_norm;
    Z(zopt_optimizer_set_max_norm(a.o, m));
    Z(zopt_optimizer_set_max_norm(b.o, m));
    double got = 0;
    Z(zopt_optimizer_get_max_norm(a.o, &got));
    grads(64.0f);
    step(a);
    step(b);
    check(got == m && a.last.skipped == 0 && b.last.skipped == 0,
          "clip: max_norm " + std::to_string(m) + " set at run time (the compiled one " + std::to_string(m0) + ")");
    same("clip: the update clipped by the runtime max_norm", backend == "cuda" ? 2 : 0);
    Z(zopt_optimizer_set_max_norm(a.o, m0));
    Z(zopt_optimizer_set_max_norm(b.o, m0));
    grads(64.0f);
    step(a);
    step(b);
    same("clip: the compiled max_norm again", backend == "cuda" ? 2 : 0);
  }

  // active: tensor 1 inactive for 2 steps, then again
  {
    const std::string c0 = counts(a);
    const uint8_t mask[T] = {1, 0, 1, 1};
    Z(zopt_optimizer_set_active(a.o, mask, T));
    Z(zopt_optimizer_set_active(b.o, mask, T));
    std::vector<float> p0(kSizes[1]), p1(kSizes[1]);
    Z(zopt_optimizer_read_state_f32(a.o, 1, ZOPT_STATE_PARAM, p0.data(), kSizes[1]));
    for (int k = 0; k < 2; ++k) {
      grads(gscale);
      step(a);
      step(b);
    }
    Z(zopt_optimizer_read_state_f32(a.o, 1, ZOPT_STATE_PARAM, p1.data(), kSizes[1]));
    int64_t t1 = -1, t0 = -1;
    Z(zopt_optimizer_get_tensor_step(a.o, 1, &t1));
    Z(zopt_optimizer_get_tensor_step(a.o, 0, &t0));
    check(p0 == p1 && counts(a) == counts(b) && t0 == t1 + 2,
          "active: an inactive tensor is left alone and keeps its count (" + c0 + " -> " + counts(a) + ")");
    same("active: 2 steps with tensor 1 inactive");
    Z(zopt_optimizer_set_active(a.o, nullptr, 0));
    Z(zopt_optimizer_set_active(b.o, nullptr, 0));
    grads(gscale);
    step(a);
    step(b);
    same("active: tensor 1 joins again at its own t");
    check(counts(a) == counts(b), "active: counts after it joins: " + counts(a));
  }

  // tensor step: the rule reads the tensor's count
  {
    Z(zopt_optimizer_set_tensor_step(a.o, 3, 40));
    Z(zopt_optimizer_set_tensor_step(b.o, 3, 40));
    grads(gscale);
    step(a);
    step(b);
    int64_t c = -1;
    Z(zopt_optimizer_get_tensor_step(a.o, 3, &c));
    check(c == 41, "tensor step: set to 40, one step: " + std::to_string(c));
    same("tensor step: the step at the set count");
  }

  // rebind: fresh gradient memory every step (a framework's new p.grad
  // tensors read in place: zopt_optimizer_set_grad_memory), tensor 0's
  // param moved too (zopt_optimizer_set_tensor_memory); the twin keeps its
  // memory and is given the same values there. The old buffers keep the
  // previous values: a step that read them would differ.
  {
    const uint32_t pdt = a.d->states[state_of(a.d, ZOPT_STATE_PARAM)].dtype;
    const uint32_t gdt = a.d->states[state_of(a.d, ZOPT_STATE_GRAD)].dtype;
    bool ok = true;
    for (int k = 0; k < 2; ++k) {
      int32_t ids[T];
      void *gs[T];
      for (int t = 0; t < T; ++t) {
        ids[t] = t;
        gs[t] = alloc((size_t)kSizes[t] * dsize(gdt), device);
      }
      ok &= zopt_optimizer_set_grad_memory(a.o, T, ids, gs) == ZOPT_OK;
      if (k == 1) {
        std::vector<float> p(kSizes[0]);
        Z(zopt_optimizer_read_state_f32(a.o, 0, ZOPT_STATE_PARAM, p.data(), kSizes[0]));
        ok &= zopt_optimizer_set_tensor_memory(a.o, 0, alloc((size_t)kSizes[0] * dsize(pdt), device), gs[0]) == ZOPT_OK;
        Z(zopt_optimizer_write_state_f32(a.o, 0, ZOPT_STATE_PARAM, p.data(), kSizes[0]));
      }
      grads(gscale);
      step(a);
      step(b);
    }
    check(ok, std::string("rebind: set_grad_memory / set_tensor_memory after finalize accepted") +
                  (ok ? "" : std::string(": ") + zopt_last_error()));
    same("rebind: 2 steps from fresh gradient memory (and a moved param)");
    check(counts(a) == counts(b), "rebind: counts " + counts(a));
    if (backend == "cuda") {
      // A grad the kernels cannot read is refused naming the tensor, and
      // nothing changes: the next step reads the memory registered before.
      char *bad = (char *)alloc((size_t)kSizes[2] * dsize(gdt) + 8, device) + 1;
      int32_t ids[2] = {1, 2};
      void *gs[2] = {alloc((size_t)kSizes[1] * dsize(gdt), device), bad};
      const zopt_status st = zopt_optimizer_set_grad_memory(a.o, 2, ids, gs);
      const std::string msg = zopt_last_error();
      grads(gscale);
      step(a);
      step(b);
      check(st == ZOPT_ERR_INVALID_ARGUMENT && msg.find("tensor 2") != std::string::npos &&
                msg.find("aligned") != std::string::npos,
            "rebind: a misaligned grad refused naming the tensor: " + msg);
      std::vector<float> host((size_t)kSizes[3]);  // host memory: not the device's
      int32_t id3 = 3;
      void *g3 = host.data();
      const zopt_status st3 = zopt_optimizer_set_grad_memory(a.o, 1, &id3, &g3);
      const std::string msg3 = zopt_last_error();
      check(st3 == ZOPT_ERR_INVALID_ARGUMENT && msg3.find("tensor 3") != std::string::npos &&
                msg3.find("not CUDA device memory") != std::string::npos,
            "rebind: a host grad refused naming the tensor: " + msg3);
      same("rebind: after the refused call, the registered memory");
    }
  }

  release(a);
  release(b);
  free_all();
  printf("%d passed, %d failed\n", zopt_check::passed, zopt_check::failed);
  return zopt_check::failed ? 1 : 0;
}

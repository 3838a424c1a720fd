//===- gpu-host-pipeline.cpp - pipelined offloaded steps on the stand-in ---===//
//
// Bucket readiness (zopt_optimizer_grad_bucket_ready) and speculation: an
// offloaded optimizer whose buckets are marked ready one by one (in a
// random order each step), against the same step run serially (plain
// zopt_optimizer_step) and the all-CPU twin, bit for bit after every step:
// params on the device, every optimizer state, the step results. Steps with
// clipping inactive (commit), clipping active (recompute), a non-finite
// grad (discard); the pipelined side's grads at new device memory each step,
// registered bucket by bucket between the marks (set_grad_memory); two tensors without a gradient, a budget smaller than the model (some buckets updated
// after validation), no speculation at all (budget 0), several param groups
// with different hyperparameters. Then the bad input: out of range, ready
// twice, a step with a bucket missing (named), a budget below one bucket, a
// capturing stream, a call that would change the optimizer mid-step.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <random>

namespace ghc {

namespace {

const char *hyper_name(uint32_t kind) {
  switch (kind) {
    case ZOPT_HYPER_LR: return "lr";
    case ZOPT_HYPER_BETA1: return "beta1";
    case ZOPT_HYPER_BETA2: return "beta2";
    case ZOPT_HYPER_EPS: return "eps";
    case ZOPT_HYPER_WEIGHT_DECAY: return "weight_decay";
  }
  return nullptr;
}

// Group g's value of a hyperparameter: every group different.
double hyper_value(uint32_t kind, int g) {
  switch (kind) {
    case ZOPT_HYPER_LR: return 1e-3 * (g + 1);
    case ZOPT_HYPER_BETA1: return 0.9 - 0.05 * g;
    case ZOPT_HYPER_BETA2: return 0.999 - 0.004 * g;
    case ZOPT_HYPER_EPS: return 1e-8 * std::pow(10.0, g);
    case ZOPT_HYPER_WEIGHT_DECAY: return 0.01 * g;
  }
  return 0;
}

}  // namespace

void pipeline_check(Fake &f, zopt_step *step, const char *twin_path) {
  zopt_step *twin = nullptr;
  Z(zopt_step_load(twin_path, &twin));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  int pi = -1, gi = -1;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pi = (int)i;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gi = (int)i;
  }
  const uint32_t pdt = d->states[pi].dtype, gdt = d->states[gi].dtype;
  const size_t ep = dtype_size(pdt), eg = dtype_size(gdt);
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097, 70001, 3000, 20000, 513};
  const size_t T = sizes.size();
  const int G = 3;
  // Three optimizers: pipelined (P), serial offloaded (S), the CPU twin (C).
  Side P, S, C;
  Z(zopt_optimizer_create(step, &P.o));
  Z(zopt_optimizer_create(step, &S.o));
  Z(zopt_optimizer_create(twin, &C.o));
  for (Side *x : {&P, &S, &C}) {
    Z(zopt_optimizer_set_bucket_elems(x->o, 16384));  // several buckets; tensors span them
    for (int g = 0; g < G; ++g) {
      int id = 0;
      Z(zopt_optimizer_add_group(x->o, &id));
      for (uint32_t h = 0; h < d->num_hypers; ++h)
        if (const char *n = hyper_name(d->hypers[h].kind))
          Z(zopt_optimizer_set_hyper(x->o, id, n, hyper_value(d->hypers[h].kind, g)));
    }
  }
  unsigned rng = 4242;
  auto rnd = [&]() { return lcg(rng); };
  add_twin_tensors(f, {&P, &S}, C, sizes, G, pdt, gdt, lcg_values(sizes, rng));
  configure_scalers(ls, {P.o, S.o, C.o});
  for (Side *x : {&P, &S, &C}) Z(zopt_optimizer_finalize(x->o));
  void *const stream = (void *)0x0FF1;
  Z(zopt_optimizer_set_stream(P.o, stream));
  Z(zopt_optimizer_set_stream(S.o, stream));
  int nb = 0;
  Z(zopt_optimizer_num_buckets(P.o, &nb));
  check(nb >= 4, "pipeline: the offloaded step has " + std::to_string(nb) + " buckets (zopt_optimizer_num_buckets)");
  // Every state the update writes: what one bucket's speculation costs,
  // per param (a q8 absmax: 4 bytes per block of ZOPT_Q8_BLOCK).
  double bytes_per_elem = 0;
  for (uint32_t s = 0; s < d->num_states; ++s)
    if (d->states[s].access & ZOPT_ACCESS_WRITE) bytes_per_elem += state_bytes(d, s, ZOPT_Q8_BLOCK) / double(ZOPT_Q8_BLOCK);

  std::mt19937 order_rng(7);
  struct Plan {
    const char *what;
    float grad_scale;  // of the grads (times the loss scale)
    bool inf;
    int64_t budget;  // -1: every bucket, else bytes
    int want;        // outcome
    bool inactive = false;  // tensors 2 and 6 without a gradient (set_active)
  };
  // Without clipping the rows never change: every speculation commits.
  const int RECOMP = (d->flags & ZOPT_FLAG_CLIP) ? ZOPT_SPEC_RECOMPUTE : ZOPT_SPEC_COMMIT;
  const int DISC = has_sumsq ? ZOPT_SPEC_DISCARD : ZOPT_SPEC_COMMIT;
  const std::vector<Plan> plans = {
      {"clipping inactive", 1e-4f, false, -1, ZOPT_SPEC_COMMIT},
      {"clipping active", 0.5f, false, -1, RECOMP},
      {"a non-finite grad", 1e-4f, true, -1, DISC},
      {"clipping inactive again", 1e-4f, false, -1, ZOPT_SPEC_COMMIT},
      {"tensors 2 and 6 without a gradient", 1e-4f, false, -1, ZOPT_SPEC_COMMIT, true},
      {"a budget of two buckets, clipping inactive", 1e-4f, false, (int64_t)(2 * 16384 * bytes_per_elem) + 4096,
       ZOPT_SPEC_COMMIT},
      {"a budget of two buckets, clipping active", 0.5f, false, (int64_t)(2 * 16384 * bytes_per_elem) + 4096, RECOMP},
      {"no speculation (budget 0), clipping active", 0.5f, false, 0, ZOPT_SPEC_COMMIT},
      {"every bucket again, clipping inactive", 1e-4f, false, -1, ZOPT_SPEC_COMMIT},
  };
  int k = 0;
  for (const Plan &pl : plans) {
    ++k;
    const std::string tag = "pipeline step " + std::to_string(k) + " (" + pl.what + ")";
    double scale = 1;
    if (ls) Z(zopt_optimizer_get_loss_scale(C.o, &scale));
    // The pipelined side's grads at new addresses each step (as a
    // binding's backward after zero_grad(set_to_none=True)): registered
    // bucket by bucket just before each mark (zopt_optimizer_set_grad_memory
    // between marks), the old ones freed after the step.
    const std::vector<unsigned long long> old_dg = P.dg;
    for (size_t t = 0; t < T; ++t) f.mem_alloc(&P.dg[t], sizes[t] * eg);
    for (size_t t = 0; t < T; ++t) {
      std::vector<float> v(sizes[t]);
      for (auto &x : v) x = rnd() * pl.grad_scale * (float)scale;
      if (pl.inf && t == 5) v[sizes[t] / 3] = INFINITY;
      Z(zopt_optimizer_write_state_f32(C.o, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
      memcpy((void *)(uintptr_t)P.dg[t], C.hg[t].data(), C.hg[t].size());
      memcpy((void *)(uintptr_t)S.dg[t], C.hg[t].data(), C.hg[t].size());
    }
    Z(zopt_optimizer_set_speculation_budget(P.o, pl.budget < 0 ? UINT64_MAX : (uint64_t)pl.budget));
    std::vector<uint8_t> act(T, 1);
    act[2] = act[6] = pl.inactive ? 0 : 1;
    for (Side *x : {&P, &S, &C}) Z(zopt_optimizer_set_active(x->o, act.data(), (int64_t)T));
    std::vector<int> order(nb);
    for (int b = 0; b < nb; ++b) order[b] = b;
    std::shuffle(order.begin(), order.end(), order_rng);
    std::vector<uint8_t> moved(T, 0);
    for (int b : order) {
      int ids[64], cnt = 0;
      Z(zopt_optimizer_bucket_tensors(P.o, b, ids, 64, &cnt));
      std::vector<int32_t> ts;
      std::vector<void *> gs;
      for (int i = 0; i < cnt; ++i)
        if (!moved[ids[i]]) {
          moved[ids[i]] = 1;
          ts.push_back(ids[i]);
          gs.push_back((void *)(uintptr_t)P.dg[ids[i]]);
        }
      Z(zopt_optimizer_set_grad_memory(P.o, (int64_t)ts.size(), ts.data(), gs.data()));
      Z(zopt_optimizer_grad_bucket_ready(P.o, b));
      if (k == 1 && b == order[0]) {
        // A tensor of a marked bucket keeps its gradient memory until the
        // step (its copy was queued from it): refused, nothing changed.
        void *other = (void *)(uintptr_t)old_dg[ids[0]];
        const int32_t id = ids[0];
        zopt_status st = zopt_optimizer_set_grad_memory(P.o, 1, &id, &other);
        std::string msg = zopt_last_error();
        check(st == ZOPT_ERR_BAD_STATE && msg.find("already marked ready") != std::string::npos,
              "pipeline: moving the grads of a tensor in a marked bucket is refused: " + msg);
      }
    }
    bool all_moved = true;
    for (size_t t = 0; t < T; ++t) all_moved &= moved[t] == 1;
    if (k == 1) check(all_moved, "pipeline: every tensor's grads registered at new memory bucket by bucket");
    zopt_step_result rp{}, rs{}, rc{};
    Z(zopt_optimizer_step(P.o, &rp));
    for (size_t t = 0; t < T; ++t) f.mem_free(old_dg[t]);
    Z(zopt_optimizer_step(S.o, &rs));
    Z(zopt_optimizer_step(C.o, &rc));
    auto same_result = [](const zopt_step_result &a, const zopt_step_result &b) {
      return a.skipped == b.skipped && a.loss_scale == b.loss_scale &&
             ((std::isnan(a.grad_norm) && std::isnan(b.grad_norm)) || a.grad_norm == b.grad_norm);
    };
    char buf[160];
    snprintf(buf, sizeof buf, ": norm %.17g, skipped %d, scale %g", rp.grad_norm, rp.skipped, rp.loss_scale);
    check(same_result(rp, rs) && same_result(rp, rc), tag + ": result = serial step's = CPU twin's" + buf);
    zopt_pipeline_stats ps{};
    ps.size = sizeof ps;
    Z(zopt_optimizer_get_pipeline_stats(P.o, &ps));
    // A budget of two full buckets holds two or more (smaller ones: a
    // group's last), never every one; the arena fills in readiness order.
    const bool spec_ok = pl.budget < 0 ? ps.speculated == nb
                         : pl.budget == 0 ? ps.speculated == 0
                                          : ps.speculated >= 2 && ps.speculated < nb;
    snprintf(buf, sizeof buf, ": outcome %d (want %d), %d of %d speculated, %d committed, %d recomputed, %d after",
             ps.outcome, pl.want, ps.speculated, ps.buckets, ps.committed, ps.recomputed, ps.late);
    const bool skipped = ps.outcome == ZOPT_SPEC_DISCARD;
    check(ps.outcome == pl.want && ps.buckets == nb && spec_ok && ps.steps == k &&
              (skipped || ps.committed + ps.recomputed + ps.late == nb) &&
              (skipped || ps.late == nb - ps.speculated),
          tag + ": " + buf);
    f.drain_all();  // the params come back asynchronously
    bool params = true;
    for (size_t t = 0; t < T; ++t)
      params &= memcmp((void *)(uintptr_t)P.dp[t], C.hp[t].data(), C.hp[t].size()) == 0 &&
                memcmp((void *)(uintptr_t)S.dp[t], C.hp[t].data(), C.hp[t].size()) == 0;
    check(params, tag + ": params on the GPU bit-identical to the serial step's and the CPU twin's");
    const bool states = states_identical(d, sizes, P.o, S.o, C.o, false);
    check(states, tag + ": every optimizer state bit-identical to the serial step's and the CPU twin's");
  }
  {
    // The speculation buffers (a budget of every bucket: shadows of the
    // written states) are the pipelined optimizer's host bytes beyond the
    // serial one's.
    zopt_memory_info mp{}, ms{};
    Z(zopt_optimizer_memory_info(P.o, &mp));
    Z(zopt_optimizer_memory_info(S.o, &ms));
    uint64_t n = 0;
    for (int64_t x : sizes) n += (uint64_t)x;
    const uint64_t extra = mp.bytes_cpu - ms.bytes_cpu, want = (uint64_t)(n * bytes_per_elem);
    check(extra >= want && extra < want + want / 4 + 65536,
          "pipeline: memory_info counts the speculation buffers (" + std::to_string(extra) + " bytes for " +
              std::to_string(bytes_per_elem).substr(0, 5) + " B/param of written states)");
  }
  int64_t cp = 0, cc = 0;
  Z(zopt_optimizer_get_step_count(P.o, 0, &cp));
  Z(zopt_optimizer_get_step_count(C.o, 0, &cc));
  check(cp == cc, "pipeline: step counts " + std::to_string(cp) + " = the CPU twin's (the discarded step not counted)");

  // ---- bad input: an error, the state unchanged ----------------------------
  auto refused = [&](zopt_status st, zopt_status want, const char *needle, const std::string &what) {
    std::string msg = zopt_last_error();
    check(st == want && msg.find(needle) != std::string::npos, "pipeline: " + what + ": " + msg);
  };
  refused(zopt_optimizer_grad_bucket_ready(P.o, nb), ZOPT_ERR_INVALID_ARGUMENT, "out of range",
          "a bucket index out of range is refused");
  refused(zopt_optimizer_grad_bucket_ready(P.o, -1), ZOPT_ERR_INVALID_ARGUMENT, "out of range",
          "a negative bucket index is refused");
  refused(zopt_optimizer_set_speculation_budget(P.o, 1000), ZOPT_ERR_INVALID_ARGUMENT, "smaller than one bucket",
          "a budget smaller than one bucket is refused");
  void *cs = nullptr;  // the optimizer's stream from here on
  f.stream_create(&cs, 0);
  Z(zopt_optimizer_set_stream(P.o, cs));
  {
    void *graph = nullptr;
    f.begin_capture(cs, 0);
    zopt_status st = zopt_optimizer_grad_bucket_ready(P.o, 0);
    std::string msg = zopt_last_error();
    int ec = f.end_capture(cs, &graph);
    check(st == ZOPT_ERR_UNSUPPORTED && msg.find("cannot be captured in a CUDA graph") != std::string::npos && ec == 0,
          "pipeline: a bucket marked ready while the stream captures a CUDA graph is refused: " + msg);
  }
  // One more step: bucket 1 twice, a step with buckets missing, a call that
  // changes the optimizer in between, a step on a capturing stream; then the rest marked, and the step
  // still bit-identical to the serial one.
  for (size_t t = 0; t < T; ++t) {
    std::vector<float> v(sizes[t]);
    for (auto &x : v) x = rnd() * 1e-4f;
    Z(zopt_optimizer_write_state_f32(C.o, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
    memcpy((void *)(uintptr_t)P.dg[t], C.hg[t].data(), C.hg[t].size());
    memcpy((void *)(uintptr_t)S.dg[t], C.hg[t].data(), C.hg[t].size());
  }
  Z(zopt_optimizer_grad_bucket_ready(P.o, 1));
  refused(zopt_optimizer_grad_bucket_ready(P.o, 1), ZOPT_ERR_BAD_STATE, "already marked ready",
          "a bucket marked ready twice is refused");
  Z(zopt_optimizer_grad_bucket_ready(P.o, 3));
  {
    // Between the marks the mask may drop a tensor (the bucket jobs are
    // waited for first; the norm partials are computed again without it),
    // not take one back: tensor 4 dropped on both sides.
    std::vector<uint8_t> act(T, 1);
    act[4] = 0;
    Z(zopt_optimizer_set_active(P.o, act.data(), (int64_t)T));
    Z(zopt_optimizer_set_active(S.o, act.data(), (int64_t)T));
    act[4] = 1;
    refused(zopt_optimizer_set_active(P.o, act.data(), (int64_t)T), ZOPT_ERR_BAD_STATE, "may only drop",
            "a tensor made active between the marks is refused");
  }
  refused(zopt_optimizer_set_hyper(P.o, 0, "lr", 0.5), ZOPT_ERR_BAD_STATE, "marked ready",
          "a hyperparameter change between the first mark and the step is refused");
  {
    zopt_status st = zopt_optimizer_step(P.o, nullptr);
    std::string msg = zopt_last_error();
    check(st == ZOPT_ERR_BAD_STATE && msg.find("bucket 0, 2") != std::string::npos,
          "pipeline: a step with buckets not marked ready is refused, naming them: " + msg);
  }
  for (int b = 0; b < nb; ++b)
    if (b != 1 && b != 3) Z(zopt_optimizer_grad_bucket_ready(P.o, b));
  {
    // The optimizer's stream (cs, set above) starts capturing: the step is
    // refused, its buckets stay marked, and it runs after the capture.
    void *graph = nullptr;
    f.begin_capture(cs, 0);
    zopt_status st = zopt_optimizer_step(P.o, nullptr);
    std::string msg = zopt_last_error();
    int ec = f.end_capture(cs, &graph);
    check(st == ZOPT_ERR_UNSUPPORTED && msg.find("cannot be captured in a CUDA graph") != std::string::npos && ec == 0,
          "pipeline: a pipelined step on a capturing stream is refused, saying why: " + msg);
  }
  zopt_step_result rp{}, rs{};
  Z(zopt_optimizer_step(P.o, &rp));
  Z(zopt_optimizer_step(S.o, &rs));
  f.drain_all();
  bool same = rp.grad_norm == rs.grad_norm && rp.skipped == rs.skipped;
  for (size_t t = 0; t < T; ++t)
    same &= memcmp((void *)(uintptr_t)P.dp[t], (void *)(uintptr_t)S.dp[t], sizes[t] * ep) == 0;
  for (size_t t = 0; t < T && same; ++t)
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      size_t b = state_bytes(d, s, sizes[t]);
      std::vector<unsigned char> x(b), y(b);
      Z(zopt_optimizer_read_state_raw(P.o, (int)t, (zopt_state_kind)kind, x.data(), b));
      Z(zopt_optimizer_read_state_raw(S.o, (int)t, (zopt_state_kind)kind, y.data(), b));
      same &= x == y;
    }
  check(same, "pipeline: after the refusals the step is bit-identical to the serial one (nothing changed)");
  // A plain step after a pipelined one: serial, the same bits.
  Z(zopt_optimizer_step(P.o, &rp));
  Z(zopt_optimizer_step(S.o, &rs));
  f.drain_all();
  same = rp.grad_norm == rs.grad_norm;
  for (size_t t = 0; t < T; ++t)
    same &= memcmp((void *)(uintptr_t)P.dp[t], (void *)(uintptr_t)S.dp[t], sizes[t] * ep) == 0;
  check(same, "pipeline: a plain step after pipelined ones runs serially, bit-identical");
  for (Side *x : {&P, &S, &C}) zopt_optimizer_free(x->o);
  for (Side *x : {&P, &S})
    for (size_t t = 0; t < T; ++t) {
      f.mem_free(x->dp[t]);
      f.mem_free(x->dg[t]);
    }
  zopt_step_free(twin);
}

}  // namespace ghc

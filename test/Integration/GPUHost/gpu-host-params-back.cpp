//===- gpu-host-params-back.cpp - params back early, on the stand-in -------===//
//
// zopt-gpu-host-check FAKE.so OFFLOAD_STEP.so CPU_TWIN.so --params-back
// (docs/GPU.md "Params back early"): an offloaded optimizer at 1 rank in
// per-bucket mode (E: zopt_optimizer_set_param_wait(PER_BUCKET)), the same
// step in the default mode (S) and the all-CPU twin (C), stepped together,
// serially and pipelined (buckets marked in a random order):
//   - E's param copies go on a stream that is not the optimizer's, bucket
//     by bucket in forward order (the last bucket first), each param once;
//   - after zopt_optimizer_wait_params of every bucket, work on the
//     caller's stream sees every new param; in the default mode, work on
//     the optimizer's stream does (no drain of the stand-in's queues);
//   - with one copy of bucket 0 held (fake_cuda_hold_htod): after
//     wait_params(nb-1, s) work on s sees bucket nb-1's new params while
//     bucket 0's copy has not run; E's own stream is not ordered after it;
//     work on s after wait_params(0, s) waits for it; in the default mode
//     the optimizer's stream waits for it; in per-bucket mode the runtime's
//     own next access (read_state of that param) waits for it;
//   - zopt_pipeline_stats.copies_in_flight: every bucket's copies from the
//     GPU queued behind the caller's work at the last mark are counted; a
//     caller of the older, smaller struct gets only the fields it knows;
//   - every state, param and result bit-identical among E, S and C;
//   - bad input: a bucket out of range, a mode out of range, the mode
//     changed between a first mark and the step (BAD_STATE, unchanged),
//     a step that is not offloaded, wait_params before finalize.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <atomic>
#include <cstddef>
#include <functional>
#include <random>
#include <thread>

namespace ghc {

namespace {

bool ready_within(Fake &f, void *s, int ms) {
  for (int i = 0; i < ms; ++i) {
    if (f.stream_query(s) == 0) return true;
    usleep(1000);
  }
  return f.stream_query(s) == 0;
}

}  // namespace

void params_back_check(Fake &f, zopt_step *step, const char *twin_path) {
  zopt_step *twin = nullptr;
  Z(zopt_step_load(twin_path, &twin));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  const StepInfo si = info_of(step);
  const uint32_t pdt = si.pdt, gdt = si.gdt;
  const size_t ep = si.ep;
  // One group: flat order is the reverse add order, bucket nb-1 holds the
  // first-added tensors (what a forward needs first).
  const std::vector<int64_t> sizes = {3000, 20000, 513, 7, 40000, 1000, 9000};
  const size_t T = sizes.size();
  Side E, S, C;
  Z(zopt_optimizer_create(step, &E.o));
  Z(zopt_optimizer_create(step, &S.o));
  Z(zopt_optimizer_create(twin, &C.o));
  unsigned rng = 777;
  auto rnd = [&]() { return lcg(rng); };
  for (Side *x : {&E, &S, &C}) Z(zopt_optimizer_set_bucket_elems(x->o, 16384));
  add_groups({E.o, S.o, C.o}, {1e-2});
  add_twin_tensors(f, {&E, &S}, C, sizes, 1, pdt, gdt, lcg_values(sizes, rng));
  configure_scalers(ls, {E.o, S.o, C.o});
  {
    // wait_params before finalize: the buckets are not known yet.
    zopt_status st = zopt_optimizer_wait_params(E.o, 0, nullptr);
    std::string msg = zopt_last_error();
    check(st == ZOPT_ERR_BAD_STATE && msg.find("finalize") != std::string::npos,
          "params back: wait_params before finalize is refused: " + msg);
  }
  Z(zopt_optimizer_set_param_wait(E.o, ZOPT_PARAM_WAIT_PER_BUCKET));
  for (Side *x : {&E, &S, &C}) Z(zopt_optimizer_finalize(x->o));
  for (Side *x : {&E, &S}) {
    f.stream_create(&x->stream, 0);
    Z(zopt_optimizer_set_stream(x->o, x->stream));
  }
  void *us = nullptr;  // the caller's stream (its forward)
  f.stream_create(&us, 0);
  const BucketMap bm = bucket_map(E.o, T);
  const int nb = bm.nb, held = bm.held;
  const std::vector<int> &only_last = bm.only_last;
  check(nb >= 3 && !only_last.empty() && held >= 0,
        "params back: " + std::to_string(nb) + " buckets, " + std::to_string(only_last.size()) +
            " tensors in the last bucket alone, tensor " + std::to_string(held) + " in bucket 0 alone");
  if (held < 0 || only_last.empty()) return;
  int mode = -1;
  Z(zopt_optimizer_get_param_wait(E.o, &mode));
  check(mode == ZOPT_PARAM_WAIT_PER_BUCKET, "params back: get_param_wait says per bucket");

  // A pinned host buffer per tensor (copies from the device queue on the
  // stream's worker, as a real DMA).
  std::vector<void *> pin(T);
  for (size_t t = 0; t < T; ++t) f.mem_host_alloc(&pin[t], sizes[t] * ep, 0);
  auto to_host = [&](const Side &x, int t, void *s) {
    memset(pin[t], 0x5A, sizes[t] * ep);
    f.memcpy_dtoh_async(pin[t], x.dp[t], sizes[t] * ep, s);
  };
  auto host_is_twin = [&](int t) { return memcmp(pin[t], C.hp[t].data(), C.hp[t].size()) == 0; };
  auto set_grads = [&](float scale) {
    for (size_t t = 0; t < T; ++t) {
      std::vector<float> v(sizes[t]);
      for (auto &x : v) x = rnd() * scale;
      Z(zopt_optimizer_write_state_f32(C.o, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
      memcpy((void *)(uintptr_t)E.dg[t], C.hg[t].data(), C.hg[t].size());
      memcpy((void *)(uintptr_t)S.dg[t], C.hg[t].data(), C.hg[t].size());
    }
  };
  // E's param copies issued since log entry h0: on one stream that is not
  // E's, every param once, in non-increasing bucket order.
  auto forward_order = [&](int h0, const std::string &tag) {
    int cur = nb, n = 0;
    bool ok = true;
    void *cs = nullptr;
    size_t bytes = 0;
    for (int i = h0; i < f.num_htod(); ++i) {
      unsigned long long dst = 0;
      size_t len = 0;
      void *s = nullptr;
      f.htod(i, &dst, &len, &s);
      int t = -1;
      for (size_t k = 0; k < T; ++k)
        if (dst >= E.dp[k] && dst < E.dp[k] + sizes[k] * ep) t = (int)k;
      if (t < 0) continue;
      ++n;
      bytes += len;
      if (!cs) cs = s;
      ok &= s == cs && s != E.stream;
      int pick = -1;
      for (int b : bm.buckets_of[t])
        if (b <= cur) pick = std::max(pick, b);
      ok &= pick >= 0;
      if (pick >= 0) cur = pick;
    }
    size_t want = 0;
    for (int64_t x : sizes) want += (size_t)x * ep;
    check(ok && bytes == want && cur == 0,
          "params back: " + tag + ": " + std::to_string(n) +
              " copies on the optimizer's copy stream, bucket " + std::to_string(nb - 1) +
              " first, bucket 0 last, every param once");
  };
  auto same_states = [&](const std::string &tag) {
    bool same = states_identical(d, sizes, E.o, S.o, C.o);
    check(same, "params back: " + tag + ": every state and param bit-identical among per-bucket, default, CPU twin");
  };
  auto step_all = [&](bool pipelined, const std::string &tag, const std::function<void()> &before_step = {}) {
    if (pipelined) {
      std::vector<int> order(nb);
      for (int b = 0; b < nb; ++b) order[b] = b;
      std::shuffle(order.begin(), order.end(), std::mt19937(nb));
      for (int b : order) Z(zopt_optimizer_grad_bucket_ready(E.o, b));
    }
    if (before_step) before_step();
    zopt_step_result re{}, rs{}, rc{};
    Z(zopt_optimizer_step(E.o, &re));
    Z(zopt_optimizer_step(S.o, &rs));
    Z(zopt_optimizer_step(C.o, &rc));
    check(re.grad_norm == rs.grad_norm && re.grad_norm == rc.grad_norm && re.skipped == rc.skipped &&
              rs.skipped == rc.skipped,
          "params back: " + tag + ": results equal");
  };

  // ---- steps 1, 2: serial, then pipelined; every bucket waited for ------------
  for (int k = 1; k <= 2; ++k) {
    const bool pipelined = k == 2;
    const std::string tag = std::string(pipelined ? "pipelined" : "serial") + " step";
    set_grads(k == 1 ? 1e-3f : 0.5f);  // clipping inactive, then active
    const int h0 = f.num_htod();
    // Pipelined: work the caller enqueued on E's stream after the marks and
    // before the step (a kernel reading a param of bucket nb-1, 100 ms on
    // the stream's worker) reads the old param: the copies back wait for it.
    struct Reader {
      const void *src;
      std::vector<unsigned char> seen;
    } reader{(const void *)(uintptr_t)E.dp[only_last[0]], {}};
    const std::vector<unsigned char> before((const unsigned char *)reader.src,
                                            (const unsigned char *)reader.src + sizes[only_last[0]] * ep);
    reader.seen.resize(before.size());
    step_all(pipelined, tag, [&] {
      if (pipelined)
        f.stream_enqueue(
            E.stream,
            [](void *a) {
              Reader *r = (Reader *)a;
              usleep(100000);
              memcpy(r->seen.data(), r->src, r->seen.size());
            },
            &reader);
    });
    if (pipelined) {
      const bool done = ready_within(f, E.stream, 5000);
      check(done && reader.seen == before && before != C.hp[only_last[0]],
            "params back: " + tag + ": the caller's work enqueued on the optimizer's stream before the step "
                                    "reads the old params (the copies back wait for it)");
    }
    forward_order(h0, tag);
    for (int b = 0; b < nb; ++b) Z(zopt_optimizer_wait_params(E.o, b, us));
    for (size_t t = 0; t < T; ++t) to_host(E, (int)t, us);
    bool ok = ready_within(f, us, 5000);
    for (size_t t = 0; t < T; ++t) ok &= host_is_twin((int)t);
    check(ok, "params back: " + tag + ": after wait_params of every bucket, work on the caller's stream sees "
                                      "every new param (per-bucket mode)");
    for (size_t t = 0; t < T; ++t) to_host(S, (int)t, S.stream);
    ok = ready_within(f, S.stream, 5000);
    for (size_t t = 0; t < T; ++t) ok &= host_is_twin((int)t);
    check(ok, "params back: " + tag + ": default mode: work on the optimizer's stream after the step sees every "
                                      "new param");
    same_states(tag);
  }

  // ---- step 3: bucket 0's copy held, per-bucket mode --------------------------
  {
    set_grads(1e-3f);
    const std::vector<unsigned char> old((unsigned char *)(uintptr_t)E.dp[held],
                                         (unsigned char *)(uintptr_t)E.dp[held] + sizes[held] * ep);
    f.hold_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    step_all(false, "held step");
    Z(zopt_optimizer_wait_params(E.o, nb - 1, us));
    for (int t : only_last) to_host(E, t, us);
    bool ok = ready_within(f, us, 5000);
    for (int t : only_last) ok &= host_is_twin(t);
    const bool still_old = memcmp((void *)(uintptr_t)E.dp[held], old.data(), old.size()) == 0 &&
                           memcmp(old.data(), C.hp[held].data(), old.size()) != 0;
    check(ok && still_old, "params back: after wait_params(" + std::to_string(nb - 1) +
                               ", s), work on s sees that bucket's new params while bucket 0's copy is held");
    to_host(E, held, E.stream);
    ok = ready_within(f, E.stream, 5000) && memcmp(pin[held], old.data(), old.size()) == 0;
    check(ok, "params back: per-bucket mode: the optimizer's stream is not ordered after the copies (it reads "
              "the old param of the held bucket)");
    Z(zopt_optimizer_wait_params(E.o, 0, us));
    to_host(E, held, us);
    usleep(50000);
    const bool waited = f.stream_query(us) != 0;
    f.release_htod();
    ok = ready_within(f, us, 5000) && host_is_twin(held);
    check(waited && ok, "params back: work on s after wait_params(0, s) waits for bucket 0's held copy, then "
                        "sees its new params");
    same_states("held step");
  }
  // ---- step 4: the default mode orders the optimizer's stream after it -------
  {
    set_grads(1e-3f);
    f.hold_htod(S.dp[held], S.dp[held] + sizes[held] * ep);
    step_all(true, "default held step");
    to_host(S, held, S.stream);
    usleep(50000);
    const bool waited = f.stream_query(S.stream) != 0;
    f.release_htod();
    const bool ok = ready_within(f, S.stream, 5000) && host_is_twin(held);
    check(waited && ok, "params back: default mode: the optimizer's stream after the step waits for bucket 0's "
                        "held copy, then sees its new params");
  }
  // ---- step 5: per-bucket mode, the runtime's own next access waits -----------
  {
    set_grads(1e-3f);
    f.hold_htod(E.dp[held], E.dp[held] + sizes[held] * ep);
    step_all(false, "read after held step");
    std::thread releaser([&f] {
      usleep(100000);
      f.release_htod();
    });
    std::vector<float> a(sizes[held]), b(sizes[held]);
    Z(zopt_optimizer_read_state_f32(E.o, held, ZOPT_STATE_PARAM, a.data(), sizes[held]));
    Z(zopt_optimizer_read_state_f32(C.o, held, ZOPT_STATE_PARAM, b.data(), sizes[held]));
    releaser.join();
    check(a == b, "params back: per-bucket mode: read_state of a param whose copy is held waits for it (the "
                  "runtime's own work waits for every copy)");
    same_states("read after held step");
  }

  // ---- copies in flight at the end of backward (zopt_pipeline_stats) -----------
  // The caller's work on E's stream holds it while every bucket is marked:
  // each bucket's copies from the GPU queue behind it, so at the last mark
  // all nb are in flight; a pipelined step without such work: none waits
  // behind anything, so the count is at most nb (the stand-in's inline or
  // queued copies), and the serial step reports no pipelined figures.
  {
    set_grads(1e-3f);
    std::atomic<bool> go{false};
    f.stream_enqueue(
        E.stream,
        [](void *a) {
          auto *g = (std::atomic<bool> *)a;
          while (!g->load()) usleep(1000);
        },
        &go);
    for (int b = 0; b < nb; ++b) Z(zopt_optimizer_grad_bucket_ready(E.o, b));
    go = true;
    zopt_step_result re{}, rs{}, rc{};
    Z(zopt_optimizer_step(E.o, &re));
    Z(zopt_optimizer_step(S.o, &rs));
    Z(zopt_optimizer_step(C.o, &rc));
    zopt_pipeline_stats ps{};
    ps.size = sizeof ps;
    Z(zopt_optimizer_get_pipeline_stats(E.o, &ps));
    check(ps.copies_in_flight == nb && ps.buckets == nb,
          "params back: pipeline stats: the " + std::to_string(nb) +
              " buckets' copies from the GPU queued behind the caller's work were in flight at the last mark "
              "(copies_in_flight " + std::to_string(ps.copies_in_flight) + ")");
    zopt_pipeline_stats old{};
    old.size = offsetof(zopt_pipeline_stats, copies_in_flight);  // a caller of the older, smaller struct
    old.copies_in_flight = -7;
    Z(zopt_optimizer_get_pipeline_stats(E.o, &old));
    check(old.copies_in_flight == -7 && old.buckets == nb && old.size == offsetof(zopt_pipeline_stats, copies_in_flight),
          "params back: pipeline stats: a caller of the older struct gets the fields it knows, nothing after");
    same_states("copies in flight");
  }

  // ---- bad input ----------------------------------------------------------------
  auto refused = [&](zopt_status st, zopt_status want, const char *needle, const std::string &what) {
    std::string msg = zopt_last_error();
    check(st == want && msg.find(needle) != std::string::npos, "params back: " + what + ": " + msg);
  };
  refused(zopt_optimizer_wait_params(E.o, nb, us), ZOPT_ERR_INVALID_ARGUMENT, "out of range",
          "wait_params of a bucket out of range is refused");
  refused(zopt_optimizer_wait_params(E.o, -1, us), ZOPT_ERR_INVALID_ARGUMENT, "out of range",
          "wait_params of a negative bucket is refused");
  refused(zopt_optimizer_set_param_wait(E.o, 2), ZOPT_ERR_INVALID_ARGUMENT, "mode 2",
          "a wait mode out of range is refused");
  refused(zopt_optimizer_set_param_wait(C.o, ZOPT_PARAM_WAIT_PER_BUCKET), ZOPT_ERR_UNSUPPORTED, "not offloaded",
          "set_param_wait of a step that is not offloaded is refused");
  refused(zopt_optimizer_wait_params(C.o, 0, nullptr), ZOPT_ERR_UNSUPPORTED, "not offloaded",
          "wait_params of a step that is not offloaded is refused");
  set_grads(1e-3f);
  Z(zopt_optimizer_grad_bucket_ready(E.o, 0));
  refused(zopt_optimizer_set_param_wait(E.o, ZOPT_PARAM_WAIT_ALL), ZOPT_ERR_BAD_STATE, "marked ready",
          "the wait mode changed between a first mark and the step is refused");
  Z(zopt_optimizer_get_param_wait(E.o, &mode));
  check(mode == ZOPT_PARAM_WAIT_PER_BUCKET, "params back: the refused change left the mode per bucket");
  for (int b = 1; b < nb; ++b) Z(zopt_optimizer_grad_bucket_ready(E.o, b));
  step_all(false, "after the refusals");
  for (int b = 0; b < nb; ++b) Z(zopt_optimizer_wait_params(E.o, b, nullptr));  // NULL: E's stream
  for (size_t t = 0; t < T; ++t) to_host(E, (int)t, E.stream);
  bool ok = ready_within(f, E.stream, 5000);
  for (size_t t = 0; t < T; ++t) ok &= host_is_twin((int)t);
  check(ok, "params back: after the refusals: wait_params(b, NULL) orders the optimizer's stream; every new "
            "param");
  same_states("after the refusals");
  f.drain_all();
  for (Side *x : {&E, &S, &C}) zopt_optimizer_free(x->o);
  for (Side *x : {&E, &S})
    for (size_t t = 0; t < T; ++t) {
      f.mem_free(x->dp[t]);
      f.mem_free(x->dg[t]);
    }
  for (void *p : pin) f.mem_free_host(p);
  zopt_step_free(twin);
}

}  // namespace ghc

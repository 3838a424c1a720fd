//===- gpu-host-offload.cpp - offloaded steps on the stand-in ------------===//
//
// An offloaded step (params/grads on the stand-in's "device", states and
// kernels on the CPU) against its CPU twin, bit for bit, with its copies
// counted; at one rank and at W ranks (loopback threads).
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

namespace ghc {

int offload_check(Fake &f, zopt_step *step, const char *twin_path) {
  zopt_step *twin = nullptr;
  Z(zopt_step_load(twin_path, &twin));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  int pi = -1, gi = -1;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pi = (int)i;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gi = (int)i;
  }
  // The grad has its own dtype: the param's, or f32 for a 16-bit param
  // (DeepSpeed's bf16 layout: gradients accumulated in f32).
  const uint32_t pdt = d->states[pi].dtype, gdt = d->states[gi].dtype;
  const bool reads_param = d->states[pi].access & ZOPT_ACCESS_READ;
  const size_t ep = dtype_size(pdt), eg = dtype_size(gdt);
  printf("INFO offloaded step '%s': param %s, grad %s\n", d->name, dtype_name(pdt), dtype_name(gdt));
  Side O, C;  // the offloaded optimizer and its twin
  Z(zopt_optimizer_create(step, &O.o));
  Z(zopt_optimizer_create(twin, &C.o));
  zopt_optimizer *const o = O.o, *const c = C.o;
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097, 70001};
  const size_t T = sizes.size();
  add_groups({o, c}, {1e-3, 3e-3});
  unsigned rng = 12345;
  auto rnd = [&]() { return lcg(rng); };
  add_twin_tensors(f, {&O}, C, sizes, 2, pdt, gdt, lcg_values(sizes, rng));
  const auto &dp = O.dp, &dg = O.dg;
  const auto &hp = C.hp, &hg = C.hg;
  configure_scalers(ls, {o, c});
  int a0 = f.num_calls();
  Z(zopt_optimizer_finalize(o));
  int host_allocs = 0;
  for (int i = a0; i < f.num_calls(); ++i) host_allocs += !strcmp(f.call(i), "cuMemHostAlloc");
  check(host_allocs == 2, "finalize: pinned staging for the params and the grads of every group (" +
                              std::to_string(host_allocs) + " cuMemHostAlloc)");
  Z(zopt_optimizer_finalize(c));
  void *const stream = (void *)0x0FF1;
  Z(zopt_optimizer_set_stream(o, stream));

  const int steps = 5, inf_at = has_sumsq ? 3 : 0;
  for (int k = 1; k <= steps; ++k) {
    for (size_t t = 0; t < T; ++t) {  // new grads, identical bytes on both
      std::vector<float> v(sizes[t]);
      for (auto &x : v) x = rnd() * (ls ? 64.f : 0.05f);
      if (k == inf_at && t == T / 2) v[sizes[t] / 2] = INFINITY;
      Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
      memcpy((void *)(uintptr_t)dg[t], hg[t].data(), hg[t].size());
    }
    zopt_step_result ro{}, rc{};
    int c0 = f.num_calls();
    Z(zopt_optimizer_step(o, &ro));
    int dtoh = 0, htod = 0, syncs = 0, allocs = 0;
    for (int i = c0; i < f.num_calls(); ++i) {
      std::string n = f.call(i);
      dtoh += n == "cuMemcpyDtoHAsync";
      htod += n == "cuMemcpyHtoDAsync";
      syncs += n == "cuStreamSynchronize";
      allocs += n == "cuMemAlloc" || n == "cuMemHostAlloc";
    }
    Z(zopt_optimizer_step(c, &rc));
    const int want_dtoh = (int)T * (reads_param ? 2 : 1), want_htod = rc.skipped ? 0 : (int)T;
    check(dtoh == want_dtoh && htod == want_htod && syncs == 1 && allocs == 0,
          "offload step " + std::to_string(k) + ": " + std::to_string(dtoh) + " copies from the GPU, " +
              std::to_string(htod) + " to it, " + std::to_string(syncs) + " sync, no allocation");
    bool same_result = ro.skipped == rc.skipped && ro.loss_scale == rc.loss_scale &&
                       ((std::isnan(ro.grad_norm) && std::isnan(rc.grad_norm)) || ro.grad_norm == rc.grad_norm);
    char buf[200];
    snprintf(buf, sizeof buf, "offload step %d result = CPU twin's (norm %.17g, skipped %d, scale %g)", k, ro.grad_norm,
             ro.skipped, ro.loss_scale);
    check(same_result, buf);
    // The params come back asynchronously: read them as the caller's next
    // work on the stream would (ZOPT_FAKE_CUDA_STRESS delays the copies).
    f.drain_all();
    bool params_same = true;
    for (size_t t = 0; t < T; ++t)
      params_same &= memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size()) == 0;
    check(params_same, "offload step " + std::to_string(k) + ": params on the GPU bit-identical to the CPU twin's");
    bool states_same = true;
    for (size_t t = 0; t < T; ++t)
      for (uint32_t s = 0; s < d->num_states; ++s) {
        uint32_t kind = d->states[s].kind;
        if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
        size_t b = state_bytes(d, s, sizes[t]);
        std::vector<unsigned char> x(b), y(b);
        Z(zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, x.data(), b));
        Z(zopt_optimizer_read_state_raw(c, (int)t, (zopt_state_kind)kind, y.data(), b));
        states_same &= x == y;
      }
    check(states_same, "offload step " + std::to_string(k) + ": optimizer states bit-identical to the CPU twin's");
    // zopt_optimizer_get_step_stats: the offloaded step's copies, its CPU
    // work and the whole, each measured; the twin's: no copies.
    uint64_t n = 0;
    for (int64_t x : sizes) n += (uint64_t)x;
    zopt_step_stats so{}, sc{};
    Z(zopt_optimizer_get_step_stats(o, &so));
    Z(zopt_optimizer_get_step_stats(c, &sc));
    const double parts = so.d2h_seconds + so.update_seconds + so.h2d_seconds;
    snprintf(buf, sizeof buf, "d2h %.3g s %llu B, update %.3g s, h2d %.3g s %llu B, total %.3g s", so.d2h_seconds,
             (unsigned long long)so.d2h_bytes, so.update_seconds, so.h2d_seconds, (unsigned long long)so.h2d_bytes,
             so.total_seconds);
    check(so.offloaded == 1 && so.steps == k && so.d2h_seconds > 0 && so.update_seconds > 0 &&
              (rc.skipped ? so.h2d_seconds == 0 : so.h2d_seconds > 0) && so.total_seconds >= parts &&
              so.d2h_bytes == n * (eg + (reads_param ? ep : 0)) && so.h2d_bytes == (rc.skipped ? 0 : n * ep),
          "offload step " + std::to_string(k) + " stats: every part measured, total >= their sum, the bytes copied (" +
              buf + ")");
    check(sc.offloaded == 0 && sc.steps == k && sc.d2h_seconds == 0 && sc.h2d_seconds == 0 && sc.d2h_bytes == 0 &&
              sc.h2d_bytes == 0 && sc.update_seconds > 0 && sc.total_seconds >= sc.update_seconds,
          "offload step " + std::to_string(k) + " stats: the CPU twin's step reports no copies");
  }
  int64_t n1 = -1, n2 = -2;
  Z(zopt_optimizer_get_step_count(o, 1, &n1));
  Z(zopt_optimizer_get_step_count(c, 1, &n2));
  check(n1 == n2 && n1 == steps - (inf_at ? 1 : 0), "offload: step counts " + std::to_string(n1));
  // PARAM access goes to the user's device memory.
  std::vector<float> a(sizes[2]), b(sizes[2]);
  Z(zopt_optimizer_read_state_f32(o, 2, ZOPT_STATE_PARAM, a.data(), sizes[2]));
  Z(zopt_optimizer_read_state_f32(c, 2, ZOPT_STATE_PARAM, b.data(), sizes[2]));
  check(a == b, "offload: read_state_f32(PARAM) reads the device param");
  // GRAD access too, in the grad's own dtype: written through the API into
  // the user's device grad, read back, and compared with the bytes there.
  {
    bool ok = true;
    for (size_t t = 0; t < T; ++t) {
      std::vector<float> w = exact_values(sizes[t], (int)t), r(sizes[t]);
      Z(zopt_optimizer_write_state_f32(o, (int)t, ZOPT_STATE_GRAD, w.data(), sizes[t]));
      Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_GRAD, w.data(), sizes[t]));  // the twin keeps up
      Z(zopt_optimizer_read_state_f32(o, (int)t, ZOPT_STATE_GRAD, r.data(), sizes[t]));
      std::vector<unsigned char> want = storage_of(w, gdt);
      ok &= r == w && want == hg[t] && memcmp((void *)(uintptr_t)dg[t], want.data(), want.size()) == 0;
    }
    check(ok, std::string("offload: write/read_state_f32(GRAD) address the device grad in its dtype (") + dtype_name(gdt) +
                  ", param " + dtype_name(pdt) + ")");
  }
  // Every optimizer state of o bit for bit the twin's (storage bytes: q8
  // codes and their per-block absmax too).
  auto states_as_twin = [&] {
    bool same = true;
    for (size_t t = 0; t < T; ++t)
      for (uint32_t s = 0; s < d->num_states; ++s) {
        uint32_t kind = d->states[s].kind;
        if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
        size_t b = state_bytes(d, s, sizes[t]);
        std::vector<unsigned char> x(b), y(b);
        Z(zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, x.data(), b));
        Z(zopt_optimizer_read_state_raw(c, (int)t, (zopt_state_kind)kind, y.data(), b));
        same &= x == y;
      }
    return same;
  };
  // Checkpoint round trip (the optimizer states are on the CPU): the load
  // undoes the step after the save.
  std::string ck = std::string(twin_path) + ".offload.ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_load(o, ck.c_str()));
  Z(zopt_optimizer_get_step_count(o, 1, &n1));
  check(n1 == n2 && states_as_twin(), "offload: checkpoint load restores the step count and every state bit for bit");
  // A checkpoint of the all-CPU twin (a different step: other placements)
  // loads into the offloaded optimizer.
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_save(c, ck.c_str()));
  Z(zopt_optimizer_load(o, ck.c_str()));
  bool cross = states_as_twin();
  Z(zopt_optimizer_get_step_count(o, 1, &n1));
  check(cross && n1 == n2, "offload: the all-CPU twin's checkpoint loads into the offloaded optimizer");
  remove(ck.c_str());
  // An in-memory export of the offloaded optimizer after a step imports
  // into the twin after the same step; then random moments written through
  // write_state_f32 on both read back the same (f32 and storage bytes).
  {
    Z(zopt_optimizer_step(o, nullptr));
    Z(zopt_optimizer_step(c, nullptr));
    void *buf = nullptr;
    size_t size = 0;
    Z(zopt_optimizer_export_state(o, &buf, &size, 0));
    Z(zopt_optimizer_step(c, nullptr));  // changed, then restored by the import
    Z(zopt_optimizer_import_state(c, buf, size, 0));
    zopt_state_buffer_free(buf);
    bool imported = states_as_twin();
    bool rw = true;
    for (size_t t = 0; t < T; ++t)
      for (uint32_t k : {ZOPT_STATE_EXP_AVG, ZOPT_STATE_EXP_AVG_SQ}) {
        std::vector<float> v(sizes[t]), x(sizes[t]), y(sizes[t]);
        for (auto &e : v) e = k == ZOPT_STATE_EXP_AVG ? rnd() * 0.1f : std::fabs(rnd()) * 0.01f;
        zopt_status so = zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)k, v.data(), sizes[t]);
        zopt_status sc = zopt_optimizer_write_state_f32(c, (int)t, (zopt_state_kind)k, v.data(), sizes[t]);
        if (so == ZOPT_ERR_INVALID_ARGUMENT && sc == so) continue;  // the step has no such state
        Z(so);
        Z(sc);
        Z(zopt_optimizer_read_state_f32(o, (int)t, (zopt_state_kind)k, x.data(), sizes[t]));
        Z(zopt_optimizer_read_state_f32(c, (int)t, (zopt_state_kind)k, y.data(), sizes[t]));
        rw &= memcmp(x.data(), y.data(), x.size() * 4) == 0;
      }
    rw &= states_as_twin();
    f.drain_all();  // the step's param copies (delayed under STRESS) land before the next check resets the params
    check(imported && rw, "offload: export/import and write/read_state_f32 of the moments: every state bit for bit the "
                          "twin's");
  }

  // The staging is protected by an event, not by the stream: the params'
  // copies back to the GPU take a while (a slow DMA on stream A); the next
  // step runs on stream B, and must wait for them before its CPU update
  // rewrites the staging.
  {
    void *a = nullptr, *b = nullptr;
    f.stream_create(&a, 0);
    f.stream_create(&b, 0);
    Z(zopt_optimizer_set_stream(o, a));
    for (size_t t = 0; t < T; ++t) memcpy((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size());  // twins again
    const int d0 = f.num_delayed_done();
    f.set_htod_delay(200000);  // 200 ms per copy
    Z(zopt_optimizer_step(o, nullptr));
    bool pending = f.num_delayed_done() - d0 < (int)T;
    Z(zopt_optimizer_step(c, nullptr));
    Z(zopt_optimizer_set_stream(o, b));
    f.set_htod_delay(0);
    Z(zopt_optimizer_step(o, nullptr));
    Z(zopt_optimizer_step(c, nullptr));
    bool a_done = f.num_delayed_done() - d0 == (int)T;  // step 1's copies all ran before step 2 returned
    f.drain_all();
    bool same = true;
    for (size_t t = 0; t < T; ++t) same &= memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size()) == 0;
    if (!(pending && a_done && same))
      printf("INFO pending %d, stream A idle after the next step %d, params same %d\n", pending, a_done, same);
    check(pending && a_done && same,
          "offload: a step on another stream waits for the previous step's param copies (its event), and the "
          "params stay bit-identical to the CPU twin's");
  }
  // An offloaded step cannot be captured: a clear refusal.
  {
    void *cs = nullptr, *graph = nullptr;
    f.stream_create(&cs, 0);
    Z(zopt_optimizer_set_stream(o, cs));
    f.begin_capture(cs, 0);
    zopt_status st = zopt_optimizer_step(o, nullptr);
    std::string msg = zopt_last_error();
    int ec = f.end_capture(cs, &graph);
    check(st == ZOPT_ERR_UNSUPPORTED && msg.find("cannot be captured in a CUDA graph") != std::string::npos &&
              msg.find("offloaded") != std::string::npos && ec == 0,
          "offload: a step while the stream captures a CUDA graph is refused, saying why (the capture stays "
          "valid): " + msg);
  }
  int f0 = f.num_calls();
  zopt_optimizer_free(o);
  int user_syncs = 0;
  for (int i = f0; i < f.num_calls(); ++i) user_syncs += !strcmp(f.call(i), "cuStreamSynchronize");
  check(user_syncs == 0, "offload: zopt_optimizer_free waits for its own events, not for the caller's stream");
  zopt_optimizer_free(c);
  zopt_step_free(twin);
  int halloc = 0, hfree = 0;
  for (int i = 0; i < f.num_calls(); ++i) {
    halloc += !strcmp(f.call(i), "cuMemHostAlloc");
    hfree += !strcmp(f.call(i), "cuMemFreeHost");
  }
  check(halloc == hfree, "offload: every pinned staging buffer freed");
  for (size_t t = 0; t < T; ++t) {  // the test's own "device" tensors
    f.mem_free(dp[t]);
    f.mem_free(dg[t]);
  }
  return 0;
}

// ZeRO ranks of an offloaded step: W ranks (threads, loopback
// communicators), each with its own device params/grads, against W ranks
// of the CPU twin. Every rank has other grads (and one rank an inf at step
// 3); the grads are reduced across ranks in the staging (the CPU program's
// REDUCE_SCATTER, in the grad's dtype), the optimizer states are sharded
// (ZeRO-1/2), the params gathered and copied back to the GPU: every rank's
// device params must equal its twin's host params bit for bit after every
// step, as must the step results. Small buckets, so that shards cut through
// tensors. Each rank loads the steps itself (as a process would; a step's
// reference count is not atomic, so optimizers of one zopt_step are not
// created from several threads at once).
//
// `pipelined`: the offloaded ranks mark their buckets ready
// (zopt_optimizer_grad_bucket_ready) before each step, every rank in the
// same shuffled order: each bucket's reduction, norm partials and
// speculative update run on the optimizer's thread; every other step has
// small grads (the speculation commits), the others clip (recompute) or
// skip (discard); step 4 has a budget of a quarter of the model.
//
// `tail` (with `pipelined`): the offloaded ranks in per-bucket mode, so
// each step leaves its tail (per bucket in forward order: commit or
// recompute, the bucket's ALL_GATHER of the params, its copy back) on the
// pipeline thread; every rank's params after the next call (which joins
// it) must still be the twin's. At step 2 rank 0's copy back of tensor 0
// stalls in its call: its step returns all the same, and read_state right
// after it returns only after the release, with the step's param. Last, a
// rank in the default mode (its step's serial ALL_GATHER, bucket 0 first)
// against the others' tails (the last bucket first): the collectives
// disagree; that rank's step fails, the others' steps return and their
// next call reports the tail's failure, naming the bucket and the ranks;
// the call after it works (ZeRO-1/2; ZeRO-0 gathers no params).
void offload_ranks_check(Fake &f, zopt_step *step, const char *step_path, const char *twin_path, int W,
                         bool pipelined, bool tail) {
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  const StepInfo si = info_of(step);
  const uint32_t pdt = si.pdt, gdt = si.gdt;
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097, 70001};
  const size_t T = sizes.size();
  const int steps = 5, inf_at = has_sumsq ? 3 : 0;
  std::vector<zopt_comm *> co(W), cc(W);
  zopt_loopback_options lo{};
  lo.timeout_s = 60;
  Z(zopt_comm_create_loopback(W, &lo, co.data()));
  Z(zopt_comm_create_loopback(W, &lo, cc.data()));
  struct RankResult {
    bool params_same = true, results_same = true, counts_same = true;
    std::string first_diff;
    int outcomes[4] = {0, 0, 0, 0};  // pipelined: steps per ZOPT_SPEC_* outcome
    bool order_refused = true;       // pipelined: marks in another order than rank 0's
    bool retry_same = true;          // pipelined: after it, the step again = the twin's
    bool budget_ok = true;           // pipelined, step 4: some buckets speculated, the rest after validation
    std::string order_msg;
    bool early = true, joined = true;  // tail: the step returned while stalled; read_state joined
    bool tail_fail_ok = true;          // tail: a disagreeing gather reported
    std::string tail_msg;
  };
  std::vector<RankResult> res(W);
  // The initial params: the same on every rank (finalize checks it).
  unsigned rng0 = 777;
  const std::vector<std::vector<float>> init = lcg_values(sizes, rng0);
  auto rank = [&](int r) {
    RankResult &rr = res[r];
    zopt_step *mine = nullptr, *twin = nullptr;
    Z(zopt_step_load(step_path, &mine));
    Z(zopt_step_load(twin_path, &twin));
    zopt_optimizer *o = nullptr, *c = nullptr;
    Z(zopt_optimizer_create(mine, &o));
    Z(zopt_optimizer_create(twin, &c));
    Z(zopt_optimizer_set_comm(o, co[r]));
    Z(zopt_optimizer_set_comm(c, cc[r]));
    Z(zopt_optimizer_set_bucket_elems(o, 32768));
    Z(zopt_optimizer_set_bucket_elems(c, 32768));
    Z(zopt_optimizer_set_num_threads(o, 2));
    Z(zopt_optimizer_set_num_threads(c, 2));
    add_groups({o, c}, {1e-3, 3e-3});
    Side O, C;
    O.o = o;
    C.o = c;
    add_twin_tensors(f, {&O}, C, sizes, 2, pdt, gdt, init);
    const auto &dp = O.dp, &dg = O.dg;
    auto &hp = C.hp, &hg = C.hg;
    configure_scalers(ls, {o, c});
    void *stream = nullptr;
    f.stream_create(&stream, 0);
    // finalize is collective: the offloaded ranks together, then the twins.
    Z(zopt_optimizer_finalize(o));
    Z(zopt_optimizer_finalize(c));
    Z(zopt_optimizer_set_stream(o, stream));
    if (tail) Z(zopt_optimizer_set_param_wait(o, ZOPT_PARAM_WAIT_PER_BUCKET));
    unsigned rng = 1000u + 7919u * (unsigned)r;  // another grad on every rank
    for (int k = 1; k <= steps; ++k) {
      for (size_t t = 0; t < T; ++t) {
        std::vector<float> v(sizes[t]);
        for (auto &x : v) {
          rng = rng * 1664525u + 1013904223u;
          x = (((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f) * (ls ? 64.f : 0.05f) * (pipelined && k % 2 ? 1e-3f : 1.f);
        }
        if (k == inf_at && r == W - 1 && t == T / 2) v[sizes[t] / 2] = INFINITY;
        Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
        memcpy((void *)(uintptr_t)dg[t], hg[t].data(), hg[t].size());
      }
      zopt_step_result ro{}, rc{};
      if (pipelined) {
        // Step 4: a budget of about a quarter of the model (the arena; some
        // buckets updated after validation; ZeRO-0, where every rank
        // updates every bucket whole: half); otherwise every bucket.
        double bpe = 0;  // bytes per param (a q8 absmax: 4 per block)
        uint64_t n = 0;
        for (uint32_t s = 0; s < d->num_states; ++s)
          if (d->states[s].access & ZOPT_ACCESS_WRITE) bpe += state_bytes(d, s, ZOPT_Q8_BLOCK) / double(ZOPT_Q8_BLOCK);
        for (int64_t x : sizes) n += (uint64_t)x;
        Z(zopt_optimizer_set_speculation_budget(o, k == 4 ? (uint64_t)(n * bpe / (d->zero_stage ? 4 : 2)) : UINT64_MAX));
        int nb = 0;
        Z(zopt_optimizer_num_buckets(o, &nb));
        std::vector<int> order(nb);
        for (int b = 0; b < nb; ++b) order[b] = b;
        std::mt19937 g((unsigned)k);  // the same order on every rank
        std::shuffle(order.begin(), order.end(), g);
        for (int b : order) Z(zopt_optimizer_grad_bucket_ready(o, b));
      }
      // tail, step 2, rank 0: tensor 0's copy back stalls in its call (a
      // releaser thread ends it: at once after the step, or after 5 s).
      const bool stall = tail && k == 2 && r == 0;
      std::atomic<bool> go{false}, released{false};
      std::thread rel;
      if (stall) {
        f.stall_htod(dp[0], dp[0] + (unsigned long long)sizes[0] * dtype_size(pdt));
        rel = std::thread([&] {
          for (int i = 0; i < 5000 && !go; ++i) usleep(1000);
          usleep(100000);
          released = true;
          f.release_htod();
        });
      }
      Z(zopt_optimizer_step(o, &ro));
      std::vector<float> held((size_t)sizes[0]);
      if (stall) {
        rr.early = !released;
        go = true;
        const zopt_status st = zopt_optimizer_read_state_f32(o, 0, ZOPT_STATE_PARAM, held.data(), sizes[0]);
        rr.joined = st == ZOPT_OK && released;
        rel.join();
      }
      Z(zopt_optimizer_step(c, &rc));
      if (stall) {
        std::vector<float> want((size_t)sizes[0]);
        Z(zopt_optimizer_read_state_f32(c, 0, ZOPT_STATE_PARAM, want.data(), sizes[0]));
        rr.joined &= held == want;
      }
      if (pipelined) {
        zopt_pipeline_stats ps{};
        ps.size = sizeof ps;
        Z(zopt_optimizer_get_pipeline_stats(o, &ps));
        rr.outcomes[ps.outcome & 3]++;
        if (k == 4)
          rr.budget_ok = ps.speculated >= 1 && ps.late >= 1 && ps.committed + ps.recomputed + ps.late == ps.buckets;
      }
      rr.results_same &= ro.skipped == rc.skipped && ro.loss_scale == rc.loss_scale &&
                         ((std::isnan(ro.grad_norm) && std::isnan(rc.grad_norm)) || ro.grad_norm == rc.grad_norm);
      f.drain_all();  // after the asynchronous param copies (as above)
      for (size_t t = 0; t < T; ++t)
        if (memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size())) {
          if (rr.params_same)
            rr.first_diff = "rank " + std::to_string(r) + " step " + std::to_string(k) + " tensor " + std::to_string(t);
          rr.params_same = false;
        }
    }
    if (pipelined) {
      // The ranks mark their buckets in different orders: the first
      // bucket's reduction (a checked collective naming its bucket) fails
      // on every rank, the step reports it and changes nothing. Fresh
      // grads first (the twin's step folded its own shard in place).
      for (size_t t = 0; t < T; ++t) {
        std::vector<float> v(sizes[t]);
        for (auto &x : v) {
          rng = rng * 1664525u + 1013904223u;
          x = (((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f) * (ls ? 64.f : 0.05f);
        }
        Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
        memcpy((void *)(uintptr_t)dg[t], hg[t].data(), hg[t].size());
      }
      int nb = 0;
      Z(zopt_optimizer_num_buckets(o, &nb));
      for (int i = 0; i < nb; ++i) Z(zopt_optimizer_grad_bucket_ready(o, r == 0 ? i : nb - 1 - i));
      zopt_status st = zopt_optimizer_step(o, nullptr);
      std::string msg = zopt_last_error();
      f.drain_all();
      bool same = true;
      for (size_t t = 0; t < T; ++t) same &= memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size()) == 0;
      rr.order_refused = st != ZOPT_OK && msg.find("bucket") != std::string::npos && same;
      rr.order_msg = msg;
      // The communicator stays usable (nothing the step keeps was written
      // before the reduction): the step again runs serially over the same
      // grads, equal to the twin's step.
      zopt_step_result ro{}, rc{};
      rr.retry_same = zopt_optimizer_step(o, &ro) == ZOPT_OK;
      if (!rr.retry_same) rr.order_msg += std::string(" | the step again: ") + zopt_last_error();
      rr.retry_same &= zopt_optimizer_step(c, &rc) == ZOPT_OK && ro.grad_norm == rc.grad_norm;
      f.drain_all();
      for (size_t t = 0; t < T; ++t)
        rr.retry_same &= memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size()) == 0;
    }
    int64_t n1 = -1, n2 = -2;
    Z(zopt_optimizer_get_step_count(o, 1, &n1));
    Z(zopt_optimizer_get_step_count(c, 1, &n2));
    rr.counts_same = n1 == n2 && n1 == steps - (inf_at ? 1 : 0) + (pipelined ? 1 : 0);
    if (tail && d->zero_stage) {  // ZeRO-0: every rank updates whole buckets, no gather
      // The last rank in the default mode, the others per bucket: its
      // serial ALL_GATHER (bucket 0 first) meets their tails' (the last
      // bucket first). Any grads (the device's last ones).
      if (r == W - 1) Z(zopt_optimizer_set_param_wait(o, ZOPT_PARAM_WAIT_ALL));
      int nb = 0;
      Z(zopt_optimizer_num_buckets(o, &nb));
      for (int b = 0; b < nb; ++b) Z(zopt_optimizer_grad_bucket_ready(o, b));
      const zopt_status s1 = zopt_optimizer_step(o, nullptr);
      std::string m = zopt_last_error();
      if (r == W - 1) {
        rr.tail_fail_ok = s1 != ZOPT_OK && m.find("ALL_GATHER") != std::string::npos;
      } else {
        int64_t n = 0;
        const zopt_status s2 = zopt_optimizer_get_step_count(o, 1, &n);
        m = zopt_last_error();
        rr.tail_fail_ok = s1 == ZOPT_OK && s2 != ZOPT_OK && m.find("bucket " + std::to_string(nb - 1)) != std::string::npos &&
                          m.find("ALL_GATHER") != std::string::npos && m.find("rank") != std::string::npos &&
                          zopt_optimizer_get_step_count(o, 1, &n) == ZOPT_OK;
      }
      rr.tail_msg = m;
    }
    zopt_optimizer_free(o);
    zopt_optimizer_free(c);
    zopt_step_free(mine);
    zopt_step_free(twin);
    for (size_t t = 0; t < T; ++t) {
      f.mem_free(dp[t]);
      f.mem_free(dg[t]);
    }
  };
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r) th.emplace_back(rank, r);
  for (auto &t : th) t.join();
  bool params = true, results = true, counts = true;
  std::string diff;
  for (const RankResult &rr : res) {
    params &= rr.params_same;
    results &= rr.results_same;
    counts &= rr.counts_same;
    if (diff.empty()) diff = rr.first_diff;
  }
  const std::string at = std::to_string(W) + " ranks (ZeRO-" + std::to_string(d->zero_stage) + ", grads " +
                         dtype_name(gdt) + ", params " + dtype_name(pdt) + (pipelined ? ", pipelined" : "") +
                         (tail ? ", per-bucket tail" : "") + ")";
  if (pipelined) {
    const int *n = res[0].outcomes;
    const bool clip = d->flags & ZOPT_FLAG_CLIP;
    bool same = true;
    for (int r = 1; r < W; ++r) same &= !memcmp(res[r].outcomes, n, sizeof res[r].outcomes);
    for (int r = 0; r < W; ++r) same &= res[r].budget_ok;
    check(same && n[ZOPT_SPEC_COMMIT] >= 2 && (!clip || n[ZOPT_SPEC_RECOMPUTE] >= 1) &&
              (!has_sumsq || n[ZOPT_SPEC_DISCARD] == 1),
          "offload at " + at + ": outcomes on every rank: " + std::to_string(n[1]) + " commit, " +
              std::to_string(n[2]) + " recompute, " + std::to_string(n[3]) + " discard; with a quarter of the "
              "model's budget some buckets speculated, the rest after validation");
    bool refused = true, again = true;
    for (const RankResult &rr : res) {
      refused &= rr.order_refused;
      again &= rr.retry_same;
    }
    check(refused, "offload at " + at + ": buckets marked in another order on each rank: the step fails on every "
                   "rank, params unchanged: " + res[0].order_msg);
    check(again, "offload at " + at + ": after it the communicator is usable: the step again runs serially, its "
                 "params and norm = the CPU twin's" + (again ? std::string() : ": " + res[0].order_msg));
  }
  if (tail) {
    bool early = true, joined = true, failed = true;
    std::string msg;
    for (const RankResult &rr : res) {
      early &= rr.early;
      joined &= rr.joined;
      failed &= rr.tail_fail_ok;
      if (!rr.tail_fail_ok && msg.empty()) msg = rr.tail_msg;
    }
    check(early, "offload at " + at + ": the step returns while rank 0's tail is stalled (a copy back)");
    check(joined, "offload at " + at + ": read_state right after it waits for the whole tail, the step's param");
    if (d->zero_stage)
      check(failed, "offload at " + at + ": a rank's serial ALL_GATHER against the others' tails: its step fails, "
                  "the others' next call reports the tail's failure naming the bucket and the ranks, the call after "
                  "it works: " + (msg.empty() ? res[0].tail_msg : msg));
  }
  check(params, "offload at " + at + ": every rank's params on the GPU bit-identical to its CPU twin's after every "
                "step" + (diff.empty() ? std::string() : ", first difference: " + diff));
  check(results, "offload at " + at + ": every rank's step results = its CPU twin's (norm, skip, scale)");
  check(counts, "offload at " + at + ": step counts");
  for (int r = 0; r < W; ++r) {
    zopt_comm_free(co[r]);
    zopt_comm_free(cc[r]);
  }
}

}  // namespace ghc

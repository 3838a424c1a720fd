//===- gpu-host-check.cpp - the runtime's host side of a GPU step ------------===//
//
//   zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so [--big]
//   zopt-gpu-host-check FAKE_DRIVER.so OFFLOAD_STEP.so CPU_TWIN.so
//
// Runs a GPU step against libzopt-fake-cuda.so (set ZOPT_CUDA_DRIVER to the
// same path): "device" memory is host memory and kernels are only recorded,
// so this checks everything the runtime does around the kernels, on any
// machine: the image handed to cuModuleLoadData (uncompressed PTX, whose
// .param lists and .reqntid the stand-in enforces), the segment, state and
// chunk tables, the grids, the device-resident step state (globals table,
// loss scaler), the launch sequence of a step (PREPARE, SUMSQ, UPDATE,
// FINISH on the user's stream, with no host synchronisation, allocation or
// copy inside zopt_optimizer_step), hyperparameter writes, results read back
// on demand after the last step wherever it ran (a CUDA graph replayed on
// another stream, with hyperparameters changed between replays), devices and
// contexts, misaligned views, the driver version, launch errors, and GPU
// checkpoints. --big adds a tensor of more than 2^32 elements (reserved, not
// committed, by the stand-in). The numerics of the kernels are checked on a
// real GPU by zopt-gpu-check (test/Integration/CUDA).
//
// An offloaded step (params/grads on the GPU, states and kernels on the CPU)
// runs completely here: its "device" copies are memcpys and its kernels are
// CPU kernels. It is compared bit for bit with CPU_TWIN.so (the same
// description with everything on the CPU) over several steps with changing
// grads, a skipped step and a checkpoint, and its copies are counted.
//===----------------------------------------------------------------------===//
#include "zopt/comm.h"
#include "zopt/zopt.h"
#include "../check_util.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using zopt_check::check;
using zopt_check::failed;
using zopt_check::passed;

struct Fake {
  int (*num_calls)();
  const char *(*call)(int);
  int (*num_launches)();
  const char *(*launch)(int, unsigned *, unsigned *, void **, unsigned long long *);
  int (*num_allocs)();
  void (*fail_next_launch)();
  unsigned (*image_magic)();
  int (*image_has_ptx)();
  int (*kernel_params)(const char *, size_t *);
  void *(*launch_context)(int);
  int (*launch_nargs)(int);
  int (*launch_replay)(int);
  void (*set_device_count)(int);
  void (*set_driver_version)(int);
  void (*fail_attribute)(int);
  void (*set_emulation)(int, unsigned);
  int (*num_prepares)();
  int (*prepare_hypers)(int, double *, int);
  void (*patch_params)(const char *, int);
  void (*set_htod_delay)(unsigned);
  int (*num_delayed_done)();
  void (*drain_all)();
  int (*stream_enqueue)(void *, void (*)(void *), void *);
  int (*num_bad_ranges)();
  const char *(*bad_range)(int);
  int (*in_alloc)(unsigned long long, size_t);
  // The driver API itself (the test plays the application).
  int (*mem_alloc)(unsigned long long *, size_t);
  int (*mem_free)(unsigned long long);
  int (*ctx_retain)(void **, int);
  int (*ctx_push)(void *);
  int (*ctx_pop)(void **);
  int (*ctx_current)(void **);
  int (*stream_create)(void **, unsigned);
  int (*stream_query)(void *);
  int (*begin_capture)(void *, int);
  int (*end_capture)(void *, void **);
  int (*instantiate)(void **, void *, unsigned long long);
  int (*graph_launch)(void *, void *);
};

size_t dsize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }
const char *state_kind_name_of(uint32_t k) {
  return k == ZOPT_STATE_PARAM ? "param" : k == ZOPT_STATE_GRAD ? "grad" : k == ZOPT_STATE_MASTER ? "master"
         : k == ZOPT_STATE_EXP_AVG ? "exp_avg" : k == ZOPT_STATE_EXP_AVG_SQ ? "exp_avg_sq" : "state";
}
const char *dname(uint32_t dt) {
  return dt == ZOPT_DTYPE_F32 ? "f32" : dt == ZOPT_DTYPE_BF16 ? "bf16" : dt == ZOPT_DTYPE_F16 ? "f16" : "?";
}

// The storage bytes of x (exactly representable in dtype dt) in dt.
std::vector<unsigned char> storage_of(const std::vector<float> &x, uint32_t dt) {
  std::vector<unsigned char> out(x.size() * dsize(dt));
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t b;
    memcpy(&b, &x[i], 4);
    if (dt == ZOPT_DTYPE_F32) {
      memcpy(&out[4 * i], &b, 4);
    } else if (dt == ZOPT_DTYPE_BF16) {
      uint16_t h = (uint16_t)(b >> 16);
      memcpy(&out[2 * i], &h, 2);
    } else {
      _Float16 h = (_Float16)x[i];
      memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

// Values exactly representable in bf16 and f16 (and f32): k/8 for small k.
std::vector<float> exact_values(int64_t n, int salt) {
  std::vector<float> v((size_t)n);
  for (int64_t i = 0; i < n; ++i) v[(size_t)i] = (float)((i * 7 + salt) % 61 - 30) * 0.125f;
  return v;
}

bool ends_with(const std::string &s, const char *suf) {
  size_t n = strlen(suf);
  return s.size() >= n && s.compare(s.size() - n, n, suf) == 0;
}

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
  const size_t ep = dsize(pdt), eg = dsize(gdt);
  printf("INFO offloaded step '%s': param %s, grad %s\n", d->name, dname(pdt), dname(gdt));
  zopt_optimizer *o = nullptr, *c = nullptr;
  Z(zopt_optimizer_create(step, &o));
  Z(zopt_optimizer_create(twin, &c));
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097, 70001};
  const size_t T = sizes.size();
  int go[2], gc[2];
  for (int k = 0; k < 2; ++k) {
    Z(zopt_optimizer_add_group(o, &go[k]));
    Z(zopt_optimizer_add_group(c, &gc[k]));
    Z(zopt_optimizer_set_hyper(o, go[k], "lr", k ? 3e-3 : 1e-3));
    Z(zopt_optimizer_set_hyper(c, gc[k], "lr", k ? 3e-3 : 1e-3));
  }
  std::vector<unsigned long long> dp(T), dg(T);
  std::vector<std::vector<unsigned char>> hp(T), hg(T);
  unsigned rng = 12345;
  auto rnd = [&]() {
    rng = rng * 1664525u + 1013904223u;
    return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f;  // [-1, 1)
  };
  for (size_t t = 0; t < T; ++t) {
    f.mem_alloc(&dp[t], sizes[t] * ep);
    f.mem_alloc(&dg[t], sizes[t] * eg);
    hp[t].resize(sizes[t] * ep);
    hg[t].resize(sizes[t] * eg);
    int id = 0;
    Z(zopt_optimizer_add_tensor(o, go[t % 2], (void *)(uintptr_t)dp[t], (void *)(uintptr_t)dg[t], sizes[t],
                                (zopt_dtype)pdt, &id));
    Z(zopt_optimizer_add_tensor(c, gc[t % 2], hp[t].data(), hg[t].data(), sizes[t], (zopt_dtype)pdt, &id));
    std::vector<float> v(sizes[t]);
    for (auto &x : v) x = rnd();
    Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_PARAM, v.data(), sizes[t]));  // twin: host
    memcpy((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size());                        // same bytes
  }
  if (ls) {
    zopt_loss_scaler_config cfg = {1024.0, 2.0, 0.5, 2, 1.0, 1};
    Z(zopt_optimizer_configure_loss_scaler(o, &cfg));
    Z(zopt_optimizer_configure_loss_scaler(c, &cfg));
  }
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
    bool params_same = true;
    for (size_t t = 0; t < T; ++t)
      params_same &= memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size()) == 0;
    check(params_same, "offload step " + std::to_string(k) + ": params on the GPU bit-identical to the CPU twin's");
    bool states_same = true;
    for (size_t t = 0; t < T; ++t)
      for (uint32_t s = 0; s < d->num_states; ++s) {
        uint32_t kind = d->states[s].kind;
        if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
        size_t b = sizes[t] * (d->states[s].dtype == ZOPT_DTYPE_F32 ? 4 : 2);
        std::vector<unsigned char> x(b), y(b);
        Z(zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, x.data(), b));
        Z(zopt_optimizer_read_state_raw(c, (int)t, (zopt_state_kind)kind, y.data(), b));
        states_same &= x == y;
      }
    check(states_same, "offload step " + std::to_string(k) + ": optimizer states bit-identical to the CPU twin's");
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
    check(ok, std::string("offload: write/read_state_f32(GRAD) address the device grad in its dtype (") + dname(gdt) +
                  ", param " + dname(pdt) + ")");
  }
  // Checkpoint round trip (the optimizer states are on the CPU).
  std::string ck = std::string(twin_path) + ".offload.ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_load(o, ck.c_str()));
  Z(zopt_optimizer_get_step_count(o, 1, &n1));
  check(n1 == n2, "offload: checkpoint load restores the step count");
  // A checkpoint of the all-CPU twin (a different step: other placements)
  // loads into the offloaded optimizer.
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_save(c, ck.c_str()));
  Z(zopt_optimizer_load(o, ck.c_str()));
  bool cross = true;
  for (size_t t = 0; t < T; ++t)
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      std::vector<float> x(sizes[t]), y(sizes[t]);
      Z(zopt_optimizer_read_state_f32(o, (int)t, (zopt_state_kind)kind, x.data(), sizes[t]));
      Z(zopt_optimizer_read_state_f32(c, (int)t, (zopt_state_kind)kind, y.data(), sizes[t]));
      cross &= memcmp(x.data(), y.data(), x.size() * 4) == 0;
    }
  Z(zopt_optimizer_get_step_count(o, 1, &n1));
  check(cross && n1 == n2, "offload: the all-CPU twin's checkpoint loads into the offloaded optimizer");
  remove(ck.c_str());

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
void offload_ranks_check(Fake &f, zopt_step *step, const char *step_path, const char *twin_path, int W) {
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  const size_t ep = dsize(pdt), eg = dsize(gdt);
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
  };
  std::vector<RankResult> res(W);
  // The initial params: the same on every rank (finalize checks it).
  std::vector<std::vector<float>> init(T);
  unsigned rng0 = 777;
  for (size_t t = 0; t < T; ++t) {
    init[t].resize(sizes[t]);
    for (auto &x : init[t]) {
      rng0 = rng0 * 1664525u + 1013904223u;
      x = ((rng0 >> 8) & 0xFFFF) / 32768.0f - 1.0f;
    }
  }
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
    int go[2], gc[2];
    for (int k = 0; k < 2; ++k) {
      Z(zopt_optimizer_add_group(o, &go[k]));
      Z(zopt_optimizer_add_group(c, &gc[k]));
      Z(zopt_optimizer_set_hyper(o, go[k], "lr", k ? 3e-3 : 1e-3));
      Z(zopt_optimizer_set_hyper(c, gc[k], "lr", k ? 3e-3 : 1e-3));
    }
    std::vector<unsigned long long> dp(T), dg(T);
    std::vector<std::vector<unsigned char>> hp(T), hg(T);
    for (size_t t = 0; t < T; ++t) {
      f.mem_alloc(&dp[t], sizes[t] * ep);
      f.mem_alloc(&dg[t], sizes[t] * eg);
      hp[t].resize(sizes[t] * ep);
      hg[t].resize(sizes[t] * eg);
      int id = 0;
      Z(zopt_optimizer_add_tensor(o, go[t % 2], (void *)(uintptr_t)dp[t], (void *)(uintptr_t)dg[t], sizes[t],
                                  (zopt_dtype)pdt, &id));
      Z(zopt_optimizer_add_tensor(c, gc[t % 2], hp[t].data(), hg[t].data(), sizes[t], (zopt_dtype)pdt, &id));
      Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_PARAM, init[t].data(), sizes[t]));
      memcpy((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size());
    }
    if (ls) {
      zopt_loss_scaler_config cfg = {1024.0, 2.0, 0.5, 2, 1.0, 1};
      Z(zopt_optimizer_configure_loss_scaler(o, &cfg));
      Z(zopt_optimizer_configure_loss_scaler(c, &cfg));
    }
    void *stream = nullptr;
    f.stream_create(&stream, 0);
    // finalize is collective: the offloaded ranks together, then the twins.
    Z(zopt_optimizer_finalize(o));
    Z(zopt_optimizer_finalize(c));
    Z(zopt_optimizer_set_stream(o, stream));
    unsigned rng = 1000u + 7919u * (unsigned)r;  // another grad on every rank
    for (int k = 1; k <= steps; ++k) {
      for (size_t t = 0; t < T; ++t) {
        std::vector<float> v(sizes[t]);
        for (auto &x : v) {
          rng = rng * 1664525u + 1013904223u;
          x = (((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f) * (ls ? 64.f : 0.05f);
        }
        if (k == inf_at && r == W - 1 && t == T / 2) v[sizes[t] / 2] = INFINITY;
        Z(zopt_optimizer_write_state_f32(c, (int)t, ZOPT_STATE_GRAD, v.data(), sizes[t]));
        memcpy((void *)(uintptr_t)dg[t], hg[t].data(), hg[t].size());
      }
      zopt_step_result ro{}, rc{};
      Z(zopt_optimizer_step(o, &ro));
      Z(zopt_optimizer_step(c, &rc));
      rr.results_same &= ro.skipped == rc.skipped && ro.loss_scale == rc.loss_scale &&
                         ((std::isnan(ro.grad_norm) && std::isnan(rc.grad_norm)) || ro.grad_norm == rc.grad_norm);
      for (size_t t = 0; t < T; ++t)
        if (memcmp((void *)(uintptr_t)dp[t], hp[t].data(), hp[t].size())) {
          if (rr.params_same)
            rr.first_diff = "rank " + std::to_string(r) + " step " + std::to_string(k) + " tensor " + std::to_string(t);
          rr.params_same = false;
        }
    }
    int64_t n1 = -1, n2 = -2;
    Z(zopt_optimizer_get_step_count(o, 1, &n1));
    Z(zopt_optimizer_get_step_count(c, 1, &n2));
    rr.counts_same = n1 == n2 && n1 == steps - (inf_at ? 1 : 0);
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
                         dname(gdt) + ", params " + dname(pdt) + ")";
  check(params, "offload at " + at + ": every rank's params on the GPU bit-identical to its CPU twin's after every "
                "step" + (diff.empty() ? std::string() : ", first difference: " + diff));
  check(results, "offload at " + at + ": every rank's step results = its CPU twin's (norm, skip, scale)");
  check(counts, "offload at " + at + ": step counts");
  for (int r = 0; r < W; ++r) {
    zopt_comm_free(co[r]);
    zopt_comm_free(cc[r]);
  }
}


// ---- GPU steps -------------------------------------------------------------

struct StepInfo {
  const zopt_step_descriptor *d;
  bool ls, has_sumsq, sr, master;
  uint32_t pdt, gdt;  // param and grad dtypes: the grad's may be f32 for a 16-bit param
  size_t ep, eg;      // their element sizes
  int lr_i = -1;
};

StepInfo info_of(zopt_step *step) {
  StepInfo i{};
  i.d = zopt_step_get_descriptor(step);
  i.ls = i.d->flags & ZOPT_FLAG_LOSS_SCALE;
  i.has_sumsq = i.d->flags & ZOPT_FLAG_SUMSQ;
  i.sr = i.d->flags & ZOPT_FLAG_STOCHASTIC;
  for (uint32_t k = 0; k < i.d->num_states; ++k) {
    if (i.d->states[k].kind == ZOPT_STATE_PARAM) i.pdt = i.d->states[k].dtype;
    if (i.d->states[k].kind == ZOPT_STATE_GRAD) i.gdt = i.d->states[k].dtype;
    i.master |= i.d->states[k].init == ZOPT_INIT_FROM_PARAM;
  }
  for (uint32_t h = 0; h < i.d->num_hypers; ++h)
    if (i.d->hypers[h].kind == ZOPT_HYPER_LR) i.lr_i = (int)h;
  i.ep = dsize(i.pdt);
  i.eg = dsize(i.gdt);
  return i;
}

struct Rec {
  std::string name, role;
  unsigned grid[3], block[3];
  void *stream, *ctx;
  unsigned long long args[12];
  int nargs, replay;
};

std::string role_of(const std::string &n) {
  return ends_with(n, "_prepare_gpu") ? "PREPARE"
         : ends_with(n, "_sumsq")     ? "SUMSQ"
         : ends_with(n, "_update")    ? "UPDATE"
         : ends_with(n, "_finish")    ? "FINISH"
         : ends_with(n, "_init_gpu")  ? "INIT"
                                      : "?" + n;
}

std::vector<Rec> launches_since(Fake &f, int from) {
  std::vector<Rec> out;
  for (int i = from; i < f.num_launches(); ++i) {
    Rec r{};
    r.name = f.launch(i, r.grid, r.block, &r.stream, r.args);
    r.role = role_of(r.name);
    r.ctx = f.launch_context(i);
    r.nargs = f.launch_nargs(i);
    r.replay = f.launch_replay(i);
    out.push_back(r);
  }
  return out;
}

int calls_since(Fake &f, int from, const char *name) {
  int n = 0;
  for (int i = from; i < f.num_calls(); ++i) n += !strcmp(f.call(i), name);
  return n;
}

std::string seq_of(const std::vector<Rec> &ls) {
  std::string s;
  for (auto &l : ls) s += l.role + " ";
  return s;
}

// A GPU optimizer over tensors of `sizes` in two groups (lr 1e-3 / 3e-3),
// params zero, in stand-in device memory; each grad a buffer of the grad's
// dtype.
struct Setup {
  zopt_optimizer *o = nullptr;
  std::vector<unsigned long long> dp, dg;
  int gid[2] = {0, 0};
};

Setup make_optimizer(Fake &f, zopt_step *step, const StepInfo &si, const std::vector<int64_t> &sizes) {
  Setup su;
  Z(zopt_optimizer_create(step, &su.o));
  for (int k = 0; k < 2; ++k) {
    Z(zopt_optimizer_add_group(su.o, &su.gid[k]));
    Z(zopt_optimizer_set_hyper(su.o, su.gid[k], "lr", k ? 3e-3 : 1e-3));
  }
  su.dp.resize(sizes.size());
  su.dg.resize(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_alloc(&su.dp[i], sizes[i] * si.ep);
    f.mem_alloc(&su.dg[i], sizes[i] * si.eg);
    memset((void *)(uintptr_t)su.dp[i], 0, sizes[i] * si.ep);  // 0.0 in every dtype
    int id = 0;
    Z(zopt_optimizer_add_tensor(su.o, su.gid[i % 2], (void *)(uintptr_t)su.dp[i], (void *)(uintptr_t)su.dg[i],
                                sizes[i], (zopt_dtype)si.pdt, &id));
  }
  if (si.ls) {
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 3, 1.0, 1};
    Z(zopt_optimizer_configure_loss_scaler(su.o, &c));
  }
  return su;
}

// The chunk table of an UPDATE launch: every element of every tensor
// exactly once, in order, chunks of at most `chunk` elements at multiples of
// it (so none straddles a multiple of 2^32 elements).
bool chunks_cover(const zopt_gpu_chunk *ch, int64_t nch, const std::vector<int64_t> &sizes, int64_t *chunk) {
  int64_t c = 0, max_n = 0;
  for (int64_t i = 0; i < nch; ++i) max_n = std::max<int64_t>(max_n, ch[i].n);
  for (size_t t = 0; t < sizes.size(); ++t)
    for (int64_t b = 0; b < sizes[t]; ++c) {
      if (c >= nch || ch[c].segment != t || ch[c].begin != b || ch[c].n < 1 ||
          (ch[c].begin % max_n) != 0 || (ch[c].begin >> 32) != ((ch[c].begin + ch[c].n - 1) >> 32))
        return false;
      b += ch[c].n;
      if (b > sizes[t]) return false;
    }
  *chunk = max_n;
  return c == nch;
}

int gpu_main_check(Fake &f, zopt_step *step, const char *path) {
  const StepInfo si = info_of(step);
  const zopt_step_descriptor *d = si.d;
  printf("INFO GPU step '%s': param %s, grad %s\n", d->name, dname(si.pdt), dname(si.gdt));
  const uint64_t seed = 0x0123456789ABCDEFull;
  void *ctx0 = nullptr;
  f.ctx_current(&ctx0);
  int c_create = f.num_calls();
  zopt_optimizer *probe = nullptr;
  Z(zopt_optimizer_create(step, &probe));
  check(f.image_magic() == 0xBA55ED50u, "cuModuleLoadData got a CUDA fatbinary (magic 0xBA55ED50)");
  // Every kernel's .param list, as the stand-in read it from the PTX.
  std::string plist;
  for (const char *k : {"_prepare_gpu", "_update", "_sumsq", "_finish", "_init_gpu"}) {
    size_t sizes[16];
    std::string name = std::string(d->name) + k;
    if (!strcmp(k, "_update") || !strcmp(k, "_sumsq")) {
      for (uint32_t i = 0; i < d->num_kernels; ++i)
        if (d->kernels[i].device == ZOPT_PLACE_GPU &&
            d->kernels[i].role == (strcmp(k, "_update") ? ZOPT_KERNEL_SUMSQ : ZOPT_KERNEL_UPDATE))
          name = d->kernels[i].symbol;
    }
    int n = f.kernel_params(name.c_str(), sizes);
    if (n >= 0) plist += role_of(name) + "=" + std::to_string(n) + " ";
  }
  check(f.image_has_ptx(), "the image's PTX is stored uncompressed (the stand-in read the .param lists: " + plist + ")");
  check(calls_since(f, c_create, "cuFuncGetParamInfo") > 0,
        "create checks every kernel's parameters against the image (cuFuncGetParamInfo)");
  void *ctx1 = nullptr;
  f.ctx_current(&ctx1);
  check(ctx1 == ctx0, "create leaves the caller's context (none) current");
  zopt_optimizer_free(probe);

  // Two groups, tensors of odd sizes, params/grads in "device" memory.
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097};
  Setup su = make_optimizer(f, step, si, sizes);
  zopt_optimizer *o = su.o;
  if (si.sr) Z(zopt_optimizer_set_seed(o, seed));
  {
    std::vector<char> host(64), hostg(64);
    int id = 0;
    zopt_status st = zopt_optimizer_add_tensor(o, su.gid[0], host.data(), hostg.data(), 16, (zopt_dtype)si.pdt, &id);
    check(st == ZOPT_ERR_INVALID_ARGUMENT && strstr(zopt_last_error(), "not CUDA device memory") &&
              strstr(zopt_last_error(), "tensor 6"),
          std::string("host pointers refused, naming the tensor: ") + zopt_last_error());
    // Device pointers off their dtype's alignment (the kernels' scalar
    // accesses would fault): a grad half an element into its buffer (for
    // an f32 grad, where a view laid out at a 16-bit param's element size
    // lands), then a param.
    unsigned long long pb = 0, gb = 0;
    f.mem_alloc(&pb, 64 * si.ep);
    f.mem_alloc(&gb, 64 * si.eg);
    st = zopt_optimizer_add_tensor(o, su.gid[0], (void *)(uintptr_t)pb, (void *)(uintptr_t)(gb + si.eg / 2), 16,
                                   (zopt_dtype)si.pdt, &id);
    std::string mg = zopt_last_error();
    zopt_status st2 = zopt_optimizer_add_tensor(o, su.gid[0], (void *)(uintptr_t)(pb + si.ep / 2),
                                                (void *)(uintptr_t)gb, 16, (zopt_dtype)si.pdt, &id);
    std::string mp = zopt_last_error();
    check(st == ZOPT_ERR_INVALID_ARGUMENT && st2 == ZOPT_ERR_INVALID_ARGUMENT &&
              mg.find("the grad of tensor 6") != std::string::npos &&
              mg.find(std::string("not aligned to its dtype ") + dname(si.gdt)) != std::string::npos &&
              mp.find("the param of tensor 6") != std::string::npos &&
              mp.find(std::string("not aligned to its dtype ") + dname(si.pdt)) != std::string::npos,
          "a grad or param not aligned to its own dtype is refused, naming the tensor and the dtype: " + mg);
    f.mem_free(pb);
    f.mem_free(gb);
  }
  int c0 = f.num_calls(), l0 = f.num_launches();
  Z(zopt_optimizer_finalize(o));
  {
    auto ls = launches_since(f, l0);
    int dtoh = calls_since(f, c0, "cuMemcpyDtoHAsync");
    std::string seq = seq_of(ls);
    check(si.master ? (seq == "INIT " && dtoh == 0) : (seq.empty() && dtoh == 0),
          "finalize: the master from the params on the device (INIT), no copy through the host: " +
              (seq.empty() ? std::string("no master") : seq));
  }
  void *const stream = (void *)0x5157;
  Z(zopt_optimizer_set_stream(o, stream));

  // ---- one step: the launch sequence, nothing synchronous --------------------
  c0 = f.num_calls(), l0 = f.num_launches();
  int a0 = f.num_allocs();
  zopt_step_result r{};
  Z(zopt_optimizer_step(o, &r));
  int syncs = calls_since(f, c0, "cuStreamSynchronize"), allocs = calls_since(f, c0, "cuMemAlloc"),
      dtoh = calls_since(f, c0, "cuMemcpyDtoHAsync"), htod = calls_since(f, c0, "cuMemcpyHtoDAsync");
  check(syncs == 0 && allocs == 0 && dtoh == 0 && htod == 0 && f.num_allocs() == a0,
        "step 1: no cuStreamSynchronize, cuMemAlloc or copy (syncs=" + std::to_string(syncs) +
            " allocs=" + std::to_string(allocs) + " dtoh=" + std::to_string(dtoh) + " htod=" + std::to_string(htod) +
            ")");
  check(calls_since(f, c0, "cuEventRecord") == 1, "step 1: one event recorded after the launches (reads wait for it)");
  auto ls = launches_since(f, l0);
  bool on_stream = true, in_ctx = true, blocks = true, nargs = true;
  unsigned long long d_hypers = 0, d_globals = 0, d_states = 0, d_segs = 0, d_chunks = 0, d_sg = 0, d_scaler = 0,
                     nchunks = 0, ngroups = 0, d_tensor_t = 0, nrows = 0, d_active = 0;
  unsigned update_grid = 0, sumsq_grid = 0;
  for (const Rec &l : ls) {
    on_stream &= l.stream == stream;
    in_ctx &= l.ctx == (void *)0x1000;
    const unsigned want_block = l.role == "PREPARE" ? ZOPT_GPU_PREPARE_BLOCK
                                : l.role == "FINISH" ? ZOPT_GPU_FINISH_BLOCK
                                                     : ZOPT_GPU_BLOCK;
    blocks &= l.block[0] == want_block && l.block[1] == 1 && l.block[2] == 1;
    if (l.role == "PREPARE") {
      d_hypers = l.args[0], d_globals = l.args[1], d_tensor_t = l.args[3], nrows = l.args[4];
      nargs &= l.nargs == 6;
    } else if (l.role == "SUMSQ") {
      d_sg = l.args[6];
      sumsq_grid = l.grid[0];
      nargs &= l.nargs == 12;
      check(l.args[9] == nrows && l.args[10] == d_tensor_t,
            "SUMSQ: the rows of the coefficient table (one per tensor) and the tensors' steps");
    } else if (l.role == "UPDATE") {
      d_states = l.args[0], d_segs = l.args[1], d_chunks = l.args[2], nchunks = l.args[3];
      update_grid = l.grid[0];
      d_active = l.args[6];
      nargs &= l.nargs == (si.sr ? 9 : 7);
      check(l.args[5] == d_sg, "UPDATE reads the SUMSQ step globals (or NULL without SUMSQ)");
      if (si.sr)
        check(l.args[7] == d_tensor_t && l.args[8] == seed,
              "stochastic rounding: UPDATE gets the tensors' steps t and the seed");
    } else if (l.role == "FINISH") {
      nargs &= l.nargs == 7;
      ngroups = l.args[1];
      check(l.grid[0] == 1 && l.args[0] == d_globals && l.args[2] == d_sg && l.args[4] == d_tensor_t &&
                l.args[5] == d_active && l.args[6] == nrows,
            "FINISH: one block, the globals table, the step globals, the tensors' steps, the active mask, the rows");
      d_scaler = l.args[3];
      check((d_scaler != 0) == si.ls, "FINISH gets the loss scaler exactly when the step scales the loss");
    }
  }
  std::string seq = seq_of(ls);
  check(seq == (si.has_sumsq ? "PREPARE SUMSQ UPDATE FINISH " : "PREPARE UPDATE FINISH "), "launch order: " + seq);
  check(on_stream, "every launch on the stream given to zopt_optimizer_set_stream");
  check(in_ctx, "every launch with the optimizer's context current");
  void *cur = nullptr;
  f.ctx_current(&cur);
  check(cur == ctx0, "step restores the caller's context (none)");
  check(blocks, "every launch with the block size its kernel declares (.reqntid: 64, 256, 256, 32)");
  check(nargs, "every launch passes the parameters of the kernel's PTX .param list");
  check(std::isnan(r.grad_norm) && r.skipped == 0, "step()'s result is left to zopt_optimizer_gpu_result");

  // ---- the tables the kernels read ------------------------------------------
  check(ngroups == 2 && nrows == sizes.size(), "2 groups, a coefficient row per tensor");
  {
    const double *tt = (const double *)(uintptr_t)d_tensor_t;
    const uint8_t *act = (const uint8_t *)(uintptr_t)d_active;
    bool ok = d_active != 0;
    for (size_t t = 0; t < sizes.size() && ok; ++t) ok = tt[t] == 1 && act[t] == 1;
    check(ok && act[sizes.size()] == 1 && act[sizes.size() + 1] == 1,
          "tensors' steps t = 1 and the active mask (every tensor, both groups) on the device");
  }
  const zopt_gpu_segment *segs = (const zopt_gpu_segment *)(uintptr_t)d_segs;
  const unsigned long long *ptrs = (const unsigned long long *)(uintptr_t)d_states;
  bool segs_ok = true, ptrs_ok = true;
  for (size_t t = 0; t < sizes.size(); ++t) {
    segs_ok &= segs[t].n == sizes[t] && segs[t].group == t % 2 && segs[t].tensor == t;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      unsigned long long p = ptrs[t * d->num_states + k];
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM) ptrs_ok &= p == su.dp[t];
      else if (kind == ZOPT_STATE_GRAD) ptrs_ok &= p == su.dg[t];
      else ptrs_ok &= p != 0 && p % 16 == 0;  // owned, for 16-byte aligned params: 16-byte aligned
    }
  }
  check(segs_ok, "segment table: n, group and tensor index of every tensor");
  check(ptrs_ok, "state table: the user's param/grad pointers, 16-byte aligned owned states");
  // Every pointer of the table spans n elements of its state's dtype inside
  // one device allocation (the user's param and grad buffers, the owned
  // states' flat buffers): the kernels stay in bounds.
  {
    bool in = true;
    std::string dts;
    for (uint32_t k = 0; k < d->num_states; ++k)
      dts += std::string(k ? ", " : "") + state_kind_name_of(d->states[k].kind) + " " + dname(d->states[k].dtype);
    for (size_t t = 0; t < sizes.size(); ++t)
      for (uint32_t k = 0; k < d->num_states; ++k)
        in &= f.in_alloc(ptrs[t * d->num_states + k], (size_t)sizes[t] * dsize(d->states[k].dtype)) != 0;
    check(in, "state table: every pointer spans its tensor's elements of its state's dtype inside one device "
              "allocation (" + dts + ")");
  }
  int64_t chunk = 0;
  check(chunks_cover((const zopt_gpu_chunk *)(uintptr_t)d_chunks, (int64_t)nchunks, sizes, &chunk),
        "work list: " + std::to_string(nchunks) + " chunks of at most " + std::to_string(chunk) +
            " elements cover every element once, in order");
  const unsigned resident = 2 * 132;  // the stand-in: 2 blocks of 256 threads per SM, 132 SMs
  check(update_grid == std::min<unsigned long long>(nchunks, resident) &&
            (!si.has_sumsq || sumsq_grid == std::min<unsigned long long>(nchunks, resident)),
        "grids sized by occupancy and the work list, not by the largest tensor: UPDATE " +
            std::to_string(update_grid) + (si.has_sumsq ? ", SUMSQ " + std::to_string(sumsq_grid) : std::string()) +
            " blocks");
  double *hy = (double *)(uintptr_t)d_hypers;
  const int lr_i = si.lr_i;
  check(lr_i >= 0 && hy[lr_i] == 1e-3 && hy[d->num_hypers + lr_i] == 3e-3, "hyperparameter table: lr per group");
  double *gl = (double *)(uintptr_t)d_globals;
  check(gl[ZOPT_GLOBAL_STEP] == 1 && gl[ZOPT_GLOBAL_CLIP_COEF] == 1 &&
            gl[ZOPT_GLOBAL_GRAD_SCALE] == (si.ls ? 1.0 / 1024 : 1.0) && gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] == 1,
        "globals table on the device: t = 1, clip 1, 1/S for each group");
  if (si.ls) {
    const zopt_gpu_scaler *sc = (const zopt_gpu_scaler *)(uintptr_t)d_scaler;
    check(sc->scale == 1024 && sc->growth_factor == 2 && sc->backoff_factor == 0.5 && sc->growth_interval == 3 &&
              sc->min_scale == 1 && sc->dynamic == 1 && sc->good_steps == 0,
          "loss scaler on the device: the configured scaler");
  }
  // maximize (ZOPT_GROUP_MAXIMIZE) on group 1: its gradient scale in the
  // device's globals table is negative, group 0's and the step counts stay
  // (FINISH keeps each group's sign when it rewrites the scale, checked on
  // its IR in test/Conversion/ZKToGPU); cleared, positive again.
  {
    const double inv = si.ls ? 1.0 / 1024 : 1.0;
    const double t0 = gl[ZOPT_GLOBAL_STEP], t1 = gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP];
    uint32_t fl = 0;
    Z(zopt_optimizer_set_group_flags(o, 1, ZOPT_GROUP_MAXIMIZE));
    Z(zopt_optimizer_get_group_flags(o, 1, &fl));
    bool on = fl == ZOPT_GROUP_MAXIMIZE && gl[ZOPT_GLOBAL_GRAD_SCALE] == inv &&
              gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE] == -inv && gl[ZOPT_GLOBAL_STEP] == t0 &&
              gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] == t1;
    Z(zopt_optimizer_set_group_flags(o, 1, 0));
    bool off = gl[ZOPT_GLOBAL_GRAD_SCALE] == inv && gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_GRAD_SCALE] == inv;
    check(on && off, "set_group_flags(MAXIMIZE): that group's gradient scale on the device is -1/S, the other "
                     "group's and the step counts unchanged; cleared: 1/S again");
  }

  // ---- the grad through the API, in its own dtype ------------------------------
  {
    bool ok = true;
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> w = exact_values(sizes[t], (int)t), r(sizes[t]);
      Z(zopt_optimizer_write_state_f32(o, (int)t, ZOPT_STATE_GRAD, w.data(), sizes[t]));
      Z(zopt_optimizer_read_state_f32(o, (int)t, ZOPT_STATE_GRAD, r.data(), sizes[t]));
      std::vector<unsigned char> want = storage_of(w, si.gdt);
      ok &= r == w && memcmp((void *)(uintptr_t)su.dg[t], want.data(), want.size()) == 0;
    }
    check(ok, std::string("write/read_state_f32(GRAD) address the device grad in its dtype (") + dname(si.gdt) +
                  ", param " + dname(si.pdt) + ")");
  }

  // ---- a second step: only the launches; a changed lr is written at once ------
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  int copies = 0, launches = 0;
  for (int i = c0; i < f.num_calls(); ++i) {
    copies += !strncmp(f.call(i), "cuMemcpy", 8) || !strncmp(f.call(i), "cuMemset", 8) ||
              !strcmp(f.call(i), "cuStreamSynchronize");
    launches += !strcmp(f.call(i), "cuLaunchKernel");
  }
  check(copies == 0 && launches == (si.has_sumsq ? 4 : 3),
        "step 2: only the launches (no copy, no sync) when no hyperparameter changed");
  c0 = f.num_calls();
  Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", 1e-3));  // same value
  check(f.num_calls() == c0, "setting lr to its current value writes nothing");
  Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", 5e-4));
  check(calls_since(f, c0, "cuMemsetD32Async") == 2 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0 &&
            calls_since(f, c0, "cuStreamSynchronize") == 0 && calls_since(f, c0, "cuEventRecord") == 1 &&
            hy[lr_i] == 5e-4 && hy[d->num_hypers + lr_i] == 3e-3,
        "a changed lr is written into the device's table at once, on the stream, by value (two 32-bit memsets, "
        "no host buffer, no sync), after the steps already enqueued");
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  check(calls_since(f, c0, "cuStreamWaitEvent") == 1 && calls_since(f, c0, "cuMemcpyHtoDAsync") == 0,
        "the next step waits for the hyperparameter write (its event), uploads nothing");

  // ---- the step state is the device's: emulate FINISH, read it back ---------
  // 4 steps ran; the fake runs no kernel, so write what FINISH would have:
  // 3 applied, 1 skipped (t_next = 4) and, with loss scaling, a backoff.
  gl[ZOPT_GLOBAL_STEP] = 4;
  gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] = 4;
  zopt_gpu_step_globals *sgp = (zopt_gpu_step_globals *)(uintptr_t)d_sg;
  if (si.has_sumsq) {
    sgp->norm = 2.5;
    sgp->skip = 1;
  }
  if (si.ls) {
    zopt_gpu_scaler *sc = (zopt_gpu_scaler *)(uintptr_t)d_scaler;
    sc->last_scale = 1024;
    sc->scale = 512;
    sc->good_steps = 0;
  }
  int64_t cnt = -1;
  c0 = f.num_calls();
  Z(zopt_optimizer_get_step_count(o, 1, &cnt));
  syncs = calls_since(f, c0, "cuStreamSynchronize");
  check(cnt == 3 && syncs == 1 && calls_since(f, c0, "cuStreamWaitEvent") >= 1,
        "get_step_count reads the device's count after the last step's event (one stream sync): " +
            std::to_string(cnt));
  zopt_step_result gr{};
  Z(zopt_optimizer_gpu_result(o, &gr));
  if (si.has_sumsq)
    check(gr.grad_norm == 2.5 && gr.skipped == 1, "gpu_result: the device's norm and skip flag");
  else
    check(std::isnan(gr.grad_norm) && gr.skipped == 0, "gpu_result without a norm reduction: NaN, not skipped");
  double scale = 0;
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(gr.loss_scale == (si.ls ? 1024 : 1) && scale == (si.ls ? 512 : 1),
        "loss scale: the step's (gpu_result) and the next step's (get_loss_scale) from the device");

  // ---- refresh_master: INIT on the tensor's chunks ---------------------------
  if (si.master) {
    l0 = f.num_launches();
    c0 = f.num_calls();
    Z(zopt_optimizer_refresh_master(o, 4, 1));
    auto rl = launches_since(f, l0);
    const zopt_gpu_chunk *ch = (const zopt_gpu_chunk *)(uintptr_t)rl[0].args[2];
    bool ok = rl.size() == 1 && rl[0].role == "INIT" && rl[0].args[3] >= 1 && ch[0].segment == 4 && ch[0].begin == 0 &&
              calls_since(f, c0, "cuMemcpyDtoHAsync") == 0;
    check(ok, "refresh_master: INIT over the tensor's chunks on the device, no copy through the host");
  }

  // ---- a failed launch is reported, not hidden --------------------------------
  f.fail_next_launch();
  zopt_status st = zopt_optimizer_step(o, nullptr);
  check(st == ZOPT_ERR_INTERNAL && strstr(zopt_last_error(), "launching PREPARE") &&
            strstr(zopt_last_error(), "LAUNCH_FAILED"),
        std::string("a failed launch returns ZOPT_ERR_INTERNAL: ") + zopt_last_error());

  // ---- checkpoints of GPU steps ---------------------------------------------
  // Fill every owned state with a pattern through the API, save, scribble,
  // load: the states, step counts and scaler come back.
  std::vector<std::vector<float>> want;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      std::vector<float> v(sizes[t]);
      for (int64_t i = 0; i < sizes[t]; ++i) v[i] = 0.25f * (float)(i % 13) + (float)k + 0.5f * (float)t;
      Z(zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)kind, v.data(), sizes[t]));
      want.push_back(v);
    }
  std::string ck = std::string(path) + ".host-check.ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      std::vector<float> z(sizes[t], -7.f);
      Z(zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)kind, z.data(), sizes[t]));
    }
  gl[ZOPT_GLOBAL_STEP] = 100;  // as if more steps ran
  hy[lr_i] = 9.0;              // and the table were scribbled on
  Z(zopt_optimizer_load(o, ck.c_str()));
  bool same = true;
  size_t w = 0;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      std::vector<float> v(sizes[t]);
      Z(zopt_optimizer_read_state_f32(o, (int)t, (zopt_state_kind)kind, v.data(), sizes[t]));
      same &= v == want[w++];
    }
  check(same, "checkpoint round trip: every owned state back on the device");
  Z(zopt_optimizer_get_step_count(o, 0, &cnt));
  check(cnt == 3 && gl[ZOPT_GLOBAL_STEP] == 4 && hy[lr_i] == 5e-4,
        "checkpoint round trip: step count 3, device t_next = 4, the hyperparameter table");
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(scale == (si.ls ? 512 : 1), "checkpoint round trip: loss scale");
  remove(ck.c_str());

  c0 = f.num_calls();
  zopt_optimizer_free(o);
  check(calls_since(f, c0, "cuStreamSynchronize") == 0 && calls_since(f, c0, "cuEventSynchronize") >= 1,
        "zopt_optimizer_free waits for its own events, not for the caller's stream (it may be destroyed)");
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
  check(f.num_allocs() == 0, "zopt_optimizer_free releases every device buffer it allocated");
  return 0;
}

// Items of the driver and the build: too old a driver, a failing device
// attribute, a kernel whose parameters differ from the runtime's, the
// caller's allocator.
void driver_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  zopt_optimizer *o = nullptr;
  f.set_driver_version(12040);
  zopt_status st = zopt_optimizer_create(step, &o);
  std::string msg = zopt_last_error();
  check(st == ZOPT_ERR_UNSUPPORTED && msg.find("CUDA toolkit 13.0") != std::string::npos &&
            msg.find("supports CUDA 12.4") != std::string::npos,
        "a CUDA 12.4 driver is refused for a step built by CUDA 13, naming both versions: " + msg);
  f.set_driver_version(13000);
  f.fail_attribute(75);
  st = zopt_optimizer_create(step, &o);
  msg = zopt_last_error();
  check(st == ZOPT_ERR_INTERNAL && msg.find("COMPUTE_CAPABILITY_MAJOR") != std::string::npos,
        "a failing cuDeviceGetAttribute is an error (no sm_0): " + msg);
  f.fail_attribute(-1);
  f.patch_params("_update", -1);
  st = zopt_optimizer_create(step, &o);
  msg = zopt_last_error();
  check(st == ZOPT_ERR_ABI && msg.find("this runtime passes") != std::string::npos,
        "an UPDATE kernel with another parameter list than the runtime's is refused at create: " + msg);
  f.patch_params("", 0);

  // The caller's allocator: every device buffer of finalize, freed by free.
  struct Pool {
    Fake *f;
    int allocs = 0, frees = 0;
    size_t bytes = 0;
  } pool{&f};
  zopt_device_allocator a;
  a.user = &pool;
  a.alloc = [](void *u, size_t n, void *) -> void * {
    Pool *p = (Pool *)u;
    unsigned long long d = 0;
    if (p->f->mem_alloc(&d, n)) return nullptr;
    p->allocs++;
    p->bytes += n;
    return (void *)(uintptr_t)d;
  };
  a.free = [](void *u, void *ptr, size_t, void *) {
    Pool *p = (Pool *)u;
    p->frees++;
    p->f->mem_free((unsigned long long)(uintptr_t)ptr);
  };
  Setup su = make_optimizer(f, step, si, {5, 300});
  Z(zopt_optimizer_set_device_allocator(su.o, &a));
  int c0 = f.num_calls();
  Z(zopt_optimizer_finalize(su.o));
  int direct = calls_since(f, c0, "cuMemAlloc") - pool.allocs;
  st = zopt_optimizer_set_device_allocator(su.o, nullptr);
  check(pool.allocs > 0 && direct == 0 && st == ZOPT_ERR_BAD_STATE,
        "zopt_optimizer_set_device_allocator: every device buffer of finalize from the caller's allocator (" +
            std::to_string(pool.allocs) + " buffers, " + std::to_string(pool.bytes) +
            " bytes), none from cuMemAlloc; refused after finalize");
  Z(zopt_optimizer_step(su.o, nullptr));
  zopt_optimizer_free(su.o);
  check(pool.frees == pool.allocs, "zopt_optimizer_free gives every buffer back through the caller's allocator");
  for (size_t i = 0; i < su.dp.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }

  // Many small tensors: the grid follows the work list (one segment walk per
  // thread sized by the largest tensor ran such a model on one block).
  Setup many = make_optimizer(f, step, si, std::vector<int64_t>(1000, 64));
  Z(zopt_optimizer_finalize(many.o));
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(many.o, nullptr));
  unsigned grid = 0;
  unsigned long long nch = 0;
  for (const Rec &l : launches_since(f, l0))
    if (l.role == "UPDATE") grid = l.grid[0], nch = l.args[3];
  check(nch == 1000 && grid == 2 * 132,
        "1000 tensors of 64 elements: 1000 chunks on " + std::to_string(grid) + " blocks (2 per SM, 132 SMs)");
  zopt_optimizer_free(many.o);
  for (size_t i = 0; i < many.dp.size(); ++i) {
    f.mem_free(many.dp[i]);
    f.mem_free(many.dg[i]);
  }
}

// Two devices: a tensor on another device than the optimizer's context is
// refused, naming it; every call restores the caller's context.
void device_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  f.set_device_count(2);
  void *c0 = nullptr, *c1 = nullptr;
  f.ctx_retain(&c0, 0);
  f.ctx_retain(&c1, 1);
  unsigned long long p1 = 0, g1 = 0, p0 = 0, g0 = 0;
  f.ctx_push(c1);
  f.mem_alloc(&p1, 64 * si.ep);
  f.mem_alloc(&g1, 64 * si.eg);
  f.ctx_pop(nullptr);
  f.ctx_push(c0);  // as PyTorch: cuda:0 current
  f.mem_alloc(&p0, 64 * si.ep);
  f.mem_alloc(&g0, 64 * si.eg);
  zopt_optimizer *o = nullptr;
  Z(zopt_optimizer_create(step, &o));
  int gid = 0, id = 0;
  Z(zopt_optimizer_add_group(o, &gid));
  Z(zopt_optimizer_add_tensor(o, gid, (void *)(uintptr_t)p0, (void *)(uintptr_t)g0, 64, (zopt_dtype)si.pdt, &id));
  zopt_status st = zopt_optimizer_add_tensor(o, gid, (void *)(uintptr_t)p1, (void *)(uintptr_t)g1, 64,
                                             (zopt_dtype)si.pdt, &id);
  std::string msg = zopt_last_error();
  check(st == ZOPT_ERR_INVALID_ARGUMENT && msg.find("the param of tensor 1 is on cuda:1") != std::string::npos &&
            msg.find("runs on cuda:0") != std::string::npos,
        "a param on cuda:1 for an optimizer on cuda:0 is refused, naming the tensor: " + msg);
  Z(zopt_optimizer_finalize(o));
  // The caller makes cuda:1 current; every call runs in cuda:0's context and
  // gives cuda:1's back.
  f.ctx_push(c1);
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(o, nullptr));
  void *cur = nullptr;
  f.ctx_current(&cur);
  bool ok = cur == c1;
  for (const Rec &l : launches_since(f, l0)) ok &= l.ctx == c0;
  int64_t n = 0;
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  Z(zopt_optimizer_set_hyper(o, gid, "lr", 0.5e-3));
  std::vector<float> v(64);
  Z(zopt_optimizer_read_state_f32(o, 0, ZOPT_STATE_PARAM, v.data(), 64));
  f.ctx_current(&cur);
  ok &= cur == c1;
  zopt_optimizer_free(o);
  f.ctx_current(&cur);
  ok &= cur == c1;
  check(ok, "with cuda:1 current, step/reads/set_hyper/free run in the optimizer's cuda:0 context and restore cuda:1");
  f.ctx_pop(nullptr);
  f.ctx_pop(nullptr);
  for (unsigned long long p : {p0, g0, p1, g1}) f.mem_free(p);
  f.set_device_count(1);
}

// A CUDA graph: the step captured on stream C, replayed on stream R, with
// the stand-in emulating the kernels (queued, delayed, FINISH advancing the
// step counts, PREPARE recording the hyperparameters it read). Reads made
// without telling the optimizer about R must wait for the replays; lr
// changes between replays must reach the replays that follow them, and
// only those.
void graph_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  f.set_emulation(1, 20000);  // 20 ms per kernel
  Setup su = make_optimizer(f, step, si, {33, 1000, 5000});
  zopt_optimizer *o = su.o;
  Z(zopt_optimizer_finalize(o));
  void *cs = nullptr, *rs = nullptr, *graph = nullptr, *exec = nullptr;
  f.stream_create(&cs, 0);
  f.stream_create(&rs, 0);
  Z(zopt_optimizer_set_stream(o, cs));
  Z(zopt_optimizer_step(o, nullptr));  // warm-up, on C
  f.drain_all();
  const int p0 = f.num_prepares();
  f.begin_capture(cs, 0);
  zopt_status st = zopt_optimizer_step(o, nullptr);
  zopt_status st_hyper = zopt_optimizer_set_hyper(o, su.gid[0], "lr", 7e-4);
  std::string msg_hyper = zopt_last_error();
  int64_t n = -1;
  zopt_status st_read = zopt_optimizer_get_step_count(o, 0, &n);
  std::string msg_read = zopt_last_error();
  int ec = f.end_capture(cs, &graph);
  check(st == ZOPT_OK && ec == 0, "step captured into a CUDA graph (nothing the capture forbids: no sync, no "
                                  "pageable copy, no wait for an event outside it)");
  check(st_hyper == ZOPT_ERR_BAD_STATE && msg_hyper.find("capturing a CUDA graph") != std::string::npos,
        "set_hyper during the capture is refused, saying why: " + msg_hyper);
  check(st_read == ZOPT_ERR_BAD_STATE && msg_read.find("capturing a CUDA graph") != std::string::npos,
        "reading the step count during the capture is refused, saying why: " + msg_read);
  f.instantiate(&exec, graph, 0);
  // Three replays on R, lr changed before the second and third; the
  // optimizer's stream stays C (as after a capture by torch.cuda.graph).
  const double lrs[3] = {1e-3, 5e-4, 2e-4};
  for (int k = 0; k < 3; ++k) {
    if (k) Z(zopt_optimizer_set_hyper(o, su.gid[0], "lr", lrs[k]));
    f.graph_launch(exec, rs);
  }
  int l_after = f.num_launches();
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  check(n == 4,
        "get_step_count after 3 replays on another stream waits for them (the step's event is a record node of "
        "the graph): count " + std::to_string(n) + " (1 + 3)");
  std::string seen;
  bool lr_ok = f.num_prepares() == p0 + 3;
  for (int k = 0; k < 3 && lr_ok; ++k) {
    double h[64];
    f.prepare_hypers(p0 + k, h, 64);
    char b[64];
    snprintf(b, sizeof b, "%g ", h[si.lr_i]);
    seen += b;
    lr_ok &= h[si.lr_i] == lrs[k] && h[si.d->num_hypers + si.lr_i] == 3e-3;
  }
  check(lr_ok, "lr changed between replays reaches exactly the replays after it: the replayed PREPAREs read " + seen);
  (void)l_after;
  // Two more replays, then a checkpoint and gpu_result right away.
  f.graph_launch(exec, rs);
  f.graph_launch(exec, rs);
  std::string ck = "/tmp/zopt-host-check-graph-" + std::to_string(getpid()) + ".ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  zopt_step_result gr{};
  Z(zopt_optimizer_gpu_result(o, &gr));
  Z(zopt_optimizer_load(o, ck.c_str()));
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  remove(ck.c_str());
  check(n == 6, "save after 2 more replays waits for them: the checkpoint holds step count " + std::to_string(n));
  // A step on another stream after a stream change: ordered after the
  // replays (the new stream waits for the optimizer's events).
  void *other = nullptr;
  f.stream_create(&other, 0);
  f.graph_launch(exec, rs);
  int c0 = f.num_calls();
  Z(zopt_optimizer_set_stream(o, other));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_get_step_count(o, 0, &n));
  check(calls_since(f, c0, "cuStreamWaitEvent") >= 1 && n == 8,
        "a new stream waits for the optimizer's last work (a replay on R), then steps: count " + std::to_string(n));
  f.drain_all();
  f.set_emulation(0, 0);
  zopt_optimizer_free(o);
  for (size_t i = 0; i < su.dp.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
}

// The active mask (zopt_optimizer_set_active) of a GPU step: the mask on
// the device (per tensor, then per group), the tensors' own step counts
// (FINISH, emulated by the stand-in as the real kernel: the step t of every
// active tensor and the count of every group with an active tensor), a
// tensor that joins later starting at t = 1 (PREPARE reads its t), the
// counts through set_tensor_step and a checkpoint, a mask refused during a
// capture or with the wrong length leaving the old one.
void active_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  f.set_emulation(1, 0);
  Setup su = make_optimizer(f, step, si, {33, 1000, 5000, 7});  // groups 0 1 0 1
  zopt_optimizer *o = su.o;
  Z(zopt_optimizer_finalize(o));
  auto counts = [&](zopt_optimizer *x) {
    std::string s;
    for (int t = 0; t < 4; ++t) {
      int64_t c = -1;
      Z(zopt_optimizer_get_tensor_step(x, t, &c));
      s += std::to_string(c) + (t < 3 ? " " : "");
    }
    return s;
  };
  auto groups = [&](zopt_optimizer *x) {
    int64_t a = -1, b = -1;
    Z(zopt_optimizer_get_step_count(x, su.gid[0], &a));
    Z(zopt_optimizer_get_step_count(x, su.gid[1], &b));
    return std::to_string(a) + " " + std::to_string(b);
  };
  const uint8_t mask[4] = {1, 0, 1, 0};  // group 1 has no active tensor
  const int l0 = f.num_launches();
  Z(zopt_optimizer_set_active(o, mask, 4));
  Z(zopt_optimizer_step(o, nullptr));
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  const uint8_t *act = nullptr;
  const double *tt = nullptr;
  for (const Rec &l : launches_since(f, l0)) {
    if (l.role == "UPDATE") act = (const uint8_t *)(uintptr_t)l.args[6];
    if (l.role == "PREPARE") tt = (const double *)(uintptr_t)l.args[3];
  }
  check(act && act[0] == 1 && act[1] == 0 && act[2] == 1 && act[3] == 0 && act[4] == 1 && act[5] == 0,
        "set_active on a GPU step: the mask on the device, per tensor (1 0 1 0) then per group (1 0), read by "
        "UPDATE");
  std::string c = counts(o), g = groups(o);
  check(c == "2 0 2 0" && g == "2 0",
        "2 steps with tensors 1 and 3 inactive: per-tensor counts " + c + " (2 0 2 0), group counts " + g +
            " (2 0): FINISH advances only the active tensors and groups");
  Z(zopt_optimizer_set_active(o, nullptr, 0));
  const double t_next = tt ? tt[1] : 0;  // what the next PREPARE reads for tensor 1's row
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  c = counts(o), g = groups(o);
  check(c == "3 1 3 1" && g == "3 1" && t_next == 1 && act[1] == 1,
        "every tensor active again: tensor 1 joins at t = 1 (the device's t of its coefficient row: " +
            std::to_string((int)t_next) + "), counts " + c + ", groups " + g);
  Z(zopt_optimizer_set_tensor_step(o, 1, 7));
  c = counts(o);
  check(c == "3 7 3 1" && tt && tt[1] == 8,
        "set_tensor_step on a GPU step: count " + c + ", the device's t of tensor 1 is 8");
  // Refusals leave the mask as it was: the wrong length; during a capture.
  const uint8_t three[3] = {0, 0, 0};
  zopt_status st_n = zopt_optimizer_set_active(o, three, 3);
  void *cs = nullptr, *graph = nullptr;
  f.stream_create(&cs, 0);
  Z(zopt_optimizer_set_stream(o, cs));
  f.begin_capture(cs, 0);
  zopt_status st_cap = zopt_optimizer_set_active(o, mask, 4);
  std::string msg_cap = zopt_last_error();
  f.end_capture(cs, &graph);
  Z(zopt_optimizer_step(o, nullptr));
  f.drain_all();
  c = counts(o);
  check(st_n == ZOPT_ERR_INVALID_ARGUMENT && st_cap == ZOPT_ERR_BAD_STATE &&
            msg_cap.find("capturing a CUDA graph") != std::string::npos && c == "4 8 4 2" && act[1] == 1,
        "set_active refused with 3 entries for 4 tensors and during a capture (" + msg_cap +
            "); the mask stays all-active: counts " + c);
  // A checkpoint holds the per-tensor counts.
  std::string ck = "/tmp/zopt-host-check-active-" + std::to_string(getpid()) + ".ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  Setup s2 = make_optimizer(f, step, si, {33, 1000, 5000, 7});
  Z(zopt_optimizer_finalize(s2.o));
  Z(zopt_optimizer_load(s2.o, ck.c_str()));
  remove(ck.c_str());
  c = counts(s2.o), g = groups(s2.o);
  check(c == "4 8 4 2" && g == "4 2", "checkpoint round trip: per-tensor counts " + c + ", group counts " + g);
  f.set_emulation(0, 0);
  for (Setup *x : {&su, &s2}) {
    zopt_optimizer_free(x->o);
    for (size_t i = 0; i < x->dp.size(); ++i) {
      f.mem_free(x->dp[i]);
      f.mem_free(x->dg[i]);
    }
  }
}

// Views into flat buffers at odd element offsets (DeepSpeed, FSDP): the
// owned states of each tensor get the 16-byte phase of its param, so that
// the kernels' head (abi.h) reaches one element where every pointer is
// 16-byte aligned and the rest of the chunk takes vectors; a grad whose
// phase differs from its param's leaves that tensor scalar. The grads are
// views at the same element offsets into a flat buffer of the grad's dtype
// (an f32 buffer beside bf16 params: DeepSpeed's and FSDP's flat f32 grad
// buffers), so their byte offsets are those of the params times eg / ep.
void misaligned_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  const zopt_step_descriptor *d = si.d;
  const std::vector<int64_t> sizes = {7, 100, 3, 1000, 4097, 61};
  int64_t total = 0;
  for (int64_t n : sizes) total += n + 1;
  unsigned long long fp = 0, fg = 0;
  f.mem_alloc(&fp, (size_t)(total + 16) * si.ep);
  f.mem_alloc(&fg, (size_t)(total + 16) * si.eg);
  memset((void *)(uintptr_t)fp, 0, (size_t)(total + 16) * si.ep);
  zopt_optimizer *o = nullptr;
  Z(zopt_optimizer_create(step, &o));
  int gid = 0, id = 0;
  Z(zopt_optimizer_add_group(o, &gid));
  std::vector<uintptr_t> pv, gv;
  int64_t off = 1;  // every view starts at an odd element
  for (size_t t = 0; t < sizes.size(); ++t) {
    // The last tensor's grad is one element further than its param's phase.
    int64_t goff = off + (t + 1 == sizes.size() ? 1 : 0);
    pv.push_back((uintptr_t)fp + (uintptr_t)off * si.ep);
    gv.push_back((uintptr_t)fg + (uintptr_t)goff * si.eg);
    Z(zopt_optimizer_add_tensor(o, gid, (void *)pv.back(), (void *)gv.back(), sizes[t], (zopt_dtype)si.pdt, &id));
    off += sizes[t] + 1;
  }
  Z(zopt_optimizer_finalize(o));
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(o, nullptr));
  const unsigned long long *ptrs = nullptr;
  const zopt_gpu_chunk *ch = nullptr;
  int64_t nch = 0;
  for (const Rec &l : launches_since(f, l0))
    if (l.role == "UPDATE") {
      ptrs = (const unsigned long long *)(uintptr_t)l.args[0];
      ch = (const zopt_gpu_chunk *)(uintptr_t)l.args[2];
      nch = (int64_t)l.args[3];
    }
  // The kernels' head rule (abi.h) over every state pointer of the chunk.
  size_t emin = 4;
  for (uint32_t k = 0; k < d->num_states; ++k) emin = std::min(emin, dsize(d->states[k].dtype));
  const int64_t lanes = (int64_t)(16 / emin);
  bool same_phase_vector = true, other_scalar = true, owned_unaligned = false;
  for (int64_t c = 0; c < nch; ++c) {
    const size_t t = ch[c].segment;
    bool found = false;
    for (int64_t h = 0; h < lanes && !found; ++h) {
      bool all = true;
      for (uint32_t k = 0; k < d->num_states; ++k)
        all &= (ptrs[t * d->num_states + k] + (uint64_t)(ch[c].begin + h) * dsize(d->states[k].dtype)) % 16 == 0;
      found = all;
    }
    if (t + 1 == sizes.size()) other_scalar &= !found;
    else same_phase_vector &= found;
    for (uint32_t k = 0; k < d->num_states; ++k)
      if (d->states[k].kind != ZOPT_STATE_PARAM && d->states[k].kind != ZOPT_STATE_GRAD)
        owned_unaligned |= ptrs[t * d->num_states + k] % 16 != 0;
  }
  check(nch > 0 && same_phase_vector && owned_unaligned,
        "misaligned views: every chunk of a view whose param and grad share a 16-byte phase has one element where "
        "all its pointers (owned states laid out in the param's phase) are 16-byte aligned: a scalar head, then "
        "vectors");
  check(other_scalar, "misaligned views: a tensor whose grad has another phase than its param stays scalar");
  zopt_optimizer_free(o);
  f.mem_free(fp);
  f.mem_free(fg);
}

// A tensor of more than 2^32 elements (pure bf16 steps: no master): chunks
// never straddle a multiple of 2^32 elements, so the kernels' stochastic-
// rounding index_hi is the chunk's (begin + j) >> 32.
void big_checks(Fake &f, zopt_step *step) {
  const StepInfo si = info_of(step);
  const int64_t big = ((int64_t)1 << 32) + 3 * 65536 + 5;
  const std::vector<int64_t> sizes = {1000, big, 17};
  Setup su = make_optimizer(f, step, si, sizes);
  Z(zopt_optimizer_set_seed(su.o, 42));
  Z(zopt_optimizer_finalize(su.o));
  int l0 = f.num_launches();
  Z(zopt_optimizer_step(su.o, nullptr));
  const zopt_gpu_chunk *ch = nullptr;
  int64_t nch = 0;
  bool sr_args = false;
  for (const Rec &l : launches_since(f, l0))
    if (l.role == "UPDATE") {
      ch = (const zopt_gpu_chunk *)(uintptr_t)l.args[2];
      nch = (int64_t)l.args[3];
      sr_args = l.nargs == 9 && l.args[8] == 42;
    }
  int64_t chunk = 0;
  bool cover = ch && chunks_cover(ch, nch, sizes, &chunk);
  int64_t hi = 0, at_boundary = 0;
  for (int64_t c = 0; c < nch; ++c)
    if (ch[c].segment == 1 && (ch[c].begin >> 32) == 1) {
      ++hi;
      at_boundary += ch[c].begin == ((int64_t)1 << 32);
    }
  check(cover && hi > 0 && at_boundary == 1 && sr_args,
        "a tensor of 2^32 + " + std::to_string(big - ((int64_t)1 << 32)) + " elements: " + std::to_string(nch) +
            " chunks cover it, one starts at element 2^32 and " + std::to_string(hi) +
            " lie above it (index_hi 1), none straddles 2^32; UPDATE gets the globals and the seed");
  zopt_optimizer_free(su.o);
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_free(su.dp[i]);
    f.mem_free(su.dg[i]);
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3 || argc > 5) {
    fprintf(stderr, "usage: zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so [--big] | OFFLOAD_STEP.so CPU_TWIN.so "
                    "[--world=W] (with ZOPT_CUDA_DRIVER=FAKE_DRIVER.so)\n");
    return 2;
  }
  const char *env = getenv("ZOPT_CUDA_DRIVER");
  if (!env || strcmp(env, argv[1])) {
    fprintf(stderr, "ZOPT_CUDA_DRIVER must name the fake driver %s\n", argv[1]);
    return 2;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  Fake f;
#define SYM(field, name) *(void **)&f.field = dlsym(h, name)
  SYM(num_calls, "fake_cuda_num_calls");
  SYM(call, "fake_cuda_call");
  SYM(num_launches, "fake_cuda_num_launches");
  SYM(launch, "fake_cuda_launch");
  SYM(num_allocs, "fake_cuda_num_allocs");
  SYM(fail_next_launch, "fake_cuda_fail_next_launch");
  SYM(image_magic, "fake_cuda_image_magic");
  SYM(image_has_ptx, "fake_cuda_image_has_ptx");
  SYM(kernel_params, "fake_cuda_kernel_params");
  SYM(launch_context, "fake_cuda_launch_context");
  SYM(launch_nargs, "fake_cuda_launch_nargs");
  SYM(launch_replay, "fake_cuda_launch_replay");
  SYM(set_device_count, "fake_cuda_set_device_count");
  SYM(set_driver_version, "fake_cuda_set_driver_version");
  SYM(fail_attribute, "fake_cuda_fail_attribute");
  SYM(set_emulation, "fake_cuda_set_emulation");
  SYM(num_prepares, "fake_cuda_num_prepares");
  SYM(prepare_hypers, "fake_cuda_prepare_hypers");
  SYM(patch_params, "fake_cuda_patch_params");
  SYM(set_htod_delay, "fake_cuda_set_htod_delay");
  SYM(num_delayed_done, "fake_cuda_num_delayed_done");
  SYM(drain_all, "fake_cuda_drain_all");
  SYM(stream_enqueue, "fake_cuda_stream_enqueue");
  SYM(num_bad_ranges, "fake_cuda_num_bad_ranges");
  SYM(bad_range, "fake_cuda_bad_range");
  SYM(in_alloc, "fake_cuda_in_alloc");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(ctx_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_push, "cuCtxPushCurrent_v2");
  SYM(ctx_pop, "cuCtxPopCurrent_v2");
  SYM(ctx_current, "cuCtxGetCurrent");
  SYM(stream_create, "cuStreamCreate");
  SYM(stream_query, "cuStreamQuery");
  SYM(begin_capture, "cuStreamBeginCapture_v2");
  SYM(end_capture, "cuStreamEndCapture");
  SYM(instantiate, "cuGraphInstantiateWithFlags");
  SYM(graph_launch, "cuGraphLaunch");
#undef SYM
  if (!f.num_calls || !f.launch || !f.mem_alloc || !f.set_emulation || !f.graph_launch || !f.num_bad_ranges ||
      !f.in_alloc) {
    fprintf(stderr, "%s is not the fake driver\n", argv[1]);
    return 2;
  }

  zopt_step *step = nullptr;
  Z(zopt_step_load(argv[2], &step));
  const bool big = argc == 4 && !strcmp(argv[3], "--big");
  if (argc == 5) {
    if (strncmp(argv[4], "--world=", 8) || atoi(argv[4] + 8) < 2) {
      fprintf(stderr, "expected --world=W (W >= 2), got %s\n", argv[4]);
      return 2;
    }
    offload_ranks_check(f, step, argv[2], argv[3], atoi(argv[4] + 8));
  } else if (argc == 4 && !big) {
    offload_check(f, step, argv[3]);
  } else {
    gpu_main_check(f, step, argv[2]);
    driver_checks(f, step);
    device_checks(f, step);
    graph_checks(f, step);
    active_checks(f, step);
    misaligned_checks(f, step);
    if (big) big_checks(f, step);
  }
  {
    const int nb = f.num_bad_ranges();
    check(nb == 0, "no copy or memset outside a device allocation (the stand-in refuses them)" +
                       (nb ? ": " + std::to_string(nb) + ", the first " + f.bad_range(0) : std::string()));
  }
  zopt_step_free(step);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

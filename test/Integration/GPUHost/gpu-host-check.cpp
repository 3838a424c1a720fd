//===- gpu-host-check.cpp - the runtime's host side of a GPU step ------------===//
//
//   zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so
//   zopt-gpu-host-check FAKE_DRIVER.so OFFLOAD_STEP.so CPU_TWIN.so
//
// Runs a GPU step against libzopt-fake-cuda.so (set ZOPT_CUDA_DRIVER to the
// same path): "device" memory is host memory and kernels are only recorded,
// so this checks everything the runtime does around the kernels, on any
// machine: the image handed to cuModuleLoadData, the segment and state
// tables, the device-resident step state (globals table, loss scaler), the
// launch sequence of a step (PREPARE, SUMSQ, UPDATE, FINISH on the user's
// stream, with no host synchronisation, allocation or device-to-host copy
// inside zopt_optimizer_step, and the hyperparameter upload only when a
// value changed), results read back on demand, launch errors, and GPU
// checkpoints. The numerics of the kernels are checked on a real GPU by
// zopt-gpu-check (test/Integration/CUDA).
//
// An offloaded step (params/grads on the GPU, states and kernels on the CPU)
// runs completely here: its "device" copies are memcpys and its kernels are
// CPU kernels. It is compared bit for bit with CPU_TWIN.so (the same
// description with everything on the CPU) over several steps with changing
// grads, a skipped step and a checkpoint, and its copies are counted.
//===----------------------------------------------------------------------===//
#include "zopt/zopt.h"
#include "../check_util.h"

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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
  void (*set_update_nargs)(int);
  unsigned (*image_magic)();
  int (*mem_alloc)(unsigned long long *, size_t);
};

bool ends_with(const std::string &s, const char *suf) {
  size_t n = strlen(suf);
  return s.size() >= n && s.compare(s.size() - n, n, suf) == 0;
}

int offload_check(Fake &f, zopt_step *step, const char *twin_path) {
  zopt_step *twin = nullptr;
  Z(zopt_step_load(twin_path, &twin));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  int pi = -1;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == ZOPT_STATE_PARAM) pi = (int)i;
  const uint32_t pdt = d->states[pi].dtype;
  const bool reads_param = d->states[pi].access & ZOPT_ACCESS_READ;
  const size_t es = pdt == ZOPT_DTYPE_F32 ? 4 : 2;
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
    f.mem_alloc(&dp[t], sizes[t] * es);
    f.mem_alloc(&dg[t], sizes[t] * es);
    hp[t].resize(sizes[t] * es);
    hg[t].resize(sizes[t] * es);
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
  zopt_optimizer_free(o);
  zopt_optimizer_free(c);
  zopt_step_free(twin);
  int halloc = 0, hfree = 0;
  for (int i = 0; i < f.num_calls(); ++i) {
    halloc += !strcmp(f.call(i), "cuMemHostAlloc");
    hfree += !strcmp(f.call(i), "cuMemFreeHost");
  }
  check(halloc == hfree, "offload: every pinned staging buffer freed");
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr, "usage: zopt-gpu-host-check FAKE_DRIVER.so GPU_STEP.so | OFFLOAD_STEP.so CPU_TWIN.so "
                    "(with ZOPT_CUDA_DRIVER=FAKE_DRIVER.so)\n");
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
  *(void **)&f.num_calls = dlsym(h, "fake_cuda_num_calls");
  *(void **)&f.call = dlsym(h, "fake_cuda_call");
  *(void **)&f.num_launches = dlsym(h, "fake_cuda_num_launches");
  *(void **)&f.launch = dlsym(h, "fake_cuda_launch");
  *(void **)&f.num_allocs = dlsym(h, "fake_cuda_num_allocs");
  *(void **)&f.fail_next_launch = dlsym(h, "fake_cuda_fail_next_launch");
  *(void **)&f.set_update_nargs = dlsym(h, "fake_cuda_set_update_nargs");
  *(void **)&f.image_magic = dlsym(h, "fake_cuda_image_magic");
  *(void **)&f.mem_alloc = dlsym(h, "cuMemAlloc_v2");
  if (!f.num_calls || !f.launch || !f.mem_alloc) {
    fprintf(stderr, "%s is not the fake driver\n", argv[1]);
    return 2;
  }

  zopt_step *step = nullptr;
  Z(zopt_step_load(argv[2], &step));
  if (argc == 4) {
    offload_check(f, step, argv[3]);
    zopt_step_free(step);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
  }
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE, has_sumsq = d->flags & ZOPT_FLAG_SUMSQ;
  uint32_t pdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
  const size_t es = pdt == ZOPT_DTYPE_F32 ? 4 : 2;

  const bool sr = d->flags & ZOPT_FLAG_STOCHASTIC;
  f.set_update_nargs(sr ? 7 : 5);
  zopt_optimizer *o = nullptr;
  Z(zopt_optimizer_create(step, &o));
  check(f.image_magic() == 0xBA55ED50u, "cuModuleLoadData got a CUDA fatbinary (magic 0xBA55ED50)");
  const uint64_t seed = 0x0123456789ABCDEFull;
  if (sr) Z(zopt_optimizer_set_seed(o, seed));

  // Two groups, tensors of odd sizes, params/grads in "device" memory.
  const std::vector<int64_t> sizes = {1, 7, 17, 100, 1000, 4097};
  int gid[2];
  for (int k = 0; k < 2; ++k) {
    Z(zopt_optimizer_add_group(o, &gid[k]));
    Z(zopt_optimizer_set_hyper(o, gid[k], "lr", k ? 3e-3 : 1e-3));
  }
  std::vector<unsigned long long> dp(sizes.size()), dg(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    f.mem_alloc(&dp[i], sizes[i] * es);
    f.mem_alloc(&dg[i], sizes[i] * es);
    memset((void *)(uintptr_t)dp[i], 0, sizes[i] * es);  // 0.0 in every dtype
    int id = 0;
    Z(zopt_optimizer_add_tensor(o, gid[i % 2], (void *)(uintptr_t)dp[i], (void *)(uintptr_t)dg[i], sizes[i],
                                (zopt_dtype)pdt, &id));
  }
  {
    std::vector<char> host(64), hostg(64);
    int id = 0;
    zopt_status st = zopt_optimizer_add_tensor(o, gid[0], host.data(), hostg.data(), 16, (zopt_dtype)pdt, &id);
    check(st == ZOPT_ERR_INVALID_ARGUMENT && strstr(zopt_last_error(), "not CUDA device memory"),
          std::string("host pointers refused: ") + zopt_last_error());
  }
  if (ls) {
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 3, 1.0, 1};
    Z(zopt_optimizer_configure_loss_scaler(o, &c));
  }
  Z(zopt_optimizer_finalize(o));
  void *const stream = (void *)0x5157;
  Z(zopt_optimizer_set_stream(o, stream));

  // ---- one step: the launch sequence, nothing synchronous --------------------
  int c0 = f.num_calls(), l0 = f.num_launches(), a0 = f.num_allocs();
  zopt_step_result r{};
  Z(zopt_optimizer_step(o, &r));
  int c1 = f.num_calls(), l1 = f.num_launches();
  std::string seq;
  int syncs = 0, allocs = 0, dtoh = 0, htod = 0;
  for (int i = c0; i < c1; ++i) {
    std::string c = f.call(i);
    syncs += c == "cuStreamSynchronize";
    allocs += c == "cuMemAlloc";
    dtoh += c == "cuMemcpyDtoHAsync";
    htod += c == "cuMemcpyHtoDAsync";
  }
  check(syncs == 0 && allocs == 0 && dtoh == 0 && f.num_allocs() == a0,
        "step 1: no cuStreamSynchronize, cuMemAlloc or device-to-host copy (syncs=" + std::to_string(syncs) +
            " allocs=" + std::to_string(allocs) + " dtoh=" + std::to_string(dtoh) + ")");
  check(htod == 1, "step 1: one host-to-device copy (the hyperparameter table), got " + std::to_string(htod));
  unsigned grid[3], block[3];
  void *s = nullptr;
  unsigned long long args[12];
  std::vector<std::string> names;
  bool on_stream = true;
  unsigned long long d_hypers = 0, d_globals = 0, d_states = 0, d_segs = 0, d_sg = 0, d_scaler = 0, nseg = 0,
                     ngroups = 0;
  for (int i = l0; i < l1; ++i) {
    std::string n = f.launch(i, grid, block, &s, args);
    on_stream &= s == stream;
    if (ends_with(n, "_prepare_gpu")) { names.push_back("PREPARE"); d_hypers = args[0]; d_globals = args[1]; ngroups = args[2]; }
    else if (ends_with(n, "_sumsq")) { names.push_back("SUMSQ"); d_sg = args[5]; }
    else if (ends_with(n, "_update")) {
      names.push_back("UPDATE");
      d_states = args[0]; d_segs = args[1]; nseg = args[2];
      check(args[4] == d_sg, "UPDATE reads the SUMSQ step globals (or NULL without SUMSQ)");
      if (sr)
        check(args[5] == d_globals && args[6] == seed,
              "stochastic rounding: UPDATE gets the device globals (step t) and the seed");
    }
    else if (ends_with(n, "_finish")) {
      names.push_back("FINISH");
      check(grid[0] == 1 && args[0] == d_globals && args[1] == ngroups && args[2] == d_sg,
            "FINISH: one block, the globals table, the group count and the step globals");
      d_scaler = args[3];
      check((d_scaler != 0) == ls, "FINISH gets the loss scaler exactly when the step scales the loss");
    } else names.push_back("?" + n);
  }
  for (auto &n : names) seq += n + " ";
  check(seq == (has_sumsq ? "PREPARE SUMSQ UPDATE FINISH " : "PREPARE UPDATE FINISH "), "launch order: " + seq);
  check(on_stream, "every launch on the stream given to zopt_optimizer_set_stream");
  check(std::isnan(r.grad_norm) && r.skipped == 0, "step()'s result is left to zopt_optimizer_gpu_result");

  // ---- the tables the kernels read ------------------------------------------
  check(ngroups == 2 && nseg == sizes.size(), "2 groups, one segment per tensor");
  const zopt_gpu_segment *segs = (const zopt_gpu_segment *)(uintptr_t)d_segs;
  const unsigned long long *ptrs = (const unsigned long long *)(uintptr_t)d_states;
  bool segs_ok = true, ptrs_ok = true;
  for (size_t t = 0; t < sizes.size(); ++t) {
    segs_ok &= segs[t].n == sizes[t] && segs[t].group == t % 2 && segs[t].tensor == t;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      unsigned long long p = ptrs[t * d->num_states + k];
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM) ptrs_ok &= p == dp[t];
      else if (kind == ZOPT_STATE_GRAD) ptrs_ok &= p == dg[t];
      else ptrs_ok &= p != 0 && p % 16 == 0;  // owned: 16-byte aligned segments
    }
  }
  check(segs_ok, "segment table: n, group and tensor index of every tensor");
  check(ptrs_ok, "state table: the user's param/grad pointers, 16-byte aligned owned states");
  const double *hy = (const double *)(uintptr_t)d_hypers;
  int lr_i = -1;
  for (uint32_t i = 0; i < d->num_hypers; ++i)
    if (d->hypers[i].kind == ZOPT_HYPER_LR) lr_i = (int)i;
  check(lr_i >= 0 && hy[lr_i] == 1e-3 && hy[d->num_hypers + lr_i] == 3e-3, "hyperparameter table: lr per group");
  double *gl = (double *)(uintptr_t)d_globals;
  check(gl[ZOPT_GLOBAL_STEP] == 1 && gl[ZOPT_GLOBAL_CLIP_COEF] == 1 &&
            gl[ZOPT_GLOBAL_GRAD_SCALE] == (ls ? 1.0 / 1024 : 1.0) && gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] == 1,
        "globals table on the device: t = 1, clip 1, 1/S for each group");
  if (ls) {
    const zopt_gpu_scaler *sc = (const zopt_gpu_scaler *)(uintptr_t)d_scaler;
    check(sc->scale == 1024 && sc->growth_factor == 2 && sc->backoff_factor == 0.5 && sc->growth_interval == 3 &&
              sc->min_scale == 1 && sc->dynamic == 1 && sc->good_steps == 0,
          "loss scaler on the device: the configured scaler");
  }

  // ---- a second step: no upload when nothing changed -------------------------
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  c1 = f.num_calls();
  int copies = 0, launches = 0;
  for (int i = c0; i < c1; ++i) {
    copies += !strncmp(f.call(i), "cuMemcpy", 8) || !strcmp(f.call(i), "cuStreamSynchronize");
    launches += !strcmp(f.call(i), "cuLaunchKernel");
  }
  check(copies == 0 && launches == (has_sumsq ? 4 : 3),
        "step 2: only the launches (no copy, no sync) when no hyperparameter changed");
  Z(zopt_optimizer_set_hyper(o, gid[0], "lr", 1e-3));  // same value
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  copies = 0;
  for (int i = c0; i < f.num_calls(); ++i) copies += !strncmp(f.call(i), "cuMemcpy", 8);
  check(copies == 0, "setting lr to its current value uploads nothing");
  Z(zopt_optimizer_set_hyper(o, gid[0], "lr", 5e-4));
  c0 = f.num_calls();
  Z(zopt_optimizer_step(o, nullptr));
  copies = 0;
  for (int i = c0; i < f.num_calls(); ++i) copies += !strcmp(f.call(i), "cuMemcpyHtoDAsync");
  check(copies == 1 && hy[lr_i] == 5e-4, "a changed lr is uploaded once, before the next step's launches");

  // ---- the step state is the device's: emulate FINISH, read it back ---------
  // 4 steps ran; the fake runs no kernel, so write what FINISH would have:
  // 3 applied, 1 skipped (t_next = 4) and, with loss scaling, a backoff.
  gl[ZOPT_GLOBAL_STEP] = 4;
  gl[ZOPT_NUM_GLOBALS + ZOPT_GLOBAL_STEP] = 4;
  zopt_gpu_step_globals *sgp = (zopt_gpu_step_globals *)(uintptr_t)d_sg;
  if (has_sumsq) {
    sgp->norm = 2.5;
    sgp->skip = 1;
  }
  if (ls) {
    zopt_gpu_scaler *sc = (zopt_gpu_scaler *)(uintptr_t)d_scaler;
    sc->last_scale = 1024;
    sc->scale = 512;
    sc->good_steps = 0;
  }
  int64_t cnt = -1;
  c0 = f.num_calls();
  Z(zopt_optimizer_get_step_count(o, 1, &cnt));
  syncs = 0;
  for (int i = c0; i < f.num_calls(); ++i) syncs += !strcmp(f.call(i), "cuStreamSynchronize");
  check(cnt == 3 && syncs == 1, "get_step_count reads the device's count (one stream sync): " + std::to_string(cnt));
  zopt_step_result gr{};
  Z(zopt_optimizer_gpu_result(o, &gr));
  if (has_sumsq)
    check(gr.grad_norm == 2.5 && gr.skipped == 1, "gpu_result: the device's norm and skip flag");
  else
    check(std::isnan(gr.grad_norm) && gr.skipped == 0, "gpu_result without a norm reduction: NaN, not skipped");
  double scale = 0;
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(gr.loss_scale == (ls ? 1024 : 1) && scale == (ls ? 512 : 1),
        "loss scale: the step's (gpu_result) and the next step's (get_loss_scale) from the device");

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
  std::string ck = std::string(argv[2]) + ".host-check.ckpt";
  Z(zopt_optimizer_save(o, ck.c_str()));
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t k = 0; k < d->num_states; ++k) {
      uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
      std::vector<float> z(sizes[t], -7.f);
      Z(zopt_optimizer_write_state_f32(o, (int)t, (zopt_state_kind)kind, z.data(), sizes[t]));
    }
  gl[ZOPT_GLOBAL_STEP] = 100;  // as if more steps ran
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
  check(cnt == 3 && gl[ZOPT_GLOBAL_STEP] == 4, "checkpoint round trip: step count 3, device t_next = 4");
  Z(zopt_optimizer_get_loss_scale(o, &scale));
  check(scale == (ls ? 512 : 1), "checkpoint round trip: loss scale");
  remove(ck.c_str());

  zopt_optimizer_free(o);
  zopt_step_free(step);
  check(f.num_allocs() == 2 * (int)sizes.size(), "zopt_optimizer_free releases every device buffer it allocated");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

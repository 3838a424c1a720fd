//===- gpu-host-check.h - what the files of zopt-gpu-host-check share -----===//
//
// zopt-gpu-host-check (gpu-host-check.cpp says what it checks) in files by
// concern: gpu-host-check.cpp (main: the stand-in's table, the run),
// gpu-host-offload.cpp (offloaded steps against their CPU twin, one rank
// and W), gpu-host-pipeline.cpp (bucket readiness and speculation against
// the serial step and the twin), gpu-host-params-back.cpp (the params'
// copies back per bucket, their order and events), gpu-host-step.cpp (a GPU step's tables, launches, device state,
// hyperparameters, results and checkpoints), gpu-host-driver.cpp (driver
// versions, launch errors, devices and contexts), gpu-host-graph.cpp (CUDA
// graphs replayed on another stream), gpu-host-tensors.cpp (the active
// mask, misaligned views, tensors past 2^32 elements). This header: the
// stand-in's introspection table (Fake), the launch records, a GPU
// optimizer over stand-in memory, an offloaded step's model beside its CPU
// twin's (Side, add_twin_tensors), and the small helpers.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_GPU_HOST_CHECK_H
#define ZOPT_TEST_GPU_HOST_CHECK_H

#include "zopt/abi.h"
#include "zopt/comm.h"
#include "zopt/zopt.h"
#include "../check_util.h"
#include "zopt_reference.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace ghc {

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
  void (*fail_memset)(int);
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
  int (*num_htod)();
  void (*htod)(int, unsigned long long *, size_t *, void **);
  void (*hold_htod)(unsigned long long, unsigned long long);
  void (*release_htod)();
  void (*stall_htod)(unsigned long long, unsigned long long);
  void (*fail_htod)(unsigned long long, unsigned long long);
  // The driver API itself (the test plays the application).
  int (*mem_alloc)(unsigned long long *, size_t);
  int (*mem_free)(unsigned long long);
  int (*ctx_retain)(void **, int);
  int (*ctx_push)(void *);
  int (*ctx_pop)(void **);
  int (*ctx_current)(void **);
  int (*stream_create)(void **, unsigned);
  int (*stream_query)(void *);
  int (*mem_host_alloc)(void **, size_t, unsigned);
  int (*mem_free_host)(void *);
  int (*memcpy_dtoh_async)(void *, unsigned long long, size_t, void *);
  int (*begin_capture)(void *, int);
  int (*end_capture)(void *, void **);
  int (*instantiate)(void **, void *, unsigned long long);
  int (*graph_launch)(void *, void *);
};

using zopt_ref::dtype_name;
using zopt_ref::dtype_size;
// The storage bytes of state s of a tensor of n elements (a PER_BLOCK
// state, a q8 absmax: one element per ZOPT_Q8_BLOCK).
inline size_t state_bytes(const zopt_step_descriptor *d, uint32_t s, int64_t n) {
  if (d->states[s].flags & ZOPT_STATE_PER_BLOCK) n = (n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK;
  return (size_t)n * dtype_size(d->states[s].dtype);
}
inline const char *state_kind_name_of(uint32_t k) {
  return k == ZOPT_STATE_PARAM ? "param" : k == ZOPT_STATE_GRAD ? "grad" : k == ZOPT_STATE_MASTER ? "master"
         : k == ZOPT_STATE_EXP_AVG ? "exp_avg" : k == ZOPT_STATE_EXP_AVG_SQ ? "exp_avg_sq" : "state";
}

// The storage bytes of x (exactly representable in dtype dt) in dt.
inline std::vector<unsigned char> storage_of(const std::vector<float> &x, uint32_t dt) {
  std::vector<unsigned char> out(x.size() * dtype_size(dt));
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
inline std::vector<float> exact_values(int64_t n, int salt) {
  std::vector<float> v((size_t)n);
  for (int64_t i = 0; i < n; ++i) v[(size_t)i] = (float)((i * 7 + salt) % 61 - 30) * 0.125f;
  return v;
}

inline bool ends_with(const std::string &s, const char *suf) {
  size_t n = strlen(suf);
  return s.size() >= n && s.compare(s.size() - n, n, suf) == 0;
}

// ---- GPU steps -------------------------------------------------------------

struct StepInfo {
  const zopt_step_descriptor *d;
  bool ls, has_sumsq, sr, master;
  uint32_t pdt, gdt;  // param and grad dtypes: the grad's may be f32 for a 16-bit param
  size_t ep, eg;      // their element sizes
  int lr_i = -1;
};

inline StepInfo info_of(zopt_step *step) {
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
  i.ep = dtype_size(i.pdt);
  i.eg = dtype_size(i.gdt);
  return i;
}

struct Rec {
  std::string name, role;
  unsigned grid[3], block[3];
  void *stream, *ctx;
  unsigned long long args[12];
  int nargs, replay;
};

inline std::string role_of(const std::string &n) {
  return ends_with(n, "_prepare_gpu") ? "PREPARE"
         : ends_with(n, "_sumsq")     ? "SUMSQ"
         : ends_with(n, "_update")    ? "UPDATE"
         : ends_with(n, "_finish")    ? "FINISH"
         : ends_with(n, "_init_gpu")  ? "INIT"
                                      : "?" + n;
}

inline std::vector<Rec> launches_since(Fake &f, int from) {
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

inline int calls_since(Fake &f, int from, const char *name) {
  int n = 0;
  for (int i = from; i < f.num_calls(); ++i) n += !strcmp(f.call(i), name);
  return n;
}

inline std::string seq_of(const std::vector<Rec> &ls) {
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

inline Setup make_optimizer(Fake &f, zopt_step *step, const StepInfo &si, const std::vector<int64_t> &sizes) {
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

// ---- offloaded steps against their CPU twin ----------------------------------

// One optimizer over the model: an offloaded one's params and grads in
// stand-in device memory (dp, dg), the CPU twin's in host memory (hp, hg).
struct Side {
  zopt_optimizer *o = nullptr;
  std::vector<unsigned long long> dp, dg;          // device (offloaded)
  std::vector<std::vector<unsigned char>> hp, hg;  // host (the twin)
  void *stream = nullptr;
};

// The checks' random values in [-1, 1): the next of a linear congruential
// generator whose state is `rng`.
inline float lcg(unsigned &rng) {
  rng = rng * 1664525u + 1013904223u;
  return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}
// A vector of lcg values per tensor of `sizes`, in order.
inline std::vector<std::vector<float>> lcg_values(const std::vector<int64_t> &sizes, unsigned &rng) {
  std::vector<std::vector<float>> v(sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    v[t].resize((size_t)sizes[t]);
    for (float &x : v[t]) x = lcg(rng);
  }
  return v;
}

// Groups in each optimizer, group k's lr lrs[k].
inline void add_groups(const std::vector<zopt_optimizer *> &opts, const std::vector<double> &lrs) {
  for (zopt_optimizer *o : opts)
    for (double lr : lrs) {
      int id = 0;
      Z(zopt_optimizer_add_group(o, &id));
      Z(zopt_optimizer_set_hyper(o, id, "lr", lr));
    }
}

// Tensors of `sizes` (tensor t in group t % G) in the offloaded optimizers
// `dev` (params and grads in new stand-in device memory) and the twin (in
// host memory); the params `init`, written through the twin, their bytes
// copied to every device param.
inline void add_twin_tensors(Fake &f, const std::vector<Side *> &dev, Side &twin, const std::vector<int64_t> &sizes,
                             int G, uint32_t pdt, uint32_t gdt, const std::vector<std::vector<float>> &init) {
  const size_t ep = dtype_size(pdt), eg = dtype_size(gdt);
  for (size_t t = 0; t < sizes.size(); ++t) {
    const int g = (int)(t % (size_t)G);
    int id = 0;
    for (Side *x : dev) {
      x->dp.push_back(0);
      x->dg.push_back(0);
      f.mem_alloc(&x->dp[t], sizes[t] * ep);
      f.mem_alloc(&x->dg[t], sizes[t] * eg);
      Z(zopt_optimizer_add_tensor(x->o, g, (void *)(uintptr_t)x->dp[t], (void *)(uintptr_t)x->dg[t], sizes[t],
                                  (zopt_dtype)pdt, &id));
    }
    twin.hp.emplace_back(sizes[t] * ep);
    twin.hg.emplace_back(sizes[t] * eg);
    Z(zopt_optimizer_add_tensor(twin.o, g, twin.hp[t].data(), twin.hg[t].data(), sizes[t], (zopt_dtype)pdt, &id));
    Z(zopt_optimizer_write_state_f32(twin.o, (int)t, ZOPT_STATE_PARAM, init[t].data(), sizes[t]));
    for (Side *x : dev) memcpy((void *)(uintptr_t)x->dp[t], twin.hp[t].data(), twin.hp[t].size());  // same bytes
  }
}

// With loss scaling (`ls`): the same scaler in each optimizer, its growth
// interval 2.
inline void configure_scalers(bool ls, const std::vector<zopt_optimizer *> &opts) {
  if (!ls) return;
  zopt_loss_scaler_config cfg = {1024.0, 2.0, 0.5, 2, 1.0, 1};
  for (zopt_optimizer *o : opts) Z(zopt_optimizer_configure_loss_scaler(o, &cfg));
}

// The chunk table of an UPDATE launch: every element of every tensor
// exactly once, in order, chunks of at most `chunk` elements at multiples of
// it (so none straddles a multiple of 2^32 elements).
// Where an optimizer's T tensors sit in its buckets, as the params-back
// and tail checks use it: `buckets_of` per tensor its buckets,
// `only_last` the tensors in bucket nb-1 alone,
// `held` a tensor in bucket 0 alone (-1: none; bucket 0 is the last copied
// back).
struct BucketMap {
  int nb = 0;
  std::vector<std::vector<int>> buckets_of;
  std::vector<int> only_last;
  int held = -1;
};
inline BucketMap bucket_map(zopt_optimizer *o, size_t T) {
  BucketMap m;
  Z(zopt_optimizer_num_buckets(o, &m.nb));
  m.buckets_of.assign(T, {});
  for (int b = 0; b < m.nb; ++b) {
    int ids[64], n = 0;
    Z(zopt_optimizer_bucket_tensors(o, b, ids, 64, &n));
    for (int i = 0; i < n; ++i) m.buckets_of[ids[i]].push_back(b);
  }
  for (size_t t = 0; t < T; ++t) {
    if (m.buckets_of[t] == std::vector<int>{m.nb - 1}) m.only_last.push_back((int)t);
    if (m.buckets_of[t] == std::vector<int>{0}) m.held = (int)t;
  }
  return m;
}

// Every state of the tensors (GRAD left out; PARAM too unless
// `with_param`) bit-identical in the three optimizers, read through
// zopt_optimizer_read_state_raw (which joins an offloaded step's tail).
inline bool states_identical(const zopt_step_descriptor *d, const std::vector<int64_t> &sizes, zopt_optimizer *a,
                             zopt_optimizer *b, zopt_optimizer *c, bool with_param = true) {
  bool same = true;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (uint32_t s = 0; s < d->num_states; ++s) {
      uint32_t kind = d->states[s].kind;
      if (kind == ZOPT_STATE_GRAD || (kind == ZOPT_STATE_PARAM && !with_param)) continue;
      size_t n = state_bytes(d, s, sizes[t]);
      std::vector<unsigned char> x(n), y(n), z(n);
      Z(zopt_optimizer_read_state_raw(a, (int)t, (zopt_state_kind)kind, x.data(), n));
      Z(zopt_optimizer_read_state_raw(b, (int)t, (zopt_state_kind)kind, y.data(), n));
      Z(zopt_optimizer_read_state_raw(c, (int)t, (zopt_state_kind)kind, z.data(), n));
      same &= x == y && x == z;
    }
  return same;
}

inline bool chunks_cover(const zopt_gpu_chunk *ch, int64_t nch, const std::vector<int64_t> &sizes, int64_t *chunk) {
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

// The checks, by file.
int offload_check(Fake &f, zopt_step *step, const char *twin_path);
void offload_ranks_check(Fake &f, zopt_step *step, const char *step_path, const char *twin_path, int W,
                         bool pipelined = false, bool tail = false);
void pipeline_check(Fake &f, zopt_step *step, const char *twin_path);
void params_back_check(Fake &f, zopt_step *step, const char *twin_path);
void tail_check(Fake &f, zopt_step *step, const char *twin_path);
int gpu_main_check(Fake &f, zopt_step *step, const char *path);
void driver_checks(Fake &f, zopt_step *step);
void device_checks(Fake &f, zopt_step *step);
void graph_checks(Fake &f, zopt_step *step);
void rebind_checks(Fake &f, zopt_step *step);
void active_checks(Fake &f, zopt_step *step);
void misaligned_checks(Fake &f, zopt_step *step);
void big_checks(Fake &f, zopt_step *step);

}  // namespace ghc

#endif

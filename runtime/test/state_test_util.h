// state_test_util.h - the model, the ranks and the snapshots of
// zopt-state-check (state_check.cpp): one rank's optimizer over its own copy
// of the model (host memory, or the stand-in CUDA driver's), every state
// read back whole and compared bit for bit, W ranks as loopback threads.
#ifndef ZOPT_STATE_TEST_UTIL_H
#define ZOPT_STATE_TEST_UTIL_H

#include "ckpt_test_util.h"
#include "rank_test_util.h"

#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace stt {

inline const std::vector<int64_t> kOld = {3, 1000, 70001, 5, 0, 33333};
inline const std::vector<int> kOldG = {0, 1, 0, 1, 1, 0};
inline const std::vector<int64_t> kNew = {130000, 7, 2049};
inline const std::vector<int> kNewG = {1, 2, 2};  // group 2 is new

inline std::string g_step, g_dir, g_name;
inline int g_world = 1;
inline std::mutex g_mu;
inline int g_fail = 0, g_pass = 0;

inline void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
inline void report(bool ok, const char *fmt, ...) {
  char m[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_mu);
  (ok ? g_pass : g_fail)++;
  printf("%s %s W=%d: %s\n", ok ? "PASS" : "FAIL", g_name.c_str(), g_world, m);
  fflush(stdout);
}

inline size_t esz(uint32_t dt) { return rtu::dtype_size(dt); }
// Elements of state sd for n elements of its tensor (a q8 absmax: one per
// block of 256, abi.h "q8 moments").
inline int64_t selems(const zopt_state_desc &sd, int64_t n) {
  return (sd.flags & ZOPT_STATE_PER_BLOCK) ? (n + 255) / 256 : n;
}
inline bool is_q8_state(const zopt_state_desc &sd) {
  return sd.dtype == ZOPT_DTYPE_Q8 || (sd.flags & ZOPT_STATE_PER_BLOCK);
}
// Whether q8 state bytes b (n elements of the tensor) are as at finalize:
// every code the zero code, every absmax +0.
inline bool q8_fresh(const zopt_state_desc &sd, const std::vector<unsigned char> &b, int64_t n) {
  if (sd.dtype == ZOPT_DTYPE_Q8) {
    const unsigned char z = sd.kind == ZOPT_STATE_EXP_AVG_SQ ? ZOPT_Q8_UNSIGNED_ZERO : ZOPT_Q8_SIGNED_ZERO;
    for (int64_t i = 0; i < n; ++i)
      if (b[(size_t)i] != z) return false;
    return true;
  }
  for (int64_t i = 0; i < selems(sd, n) * 4; ++i)
    if (b[(size_t)i]) return false;
  return true;
}
using rtu::load;
using rtu::store;
using rtu::value;
inline bool is_owned(uint32_t kind) { return kind != ZOPT_STATE_PARAM && kind != ZOPT_STATE_GRAD; }

// The model's memory: host memory, or (--device-memory=FAKE.so, for
// offloaded steps) the stand-in CUDA driver's "device" memory, which is
// host memory the test reads and writes directly.
inline int (*g_dev_alloc)(unsigned long long *, size_t) = nullptr;
inline int (*g_dev_free)(unsigned long long) = nullptr;
inline unsigned char *mem_alloc(size_t bytes) {
  if (!g_dev_alloc) return (unsigned char *)calloc(bytes, 1);
  unsigned long long d = 0;
  if (g_dev_alloc(&d, bytes)) abort();
  memset((void *)(uintptr_t)d, 0, bytes);
  return (unsigned char *)(uintptr_t)d;
}
inline void mem_free(unsigned char *m) {
  if (!g_dev_alloc) free(m);
  else g_dev_free((unsigned long long)(uintptr_t)m);
}
inline const char *kHyperNames[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening", "bias_correction"};

// Everything an optimizer holds, whole; compared bit for bit.
struct Snap {
  std::vector<std::vector<std::vector<unsigned char>>> st;  // [tensor][descriptor state] (GRAD empty)
  std::vector<int64_t> steps, gcounts;
  std::vector<double> hypers;
  std::vector<uint32_t> gflags;
  double scale = 0;
  int64_t good = 0;
  zopt_loss_scaler_config cfg{};
  uint64_t seed = 0;
  bool same_cfg(const Snap &o) const {
    return cfg.init_scale == o.cfg.init_scale && cfg.growth_factor == o.cfg.growth_factor &&
           cfg.backoff_factor == o.cfg.backoff_factor && cfg.growth_interval == o.cfg.growth_interval &&
           cfg.min_scale == o.cfg.min_scale && cfg.dynamic == o.cfg.dynamic;
  }
  bool operator==(const Snap &o) const {
    return st == o.st && steps == o.steps && gcounts == o.gcounts && hypers == o.hypers && gflags == o.gflags &&
           scale == o.scale && good == o.good && same_cfg(o) && seed == o.seed;
  }
  bool operator!=(const Snap &o) const { return !(*this == o); }
};
// Where two snapshots differ first ("" if nowhere).
inline std::string diff(const Snap &a, const Snap &b) {
  if (a.st.size() != b.st.size()) return "tensor counts";
  for (size_t t = 0; t < a.st.size(); ++t)
    for (size_t s = 0; s < a.st[t].size(); ++s)
      if (a.st[t][s] != b.st[t][s]) return "tensor " + std::to_string(t) + " state " + std::to_string(s);
  if (a.steps != b.steps) return "tensor steps";
  if (a.gcounts != b.gcounts) return "group step counts";
  if (a.hypers != b.hypers || a.gflags != b.gflags) return "hyperparameters or group flags";
  if (a.scale != b.scale || a.good != b.good || !a.same_cfg(b)) return "loss scaler";
  if (a.seed != b.seed) return "seed";
  return "";
}

// One rank's optimizer over its own copy of the model.
struct Rank {
  int r = 0;
  zopt_step *step = nullptr;
  zopt_optimizer *o = nullptr;
  const zopt_step_descriptor *d = nullptr;
  uint32_t pdt = ZOPT_DTYPE_F32, gdt = ZOPT_DTYPE_F32;
  bool zero3 = false;
  std::vector<int64_t> n;
  std::vector<int> grp;
  int ngroups = 0;
  size_t reg = 0;  // tensors registered (the first `reg` of the model)
  std::vector<unsigned char *> p, g;  // the model's params and grads (mem_alloc)
  ~Rank() {
    zopt_optimizer_free(o);
    zopt_step_free(step);
    for (unsigned char *m : p) mem_free(m);
    for (unsigned char *m : g) mem_free(m);
  }
  // The model's params (copies), and written back (the caller restores the
  // model before a load: docs/CHECKPOINT.md; through the optimizer, after
  // its pending copies of an offloaded step).
  std::vector<std::vector<unsigned char>> params() const {
    std::vector<std::vector<unsigned char>> v;
    for (size_t t = 0; t < reg; ++t) {
      v.emplace_back((size_t)n[t] * esz(pdt) + 1, 0);
      zopt_optimizer_read_state_raw(o, (int)t, ZOPT_STATE_PARAM, v.back().data(), v.back().size() - 1);
    }
    return v;
  }
  bool set_params(const std::vector<std::vector<unsigned char>> &v) {
    for (size_t t = 0; t < reg; ++t)
      if (zopt_optimizer_write_state_raw(o, (int)t, ZOPT_STATE_PARAM, v[t].data(), (size_t)n[t] * esz(pdt)))
        return false;
    return true;
  }
  bool create(zopt_comm *comm) {
    r = comm ? zopt_comm_rank(comm) : 0;
    if (zopt_step_load(g_step.c_str(), &step) || zopt_optimizer_create(step, &o)) return false;
    d = zopt_step_get_descriptor(step);
    rtu::tensor_types(d, &pdt, &gdt, &zero3);
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 3, 1.0, 1};  // the scale moves within the test's steps
    return (!comm || !zopt_optimizer_set_comm(o, comm)) && !zopt_optimizer_set_bucket_elems(o, 65536) &&
           !zopt_optimizer_set_seed(o, 42) && !zopt_optimizer_configure_loss_scaler(o, &c);
  }
  // Appends tensors to the model (memory, params from `pseed`), unregistered.
  void grow(const std::vector<int64_t> &sizes, const std::vector<int> &groups, uint64_t pseed) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t t = n.size();
      n.push_back(sizes[i]);
      grp.push_back(groups[i]);
      ngroups = std::max(ngroups, groups[i] + 1);
      p.push_back(mem_alloc((size_t)sizes[i] * esz(pdt) + 8));
      g.push_back(mem_alloc((size_t)sizes[i] * esz(gdt) + 8));
      for (int64_t k = 0; k < sizes[i]; ++k) store(p[t], pdt, (size_t)k, value(pseed, t, (uint64_t)k, 1.0));
    }
  }
  // Registers tensors [from, end) with add_tensors (new groups as needed).
  zopt_status add(size_t from, int *first = nullptr) {
    int G = 0;
    for (size_t t = 0; t < from; ++t) G = std::max(G, grp[t] + 1);
    if (!from) G = 0;
    std::vector<int> gs;
    std::vector<void *> ps, gr;
    std::vector<int64_t> ns;
    for (size_t t = from; t < n.size(); ++t) {
      gs.push_back(grp[t]);
      ps.push_back(p[t]);
      gr.push_back(g[t]);
      ns.push_back(n[t]);
    }
    int first_group = -1, ft = -1;
    zopt_status st = zopt_optimizer_add_tensors(o, ngroups - G, (int)gs.size(), gs.data(), ps.data(), gr.data(),
                                                ns.data(), (zopt_dtype)pdt, &first_group, &ft);
    if (!st && (first_group != G || ft != (int)from)) {
      fprintf(stderr, "add_tensors: first group %d (want %d), first tensor %d (want %zu)\n", first_group, G, ft, from);
      return ZOPT_ERR_INTERNAL;
    }
    if (first) *first = ft;
    if (!st) reg = n.size();
    return st;
  }
  int groups_registered() const {
    int G = 0;
    for (size_t t = 0; t < reg; ++t) G = std::max(G, grp[t] + 1);
    return G;
  }
  bool hypers() {
    for (int gi = 0; gi < groups_registered(); ++gi) {
      double lr = 1e-3 * (gi + 1);
      if (zopt_optimizer_set_hyper(o, gi, "lr", lr)) return false;
      zopt_optimizer_set_hyper(o, gi, "weight_decay", 0.01 * (gi + 1));  // where the step has one
    }
    return true;
  }
  // Steps [k0, k0 + k) with this rank's gradients.
  bool steps(int k0, int k) {
    for (int s = k0; s < k0 + k; ++s) {
      for (size_t t = 0; t < reg; ++t)
        for (int64_t i = 0; i < n[t]; ++i)
          store(g[t], gdt, (size_t)i, value(2, (uint64_t)s * 64 + (uint64_t)r * 16 + t, (uint64_t)i, 0.05));
      if (streaming && !reduce_buckets(0)) return false;
      if (zopt_optimizer_step(o, nullptr)) return false;
    }
    return true;
  }
  // Gradient streaming: buckets [first, end) handed over.
  bool streaming = false;
  bool reduce_buckets(int first, int last = -1) {
    int nb = 0;
    if (zopt_optimizer_num_buckets(o, &nb)) return false;
    for (int b = first; b < (last < 0 ? nb : last); ++b) {
      int cnt = 0;
      if (zopt_optimizer_bucket_tensors(o, b, nullptr, 0, &cnt)) return false;
      std::vector<int> ts((size_t)cnt);
      std::vector<const void *> gs;
      if (zopt_optimizer_bucket_tensors(o, b, ts.data(), cnt, &cnt)) return false;
      for (int t : ts) gs.push_back(g[(size_t)t]);
      if (zopt_optimizer_reduce_bucket(o, b, gs.data(), cnt)) return false;
    }
    return true;
  }
  // Everything the optimizer holds, whole (collective).
  bool snapshot(Snap *s) {
    *s = Snap();
    const size_t T = reg;
    s->st.resize(T);
    for (size_t t = 0; t < T; ++t) {
      s->st[t].resize(d->num_states);
      for (uint32_t k = 0; k < d->num_states; ++k) {
        const uint32_t kind = d->states[k].kind;
        std::vector<unsigned char> &b = s->st[t][k];
        if (kind == ZOPT_STATE_GRAD) continue;
        b.assign((size_t)selems(d->states[k], n[t]) * esz(d->states[k].dtype) + 1, 0);
        if (kind == ZOPT_STATE_PARAM && zero3) {
          void *dst[1] = {b.data()};
          if (zopt_optimizer_gather_params(o, (int)t, 1, dst)) return false;
        } else if (zopt_optimizer_read_state_raw(o, (int)t, (zopt_state_kind)kind, b.data(), b.size() - 1)) {
          return false;
        }
      }
    }
    s->steps.assign(T, -1);
    if (T && zopt_optimizer_get_tensor_steps(o, 0, (int)T, s->steps.data())) return false;
    for (size_t t = 0; t < T; ++t) {  // the one-tensor call agrees
      int64_t c = -2;
      if (zopt_optimizer_get_tensor_step(o, (int)t, &c) || c != s->steps[t]) return false;
    }
    for (int gi = 0; gi < groups_registered(); ++gi) {
      int64_t c = 0;
      uint32_t f = 0;
      if (zopt_optimizer_get_step_count(o, gi, &c) || zopt_optimizer_get_group_flags(o, gi, &f)) return false;
      s->gcounts.push_back(c);
      s->gflags.push_back(f);
      for (const char *h : kHyperNames) {
        double v = 0;
        if (!zopt_optimizer_get_hyper(o, gi, h, &v)) s->hypers.push_back(v);
      }
    }
    return !zopt_optimizer_get_loss_scaler_state(o, &s->scale, &s->good) &&
           !zopt_optimizer_get_loss_scaler_config(o, &s->cfg) && !zopt_optimizer_get_seed(o, &s->seed);
  }
};

// Runs fn(rank, comm) on W ranks: loopback threads (W = 1: no communicator).
inline void on_ranks(const std::function<void(int, zopt_comm *)> &fn) {
  if (!rtu::on_ranks(g_world, 30, true, fn)) report(false, "loopback: %s", zopt_last_error());
}

// A rank's optimizer over the old tensors, finalized, 2 steps taken.
inline bool build_old(Rank &R, zopt_comm *c) {
  int id;
  if (!R.create(c)) return false;
  R.grow(kOld, kOldG, 1);
  for (int gi = 0; gi < R.ngroups; ++gi)
    if (zopt_optimizer_add_group(R.o, &id)) return false;
  for (size_t t = 0; t < kOld.size(); ++t)
    if (zopt_optimizer_add_tensor(R.o, R.grp[t], R.p[t], R.g[t], R.n[t], (zopt_dtype)R.pdt, &id))
      return false;
  R.reg = kOld.size();
  if (R.streaming && zopt_optimizer_set_grad_streaming(R.o, 1)) return false;
  return !zopt_optimizer_finalize(R.o) && R.hypers() && R.steps(0, 2);
}

// The outcome of a call on every rank: the same status and message.
struct Outcomes {
  std::vector<zopt_status> st;
  std::vector<std::string> msg;
  Outcomes() : st((size_t)g_world, ZOPT_OK), msg((size_t)g_world) {}
  void set(int r, zopt_status s) {
    st[(size_t)r] = s;
    msg[(size_t)r] = zopt_last_error();
  }
  bool all(zopt_status want, const char *needle = nullptr) const {
    for (size_t q = 0; q < st.size(); ++q)
      if (st[q] != want || msg[q] != msg[0] || (needle && msg[q].find(needle) == std::string::npos)) return false;
    return true;
  }
};

// An exported image's bytes (the buffer freed).
inline std::vector<unsigned char> to_vec(void *b, size_t n) {
  std::vector<unsigned char> v((unsigned char *)b, (unsigned char *)b + n);
  zopt_state_buffer_free(b);
  return v;
}

// The tests of zopt-state-check: state_check_add.cpp (1, 2),
// state_check_image.cpp (3 to 5), state_check.cpp (GPU steps).
void test_add();
void test_add_refused();
void test_export_import();
void test_unhashed();
void test_corrupt();
void test_staged();

}  // namespace stt

#endif

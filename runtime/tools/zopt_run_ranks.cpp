//===- zopt_run_ranks.cpp - the main job at W ranks ------------------------===//
//
//   zopt-run step.so --ranks W [--params N] [--tensors T] [--steps K]
//   mpirun -np W zopt-run step.so --mpi [...]
//
// Runs the compiled step at W ranks (threads over the loopback communicator,
// or MPI processes) on every rank's own gradients, and on one rank (the
// reference) on their rank-order sum with the gradient divisor W. Prints,
// per rank, the runtime-owned state it holds per parameter against one
// rank's, the median step time and where it went (the collectives, the
// norm, the update), and whether every param and every state is
// bit-identical to the one-rank run after the last step ("yes" or "NO");
// the exit status is 1 when any rank is not (or failed).
//
// For the tests of that verdict (test/Integration/ZeRO/zopt-run*.test):
// with ZOPT_RUN_FAULT=grad in the environment, the last rank changes one
// element of its gradient after the reference summed the ranks'
// gradients, so every rank must report NO and the run exit 1. With
// ZOPT_RUN_FAULT=stall the last rank sleeps 60 s before its last step (a
// stalled peer: the others fail within --timeout, naming it);
// ZOPT_RUN_FAULT=stall-unchecked does the same with the signature checks
// off (the stall is found inside a data collective, by the engine's
// liveness exchange).
//
//===----------------------------------------------------------------------===//
#include "zopt/comm.h"
#include "zopt/zopt.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace {

size_t esize(uint32_t d) { return d == ZOPT_DTYPE_F32 ? 4 : 2; }

float load(const uint8_t *p, uint32_t dt, size_t i) {
  if (dt == ZOPT_DTYPE_F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  if (dt == ZOPT_DTYPE_F16) return _cvtsh_ss(h);
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
void store(uint8_t *p, uint32_t dt, size_t i, float f) {
  if (dt == ZOPT_DTYPE_F32) {
    std::memcpy(p + 4 * i, &f, 4);
    return;
  }
  uint16_t h;
  if (dt == ZOPT_DTYPE_F16) {
    h = _cvtss_sh(f, 0);
  } else {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    h = uint16_t(u >> 16);
  }
  std::memcpy(p + 2 * i, &h, 2);
}

struct Model {
  std::vector<std::vector<uint8_t>> p, g, g0;  // g0: this rank's gradients (the collectives overwrite g)
  zopt_optimizer *o = nullptr;
  ~Model() { zopt_optimizer_free(o); }
};

struct Setup {
  const zopt_step *step;
  const zopt_step_descriptor *d;
  uint32_t pdt, gdt;
  std::vector<int64_t> sizes;
  int steps, threads;
  bool fault = false;  // ZOPT_RUN_FAULT=grad: the last rank's gradient differs from the reference's
  bool stall = false;  // ZOPT_RUN_FAULT=stall(-unchecked): the last rank sleeps before its last step
};

struct RankResult {
  bool ok = false, identical = false;
  std::string error;
  double state_bpp = 0, one_rank_bpp = 0, step_ms = 0, reduce_ms = 0, gather_ms = 0, norm_ms = 0, update_ms = 0;
};

// Rank r's gradient values (deterministic, per rank and tensor).
float grad_of(int r, size_t t, int64_t i, double scale) {
  uint64_t h = (uint64_t)(r + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)t << 40) ^ (uint64_t)i;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  double u = (double)(h >> 11) / 9007199254740992.0 - 0.5;
  return (float)(u * 2e-3 * scale);
}

bool build(const Setup &s, Model &m, zopt_comm *comm, int rank, int world, std::string *err) {
  auto ck = [&](zopt_status st, const char *what) {
    if (st != ZOPT_OK) *err = std::string(what) + ": " + zopt_last_error();
    return st == ZOPT_OK;
  };
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  if (!ck(zopt_optimizer_create(s.step, &m.o), "create")) return false;
  if (!ck(zopt_optimizer_set_num_threads(m.o, s.threads), "set_num_threads")) return false;
  int group, id;
  if (!ck(zopt_optimizer_add_group(m.o, &group), "add_group")) return false;
  const double S = (s.d->flags & ZOPT_FLAG_LOSS_SCALE) ? 1024.0 : 1.0;
  for (size_t t = 0; t < s.sizes.size(); ++t) {
    int64_t n = s.sizes[t];
    m.p.emplace_back((size_t)n * esize(s.pdt));
    m.g.emplace_back((size_t)n * esize(s.gdt));
    for (int64_t i = 0; i < n; ++i) {
      store(m.p[t].data(), s.pdt, (size_t)i, normal(rng) * 0.05f);
      if (rank >= 0) {
        store(m.g[t].data(), s.gdt, (size_t)i, (float)(grad_of(rank, t, i, 1.0) * S));
      } else {  // the reference: the rank-order f32 sum of every rank's gradient
        float acc = 0;
        for (int q = 0; q < world; ++q) {
          uint8_t b[4];
          store(b, s.gdt, 0, (float)(grad_of(q, t, i, 1.0) * S));
          acc = q ? acc + load(b, s.gdt, 0) : load(b, s.gdt, 0);
        }
        store(m.g[t].data(), s.gdt, (size_t)i, acc);
      }
    }
    if (!ck(zopt_optimizer_add_tensor(m.o, group, m.p[t].data(), m.g[t].data(), n, (zopt_dtype)s.pdt, &id),
            "add_tensor"))
      return false;
  }
  if (s.fault && rank == world - 1 && !s.sizes.empty() && s.sizes[0] > 0)
    store(m.g[0].data(), s.gdt, 0, load(m.g[0].data(), s.gdt, 0) * 2.0f + 1e-3f);
  m.g0 = m.g;
  if (comm && !ck(zopt_optimizer_set_comm(m.o, comm), "set_comm")) return false;
  if (!ck(zopt_optimizer_finalize(m.o), "finalize")) return false;
  if (!ck(zopt_optimizer_set_grad_divisor(m.o, world), "set_grad_divisor")) return false;
  if (s.d->flags & ZOPT_FLAG_LOSS_SCALE) {
    zopt_loss_scaler_config c{1024.0, 2.0, 0.5, 2000, 1.0, 1};
    if (!ck(zopt_optimizer_configure_loss_scaler(m.o, &c), "configure_loss_scaler")) return false;
  }
  return true;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One rank's run; compares with the reference `ref` after the last step.
RankResult run_rank(const Setup &s, zopt_comm *comm, int rank, int world, Model &ref) {
  RankResult res;
  Model m;
  if (!build(s, m, comm, rank, world, &res.error)) return res;
  const zopt_step_descriptor *d = s.d;
  std::vector<double> times, op(d->num_program + 1), sum_op(d->num_program + 1, 0.0);
  for (int k = 0; k < s.steps; ++k) {
    // A new backward pass: the ranks' gradients again (the reduction wrote
    // the mean into each rank's shard of them).
    for (size_t t = 0; t < m.g.size(); ++t) std::memcpy(m.g[t].data(), m.g0[t].data(), m.g[t].size());
    zopt_step_result r;
    if (s.stall && rank == world - 1 && k == s.steps - 1) std::this_thread::sleep_for(std::chrono::seconds(60));
    auto t0 = std::chrono::steady_clock::now();
    if (zopt_optimizer_step(m.o, &r) != ZOPT_OK) {
      res.error = std::string("step: ") + zopt_last_error();
      return res;
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    zopt_optimizer_get_op_times(m.o, op.data(), (int)op.size());
    for (size_t i = 0; i < op.size(); ++i) sum_op[i] += op[i] / s.steps;
  }
  res.step_ms = median(times) * 1e3;
  for (uint32_t i = 0; i < d->num_program; ++i) {
    double ms = sum_op[i] * 1e3;
    switch (d->program[i].code) {
      case ZOPT_OP_REDUCE_SCATTER: res.reduce_ms += ms; break;
      case ZOPT_OP_ALL_GATHER: res.gather_ms += ms; break;
      case ZOPT_OP_NORM_PARTIALS:
      case ZOPT_OP_NORM: res.norm_ms += ms; break;
      case ZOPT_OP_UPDATE: res.update_ms += ms; break;
    }
  }
  res.reduce_ms += sum_op[d->num_program] * 1e3;  // the ranks' agreement
  zopt_memory_info mi;
  zopt_optimizer_memory_info(m.o, &mi);
  res.state_bpp = double(mi.state_bytes) / double(mi.num_params);
  res.one_rank_bpp = double(mi.state_bytes_one_rank) / double(mi.num_params);
  // Bit-identity with one rank: params (gathered under ZeRO-3) and every
  // optimizer state (a collective read of sharded states).
  bool same = true;
  bool zero3 = false;
  for (uint32_t i = 0; i < d->num_states; ++i)
    zero3 |= d->states[i].kind == ZOPT_STATE_PARAM && (d->states[i].flags & ZOPT_STATE_PARTITIONED);
  if (zero3 && zopt_optimizer_gather_params(m.o, 0, (int)s.sizes.size(), nullptr) != ZOPT_OK) {
    res.error = std::string("gather_params: ") + zopt_last_error();
    return res;
  }
  for (size_t t = 0; t < s.sizes.size(); ++t) same = same && m.p[t] == ref.p[t];
  for (uint32_t i = 0; i < d->num_states; ++i) {
    uint32_t kind = d->states[i].kind;
    if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
    for (size_t t = 0; t < s.sizes.size(); ++t) {
      size_t b = (size_t)s.sizes[t] * esize(d->states[i].dtype);
      std::vector<uint8_t> x(b), y(b);
      // The ranks share the reference: one reader at a time (an optimizer
      // takes one call at a time, zopt.h "Threading").
      static std::mutex ref_mu;
      zopt_status st = zopt_optimizer_read_state_raw(m.o, (int)t, (zopt_state_kind)kind, x.data(), b);
      if (st == ZOPT_OK) {
        std::lock_guard<std::mutex> lk(ref_mu);
        st = zopt_optimizer_read_state_raw(ref.o, (int)t, (zopt_state_kind)kind, y.data(), b);
      }
      if (st != ZOPT_OK) {
        res.error = std::string("read_state_raw: ") + zopt_last_error();
        return res;
      }
      same = same && x == y;
    }
  }
  res.identical = same;
  res.ok = true;
  return res;
}

void print_header() {
  std::printf("%5s %16s %16s %9s %10s %9s %9s %9s %s\n", "rank", "state B/param", "one rank B/param", "step ms",
              "reduce ms", "norm ms", "update ms", "gather ms", "bit-identical to one rank");
}
void print_row(int r, const RankResult &x) {
  if (!x.ok) {
    std::printf("%5d FAILED: %s\n", r, x.error.c_str());
    return;
  }
  std::printf("%5d %16.2f %16.2f %9.2f %10.2f %9.2f %9.2f %9.2f %s\n", r, x.state_bpp, x.one_rank_bpp, x.step_ms,
              x.reduce_ms, x.norm_ms, x.update_ms, x.gather_ms, x.identical ? "yes" : "NO");
}

}  // namespace

// Entry from zopt_run.cpp's main. Returns the process exit code.
int zopt_run_ranks(const char *path, int world, bool mpi, long long nParams, int nTensors, int steps, int threads,
                   double timeout) {
  if (nTensors < 1 || nParams < nTensors || steps < 1 || threads < 1) {
    std::fprintf(stderr, "zopt-run: need params >= tensors >= 1, steps >= 1\n");
    return 2;
  }
  zopt_step *step = nullptr;
  if (zopt_step_load(path, &step) != ZOPT_OK) {
    std::fprintf(stderr, "zopt-run: %s\n", zopt_last_error());
    return 1;
  }
  Setup s;
  s.step = step;
  s.d = zopt_step_get_descriptor(step);
  for (uint32_t i = 0; i < s.d->num_states; ++i) {
    if (s.d->states[i].kind == ZOPT_STATE_PARAM) s.pdt = s.d->states[i].dtype;
    if (s.d->states[i].kind == ZOPT_STATE_GRAD) s.gdt = s.d->states[i].dtype;
  }
  for (int t = 0; t < nTensors; ++t) s.sizes.push_back(nParams / nTensors + (t < nParams % nTensors ? 1 : 0));
  s.steps = steps;
  s.threads = threads;
  const char *fault = std::getenv("ZOPT_RUN_FAULT");
  s.fault = fault && !std::strcmp(fault, "grad");
  s.stall = fault && (!std::strcmp(fault, "stall") || !std::strcmp(fault, "stall-unchecked"));
  const bool unchecked = fault && !std::strcmp(fault, "stall-unchecked");
  int rc = 0;
  if (mpi) {
    zopt_comm *c = nullptr;
    if (zopt_comm_create_mpi(nullptr, &c) != ZOPT_OK) {
      std::fprintf(stderr, "zopt-run: %s\n", zopt_last_error());
      return 1;
    }
    int rank = zopt_comm_rank(c);
    world = zopt_comm_size(c);
    if ((timeout > 0 && zopt_comm_set_timeout(c, timeout) != ZOPT_OK) ||
        (unchecked && zopt_comm_set_checks(c, 0) != ZOPT_OK)) {
      std::fprintf(stderr, "zopt-run: %s\n", zopt_last_error());
      return 1;
    }
    Model ref;
    std::string err;
    if (!build(s, ref, nullptr, -1, world, &err)) {
      std::fprintf(stderr, "zopt-run: reference: %s\n", err.c_str());
      return 1;
    }
    for (int k = 0; k < steps; ++k)
      if (zopt_optimizer_step(ref.o, nullptr) != ZOPT_OK) {
        std::fprintf(stderr, "zopt-run: reference step: %s\n", zopt_last_error());
        return 1;
      }
    if (rank == 0)
      std::printf("step %s, ZeRO stage %u, %lld parameters in %d tensors, %d MPI ranks x %d threads, %d steps\n",
                  s.d->name, s.d->zero_stage, nParams, nTensors, world, threads, steps);
    RankResult res = run_rank(s, c, rank, world, ref);
    if (!res.ok) std::fprintf(stderr, "zopt-run: rank %d: %s\n", rank, res.error.c_str());
    // Rank 0 prints every rank's row (a fixed-size record each).
    struct Row {
      int32_t ok, identical;
      double v[7];
      char error[200];
    } mine{}, none{};
    mine.ok = res.ok;
    mine.identical = res.identical;
    double vals[7] = {res.state_bpp, res.one_rank_bpp, res.step_ms, res.reduce_ms, res.norm_ms, res.update_ms,
                      res.gather_ms};
    std::memcpy(mine.v, vals, sizeof vals);
    std::snprintf(mine.error, sizeof mine.error, "%s", res.error.c_str());
    std::vector<Row> rows(world, none);
    if (zopt_comm_all_gather(c, &mine, rows.data(), sizeof(Row)) != ZOPT_OK) {
      std::fprintf(stderr, "zopt-run: rank %d: %s\n", rank, zopt_last_error());
      return 1;
    }
    if (rank == 0) {
      print_header();
      for (int q = 0; q < world; ++q) {
        RankResult x;
        x.ok = rows[q].ok;
        x.identical = rows[q].identical;
        x.error = rows[q].error;
        x.state_bpp = rows[q].v[0], x.one_rank_bpp = rows[q].v[1], x.step_ms = rows[q].v[2];
        x.reduce_ms = rows[q].v[3], x.norm_ms = rows[q].v[4], x.update_ms = rows[q].v[5], x.gather_ms = rows[q].v[6];
        print_row(q, x);
        if (!x.ok || !x.identical) res.ok = false;
      }
    }
    rc = res.ok && res.identical ? 0 : 1;
    zopt_comm_free(c);
  } else {
    std::printf("step %s, ZeRO stage %u, %lld parameters in %d tensors, %d loopback ranks (threads) x %d threads, "
                "%d steps\n",
                s.d->name, s.d->zero_stage, nParams, nTensors, world, threads, steps);
    Model ref;
    std::string err;
    if (!build(s, ref, nullptr, -1, world, &err)) {
      std::fprintf(stderr, "zopt-run: reference: %s\n", err.c_str());
      return 1;
    }
    for (int k = 0; k < steps; ++k)
      if (zopt_optimizer_step(ref.o, nullptr) != ZOPT_OK) {
        std::fprintf(stderr, "zopt-run: reference step: %s\n", zopt_last_error());
        return 1;
      }
    std::vector<zopt_comm *> comms(world);
    zopt_loopback_options lo{};
    lo.timeout_s = timeout > 0 ? timeout : 120;
    if (zopt_comm_create_loopback(world, &lo, comms.data()) != ZOPT_OK) {
      std::fprintf(stderr, "zopt-run: %s\n", zopt_last_error());
      return 1;
    }
    std::vector<RankResult> res(world);
    std::vector<std::thread> th;
    for (int r = 0; r < world; ++r) th.emplace_back([&, r] { res[r] = run_rank(s, comms[r], r, world, ref); });
    for (auto &t : th) t.join();
    for (auto *c : comms) zopt_comm_free(c);
    print_header();
    for (int r = 0; r < world; ++r) {
      print_row(r, res[r]);
      if (!res[r].ok || !res[r].identical) rc = 1;
    }
  }
  zopt_step_free(step);
  return rc;
}

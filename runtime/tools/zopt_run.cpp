//===- zopt_run.cpp - run a compiled step through the runtime -------------===//
//
//   zopt-run step.so [--params N] [--tensors T] [--steps K] [--threads P]
//   zopt-run step.so --ranks W [...]          W ranks as threads (loopback)
//   mpirun -np W zopt-run step.so --mpi [...] W MPI processes
//
// The main job: loads a step.so, registers T tensors of random data
// (N parameters in all), runs K optimizer steps with a changing lr and
// prints per-step time, throughput, the ratio to an in-place stream roofline
// measured in the same run over arrays of the same sizes and dtypes (read
// what the step reads, write what it writes, no math), and the bytes per
// parameter held on each placement (the user's tensors, the optimizer
// states, the rest: staging and scratch). A step with its params and grads
// on the GPU (an offloaded step) gets them in device memory through the
// CUDA driver (zopt_run_device.h; on a machine without a GPU, the stand-in
// driver named by ZOPT_CUDA_DRIVER) and also prints where its step time
// went: the copies of the grads to the host, the CPU update, the copies of
// the params back (zopt_optimizer_get_step_stats). Without a driver it says
// that the step needs one and exits with status 3. Uses only the public C
// API.
//
//===----------------------------------------------------------------------===//
#include "zopt/zopt.h"
#include "zopt/cpu.h"
#include "stream_roofline.h"
#include "zopt_run_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <memory>
#include <sys/mman.h>

#include <immintrin.h>

namespace {

#define CHECK_Z(call)                                                          \
  do {                                                                         \
    zopt_status st_ = (call);                                                  \
    if (st_ != ZOPT_OK) {                                                      \
      std::fprintf(stderr, "zopt-run: %s failed (%d): %s\n", #call, int(st_),   \
                   zopt_last_error());                                         \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

size_t dtypeBytes(uint32_t d) { return d == ZOPT_DTYPE_F32 ? 4 : d == ZOPT_DTYPE_Q8 ? 1 : 2; }
const char *dtypeName(uint32_t d) {
  return d == ZOPT_DTYPE_F32    ? "f32"
         : d == ZOPT_DTYPE_BF16 ? "bf16"
         : d == ZOPT_DTYPE_I16  ? "i16"
         : d == ZOPT_DTYPE_Q8   ? "q8"
                                : "f16";
}
// Bytes per parameter of a state: a PER_BLOCK state (a q8 absmax) holds one
// element per ZOPT_Q8_BLOCK params.
double stateBytes(const zopt_state_desc &sd) {
  return double(dtypeBytes(sd.dtype)) / ((sd.flags & ZOPT_STATE_PER_BLOCK) ? ZOPT_Q8_BLOCK : 1);
}
const char *kindName(uint32_t k) {
  static const char *names[] = {"?", "param", "grad", "master", "exp_avg",
                                "exp_avg_sq", "max_exp_avg_sq",
                                "momentum_buffer", "exp_avg_absmax",
                                "exp_avg_sq_absmax", "kahan_comp"};
  return k < 11 ? names[k] : "?";
}

uint16_t toBits16(float f, uint32_t dtype) {
  if (dtype == ZOPT_DTYPE_F16)
    return _cvtss_sh(f, 0);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

double now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Large host arrays: 2 MiB-aligned and advised as transparent huge pages,
// as the runtime does for its own state buffers (with 4 KiB pages a step
// that streams 7 arrays loses bandwidth to TLB misses). Freed with free().
struct FreeDeleter {
  void operator()(uint8_t *p) const { std::free(p); }
};
using HostBuf = std::unique_ptr<uint8_t, FreeDeleter>;
HostBuf allocHuge(size_t bytes) {
  const size_t huge = size_t(2) << 20;
  bytes = (std::max<size_t>(bytes, 1) + huge - 1) / huge * huge;
  uint8_t *p = static_cast<uint8_t *>(std::aligned_alloc(huge, bytes));
  if (p)
    madvise(p, bytes, MADV_HUGEPAGE);
  return HostBuf(p);
}

// The roofline: the in-place stream of stream_roofline.h (the one the CPU
// benchmark uses) over arrays of the step's sizes and dtypes: every array
// the step reads is read, every array it writes is written (read-write
// arrays in place), one vector of every array after the other, split over
// `threads` threads with the same contiguous partition as the data.
struct Stream {
  std::vector<HostBuf> mem;
  std::vector<zopt_stream::Arr> arrs;
  size_t n = 0;
  uint32_t mask = 0;  // runtime zero
  bool avx512 = false;

  void run(int threads) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        (avx512 ? zopt_stream::streamAvx512 : zopt_stream::streamAvx2)(arrs.data(), (int)arrs.size(), lo, hi,
                                                                         mask);
      });
    for (auto &t : ts)
      t.join();
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

} // namespace

// zopt_run_ranks.cpp: the main job at W ranks.
int zopt_run_ranks(const char *path, int world, bool mpi, long long nParams, int nTensors, int steps, int threads,
                   double timeout);

int main(int argc, char **argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help")) {
    std::printf("usage: zopt-run step.so [--params N] [--tensors T] "
                "[--steps K] [--threads P] [--ranks W | --mpi] [--timeout S]\n");
    return argc < 2 ? 2 : 0;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0); // progress lines as they come
  const char *path = argv[1];
  long long nParams = 16ll << 20;
  int nTensors = 64, steps = 10;
  int threads = int(std::thread::hardware_concurrency());
  int ranks = 0;
  bool mpi = false, threads_set = false;
  double timeout = 0;  // seconds a collective waits for its peers; 0: the communicator's default
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mpi") {
      mpi = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "zopt-run: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--timeout") {
      char *end = nullptr;
      timeout = std::strtod(argv[++i], &end);
      if (!end || *end || !(timeout > 0) || !std::isfinite(timeout)) {
        std::fprintf(stderr, "zopt-run: --timeout %s: seconds, finite and > 0\n", argv[i]);
        return 2;
      }
      continue;
    }
    long long v = std::atoll(argv[++i]);
    if (a == "--params") nParams = v;
    else if (a == "--tensors") nTensors = int(v);
    else if (a == "--steps") steps = int(v);
    else if (a == "--threads") threads = int(v), threads_set = true;
    else if (a == "--ranks") ranks = int(v);
    else {
      std::fprintf(stderr, "zopt-run: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (ranks > 0 || mpi) {
    if (ranks < 0 || ranks > 64) {
      std::fprintf(stderr, "zopt-run: --ranks %d not in [1, 64]\n", ranks);
      return 2;
    }
    // The ranks share this machine's cores.
    if (!threads_set) threads = std::max(1, threads / std::max(1, mpi ? 1 : ranks));
    return zopt_run_ranks(path, ranks, mpi, nParams, nTensors, steps, threads, timeout);
  }
  if (nParams < nTensors || nTensors < 1 || steps < 1 || threads < 1) {
    std::fprintf(stderr, "zopt-run: need params >= tensors >= 1, steps >= 1\n");
    return 2;
  }

  zopt_step *step = nullptr;
  CHECK_Z(zopt_step_load(path, &step));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(step);
  const char *isa = zopt_isa_name(zopt_step_isa(step));
  std::printf("step %s (ABI %u, ZeRO stage %u, align %u), kernels: %s, "
              "%d threads\n",
              d->name, d->abi_version, d->zero_stage, d->align, isa, threads);
  uint32_t pdtype = 0;
  double bytesPerParam = 0;
  bool paramOnGpu = false, gradOnGpu = false, stateOnGpu = false;
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    if (sd.kind == ZOPT_STATE_PARAM)
      pdtype = sd.dtype, paramOnGpu = sd.placement == ZOPT_PLACE_GPU;
    else if (sd.kind == ZOPT_STATE_GRAD)
      gradOnGpu = sd.placement == ZOPT_PLACE_GPU;
    else if (sd.placement == ZOPT_PLACE_GPU)
      stateOnGpu = true;
    double b = stateBytes(sd);
    bytesPerParam += ((sd.access & ZOPT_ACCESS_READ) ? b : 0) +
                     ((sd.access & ZOPT_ACCESS_WRITE) ? b : 0);
    std::printf("  state %-16s %-4s on %s%s%s%s%s\n", kindName(sd.kind),
                dtypeName(sd.dtype),
                sd.placement == ZOPT_PLACE_CPU ? "cpu" : "gpu",
                (sd.access & ZOPT_ACCESS_READ) ? ", read" : "",
                (sd.access & ZOPT_ACCESS_WRITE) ? ", written" : "",
                sd.rounding == ZOPT_ROUND_STOCHASTIC ? ", rounded stochastically" : "",
                (sd.flags & ZOPT_STATE_PER_BLOCK) ? ", one per block" : "");
  }

  // GPU-placed params and grads: device memory from the CUDA driver. A GPU
  // step (its states on the GPU too) is refused by zopt_optimizer_create
  // without one, with the runtime's message; an offloaded step is said here.
  RunDevice device;
  if ((paramOnGpu || gradOnGpu) && !stateOnGpu) {
    std::string why;
    if (!device.open(&why)) {
      std::printf("zopt-run: step %s keeps its params and grads on the GPU (an offloaded step: the update runs on "
                  "the CPU between copies from and to the GPU), so running it needs a CUDA GPU and its driver: %s.\n"
                  "On a machine without a GPU, ZOPT_CUDA_DRIVER=<build>/lib/libzopt-fake-cuda.so runs it on the "
                  "stand-in driver (device memory is host memory; scripts/main.sh does so).\n",
                  d->name, why.c_str());
      zopt_step_free(step);
      return 3;
    }
    std::printf("params and grads in device memory of %s\n", device.driver().c_str());
  }

  // User tensors: random params and grads of the param dtype.
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  size_t eb = dtypeBytes(pdtype);
  // Like the runtime's buffers and the roofline's arrays: huge pages.
  std::vector<HostBuf> params(nTensors), grads(nTensors);
  zopt_optimizer *opt = nullptr;
  CHECK_Z(zopt_optimizer_create(step, &opt));
  if ((paramOnGpu || gradOnGpu) && stateOnGpu) {
    std::string why;
    if (!device.open(&why)) {
      std::fprintf(stderr, "zopt-run: %s\n", why.c_str());
      return 1;
    }
  }
  CHECK_Z(zopt_optimizer_set_num_threads(opt, threads));
  int group;
  CHECK_Z(zopt_optimizer_add_group(opt, &group));
  for (int t = 0; t < nTensors; ++t) {
    long long n = nParams / nTensors + (t < nParams % nTensors ? 1 : 0);
    params[t] = allocHuge(size_t(n) * eb);
    grads[t] = allocHuge(size_t(n) * eb);
    if (!params[t] || !grads[t]) {
      std::fprintf(stderr, "zopt-run: out of memory for the tensors\n");
      return 1;
    }
    for (long long i = 0; i < n; ++i) {
      float p = normal(rng) * 0.05f, g = normal(rng) * 1e-3f;
      if (pdtype == ZOPT_DTYPE_F32) {
        std::memcpy(params[t].get() + i * 4, &p, 4);
        std::memcpy(grads[t].get() + i * 4, &g, 4);
      } else {
        if (d->flags & ZOPT_FLAG_LOSS_SCALE)
          g *= 1024.f; // gradients arrive loss-scaled
        uint16_t pb = toBits16(p, pdtype), gb = toBits16(g, pdtype);
        std::memcpy(params[t].get() + i * 2, &pb, 2);
        std::memcpy(grads[t].get() + i * 2, &gb, 2);
      }
    }
    void *pp = params[t].get(), *gp = grads[t].get();
    std::string why;
    if (paramOnGpu && !(pp = device.upload(pp, size_t(n) * eb, &why)))
      std::fprintf(stderr, "zopt-run: device memory for the params: %s\n", why.c_str()), std::exit(1);
    if (gradOnGpu && !(gp = device.upload(gp, size_t(n) * eb, &why)))
      std::fprintf(stderr, "zopt-run: device memory for the grads: %s\n", why.c_str()), std::exit(1);
    int id;
    CHECK_Z(zopt_optimizer_add_tensor(opt, group, pp, gp, n, zopt_dtype(pdtype), &id));
  }
  CHECK_Z(zopt_optimizer_finalize(opt));
  if (d->flags & ZOPT_FLAG_LOSS_SCALE) {
    zopt_loss_scaler_config c{1024.0, 2.0, 0.5, 2000, 1.0, 1};
    CHECK_Z(zopt_optimizer_configure_loss_scaler(opt, &c));
  }

  zopt_memory_info mem;
  CHECK_Z(zopt_optimizer_memory_info(opt, &mem));
  std::printf("%llu parameters in %d tensors\n", (unsigned long long)mem.num_params, nTensors);
  {
    // Bytes per parameter held on each placement, by what is held (one rank: every state whole): the user's
    // params and grads and the optimizer's states where the descriptor
    // places them; the rest is the runtime's staging and scratch.
    double user[2] = {0, 0}, owned[2] = {0, 0};
    for (uint32_t s = 0; s < d->num_states; ++s) {
      const zopt_state_desc &sd = d->states[s];
      const int at = sd.placement == ZOPT_PLACE_GPU ? 1 : 0;
      (sd.kind == ZOPT_STATE_PARAM || sd.kind == ZOPT_STATE_GRAD ? user : owned)[at] += stateBytes(sd);
    }
    const double total[2] = {double(mem.bytes_cpu) / double(mem.num_params),
                             double(mem.bytes_gpu) / double(mem.num_params)};
    std::printf("bytes/param          host (cpu)       gpu\n");
    std::printf("  params, grads      %10.2f %9.2f\n", user[0], user[1]);
    std::printf("  optimizer states   %10.2f %9.2f\n", owned[0], owned[1]);
    std::printf("  staging, scratch   %10.2f %9.2f\n", total[0] - user[0] - owned[0], total[1] - user[1] - owned[1]);
    std::printf("  total              %10.2f %9.2f\n", total[0], total[1]);
  }
  std::printf("traffic per step: %.0f bytes/param (read + write)\n\n",
              bytesPerParam);

  // Roofline arrays: same sizes and dtypes as the states.
  Stream stream;
  stream.mask = uint32_t(std::getenv("ZOPT_RUN_NEVER_SET") != nullptr);
  stream.n = size_t(nParams);
  stream.avx512 = zopt_cpu_runs_isa(ZOPT_ISA_AVX512);
  for (uint32_t s = 0; s < d->num_states; ++s) {
    const zopt_state_desc &sd = d->states[s];
    if (!sd.access || (sd.flags & ZOPT_STATE_PER_BLOCK))
      continue;  // a q8 absmax: 4 bytes per 256 params, left out
    size_t es = dtypeBytes(sd.dtype);
    HostBuf buf = allocHuge(size_t(nParams) * es);
    if (!buf) {
      std::fprintf(stderr, "zopt-run: out of memory for the roofline arrays\n");
      return 1;
    }
    uint8_t *p = buf.get();
    std::memset(p, int(s + 1), size_t(nParams) * es);
    stream.mem.push_back(std::move(buf));
    stream.arrs.push_back({p, int(es),
                           bool(sd.access & ZOPT_ACCESS_READ),
                           bool(sd.access & ZOPT_ACCESS_WRITE)});
  }

  std::printf("%5s %10s %10s %12s %9s %10s %8s\n", "step", "lr", "ms",
              "Gparam/s", "GB/s", "grad_norm", "skipped");
  std::vector<double> stepTimes, streamTimes;
  std::vector<zopt_step_stats> stats;
  for (int k = 0; k < steps; ++k) {
    double lr = 1e-3 * (0.5 + 0.5 * std::cos(3.14159265 * k / steps));
    CHECK_Z(zopt_optimizer_set_hyper(opt, group, "lr", lr));
    zopt_step_result r;
    double t0 = now();
    CHECK_Z(zopt_optimizer_step(opt, &r));
    double dt = now() - t0;
    zopt_step_stats ss;
    if (zopt_optimizer_get_step_stats(opt, &ss) == ZOPT_OK)
      stats.push_back(ss);
    t0 = now();
    stream.run(threads);
    streamTimes.push_back(now() - t0);
    stepTimes.push_back(dt);
    std::printf("%5d %10.3g %10.2f %12.3f %9.2f %10.4g %8d\n", k + 1, lr,
                dt * 1e3, double(nParams) / dt * 1e-9,
                double(nParams) * bytesPerParam / dt * 1e-9, r.grad_norm,
                r.skipped);
  }
  // Where the time of the last step went, op by op (zopt_optimizer_get_op_times).
  {
    static const char *names[] = {"?", "COPY", "REDUCE_SCATTER", "ALL_GATHER", "NORM_PARTIALS",
                                   "NORM", "PREPARE", "UPDATE", "FINISH"};
    std::vector<double> sec(d->num_program + 1);
    if (zopt_optimizer_get_op_times(opt, sec.data(), (int)sec.size()) == ZOPT_OK) {
      std::printf("\nlast step by program op:");
      for (uint32_t i = 0; i < d->num_program; ++i)
        std::printf(" %s %.2f ms%s", names[d->program[i].code <= 8 ? d->program[i].code : 0], sec[i] * 1e3,
                    i + 1 < d->num_program ? "," : "\n");
    }
  }
  // An offloaded step's parts (zopt_optimizer_get_step_stats), medians over
  // the steps: the baseline an overlapped step is measured against.
  if (!stats.empty() && stats.back().offloaded) {
    auto med = [&](double zopt_step_stats::*f) {
      std::vector<double> v;
      for (const zopt_step_stats &x : stats) v.push_back(x.*f);
      return median(v) * 1e3;
    };
    std::printf("\noffloaded step (median of %zu): grads to host %.2f ms (%.1f MB), CPU update %.2f ms, params to "
                "gpu %.2f ms (%.1f MB), total %.2f ms\n",
                stats.size(), med(&zopt_step_stats::d2h_seconds), double(stats.back().d2h_bytes) * 1e-6,
                med(&zopt_step_stats::update_seconds), med(&zopt_step_stats::h2d_seconds),
                double(stats.back().h2d_bytes) * 1e-6, med(&zopt_step_stats::total_seconds));
  }
  double ts = median(stepTimes), tr = median(streamTimes);
  double gbs = double(nParams) * bytesPerParam / ts * 1e-9;
  double gbr = double(nParams) * bytesPerParam / tr * 1e-9;
  std::printf("\nmedian step %.2f ms = %.2f GB/s; in-place stream roofline "
              "(same run, same arrays) %.2f ms = %.2f GB/s; ratio %.2f\n",
              ts * 1e3, gbs, tr * 1e3, gbr, tr / ts);
  if (d->flags & ZOPT_FLAG_SUMSQ) {
    // The norm pass reads the grads once more than the roofline's bytes.
    double extra = double(eb);
    std::printf("(the step's global-norm pass reads the grads a second time: "
                "%.0f bytes/param moved, so the ratio can reach at most "
                "%.2f)\n",
                bytesPerParam + extra, bytesPerParam / (bytesPerParam + extra));
  }
  zopt_optimizer_free(opt);
  zopt_step_free(step);
  return 0;
}

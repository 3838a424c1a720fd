// zopt-bench-offload: the serial offloaded step (params and grads on the
// GPU, the optimizer states and the update on the CPU) against the same
// description compiled all-CPU, in the same run: the baseline an overlapped
// offload pipeline is measured against (docs/benchmarks/offload.md).
//
//   ZOPT_CUDA_DRIVER=... zopt-bench-offload OFFLOAD.so CPU.so [--params N]
//       [--tensors T] [--steps K] [--threads P]
//
// OFFLOAD.so's params and grads are device memory of the CUDA driver
// (zopt_run_device.h: libcuda.so.1, or the stand-in driver named by
// ZOPT_CUDA_DRIVER, whose device memory is host memory and whose copies are
// memcpys); CPU.so's are host memory with the same random values. Each of
// K steps runs the offloaded step, then the CPU step, with the same lr.
// Reports the median exposed time of the offloaded step (the wall time of
// zopt_optimizer_step: the serial step exposes all of it) and its parts
// (zopt_optimizer_get_step_stats: grads to the host, CPU update, params
// back), the median CPU-only step, and whether both ended with the same
// params (bit for bit).
#include "offload_common.h"
#include "zopt_run_device.h"

#include <cmath>
#include <random>

using namespace zopt_bench;
#define Z ZB_CHECK

int main(int argc, char **argv) {
  prog() = "zopt-bench-offload";
  if (argc < 3) {
    std::fprintf(stderr, "usage: zopt-bench-offload OFFLOAD.so CPU.so [--params N] [--tensors T] [--steps K] "
                         "[--threads P]\n");
    return 2;
  }
  OffloadOpts opt;
  if (!parse_opts(argc, argv, 3, opt)) return 2;
  const long long N = opt.params;
  const int T = opt.tensors, K = opt.steps, P = opt.threads;
  zopt_step *so = nullptr, *sc = nullptr;
  Z(zopt_step_load(argv[1], &so));
  Z(zopt_step_load(argv[2], &sc));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(so);
  const StepShape shape(d);
  const uint32_t pdt = shape.pdt, gdt = shape.gdt;
  RunDevice dev;
  std::string why;
  if (!dev.open(&why)) {
    std::fprintf(stderr, "zopt-bench-offload: %s\n", why.c_str());
    return 3;
  }
  std::printf("offloaded step %s: %.2f B/param of optimizer state on the host; %lld params in %d tensors, %d "
              "steps; device memory of %s\n",
              d->name, shape.host_state, N, T, K, dev.driver().c_str());

  zopt_optimizer *o = nullptr, *c = nullptr;
  Z(zopt_optimizer_create(so, &o));
  Z(zopt_optimizer_create(sc, &c));
  if (P > 0) {
    Z(zopt_optimizer_set_num_threads(o, P));
    Z(zopt_optimizer_set_num_threads(c, P));
  }
  int go, gc;
  Z(zopt_optimizer_add_group(o, &go));
  Z(zopt_optimizer_add_group(c, &gc));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<std::vector<unsigned char>> hp(T), hg(T);
  std::vector<void *> dp(T), dg(T);
  for (int t = 0; t < T; ++t) {
    long long n = N / T + (t < N % T ? 1 : 0);
    hp[t].resize((size_t)n * dsize(pdt));
    hg[t].resize((size_t)n * dsize(gdt));
    for (long long i = 0; i < n; ++i) {
      store_as(normal(rng) * 0.05f, pdt, &hp[t][(size_t)i * dsize(pdt)]);
      store_as(normal(rng) * 1e-3f, gdt, &hg[t][(size_t)i * dsize(gdt)]);
    }
    if (!(dp[t] = dev.upload(hp[t].data(), hp[t].size(), &why)) ||
        !(dg[t] = dev.upload(hg[t].data(), hg[t].size(), &why))) {
      std::fprintf(stderr, "zopt-bench-offload: %s\n", why.c_str());
      return 1;
    }
    int id;
    Z(zopt_optimizer_add_tensor(o, go, dp[t], dg[t], n, (zopt_dtype)pdt, &id));
    Z(zopt_optimizer_add_tensor(c, gc, hp[t].data(), hg[t].data(), n, (zopt_dtype)pdt, &id));
  }
  Z(zopt_optimizer_finalize(o));
  Z(zopt_optimizer_finalize(c));

  std::vector<double> exposed, d2h, upd, h2d, total, cpu;
  zopt_step_stats s{};
  for (int k = 0; k <= K; ++k) {  // step 0: warm-up (first touch), not counted
    double lr = 1e-3 * (0.5 + 0.5 * std::cos(3.14159265 * k / (K + 1)));
    Z(zopt_optimizer_set_hyper(o, go, "lr", lr));
    Z(zopt_optimizer_set_hyper(c, gc, "lr", lr));
    double t0 = now();
    Z(zopt_optimizer_step(o, nullptr));
    double t1 = now();
    Z(zopt_optimizer_get_step_stats(o, &s));
    double t2 = now();
    Z(zopt_optimizer_step(c, nullptr));
    double t3 = now();
    if (!k) continue;
    exposed.push_back(t1 - t0);
    d2h.push_back(s.d2h_seconds);
    upd.push_back(s.update_seconds);
    h2d.push_back(s.h2d_seconds);
    total.push_back(s.total_seconds);
    cpu.push_back(t3 - t2);
  }
  // The params, read back from the device (after the step's copies). With
  // a stochastically rounded master the cell's param and master take
  // different random bits (the key has the state slot, docs/NUMERICS.md
  // §7), and the peer updates its param in place: not comparable.
  bool sr_master = false;
  for (uint32_t s = 0; s < d->num_states; ++s)
    sr_master |= d->states[s].kind == ZOPT_STATE_MASTER && d->states[s].rounding == ZOPT_ROUND_STOCHASTIC;
  bool same = true;
  for (int t = 0; t < T && same && !sr_master; ++t) {
    std::vector<unsigned char> x(hp[t].size());
    Z(zopt_optimizer_read_state_raw(o, t, ZOPT_STATE_PARAM, x.data(), x.size()));
    same = x == hp[t];
  }
  // The step of median exposed time, with its own parts (they add up).
  std::vector<size_t> order(exposed.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return exposed[a] < exposed[b]; });
  const size_t m = order[order.size() / 2];
  const double ms = 1e3, e = exposed[m], cp = median(cpu);
  std::printf("offloaded step (median of %d): exposed %.1f ms = grads to host %.1f ms (%.0f MB) + CPU update %.1f "
              "ms + params to gpu %.1f ms (%.0f MB) + other %.1f ms (stats total %.1f ms)\n",
              K, e * ms, d2h[m] * ms, (double)s.d2h_bytes * 1e-6, upd[m] * ms, h2d[m] * ms,
              (double)s.h2d_bytes * 1e-6, (e - d2h[m] - upd[m] - h2d[m]) * ms, total[m] * ms);
  std::printf("CPU-only step, same description on the host (median of %d): %.1f ms; offloaded / CPU-only %.2f; "
              "params bit-identical after %d steps: %s\n",
              K, cp * ms, e / cp, K + 1, sr_master ? "not compared (a stochastically rounded master)" : same ? "yes" : "NO");
  zopt_optimizer_free(o);
  zopt_optimizer_free(c);
  zopt_step_free(so);
  zopt_step_free(sc);
  return same ? 0 : 1;
}

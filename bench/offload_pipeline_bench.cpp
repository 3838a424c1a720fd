// zopt-bench-offload-pipeline: the pipelined offloaded step (bucket
// readiness and speculation, docs/GPU.md) against the serial offloaded
// step, in the same run, behind a simulated backward and before a
// simulated forward (docs/benchmarks/offload.md "The pipelined step").
//
//   ZOPT_CUDA_DRIVER=... zopt-bench-offload-pipeline OFFLOAD.so [--params N]
//       [--tensors T] [--steps K] [--threads P] [--backward-ms B]
//       [--forward-ms F] [--bucket E] [--param-wait M]
//
// Two optimizers of OFFLOAD.so with the same params and grads in device
// memory (zopt_run_device.h: libcuda.so.1 or the stand-in). Each step runs
// a simulated backward of B ms for each: the serial one sleeps B ms, then
// zopt_optimizer_step; the pipelined one sleeps B / nb ms per bucket and
// marks it ready (buckets in flat order, the order backward produces
// them), then zopt_optimizer_step. Then each runs a simulated forward of F
// ms (default B / 2: a forward is about half a backward), what the GPU does
// next: for each bucket in forward order (the last first) it waits for the
// bucket's params, then sleeps F / nb ms. Waiting for the params: in the
// default mode (ZOPT_PARAM_WAIT_ALL; the serial optimizer always) a host
// synchronisation of the optimizer's stream before the first bucket; in
// per-bucket mode (the pipelined optimizer with M = 1, or both passes with
// M = 2, the default) zopt_optimizer_wait_params(b) on a stream of the
// forward's, then a host synchronisation of that stream, before each
// bucket. The host time of those waits is the time the GPU would wait.
// Reported: per step the step()'s wall time, the forward's waits and the
// exposed time = step() + the forward's waits (what the GPU waits for
// after backward; the serial step's: its step() + its waits), and the old
// figure (step() alone after backward), and the part of a per-bucket
// step's tail still running after the forward (the next call waits for
// it: the next backward's first mark would); per case their medians and ratios
// against the serial step, with clipping inactive (max_norm 1e9) and
// active (max_norm 1e-3: every bucket recomputed); the pipelined step's
// outcome and the CPU time its jobs overlapped with backward (read after
// the forward: reading them joins a per-bucket step's tail). The params of
// both are compared bit for bit at the end. scripts/main.sh runs it after
// zopt-run for an offloaded example.
#include "offload_common.h"
#include "zopt_run_device.h"

#include <cmath>
#include <random>
#include <thread>

using namespace zopt_bench;
#define Z ZB_CHECK

namespace {
void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }
}  // namespace

int main(int argc, char **argv) {
  prog() = "zopt-bench-offload-pipeline";
  if (argc < 2) {
    std::fprintf(stderr, "usage: zopt-bench-offload-pipeline OFFLOAD.so [--params N] [--tensors T] [--steps K] "
                         "[--threads P] [--backward-ms B] [--forward-ms F] [--bucket E] [--param-wait M]\n");
    return 2;
  }
  OffloadOpts opt;
  double Bms = 0;  // 0: the serial step's own time (a backward as long as the step)
  double Ed = 0, Fms = 0, Mw = 2;  // F 0: half the backward; M: 0 default mode, 1 per bucket, 2 both
  if (!parse_opts(argc, argv, 2, opt,
                  {{"--backward-ms", &Bms}, {"--forward-ms", &Fms}, {"--bucket", &Ed}, {"--param-wait", &Mw}}))
    return 2;
  if (Mw != 0 && Mw != 1 && Mw != 2) {
    std::fprintf(stderr, "zopt-bench-offload-pipeline: --param-wait %g: 0 (default mode), 1 (per bucket), 2 (both)\n",
                 Mw);
    return 2;
  }
  const long long N = opt.params, E = (long long)Ed;
  const int T = opt.tensors, K = opt.steps, P = opt.threads;
  zopt_step *so = nullptr;
  Z(zopt_step_load(argv[1], &so));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(so);
  const StepShape shape(d);
  const uint32_t pdt = shape.pdt, gdt = shape.gdt;
  const double host_state = shape.host_state;
  RunDevice dev;
  std::string why;
  if (!dev.open(&why)) {
    std::fprintf(stderr, "zopt-bench-offload-pipeline: %s\n", why.c_str());
    return 3;
  }
  zopt_optimizer *o[2] = {nullptr, nullptr};  // serial, pipelined
  int g[2];
  for (int i = 0; i < 2; ++i) {
    Z(zopt_optimizer_create(so, &o[i]));
    if (P > 0) Z(zopt_optimizer_set_num_threads(o[i], P));
    if (E > 0) Z(zopt_optimizer_set_bucket_elems(o[i], E));
    Z(zopt_optimizer_add_group(o[i], &g[i]));
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<long long> numel(T);
  for (int t = 0; t < T; ++t) {
    long long n = numel[t] = N / T + (t < N % T ? 1 : 0);
    std::vector<unsigned char> hp((size_t)n * dsize(pdt)), hg((size_t)n * dsize(gdt));
    for (long long i = 0; i < n; ++i) {
      store_as(normal(rng) * 0.05f, pdt, &hp[(size_t)i * dsize(pdt)]);
      store_as(normal(rng) * 1e-3f, gdt, &hg[(size_t)i * dsize(gdt)]);
    }
    for (int i = 0; i < 2; ++i) {
      void *dp = dev.upload(hp.data(), hp.size(), &why), *dg = dp ? dev.upload(hg.data(), hg.size(), &why) : nullptr;
      if (!dg) {
        std::fprintf(stderr, "zopt-bench-offload-pipeline: %s\n", why.c_str());
        return 1;
      }
      int id;
      Z(zopt_optimizer_add_tensor(o[i], g[i], dp, dg, n, (zopt_dtype)pdt, &id));
    }
  }
  for (int i = 0; i < 2; ++i) Z(zopt_optimizer_finalize(o[i]));
  int nb = 0;
  Z(zopt_optimizer_num_buckets(o[1], &nb));
  std::printf("offloaded step %s: %.2f B/param of optimizer state on the host; %lld params in %d tensors, %d "
              "buckets, %d steps per case; device memory of %s\n",
              d->name, host_state, N, T, nb, K, dev.driver().c_str());
  if (Bms <= 0) {  // a backward as long as one serial step
    Z(zopt_optimizer_step(o[0], nullptr));  // warm-up (first touch)
    for (int b = 0; b < nb; ++b) Z(zopt_optimizer_grad_bucket_ready(o[1], b));
    Z(zopt_optimizer_step(o[1], nullptr));
    double t0 = now();
    Z(zopt_optimizer_step(o[0], nullptr));
    Bms = (now() - t0) * 1e3;
    for (int b = 0; b < nb; ++b) Z(zopt_optimizer_grad_bucket_ready(o[1], b));
    Z(zopt_optimizer_step(o[1], nullptr));
  }
  const double B = Bms * 1e-3;
  if (Fms <= 0) Fms = Bms / 2;
  const double F = Fms * 1e-3;
  void *fs = dev.new_stream(&why);  // the forward's stream (per-bucket mode)
  if (!fs) {
    std::fprintf(stderr, "zopt-bench-offload-pipeline: %s\n", why.c_str());
    return 1;
  }
  // The simulated forward after optimizer i's step: per bucket in forward
  // order its params waited for, then F / nb of compute; the host seconds
  // spent waiting.
  auto forward = [&](zopt_optimizer *x, int mode) {
    double waited = 0;
    for (int b = nb - 1; b >= 0; --b) {
      const double t0 = now();
      if (mode == ZOPT_PARAM_WAIT_PER_BUCKET) {
        Z(zopt_optimizer_wait_params(x, b, fs));
        if (int r = dev.sync(fs)) std::fprintf(stderr, "cuStreamSynchronize: CUDA error %d\n", r);
      } else if (b == nb - 1) {  // the optimizer's stream waits for every copy back
        if (int r = dev.sync(nullptr)) std::fprintf(stderr, "cuStreamSynchronize: CUDA error %d\n", r);
      }
      waited += now() - t0;
      sleep_s(F / nb);
    }
    return waited;
  };
  bool clip = (d->flags & ZOPT_FLAG_CLIP) != 0;
  const char *mname[] = {"default mode: the optimizer's stream waits for every copy back",
                         "per bucket: the forward waits for each bucket's params (zopt_optimizer_wait_params)"};
  for (int mode = Mw == 1 ? 1 : 0; mode <= (Mw == 0 ? 0 : 1); ++mode) {
    Z(zopt_optimizer_set_param_wait(o[1], mode));
    std::printf("simulated backward: %.1f ms per step (%.2f ms per bucket), forward %.1f ms (%.2f ms per bucket); "
                "pipelined params waited for: %s\n",
                Bms, Bms / nb, Fms, Fms / nb, mname[mode]);
    for (int active = 0; active < (clip ? 2 : 1); ++active) {
      for (int i = 0; i < 2; ++i) Z(zopt_optimizer_set_max_norm(o[i], active ? 1e-3 : 1e9));
      std::vector<double> ser, pip, over, sexp, pexp, pwait, left;
      zopt_pipeline_stats ps{};
      const char *oc[] = {"none", "commit", "recompute", "discard"};
      for (int k = 0; k <= K; ++k) {  // k = 0: warm-up, not counted
        sleep_s(B);
        double t0 = now();
        Z(zopt_optimizer_step(o[0], nullptr));
        double t1 = now();
        const double ws = forward(o[0], ZOPT_PARAM_WAIT_ALL);
        const double t1b = now();
        for (int b = 0; b < nb; ++b) {
          sleep_s(B / nb);
          Z(zopt_optimizer_grad_bucket_ready(o[1], b));
        }
        double t2 = now();
        Z(zopt_optimizer_step(o[1], nullptr));
        double t3 = now();
        const double wp = forward(o[1], mode);
        ps.size = sizeof ps;
        const double t4 = now();
        Z(zopt_optimizer_get_pipeline_stats(o[1], &ps));  // after the forward: joins a tail
        const double jp = now() - t4;  // the tail still running after the forward
        // Every step: the backward the CPU work hid behind, what stayed
        // exposed, the outcome. (No GPU/CPU split of the buckets is built:
        // every bucket updates on the CPU, GPU fraction 0.)
        std::printf("  %sstep %d: backward %.1f ms, CPU work overlapped %.1f ms, exposed %.1f ms (serial %.1f ms), "
                    "%s: %d of %d buckets speculated, %d committed, %d recomputed, %d late; %d copies in flight at the "
                    "end of backward; GPU fraction 0; forward waited %.1f ms (serial %.1f ms): exposed with the "
                    "forward's waits %.1f ms (serial %.1f ms); tail left after the forward %.1f ms\n",
                    k ? "" : "warm-up ", k, (t2 - t1b) * 1e3, ps.overlapped_seconds * 1e3, (t3 - t2) * 1e3,
                    (t1 - t0) * 1e3, oc[ps.outcome & 3], ps.speculated, ps.buckets, ps.committed, ps.recomputed,
                    ps.late, ps.copies_in_flight, wp * 1e3, ws * 1e3, (t3 - t2 + wp) * 1e3, (t1 - t0 + ws) * 1e3,
                    jp * 1e3);
        if (!k) continue;
        ser.push_back(t1 - t0);
        pip.push_back(t3 - t2);
        over.push_back(ps.overlapped_seconds);
        sexp.push_back(t1 - t0 + ws);
        pexp.push_back(t3 - t2 + wp);
        pwait.push_back(wp);
        left.push_back(jp);
      }
      const double s = median(ser), p = median(pip), se = median(sexp), pe = median(pexp);
      std::printf("clipping %s: serial step %.1f ms; pipelined step after backward %.1f ms (%.2f of serial); outcome "
                  "%s (%d of %d buckets speculated, %d recomputed); CPU work overlapped with backward %.1f ms; "
                  "with the forward's waits: serial %.1f ms, pipelined %.1f ms (step() %.1f + waits %.1f; %.2f of "
                  "serial); tail left after the forward %.1f ms [%s]\n",
                  active ? "active" : "inactive", s * 1e3, p * 1e3, p / s, oc[ps.outcome & 3], ps.speculated,
                  ps.buckets, ps.recomputed, median(over) * 1e3, se * 1e3, pe * 1e3, p * 1e3, median(pwait) * 1e3,
                  pe / se, median(left) * 1e3, mode ? "per bucket" : "default mode");
    }
  }
  bool same = true;
  for (int t = 0; t < T && same; ++t) {
    std::vector<unsigned char> x((size_t)numel[t] * dsize(pdt)), y(x.size());
    Z(zopt_optimizer_read_state_raw(o[0], t, ZOPT_STATE_PARAM, x.data(), x.size()));
    Z(zopt_optimizer_read_state_raw(o[1], t, ZOPT_STATE_PARAM, y.data(), y.size()));
    same = x == y;
  }
  std::printf("params of the pipelined and the serial optimizer bit-identical: %s\n", same ? "yes" : "NO");
  for (int i = 0; i < 2; ++i) zopt_optimizer_free(o[i]);
  zopt_step_free(so);
  return same ? 0 : 1;
}

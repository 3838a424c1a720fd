//===- gpu-check.cpp - a GPU step against the same step on the CPU ---------===//
//
// zopt-gpu-check GPU_STEP.so CPU_STEP.so [--steps=N] [--inf-at=K] [--seed=S]
//                [--graph] [--lr-schedule] [--max-norm-schedule]
//                [--misaligned] [--chunk=N] [--tensors=T --numel=N] [--rebind]
//
// Runs the GPU step (device memory via the CUDA driver API, dlopen'ed here)
// and the same description compiled for the CPU on identical random data
// (many tensors of odd sizes, two groups with different lr) through the
// public C API, and compares every state after every step:
//   * f32 states: |gpu - cpu| <= 8 ulp(max(|gpu|,|cpu|)) + 1e-30
//   * bf16/f16 states: storage values within 1 ULP (bit patterns differ by
//     at most 1 with the same sign), as in zopt-kernel-check.
//   * grad_norm (zopt_optimizer_gpu_result) vs the CPU's: relative 1e-9.
// --inf-at=K puts +inf into one grad element before step K (1-based): with
// loss scaling both must skip (no state change, scale backs off).
// --graph: step 1 runs normally; step 2 is captured into a CUDA graph on a
//   capture stream C, and steps 2.. replay the graph on ANOTHER stream R
//   while the optimizer's stream stays C (as after torch.cuda.graph): every
//   read (gpu_result, get_loss_scale, read_state, checkpoints) must wait for
//   the replays by itself (issue 11, item 1).
// --lr-schedule: before every step k >= 2 the lr of both groups changes
//   (lr * 0.8^(k-1)), on both optimizers; with --graph between replays: the
//   replays must use it (item 2).
// --max-norm-schedule: before every step k >= 2 the clip threshold changes
//   (zopt_optimizer_set_max_norm: the compiled max_norm * 0.5^(k-1)), on
//   both optimizers; the GPU kernels read it from the device (with --graph
//   between replays: the replays must use it).
// --misaligned: the GPU tensors are views at odd element offsets into one
//   flat param and one flat grad buffer (DeepSpeed/FSDP), each in its own
//   dtype (an f32 grad buffer beside bf16 params: the views of tensor t
//   start at the same element offset of both); a second GPU optimizer over
//   aligned copies of the same data must give the same bits in every state
//   and param (item 6).
// --chunk=N: the GPU optimizer's work list uses chunks of N elements
//   (ZOPT_GPU_CHUNK); a second GPU optimizer with the default chunking
//   must give the same bits in every state and param (item 5).
// --tensors=T --numel=N: T tensors of N elements instead of the odd sizes.
// --rebind: before every GPU step from the second on, each tensor's grad
//   moves to freshly allocated device memory holding the same values
//   (zopt_optimizer_set_grad_memory, as a framework's new gradient tensors
//   read in place), and the memory it left is overwritten with NaN: a step
//   that read it would differ from the CPU twin (issue 20).
// --exact: every stored bit of every state must equal the CPU's (the q8
//   kernels' contract, docs/GPU.md "q8 moments on the GPU"), after
//   finalize, every step and the checkpoint loads; without it the
//   tolerances above.
// Checkpoints cross between the two: after the checkpoint check, the GPU
// optimizer loads the CPU's checkpoint and the CPU optimizer the GPU's;
// every state then holds the other's bits, and one more step on both
// compares as the steps do.
// The grad has its own dtype: the param's, or f32 for a bf16/f16 param
// (DeepSpeed's default bf16 layout, gradients accumulated in f32); every
// grad buffer, view and copy uses it.
// Prints the CUDA driver's version and the toolkit version the step was
// built with. Exit 0 and a final "N passed, 0 failed" line when everything
// matches; 77 (lit/ctest "skip") when no CUDA device is present; a watchdog
// fails the run after 10 minutes (a hang in a replay would be a bug).
//===----------------------------------------------------------------------===//
#include "zopt/zopt.h"
#include "../check_util.h"
#include "../cuda_test_driver.h"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
using zopt_check::CUdeviceptr;
zopt_check::TestCuda cu;

using zopt_check::check;
using zopt_check::failed;
using zopt_check::passed;

size_t esize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : dt == ZOPT_DTYPE_Q8 ? 1 : 2; }
float f32_ulp(float x) {
  x = std::fabs(x);
  return std::nextafter(x, INFINITY) - x;
}
// CPU vs GPU element: f32 within 8 ULP, bf16/f16 within 1 ULP.
bool close_enough(uint32_t dt, const unsigned char *a, const unsigned char *b) {
  if (dt == ZOPT_DTYPE_F32) {
    float x, y;
    memcpy(&x, a, 4);
    memcpy(&y, b, 4);
    return (std::isnan(x) && std::isnan(y)) || std::fabs(x - y) <= 8 * f32_ulp(std::fmax(std::fabs(x), std::fabs(y))) + 1e-30f;
  }
  if (dt == ZOPT_DTYPE_Q8) return *a == *b;  // q8 codes: offloaded, the CPU kernels on both sides
  uint16_t x, y;
  memcpy(&x, a, 2);
  memcpy(&y, b, 2);
  // A remainder master's low half (abi.h): a master 8 f32 ulps off moves it
  // by up to 8 modulo 2^16 (the param takes the carry).
  if (dt == ZOPT_DTYPE_I16) return std::abs((int)(int16_t)(uint16_t)(x - y)) <= 8;
  // Sign-magnitude to an ordered integer: adjacent values differ by 1.
  auto ord = [](uint16_t u) { return (u >> 15) ? -(int)(u & 0x7fff) : (int)(u & 0x7fff); };
  return std::abs(ord(x) - ord(y)) <= 1;
}

void watchdog(int) {
  const char msg[] = "FAIL watchdog: no progress for 10 minutes (a replay or a read that never returns)\n";
  if (write(1, msg, sizeof msg - 1) < 0) {}
  _exit(1);
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: zopt-gpu-check GPU_STEP.so CPU_STEP.so [--steps=N] [--inf-at=K] [--seed=S] [--graph] "
                    "[--lr-schedule] [--max-norm-schedule] [--misaligned] [--chunk=N] [--tensors=T --numel=N] "
                    "[--rebind] [--exact]\n");
    return 2;
  }
  int steps = 3, inf_at = 0;
  bool graph = false, lr_schedule = false, max_norm_schedule = false, misaligned = false, rebind = false,
       exact = false;
  long long chunk = 0, ntensors = 0, numel = 0;
  unsigned seed = 1;
  for (int i = 3; i < argc; ++i) {
    if (!strncmp(argv[i], "--steps=", 8)) steps = atoi(argv[i] + 8);
    else if (!strncmp(argv[i], "--inf-at=", 9)) inf_at = atoi(argv[i] + 9);
    else if (!strncmp(argv[i], "--seed=", 7)) seed = (unsigned)atoi(argv[i] + 7);
    else if (!strcmp(argv[i], "--graph")) graph = true;
    else if (!strcmp(argv[i], "--lr-schedule")) lr_schedule = true;
    else if (!strcmp(argv[i], "--max-norm-schedule")) max_norm_schedule = true;
    else if (!strcmp(argv[i], "--misaligned")) misaligned = true;
    else if (!strncmp(argv[i], "--chunk=", 8)) chunk = atoll(argv[i] + 8);
    else if (!strncmp(argv[i], "--tensors=", 10)) ntensors = atoll(argv[i] + 10);
    else if (!strncmp(argv[i], "--numel=", 8)) numel = atoll(argv[i] + 8);
    else if (!strcmp(argv[i], "--rebind")) rebind = true;
    else if (!strcmp(argv[i], "--exact")) exact = true;
    else return fprintf(stderr, "unknown option %s\n", argv[i]), 2;
  }
  if (rebind && (graph || misaligned))
    return fprintf(stderr, "--rebind moves each tensor's own grad buffer: not with --graph or --misaligned\n"), 2;
  signal(SIGALRM, watchdog);
  alarm(600);
  // ZOPT_CUDA_DRIVER (as the runtime reads it) lets the control flow run
  // against the stand-in driver (its kernels do nothing: the comparisons
  // then fail); without it, the real driver.
  const int ndev = cu.load();
  if (ndev < 1) {
    printf("SKIP no CUDA device\n");
    return 77;
  }
  int dev = 0, drv = 0;
  void *ctx = nullptr;
  C(cu.DeviceGet(&dev, 0));
  C(cu.DevicePrimaryCtxRetain(&ctx, dev));
  C(cu.CtxSetCurrent(ctx));
  if (cu.DriverGetVersion) cu.DriverGetVersion(&drv);
  char dev_name[256] = "?";
  if (cu.DeviceGetName) cu.DeviceGetName(dev_name, sizeof dev_name, dev);

  zopt_step *sg = nullptr, *sc = nullptr;
  Z(zopt_step_load(argv[1], &sg));
  Z(zopt_step_load(argv[2], &sc));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(sg);
  {
    // The toolkit each image was built with (abi.h: <image>_cuda_version).
    std::string tk;
    void *so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    for (uint32_t i = 0; so && i < d->num_kernels; ++i)
      if (d->kernels[i].device == ZOPT_PLACE_GPU && d->kernels[i].role == ZOPT_KERNEL_GPU_IMAGE) {
        std::string sym = std::string(d->kernels[i].symbol) + "_cuda_version";
        const uint32_t *v = (const uint32_t *)dlsym(so, sym.c_str());
        tk += " sm_" + std::to_string(d->kernels[i].isa) + ":" +
              (v ? std::to_string(*v / 1000) + "." + std::to_string(*v % 1000 / 10) : std::string("unknown"));
      }
    printf("INFO device %s; CUDA driver %d.%d (cuDriverGetVersion %d); step built by CUDA toolkit%s\n", dev_name,
           drv / 1000, drv % 1000 / 10, drv, tk.empty() ? " (no GPU image: offloaded step)" : tk.c_str());
  }
  const bool ls = d->flags & ZOPT_FLAG_LOSS_SCALE;
  bool offload = true;  // no GPU kernels: params/grads on the GPU, update on the CPU
  for (uint32_t i = 0; i < d->num_kernels; ++i) offload &= d->kernels[i].device != ZOPT_PLACE_GPU;
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  auto dname = [](uint32_t dt) {
    return dt == ZOPT_DTYPE_F32 ? "f32" : dt == ZOPT_DTYPE_BF16 ? "bf16" : dt == ZOPT_DTYPE_I16 ? "i16" : "f16";
  };
  printf("INFO param %s, grad %s%s\n", dname(pdt), dname(gdt), gdt != pdt ? " (gradients accumulated in f32)" : "");
  // og: the GPU step under test; oc: its CPU twin; o2: a second GPU
  // optimizer (aligned tensors / default chunking) that og must match bit
  // for bit (--misaligned, --chunk).
  const bool twin_gpu = (misaligned || chunk) && !offload;
  zopt_optimizer *og = nullptr, *oc = nullptr, *o2 = nullptr;
  Z(zopt_optimizer_create(sg, &og));
  Z(zopt_optimizer_create(sc, &oc));
  if (twin_gpu) Z(zopt_optimizer_create(sg, &o2));

  // Many tensors of odd sizes in two groups.
  std::vector<int64_t> sizes = {1, 3, 7, 15, 17, 31, 33, 100, 255, 257, 1000, 4097, 65537, 100003, 1000003};
  if (ntensors > 0 && numel > 0) sizes.assign((size_t)ntensors, numel);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct T { int64_t n; std::vector<unsigned char> p, g; CUdeviceptr dp, dg, dp2, dg2; int id; };
  std::vector<T> ts;
  int gid[2];
  const double base_lr[2] = {1e-3, 3e-3};
  for (int k = 0; k < 2; ++k) {
    Z(zopt_optimizer_add_group(og, &gid[k]));
    Z(zopt_optimizer_add_group(oc, &gid[k]));
    Z(zopt_optimizer_set_hyper(og, gid[k], "lr", base_lr[k]));
    Z(zopt_optimizer_set_hyper(oc, gid[k], "lr", base_lr[k]));
    if (o2) {
      Z(zopt_optimizer_add_group(o2, &gid[k]));
      Z(zopt_optimizer_set_hyper(o2, gid[k], "lr", base_lr[k]));
    }
  }
  auto randv = [&](int64_t n, float scale) {
    std::vector<float> f(n);
    for (auto &x : f) x = nd(rng) * scale;
    return f;
  };
  // --misaligned: one flat buffer each for params and grads; tensor t
  // starts at an odd element offset (the same for param and grad).
  CUdeviceptr flat_p = 0, flat_g = 0;
  int64_t off = 1;
  if (misaligned) {
    int64_t total = 1;
    for (int64_t n : sizes) total += n + 1;
    C(cu.MemAlloc(&flat_p, (size_t)total * esize(pdt)));
    C(cu.MemAlloc(&flat_g, (size_t)total * esize(gdt)));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    T t;
    t.n = sizes[i];
    t.p.resize(t.n * esize(pdt));
    t.g.resize(t.n * esize(gdt));
    t.dp2 = t.dg2 = 0;
    if (misaligned) {
      t.dp = flat_p + (CUdeviceptr)off * esize(pdt);
      t.dg = flat_g + (CUdeviceptr)off * esize(gdt);
      off += t.n + 1;
    } else {
      C(cu.MemAlloc(&t.dp, t.p.size()));
      C(cu.MemAlloc(&t.dg, t.g.size()));
    }
    int idc = 0, id2 = 0;
    Z(zopt_optimizer_add_tensor(oc, gid[i % 2], t.p.data(), t.g.data(), t.n, (zopt_dtype)pdt, &idc));
    Z(zopt_optimizer_add_tensor(og, gid[i % 2], (void *)(uintptr_t)t.dp, (void *)(uintptr_t)t.dg, t.n,
                                (zopt_dtype)pdt, &t.id));
    if (o2) {
      C(cu.MemAlloc(&t.dp2, t.p.size()));
      C(cu.MemAlloc(&t.dg2, t.g.size()));
      Z(zopt_optimizer_add_tensor(o2, gid[i % 2], (void *)(uintptr_t)t.dp2, (void *)(uintptr_t)t.dg2, t.n,
                                  (zopt_dtype)pdt, &id2));
    }
    // Random param/grad values in the storage dtype (via the CPU optimizer's
    // f32 writer), copied bit for bit to the device.
    std::vector<float> pv = randv(t.n, 1.f), gv = randv(t.n, ls ? 1024.f * 1e-3f : 1e-2f);
    Z(zopt_optimizer_write_state_f32(oc, idc, ZOPT_STATE_PARAM, pv.data(), t.n));
    Z(zopt_optimizer_write_state_f32(oc, idc, ZOPT_STATE_GRAD, gv.data(), t.n));
    C(cu.MemcpyHtoD(t.dp, t.p.data(), t.p.size()));
    C(cu.MemcpyHtoD(t.dg, t.g.data(), t.g.size()));
    if (o2) {
      C(cu.MemcpyHtoD(t.dp2, t.p.data(), t.p.size()));
      C(cu.MemcpyHtoD(t.dg2, t.g.data(), t.g.size()));
    }
    ts.push_back(std::move(t));
  }
  if (ls) {
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 2, 1.0, 1};
    Z(zopt_optimizer_configure_loss_scaler(og, &c));
    Z(zopt_optimizer_configure_loss_scaler(oc, &c));
    if (o2) Z(zopt_optimizer_configure_loss_scaler(o2, &c));
  }
  if (chunk) {
    setenv("ZOPT_GPU_CHUNK", std::to_string(chunk).c_str(), 1);
    printf("INFO the GPU optimizer's work list uses chunks of %lld elements\n", chunk);
  }
  Z(zopt_optimizer_finalize(og));
  unsetenv("ZOPT_GPU_CHUNK");
  Z(zopt_optimizer_finalize(oc));
  if (o2) Z(zopt_optimizer_finalize(o2));

  // Every owned state (and the param) of every tensor, raw; elements of a
  // and b that do not compare (bit for bit with --exact).
  auto raw = [&](zopt_optimizer *o) {
    std::vector<std::vector<unsigned char>> out;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      const uint32_t kind = d->states[k].kind;
      if (kind == ZOPT_STATE_GRAD) continue;
      for (const T &t : ts) {
        const int64_t ne = (d->states[k].flags & ZOPT_STATE_PER_BLOCK) ? (t.n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : t.n;
        out.emplace_back((size_t)ne * esize(d->states[k].dtype));
        Z(zopt_optimizer_read_state_raw(o, t.id, (zopt_state_kind)kind, out.back().data(), out.back().size()));
      }
    }
    return out;
  };
  auto differing = [&](const std::vector<std::vector<unsigned char>> &a,
                       const std::vector<std::vector<unsigned char>> &b, bool bits) {
    int64_t bad = 0;
    size_t i = 0;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      if (d->states[k].kind == ZOPT_STATE_GRAD) continue;
      const size_t es = esize(d->states[k].dtype);
      for (size_t j = 0; j < ts.size(); ++j, ++i)
        for (size_t e = 0; e < a[i].size(); e += es)
          bad += bits ? memcmp(&a[i][e], &b[i][e], es) != 0 : !close_enough(d->states[k].dtype, &a[i][e], &b[i][e]);
    }
    return bad;
  };
  if (exact)
    check(differing(raw(oc), raw(og), true) == 0,
          "after finalize: every state of every tensor bit-identical to the CPU's (INIT, zero codes)");

  void *cstream = nullptr, *rstream = nullptr, *exec = nullptr;
  for (int step = 1; step <= steps; ++step) {
    if (step == inf_at) {
      T &t = ts[ts.size() / 2];
      float inf = INFINITY;
      std::vector<float> gv(t.n);
      Z(zopt_optimizer_read_state_f32(oc, t.id, ZOPT_STATE_GRAD, gv.data(), t.n));
      gv[t.n / 2] = inf;
      Z(zopt_optimizer_write_state_f32(oc, t.id, ZOPT_STATE_GRAD, gv.data(), t.n));
      Z(zopt_optimizer_write_state_f32(og, t.id, ZOPT_STATE_GRAD, gv.data(), t.n));
      if (o2) Z(zopt_optimizer_write_state_f32(o2, t.id, ZOPT_STATE_GRAD, gv.data(), t.n));
    }
    if (lr_schedule && step >= 2)
      for (int k = 0; k < 2; ++k) {
        const double lr = base_lr[k] * std::pow(0.8, step - 1);
        Z(zopt_optimizer_set_hyper(og, gid[k], "lr", lr));  // between replays with --graph
        Z(zopt_optimizer_set_hyper(oc, gid[k], "lr", lr));
        if (o2) Z(zopt_optimizer_set_hyper(o2, gid[k], "lr", lr));
      }
    if (max_norm_schedule && step >= 2) {
      const double m = zopt_step_get_descriptor(sg)->max_norm * std::pow(0.5, step - 1);
      Z(zopt_optimizer_set_max_norm(og, m));  // between replays with --graph
      Z(zopt_optimizer_set_max_norm(oc, m));
      if (o2) Z(zopt_optimizer_set_max_norm(o2, m));
      printf("INFO step %d: max_norm %g\n", step, m);
    }
    if (rebind && step >= 2) {
      // Every grad to new device memory with the same values (the CPU
      // twin's grad bytes), the memory it left overwritten with NaN.
      std::vector<int32_t> ids;
      std::vector<void *> grads;
      for (T &t : ts) {
        CUdeviceptr nb = 0;
        C(cu.MemAlloc(&nb, t.g.size()));
        C(cu.MemcpyHtoD(nb, t.g.data(), t.g.size()));
        ids.push_back(t.id);
        grads.push_back((void *)(uintptr_t)nb);
      }
      Z(zopt_optimizer_set_grad_memory(og, (int64_t)ids.size(), ids.data(), grads.data()));
      for (size_t i = 0; i < ts.size(); ++i) {
        std::vector<unsigned char> nan(ts[i].g.size(), 0xff);
        C(cu.CtxSynchronize());  // the last step no longer reads it
        C(cu.MemcpyHtoD(ts[i].dg, nan.data(), nan.size()));
        C(cu.MemFree(ts[i].dg));
        ts[i].dg = (CUdeviceptr)(uintptr_t)grads[i];
      }
      printf("INFO step %d: %zu grads moved to new device memory (set_grad_memory)\n", step, ts.size());
    }
    zopt_step_result rc{}, rg{}, rg2{};
    Z(zopt_optimizer_step(oc, &rc));
    if (o2) Z(zopt_optimizer_step(o2, nullptr));
    if (graph && step >= 2 && !offload) {
      // Capture zopt_optimizer_step once (step 2) on stream C, then replay
      // the graph on stream R; the optimizer is never told about R.
      if (!exec) {
        C(cu.StreamCreate(&cstream, 1 /* non-blocking */));
        C(cu.StreamCreate(&rstream, 1));
        Z(zopt_optimizer_set_stream(og, cstream));
        C(cu.StreamBeginCapture(cstream, 0 /* global */));
        zopt_status st = zopt_optimizer_step(og, &rg);
        void *g = nullptr;
        int ec = cu.StreamEndCapture(cstream, &g);
        if (st != ZOPT_OK || ec) {
          printf("FAIL step %d: capture: zopt_optimizer_step = %d (%s), cuStreamEndCapture = %d\n", step, (int)st,
                 zopt_last_error(), ec);
          return 1;
        }
        C(cu.GraphInstantiate(&exec, g, 0));
        printf("PASS step %d: zopt_optimizer_step captured into a CUDA graph on stream C\n", step);
        ++passed;
      }
      C(cu.GraphLaunch(exec, rstream));  // no synchronisation: the reads below must wait
      rg.grad_norm = NAN;
      rg.skipped = 0;
    } else {
      Z(zopt_optimizer_step(og, &rg));
    }
    // GPU steps leave their result on the device; offloaded steps (CPU
    // kernels) return it from step().
    if (offload) rg2 = rg;
    else Z(zopt_optimizer_gpu_result(og, &rg2));
    char buf[256];
    snprintf(buf, sizeof buf, "step %d skipped cpu=%d gpu=%d%s", step, rc.skipped, rg2.skipped,
             graph && step >= 2 ? " (graph replay on stream R)" : "");
    check(rc.skipped == rg2.skipped && (offload || (std::isnan(rg.grad_norm) && rg.skipped == 0)), buf);
    if (d->flags & ZOPT_FLAG_SUMSQ) {
      double a = rc.grad_norm, b = rg2.grad_norm;
      bool ok = (std::isfinite(a) && std::fabs(a - b) <= 1e-9 * std::fabs(a)) || (!std::isfinite(a) && !std::isfinite(b));
      snprintf(buf, sizeof buf, "step %d grad_norm cpu=%.17g gpu=%.17g", step, a, b);
      check(ok, buf);
    }
    double sc1 = 0, sc2 = 0;
    Z(zopt_optimizer_get_loss_scale(oc, &sc1));
    Z(zopt_optimizer_get_loss_scale(og, &sc2));
    snprintf(buf, sizeof buf, "step %d loss scale cpu=%g gpu=%g", step, sc1, sc2);
    check(sc1 == sc2, buf);
    for (uint32_t k = 0; k < d->num_states; ++k) {
      const uint32_t kind = d->states[k].kind, dt = d->states[k].dtype;
      if (kind == ZOPT_STATE_GRAD) continue;
      int64_t bad = 0, worst = -1, diff2 = 0;
      for (const T &t : ts) {
        // A PER_BLOCK state (a q8 absmax): one element per ZOPT_Q8_BLOCK.
        const int64_t ne = (d->states[k].flags & ZOPT_STATE_PER_BLOCK) ? (t.n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : t.n;
        std::vector<unsigned char> a(ne * esize(dt)), b(ne * esize(dt)), c2;
        Z(zopt_optimizer_read_state_raw(oc, t.id, (zopt_state_kind)kind, a.data(), a.size()));
        Z(zopt_optimizer_read_state_raw(og, t.id, (zopt_state_kind)kind, b.data(), b.size()));
        for (int64_t i = 0; i < ne; ++i) {
          bool ok = exact ? !memcmp(&a[i * esize(dt)], &b[i * esize(dt)], esize(dt))
                          : close_enough(dt, &a[i * esize(dt)], &b[i * esize(dt)]);
          if (!ok && bad++ == 0) worst = i;
        }
        if (bad && worst >= 0) {
          printf("INFO first mismatch: tensor %d element %lld\n", t.id, (long long)worst);
          worst = -2;
        }
        if (o2) {
          c2.resize(b.size());
          Z(zopt_optimizer_read_state_raw(o2, t.id, (zopt_state_kind)kind, c2.data(), c2.size()));
          for (int64_t i = 0; i < ne; ++i)
            diff2 += memcmp(&b[i * esize(dt)], &c2[i * esize(dt)], esize(dt)) != 0;
        }
      }
      snprintf(buf, sizeof buf, "step %d state %u (kind %u, %s)%s mismatches=%lld", step, k, kind,
               dt == ZOPT_DTYPE_F32 ? "f32" : dt == ZOPT_DTYPE_BF16 ? "bf16" : dt == ZOPT_DTYPE_I16 ? "i16" : dt == ZOPT_DTYPE_Q8 ? "q8" : "f16",
               exact ? " bit for bit" : "", (long long)bad);
      check(bad == 0, buf);
      if (o2) {
        snprintf(buf, sizeof buf, "step %d state %u (kind %u): %s GPU optimizer bit-identical, differing=%lld", step,
                 k, kind, misaligned ? "misaligned views vs the aligned" : "chunks vs the default-chunked",
                 (long long)diff2);
        check(diff2 == 0, buf);
      }
    }
  }
  int64_t c1 = 0, c2 = 0;
  Z(zopt_optimizer_get_step_count(oc, 0, &c1));
  Z(zopt_optimizer_get_step_count(og, 0, &c2));
  check(c1 == c2, "step counts cpu=" + std::to_string(c1) + " gpu=" + std::to_string(c2));

  // Checkpoint of the GPU step: save, take one more step on both, load the
  // GPU one back, step again: it must match the CPU optimizer loaded from
  // its own checkpoint (same step counts, scaler, states). With --graph the
  // extra step is a replay on R, and save/load must wait for it.
  std::string ckg = std::string(argv[1]) + ".ckpt", ckc = std::string(argv[2]) + ".ckpt";
  Z(zopt_optimizer_save(og, ckg.c_str()));
  Z(zopt_optimizer_save(oc, ckc.c_str()));
  if (exec) C(cu.GraphLaunch(exec, rstream));
  else Z(zopt_optimizer_step(og, nullptr));
  Z(zopt_optimizer_step(oc, nullptr));
  Z(zopt_optimizer_load(og, ckg.c_str()));
  Z(zopt_optimizer_load(oc, ckc.c_str()));
  Z(zopt_optimizer_get_step_count(oc, 0, &c1));
  Z(zopt_optimizer_get_step_count(og, 0, &c2));
  check(c1 == c2, "after checkpoint load: step counts cpu=" + std::to_string(c1) + " gpu=" +
                                  std::to_string(c2));
  int64_t bad = 0;
  for (uint32_t k = 0; k < d->num_states; ++k) {
    const uint32_t kind = d->states[k].kind, dt = d->states[k].dtype;
    if (kind == ZOPT_STATE_PARAM || kind == ZOPT_STATE_GRAD) continue;
    for (const T &t : ts) {
      const int64_t ne = (d->states[k].flags & ZOPT_STATE_PER_BLOCK) ? (t.n + ZOPT_Q8_BLOCK - 1) / ZOPT_Q8_BLOCK : t.n;
      std::vector<unsigned char> a(ne * esize(dt)), b(ne * esize(dt));
      Z(zopt_optimizer_read_state_raw(oc, t.id, (zopt_state_kind)kind, a.data(), a.size()));
      Z(zopt_optimizer_read_state_raw(og, t.id, (zopt_state_kind)kind, b.data(), b.size()));
      for (int64_t i = 0; i < ne; ++i)
        bad += exact ? memcmp(&a[i * esize(dt)], &b[i * esize(dt)], esize(dt)) != 0
                     : !close_enough(dt, &a[i * esize(dt)], &b[i * esize(dt)]);
    }
  }
  check(bad == 0, std::string("after checkpoint load: owned states match the CPU's") + (exact ? " bit for bit" : "") +
                      ", mismatches=" + std::to_string(bad));
  // Across: the GPU optimizer loads the CPU's checkpoint, the CPU optimizer
  // the GPU's: each then holds the other's bits; one more step compares.
  {
    const auto from_g = raw(og), from_c = raw(oc);
    Z(zopt_optimizer_load(og, ckc.c_str()));
    Z(zopt_optimizer_load(oc, ckg.c_str()));
    check(differing(raw(og), from_c, true) == 0 && differing(raw(oc), from_g, true) == 0,
          "checkpoints across: the GPU step loads the CPU's and the CPU step the GPU's, every state bit for bit");
    Z(zopt_optimizer_step(og, nullptr));
    Z(zopt_optimizer_step(oc, nullptr));
    const int64_t nb = differing(raw(oc), raw(og), exact);
    check(nb == 0, std::string("checkpoints across: a step after them: every state matches") +
                       (exact ? " bit for bit" : "") + ", mismatches=" + std::to_string(nb));
  }
  remove(ckg.c_str());
  remove(ckc.c_str());
  zopt_optimizer_free(og);
  zopt_optimizer_free(oc);
  if (o2) zopt_optimizer_free(o2);
  zopt_step_free(sg);
  zopt_step_free(sc);
  // The device memory of the test (freed at exit anyway on a device; the
  // stand-in's is heap memory, which LeakSanitizer checks).
  for (const T &t : ts) {
    if (!misaligned) {
      C(cu.MemFree(t.dp));
      C(cu.MemFree(t.dg));
    }
    if (t.dp2) C(cu.MemFree(t.dp2));
    if (t.dg2) C(cu.MemFree(t.dg2));
  }
  if (flat_p) C(cu.MemFree(flat_p));
  if (flat_g) C(cu.MemFree(flat_g));
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

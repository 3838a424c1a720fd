//===- nccl-check.cpp - the nccl communicator at world size 1 --------------===//
//
// zopt-nccl-check [GPU_STEP.so] [--big]
//
// The `nccl` communicator (runtime/src/comm/nccl.cpp) at W = 1 with whatever
// libnccl.so.2 ($ZOPT_NCCL_LIB) and CUDA driver ($ZOPT_CUDA_DRIVER) are
// there: the real ones on a GPU machine (bench/gpu/run_gpu_bench.sh), the
// stand-ins here (test/Integration/GPUHost/nccl-w1.test). One process, one
// device, so no "Duplicate GPU" refusal:
//   * init: zopt_comm_nccl_unique_id + zopt_comm_create_nccl(rank 0 of 1) on
//     a stream of our own; name, rank, size, DEVICE memory;
//   * all_to_all, all_gather and the in-place all_gather on random bytes of
//     several sizes (0 bytes included; --big adds 256 MiB), with the
//     signature checks on and off, each awaited with zopt_comm_synchronize:
//     recv must equal send byte for byte (poisoned before);
//   * barrier; the collective count;
//   * with GPU_STEP.so (a GPU step, e.g. ZeRO-2): one optimizer given the
//     communicator and one without, on identical random params and grads,
//     3 steps: world (0, 1), every state and param bit-identical, the same
//     step counts and grad norms.
// Prints the NCCL version (ncclGetVersion) and the driver's. With
// $ZOPT_CUDA_DRIVER (a stand-in, whose kernels do not run) the step counts
// are not checked, and the stand-in NCCL needs FAKE_NCCL_MAILBOX_BYTES above
// the largest size (64 MiB; 256 MiB with --big). Exit 0 with a
// final "N passed, 0 failed" line; 1 on a failure; 77 without a device.
//===----------------------------------------------------------------------===//
#include "zopt/comm.h"
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

void watchdog(int) {
  const char msg[] = "FAIL watchdog: no progress for 120 s (a collective that never completes)\n";
  if (write(1, msg, sizeof msg - 1) < 0) {}
  _exit(1);
}

CUdeviceptr dalloc(size_t n) {
  CUdeviceptr p = 0;
  C(cu.MemAlloc(&p, n ? n : 1));
  return p;
}

std::vector<unsigned char> random_bytes(std::mt19937 &rng, size_t n) {
  std::vector<unsigned char> v(n);
  for (auto &b : v) b = (unsigned char)(rng() & 0xff);
  return v;
}

size_t esize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : 2; }

// The collectives at W = 1 on `n` bytes: recv == send for all_to_all and
// all_gather, and the in-place all_gather leaves its buffer as it was.
void collectives(zopt_comm *comm, std::mt19937 &rng, size_t n, bool checks) {
  const std::string tag = std::to_string(n) + " bytes, checks " + (checks ? "on" : "off");
  std::vector<unsigned char> src = random_bytes(rng, n), got(n);
  CUdeviceptr s = dalloc(n), r = dalloc(n);
  if (n) C(cu.MemcpyHtoD(s, src.data(), n));
  auto round = [&](const char *what, zopt_status st, CUdeviceptr out) {
    zopt_status sy = st == ZOPT_OK ? zopt_comm_synchronize(comm) : st;
    bool same = true;
    if (sy == ZOPT_OK && n) {
      C(cu.MemcpyDtoH(got.data(), out, n));
      same = memcmp(got.data(), src.data(), n) == 0;
    }
    check(st == ZOPT_OK && sy == ZOPT_OK && same,
          std::string(what) + " " + tag + (st || sy ? std::string(": ") + zopt_last_error() : ""));
  };
  std::vector<unsigned char> poison(n, 0xA5);  // recv is overwritten, not left as it was
  if (n) C(cu.MemcpyHtoD(r, poison.data(), n));
  round("all_to_all", zopt_comm_all_to_all(comm, (void *)(uintptr_t)s, (void *)(uintptr_t)r, n), r);
  if (n) C(cu.MemcpyHtoD(r, poison.data(), n));
  round("all_gather", zopt_comm_all_gather(comm, (void *)(uintptr_t)s, (void *)(uintptr_t)r, n), r);
  // In place (send == recv + rank * n): the buffer keeps the rank's bytes.
  if (n) C(cu.MemcpyHtoD(r, src.data(), n));
  round("in-place all_gather", zopt_comm_all_gather(comm, (void *)(uintptr_t)r, (void *)(uintptr_t)r, n), r);
  C(cu.MemFree(s));
  C(cu.MemFree(r));
}

// A GPU step with the communicator (W = 1) against one without: the same
// bits everywhere after every step.
void step_with_comm(const char *path, zopt_comm *comm, void *stream, std::mt19937 &rng, bool stand_in) {
  zopt_step *st = nullptr;
  Z(zopt_step_load(path, &st));
  const zopt_step_descriptor *d = zopt_step_get_descriptor(st);
  printf("INFO step %s: ZeRO stage %u\n", d->name, (unsigned)d->zero_stage);
  uint32_t pdt = 0, gdt = 0;
  for (uint32_t i = 0; i < d->num_states; ++i) {
    if (d->states[i].kind == ZOPT_STATE_PARAM) pdt = d->states[i].dtype;
    if (d->states[i].kind == ZOPT_STATE_GRAD) gdt = d->states[i].dtype;
  }
  zopt_optimizer *oa = nullptr, *ob = nullptr;
  Z(zopt_optimizer_create(st, &oa));
  Z(zopt_optimizer_create(st, &ob));
  zopt_status sc = zopt_optimizer_set_comm(oa, comm);
  check(sc == ZOPT_OK, std::string("a GPU step takes the nccl communicator") +
                           (sc ? std::string(": ") + zopt_last_error() : ""));
  if (sc) return;
  Z(zopt_optimizer_set_stream(oa, stream));
  Z(zopt_optimizer_set_stream(ob, stream));
  const std::vector<int64_t> sizes = {1, 17, 1000, 4097, 65537, 300007};
  std::normal_distribution<float> nd(0.f, 1.f);
  struct T { int64_t n; CUdeviceptr pa, ga, pb, gb; int ia, ib; };
  std::vector<T> ts;
  int ga = 0, gb = 0;
  Z(zopt_optimizer_add_group(oa, &ga));
  Z(zopt_optimizer_add_group(ob, &gb));
  Z(zopt_optimizer_set_hyper(oa, ga, "lr", 1e-3));
  Z(zopt_optimizer_set_hyper(ob, gb, "lr", 1e-3));
  for (int64_t n : sizes) {
    T t{n, dalloc(n * esize(pdt)), dalloc(n * esize(gdt)), dalloc(n * esize(pdt)), dalloc(n * esize(gdt)), 0, 0};
    Z(zopt_optimizer_add_tensor(oa, ga, (void *)(uintptr_t)t.pa, (void *)(uintptr_t)t.ga, n, (zopt_dtype)pdt, &t.ia));
    Z(zopt_optimizer_add_tensor(ob, gb, (void *)(uintptr_t)t.pb, (void *)(uintptr_t)t.gb, n, (zopt_dtype)pdt, &t.ib));
    ts.push_back(t);
  }
  zopt_status fa = zopt_optimizer_finalize(oa);
  check(fa == ZOPT_OK, std::string("finalize with the communicator") + (fa ? std::string(": ") + zopt_last_error() : ""));
  if (fa) return;
  Z(zopt_optimizer_finalize(ob));
  int rank = -1, world = -1;
  Z(zopt_optimizer_get_world(oa, &rank, &world));
  check(rank == 0 && world == 1, "world (" + std::to_string(rank) + ", " + std::to_string(world) + ")");
  auto fill = [&](int t, zopt_state_kind kind, float scale) {
    std::vector<float> v(ts[t].n);
    for (auto &x : v) x = nd(rng) * scale;
    Z(zopt_optimizer_write_state_f32(oa, ts[t].ia, kind, v.data(), ts[t].n));
    Z(zopt_optimizer_write_state_f32(ob, ts[t].ib, kind, v.data(), ts[t].n));
  };
  bool master = false;
  for (uint32_t i = 0; i < d->num_states; ++i) master |= d->states[i].kind == ZOPT_STATE_MASTER;
  for (size_t t = 0; t < ts.size(); ++t) fill((int)t, ZOPT_STATE_PARAM, 1.f);
  if (master) {
    Z(zopt_optimizer_refresh_master(oa, 0, (int)ts.size()));
    Z(zopt_optimizer_refresh_master(ob, 0, (int)ts.size()));
  }
  for (int step = 1; step <= 3; ++step) {
    for (size_t t = 0; t < ts.size(); ++t) fill((int)t, ZOPT_STATE_GRAD, 1e-2f);
    zopt_step_result ra{}, rb{};
    Z(zopt_optimizer_step(oa, nullptr));
    Z(zopt_optimizer_step(ob, nullptr));
    Z(zopt_optimizer_gpu_result(oa, &ra));
    Z(zopt_optimizer_gpu_result(ob, &rb));
    long long differ = 0;
    for (uint32_t k = 0; k < d->num_states; ++k) {
      if (d->states[k].kind == ZOPT_STATE_GRAD) continue;
      for (const T &t : ts) {
        size_t bytes = (size_t)t.n * esize(d->states[k].dtype);
        std::vector<unsigned char> a(bytes), b(bytes);
        Z(zopt_optimizer_read_state_raw(oa, t.ia, (zopt_state_kind)d->states[k].kind, a.data(), bytes));
        Z(zopt_optimizer_read_state_raw(ob, t.ib, (zopt_state_kind)d->states[k].kind, b.data(), bytes));
        differ += memcmp(a.data(), b.data(), bytes) != 0;
      }
    }
    int64_t ca = -1, cb = -2;
    Z(zopt_optimizer_get_step_count(oa, 0, &ca));
    Z(zopt_optimizer_get_step_count(ob, 0, &cb));
    const bool norms = (std::isnan(ra.grad_norm) && std::isnan(rb.grad_norm)) || ra.grad_norm == rb.grad_norm;
    // The stand-in driver's kernels do not run (FINISH counts nothing).
    const bool counted = stand_in || ca == step;
    check(differ == 0 && ca == cb && counted && norms && ra.skipped == rb.skipped,
          "step " + std::to_string(step) + " with the nccl communicator bit-identical to none (tensors differing: " +
              std::to_string(differ) + ", counts " + std::to_string(ca) + "/" + std::to_string(cb) + ")");
  }
  zopt_optimizer_free(oa);
  zopt_optimizer_free(ob);
  for (T &t : ts) {
    C(cu.MemFree(t.pa));
    C(cu.MemFree(t.ga));
    C(cu.MemFree(t.pb));
    C(cu.MemFree(t.gb));
  }
  zopt_step_free(st);
}
}  // namespace

int main(int argc, char **argv) {
  const char *step_path = nullptr;
  bool big = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--big")) big = true;
    else if (argv[i][0] == '-') return fprintf(stderr, "usage: zopt-nccl-check [GPU_STEP.so] [--big]\n"), 2;
    else step_path = argv[i];
  }
  signal(SIGALRM, watchdog);
  alarm(120);
  const char *nccl = getenv("ZOPT_NCCL_LIB");
  nccl = nccl && *nccl ? nccl : "libnccl.so.2";
  if (void *hn = dlopen(nccl, RTLD_NOW | RTLD_LOCAL)) {
    int v = 0;
    auto get_version = (int (*)(int *))dlsym(hn, "ncclGetVersion");
    if (get_version && get_version(&v) == 0)
      printf("INFO NCCL %s: version %d.%d.%d (ncclGetVersion %d)\n", nccl, v / 10000, v / 100 % 100, v % 100, v);
    else
      printf("INFO NCCL %s: no version\n", nccl);
  } else {
    printf("INFO NCCL %s does not load: %s\n", nccl, dlerror());
  }
  const char *lib = getenv("ZOPT_CUDA_DRIVER");  // a stand-in: its kernels do not run
  const int ndev = cu.load();
  if (ndev < 1) {
    printf("SKIP no CUDA device\n");
    return 77;
  }
  int dev = 0, drv = 0;
  void *ctx = nullptr, *stream = nullptr;
  C(cu.DeviceGet(&dev, 0));
  C(cu.DevicePrimaryCtxRetain(&ctx, dev));
  C(cu.CtxSetCurrent(ctx));
  if (cu.DriverGetVersion) cu.DriverGetVersion(&drv);
  printf("INFO CUDA driver %d.%d (%d)\n", drv / 1000, drv % 1000 / 10, drv);
  C(cu.StreamCreate(&stream, 1 /* non-blocking */));

  unsigned char id[ZOPT_NCCL_UNIQUE_ID_BYTES];
  zopt_status su = zopt_comm_nccl_unique_id(id);
  check(su == ZOPT_OK, std::string("ncclGetUniqueId") + (su ? std::string(": ") + zopt_last_error() : ""));
  zopt_comm *comm = nullptr;
  zopt_status sc = su ? su : zopt_comm_create_nccl(id, 0, 1, stream, &comm);
  check(sc == ZOPT_OK, std::string("zopt_comm_create_nccl(rank 0 of 1)") + (sc ? std::string(": ") + zopt_last_error() : ""));
  if (sc != ZOPT_OK) {
    printf("%d passed, %d failed\n", zopt_check::passed, zopt_check::failed);
    return 1;
  }
  check(!strcmp(zopt_comm_name(comm), "nccl") && zopt_comm_rank(comm) == 0 && zopt_comm_size(comm) == 1 &&
            zopt_comm_memory(comm) == ZOPT_COMM_MEM_DEVICE,
        std::string("communicator '") + zopt_comm_name(comm) + "' rank " + std::to_string(zopt_comm_rank(comm)) +
            " of " + std::to_string(zopt_comm_size(comm)) + ", device memory");
  Z(zopt_comm_set_timeout(comm, 60.0));
  std::mt19937 rng(7);
  std::vector<size_t> sizes = {0, 1, 7, 96, 4096, (1u << 20) + 3, 64u << 20};
  if (big) sizes.push_back(256u << 20);
  for (int checks = 1; checks >= 0; --checks) {
    Z(zopt_comm_set_checks(comm, checks));
    for (size_t n : sizes) collectives(comm, rng, n, checks);
  }
  zopt_status sb = zopt_comm_barrier(comm);
  if (sb == ZOPT_OK) sb = zopt_comm_synchronize(comm);
  check(sb == ZOPT_OK, std::string("barrier") + (sb ? std::string(": ") + zopt_last_error() : ""));
  printf("INFO %llu collectives\n", (unsigned long long)zopt_comm_count(comm));
  if (step_path) step_with_comm(step_path, comm, stream, rng, lib && *lib);
  zopt_comm_free(comm);
  check(true, "communicator freed");
  printf("%d passed, %d failed\n", zopt_check::passed, zopt_check::failed);
  return zopt_check::failed ? 1 : 0;
}

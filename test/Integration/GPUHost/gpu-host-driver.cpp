//===- gpu-host-driver.cpp - the driver and devices ----------------------===//
//
// Driver versions, launch errors and images the runtime refuses; several
// devices and the caller's contexts.
//===----------------------------------------------------------------------===//
#include "gpu-host-check.h"

namespace ghc {

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

}  // namespace ghc

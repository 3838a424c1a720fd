//===- twin_util.h - a step against its CPU twin: the shared setup ---------===//
//
// What zopt-backend-conformance (conformance.cpp) and zopt-linked-gpu-check
// (linked-gpu.cpp) share: the CUDA driver (device 0's primary context),
// param and grad memory on the host or from the driver, an optimizer of a
// step over some of the four tensors (two groups, params written through
// the API), the counts, and the distance of two stored values in units of
// the last place.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_INTEGRATION_BACKEND_TWIN_UTIL_H
#define ZOPT_TEST_INTEGRATION_BACKEND_TWIN_UTIL_H

#include "../check_util.h"
#include "../cuda_test_driver.h"
#include "zopt/abi.h"
#include "zopt/zopt.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace twin {

// The four tensors (groups 0 1 0 1).
inline const int64_t kSizes[4] = {33, 1000, 4099, 7};

// The driver, device 0's primary context pushed on this thread.
inline zopt_check::TestCuda g_cu;
inline bool load_driver() {
  int dev = 0;
  void *ctx = nullptr;
  return g_cu.load() > 0 && g_cu.DeviceGet && g_cu.DevicePrimaryCtxRetain && g_cu.CtxPushCurrent && g_cu.MemAlloc &&
         g_cu.MemFree && g_cu.DeviceGet(&dev, 0) == 0 && g_cu.DevicePrimaryCtxRetain(&ctx, dev) == 0 &&
         g_cu.CtxPushCurrent(ctx) == 0;
}

// Every buffer alloc() made, with where it lives: freed by free_all().
inline std::vector<std::pair<void *, bool>> g_allocs;

// Zeroed host memory, or the driver's (`device`).
inline void *alloc(size_t bytes, bool device) {
  bytes = std::max<size_t>(bytes, 16);
  if (!device) {
    void *p = calloc(1, bytes);
    g_allocs.emplace_back(p, false);
    return p;
  }
  unsigned long long p = 0;
  C(g_cu.MemAlloc(&p, bytes));
  g_allocs.emplace_back((void *)(uintptr_t)p, true);
  return (void *)(uintptr_t)p;
}

// After the optimizers that used them are freed.
inline void free_all() {
  for (auto &[p, device] : g_allocs)
    if (device)
      g_cu.MemFree((unsigned long long)(uintptr_t)p);
    else
      free(p);
  g_allocs.clear();
}

inline size_t dsize(uint32_t dt) { return dt == ZOPT_DTYPE_F32 ? 4 : dt == ZOPT_DTYPE_Q8 ? 1 : 2; }

inline int state_of(const zopt_step_descriptor *d, uint32_t kind) {
  for (uint32_t i = 0; i < d->num_states; ++i)
    if (d->states[i].kind == kind) return (int)i;
  return -1;
}

// A stored value (`es` bytes: an f32, a 16-bit float, a q8 code) as an
// integer in the values' order: two values' difference is their distance
// in units of the last place.
inline int64_t ordered(int64_t w, size_t es) {
  if (es == 1) return w;  // a q8 code: itself
  const int64_t sign = es == 4 ? 0x80000000ll : 0x8000ll;
  return (w & sign) ? -(w & (sign - 1)) : w;
}

// An optimizer over some of the four tensors (`ids`, in order), two groups.
struct Opt {
  zopt_step *step = nullptr;
  zopt_optimizer *o = nullptr;
  const zopt_step_descriptor *d = nullptr;
  std::vector<int> ids;
  zopt_step_result last{};  // the last step's result (conformance)
  int local(int t) const {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == t) return (int)i;
    return -1;
  }
};

// Step `path` over tensors `ids`, params and grads on the host or the
// device, params[t] written through the API; lr 1e-3 and 3e-3 per group
// (where the rule has one), the loss scaler's growth interval 2; finalized.
inline Opt make(const char *path, bool device, const std::vector<int> &ids,
                const std::vector<std::vector<float>> &params) {
  Opt x;
  x.ids = ids;
  Z(zopt_step_load(path, &x.step));
  x.d = zopt_step_get_descriptor(x.step);
  Z(zopt_optimizer_create(x.step, &x.o));
  Z(zopt_optimizer_set_num_threads(x.o, 2));
  int g[2];
  for (int k = 0; k < 2; ++k) {
    Z(zopt_optimizer_add_group(x.o, &g[k]));
    double v;
    if (zopt_optimizer_get_hyper(x.o, g[k], "lr", &v) == ZOPT_OK)
      Z(zopt_optimizer_set_hyper(x.o, g[k], "lr", k ? 3e-3 : 1e-3));
  }
  const uint32_t pdt = x.d->states[state_of(x.d, ZOPT_STATE_PARAM)].dtype;
  const uint32_t gdt = x.d->states[state_of(x.d, ZOPT_STATE_GRAD)].dtype;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int t = ids[i];
    int id = 0;
    Z(zopt_optimizer_add_tensor(x.o, g[t % 2], alloc((size_t)kSizes[t] * dsize(pdt), device),
                                alloc((size_t)kSizes[t] * dsize(gdt), device), kSizes[t], (zopt_dtype)pdt, &id));
    Z(zopt_optimizer_write_state_f32(x.o, id, ZOPT_STATE_PARAM, params[t].data(), kSizes[t]));
  }
  if (x.d->flags & ZOPT_FLAG_LOSS_SCALE) {
    zopt_loss_scaler_config c = {1024.0, 2.0, 0.5, 2, 1.0, 1};
    Z(zopt_optimizer_configure_loss_scaler(x.o, &c));
  }
  Z(zopt_optimizer_finalize(x.o));
  return x;
}

inline void release(Opt &x) {
  zopt_optimizer_free(x.o);
  zopt_step_free(x.step);
}

// Each tensor's count, then each group's: "2 2 2 2 | 2 2".
inline std::string counts(const Opt &x) {
  std::string s;
  for (int t : x.ids) {
    int64_t c = -1;
    Z(zopt_optimizer_get_tensor_step(x.o, x.local(t), &c));
    s += std::to_string(c) + " ";
  }
  int64_t a = -1, b = -1;
  Z(zopt_optimizer_get_step_count(x.o, 0, &a));
  Z(zopt_optimizer_get_step_count(x.o, 1, &b));
  return s + "| " + std::to_string(a) + " " + std::to_string(b);
}

}  // namespace twin

#endif

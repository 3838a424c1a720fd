// backend/cuda/device.cpp - what the CUDA backends share (device.h): the
// driver, contexts, events and streams of an optimizer on a device.
#include "backend/cuda/device.h"

#include <cstdarg>
#include <cstdio>
#include <string>

using namespace zopt;
using namespace zopt::cu;

namespace {

const char *attr_name(int a) {
  return a == ATTR_CC_MAJOR ? "COMPUTE_CAPABILITY_MAJOR" : a == ATTR_CC_MINOR ? "COMPUTE_CAPABILITY_MINOR"
                                                                               : "MULTIPROCESSOR_COUNT";
}

}  // namespace

namespace zopt {

// ---- contexts, events, streams ---------------------------------------------

CtxScope::CtxScope(const GpuState *g) : g_(g) {
  CUcontext cur = nullptr;
  if (g->cu->CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == g->ctx) return;
  if (CUresult r = g->cu->CtxPushCurrent(g->ctx)) {
    st_ = fail(ZOPT_ERR_INTERNAL, "cuCtxPushCurrent (the optimizer's context): %s", error_string(r));
    return;
  }
  pushed_ = true;
}

CtxScope::~CtxScope() {
  if (!pushed_) return;
  CUcontext popped = nullptr;
  g_->cu->CtxPopCurrent(&popped);
}

zopt_status cuda_attach(GpuState *g, const char *name, const char *what) {
  const char *why = "";
  const Driver *cu = driver(&why);
  if (!cu) return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' %s: %s", name, what, why);
  g->cu = cu;
  if (CUresult r = cu->DriverGetVersion(&g->driver_version))
    return fail(ZOPT_ERR_INTERNAL, "cuDriverGetVersion: %s", error_string(r));
  CUcontext cur = nullptr;
  if (cu->CtxGetCurrent(&cur) == CUDA_SUCCESS && cur) {
    g->ctx = cur;
    if (CUresult r = cu->CtxGetDevice(&g->dev)) return fail(ZOPT_ERR_INTERNAL, "cuCtxGetDevice: %s", error_string(r));
  } else {
    int n = 0;
    if (cu->DeviceGetCount(&n) != CUDA_SUCCESS || n < 1)
      return fail(ZOPT_ERR_UNSUPPORTED, "step '%s' %s: no CUDA device", name, what);
    if (CUresult r = cu->DeviceGet(&g->dev, 0)) return fail(ZOPT_ERR_INTERNAL, "cuDeviceGet: %s", error_string(r));
    if (CUresult r = cu->DevicePrimaryCtxRetain(&g->ctx, g->dev))
      return fail(ZOPT_ERR_INTERNAL, "cuDevicePrimaryCtxRetain: %s", error_string(r));
    g->retained = true;
  }
  int v[3] = {0, 0, 0};
  const int attrs[3] = {ATTR_CC_MAJOR, ATTR_CC_MINOR, ATTR_MULTIPROCESSOR_COUNT};
  for (int i = 0; i < 3; ++i) {
    CUresult r = cu->DeviceGetAttribute(&v[i], attrs[i], g->dev);
    if (r != CUDA_SUCCESS || v[i] < (i == 1 ? 0 : 1)) {
      zopt_status st = fail(ZOPT_ERR_INTERNAL, "step '%s': cuDeviceGetAttribute(%s) of cuda:%d: %s", name,
                            attr_name(attrs[i]), (int)g->dev,
                            r != CUDA_SUCCESS ? error_string(r) : ("value " + std::to_string(v[i])).c_str());
      cuda_detach(g);
      return st;
    }
  }
  g->sm = v[0] * 10 + v[1];
  g->num_sms = v[2];
  return ZOPT_OK;
}

void cuda_detach(GpuState *g) {
  if (g->retained) g->cu->DevicePrimaryCtxRelease(g->dev);
  g->retained = false;
}

zopt_status gpu_events(GpuState *g) {
  for (CUevent *e : {&g->done, &g->hypers_ready, &g->staging})
    if (!*e)
      if (CUresult r = g->cu->EventCreate(e, EVENT_DISABLE_TIMING))
        return fail(ZOPT_ERR_INTERNAL, "cuEventCreate: %s", error_string(r));
  return ZOPT_OK;
}

void destroy_events(GpuState *g) {
  for (int k = 0; k < 2; ++k)
    if (g->ptrs_pinned[k]) {
      g->cu->MemFreeHost(g->ptrs_pinned[k]);
      g->ptrs_pinned[k] = nullptr;
    }
  for (CUevent *e : {&g->done, &g->hypers_ready, &g->staging, &g->ptrs_copied[0], &g->ptrs_copied[1]})
    if (*e) {
      g->cu->EventDestroy(*e);
      *e = nullptr;
    }
}

zopt_status gpu_check_pointers(const GpuState *g, void *param, void *grad, int tensor, const char *fn) {
  // Inside an allocation found in this call (a framework's gradients share
  // a few of its caching allocator's segments): nothing to ask the driver.
  auto known = [g](const void *p) {
    const uintptr_t a = (uintptr_t)p;
    for (auto it = g->checked.rbegin(); it != g->checked.rend(); ++it)
      if (a >= it->first && a < it->second) return true;
    return false;
  };
  if ((!param || known(param)) && known(grad)) return ZOPT_OK;
  ZOPT_CTX_SCOPE(g);
  for (int i = 0; i < 2; ++i) {
    void *p = i ? grad : param;
    const char *what = i ? "grad" : "param";
    if (!i && !p) continue;  // the param unchanged (check_tensor: NULL), checked when it was registered
    const uintptr_t a = (uintptr_t)p;
    if (known(p)) continue;
    unsigned type = 0;
    CUresult r = g->cu->PointerGetAttribute(&type, POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS || (type != MEMORYTYPE_DEVICE && type != MEMORYTYPE_UNIFIED))
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s: the %s of tensor %d (%p) is not CUDA device memory (the step's %ss "
                  "are on the GPU)",
                  fn, what, tensor, p, what);
    if (type != MEMORYTYPE_DEVICE) continue;  // managed memory: any device
    int dev = -1;
    r = g->cu->PointerGetAttribute(&dev, POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: the device of the %s of tensor %d (%p): %s", fn,
                  what, tensor, p, error_string(r));
    if (dev != (int)g->dev)
      return fail(ZOPT_ERR_INVALID_ARGUMENT,
                  "%s: the %s of tensor %d is on cuda:%d, but the optimizer runs on cuda:%d "
                  "(the context current at zopt_optimizer_create, else device 0): create the optimizer while "
                  "cuda:%d's context is current (PyTorch: inside `with torch.cuda.device(%d)`), with every tensor "
                  "on that device",
                  fn, what, tensor, dev, (int)g->dev, dev, dev);
    CUdeviceptr start = 0;
    size_t size = 0;
    if (g->checked.size() < 64 &&
        !g->cu->PointerGetAttribute(&start, POINTER_ATTRIBUTE_RANGE_START_ADDR, (CUdeviceptr)a) &&
        !g->cu->PointerGetAttribute(&size, POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)a) && size &&
        a >= (uintptr_t)start && a < (uintptr_t)start + size)
      g->checked.emplace_back((uintptr_t)start, (uintptr_t)start + size);
  }
  return ZOPT_OK;
}

zopt_status gpu_capturing(const GpuState *g, CUstream s, bool *capturing) {
  int status = STREAM_CAPTURE_STATUS_NONE;
  if (CUresult r = g->cu->StreamIsCapturing(s, &status))
    return fail(ZOPT_ERR_BAD_STATE,
                "cuStreamIsCapturing(%p): %s (the legacy default stream while another stream captures a CUDA "
                "graph? pass the capturing stream: zopt_optimizer_set_stream)",
                (void *)s, error_string(r));
  *capturing = status != STREAM_CAPTURE_STATUS_NONE;
  return ZOPT_OK;
}

zopt_status refuse_if_capturing(const GpuState *g, CUstream s, zopt_status code, const char *fmt, ...) {
  bool cap = false;
  if (zopt_status st = gpu_capturing(g, s, &cap)) return st;
  if (!cap) return ZOPT_OK;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return fail(code, "%s", msg);
}

zopt_status gpu_wait_own_work(GpuState *g, CUstream s) {
  const std::pair<CUevent, bool> evs[] = {
      {g->done, g->done_recorded}, {g->hypers_ready, g->hypers_recorded}, {g->staging, g->staging_recorded}};
  for (auto &e : evs)
    if (e.second) CU_TRY(g->cu->StreamWaitEvent(s, e.first, 0), "cuStreamWaitEvent (the optimizer's last work)");
  return ZOPT_OK;
}

zopt_status gpu_begin_host_access(GpuState *g, const char *what) {
  if (zopt_status st = refuse_if_capturing(
          g, g->stream, ZOPT_ERR_BAD_STATE,
          "%s: the optimizer's stream is capturing a CUDA graph, and this call copies device memory to or from the "
          "host and waits for it: call it outside the capture (e.g. after a replay)",
          what))
    return st;
  return gpu_wait_own_work(g, g->stream);
}

void gpu_sync_own_work(GpuState *g) {
  const std::pair<CUevent, bool> evs[] = {
      {g->done, g->done_recorded}, {g->hypers_ready, g->hypers_recorded}, {g->staging, g->staging_recorded}};
  for (auto &e : evs)
    if (e.second) g->cu->EventSynchronize(e.first);
}

zopt_status gpu_set_stream(GpuState *g, void *stream) {
  if ((CUstream)stream == g->stream) return ZOPT_OK;
  ZOPT_CTX_SCOPE(g);
  // The new stream starts after the optimizer's work on the old one (its
  // events: the old stream itself may be gone). A capturing stream cannot
  // wait for work outside its capture; the capture's caller orders it
  // (PyTorch synchronizes before capturing).
  bool cap = false;
  if (gpu_capturing(g, (CUstream)stream, &cap) == ZOPT_OK && !cap)
    if (zopt_status st = gpu_wait_own_work(g, (CUstream)stream)) return st;
  clear_error();
  g->stream = (CUstream)stream;
  return ZOPT_OK;
}

zopt_status gpu_state_create(const char *name, const char *what, zopt_status (*init)(GpuState *, const void *),
                             const void *arg, void (*undo)(GpuState *), GpuState **out) {
  GpuState *g = new (std::nothrow) GpuState;
  if (!g) return fail(ZOPT_ERR_OUT_OF_MEMORY, "out of memory");
  if (zopt_status st = cuda_attach(g, name, what)) {
    delete g;
    return st;
  }
  zopt_status st;
  {
    CtxScope scope(g);
    st = scope.status();
    if (!st) st = init(g, arg);
    if (st && !scope.status() && undo) undo(g);
  }
  if (st) {
    cuda_detach(g);
    delete g;
    return st;
  }
  *out = g;
  return ZOPT_OK;
}

}  // namespace zopt

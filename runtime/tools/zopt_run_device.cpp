//===- zopt_run_device.cpp - device memory for zopt-run (zopt_run_device.h) ===//
#include "zopt_run_device.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>

struct RunDevice::Fns {
  int (*Init)(unsigned);
  int (*DeviceGet)(int *, int);
  int (*PrimaryCtxRetain)(void **, int);
  int (*CtxSetCurrent)(void *);
  int (*MemAlloc)(unsigned long long *, size_t);
  int (*MemFree)(unsigned long long);
  int (*MemcpyHtoD)(unsigned long long, const void *, size_t);
  int (*StreamCreate)(void **, unsigned);
  int (*StreamDestroy)(void *);
  int (*StreamSynchronize)(void *);
};

RunDevice::~RunDevice() {
  if (f_) {
    for (void *s : streams_) f_->StreamDestroy(s);
    for (unsigned long long p : allocs_) f_->MemFree(p);
  }
  delete f_;
  // The library stays loaded: the runtime holds its own handle to it.
}

bool RunDevice::open(std::string *why) {
  const char *env = std::getenv("ZOPT_CUDA_DRIVER");
  name_ = env && *env ? env : "libcuda.so.1";
  lib_ = dlopen(name_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib_) {
    const char *e = dlerror();
    *why = "no CUDA driver (" + name_ + "): " + (e ? e : "dlopen failed");
    return false;
  }
  f_ = new Fns{};
  struct Sym {
    void **slot;
    const char *name;
  } syms[] = {{(void **)&f_->Init, "cuInit"},
              {(void **)&f_->DeviceGet, "cuDeviceGet"},
              {(void **)&f_->PrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
              {(void **)&f_->CtxSetCurrent, "cuCtxSetCurrent"},
              {(void **)&f_->MemAlloc, "cuMemAlloc_v2"},
              {(void **)&f_->MemFree, "cuMemFree_v2"},
              {(void **)&f_->MemcpyHtoD, "cuMemcpyHtoD_v2"},
              {(void **)&f_->StreamCreate, "cuStreamCreate"},
              {(void **)&f_->StreamDestroy, "cuStreamDestroy_v2"},
              {(void **)&f_->StreamSynchronize, "cuStreamSynchronize"}};
  for (const Sym &s : syms)
    if (!(*s.slot = dlsym(lib_, s.name))) {
      *why = "CUDA driver " + name_ + " lacks " + s.name;
      delete f_;
      f_ = nullptr;
      return false;
    }
  int dev = 0;
  void *ctx = nullptr;
  int r = f_->Init(0);
  if (!r) r = f_->DeviceGet(&dev, 0);
  if (!r) r = f_->PrimaryCtxRetain(&ctx, dev);
  if (!r) r = f_->CtxSetCurrent(ctx);
  if (r) {
    *why = "CUDA driver " + name_ + ": no usable device 0 (CUDA error " + std::to_string(r) + ")";
    delete f_;
    f_ = nullptr;
    return false;
  }
  return true;
}

void *RunDevice::upload(const void *host, size_t bytes, std::string *why) {
  unsigned long long p = 0;
  if (int r = f_->MemAlloc(&p, bytes ? bytes : 1)) {
    *why = "cuMemAlloc(" + std::to_string(bytes) + " bytes): CUDA error " + std::to_string(r);
    return nullptr;
  }
  allocs_.push_back(p);
  if (int r = f_->MemcpyHtoD(p, host, bytes)) {
    *why = "cuMemcpyHtoD(" + std::to_string(bytes) + " bytes): CUDA error " + std::to_string(r);
    return nullptr;
  }
  return (void *)(uintptr_t)p;
}

void *RunDevice::new_stream(std::string *why) {
  void *s = nullptr;
  if (int r = f_->StreamCreate(&s, 1)) {  // CU_STREAM_NON_BLOCKING
    *why = "cuStreamCreate: CUDA error " + std::to_string(r);
    return nullptr;
  }
  streams_.push_back(s);
  return s;
}

int RunDevice::sync(void *stream) { return f_->StreamSynchronize(stream); }

//===- cuda_test_driver.h - the CUDA driver as the test drivers use it ----===//
//
// Shared by zopt-gpu-check, zopt-nccl-check and zopt-backend-conformance:
// the driver API functions they call, one line each (an X-macro expanded
// into the table and its loader), loaded from $ZOPT_CUDA_DRIVER (as the
// runtime reads it: e.g. the stand-in of test/Integration/GPUHost) or
// libcuda.so.1; C() exits with the driver's error code when a call fails.
//===----------------------------------------------------------------------===//
#ifndef ZOPT_TEST_INTEGRATION_CUDA_TEST_DRIVER_H
#define ZOPT_TEST_INTEGRATION_CUDA_TEST_DRIVER_H

#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace zopt_check {

typedef unsigned long long CUdeviceptr;

// X(member, symbol, return type, parameters)
#define ZOPT_TEST_CUDA_FUNCTIONS(X)                                              \
  X(Init, "cuInit", int, (unsigned))                                             \
  X(DriverGetVersion, "cuDriverGetVersion", int, (int *))                        \
  X(DeviceGetCount, "cuDeviceGetCount", int, (int *))                            \
  X(DeviceGet, "cuDeviceGet", int, (int *, int))                                 \
  X(DeviceGetName, "cuDeviceGetName", int, (char *, int, int))                   \
  X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", int, (void **, int))     \
  X(CtxSetCurrent, "cuCtxSetCurrent", int, (void *))                             \
  X(CtxPushCurrent, "cuCtxPushCurrent_v2", int, (void *))                        \
  X(CtxSynchronize, "cuCtxSynchronize", int, ())                                 \
  X(MemAlloc, "cuMemAlloc_v2", int, (CUdeviceptr *, size_t))                     \
  X(MemFree, "cuMemFree_v2", int, (CUdeviceptr))                                 \
  X(MemcpyHtoD, "cuMemcpyHtoD_v2", int, (CUdeviceptr, const void *, size_t))     \
  X(MemcpyDtoH, "cuMemcpyDtoH_v2", int, (void *, CUdeviceptr, size_t))           \
  X(StreamCreate, "cuStreamCreate", int, (void **, unsigned))                    \
  X(StreamSynchronize, "cuStreamSynchronize", int, (void *))                     \
  X(StreamBeginCapture, "cuStreamBeginCapture_v2", int, (void *, int))           \
  X(StreamEndCapture, "cuStreamEndCapture", int, (void *, void **))              \
  X(GraphInstantiate, "cuGraphInstantiateWithFlags", int, (void **, void *, unsigned long long)) \
  X(GraphLaunch, "cuGraphLaunch", int, (void *, void *))

struct TestCuda {
#define ZOPT_TEST_CUDA_MEMBER(name, sym, ret, params) ret(*name) params = nullptr;
  ZOPT_TEST_CUDA_FUNCTIONS(ZOPT_TEST_CUDA_MEMBER)
#undef ZOPT_TEST_CUDA_MEMBER
  void *handle = nullptr;

  // The driver's functions (absent ones stay NULL) and cuInit; the number
  // of devices, 0 without a driver or a device.
  int load() {
    const char *lib = getenv("ZOPT_CUDA_DRIVER");
    handle = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle) return 0;
#define ZOPT_TEST_CUDA_LOAD(name, sym, ret, params) *(void **)&name = dlsym(handle, sym);
    ZOPT_TEST_CUDA_FUNCTIONS(ZOPT_TEST_CUDA_LOAD)
#undef ZOPT_TEST_CUDA_LOAD
    int n = 0;
    if (Init && DeviceGetCount && Init(0) == 0) DeviceGetCount(&n);
    return n;
  }
};

}  // namespace zopt_check

#define C(call)                                                  \
  do {                                                           \
    if (int r_ = (call)) {                                       \
      fprintf(stderr, "%s failed: CUDA error %d\n", #call, r_); \
      exit(1);                                                   \
    }                                                            \
  } while (0)

#endif

// cuda_driver.h - the CUDA driver API, loaded at run time (not installed).
//
// libzopt_runtime has no build or link dependency on CUDA: the few driver
// types are declared here (ABI-identical to <cuda.h> of CUDA 12/13) and the
// functions are resolved with dlopen("libcuda.so.1") + dlsym into one table,
// the first time a GPU step needs them. A machine without the driver gets a
// clear ZOPT_ERR_UNSUPPORTED from zopt_optimizer_create.
#ifndef ZOPT_RUNTIME_CUDA_DRIVER_H
#define ZOPT_RUNTIME_CUDA_DRIVER_H

#include <cstddef>
#include <cstdint>

namespace zopt::cu {

typedef int CUresult;  // CUDA_SUCCESS = 0
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;  // 64-bit: the *_v2 entry points
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

constexpr CUresult CUDA_SUCCESS = 0;
// CUdevice_attribute values used here.
constexpr int ATTR_MULTIPROCESSOR_COUNT = 16;
constexpr int ATTR_CC_MAJOR = 75;
constexpr int ATTR_CC_MINOR = 76;
// CUpointer_attribute / CUmemorytype values used here.
constexpr int POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr int POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
constexpr int POINTER_ATTRIBUTE_RANGE_START_ADDR = 11;  // the allocation holding the pointer
constexpr int POINTER_ATTRIBUTE_RANGE_SIZE = 12;
constexpr unsigned MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2, MEMORYTYPE_UNIFIED = 4;
// CUfunction_attribute: the largest block a launch of the function may use
// (its .reqntid / .maxntid when it declares one).
constexpr int FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
// CUevent flags (cuEventCreate), record and wait flags.
constexpr unsigned EVENT_DISABLE_TIMING = 2;
constexpr unsigned EVENT_RECORD_EXTERNAL = 1;  // in a capture: an event record node
constexpr unsigned EVENT_WAIT_EXTERNAL = 1;    // in a capture: an event wait node
// CUstream flags (cuStreamCreate): no implicit order with the legacy stream.
constexpr unsigned STREAM_NON_BLOCKING = 1;
// CUstreamCaptureStatus.
constexpr int STREAM_CAPTURE_STATUS_NONE = 0, STREAM_CAPTURE_STATUS_ACTIVE = 1,
              STREAM_CAPTURE_STATUS_INVALIDATED = 2;

// One entry per driver function: member name, exported symbol, signature.
#define ZOPT_CU_FUNCS(X)                                                                  \
  X(Init, "cuInit", CUresult (*)(unsigned))                                               \
  X(DriverGetVersion, "cuDriverGetVersion", CUresult (*)(int *))                          \
  X(DeviceGetCount, "cuDeviceGetCount", CUresult (*)(int *))                              \
  X(DeviceGet, "cuDeviceGet", CUresult (*)(CUdevice *, int))                              \
  X(DeviceGetAttribute, "cuDeviceGetAttribute", CUresult (*)(int *, int, CUdevice))       \
  X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", CUresult (*)(CUcontext *, CUdevice)) \
  X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", CUresult (*)(CUdevice))      \
  X(CtxGetCurrent, "cuCtxGetCurrent", CUresult (*)(CUcontext *))                          \
  X(CtxSetCurrent, "cuCtxSetCurrent", CUresult (*)(CUcontext))                            \
  X(CtxGetDevice, "cuCtxGetDevice", CUresult (*)(CUdevice *))                             \
  X(CtxPushCurrent, "cuCtxPushCurrent_v2", CUresult (*)(CUcontext))                       \
  X(CtxPopCurrent, "cuCtxPopCurrent_v2", CUresult (*)(CUcontext *))                       \
  X(FuncGetAttribute, "cuFuncGetAttribute", CUresult (*)(int *, int, CUfunction))         \
  X(OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor", \
    CUresult (*)(int *, CUfunction, int, size_t))                                         \
  X(ModuleLoadData, "cuModuleLoadData", CUresult (*)(CUmodule *, const void *))           \
  X(ModuleUnload, "cuModuleUnload", CUresult (*)(CUmodule))                               \
  X(ModuleGetFunction, "cuModuleGetFunction", CUresult (*)(CUfunction *, CUmodule, const char *)) \
  X(LaunchKernel, "cuLaunchKernel",                                                       \
    CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,  \
                 unsigned, CUstream, void **, void **))                                   \
  X(MemAlloc, "cuMemAlloc_v2", CUresult (*)(CUdeviceptr *, size_t))                       \
  X(MemFree, "cuMemFree_v2", CUresult (*)(CUdeviceptr))                                   \
  X(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                                              \
    CUresult (*)(CUdeviceptr, const void *, size_t, CUstream))                            \
  X(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2",                                              \
    CUresult (*)(void *, CUdeviceptr, size_t, CUstream))                                  \
  X(MemsetD8Async, "cuMemsetD8Async", CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream)) \
  X(MemsetD32Async, "cuMemsetD32Async", CUresult (*)(CUdeviceptr, unsigned, size_t, CUstream)) \
  X(StreamCreate, "cuStreamCreate", CUresult (*)(CUstream *, unsigned))                   \
  X(StreamDestroy, "cuStreamDestroy_v2", CUresult (*)(CUstream))                          \
  X(StreamSynchronize, "cuStreamSynchronize", CUresult (*)(CUstream))                     \
  X(StreamWaitEvent, "cuStreamWaitEvent", CUresult (*)(CUstream, CUevent, unsigned))      \
  X(StreamIsCapturing, "cuStreamIsCapturing", CUresult (*)(CUstream, int *))              \
  X(EventCreate, "cuEventCreate", CUresult (*)(CUevent *, unsigned))                      \
  X(EventDestroy, "cuEventDestroy_v2", CUresult (*)(CUevent))                             \
  X(EventRecordWithFlags, "cuEventRecordWithFlags", CUresult (*)(CUevent, CUstream, unsigned)) \
  X(EventSynchronize, "cuEventSynchronize", CUresult (*)(CUevent))                        \
  X(EventQuery, "cuEventQuery", CUresult (*)(CUevent))                                    \
  X(GetErrorString, "cuGetErrorString", CUresult (*)(CUresult, const char **))            \
  X(PointerGetAttribute, "cuPointerGetAttribute", CUresult (*)(void *, int, CUdeviceptr))   \
  X(MemHostAlloc, "cuMemHostAlloc", CUresult (*)(void **, size_t, unsigned))              \
  X(MemFreeHost, "cuMemFreeHost", CUresult (*)(void *))

// Entry points resolved when present (null otherwise): a driver without
// them still loads, and only the code that needs them refuses to run (the
// NCCL communicator, runtime/src/comm/nccl.cpp: cuStreamQuery) or skips a
// check (cuFuncGetParamInfo, CUDA 12.4+: the kernels' parameter lists).
#define ZOPT_CU_OPTIONAL_FUNCS(X)                           \
  X(StreamQuery, "cuStreamQuery", CUresult (*)(CUstream)) \
  X(FuncGetParamInfo, "cuFuncGetParamInfo", CUresult (*)(CUfunction, size_t, size_t *, size_t *))

constexpr CUresult CUDA_ERROR_NOT_READY = 600;  // cuStreamQuery: work still pending

struct Driver {
#define ZOPT_CU_MEMBER(name, sym, type) \
  using name##_fn = type;                \
  name##_fn name = nullptr;
  ZOPT_CU_FUNCS(ZOPT_CU_MEMBER)
  ZOPT_CU_OPTIONAL_FUNCS(ZOPT_CU_MEMBER)
#undef ZOPT_CU_MEMBER
};

// The driver table, loaded and cuInit'ed once per process (thread-safe).
// Returns nullptr when libcuda.so.1 is missing, lacks a symbol or cuInit
// fails; `why` (if non-null) then says which. ZOPT_CUDA_DRIVER overrides the
// library name (tests).
const Driver *driver(const char **why = nullptr);

// "CUDA_ERROR_... (code)" for a result.
const char *error_string(CUresult r);

}  // namespace zopt::cu

#endif

// gpu_internal.h - state shared by the CUDA backends of the runtime: GPU
// steps (gpu.cpp: states on the device, kernels from the step's images) and
// offloaded steps (offload.cpp: params/grads on the device, states and
// kernels on the CPU). Not installed.
#ifndef ZOPT_RUNTIME_GPU_INTERNAL_H
#define ZOPT_RUNTIME_GPU_INTERNAL_H

#include "cuda_driver.h"
#include "internal.h"

namespace zopt {

using cu::CUcontext;
using cu::CUdevice;
using cu::CUdeviceptr;
using cu::CUfunction;
using cu::CUmodule;
using cu::CUstream;
using cu::Driver;

struct GpuState {
  const Driver *cu = nullptr;
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  bool retained = false;  // we retained the device's primary context
  int sm = 0, num_sms = 1, image_sm = 0;
  CUmodule mod = nullptr;
  CUfunction prepare = nullptr, sumsq = nullptr, update = nullptr, finish = nullptr;
  CUstream stream = nullptr;  // 0: the legacy default stream
  std::vector<CUdeviceptr> allocs;
  CUdeviceptr d_states = 0, d_segs = 0, d_hypers = 0, d_globals = 0, d_coeffs = 0, d_partials = 0, d_sg = 0,
              d_scaler = 0;
  std::vector<double> h_hypers;  // staging of the hyperparameter table
  int64_t num_segments = 0;
  unsigned prepare_grid = 1, sumsq_grid = 1, update_grid = 1;
  bool stepped = false;
  // The running state (step counts, loss scaler) lives on the device once
  // finalized; `device_ahead` says the host copy in zopt_optimizer is stale
  // (steps ran since the last gpu_pull), `hypers_dirty` that the device's
  // hyperparameter table is.
  bool device_ahead = false;
  bool hypers_dirty = true;
  // Offloaded steps: the pinned host staging buffers of params and grads.
  std::vector<void *> pinned;
};


// The driver, a context (the caller's current one, e.g. PyTorch's, else
// device 0's primary context, retained) and the device's properties; `what`
// completes "step '<name>' <what>: no CUDA driver ..." messages.
zopt_status cuda_attach(GpuState *g, const char *name, const char *what);
void cuda_detach(GpuState *g);  // releases a retained primary context
zopt_status make_current(const GpuState *g);
// Both pointers are CUDA device (or managed) memory.
zopt_status gpu_check_pointers(const GpuState *g, void *param, void *grad);

}  // namespace zopt

#endif
